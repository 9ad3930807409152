"""
The protocols of train_tiny.py's two headline demonstrations, their claims and the one rule that
judges every claim: Hidden Decoding's expansion factor n, continued from one n = 1 checkpoint (HD
§2.3, Table 5), and Think-at-Hard's routing on in-context lookups (TaH §4.3, §5).

A protocol is protocol(preset, ctx, seed, data) -> (rows, trained): `preset` the budget
(train_tiny.Preset), ctx the run's context (trainer.Context), data the task (tasks.py). Every arm
trains from the same seed on the same batches and is evaluated on the held-out set; each result
is a row (result_rows, below: effect, arm, metric, seed, value). `trained` is what `--suite all`'s
extra arms (lab/ablations.py) and the probes (lab/inside.py) build on: this file imports nothing
of lab/, which hangs off it.
"""

import copy
from dataclasses import KW_ONLY, dataclass, field
from typing import NamedTuple, Optional

import numpy as np
import torch

from hd import HDConfig, HiddenDecoding, expand_streams
from tah import TaHConfig, ThinkAtHard, oracle_depths, stage1_loss, stage2_loss
from tasks import answer_exact
from trainer import Stage, batch_gen, evaluate, finite_loss, train

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
# Shared pieces


def backbone_cfg(preset, vocab, **kw):
    """The text backbone's shape from the preset, as keyword arguments of a config (kw: overrides)."""
    p = preset
    return dict(vocab_size=vocab, block_size=p.block, n_layer=p.n_layer, n_embd=p.n_embd, n_head=p.n_head,
                n_kv_head=p.n_kv_head, head_dim=p.head_dim, n_experts=p.n_experts, top_k=p.top_k,
                expert_hidden=p.expert_hidden, ffn_hidden=p.ffn_hidden) | kw


def lm_loss(model, x, y):
    return model(x, y)[1]


# -----------------------------------------------------------------------------
# HD: expansion factor n, continued from one n=1 checkpoint (HD §2.3, Table 5)


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
    preset.hd_ns (n = 1: the control) on the same batches, each expanded with E_k <- E_{k mod n}."""
    base = hd_backbone(preset, ctx, seed, data, "hd")
    rows = result_rows(HD_N, BACKBONE, seed, evaluate(base, data, preset, ctx))
    rows += result_rows(HD_N, JUST_EXPANDED, seed, evaluate(expand_streams(base, 2), data, preset, ctx))
    trained = HDTrained(base, {n: expand_streams(base, n).to(ctx.device) for n in preset.hd_ns}, {})
    for n, model in trained.models.items():
        train(f"hd/n={n} continued", model, lm_loss, data, continuation(preset), ctx=ctx, seed=seed,
              first_batch=preset.hd_base_iters)
        trained.metrics[n] = evaluate(model, data, preset, ctx)
        rows += result_rows(HD_N, hd_cont_arm(n), seed, trained.metrics[n])
    return rows, trained


def hd_claims(ns):
    """Each n > 1 beats n = 1, and each n beats the one before it."""
    more = [n for n in ns if n > 1]
    return ([Claim(f"HD n={n} beats n=1 (continued from one checkpoint)", HD_N, hd_cont_arm(n),
                   baseline=hd_cont_arm(1), metric="loss", sign=-1) for n in more]
            + [Claim(f"HD gain grows with n: n={b} beats n={a}", HD_N, hd_cont_arm(b), baseline=hd_cont_arm(a),
                     metric="loss", sign=-1) for a, b in zip(more, more[1:])])


# -----------------------------------------------------------------------------
# TaH: routing on in-context lookups (TaH §4.3, §5, Tables 1 and 4, Figs. 1b, 4 and 6)


class TaHEffects(NamedTuple):
    """The effects of one TaH task's rows; `inside` (what the second pass does) only on lookups."""
    routing: Effect
    sweep: Effect
    diagnostics: Effect
    inside: Optional[Effect] = None


def tah_effects(tag, task, inside=True):
    return TaHEffects(
        Effect(f"{tag}-routing", f"TaH: routing ({task})",
               "Qwen3-1.7B, avg acc: Standard 47.8, AlwaysThink 44.7, TaH 52.8 with ~6% of tokens iterated (TaH "
               "Tables 1, 9); AlwaysThink corrupts more than it corrects (Fig. 1b); decider imitates the oracle at "
               "~83% (Fig. 6)"),
        Effect(f"{tag}-sweep", f"TaH: decider threshold sweep ({task})",
               "accuracy is robust across thresholds, ~6% iterated at 0.9 (TaH Fig. 4)"),
        Effect(f"{tag}-diagnostics", f"TaH: diagnostics ({task})",
               "overthink (false 'continue') costs about twice as much as underthink (TaH Table 10)"),
        Effect(f"{tag}-inside",
               f"TaH inside: the tokens the decider sends on, top-1 after the first pass -> after the second ({task}; "
               f"counts over the evaluation batches)",
               "Qwen3-1.7B: the predictions of the tokens that think twice change across iterations (TaH Fig. 5); "
               "one token type goes on in 17-34% of its occurrences (TaH Table 6)") if inside else None)


