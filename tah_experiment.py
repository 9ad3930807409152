"""
Think-at-Hard's experiment (TaH §4.3, §5; Tables 1, 4 and 10, Figs. 1b and 4-7): routing on
in-context lookups, and what the second pass does. train_tiny.py's `--suite tah`.

The protocol: a base model is pretrained on the task; from it, on the same batches, Standard (one
pass a token; also the oracle's reference), AlwaysThink (two passes for every token), and TaH's
two stages (stage 1 on the oracle's depths, stage 2 the decider alone). Each routing mode is
evaluated on the held-out set over the answers, with its revisions against Standard, and the
decider over a sweep of thresholds. The probes: the diagnostics of Table 10, and the tokens the
decider sends on, before and after the second pass (Fig. 5), one problem traced (Figs. 5, 7).
The rows' vocabulary and the rule are experiment.py's.
"""

import copy
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np
import torch

from experiment import Arm, Claim, Effect, backbone_cfg, cell, keep, recording_attention, result_rows
from tah import DepthKV, TaHConfig, ThinkAtHard, oracle_depths, stage1_loss, stage2_loss
from tasks import answer_exact
from trainer import Stage, batch_gen, finite_loss, train

# -----------------------------------------------------------------------------
# The protocol: routing on in-context lookups (TaH §4.3, §5, Tables 1 and 4, Figs. 1b, 4 and 6)


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
    (2 passes for every token), TaH stage 1 (oracle depths) and stage 2 (the decider alone); each
    evaluated, with the probes of what the second pass does (tah_results)."""
    trained = train_tah_arms(preset, ctx, seed, data, "tah")
    return tah_results(TAH_EFFECTS, trained, seed, keep_problem=True), trained


def tah_results(effects, trained, seed, arms=TAH_ARMS, evaluate=None, keep_problem=False):
    """A TaH suite's rows from what it trained: the routing rows of Standard and `arms`
    (tah_routing_rows, each routing mode's outcomes kept in trained.tokens), the diagnostics and
    the probes (tah_probes). evaluate: the held-out evaluation (default: trained.evaluate)."""
    rows, trained.tokens = tah_routing_rows(effects, trained.models, evaluate or trained.evaluate, seed, arms)
    return tah_probes(rows, trained, effects, seed, keep_problem)


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
    mode's per-token outcomes (for the diagnostics, below)."""
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


# -----------------------------------------------------------------------------
# The probes: the diagnostics (TaH Table 10), what the second pass changes (Fig. 5), one problem traced (Fig. 7)


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
    """`rows` (a TaH protocol's, from what it trained: TaHTrained) with the probes' rows:
    the diagnostics of each routing mode it evaluated, right after the routing rows (where the
    report shows them), and on lookups what the second pass does (TaH Figs. 5, 7); keep_problem:
    the first seed's two-hop problem kept with the run too (the headline suite's)."""
    diagnostics = [r for mode, tokens in trained.tokens.items() for r in tah_diagnostics(effects, mode, tokens, seed)]
    at = max((i + 1 for i, r in enumerate(rows) if r["effect_id"] == effects.routing.id), default=len(rows))
    rows = rows[:at] + diagnostics + rows[at:]
    if effects.inside is not None:
        rows += tah_rows(trained.models["tah"], trained.batches(), trained.data, seed, effects.inside)
        if keep_problem and seed == trained.ctx.seeds[0]:
            keep_tah_problem(trained.ctx, trained.models["tah"], next(trained.batches())[0], trained.data)
    return rows


def inside_claims(effect, task):
    """What the probes say on one task's lookups."""
    return [Claim(f"{task}: among the two-hop answers sent on, the second pass corrects more than it corrupts",
                  effect, KINDS[2], baseline=0, metric=FIXES, sign=+1)]


def keep_tah_problem(ctx, model, x, data):
    """The first problem of the held-out batch x with a two-hop query through the decider (TaH Figs.
    5, 7), kept with the run as tah_problem.md (a row per token) and tah_problem.png."""
    L = data.problem_len
    problems = x[:, :x.size(1) // L * L].reshape(-1, L)
    idx = problems[(data.hops(problems) == 2).any(1).nonzero()[0, 0]][None]
    model.eval()
    trace = tah_trace(model, idx)
    model.train()
    names = [data.describe(t) for t in idx[0].tolist()]
    keep(ctx, "tah_problem.md", trace_table(trace, names, data.describe),
         picture=dict(trace=trace, names=names, threshold=model.cfg.threshold, describe=data.describe))


def trace_table(trace, names, describe):
    """One TaH forward (tah_trace), a row per token: passes, p(go on), top-1 after pass 1
    and after the last."""
    lines = ["| position | token | next | passes | p(go on) after pass 1 | top-1 after pass 1 | top-1 after the last |",
             "|---|---|---|---|---|---|---|"]
    for i, name in enumerate(names):
        nxt = cell(names[i + 1]) if i + 1 < len(names) else ""
        lines.append(f"| {i} | {cell(name)} | {nxt} | {trace['passes'][i].item()} | {trace['go'][i].item():.3f} | "
                     f"{cell(describe(trace['first'][i].item()))} | {cell(describe(trace['final'][i].item()))} |")
    return "\n".join(lines)


KEPT = {"tah_problem.md": "TaH inside: one held-out lookup problem through the decider (TaH Figs. 5 and 7)"}
TAH_CLAIMS = tah_claims(TAH_EFFECTS, "TaH, lookups") + inside_claims(TAH_EFFECTS.inside, "TaH, lookups")


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("tah_experiment.py", "python train_tiny.py --suite tah")
