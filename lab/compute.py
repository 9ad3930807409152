"""
What HD's compute buys (`--suite hd-compute`): the continuation's compute spent four ways, each
from the same n = 1 checkpoint and on the same batches, seed by seed.

- More streams (HD): n = 1 continued (the control), n = 2 and n = 4, as the default run.
- More steps: n = 1 continued for 0.5x, 1.5x, 2x, 3x and 4x the steps, each with its own full
  schedule (more tokens, the same parameters; past one epoch the text repeats: the rows give the
  epochs each arm sees, the backbone's steps included). With the control, the curve of loss
  against FLOPs that the effective compute is read from.
- Looping (recurrent depth): the n = 1 model with its whole block stack run 2x and 4x per token,
  the same weights each pass (Looped), as Ouro loops the whole stack rather than a middle core as
  Huginn does. A fair start: each pass after the first moves the state by a per-channel gate that
  starts at 0, so the loop begins at the n = 1 function exactly, as HD's expansion does (a
  checkpoint trained for one pass, run k times as it is, starts far from it and ended above the
  control in an earlier run: RESULTS). KV-Mirror pairs the first third with the last within each pass.
- Parallel copies (ParScale, Chen et al. 2025): the n = 1 model run P = 2 and 4 times side by side on
  the same tokens, each copy with its own learned prefix rows, the final states mixed by a learned
  weighted sum (ParScale). HD's closest peer: parallel streams of one backbone, but no copy sees
  another's keys, where HD's F and L layers mix its streams.

Each arm's training FLOPs are counted as it runs (lab/flops.py's per_token: the rows each layer
runs, the head once a token, the loop's passes), times the tokens its continuation trains on
(steps x batch x block). As run, the ways do not spend equal compute: at the default preset HD
n = 4 costs ~2.0x n = 1 a token (its head and its two KV-mirrored layers run once a token), the
loop x4 ~2.3x. So the arms are compared by their **effective compute**: the FLOPs n = 1 needs to
reach the arm's loss on its curve of more steps (per seed, read in log FLOPs between the points
that bracket it; beyond the curve not extrapolated: the bound its nearest end gives, and a row
saying which), over the FLOPs the arm spent. Above 1, the arm's compute is worth more than the
same compute spent on more steps.

Every way gets its best shot by one rule: `--suite hd-compute-lr` continues each way from the same
backbone at each peak rate of LR_GRID (x --hd_cont_lr), then, at its best, the parameters it adds
(HD's tables past the first, the loop's gates, ParScale's prefixes and aggregation MLP) at each rate
of NEW_GRID (x the way's), every point judged on the dev split; RATES holds what it chose, and this
suite runs each way at its rates (the steps arms at the control's). How far each peer moved (its
gates, its prefix values, its mixing weights from uniform) is a row, and "n = k beats X" is read
only where X moved: where "X beats the n = 1 control" is shown.
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/compute.py is no script: run python train_tiny.py --suite hd-compute", file=sys.stderr)
    sys.exit(2)

import math
from dataclasses import replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hd_experiment
from checks import MAX_INT, check_fits, check_tokens, is_int
from experiment import Arm, Claim, Effect, lm_loss, result_rows
from hd import HiddenDecoding, expand_streams, layer_mask
from lab import figures, flops
from lab.report import interval95
from moe import BlockMask, dense_mask, upcast
from trainer import evaluate, log, train


class Looped(nn.Module):
    """An n = 1 HD model (hd.HiddenDecoding) with its block stack run `loops` times per token, the
    same weights each pass; the final norm and the LM head read the last pass's state. Pass j > 1
    moves the state by a gated step, x <- x + g_j * (blocks(x) - x), a per-channel gate g_j that
    starts at 0 (gated=True): at step 0 the loop is the n = 1 model exactly, as HD's expansion
    starts at its n = 1 function, and training opens the gates. gated=False: the plain loop (each
    pass's output the next's input). loops = 1 is the model itself. With caches (decoding),
    caches[j] are pass j's (one generate.make_caches per pass)."""

    def __init__(self, model, loops, gated=True):
        super().__init__()
        if type(model) is not HiddenDecoding or model.cfg.n_streams != 1:
            what = f"n_streams {model.cfg.n_streams}" if type(model) is HiddenDecoding else type(model).__name__
            raise ValueError(f"Looped takes an n = 1 HiddenDecoding (hd.py), got {what}"[:200])
        if not is_int(loops) or not 1 <= loops <= MAX_INT:
            raise ValueError(f"Looped's loops must be an int in [1, 2**53], got {loops!r}"[:200])
        if not isinstance(gated, bool):  # 'no', 0 or nan would read as a choice they do not say
            raise ValueError(f"Looped's gated must be True (the gated loop) or False (the plain one), got {gated!r}"[:200])
        try:  # the size rule: `loops` passes keep what a batch of `loops` sequences keeps
            check_fits(model.cfg, batch=loops)
        except ValueError as e:
            raise ValueError(f"Looped x{loops:,}: {e}") from None
        self.model, self.loops = model, loops
        C = model.cfg.n_embd
        self.gates = nn.ParameterList(nn.Parameter(torch.zeros(C)) for _ in range(loops - 1)) if gated else None

    @property
    def backbone(self):
        return self.model.backbone  # the trainer's router-bias update reads it

    @property
    def cfg(self):
        return self.model.cfg

    def forward(self, idx, targets=None, caches=None):
        m = self.model
        check_tokens(idx, targets, m.cfg.vocab_size)
        if caches is not None and (not isinstance(caches, (list, tuple)) or len(caches) != self.loops):
            raise ValueError(f"a Looped model's caches are one generate.make_caches per pass: {self.loops} of them, "
                             f"got {len(caches) if isinstance(caches, (list, tuple)) else type(caches).__name__}")
        if caches is not None and len({id(c) for c in caches}) < self.loops:  # one list for two passes: each pass's
            raise ValueError("a Looped model's caches are one generate.make_caches per pass, each its own: "
                             "the same list was given to two passes")  # keys would overwrite the other's
        x = m.embed(idx)
        for j in range(self.loops):
            y = m.backbone.run_blocks(x, m.plans(idx, None if caches is None else caches[j]))
            x = y if j == 0 or self.gates is None else x + self.gates[j - 1].to(y.dtype) * (y - x)
        logits = m.head(x)
        loss = None if targets is None else F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten(),
                                                            ignore_index=-1)
        return logits, loss


