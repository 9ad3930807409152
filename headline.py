"""
The two headline demonstrations of train_tiny.py: Hidden Decoding's expansion factor n,
continued from one n = 1 checkpoint (HD §2.3, Table 5), and Think-at-Hard's routing on in-context
lookups (TaH §4.3, §5). For each paper: its protocol, the rows, the claims, what it looks inside.

A protocol is protocol(P, run, seed, data) -> (rows, trained): P the budget, run the run's
context (trainer.Run), data the task; `trained` is what ablations.py builds its extra arms on.
Each arm trains from the same seed on the same batches.
"""

import copy
import shutil
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import numpy as np
import torch

from hd import HDConfig, HiddenDecoding, expand_streams
from inside import OUTCOMES, iteration_outcomes, stream_line, stream_name, stream_probes, tah_trace
from figures import plot_streams, plot_sweep, plot_trace
from report import Arm, Claim, Effect, result_rows, trace_table
from tah import TaHConfig, ThinkAtHard, oracle_depths
from tasks import Lookups, answer_exact, atomic
from trainer import Stage, batch_gen, evaluate, finite_loss, rank_world, train


# -----------------------------------------------------------------------------
# Shared pieces


def backbone_cfg(P, vocab, **kw):
    base = dict(vocab_size=vocab, block_size=P.block, n_layer=P.n_layer, n_embd=P.n_embd, n_head=P.n_head,
                n_kv_head=P.n_kv_head, head_dim=P.head_dim, n_experts=P.n_experts, top_k=P.top_k,
                expert_hidden=P.expert_hidden, ffn_hidden=P.ffn_hidden)
    base.update(kw)
    return base


def lm_loss(model, x, y):
    return model(x, y)[1]


def save_inside(run, name, text):
    """An analysis of the first seed's models, kept with the run (the report copies it out)."""
    if rank_world()[0] == 0:
        (run.run_dir / "inside").mkdir(exist_ok=True)
        atomic(run.run_dir / "inside" / name, lambda f: f.write(text.encode()))


# -----------------------------------------------------------------------------
# HD: expansion factor n, continued from one n=1 checkpoint (HD §2.3, Table 5)


HD_N = Effect("hd-n", "HD: expansion factor n, continued from one n=1 checkpoint",
              "6B MoE loss: baseline 1.908, HD n=2 1.874, n=3 1.857 (HD Table 5); each stage continues the "
              "previous one's checkpoint (HD §2.3)")


def hd_cont_arm(n):
    return Arm(f"n{n}-continued", f"n={n} continued")


def hd_backbone(P, run, seed, data, tag):
    """The n = 1 model every HD arm continues from, pretrained for P.hd_base_iters steps."""
    torch.manual_seed(seed)
    cfg = HDConfig(**backbone_cfg(P, data.vocab_size, layout=P.layout, window=P.window, n_streams=1))
    base = HiddenDecoding(cfg).to(run.device)
    train(f"{tag}/backbone n=1", base, lm_loss, data, Stage(P.hd_base_iters, P.lr, P.warmup, P.batch, P.block), run,
          seed)
    return base


def continuation(P):
    """Every continued arm's stage: P.hd_cont_iters steps at peak rate P.hd_cont_lr."""
    return Stage(P.hd_cont_iters, P.hd_cont_lr, P.warmup, P.batch, P.block)


BACKBONE = Arm("n1-backbone", "n=1 backbone (start of every arm)")
JUST_EXPANDED = Arm("n2-step0", "n=2 just expanded (step 0)")


@dataclass
class HDTrained:
    """What the HD protocol hands its extra arms: the n = 1 backbone and each n's metrics."""
    base: HiddenDecoding
    headline: dict


def hd_protocol(P, run, seed, data):
    """HD's continued-pretraining protocol (§2.3, §4): an n = 1 backbone, continued as each n of
    P.hd_ns (n = 1: the control) on the same batches, each expanded with E_k <- E_{k mod n}."""
    base = hd_backbone(P, run, seed, data, "hd")
    rows = result_rows(HD_N, BACKBONE, seed, evaluate(base, data, P, run))
    rows += result_rows(HD_N, JUST_EXPANDED, seed, evaluate(expand_streams(base, 2), data, P, run))
    headline, models = {}, {n: expand_streams(base, n).to(run.device) for n in P.hd_ns}
    for n, model in models.items():
        train(f"hd/n={n} continued", model, lm_loss, data, continuation(P), run, seed, first_batch=P.hd_base_iters)
        headline[n] = evaluate(model, data, P, run)
        rows += result_rows(HD_N, hd_cont_arm(n), seed, headline[n])
        if n > 1:  # the probes of HD §5.2-5.3 (seconds)
            rows += hd_inside_rows(model, data, P, run, seed)
            if n == max(P.hd_ns) and seed == run.seeds[0]:
                save_inside(run, "hd_line.md", stream_line(model, data.windows(run.eval_split, P.block)[0][0], data.decode))
    return rows, HDTrained(base, headline)


