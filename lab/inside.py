"""
Looking inside trained models: the probes the two papers use to explain *why* their methods help,
and the rows and claims they give the default run (protocols.py calls them on the models it trained).

Hidden Decoding (§5.2-5.3): how alike a token's streams are at every layer (stream_cosine, Fig.
6a), what a final-stream query reads of each stream (stream_mass, Fig. 6b), and the shared LM
head read off every stream (head_probes, Fig. 7). Think-at-Hard (§5): what a second pass changes
(iteration_outcomes, Fig. 5) and whom a deeper query attends to (tah_trace, Fig. 7). Attention
weights are recomputed from each moe.Attention call (moe.Attention.record) inside a `with`.
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/inside.py is no script: run python train_tiny.py (its probes run in the default run)", file=sys.stderr)
    sys.exit(2)

import math
import shutil
from contextlib import contextmanager
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

import moe
from hd import HiddenDecoding
from lab.figures import plot_streams, plot_sweep, plot_trace
from lab.files import atomic
from lab.report import Arm, Claim, Effect, cell, result_rows, trace_table
from tah import DepthKV
from trainer import rank_world

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


# -----------------------------------------------------------------------------
# The probes' rows and claims in the default run, and what is kept with the run


def save_inside(ctx, name, text):
    """An analysis of the first seed's models, kept with the run (the report copies it out)."""
    if rank_world()[0] == 0:
        (ctx.run_dir / "inside").mkdir(exist_ok=True)
        atomic(ctx.run_dir / "inside" / name, lambda f: f.write(text.encode()))


INSIDE_WINDOWS = 32  # held-out windows (of the preset's block) the HD probes read


class HDInside(NamedTuple):
    """The three effects of HD's probes on one n (HD Figs. 6a, 6b, 7)."""
    cosine: Effect
    mass: Effect
    head: Effect


def hd_effects(n):
    return HDInside(Effect(f"hd-n{n}-cosine",
                           f"HD n={n} inside: cosine of two streams, same token vs different tokens, per layer",
                           "Qwen3-8B HD n=8: same token 0.987 at the input, 0.637 in the middle layers, 0.783 at the "
                           "output, above the different-token baseline (HD Fig. 6a)"),
                    Effect(f"hd-n{n}-mass",
                           f"HD n={n} inside: the final stream's attention mass on each stream (F and L layers)",
                           "n=8: the final stream reads the others, stream 0 up to 0.52 (HD Fig. 6b)"),
                    Effect(f"hd-n{n}-head", f"HD n={n} inside: the shared LM head read off every stream",
                           "n=8: an intermediate stream's top-1 differs from the final stream's in up to 63% of "
                           "positions; the final stream has the lowest entropy, 2.09 bits at n=8 (HD Fig. 7)"))


SAME, DIFFERENT = Arm("same", "same token"), Arm("different", "different tokens")
LOWEST_OTHER = Arm("lowest-other", "lowest-entropy other stream")
LEAST_GAP, DIFFERS, BITS = "where the gap is least", "top-1 differs from the final stream's", "entropy (bits)"


def stream_arm(k, n):
    return Arm(f"stream{k}", stream_name(k, n))


def state_name(layer):
    return "input" if layer == 0 else f"block {layer}"  # states[l]: the embedding, then block l's output


def hd_rows(model, windows, batch, seed):
    """The HD probes (stream_probes) on the first INSIDE_WINDOWS held-out windows, as rows."""
    n, layout = model.cfg.n_streams, model.cfg.layout
    effects = hd_effects(n)
    cross, (same, diff, mass, differs, bits) = stream_probes(model, windows[:INSIDE_WINDOWS], batch)
    least = min(range(len(same)), key=lambda l: same[l] - diff[l])  # "above at every layer" = above here
    rows = []
    for arm, cos in ((DIFFERENT, diff), (SAME, same)):
        rows += result_rows(effects.cosine, arm, seed,
                            {**{state_name(l): c for l, c in enumerate(cos)}, LEAST_GAP: cos[least]})
    for j, l in enumerate(cross):
        rows += result_rows(effects.mass, Arm(f"block{l + 1}", f"block {l + 1} ({layout[l]})"), seed,
                            {f"on {stream_name(k, n)}": m for k, m in enumerate(mass[j])})
    for k in range(n):
        rows += result_rows(effects.head, stream_arm(k, n), seed, {DIFFERS: differs[k], BITS: bits[k]})
    return rows + result_rows(effects.head, LOWEST_OTHER, seed, {BITS: min(bits[:-1])})