PREFIX = 2  # ParScale's prefix rows per layer and copy (the released code's default: 48; here T = 64, see ParScale)
SMOOTHING = 0.01  # ParScale's aggregation weights w <- (1 - e) w + e / P: e as the released model code's
# configuration sets it (Qwen2ParScaleConfig's parscale_attn_smooth = 0.01, github.com/QwenLM/ParScale)


class ParScale(nn.Module):
    """ParScale (Chen et al. 2025, "Parallel Scaling Law for Language Models"): P copies of an
    n = 1 HD model's pass on the same tokens, the same weights, as P batch rows. Copy p differs by
    its prefix: at every layer `prefix` learned key and value rows that each of its queries sees
    besides the causal keys (prefix tuning, as the paper: the rows sit ahead of the keys, no RoPE).
    No copy sees another's keys (where HD's F and L layers mix its streams). Each copy's final
    state is normed; the dynamic weighted sum mixes them, weights softmax(MLP(the P states
    concatenated)) over P (Linear(P C, C), SiLU, Linear(C, P)), smoothed by SMOOTHING; the head
    runs once. Added parameters: 2 x layers x P x prefix x kv_heads x head_dim, and the MLP's.
    The start: the copies are equal but for their prefixes, and the prefix values start at 0, so
    each copy is the n = 1 model but for the attention mass its prefix keys draw (keys N(0, 0.02));
    any convex mix of equal copies is that copy. So the start is as close to n = 1 as the prefix's
    rows are few: PREFIX = 2, the most rows whose start was within 0.001 of n = 1's held-out loss
    on the default run's backbone (+0.0006 at P = 4; 3 rows +0.0016, 4 +0.003, the paper's 48,
    here 3/4 of a sequence's keys, +0.057). With caches (decoding): one generate.make_caches for
    the P x B rows."""

    def __init__(self, model, copies, prefix=PREFIX):
        super().__init__()
        if type(model) is not HiddenDecoding or model.cfg.n_streams != 1:
            what = f"n_streams {model.cfg.n_streams}" if type(model) is HiddenDecoding else type(model).__name__
            raise ValueError(f"ParScale takes an n = 1 HiddenDecoding (hd.py), got {what}"[:200])
        for name, v, top in (("copies", copies, 1024), ("prefix", prefix, model.cfg.block_size)):
            if not is_int(v) or not 1 <= v <= top:
                raise ValueError(f"ParScale's {name} must be an int in [1, {top}], got {v!r}"[:200])
        try:  # the size rule: P copies keep what a batch of P sequences keeps
            check_fits(model.cfg, batch=copies)
        except ValueError as e:
            raise ValueError(f"ParScale P = {copies}: {e}") from None
        cfg = model.cfg
        self.model, self.copies, self.prefix = model, copies, prefix
        shape = (cfg.n_layer, copies, cfg.n_kv_head, prefix, cfg.head_dim)
        self.prefix_k = nn.Parameter(torch.randn(shape) * 0.02)
        self.prefix_v = nn.Parameter(torch.zeros(shape))
        C = cfg.n_embd
        self.aggregate = nn.Sequential(nn.Linear(copies * C, C), nn.SiLU(), nn.Linear(C, copies))
        self.mixed = None  # the last forward's mixing weights (B, T, P)
        for layer in (self.aggregate[0], self.aggregate[2]):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    @property
    def backbone(self):
        return self.model.backbone  # the trainer's router-bias update reads it

    @property
    def cfg(self):
        return self.model.cfg

    def forward(self, idx, targets=None, caches=None):
        m, P = self.model, self.copies
        check_tokens(idx, targets, m.cfg.vocab_size)
        B, T = idx.shape
        rows = idx.repeat(P, 1)  # copy-major: row p * B + b is copy p of sequence b
        plans = m.plans(rows, caches)
        plans = [replace(plan, mask=self.prefixed(plan.mask, i, T, idx.device),
                         cache=Prefixed(self.prefix_k[i], self.prefix_v[i], rows=B,
                                          cache=None if caches is None else caches[i]))
                 for i, plan in enumerate(plans)]
        h = m.backbone.norm_f(m.backbone.run_blocks(m.embed(rows), plans)).view(P, B, T, -1)
        w = torch.softmax(upcast(self.aggregate(h.permute(1, 2, 0, 3).flatten(2))), dim=-1)  # (B, T, P)
        w = (1 - SMOOTHING) * w + SMOOTHING / P
        self.mixed = w.detach()  # the last forward's weights (B, T, P): how far from 1 / P, in the report
        logits = m.backbone.lm_head((w.permute(2, 0, 1)[..., None] * h).sum(0).to(h.dtype))
        loss = None if targets is None else F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten(),
                                                            ignore_index=-1)
        return logits, loss

    def prefixed(self, mask, i, T, device):
        """Layer i's mask (one of moe.attend's forms) as a dense one with the prefix's rows first,
        every query seeing them; None (a decode step: every key) stays None."""
        if mask is None:
            return None
        if isinstance(mask, str):  # "causal": T new rows, no cached ones
            mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        elif isinstance(mask, BlockMask):  # uncached on CUDA: the same mask, dense
            t = torch.arange(T, device=device)
            mask = dense_mask(layer_mask(self.model.cfg, i), t, t)
        return torch.cat([mask.new_ones(*mask.shape[:-1], self.prefix), mask], dim=-1)