def hd_claims(ns):
    """Each n > 1 beats n = 1, each n beats the one before it, and the probes' claims per n > 1."""
    more = [n for n in ns if n > 1]
    return ([Claim(f"HD n={n} beats n=1 (continued from one checkpoint)", HD_N, hd_cont_arm(n), hd_cont_arm(1),
                   "loss", -1) for n in more]
            + [Claim(f"HD gain grows with n: n={b} beats n={a}", HD_N, hd_cont_arm(b), hd_cont_arm(a), "loss", -1)
               for a, b in zip(more, more[1:])]
            + [c for n in more for c in hd_inside_claims(n)])


# HD inside (HD §5.2-5.3): the probes of inside.py on the n=2 and n=4 models just trained

INSIDE_WINDOWS = 32  # held-out windows (of P.block tokens) the HD probes read


class HDInside(NamedTuple):
    """The three effects of HD's probes on one n (HD Figs. 6a, 6b, 7)."""
    cosine: Effect
    mass: Effect
    head: Effect


def hd_inside_effects(n):
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


def state_name(l):
    return "input" if l == 0 else f"block {l}"  # states[l]: the embedding, then block l's output


def hd_inside_rows(model, data, P, run, seed):
    """The HD probes (inside.stream_probes) on the first INSIDE_WINDOWS held-out windows."""
    n, layout = model.cfg.n_streams, model.cfg.layout
    cos_fx, mass_fx, head_fx = hd_inside_effects(n)
    xs = data.windows(run.eval_split, P.block)[0][:INSIDE_WINDOWS]
    cross, (same, diff, mass, differs, bits) = stream_probes(model, xs, P.batch)
    least = min(range(len(same)), key=lambda l: same[l] - diff[l])  # "above at every layer" = above here
    rows = []
    for arm, cos in ((DIFFERENT, diff), (SAME, same)):
        rows += result_rows(cos_fx, arm, seed, {**{state_name(l): c for l, c in enumerate(cos)}, LEAST_GAP: cos[least]})
    for j, l in enumerate(cross):
        rows += result_rows(mass_fx, Arm(f"block{l + 1}", f"block {l + 1} ({layout[l]})"), seed,
                            {f"on {stream_name(k, n)}": m for k, m in enumerate(mass[j])})
    for k in range(n):
        rows += result_rows(head_fx, stream_arm(k, n), seed, {DIFFERS: differs[k], BITS: bits[k]})
    return rows + result_rows(head_fx, LOWEST_OTHER, seed, {BITS: min(bits[:-1])})


def hd_inside_claims(n):
    fx = hd_inside_effects(n)
    return [Claim(f"HD n={n} inside: a token's streams are more alike than different tokens' at every layer",
                  fx.cosine, SAME, DIFFERENT, LEAST_GAP, +1),
            Claim(f"HD n={n} inside: the final stream has the lowest entropy", fx.head, stream_arm(n - 1, n),
                  LOWEST_OTHER, BITS, -1)]


def plot_hd_streams(summary, out, ns):
    """HD's streams figure (figures.plot_streams) over the n > 1 of ns."""
    fxs = {n: hd_inside_effects(n) for n in ns if n > 1}
    return plot_streams(summary, out, *({n: getattr(fx, f).name for n, fx in fxs.items()} for f in HDInside._fields))


HD_INSIDE_MD = {"hd_line.md": "HD inside: one held-out line, each stream's top-1 token and its probability (HD Fig. 8)"}


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


