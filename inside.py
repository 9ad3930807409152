"""
Looking inside trained models: the probes the two papers use to explain *why* their methods help.

Hidden Decoding (arXiv 2607.08186, §5.2-5.3):
  - stream_cosine: how alike the n streams of one token are at every layer, against the same
    streams of different tokens (Fig. 6a);
  - stream_mass: how much attention a final-stream query gives each stream's keys (Fig. 6b);
  - head_probes: the shared LM head read off every stream; how often a stream's top-1 differs
    from the final stream's, and each stream's entropy (Fig. 7).
Think-at-Hard (arXiv 2511.08577, §5, Figs. 5 and 7):
  - iteration_outcomes: for the tokens that go on, their top-1 before and after the next pass;
  - recording_attention gives the duo-causal attention weights of a deeper query.

Each probe runs on a model as it is, without training; train_tiny.py runs them on the models its
HD and TaH suites have just trained. The attention weights are recomputed from each
moe.Attention call's queries, keys and mask (moe.Attention.record) for the length of a `with` block.
"""

import math
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

import moe
from hd import HiddenDecoding
from report import cell
from tah import DepthKV

# -----------------------------------------------------------------------------
# Attention weights, from any model built on moe.py


def attention_weights(q, k, mask):
    """softmax(q k^T / sqrt(hd)) under mask, as attend computes it: q (B, H, Tq, hd), k (B, Hkv,
    Tk, hd) -> (B, H, Tq, Tk), float32. A query head h reads key head h // (H / Hkv) (GQA, as
    SDPA's enable_gqa); a row that sees no key weighs every key 0."""
    if isinstance(mask, BlockMask):
        raise ValueError("attention weights are read on the dense paths: give a boolean mask, not a BlockMask")
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.size(-1))
    if isinstance(mask, str):  # "causal"
        mask = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)


@contextmanager
def recording_attention(model):
    """Inside the block, every attention call of `model` also appends its weights (B, H, Tq, Tk)
    to the list it yields, in call order (moe.Attention.record calls attention_weights): one per
    layer per pass (one per layer for HD's dense path; layer i of TaH's pass d is entry
    d * n_layer + i). Only masks as tensors or "causal"."""
    calls, layers = [], [m for m in model.modules() if isinstance(m, moe.Attention)]
    for a in layers:
        a.record = lambda q, k, mask: calls.append(attention_weights(q, k, mask))
    try:
        yield calls
    finally:
        for a in layers:
            a.record = None


# -----------------------------------------------------------------------------
# Hidden Decoding: the streams (HD §5.2-5.3)


def reference_copy(model):
    """The same HD model with every row carried through every layer (no KV-mirror skip) and
    every layer on its dense mask: the same logits (test_hd.py), and every stream's state and
    attention weights exist to be read."""
    ref = HiddenDecoding(replace(model.cfg, mirror_skip=False, attn_impl="dense"))
    ref.load_state_dict(model.state_dict())
    return ref.to(next(model.parameters()).device).eval()


@torch.no_grad()
def stream_states(model, idx):
    """The residual state of every stream at every layer: (n_layer + 1, B, L, n, C), first the
    input (each stream's own embedding), then each block's output. Also returns the attention
    weights of every layer, (B, H, L*n, L*n) each."""
    ref, n = reference_copy(model), model.cfg.n_streams
    states = [ref.embed(idx)]
    hooks = [b.register_forward_hook(lambda mod, args, out: states.append(out[0])) for b in ref.backbone.blocks]
    try:
        with recording_attention(ref) as weights:
            ref(idx)
    finally:
        for h in hooks:
            h.remove()
    B, L = idx.shape
    return torch.stack(states).view(len(states), B, L, n, -1), weights