def hd_claims(n):
    effects = hd_effects(n)
    return [Claim(f"HD n={n} inside: a token's streams are more alike than different tokens' at every layer",
                  effects.cosine, SAME, baseline=DIFFERENT, metric=LEAST_GAP, sign=+1),
            Claim(f"HD n={n} inside: the final stream has the lowest entropy", effects.head, stream_arm(n - 1, n),
                  baseline=LOWEST_OTHER, metric=BITS, sign=-1)]


def save_hd_line(ctx, model, data, block):
    """HD Fig. 8 on the first held-out window, kept with the run as hd_line.md."""
    save_inside(ctx, "hd_line.md", stream_line(model, data.windows(ctx.eval_split, block)[0][0], data.decode))


def hd_probes(trained, preset, ctx, seed, data):
    """The probes of HD §5.2-5.3 on each n > 1 the HD protocol trained (protocols.HDTrained), and
    HD Fig. 8 on the largest n in the first seed, kept with the run."""
    windows = data.windows(ctx.eval_split, preset.block)[0]
    rows = [r for n, model in trained.models.items() if n > 1 for r in hd_rows(model, windows, preset.batch, seed)]
    if seed == ctx.seeds[0]:
        save_hd_line(ctx, trained.models[max(preset.hd_ns)], data, preset.block)
    return rows


def plot_hd_streams(summary, out, ns):
    """HD's streams figure (figures.plot_streams) over the n > 1 of ns."""
    effects = {n: hd_effects(n) for n in ns if n > 1}
    return plot_streams(summary, out, *({n: getattr(e, f).name for n, e in effects.items()} for f in HDInside._fields))


HD_INSIDE_MD = {"hd_line.md": "HD inside: one held-out line, each stream's top-1 token and its probability (HD Fig. 8)"}


# TaH inside (TaH Figs. 5 and 7): what the second pass does in the lookups model

KINDS = {0: Arm("other", "other tokens (target: the next token)"), 1: Arm("one-hop", "one-hop queries"),
         2: Arm("two-hop", "two-hop queries"), 3: Arm("three-hop", "three-hop queries")}
QUERIES, FIXES, SENT = Arm("queries", "every query token"), "corrected - corrupted", "share of the kind sent on"


@torch.no_grad()
def tah_rows(model, batches, data, seed, effect, threshold=None):
    """The tokens the decider sends on: top-1 after the first and the last pass against the next
    token, by query kind (TaH Fig. 5), and each kind's share sent on (per problem: all queries'),
    over the held-out `batches`."""
    model.eval()
    counts, totals, queries = {}, {}, [0, 0]  # queries: sent on, all
    for x, y in batches:
        out = model(x, mode="decider", threshold=threshold)
        nxt = torch.cat([x[:, 1:], y[:, -1:]], 1)  # the next token; the last position's only if it is a target
        kind = data.hops(x)
        for h, c in iteration_outcomes(out.first_logits.argmax(-1), out.logits.argmax(-1), nxt,
                                       (out.depths > 1) & (nxt >= 0), kind).items():
            counts[h] = {o: counts.get(h, {}).get(o, 0) + c[o] for o in OUTCOMES}
        for h in kind[nxt >= 0].unique().tolist():
            totals[h] = totals.get(h, 0) + int(((kind == h) & (nxt >= 0)).sum())
        queries = [queries[0] + int((out.depths > 1)[kind > 0].sum()), queries[1] + int((kind > 0).sum())]
    model.train()
    rows = []
    for h in sorted(totals):  # every kind in the data, sent on or not
        c = counts.get(h, dict.fromkeys(OUTCOMES, 0))
        rows += result_rows(effect, KINDS[h], seed, {**c, FIXES: c[OUTCOMES[0]] - c[OUTCOMES[1]],
                                                     SENT: sum(c.values()) / totals[h]})
    if data.per_problem:  # one token kind for every query: how often the decider sends it on
        rows += result_rows(effect, QUERIES, seed, {SENT: queries[0] / max(queries[1], 1)})
    return rows