TAH_FX = tah_effects("tah", "in-context lookups, answers")
STANDARD, ALWAYS = Arm("standard", "Standard"), Arm("always", "AlwaysThink")
TAH_ORACLE = Arm("tah-oracle", "TaH, oracle routing (upper bound)")
TAH_DECIDER = Arm("tah-decider", f"TaH, decider routing (threshold {TaHConfig.threshold})")  # the paper's 0.9
TAH_ROUTER = Arm("tah-router", "TaH, token-type router (2 passes for every token of a kind that can be hard)")
# the TaH arms compared with Standard: (arm, which fine-tuned model, routing mode)
TAH_ARMS = [(ALWAYS, "always", "always"), (TAH_ORACLE, "tah", "oracle"), (TAH_DECIDER, "tah", "decider"),
            (TAH_ROUTER, "router", "router")]


def tah_config(P, task, n_layer):
    """The TaH suites' model: the backbone's attention shape, dense, n_layer blocks, a narrow MLP,
    two passes at most, rank-8 LoRA, top-100 logits."""
    return TaHConfig(**backbone_cfg(P, task.vocab_size, n_experts=0, n_layer=n_layer, kv_mirror=n_layer >= 3,
                                    ffn_hidden=P.tah_ffn_hidden),
                     logit_topk=min(100, task.vocab_size), max_depth=2, lora_rank=8)


class TaHStages(NamedTuple):
    """The stages of a TaH suite (trainer.Stage each), and the held-out batches of an evaluation."""
    base: Stage  # the base model, pretrained on the task
    sft: Stage  # each fine-tune from the base: Standard, AlwaysThink, TaH stage 1
    stage2: Stage  # TaH stage 2: the decider alone
    evals: int


def tah_stages(P, task):
    """The TaH suite's stages: the base model, the fine-tunes (each from the base on the same
    batches) and stage 2. A sequence holds whole problems only: a problem cut off at the block's
    end has targets its pairs or operands cannot serve."""
    block = P.block // task.problem_len * task.problem_len
    return TaHStages(base=Stage(P.tah_base_iters, P.tah_base_lr, min(50, P.tah_base_iters), P.tah_batch, block),
                     sft=Stage(P.tah_sft_iters, P.tah_sft_lr, min(10, P.tah_sft_iters), P.tah_batch, block),
                     stage2=Stage(P.decider_iters, P.decider_lr, min(10, P.decider_iters), P.tah_batch, block),
                     evals=P.tah_eval_batches)


def standard_loss(model, x, y):
    return model(x, y, mode="standard").loss


def always_loss(model, x, y):
    return model(x, y, mode="always").loss


def tah_base(P, run, seed, data, cfg, tag, stages):
    """The "base" model every TaH arm starts from, pretrained on the task."""
    torch.manual_seed(seed)
    base = ThinkAtHard(cfg).to(run.device)
    train(f"{tag}/base", base, standard_loss, data, stages.base, run, seed)
    return base


def from_base(base, attention="duo"):
    """A copy of the base model, under `attention` (TaH Table 2's ablations), to fine-tune."""
    m = ThinkAtHard(replace(base.cfg, attention=attention)).to(next(base.parameters()).device)
    m.load_state_dict(base.state_dict())
    return m


def tah_protocol(P, run, seed, data, tag="tah", fx=TAH_FX, n_layer=None, router=False):
    """TaH's protocol (§4.3, §5) at tiny scale: a base model pretrained on the task; from it, on the
    same batches: Standard (also the oracle's reference, as the paper's SFT model), AlwaysThink
    (2 passes for every token), TaH stage 1 (oracle depths) and stage 2 (the decider alone); with
    `router`, a token-type router's depths in stage 1 and at evaluation (a skeptic's baseline)."""
    stages = tah_stages(P, data)
    base = tah_base(P, run, seed, data, tah_config(P, data, n_layer or P.tah_layers), tag, stages)
    later = dict(first_batch=stages.base.steps)  # the fine-tunes: the batches after the base model's
    models = {"standard": from_base(base), "always": from_base(base), "tah": from_base(base)}
    train(f"{tag}/Standard", models["standard"], standard_loss, data, stages.sft, run, seed, **later)
    oracle = Oracle(copy.deepcopy(models["standard"]).eval().requires_grad_(False), base.cfg.max_depth, data)
    train(f"{tag}/AlwaysThink", models["always"], always_loss, data, stages.sft, run, seed, **later)
    train_tah(f"{tag}/TaH", models["tah"], oracle, data, stages, run, seed)
    route = TokenRouter(data) if router else None
    if router:
        models["router"] = from_base(base)
        train(f"{tag}/token-type router", models["router"], route.stage1_loss, data, stages.sft, run, seed, **later)
    trained = TaHTrained(tag, base, models, oracle, route, stages, data, run)
    rows = tah_routing_rows(fx, models, trained.evaluate, seed)
    if isinstance(data, Lookups):  # what the second pass does (TaH Figs. 5, 7)
        rows += tah_inside_rows(models["tah"], data, stages, run, seed, fx)
        if tag == "tah" and seed == run.seeds[0]:
            tah_problem(models["tah"], data, stages, run)
    return rows, trained