class Prefixed:
    """ParScale's K/V for one layer: the copies' prefix rows (P, Hkv, prefix, hd), each repeated
    over B sequences, ahead of the keys the layer made (and of those its cache holds)."""

    def __init__(self, k, v, *, rows, cache=None):
        self.k, self.v, self.B, self.cache = k, v, rows, cache

    def update(self, k, v):
        if self.cache is not None:
            k, v = self.cache.update(k, v)
        pk, pv = (p.to(k.dtype).repeat_interleave(self.B, dim=0) for p in (self.k, self.v))
        return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)


def training_flops(model, stage):
    """The training FLOPs of `stage` on `model` (the formula of this file's docstring)."""
    return flops.per_token(model, stage.block) * stage.steps * stage.batch * stage.block


HD_COMPUTE = Effect("hd-compute", "HD: the continuation's compute spent four ways (more streams, more data, looping, "
                    "parallel copies)",
                    "HD argues for its streams against looped (recurrent-depth) transformers on cost and practicality "
                    "(HD §1, §3), not on quality at equal compute; this project's comparison")
FLOPS = "continuation training FLOPs"
N1 = hd_experiment.hd_cont_arm(1)


def streams_arm(n):
    return hd_experiment.hd_cont_arm(n)


STEPS = (0.5, 1.5, 2, 4)  # n = 1 continued for these multiples of the continuation's steps (1x: the control)
EFFECTIVE = "effective compute"  # the FLOPs n = 1 needs to reach the arm's loss by more steps, over the arm's FLOPs
EPOCHS = "epochs of the train split"  # the backbone's steps and the arm's, each a batch x block tokens
BEYOND = "beyond the curve (+1: a lower bound, -1: an upper)"  # effective compute read as a bound
LATE = Effect("hd-compute-late", f"HD's compute, late: the same from n = 1 after {max(STEPS):g}x the steps more (the "
              "early regime's longest arm), without the loop and ParScale",
              "HD grows n from a converged checkpoint (HD §2.3); this project's comparison")