def stream_cosine(states):
    """Per layer, (same, different): the mean cosine similarity of two streams a < b of the same
    token, and of stream a of token i with stream b of another token (token i - L//2 of the same
    row, mod L), over every pair of streams. states (layers, B, L, n, C); n >= 2, L >= 2."""
    S = F.normalize(states.float(), dim=-1)
    other = S.roll(S.size(2) // 2, dims=2)
    pairs = [(a, b) for a in range(S.size(3)) for b in range(a + 1, S.size(3))]
    same = torch.stack([(S[..., a, :] * S[..., b, :]).sum(-1) for a, b in pairs]).mean((0, 2, 3))
    diff = torch.stack([(S[..., a, :] * other[..., b, :]).sum(-1) for a, b in pairs]).mean((0, 2, 3))
    return same, diff


def stream_mass(weights, n):
    """weights (B, H, L*n, L*n) over the expanded rows t = i*n + k -> (n,): the attention mass a
    final-stream query (k = n-1) gives the keys of each stream, mean over queries, heads and
    batch (HD Fig. 6b). Sums to 1 where every query sees a key."""
    final_queries = weights[:, :, n - 1::n]  # (B, H, L, L*n)
    return final_queries.unflatten(-1, (-1, n)).sum(-2).mean((0, 1, 2))


def entropy(logits):
    """Entropy (nats) of softmax(logits) over the last dimension."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def head_probes(model, last_states):
    """The shared LM head (final norm, projection) applied to every stream's last state
    (B, L, n, C) (HD Fig. 7). Returns per stream: how often its top-1 differs from the final
    stream's, its mean entropy in bits (as the paper gives it), and the probabilities
    (B, L, n, V)."""
    logits = model.head(last_states).float()
    top1 = logits.argmax(-1)
    differs = (top1 != top1[..., -1:]).float().mean((0, 1))
    bits = entropy(logits).mean((0, 1)) / math.log(2)
    return differs, bits, F.softmax(logits, dim=-1)


@torch.no_grad()
def stream_probes(model, xs, batch):
    """Every probe above over the windows xs (N, L), `batch` at a time, as means over the
    batches: (same, different) cosine per state, the final stream's attention mass on each
    stream in every cross-stream layer (F and L; their indices as `cross`), and each stream's
    top-1 disagreement and entropy. Returns cross, [same, different, mass, differs, bits]."""
    n, layout, device = model.cfg.n_streams, model.cfg.layout, next(model.parameters()).device
    cross = [l for l, kind in enumerate(layout) if kind in "FL"]
    parts = []
    for i in range(0, len(xs), batch):
        states, weights = stream_states(model, xs[i:i + batch].to(device))
        differs, bits, _ = head_probes(model, states[-1])
        mass = torch.stack([stream_mass(weights[l], n) for l in cross]) if cross else torch.zeros(0, n)
        parts.append((*stream_cosine(states), mass, differs, bits))
    return cross, [torch.stack(p).mean(0).tolist() for p in zip(*parts)]


def stream_name(k, n):
    return f"stream {k}" + (" (final)" if k == n - 1 else "")


@torch.no_grad()
def stream_line(model, x, decode, most=12):
    """HD Fig. 8 on one window x (T,): each stream's top-1 token and its probability at every
    position of the window's first whole line (up to `most` tokens), as a markdown table."""
    text = [decode([t]) for t in x.tolist()]
    ends = [i for i, t in enumerate(text) if "\n" in t]
    a, b = next(((a + 1, b) for a, b in zip(ends, ends[1:]) if b - a > 4), (0, len(text) - 1))
    states, _ = stream_states(model, x[None].to(next(model.parameters()).device))
    p, top = head_probes(model, states[-1])[2][0].max(-1)  # over (T, n, V)
    n = model.cfg.n_streams
    lines = ["| input | next | " + " | ".join(stream_name(k, n) for k in range(n)) + " |", "|---" * (n + 2) + "|"]
    for i in range(a, min(b, a + most)):
        tops = " | ".join(f"{cell(decode([top[i, k].item()]))} {p[i, k].item():.2f}" for k in range(n))
        lines.append(f"| {cell(text[i])} | {cell(text[i + 1])} | {tops} |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Think-at-Hard: what a second pass changes (TaH Fig. 5)

OUTCOMES = ("wrong -> right", "right -> wrong", "wrong -> wrong", "right -> right")


def iteration_outcomes(before, after, target, went, kind):
    """For the positions that went on (went, bool): counts of each outcome of their top-1
    against the target, before the next pass (`before`) and after it (`after`), per value of
    `kind` (e.g. a query's hop count). All arguments are tensors of one shape.
    Returns {kind value: {outcome: count}}."""
    out = {}
    for k in kind[went].unique().tolist():
        sel = went & (kind == k)
        b, a = before[sel] == target[sel], after[sel] == target[sel]
        out[k] = dict(zip(OUTCOMES, (int((~b & a).sum()), int((b & ~a).sum()), int((~b & ~a).sum()),
                                     int((b & a).sum()))))
    return out


@torch.no_grad()
def tah_trace(model, idx, threshold=None):
    """One decider-routed forward of idx (1, T), kept whole for drawing (TaH Figs. 5 and 7):
    per token the passes it ran, the decider's probability of going on after its first pass,
    its top-1 after the first pass and after the last; and the attention of the last layer in
    the second pass (mean over heads): its queries (the tokens that went on) over the keys,
    each key a (position, depth) state."""
    cache = DepthKV(model.cfg.n_layer, 1, idx.device)
    with recording_attention(model) as calls:
        out = model(idx, mode="decider", cache=cache, threshold=threshold)
    trace = dict(passes=out.depths[0], go=torch.sigmoid(out.passes[0].score[0]),
                 first=out.first_logits[0].argmax(-1), final=out.logits[0].argmax(-1))
    if len(out.passes) > 1:  # someone went on: depth 1's queries are out.passes[1].sel
        p, n_layer = out.passes[1], model.cfg.n_layer
        w = calls[2 * n_layer - 1][0].mean(0)  # (Tq, Tk), the last layer of pass 2
        pos, depth, keys = (t[0, :cache.len] for t in cache.lookups)
        trace.update(query_pos=p.sel[0][p.valid[0]], weights=w[p.valid[0]][:, keys],
                     key_pos=pos[keys], key_depth=depth[keys])
    return trace