def train_tah(name, model, oracle, data, stages, run, seed):
    """TaH's two stages (§4.3) from the base: stage 1 (backbone and LoRA, the oracle's depths),
    then stage 2 (the decider alone)."""
    train(f"{name} stage 1", model, OracleLoss(oracle), data, stages.sft, run, seed, first_batch=stages.base.steps)
    model.requires_grad_(False).decider.requires_grad_(True)  # stage 2: only the decider learns
    train(f"{name} stage 2 (decider)", model, lambda m, x, y: m.stage2_loss(x, oracle(x, y))[0],
          data, stages.stage2, run, seed, first_batch=stages.base.steps + stages.sft.steps)


@dataclass
class TaHTrained:
    """What the TaH protocol hands its extra arms (ablations.py): the base, the fine-tuned models
    by name, the oracle, the token-type router (or None), the stages, and `evaluate`."""
    tag: str
    base: ThinkAtHard
    models: dict
    oracle: "Oracle"
    route: Optional["TokenRouter"]
    stages: TaHStages
    data: object
    run: object

    def evaluate(self, model, mode, threshold=None):
        return tah_eval(model, self.data, self.stages, self.run, mode, self.oracle, threshold, self.route)


class OracleLoss:
    """TaH stage 1's loss on the oracle's depths (TaH Eq. 7)."""

    def __init__(self, oracle):
        self.oracle = oracle

    def __call__(self, model, x, y):
        return model.stage1_loss(x, y, self.oracle(x, y))


class Oracle:
    """Oracle depths (TaH Eq. 7): 2 passes iff the frozen reference's top-1 misses the target and
    the input token is in the response (task.response, the authors' rule)."""

    def __init__(self, ref, max_depth, task):
        self.ref, self.max_depth, self.task = ref, max_depth, task

    @torch.no_grad()
    def __call__(self, x, y):
        return oracle_depths(self.ref(x, mode="standard").logits, y, self.max_depth, self.task.response(x))


class TokenRouter:
    """A router that reads the token alone: 2 passes for every token of a kind that can need more
    (task.sometimes_hard), in stage 1 and at evaluation; it has no decider."""

    def __init__(self, task):
        if not callable(getattr(task, "sometimes_hard", None)):
            raise ValueError(f"TokenRouter reads a task's token kinds (sometimes_hard, as tasks.Lookups has), got "
                             f"{type(task).__name__}")
        self.task = task

    def __call__(self, x):
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"TokenRouter routes token ids (an integer tensor), got {getattr(x, 'dtype', type(x))}")
        return 1 + self.task.sometimes_hard(x).long()

    def stage1_loss(self, model, x, y):
        return model.stage1_loss(x, y, self(x))


def eval_batches(data, stages, run):
    """The held-out batches every TaH evaluation reads, of the base stage's shape, on the device."""
    for k in range(stages.evals):
        x, y = data.batch(run.eval_split, stages.base.batch, stages.base.block, batch_gen(run.eval_seed, k, run.eval_split))
        yield x.to(run.device), y.to(run.device)