def steps_arm(k):
    return Arm(f"n1-steps{k:g}", f"n=1 continued {k:g}x the steps (repeated data)")


def looped_arm(k):
    return Arm(f"n1-looped{k}", f"n=1 looped x{k} (the whole stack, shared weights, gated)")


def parscale_arm(k):
    return Arm(f"parscale{k}", f"ParScale P={k} (n=1 run {k}x in parallel, prefixes, weighted sum)")


def hd_compute(preset, ctx, seed, data):
    """Two regimes, one seed. Early: the n = 1 backbone (--hd_base_iters steps), then from it on
    the same batches n = 1 continued for 0.5x to 4x the steps (STEPS, each its own schedule; 1x is
    the control), and for each k of --hd_ns past 1 (2, 4) HD n = k, the n = 1 stack looped x k
    (gated) and ParScale P = k. Late: from where the longest steps arm ended (n = 1 after
    max(STEPS) x the continuation's steps more), the same control, HD arms and curve of more steps
    (LATE: no loop, no ParScale, for time). Each arm's held-out loss and accuracy, its FLOPs as
    run, and (not the steps arms) its effective compute: the FLOPs n = 1 needs to reach the arm's
    loss on this seed's curve of more steps in its regime, over the arm's."""
    base = hd_experiment.hd_backbone(preset, ctx, seed, data, "hd-compute")
    ks, stage = preset.hd_ns[1:], hd_experiment.continuation(preset)
    run = dict(preset=preset, ctx=ctx, seed=seed, data=data)
    rows, last = regime(HD_COMPUTE, base, preset.hd_base_iters, **run,
                        others=[(looped_arm(k), lambda m, k=k: Looped(m, k)) for k in ks]
                        + [(parscale_arm(k), lambda m, k=k: ParScale(m, k)) for k in ks])
    late, _ = regime(LATE, last, preset.hd_base_iters + longest(stage).steps, **run)
    return rows + late


def longest(stage):
    return replace(stage, steps=max(1, round(max(STEPS) * stage.steps)))