TAH_EFFECTS = tah_effects("tah", "in-context lookups, answers")
STANDARD, ALWAYS = Arm("standard", "Standard"), Arm("always", "AlwaysThink")
TAH_ORACLE = Arm("tah-oracle", "TaH, oracle routing (upper bound)")
TAH_DECIDER = Arm("tah-decider", f"TaH, decider routing (threshold {TaHConfig.threshold})")  # the paper's 0.9
# the TaH arms compared with Standard: (arm, which fine-tuned model, routing mode)
TAH_ARMS = [(ALWAYS, "always", "always"), (TAH_ORACLE, "tah", "oracle"), (TAH_DECIDER, "tah", "decider")]


def tah_config(preset, task, n_layer):
    """The TaH suites' model: the backbone's attention shape, dense, n_layer blocks, a narrow MLP,
    two passes at most, rank-8 LoRA, top-100 logits."""
    return TaHConfig(**backbone_cfg(preset, task.vocab_size, n_experts=0, n_layer=n_layer, kv_mirror=n_layer >= 3,
                                    ffn_hidden=preset.tah_ffn_hidden),
                     logit_topk=min(100, task.vocab_size), max_depth=2, lora_rank=8)


@dataclass(frozen=True, kw_only=True)
class TaHStages:
    """The stages of a TaH suite (trainer.Stage each), and the held-out batches of an evaluation."""
    base: Stage  # the base model, pretrained on the task
    sft: Stage  # each fine-tune from the base: Standard, AlwaysThink, TaH stage 1
    stage2: Stage  # TaH stage 2: the decider alone
    evals: int


def tah_stages(preset, task):
    """The TaH suite's stages: the base model, the fine-tunes (each from the base on the same
    batches) and stage 2. A sequence holds whole problems only: a problem cut off at the block's
    end has targets its pairs or operands cannot serve."""
    p, block = preset, preset.block // task.problem_len * task.problem_len
    stage = lambda steps, lr, warmup: Stage(steps, lr, warmup=min(warmup, steps), batch=p.tah_batch, block=block)
    return TaHStages(base=stage(p.tah_base_iters, p.tah_base_lr, 50), sft=stage(p.tah_sft_iters, p.tah_sft_lr, 10),
                     stage2=stage(p.decider_iters, p.decider_lr, 10), evals=p.tah_eval_batches)


def standard_loss(model, x, y):
    return model(x, y, mode="standard").loss


def always_loss(model, x, y):
    return model(x, y, mode="always").loss


def tah_base(preset, ctx, seed, data, tag, cfg):
    """The "base" model every TaH arm starts from, pretrained on the task."""
    torch.manual_seed(seed)
    base = ThinkAtHard(cfg).to(ctx.device)
    train(f"{tag}/base", base, standard_loss, data, tah_stages(preset, data).base, ctx=ctx, seed=seed)
    return base


def from_base(base):
    """A copy of the base model, to fine-tune."""
    m = ThinkAtHard(base.cfg).to(next(base.parameters()).device)
    m.load_state_dict(base.state_dict())
    return m


@dataclass(kw_only=True)
class TaHTrained:
    """What the TaH protocol hands on: the base, the fine-tuned models by name, the oracle, the
    stages, the task and the run's context, and each routing mode's per-token outcomes on the
    held-out set (tah_eval's); `evaluate` runs the held-out evaluation."""
    base: ThinkAtHard
    models: dict
    oracle: "Oracle"
    stages: TaHStages
    data: object
    ctx: object
    tokens: dict = field(default_factory=dict)

    def evaluate(self, model, mode, threshold=None, depths=None):
        return tah_eval(model, mode, self, threshold, depths)

    def batches(self):
        return eval_batches(self.data, self.stages, self.ctx)


def tah_protocol(preset, ctx, seed, data):
    """TaH's protocol (§4.3, §5) at tiny scale: a base model pretrained on the task; from it, on the
    same batches: Standard (also the oracle's reference, as the paper's SFT model), AlwaysThink
    (2 passes for every token), TaH stage 1 (oracle depths) and stage 2 (the decider alone)."""
    trained = train_tah_arms(preset, ctx, seed, data, "tah")
    rows, trained.tokens = tah_routing_rows(TAH_EFFECTS, trained.models, trained.evaluate, seed)
    return rows, trained


