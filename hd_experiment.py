"""
Hidden Decoding's experiment (HD §2.3, Table 5; §5.2-5.3): the expansion factor n, continued from
one n = 1 checkpoint, and what the trained streams hold. train_tiny.py's `--suite hd`.

The protocol: an n = 1 backbone is pretrained, then continued as each n of --hd_ns (n = 1: the
control) for the same steps on the same batches, each expanded with E_k <- E_{k mod n}; each is
evaluated on the held-out set. The claims: each n > 1 beats n = 1, and the gain grows with n.
The probes, on each n > 1: how alike a token's streams are at every layer (stream_cosine, Fig.
6a), what a final-stream query reads of each stream (stream_mass, Fig. 6b), the shared LM head
read off every stream (head_probes, Fig. 7), and one held-out line through every stream (Fig. 8).
The rows' vocabulary and the rule are experiment.py's.
"""

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from experiment import Arm, Claim, Effect, backbone_cfg, cell, keep, lm_loss, recording_attention, result_rows
from hd import HDConfig, HiddenDecoding, expand_streams
from trainer import Stage, evaluate, train

# -----------------------------------------------------------------------------
# The protocol: expansion factor n, continued from one n=1 checkpoint (HD §2.3, Table 5)


HD_N = Effect("hd-n", "HD: expansion factor n, continued from one n=1 checkpoint",
              "6B MoE loss: baseline 1.908, HD n=2 1.874, n=3 1.857 (HD Table 5); each stage continues the "
              "previous one's checkpoint (HD §2.3)")

BACKBONE = Arm("n1-backbone", "n=1 backbone (start of every arm)")

JUST_EXPANDED = Arm("n2-step0", "n=2 just expanded (step 0)")

def hd_cont_arm(n):
    return Arm(f"n{n}-continued", f"n={n} continued")

def hd_config(preset, vocab, n):
    """HD with n streams on the text backbone, its layout and window from the preset."""
    return HDConfig(**backbone_cfg(preset, vocab, layout=preset.layout, window=preset.window, n_streams=n))

def hd_backbone(preset, ctx, seed, data, tag):
    """The n = 1 model every HD arm continues from, pretrained for preset.hd_base_iters steps."""
    torch.manual_seed(seed)
    base = HiddenDecoding(hd_config(preset, data.vocab_size, 1)).to(ctx.device)
    stage = Stage(preset.hd_base_iters, preset.lr, warmup=preset.warmup, batch=preset.batch, block=preset.block)
    train(f"{tag}/backbone n=1", base, lm_loss, data, stage, ctx=ctx, seed=seed)
    return base

def continuation(preset):
    """Every continued arm's stage: preset.hd_cont_iters steps at peak rate preset.hd_cont_lr."""
    return Stage(preset.hd_cont_iters, preset.hd_cont_lr, warmup=preset.warmup, batch=preset.batch,
                 block=preset.block)

@dataclass
class HDTrained:
    """What the HD protocol hands on: the n = 1 backbone, each n's model and held-out metrics."""
    base: HiddenDecoding
    models: dict
    metrics: dict


def hd_protocol(preset, ctx, seed, data):
    """HD's continued-pretraining protocol (§2.3, §4): an n = 1 backbone, continued as each n of
    preset.hd_ns (n = 1: the control) on the same batches, each expanded with E_k <- E_{k mod n};
    then the probes of §5.2-5.3 on each n > 1 (hd_probes, below)."""
    base = hd_backbone(preset, ctx, seed, data, "hd")
    rows = result_rows(HD_N, BACKBONE, seed, evaluate(base, data, preset, ctx))
    rows += result_rows(HD_N, JUST_EXPANDED, seed, evaluate(expand_streams(base, 2), data, preset, ctx))
    trained = HDTrained(base, {n: expand_streams(base, n).to(ctx.device) for n in preset.hd_ns}, {})
    for n, model in trained.models.items():
        train(f"hd/n={n} continued", model, lm_loss, data, continuation(preset), ctx=ctx, seed=seed,
              first_batch=preset.hd_base_iters)
        trained.metrics[n] = evaluate(model, data, preset, ctx)
        rows += result_rows(HD_N, hd_cont_arm(n), seed, trained.metrics[n])
    return rows + hd_probes(trained, preset, ctx, seed, data), trained


def hd_claims(ns):
    """Each n > 1 beats n = 1, and each n beats the one before it; what the probes say of each n > 1."""
    more = [n for n in ns if n > 1]
    return ([Claim(f"HD n={n} beats n=1 (continued from one checkpoint)", HD_N, hd_cont_arm(n),
                   baseline=hd_cont_arm(1), metric="loss", sign=-1) for n in more]
            + [Claim(f"HD gain grows with n: n={b} beats n={a}", HD_N, hd_cont_arm(b), baseline=hd_cont_arm(a),
                     metric="loss", sign=-1) for a, b in zip(more, more[1:])]
            + [c for n in more for c in inside_claims(n)])


# -----------------------------------------------------------------------------
# The probes: what the streams hold (HD §5.2-5.3)


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
# The probes' rows and claims


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


def inside_claims(n):
    effects = hd_effects(n)
    return [Claim(f"HD n={n} inside: a token's streams are more alike than different tokens' at every layer",
                  effects.cosine, SAME, baseline=DIFFERENT, metric=LEAST_GAP, sign=+1),
            Claim(f"HD n={n} inside: the final stream has the lowest entropy", effects.head, stream_arm(n - 1, n),
                  baseline=LOWEST_OTHER, metric=BITS, sign=-1)]


def hd_probes(trained, preset, ctx, seed, data):
    """The probes of HD §5.2-5.3 on each n > 1 the protocol trained, as rows; HD Fig. 8 on the
    largest n, kept with the run from the first seed (hd_line.md)."""
    windows = data.windows(ctx.eval_split, preset.block)[0]
    rows = [r for n, model in trained.models.items() if n > 1 for r in hd_rows(model, windows, preset.batch, seed)]
    if seed == ctx.seeds[0]:
        keep(ctx, "hd_line.md", stream_line(trained.models[max(preset.hd_ns)], windows[0], data.decode))
    return rows


KEPT = {"hd_line.md": "HD inside: one held-out line, each stream's top-1 token and its probability (HD Fig. 8)"}


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("hd_experiment.py", "python train_tiny.py --suite hd")