def regime(effect, start, done, *, preset, ctx, seed, data, others=()):
    """One regime's arms from the n = 1 model `start`, trained for `done` steps (the batches the
    arms read from): HD n for each of --hd_ns (n = 1, the control), n = 1 for each of STEPS x the
    continuation's steps, and `others` [(arm, the model made from an n = 1 copy)], each at its way's
    rates (RATES). Returns the rows and the longest steps arm's model, as trained."""
    stage = hd_experiment.continuation(preset)
    arms = [(streams_arm(n), expand_streams(start, n), stage) for n in preset.hd_ns]
    arms += [(steps_arm(k), expand_streams(start, 1), replace(stage, steps=max(1, round(k * stage.steps))))
             for k in STEPS]
    arms += [(arm, make(expand_streams(start, 1)), stage) for arm, make in others]
    rows, runs, last = [], {}, None
    for arm, model, arm_stage in arms:
        model = model.to(ctx.device)
        arm_stage = at_rates(arm_stage, model, *rates(arm))
        train(f"{effect.id}/{arm.label}", model, lm_loss, data, arm_stage, ctx=ctx, seed=seed, first_batch=done)
        metrics = evaluate(model, data, preset, ctx)
        runs[arm] = (training_flops(model, arm_stage), metrics["loss"])
        seen = (done + arm_stage.steps) * arm_stage.batch * arm_stage.block / len(data.split["train"])
        rows += result_rows(effect, arm, seed, {**metrics, FLOPS: runs[arm][0], **moved(model),
                                                **({EPOCHS: seen} if arm.id.startswith("n1-steps") else {})})
        last = model if arm == steps_arm(max(STEPS)) else last
    curve = [runs[a] for a in runs if a == N1 or a.id.startswith("n1-steps")]
    for arm, (f, loss) in runs.items():
        if arm != N1 and not arm.id.startswith("n1-steps"):
            value, bound = effective_compute(curve, loss, f, bound=True)
            rows += result_rows(effect, arm, seed, {EFFECTIVE: value, BEYOND: bound})
    return rows, last


def effective_compute(curve, loss, spent, bound=False):
    """The FLOPs n = 1 needs to reach `loss` on `curve` [(FLOPs, loss)] (its more-steps arms, one
    seed), read linearly in log FLOPs between the first two neighbouring points that bracket it,
    over the FLOPs the arm `spent`: > 1, its compute is worth more than as many FLOPs of more
    steps. Beyond the curve it is not extrapolated: nan, or with `bound` (value, which) the bound
    the curve gives, which = +1 a lower bound (a loss below every point: at least the FLOPs of the
    lowest), -1 an upper bound (above every point: at most the FLOPs of the highest), 0 a value."""
    points = sorted(curve)
    for (f0, l0), (f1, l1) in zip(points, points[1:]):
        if min(l0, l1) <= loss <= max(l0, l1):
            w = 0.0 if l0 == l1 else (l0 - loss) / (l0 - l1)
            value = math.exp(math.log(f0) + w * (math.log(f1) - math.log(f0))) / spent
            return (value, 0) if bound else value
    if not bound:
        return float("nan")
    lowest, highest = min(points, key=lambda p: p[1]), max(points, key=lambda p: p[1])
    return (lowest[0] / spent, 1) if loss < lowest[1] else (highest[0] / spent, -1)


# -----------------------------------------------------------------------------
# Each way's learning rates: one search for every way, on the dev split (--suite hd-compute-lr)


LR_GRID = (1, 2, 4, 8)  # the continuation's peak rate, x the preset's (--hd_cont_lr)
NEW_GRID = (1, 10, 30, 100)  # the rate of the parameters a way adds to the n = 1 model, x the way's rate
# The rates each way runs at, (x --hd_cont_lr, x that for the parameters it adds), as --suite hd-compute-lr
# chose them on the dev split (search_choice; RESULTS, "What HD's compute buys"), fixed before the test split
# was read. The steps arms run at the control's.
RATES = {"n1": (4, 1), "n2": (4, 30), "n4": (4, 30), "looped2": (4, 1), "looped4": (4, 1), "parscale2": (4, 1),
         "parscale4": (4, 1)}  # `--suite hd-compute-lr --seeds 2` (1,384 s): every choice inside both grids


def way_of(arm):
    """The way an arm spends its compute, RATES' key: "n1" (the control and its steps arms), "n<k>"
    (HD), "looped<k>", "parscale<k>"."""
    i = arm.id
    return "n1" if i.startswith(("n1-steps", "n1-continued")) else i.removeprefix("n1-").removesuffix("-continued")