def train_tah_arms(preset, ctx, seed, data, tag, n_layer=None):
    """The base model, then from it on the same batches: Standard, AlwaysThink and TaH's two stages."""
    stages = tah_stages(preset, data)
    base = tah_base(preset, ctx, seed, data, tag, tah_config(preset, data, n_layer or preset.tah_layers))
    after_base = dict(first_batch=stages.base.steps)  # the fine-tunes read the batches after the base model's
    models = {"standard": from_base(base), "always": from_base(base), "tah": from_base(base)}
    train(f"{tag}/Standard", models["standard"], standard_loss, data, stages.sft, ctx=ctx, seed=seed, **after_base)
    oracle = Oracle(copy.deepcopy(models["standard"]).eval().requires_grad_(False), base.cfg.max_depth, data)
    train(f"{tag}/AlwaysThink", models["always"], always_loss, data, stages.sft, ctx=ctx, seed=seed, **after_base)
    train_tah(f"{tag}/TaH", models["tah"], oracle, data, stages, ctx, seed)
    return TaHTrained(base=base, models=models, oracle=oracle, stages=stages, data=data, ctx=ctx)


def train_tah(name, model, oracle, data, stages, ctx, seed):
    """TaH's two stages (§4.3) from the base: stage 1 (backbone and LoRA, the oracle's depths),
    then stage 2 (the decider alone)."""
    train(f"{name} stage 1", model, OracleLoss(oracle), data, stages.sft, ctx=ctx, seed=seed, first_batch=stages.base.steps)
    model.requires_grad_(False).decider.requires_grad_(True)  # stage 2: only the decider learns
    train(f"{name} stage 2 (decider)", model, lambda m, x, y: stage2_loss(m, x, oracle(x, y))[0],
          data, stages.stage2, ctx=ctx, seed=seed, first_batch=stages.base.steps + stages.sft.steps)


class OracleLoss:
    """TaH stage 1's loss on the oracle's depths (TaH Eq. 7)."""

    def __init__(self, oracle):
        self.oracle = oracle

    def __call__(self, model, x, y):
        return stage1_loss(model, x, y, self.oracle(x, y))


class Oracle:
    """Oracle depths (TaH Eq. 7): 2 passes iff the frozen reference's top-1 misses the target and
    the input token is in the response (task.response, the authors' rule)."""

    def __init__(self, ref, max_depth, task):
        self.ref, self.max_depth, self.task = ref, max_depth, task

    @torch.no_grad()
    def __call__(self, x, y):
        return oracle_depths(self.ref(x, mode="standard").logits, y, self.max_depth, self.task.response(x))


def eval_batches(data, stages, ctx):
    """The held-out batches every TaH evaluation reads, of the base stage's shape, on the device."""
    for k in range(stages.evals):
        x, y = data.batch(ctx.eval_split, stages.base.batch, stages.base.block, batch_gen(ctx.eval_seed, k, ctx.eval_split))
        yield x.to(ctx.device), y.to(ctx.device)


@torch.no_grad()
def tah_eval(model, mode, trained, threshold=None, depths=None):
    """Held-out metrics of one routing mode over the answers: loss, accuracy, whole-problem exact
    match, tokens iterated, passes per token, and per-token outcomes (revisions against Standard);
    for the decider, how well it imitates the oracle. depths: a function of the input giving the
    passes to follow (an ablation's router) instead of the mode's."""
    model.eval()
    data, losses, exact, iterated = trained.data, [], [], []
    outcomes = {"ok": [], "first_ok": [], "hard": [], "went": []}
    for x, y in trained.batches():
        hard = trained.oracle(x, y)
        given = hard if mode == "oracle" else None if depths is None else depths(x)  # passes to follow
        out = model(x, y, mode="oracle" if given is not None else mode, depths=given, threshold=threshold)
        keep, ok = y != -1, out.logits.argmax(-1) == y
        losses.append(out.loss.item())
        exact.append(answer_exact(ok, y, data.problem_len, data.answers))
        iterated.append((out.depths > 1).float().mean().item())
        for k, v in (("ok", ok), ("first_ok", out.first_logits.argmax(-1) == y), ("hard", hard > 1),
                     ("went", out.depths > 1)):
            outcomes[k].append(v[keep])
    model.train()
    per_token = {k: torch.cat(v) for k, v in outcomes.items()}
    metrics = {"loss": finite_loss({"loss": float(np.mean(losses))})["loss"],
               "acc": per_token["ok"].float().mean().item(), "exact match": float(np.mean(exact)),
               "iterated": float(np.mean(iterated)), "passes per token": 1 + float(np.mean(iterated))}
    if mode == "decider":  # imitation of the oracle over answers (other positions are trivially "stop")
        went, hard = per_token["went"], per_token["hard"]
        tp, pos, neg = (went & hard).sum().item(), hard.sum().item(), (~hard).sum().item()
        recall, spec = tp / max(pos, 1), (~went & ~hard).sum().item() / max(neg, 1)
        metrics.update({"decider balanced acc": 0.5 * (recall + spec), "decider recall": recall,
                        "decider precision": tp / max(went.sum().item(), 1)})
    return metrics, per_token