def tah_diagnostics(effects, mode, tokens, seed):
    """Oracle: pass 1 alone against the sum. Decider: the easy answers it sends on (overthinking)."""
    share = lambda m: m.float().mean().item() if m.numel() else float("nan")
    if mode == "oracle":
        h = tokens["hard"]
        return result_rows(effects.diagnostics, Arm("oracle", "TaH under the oracle"), seed, {
            "hard share of answers": share(h), "pass-1 acc, easy answers": share(tokens["first_ok"][~h]),
            "pass-1 acc, hard answers": share(tokens["first_ok"][h]), "summed acc, hard answers": share(tokens["ok"][h])})
    if mode == "decider":
        sent = tokens["went"] & ~tokens["hard"]  # easy answers the decider sent on
        return result_rows(effects.diagnostics, Arm("decider", "TaH under the decider"), seed, {
            "easy answers sent on": share(sent), "of those, right after pass 1": share(tokens["first_ok"][sent]),
            "of those, right after pass 2": share(tokens["ok"][sent])})
    return []


def tah_probes(rows, trained, effects, seed, keep_problem=False):
    """`rows` (a TaH protocol's, from what it trained: protocols.TaHTrained) with the probes' rows:
    the diagnostics of each routing mode it evaluated, right after the routing rows (where the
    report shows them), and on lookups what the second pass does (TaH Figs. 5, 7); keep_problem:
    the first seed's two-hop problem kept with the run too (the headline suite's)."""
    diagnostics = [r for mode, tokens in trained.tokens.items() for r in tah_diagnostics(effects, mode, tokens, seed)]
    at = max((i + 1 for i, r in enumerate(rows) if r["effect_id"] == effects.routing.id), default=len(rows))
    rows = rows[:at] + diagnostics + rows[at:]
    if effects.inside is not None:
        rows += tah_rows(trained.models["tah"], trained.batches(), trained.data, seed, effects.inside)
        if keep_problem and seed == trained.ctx.seeds[0]:
            save_tah_problem(trained.ctx, trained.models["tah"], next(trained.batches())[0], trained.data)
    return rows


def claims(ns, tah_effects, task):
    """The probes' claims of the headline suites: HD's per n > 1 of ns, TaH's on one task's effects."""
    return [c for n in ns if n > 1 for c in hd_claims(n)], tah_claims(tah_effects.inside, task)


def tah_claims(effect, task):
    return [Claim(f"{task}: among the two-hop answers sent on, the second pass corrects more than it corrupts",
                  effect, KINDS[2], baseline=0, metric=FIXES, sign=+1)]


def save_tah_problem(ctx, model, x, data):
    """The first problem of the held-out batch x with a two-hop query through the decider (TaH Figs.
    5, 7), kept with the run as tah_problem.md (a row per token) and tah_problem.png."""
    L = data.problem_len
    problems = x[:, :x.size(1) // L * L].reshape(-1, L)
    idx = problems[(data.hops(problems) == 2).any(1).nonzero()[0, 0]][None]
    model.eval()
    trace = tah_trace(model, idx)
    model.train()
    names = [data.describe(t) for t in idx[0].tolist()]
    save_inside(ctx, "tah_problem.md", trace_table(trace, names, data.describe))
    if rank_world()[0] == 0:
        plot_trace(trace, names, model.cfg.threshold, ctx.run_dir / "inside" / "tah_problem.png", data.describe)


TAH_INSIDE_MD = {"tah_problem.md": "TaH inside: one held-out lookup problem through the decider (TaH Figs. 5 and 7)"}


def plot_tah_tradeoff(summary, out, eval_set):
    """Every TaH task's threshold sweep in the rows, one panel each; its two ends (Standard,
    AlwaysThink) are its arms that are no threshold of the decider."""
    sweeps = list(dict.fromkeys(s["effect"] for s in summary if s["effect"].startswith("TaH: decider threshold")))
    ends = tuple(dict.fromkeys(s["arm"] for s in summary if s["effect"] in sweeps and "threshold" not in s["arm"]))
    return plot_sweep(summary, out, eval_set, sweeps, ends)


def copy_tah_problem(run_dir, out):
    trace = run_dir / "inside" / "tah_problem.png"
    return shutil.copyfile(trace, out / trace.name) if trace.exists() else None