def rates(arm):
    """The rates RATES gives the arm's way; a way the search did not choose for (another --hd_ns)
    runs at the preset's, and says so."""
    if way_of(arm) not in RATES:
        log(f"hd-compute: {arm.label} was not searched for (RATES): it runs at --hd_cont_lr, what it adds at 1x")
    return RATES.get(way_of(arm), (1, 1))


def added(model):
    """The names of the parameters a way adds to the n = 1 model it grows from: HD's tables past
    the first, the loop's gates, ParScale's prefixes and aggregation MLP."""
    return tuple(n for n, _ in model.named_parameters()
                 if n.startswith(("gates.", "prefix_", "aggregate.")) or n.startswith("tables.") and n != "tables.0.weight")


def at_rates(stage, model, rate, new):
    """`stage` at `rate` x its peak learning rate, the parameters `model` adds (added) at `new` x that."""
    return replace(stage, lr=stage.lr * rate, scaled=added(model) if new != 1 else (), scale=new)


MOVED = {"gates": "mean |gate|", "prefix_v": "prefix values' RMS", "mixed": "mixing weights' mean |w - 1/P|"}


def moved(model):
    """How far a peer moved from the n = 1 function it starts at (the gates and prefix values
    start at 0, the mixing weights near 1/P): the loop's mean |gate|, ParScale's prefix values' RMS
    and how far its mixing weights stand from uniform over the last evaluation batch."""
    if isinstance(model, Looped) and model.gates is not None:
        return {MOVED["gates"]: torch.cat([g.detach().abs() for g in model.gates]).mean().item()}
    if isinstance(model, ParScale):
        mixed = {} if model.mixed is None else {MOVED["mixed"]: (model.mixed - 1 / model.copies).abs().mean().item()}
        return {MOVED["prefix_v"]: model.prefix_v.detach().pow(2).mean().sqrt().item(), **mixed}
    return {}


HD_COMPUTE_LR = Effect("hd-compute-lr", "HD's compute: each way's learning rates, searched on the dev split",
                       "this project's protocol: every way tuned by one rule on the dev split before the test split is "
                       "read (a best shot for each)")
DEV_LOSS = "dev loss"


def searched_arm(way, rate, new):
    return Arm(f"{way.id}-lr{rate:g}-new{new:g}", f"{way.label}, lr x{rate:g}, added x{new:g}")


def hd_compute_lr(preset, ctx, seed, data):
    """The search, one seed: from its n = 1 backbone (--suite hd-compute's), each way (the control,
    and for each k of --hd_ns past 1 HD n = k, the gated loop x k, ParScale P = k) continued at each
    rate of LR_GRID (what it adds at 1x); then, at the rate of its lowest dev loss in this seed, what
    it adds at each rate of NEW_GRID. Every point's dev loss a row; search_choice picks from them."""
    base = hd_experiment.hd_backbone(preset, ctx, seed, data, "hd-compute")
    dev, stage, ks = replace(ctx, eval_split="dev"), hd_experiment.continuation(preset), preset.hd_ns[1:]
    ways = [(N1, lambda m: m)] + [(streams_arm(k), lambda m, k=k: expand_streams(m, k)) for k in ks] + \
        [(looped_arm(k), lambda m, k=k: Looped(m, k)) for k in ks] + [(parscale_arm(k), lambda m, k=k: ParScale(m, k))
                                                                     for k in ks]
    rows = []
    for way, make in ways:
        losses = {}
        for rate, new in [(r, 1) for r in LR_GRID] + [(None, n) for n in NEW_GRID[1:]]:
            model = make(expand_streams(base, 1)).to(ctx.device)
            if rate is None:  # the second stage, at this seed's best rate
                if not added(model):
                    break
                rate = min((loss, r) for (r, n), loss in losses.items() if n == 1)[1]
            arm = searched_arm(way, rate, new)
            try:
                train(f"hd-compute-lr/{arm.label}", model, lm_loss, data, at_rates(stage, model, rate, new), ctx=ctx,
                      seed=seed, first_batch=preset.hd_base_iters)
                losses[rate, new] = evaluate(model, data, preset, dev)["loss"]
            except SystemExit as e:  # a rate the way diverges at (a non-finite loss or weights): a point never chosen
                log(f"hd-compute-lr/{arm.label} s{seed}: {e.code} (its point is inf)")
                losses[rate, new] = float("inf")
            rows += result_rows(HD_COMPUTE_LR, arm, seed, {DEV_LOSS: losses[rate, new]})
    return rows


