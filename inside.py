"""
Looking inside trained models: the probes the two papers use to explain *why* their methods help.

Hidden Decoding (§5.2-5.3): how alike a token's streams are at every layer (stream_cosine, Fig.
6a), what a final-stream query reads of each stream (stream_mass, Fig. 6b), and the shared LM
head read off every stream (head_probes, Fig. 7). Think-at-Hard (§5): what a second pass changes
(iteration_outcomes, Fig. 5) and whom a deeper query attends to (tah_trace, Fig. 7). Attention
weights are recomputed from each moe.Attention call (moe.Attention.record) inside a `with`.
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
    """softmax(q k^T / sqrt(hd)) under mask, as attend computes it, float32: q (B, H, Tq, hd), k
    (B, Hkv, Tk, hd) -> (B, H, Tq, Tk); a row that sees no key weighs every key 0."""
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
    to the list it yields, in call order (TaH: layer i of pass d is entry d * n_layer + i)."""
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
    """The HD model without the KV-mirror skip and on dense masks: the same logits (test_hd.py),
    with every stream's state and attention weights there to read."""
    ref = HiddenDecoding(replace(model.cfg, mirror_skip=False, attn_impl="dense"))
    ref.load_state_dict(model.state_dict())
    return ref.to(next(model.parameters()).device).eval()


@torch.no_grad()
def stream_states(model, idx):
    """Every stream's residual state at every layer, (n_layer + 1, B, L, n, C), and every layer's
    attention weights (B, H, L*n, L*n)."""
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
    """Per layer, (same, different): the mean cosine of streams a < b of one token, and of stream a
    of token i with stream b of token i - L//2 (mod L). states (layers, B, L, n, C)."""
    S = F.normalize(states.float(), dim=-1)
    other = S.roll(S.size(2) // 2, dims=2)
    pairs = [(a, b) for a in range(S.size(3)) for b in range(a + 1, S.size(3))]
    same = torch.stack([(S[..., a, :] * S[..., b, :]).sum(-1) for a, b in pairs]).mean((0, 2, 3))
    diff = torch.stack([(S[..., a, :] * other[..., b, :]).sum(-1) for a, b in pairs]).mean((0, 2, 3))
    return same, diff


def stream_mass(weights, n):
    """weights (B, H, L*n, L*n) -> (n,): the attention mass final-stream queries give each stream's
    keys (HD Fig. 6b)."""
    final_queries = weights[:, :, n - 1::n]  # (B, H, L, L*n)
    return final_queries.unflatten(-1, (-1, n)).sum(-2).mean((0, 1, 2))


def entropy(logits):
    """Entropy (nats) of softmax(logits) over the last dimension."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def head_probes(model, last_states):
    """The shared LM head on every stream's last state (B, L, n, C) (HD Fig. 7): per stream, how
    often its top-1 differs from the final stream's, its entropy in bits, and the probabilities."""
    logits = model.head(last_states).float()
    top1 = logits.argmax(-1)
    differs = (top1 != top1[..., -1:]).float().mean((0, 1))
    bits = entropy(logits).mean((0, 1)) / math.log(2)
    return differs, bits, F.softmax(logits, dim=-1)


@torch.no_grad()
def stream_probes(model, xs, batch):
    """Every probe above over the windows xs, `batch` at a time: cross (the F and L layers), then
    [same, different, mass, differs, bits], each a mean over the batches."""
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
    """Per value of `kind`, for the positions that `went` on: counts of each outcome of their top-1
    against the target, `before` and `after` the next pass."""
    out = {}
    for k in kind[went].unique().tolist():
        sel = went & (kind == k)
        b, a = before[sel] == target[sel], after[sel] == target[sel]
        out[k] = dict(zip(OUTCOMES, (int((~b & a).sum()), int((b & ~a).sum()), int((~b & ~a).sum()),
                                     int((b & a).sum()))))
    return out


@torch.no_grad()
def tah_trace(model, idx, threshold=None):
    """One decider-routed forward of idx (1, T) kept for drawing (TaH Figs. 5, 7): per token its
    passes, p(go on) after pass 1, top-1 after the first and last pass; and the last layer's
    second-pass attention (mean over heads) over every (position, depth) key."""
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
