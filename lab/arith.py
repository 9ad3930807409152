"""
Fixed-width addition, the task of --suite all's contrast (TaH on addition, lab/ablations.py): its
hard digits need the carry chain over operands that never iterate, not a refinement at the digit.
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/arith.py is no script: run python train_tiny.py --suite tah-add", file=sys.stderr)
    sys.exit(2)

import torch


class Arith:
    """Fixed-width addition 'aaaa+bbbb=ccccc;' (zero-padded), answer digits most significant first,
    the only targets."""

    VOCAB = "0123456789+=;"

    def __init__(self, digits):
        self.digits = digits
        self.vocab_size = len(self.VOCAB)
        self.problem_len = 3 * digits + 4
        self.answers = digits + 1  # targets per problem

    def problem(self, a, b):
        n = self.digits
        return f"{a:0{n}d}+{b:0{n}d}={a + b:0{n + 1}d};"

    def encode(self, text):
        return [self.VOCAB.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.VOCAB[i] for i in ids)

    def batch(self, split, B, T, gen):
        k = T // self.problem_len + 1
        ops = torch.randint(10 ** self.digits, (B, k, 2), generator=gen).tolist()
        rows = torch.tensor([sum((self.encode(self.problem(a, b)) for a, b in r), []) for r in ops])
        x, y = rows[:, :T], rows[:, 1:T + 1].clone()
        # position p of a problem holds an answer digit iff 2n+2 <= p < 3n+3; y[t] = x[t+1]
        p = (torch.arange(1, T + 1) % self.problem_len)
        answer = (p >= 2 * self.digits + 2) & (p < 3 * self.digits + 3)
        y[:, ~answer] = -1
        return x, y

    def response(self, x):
        """The positions the oracle may mark hard (the authors' rule): inputs in the response, the answer
        digits and ';' ('=' predicts the first digit, and is never hard)."""
        p = torch.arange(x.size(1), device=x.device) % self.problem_len
        return (p >= 2 * self.digits + 2).expand_as(x)