def tah_routing_rows(effects, models, evaluate, seed, arms=TAH_ARMS):
    """A TaH suite's rows: Standard, then each of `arms` with its revisions against Standard (the
    decider also: its share of AlwaysThink's gain), the threshold sweep; and each arm's routing
    mode's per-token outcomes (for the diagnostics, lab/inside.py)."""
    std_metrics, std_tokens = evaluate(models["standard"], "standard")
    rows, sweep, outcomes = result_rows(effects.routing, STANDARD, seed, std_metrics), {"standard": std_metrics}, {}
    for arm, which, mode in [a for a in arms if a[1] in models]:
        metrics, tokens = evaluate(models[which], mode)
        # revisions against Standard's prediction of the same token (TaH Fig. 1b)
        metrics["corrected vs Standard"] = int((tokens["ok"] & ~std_tokens["ok"]).sum())
        metrics["corrupted vs Standard"] = int((~tokens["ok"] & std_tokens["ok"]).sum())
        metrics["corrupted - corrected vs Standard"] = (metrics["corrupted vs Standard"]
                                                        - metrics["corrected vs Standard"])
        sweep[models[which].cfg.threshold if mode == "decider" else mode] = metrics
        if mode == "decider":  # cost beside accuracy: how much of AlwaysThink's gain, at what share of its passes
            gain = sweep["always"]["acc"] - std_metrics["acc"]
            metrics["share of AlwaysThink's gain"] = (metrics["acc"] - std_metrics["acc"]) / gain if gain > 0 \
                else float("nan")
        rows += result_rows(effects.routing, arm, seed, metrics)
        outcomes[mode] = tokens
    # the compute-accuracy trade-off (TaH Fig. 4): Standard and AlwaysThink are the end points
    for thr in (0.1, 0.3, 0.5, 0.7, 0.8, 0.95):
        sweep[thr] = evaluate(models["tah"], "decider", thr)[0]
    for key in ["standard"] + sorted(k for k in sweep if not isinstance(k, str)) + ["always"]:
        arm = {"standard": STANDARD, "always": ALWAYS}.get(key) or Arm(f"decider-{key}", f"TaH decider, threshold {key}")
        rows += result_rows(effects.sweep, arm, seed, {k: sweep[key][k] for k in ("iterated", "acc")})
    return rows, outcomes


def tah_claims(effects, task):
    """The TaH claims on one task's rows."""
    r = effects.routing
    return [
        Claim(f"{task}: TaH under the oracle beats Standard (upper bound)", r, TAH_ORACLE, baseline=STANDARD,
              metric="acc", sign=+1),
        Claim(f"{task}: TaH under its decider beats Standard: answers", r, TAH_DECIDER, baseline=STANDARD,
              metric="acc", sign=+1),
        Claim(f"{task}: TaH under its decider beats Standard: whole problems", r, TAH_DECIDER, baseline=STANDARD,
              metric="exact match", sign=+1),
        Claim(f"{task}: the decider iterates at most 10% of positions", r, TAH_DECIDER, baseline=0.10,
              metric="iterated", sign=-1),
        Claim(f"{task}: the decider imitates the oracle: balanced accuracy above 0.85", r, TAH_DECIDER, baseline=0.85,
              metric="decider balanced acc", sign=+1),
        Claim(f"{task}: latent overthinking: AlwaysThink corrupts more than it corrects", r, ALWAYS, baseline=0,
              metric="corrupted - corrected vs Standard", sign=+1),
        Claim(f"{task}: AlwaysThink falls below Standard (paper: 44.7 vs 47.8)", r, ALWAYS, baseline=STANDARD,
              metric="acc", sign=-1),
    ]


TAH_CLAIMS = tah_claims(TAH_EFFECTS, "TaH, lookups")


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("protocols.py", "python train_tiny.py")