@torch.no_grad()
def tah_eval(model, data, stages, run, mode, oracle, threshold=None, route=None):
    """Held-out metrics of one routing mode ("router": route's depths) over the answers: loss,
    accuracy, whole-problem exact match, tokens iterated, passes per token, and per-token outcomes
    (revisions against Standard); for the decider, how well it imitates the oracle."""
    model.eval()
    losses, ems, iterated, outcomes = [], [], [], {"ok": [], "first_ok": [], "hard": [], "went": []}
    for x, y in eval_batches(data, stages, run):
        depths = oracle(x, y)
        given = depths if mode == "oracle" else route(x) if mode == "router" else None  # depths to follow
        out = model(x, y, mode="oracle" if given is not None else mode, depths=given, threshold=threshold)
        keep, ok = y != -1, out.logits.argmax(-1) == y
        losses.append(out.loss.item())
        ems.append(answer_exact(ok, y, data.problem_len, data.answers))
        iterated.append((out.depths > 1).float().mean().item())
        for k, v in (("ok", ok), ("first_ok", out.first_logits.argmax(-1) == y), ("hard", depths > 1),
                     ("went", out.depths > 1)):
            outcomes[k].append(v[keep])
    model.train()
    o = {k: torch.cat(v) for k, v in outcomes.items()}
    r = {"loss": finite_loss({"loss": float(np.mean(losses))})["loss"], "acc": o["ok"].float().mean().item(),
         "exact match": float(np.mean(ems)),
         "iterated": float(np.mean(iterated)), "passes per token": 1 + float(np.mean(iterated))}
    if mode == "decider":  # imitation of the oracle over answers (other positions are trivially "stop")
        went, hard = o["went"], o["hard"]
        tp, pos, neg = (went & hard).sum().item(), hard.sum().item(), (~hard).sum().item()
        recall, spec = tp / max(pos, 1), (~went & ~hard).sum().item() / max(neg, 1)
        r.update({"decider balanced acc": 0.5 * (recall + spec), "decider recall": recall,
                  "decider precision": tp / max(went.sum().item(), 1)})
    return r, o


def tah_routing_rows(fx, models, ev, seed):
    """A TaH suite's rows: Standard, then each of TAH_ARMS with its revisions against Standard (the
    decider also: its share of AlwaysThink's gain), the diagnostics, the threshold sweep."""
    r_std, o_std = ev(models["standard"], "standard")
    rows, sweep = result_rows(fx.routing, STANDARD, seed, r_std), {"standard": r_std}
    for arm, which, mode in [a for a in TAH_ARMS if a[1] in models]:
        r, o = ev(models[which], mode)
        # revisions against Standard's prediction of the same token (TaH Fig. 1b)
        r["corrected vs Standard"] = int((o["ok"] & ~o_std["ok"]).sum())
        r["corrupted vs Standard"] = int((~o["ok"] & o_std["ok"]).sum())
        r["corrupted - corrected vs Standard"] = r["corrupted vs Standard"] - r["corrected vs Standard"]
        sweep[models[which].cfg.threshold if mode == "decider" else mode] = r
        if mode == "decider":  # cost beside accuracy: how much of AlwaysThink's gain, at what share of its passes
            gain = sweep["always"]["acc"] - r_std["acc"]
            r["share of AlwaysThink's gain"] = (r["acc"] - r_std["acc"]) / gain if gain > 0 else float("nan")
        rows += result_rows(fx.routing, arm, seed, r) + tah_diagnostics(fx, mode, o, seed)
    # the compute-accuracy trade-off (TaH Fig. 4): Standard and AlwaysThink are the end points
    for thr in (0.1, 0.3, 0.5, 0.7, 0.8, 0.95):
        sweep[thr] = ev(models["tah"], "decider", thr)[0]
    for key in ["standard"] + sorted(k for k in sweep if not isinstance(k, str)) + ["always"]:
        arm = {"standard": STANDARD, "always": ALWAYS}.get(key) or Arm(f"decider-{key}", f"TaH decider, threshold {key}")
        rows += result_rows(fx.sweep, arm, seed, {k: sweep[key][k] for k in ("iterated", "acc")})
    return rows


def tah_diagnostics(fx, mode, o, seed):
    """Oracle: pass 1 alone against the sum. Decider: the easy answers it sends on (overthinking)."""
    share = lambda m: m.float().mean().item() if m.numel() else float("nan")
    if mode == "oracle":
        h = o["hard"]
        return result_rows(fx.diagnostics, Arm("oracle", "TaH under the oracle"), seed, {
            "hard share of answers": share(h), "pass-1 acc, easy answers": share(o["first_ok"][~h]),
            "pass-1 acc, hard answers": share(o["first_ok"][h]), "summed acc, hard answers": share(o["ok"][h])})
    if mode == "decider":
        fp = o["went"] & ~o["hard"]  # easy answers the decider sent on
        return result_rows(fx.diagnostics, Arm("decider", "TaH under the decider"), seed, {
            "easy answers sent on": share(fp), "of those, right after pass 1": share(o["first_ok"][fp]),
            "of those, right after pass 2": share(o["ok"][fp])})
    return []


