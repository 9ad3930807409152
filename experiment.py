"""
What the two papers' experiments share (hd_experiment.py, tah_experiment.py): the rows every result
is written in and the one rule that judges every claim; the text backbone's shape and the LM loss;
attention weights recorded from any model built on moe.py; what a protocol keeps of its first seed.

A protocol is protocol(preset, ctx, seed, data) -> (rows, trained): `preset` the budget
(train_tiny.Preset), ctx the run's context (trainer.Context), data the task (tasks.py). Every arm
trains from the same seed on the same batches and is evaluated on the held-out set; each result
is a row (result_rows, below: effect, arm, metric, seed, value). `trained` is what `--suite all`'s
extra arms (lab/ablations.py) build on: these files import nothing of lab/, which hangs off them.
"""

import math
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

import moe

# -----------------------------------------------------------------------------
# The rows: an arm's results in one effect, one row per metric and seed; claims match on the ids


@dataclass(frozen=True)
class Effect:
    """One comparison of the report, with the paper's figure it is set against. `id` is what
    claims match rows on; `name` is the caption, free to change."""
    id: str
    name: str
    paper: str

@dataclass(frozen=True)
class Arm:
    """One arm of an effect: `id` is what claims match rows on; `label` is what the tables show."""
    id: str
    label: str

def result_rows(effect, arm, seed, metrics):
    """One row per metric of one arm's results in one seed."""
    if not (isinstance(effect, Effect) and isinstance(arm, Arm)):
        raise TypeError(f"result_rows takes an Effect and an Arm, got {type(effect).__name__} and {type(arm).__name__}")
    return [dict(effect=effect.name, effect_id=effect.id, paper=effect.paper, arm=arm.label, arm_id=arm.id, metric=m,
                 seed=seed, value=v) for m, v in metrics.items()]

@dataclass
class Claim:
    """The paper says `arm` differs from `baseline` (another Arm, or a target number) in `metric`
    with sign `sign` (+1: higher)."""
    name: str
    effect: Effect
    arm: Arm
    _: KW_ONLY
    baseline: object
    metric: str
    sign: int
    margin: float = 0.0  # a non-inferiority claim: the arm may fall short of the baseline by this much

    def __post_init__(self):
        if not (isinstance(self.effect, Effect) and isinstance(self.arm, Arm)
                and isinstance(self.baseline, (Arm, int, float))):
            raise TypeError(f"claim {self.name!r}: an Effect, an Arm and a baseline Arm or number, got "
                            f"{type(self.effect).__name__}, {type(self.arm).__name__}, {type(self.baseline).__name__}")

def finite_reals(values, name):
    """values as a 1-D float array, or one line saying why they are not finite reals."""
    if isinstance(values, np.ndarray):
        ok = values.ndim == 1 and values.dtype.kind in "fiu"
    else:
        ok = isinstance(values, (list, tuple)) and all(
            isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) for v in values)
    if not ok or not np.all(np.isfinite(np.asarray(values, dtype=float))):
        raise ValueError(f"{name} must be finite real numbers in one dimension, got {values!r}")
    if len(values) == 0:
        raise ValueError(f"{name} is empty: there is nothing to judge")
    return np.asarray(values, dtype=float)


# -----------------------------------------------------------------------------
# The rule: a claim is an arm against a baseline in one metric with the paper's sign, judged on
# the paired differences over seeds (same seed: same init and batches, so most of the spread cancels)


RULE = ("shown: over >= 2 seeds, the paired difference has the paper's sign in every seed and its mean "
        "exceeds twice its standard deviation across seeds; otherwise not shown")

def verdict(deltas, sign):
    """The rule (RULE) on per-seed paired differences and the paper's direction (+1 or -1)."""
    if type(sign) is not int or sign not in (1, -1):
        raise ValueError(f"sign must be the int +1 or -1 (the paper's direction), got {sign!r}")
    d = finite_reals(deltas, "deltas")
    if len(d) < 2:
        return "not shown"
    right_sign = np.all(np.sign(d) == sign)
    with np.errstate(over="ignore"):
        mean, std = d.mean(), d.std(ddof=1)
    if not (np.isfinite(mean) and np.isfinite(std)):
        raise ValueError(f"deltas overflow a float's range (mean {mean}): a mean that overflowed is no verdict")
    return "shown" if right_sign and abs(mean) > 2 * std else "not shown"

def claim_deltas(rows, claim):
    """Per-seed differences for a claim, from the rows, matched by the effect's and arms' ids."""
    val = {(r["arm_id"], r["metric"], r["seed"]): r["value"] for r in rows if r["effect_id"] == claim.effect.id}
    arm, m = claim.arm.id, claim.metric
    seeds = sorted({s for (a, _, s) in val if a == arm})
    if not isinstance(claim.baseline, Arm):  # a target number
        return [val[(arm, m, s)] - claim.baseline for s in seeds if (arm, m, s) in val]
    base = claim.baseline.id
    return [val[(arm, m, s)] - val[(base, m, s)] for s in seeds if (arm, m, s) in val and (base, m, s) in val]

def judge(rows, claims):
    """Every claim whose suite ran, by the rule; a claim whose arms have no rows is an error (a bug)."""
    out, ran = [], {r["effect_id"] for r in rows}
    for c in claims:
        if c.effect.id not in ran:
            continue
        d = claim_deltas(rows, c)
        if not d:
            raise ValueError(f"claim {c.name!r} finds no {c.metric!r} rows of arm {c.arm.id!r} against "
                             f"{getattr(c.baseline, 'id', c.baseline)!r} in effect {c.effect.id!r}")
        out.append(dict(claim=c.name, metric=c.metric, deltas=d, mean=float(np.mean(d)),
                        std=float(np.std(d, ddof=1)) if len(d) > 1 else 0.0,
                        verdict=verdict([x + c.sign * c.margin for x in d], c.sign) if np.all(np.isfinite(d))
                        else "not shown"))  # a seed without a value (a rate over no tokens) shows nothing
    return out


# -----------------------------------------------------------------------------
# Shared pieces: the backbone's shape, the LM loss, attention weights, what a protocol keeps


def backbone_cfg(preset, vocab, **kw):
    """The text backbone's shape from the preset, as keyword arguments of a config (kw: overrides)."""
    p = preset
    return dict(vocab_size=vocab, block_size=p.block, n_layer=p.n_layer, n_embd=p.n_embd, n_head=p.n_head,
                n_kv_head=p.n_kv_head, head_dim=p.head_dim, n_experts=p.n_experts, top_k=p.top_k,
                expert_hidden=p.expert_hidden, ffn_hidden=p.ffn_hidden) | kw

def lm_loss(model, x, y):
    return model(x, y)[1]


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


def keep(ctx, name, text, picture=None):
    """An analysis of the first seed's models kept with the run as `name` (markdown text; picture:
    what lab/ draws beside it), through the run's context (lab/files.py's Kept; None: not kept)."""
    if ctx.keep is not None:
        ctx.keep(ctx, name, text, picture)


def cell(text):
    """A token as a markdown table cell."""
    return "`" + text.replace("\n", "⏎").replace("|", "\\|").replace("`", "'") + "`"


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("experiment.py", "python train_tiny.py")