def search_choice(rows):
    """Each way's rates from the search's rows: (rate, new) of the lowest mean dev loss over the
    seeds, among the points every seed ran (a point one seed's second stage alone ran is left out)."""
    seeds = {r["seed"] for r in rows if r["effect_id"] == HD_COMPUTE_LR.id}
    points = {}
    for r in rows:
        if r["effect_id"] == HD_COMPUTE_LR.id:
            way, rate, new = r["arm_id"].rsplit("-", 2)
            points.setdefault(way, {}).setdefault((float(rate[2:]), float(new[3:])), {})[r["seed"]] = r["value"]
    return {way_of(Arm(way, "")): min((sum(v.values()) / len(v), point) for point, v in grid.items()
                                      if set(v) == seeds)[1] for way, grid in points.items()}


def check_arms(preset, *, vocab, max_steps, device, sharing):
    """The preset's check (lab/presets.py) of this suite's arms beyond HD's: its longest stage (n = 1
    for max(STEPS) x the continuation's steps) and its largest loop (n = 1 looped x k, k the largest
    of --hd_ns); `vocab`: the text's, at most; `max_steps`: a stage's."""
    k, most = max(preset.hd_ns), max(STEPS)
    if most * preset.hd_cont_iters > max_steps:
        return (f"--suite hd-compute continues n = 1 for {most:g}x --hd_cont_iters ({most:g} x {preset.hd_cont_iters:,} "
                f"steps), past the {max_steps:,} steps a stage may take: lower --hd_cont_iters")
    try:  # looped x k keeps what a batch of k x --batch sequences keeps
        check_fits(hd_experiment.hd_config(preset, vocab, 1), k * preset.batch, training=True, device=device, sharing=sharing)
    except ValueError as e:
        return f"--suite hd-compute's n = 1 looped x{k}: {e} (--batch {preset.batch})"
    return None


def loss_claim(name, arm, baseline):
    return Claim(name, HD_COMPUTE, arm, baseline=baseline, metric="loss", sign=-1)


def claims(ns):
    """For each k of --hd_ns past 1, the largest first: whether each peer moved (the gated loop x k
    and ParScale P = k against the n = 1 control: a claim "n = k beats X" is read only where X's is
    shown), HD n = k against the loop x k (the same tokens and non-embedding weights; as run n = k
    spends less), against ParScale P = k (parallel copies of the same backbone), and n = k's compute
    worth more than more steps (its effective compute above 1, a bound beyond the curve); then,
    late, n = k against the control and its effective compute above 1."""
    return [c for k in reversed(ns[1:]) for c in (
        loss_claim(f"HD compute: the loop x{k} moved: it beats the n=1 control (read before n={k} against it)",
                   looped_arm(k), N1),
        loss_claim(f"HD compute: ParScale P={k} moved: it beats the n=1 control (read before n={k} against it)",
                   parscale_arm(k), N1),
        loss_claim(f"HD compute: n={k} beats n=1 looped x{k} (the same tokens and non-embedding weights)", streams_arm(k),
                   looped_arm(k)),
        loss_claim(f"HD compute: n={k} beats ParScale P={k} (the same backbone, {k} parallel copies)", streams_arm(k),
                   parscale_arm(k)),
        Claim(f"HD compute: n={k}'s compute is worth more than more steps (effective compute > 1)", HD_COMPUTE,
              streams_arm(k), baseline=1.0, metric=EFFECTIVE, sign=1))] + [c for k in reversed(ns[1:]) for c in (
        Claim(f"HD compute, late: n={k} beats the n=1 control", LATE, streams_arm(k), baseline=N1, metric="loss",
              sign=-1),
        Claim(f"HD compute, late: n={k}'s compute is worth more than more steps (effective compute > 1)", LATE,
              streams_arm(k), baseline=1.0, metric=EFFECTIVE, sign=1))]