def tah_claims(fx, task):
    """The TaH claims on one task's rows."""
    r = fx.routing
    return [
        Claim(f"{task}: TaH under the oracle beats Standard (upper bound)", r, TAH_ORACLE, STANDARD, "acc", +1),
        Claim(f"{task}: TaH under its decider beats Standard: answers", r, TAH_DECIDER, STANDARD, "acc", +1),
        Claim(f"{task}: TaH under its decider beats Standard: whole problems", r, TAH_DECIDER, STANDARD,
              "exact match", +1),
        Claim(f"{task}: the decider iterates at most 10% of positions", r, TAH_DECIDER, 0.10, "iterated", -1),
        Claim(f"{task}: the decider imitates the oracle: balanced accuracy above 0.85", r, TAH_DECIDER, 0.85,
              "decider balanced acc", +1),
        Claim(f"{task}: latent overthinking: AlwaysThink corrupts more than it corrects", r, ALWAYS, 0,
              "corrupted - corrected vs Standard", +1),
        Claim(f"{task}: AlwaysThink falls below Standard (paper: 44.7 vs 47.8)", r, ALWAYS, STANDARD, "acc", -1),
    ]


# TaH inside (TaH Figs. 5 and 7): the probes of inside.py on the lookups model just trained

KINDS = {0: Arm("other", "other tokens (target: the next token)"), 1: Arm("one-hop", "one-hop queries"),
         2: Arm("two-hop", "two-hop queries"), 3: Arm("three-hop", "three-hop queries")}
QUERIES, FIXES, SENT = Arm("queries", "every query token"), "corrected - corrupted", "share of the kind sent on"


@torch.no_grad()
def tah_inside_rows(model, data, stages, run, seed, fx, threshold=None):
    """The tokens the decider sends on: top-1 after the first and the last pass against the next
    token, by query kind (TaH Fig. 5), and each kind's share sent on (per problem: all queries')."""
    model.eval()
    counts, totals, queries = {}, {}, [0, 0]  # queries: sent on, all
    for x, y in eval_batches(data, stages, run):
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
    rows, effect = [], fx.inside
    for h in sorted(totals):  # every kind in the data, sent on or not
        c = counts.get(h, dict.fromkeys(OUTCOMES, 0))
        rows += result_rows(effect, KINDS[h], seed, {**c, FIXES: c[OUTCOMES[0]] - c[OUTCOMES[1]],
                                                     SENT: sum(c.values()) / totals[h]})
    if data.per_problem:  # one token kind for every query: how often the decider sends it on
        rows += result_rows(effect, QUERIES, seed, {SENT: queries[0] / max(queries[1], 1)})
    return rows


def tah_problem(model, data, stages, run):
    """The first held-out problem with a two-hop query through the decider (TaH Figs. 5, 7), kept
    with the run as tah_problem.md (a row per token) and tah_problem.png."""
    x, _ = next(eval_batches(data, stages, run))
    L = data.problem_len
    problems = x[:, :x.size(1) // L * L].reshape(-1, L)
    idx = problems[(data.hops(problems) == 2).any(1).nonzero()[0, 0]][None]
    model.eval()
    trace = tah_trace(model, idx)
    model.train()
    names = [data.describe(t) for t in idx[0].tolist()]
    save_inside(run, "tah_problem.md", trace_table(trace, names, data.describe))
    if rank_world()[0] == 0:
        plot_trace(trace, names, model.cfg.threshold, run.run_dir / "inside" / "tah_problem.png", data.describe)


def inside_claims(fx, task):
    return [Claim(f"{task}: among the two-hop answers sent on, the second pass corrects more than it corrupts",
                  fx.inside, KINDS[2], 0, FIXES, +1)]


def plot_tah_tradeoff(summary, out, eval_set):
    """Every TaH task's threshold sweep in the rows, one panel each."""
    sweeps = list(dict.fromkeys(s["effect"] for s in summary if s["effect"].startswith("TaH: decider threshold")))
    return plot_sweep(summary, out, eval_set, sweeps, (STANDARD.label, ALWAYS.label))


def copy_tah_problem(run_dir, out):
    trace = run_dir / "inside" / "tah_problem.png"
    return shutil.copyfile(trace, out / trace.name) if trace.exists() else None


TAH_CLAIMS = tah_claims(TAH_FX, "TaH, lookups") + inside_claims(TAH_FX, "TaH, lookups")
TAH_INSIDE_MD = {"tah_problem.md": "TaH inside: one held-out lookup problem through the decider (TaH Figs. 5 and 7)"}