def ways(ns):
    """The figure's four lines, each through the n = 1 control."""
    return {"more streams (HD)": [N1] + [streams_arm(k) for k in ns[1:]],
            "more steps (repeated data)": sorted([N1] + [steps_arm(k) for k in STEPS],
                                                 key=lambda a: 1 if a == N1 else float(a.id[8:])),
            "looping, gated (recurrent depth)": [N1] + [looped_arm(k) for k in ns[1:]],
            "parallel copies (ParScale)": [N1] + [parscale_arm(k) for k in ns[1:]]}


# where each way's tags sit from its points, in the legend's order: HD to the left below, more steps
# to the right, the loop to the left above, ParScale to the right below, so that arms at like FLOPs
# and loss stay apart
TAG_PLACES = (dict(xytext=(-6, -11), ha="right"), dict(xytext=(6, -2), ha="left"),
              dict(xytext=(-5, 5), ha="right"), dict(xytext=(5, -11), ha="left"))


def tag(label):
    """An arm's short tag, in its way's colour: the last word of its label that holds a number
    ("n=2 continued" -> n=2, "... 1.5x the steps" -> 1.5x, "n=1 looped x4" -> x4, "ParScale P=2" -> P=2)."""
    return [w for w in label.split(" (")[0].split() if any(c.isdigit() for c in w)][-1]


def plot(summary, out_dir, ns):
    """What HD's compute buys (lab/compute.py), one panel a regime (early; late, where it ran): each
    arm's held-out loss minus the n = 1 control's, paired by seed, with its 95% interval (t over
    the seeds), against the arm's continuation FLOPs as run; each way of spending compute a line
    from the control (0 at its FLOPs), its arms tagged in its colour, each way's tags on a side of their own."""
    plt = figures.pyplot()
    regimes = [(e, title) for e, title in ((HD_COMPUTE, "early: from the n = 1 backbone"),
                                           (LATE, f"late: after {max(STEPS):g}x the steps more"))
               if any(s["effect"] == e.name and s["arm"] == N1.label for s in summary)]
    if plt is None or not regimes:
        return None
    fig, axes = plt.subplots(1, len(regimes), figsize=(6.5 * len(regimes), 4.8), squeeze=False)
    for ax, (effect, title) in zip(axes[0], regimes):
        pts = {}  # arm -> metric -> {seed: value}
        for s in summary:
            if s["effect"] == effect.name:
                pts.setdefault(s["arm"], {})[s["metric"]] = s["values"]
        control = pts[N1.label]["loss"]
        for i, (way, arms) in enumerate(ways(ns).items()):
            have = [a.label for a in arms if a.label in pts]
            if len(have) < 2:
                continue  # a way the regime did not run (late: the loop, ParScale)
            x = [np.mean(list(pts[a][FLOPS].values())) for a in have]
            deltas = [[pts[a]["loss"][k] - control[k] for k in control if k in pts[a]["loss"]] for a in have]
            y = [np.mean(d) for d in deltas]
            half = [0.0 if len(d) < 2 else (interval95(d)[1] - interval95(d)[0]) / 2 for d in deltas]
            color, place = f"C{i}", TAG_PLACES[i % len(TAG_PLACES)]  # a way's colour the same in every panel
            ax.errorbar(x, y, yerr=half, fmt="o-", ms=4, capsize=3, lw=1.2, color=color, label=way)
            for a, xi, yi in zip(have, x, y):
                if a != N1.label:  # the control's label once, below
                    ax.annotate(tag(a), (xi, yi), fontsize=7, color=color, textcoords="offset points", **place)
        ax.annotate("control", (np.mean(list(pts[N1.label][FLOPS].values())), 0), fontsize=7,
                    xytext=(-6, -12), ha="right", textcoords="offset points")
        ax.axhline(0, color="0.6", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("continuation training FLOPs as run (log 2; lab/flops.py)")
        ax.set_ylabel("held-out loss − the control's, paired by seed (95% interval)", fontsize=8)
        ax.set_title(f"{title}: each arm's paired difference from the control", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("HD's compute: each way of spending it, its arms' loss minus the control's against their FLOPs as run",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return figures.saved(fig, out_dir / "hd_compute.png")
