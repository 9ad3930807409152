"""
Tiny training runs that show each effect of the three papers with numbers.

    python train_tiny.py                      # the headline suites (HD, TaH), the measured protocol
    python train_tiny.py --suite all          # every suite with every ablation arm
    python train_tiny.py --smoke              # every suite's code path in seconds
    torchrun --nproc_per_node=8 train_tiny.py # DDP: the global batch split over ranks

Read in the order a run happens: the presets, the suites (each with its effects, arms, protocol
and claims), the command line, main. The data lives in tasks.py (Shakespeare through cl100k BPE
for HD and MoE; in-context lookups and addition for TaH), the training loop in trainer.py, the
verdicts, tables and plots in report.py.

Each arm trains from the same seed on the same batches; results (mean and spread over seeds,
the paper's figure beside them) are printed as a markdown table and written to
`<out>/results.md` and `<out>/results.json`. A killed run resumes from its checkpoints.
"""

import argparse
import contextlib
import copy
import hashlib
import json
import math
import multiprocessing
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hd import HDConfig, HiddenDecoding, expand_streams
from inside import OUTCOMES, head_probes, iteration_outcomes, stream_cosine, stream_mass, stream_states, tah_trace
from moe import ModelConfig, Transformer
from report import (RULE, Claim, Effect, judge, plot, plot_streams, plot_sweep, plot_trace,
                    summarize, table)
from tah import TaHConfig, ThinkAtHard, oracle_depths
from tasks import Arith, Lookups, atomic, load_text
from trainer import (DDP, MASTER, PROGRESS, WORLD, batch_gen, evaluate, finite_loss, load_checkpoint, log, probing,
                     train)


# -----------------------------------------------------------------------------
# Presets


@dataclass
class Preset:
    """One budget for every suite. The HD and MoE suites train the text backbone; the TaH suites
    train their own small dense models on synthetic tasks (TaH needs a model that is short of
    depth for its hardest tokens, see suite_tah): in-context lookups (the headline) and
    addition (the contrast, --suite all)."""
    # text backbone (HD, MoE)
    n_layer: int = 6
    n_embd: int = 64
    n_head: int = 12
    n_kv_head: int = 2
    head_dim: int = 16
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 64
    ffn_hidden: int = 192
    layout: str = "IIFLII"
    window: int = 16
    block: int = 64  # tokens per sequence
    batch: int = 8  # global batch, sequences
    iters: int = 300  # --suite all: every from-scratch HD arm and MoE arm
    lr: float = 3e-3
    warmup: int = 20
    hd_base_iters: int = 150  # HD: the n=1 backbone every arm continues from
    hd_cont_iters: int = 160  # HD: steps every arm continues from the n=1 checkpoint
    hd_cont_lr: float = 3e-3  # HD: the continuation's peak learning rate (warmup, then cosine)
    # TaH: in-context lookups (Lookups) on tah_layers; addition (Arith, --suite all) on add_layers
    symbols: int = 8
    queries: int = 5
    two_hop: float = 0.3
    three_hop: float = 0.2  # --suite tah3 (TaH-3 vs TaH-2): the share of three-hop queries
    tah_layers: int = 1
    tah_ffn_hidden: int = 48  # narrow: one pass cannot decode two hops from the bag of listed pairs
    digits: int = 4
    add_layers: int = 3
    tah_batch: int = 32
    tah_base_iters: int = 500  # the "base" model every TaH arm starts from
    tah_base_lr: float = 2e-3
    tah_sft_iters: int = 400  # Standard, AlwaysThink and TaH stage 1, each from the base
    tah_sft_lr: float = 2e-3
    decider_iters: int = 400  # TaH stage 2
    decider_lr: float = 3e-3
    tah_eval_batches: int = 10
    seeds: int = 5
    plays: tuple = ("macbeth", "hamlet", "othello", "king-lear")


PRESETS = {
    "default": Preset(),  # the measured protocol (README, RESULTS), on any device
    "large": Preset(  # not yet measured: wider, deeper, longer, for a GPU; opt-in (--preset large)
n_layer=8, n_embd=192, n_head=18, n_kv_head=3, head_dim=32, n_experts=16, top_k=2,
                  expert_hidden=192, ffn_hidden=576, layout="IIFIILII", window=64, block=128,
                  batch=32, iters=600, lr=2e-3, warmup=50, hd_base_iters=600, hd_cont_iters=300, hd_cont_lr=2e-3,
                  digits=6, add_layers=4, tah_batch=64, tah_base_iters=1500, tah_sft_iters=800,
                  decider_iters=1200, seeds=5, plays=()),
    "smoke": Preset(n_layer=3, n_embd=32, n_head=6, n_kv_head=2, head_dim=8, n_experts=4, expert_hidden=32,
                    ffn_hidden=64, layout="IFL", window=8, block=32, batch=4, iters=4, warmup=2,
                    hd_base_iters=4, hd_cont_iters=3, symbols=4, queries=2, digits=2, tah_batch=4,
                    tah_base_iters=4, tah_sft_iters=3, decider_iters=3, tah_eval_batches=1, seeds=1,
                    plays=("macbeth",)),
}


# -----------------------------------------------------------------------------
# Suites
# Each returns rows {effect, paper, arm, metric, seed, value}. An effect's first arm is the
# baseline its other arms are compared with, seed by seed; the report reads only rows. Each
# suite's effects, arms, protocol and claims sit together.


def backbone_cfg(P, vocab, **kw):
    base = dict(vocab_size=vocab, block_size=P.block, n_layer=P.n_layer, n_embd=P.n_embd, n_head=P.n_head,
                n_kv_head=P.n_kv_head, head_dim=P.head_dim, n_experts=P.n_experts, top_k=P.top_k,
                expert_hidden=P.expert_hidden, ffn_hidden=P.ffn_hidden)
    base.update(kw)
    return base


def lm_loss(model, x, y):
    return model(x, y)[1]


def result_rows(effect, arm, seed, r):
    return [dict(effect=effect.name, paper=effect.paper, arm=arm, metric=m, seed=seed, value=v) for m, v in r.items()]


# -----------------------------------------------------------------------------
# HD: expansion factor n, continued from one n=1 checkpoint (and, --suite all, ablations)


HD_N = Effect("HD: expansion factor n, continued from one n=1 checkpoint",
              "6B MoE loss: baseline 1.908, HD n=2 1.874, n=3 1.857 (HD Table 5); each stage continues the "
              "previous one's checkpoint (HD §2.3)")
HD_SCRATCH = Effect("HD: expansion factor n, from scratch",
                    "HD is continued pretraining; from scratch is this project's contrast")
HD_LAYOUTS_CONT = Effect("HD: stream-factorized layouts (n=2, continued from the n=1 checkpoint)",
                         "21B avg: baseline 54.33; SF(1) +1.55, SF(4) +2.16, all-full +2.62 (HD Table 4)")
HD_OBJECTIVE_CONT = Effect("HD: training objective (n=2, continued from the n=1 checkpoint)",
                           "loss: final 1.874 < sum 1.877 < all 1.880 (HD Table 5)")
HD_KV_CONT = Effect("HD: per-stream vs shared KV (n=2, continued from the n=1 checkpoint)",
                    "avg: per-stream 64.23 vs shared 63.46 (1 full layer) (HD Table 6)")

# arm names: the suites write them, the claims read them
HD_CONT_NS = (1, 2, 4)  # the HD headline's arms, each continued from the n=1 checkpoint


def hd_cont_arm(n):
    return f"n={n} continued"


def hd_scratch_arms():
    """--suite all: the contrast, n = 1, 2, 4 trained from scratch for P.iters steps, as (arm,
    n)."""
    return [(f"n={n} from scratch", n) for n in HD_CONT_NS]


NO_EXPANSION = "no expansion (n=1 continued)"
ALL_FULL, FEW_FULL = "layout all-full (every layer F)", "layout few-full (--layout, the default)"
ONE_FULL, ALL_INTRA = "layout one-full (the last layer F, the others I)", "layout all-intra (every layer I)"
PER_STREAM_KV, SHARED_KV = "per-stream KV", "shared KV"


def hd_continued_ablation_arms(P):
    """--suite all: the ablations as the paper runs them (HD Tables 4-6: continued pretraining),
    each an n=2 model expanded from the n=1 checkpoint and continued for P.hd_cont_iters steps,
    as (effect, arm, how): how is a dict of expand_streams overrides, or an int n whose headline
    arm this arm is (layout P.layout, objective final, per-stream KV), its rows reused."""
    L = P.n_layer
    layouts = [(ALL_FULL, "F" * L), (FEW_FULL, P.layout), (ONE_FULL, "I" * (L - 1) + "F"), (ALL_INTRA, "I" * L)]
    return ([(HD_LAYOUTS_CONT, NO_EXPANSION, 1)]
            + [(HD_LAYOUTS_CONT, arm, 2 if lay == P.layout else dict(layout=lay)) for arm, lay in layouts]
            + [(HD_OBJECTIVE_CONT, f"objective {o}", 2 if o == "final" else dict(objective=o))
               for o in ("final", "all", "sum")]
            + [(HD_KV_CONT, PER_STREAM_KV, 2), (HD_KV_CONT, SHARED_KV, dict(shared_kv=True))])


def hd_continuations(base, ns, device):
    """The HD protocol (HD §2.3, §4): every arm starts from the same trained n = 1 model,
    expanded to n streams with E_k <- E_{k mod n}; n = 1 is the control that simply trains on."""
    return {n: expand_streams(base, n).to(device) for n in ns}


def suite_hd(P, args, seed, data, every_arm):
    """Pretrain an n = 1 backbone, then continue it as n = 1 (control), 2 and 4 on the same
    batches for the same steps (the paper's continued-pretraining protocol)."""
    rows, V = [], data.vocab_size
    torch.manual_seed(seed)
    base = HiddenDecoding(HDConfig(**backbone_cfg(P, V, layout=P.layout, window=P.window, n_streams=1))).to(args.device)
    train("hd/backbone n=1", base, lm_loss, data, replace(P, iters=P.hd_base_iters), args, seed)
    rows += result_rows(HD_N, "n=1 backbone (start of every arm)", seed, evaluate(base, data, P, args))
    rows += result_rows(HD_N, "n=2 just expanded (step 0)", seed, evaluate(expand_streams(base, 2), data, P, args))
    cont, headline = replace(P, iters=P.hd_cont_iters, lr=P.hd_cont_lr), {}
    for n, model in hd_continuations(base, HD_CONT_NS, args.device).items():
        train(f"hd/n={n} continued", model, lm_loss, data, cont, args, seed, first_batch=P.hd_base_iters)
        r = evaluate(model, data, P, args)
        rows += result_rows(HD_N, hd_cont_arm(n), seed, r)
        headline[n] = r
        if n in HD_INSIDE:  # the probes of HD §5.2-5.3 (seconds)
            rows += hd_inside_rows(model, data, P, args, seed)
            if n == max(HD_INSIDE) and seed == args.seeds[0]:
                save_inside(args, "hd_line.md", hd_line(model, data, args))
    if every_arm:
        for effect, arm, how in hd_continued_ablation_arms(P):
            if not isinstance(how, dict):  # a headline arm, already trained
                rows += result_rows(effect, arm, seed, headline[how])
                continue
            model = expand_streams(base, 2, **how).to(args.device)
            train(f"hd/n=2 continued, {arm}", model, lm_loss, data, cont, args, seed, first_batch=P.hd_base_iters)
            rows += result_rows(effect, arm, seed, evaluate(model, data, P, args))
        rows += suite_hd_scratch(P, args, seed, data)
    return rows


def suite_hd_scratch(P, args, seed, data):
    """--suite all: the contrast, each n of hd_scratch_arms trained from scratch."""
    rows = []
    for arm, n in hd_scratch_arms():
        torch.manual_seed(seed)
        cfg = HDConfig(**backbone_cfg(P, data.vocab_size, layout=P.layout, window=P.window, n_streams=n))
        model = HiddenDecoding(cfg).to(args.device)
        train(f"hd/{arm}", model, lm_loss, data, P, args, seed)
        rows += result_rows(HD_SCRATCH, arm, seed, evaluate(model, data, P, args))
    return rows


# The paper's expansion protocol (HD §2.3, §4.3): 1 -> 2 -> 4, each stage from the previous one


HD_PROG = Effect("HD: progressive expansion 1 -> 2 -> 4, each stage continued from the previous stage's checkpoint",
                 "HD §2.3, §4.3 (Fig. 4b): each expansion lowers the loss further; n=1 continues as the control")


def prog_arm(n, stage):
    return f"n={n} after stage {stage}"


def suite_hd_progressive(P, args, seed, data, every_arm):
    """HD as the paper scales it: the n=1 backbone, then stage 1 (n=2 expanded from it) and
    stage 2 (n=4 expanded from stage 1's n=2), P.hd_cont_iters steps each on the next batches.
    On the same batches for the same steps: n=1 through both stages (the control), and n=2
    through stage 2 (so that n=4 meets n=2 at equal steps)."""
    torch.manual_seed(seed)
    base = HiddenDecoding(HDConfig(**backbone_cfg(P, data.vocab_size, layout=P.layout, window=P.window,
                                                  n_streams=1))).to(args.device)
    train("hd-progressive/backbone n=1", base, lm_loss, data, replace(P, iters=P.hd_base_iters), args, seed)
    cont, rows = replace(P, iters=P.hd_cont_iters, lr=P.hd_cont_lr), []
    models = {n: expand_streams(base, n).to(args.device) for n in (1, 2)}
    for stage in (1, 2):
        if stage == 2:  # n=4 from stage 1's n=2, before that one trains on
            models[4] = expand_streams(models[2], 4).to(args.device)
        for n, model in models.items():
            train(f"hd-progressive/n={n} stage {stage}", model, lm_loss, data, cont, args, seed,
                  first_batch=P.hd_base_iters + (stage - 1) * P.hd_cont_iters)
            rows += result_rows(HD_PROG, prog_arm(n, stage), seed, evaluate(model, data, P, args))
    return rows


HD_CLAIMS = [
    Claim("HD n=2 beats n=1 (continued from one checkpoint)", HD_N, hd_cont_arm(2), hd_cont_arm(1), "loss", -1),
    Claim("HD n=4 beats n=1 (continued from one checkpoint)", HD_N, hd_cont_arm(4), hd_cont_arm(1), "loss", -1),
    Claim("HD gain grows with n: n=4 beats n=2", HD_N, hd_cont_arm(4), hd_cont_arm(2), "loss", -1),
]
HD_PROG_CLAIMS = [
    Claim("HD progressive: n=2 beats n=1 after stage 1", HD_PROG, prog_arm(2, 1), prog_arm(1, 1), "loss", -1),
    Claim("HD progressive: n=4 (from n=2) beats n=1 after stage 2", HD_PROG, prog_arm(4, 2), prog_arm(1, 2), "loss", -1),
    Claim("HD progressive: gain grows with n: n=4 beats n=2 after stage 2", HD_PROG, prog_arm(4, 2), prog_arm(2, 2),
          "loss", -1),
]


# --suite all: the paper's order in each ablation table (held-out loss, lower is better)
HD_ABLATION_CLAIMS = [
    Claim("HD layouts: one full layer (SF(1)) still beats no expansion", HD_LAYOUTS_CONT, ONE_FULL, NO_EXPANSION,
          "loss", -1),
    Claim("HD layouts: the default few-full (SF) beats one full layer", HD_LAYOUTS_CONT, FEW_FULL, ONE_FULL, "loss", -1),
    Claim("HD layouts: all-full beats few-full (the paper: by little)", HD_LAYOUTS_CONT, ALL_FULL, FEW_FULL, "loss", -1),
    Claim("HD objectives: final-stream loss beats sum", HD_OBJECTIVE_CONT, "objective final", "objective sum", "loss",
          -1),
    Claim("HD objectives: sum beats all-token loss", HD_OBJECTIVE_CONT, "objective sum", "objective all", "loss", -1),
    Claim("HD: per-stream KV beats shared KV", HD_KV_CONT, PER_STREAM_KV, SHARED_KV, "loss", -1),
]


# HD inside (HD §5.2-5.3): the probes of inside.py on the n=2 and n=4 models just trained

INSIDE_WINDOWS = 32  # held-out windows (of P.block tokens) the HD probes read


def hd_inside_effects(n):
    return (Effect(f"HD n={n} inside: cosine of two streams, same token vs different tokens, per layer",
                   "Qwen3-8B HD n=8: same token 0.987 at the input, 0.637 in the middle layers, 0.783 at the "
                   "output, above the different-token baseline (HD Fig. 6a)"),
            Effect(f"HD n={n} inside: the final stream's attention mass on each stream (F and L layers)",
                   "n=8: the final stream reads the others, stream 0 up to 0.52 (HD Fig. 6b)"),
            Effect(f"HD n={n} inside: the shared LM head read off every stream",
                   "n=8: an intermediate stream's top-1 differs from the final stream's in up to 63% of positions; "
                   "the final stream has the lowest entropy, 2.09 bits at n=8 (HD Fig. 7)"))


HD_INSIDE = {n: hd_inside_effects(n) for n in (2, 4)}
SAME, DIFFERENT, LEAST_GAP = "same token", "different tokens", "where the gap is least"
LOWEST_OTHER, DIFFERS, BITS = "lowest-entropy other stream", "top-1 differs from the final stream's", "entropy (bits)"


def stream_name(k, n):
    return f"stream {k}" + (" (final)" if k == n - 1 else "")


def state_name(l):
    return "input" if l == 0 else f"block {l}"  # states[l]: the embedding, then block l's output


@torch.no_grad()
def hd_inside_rows(model, data, P, args, seed):
    """The HD probes on the first INSIDE_WINDOWS held-out windows (means over batches of them)."""
    n, layout = model.cfg.n_streams, model.cfg.layout
    cos_fx, mass_fx, head_fx = HD_INSIDE[n]
    xs = data.windows(args.eval_split, P.block)[0][:P.batch if probing(args) else INSIDE_WINDOWS]
    cross = [l for l, kind in enumerate(layout) if kind in "FL"]
    parts = []
    for i in range(0, len(xs), P.batch):
        states, weights = stream_states(model, xs[i:i + P.batch].to(args.device))
        differs, bits, _ = head_probes(model, states[-1])
        mass = torch.stack([stream_mass(weights[l], n) for l in cross]) if cross else torch.zeros(0, n)
        parts.append((*stream_cosine(states), mass, differs, bits))
    same, diff, mass, differs, bits = (torch.stack(p).mean(0).tolist() for p in zip(*parts))
    least = min(range(len(same)), key=lambda l: same[l] - diff[l])  # "above at every layer" = above here
    rows = []
    for arm, cos in ((DIFFERENT, diff), (SAME, same)):
        rows += result_rows(cos_fx, arm, seed, {**{state_name(l): c for l, c in enumerate(cos)}, LEAST_GAP: cos[least]})
    for j, l in enumerate(cross):
        rows += result_rows(mass_fx, f"block {l + 1} ({layout[l]})", seed,
                            {f"on {stream_name(k, n)}": m for k, m in enumerate(mass[j])})
    for k in range(n):
        rows += result_rows(head_fx, stream_name(k, n), seed, {DIFFERS: differs[k], BITS: bits[k]})
    return rows + result_rows(head_fx, LOWEST_OTHER, seed, {BITS: min(bits[:-1])})


def cell(text):
    """A token as a markdown table cell."""
    return "`" + text.replace("\n", "⏎").replace("|", "\\|").replace("`", "'") + "`"


@torch.no_grad()
def hd_line(model, data, args, most=12):
    """HD Fig. 8 on held-out text: each stream's top-1 token and its probability at every position
    of the first whole line (up to `most` tokens) of the first held-out window, as markdown."""
    x = data.windows(args.eval_split, model.cfg.block_size)[0][0]
    text = [data.decode([t]) for t in x.tolist()]
    ends = [i for i, t in enumerate(text) if "\n" in t]
    a, b = next(((a + 1, b) for a, b in zip(ends, ends[1:]) if b - a > 4), (0, len(text) - 1))
    states, _ = stream_states(model, x[None].to(args.device))
    probs = head_probes(model, states[-1])[2][0]  # (T, n, V)
    p, top = probs.max(-1)
    n = model.cfg.n_streams
    lines = [f"| input | next | " + " | ".join(stream_name(k, n) for k in range(n)) + " |", "|---" * (n + 2) + "|"]
    for i in range(a, min(b, a + most)):
        tops = " | ".join(f"{cell(data.decode([top[i, k].item()]))} {p[i, k].item():.2f}" for k in range(n))
        lines.append(f"| {cell(text[i])} | {cell(text[i + 1])} | {tops} |")
    return "\n".join(lines)


def save_inside(args, name, text):
    """An analysis of the first seed's models, kept with the run (the report copies it out)."""
    if MASTER:
        (args.run_dir / "inside").mkdir(exist_ok=True)
        atomic(args.run_dir / "inside" / name, lambda f: f.write(text.encode()))


HD_INSIDE_CLAIMS = [c for n in (2, 4) for c in (
    Claim(f"HD n={n} inside: a token's streams are more alike than different tokens' at every layer",
          HD_INSIDE[n][0], SAME, DIFFERENT, LEAST_GAP, +1),
    Claim(f"HD n={n} inside: the final stream has the lowest entropy", HD_INSIDE[n][2], stream_name(n - 1, n),
          LOWEST_OTHER, BITS, -1))]


# -----------------------------------------------------------------------------
# TaH: routing on in-context lookups (headline) and addition (the contrast)


@dataclass(frozen=True)
class TaHEffects:
    """The effects of one TaH task (the headline lookups, or the addition contrast)."""
    routing: Effect
    sweep: Effect
    diag: Effect
    attention: Effect


def tah_effects(task):
    return TaHEffects(
        Effect(f"TaH: routing ({task})",
               "Qwen3-1.7B, avg acc: Standard 47.8, AlwaysThink 44.7, TaH 52.8 with ~6% of tokens iterated "
               "(TaH Tables 1, 9); AlwaysThink corrupts more than it corrects (Fig. 1b); decider imitates the "
               "oracle at ~83% (Fig. 6)"),
        Effect(f"TaH: decider threshold sweep ({task})",
               "accuracy is robust across thresholds, ~6% iterated at 0.9 (TaH Fig. 4)"),
        Effect(f"TaH: diagnostics ({task})",
               "overthink (false 'continue') costs about twice as much as underthink (TaH Table 10)"),
        Effect(f"TaH: duo-causal vs ablations, oracle routing ({task})",
               "avg: duo-causal 35.9 vs causal (depth-1 keys) 30.5 (TaH Table 2)"))


TAH = tah_effects("in-context lookups, answers")
TAH_ADD = tah_effects("addition, answer digits; the contrast")
STANDARD, ALWAYS = "Standard", "AlwaysThink"
TAH_ORACLE = "TaH, oracle routing (upper bound)"
TAH_DECIDER = f"TaH, decider routing (threshold {TaHConfig.threshold})"  # the paper's 0.9
TAH_ATTENTION_ABLATIONS = ("first_depth", "depth_local")  # --suite all, beside duo-causal

# the TaH arms compared with Standard: (arm, which fine-tuned model, routing mode)
TAH_ARMS = [(ALWAYS, "always", "always"), (TAH_ORACLE, "tah", "oracle"), (TAH_DECIDER, "tah", "decider")]


def suite_tah(P, args, seed, data, every_arm):
    """TaH on in-context lookups (Lookups), a one-layer backbone. The task has TaH's premise:
    a two-hop answer needs one more lookup at its own position, over pairs that the first pass
    already represents, and the first pass's prediction (the intermediate symbol, fed back by
    Eq. 4) is exactly what the second hop needs; a one-layer model cannot compose two lookups
    in one pass, so the reference's mistakes fall on the queries whose token says "2 hops"."""
    return tah_protocol(P, args, seed, data, every_arm, "tah", TAH, P.tah_layers)


def suite_tah_add(P, args, seed, data, every_arm):
    """The contrast (--suite all): TaH on addition. An answer digit's extra work is the carry
    chain over the operands, not a refinement at the digit's own position, so iterating only
    the hard digits (whose operands never iterate: they have no target) cannot supply it."""
    return tah_protocol(P, args, seed, data, every_arm, "tah-add", TAH_ADD, P.add_layers)


def tah_config(P, task, n_layer):
    """The TaH suites' model: the text backbone's attention shape, dense, n_layer blocks (KV-Mirror
    needs 3), a narrow MLP, two passes at most, rank-8 LoRA, top-100 logits (all, if fewer)."""
    return TaHConfig(**backbone_cfg(P, task.vocab_size, n_experts=0, n_layer=n_layer, kv_mirror=n_layer >= 3,
                                    ffn_hidden=P.tah_ffn_hidden),
                     logit_topk=min(100, task.vocab_size), max_depth=2, lora_rank=8)


def tah_stages(P, task):
    """Budgets of the TaH suite's stages: the base model, the fine-tunes (Standard, AlwaysThink,
    TaH stage 1; each from the base on the same batches) and stage 2. A sequence holds whole
    problems only: the tokens of a problem cut off at the block's end carry no target that
    its pairs or operands could serve (a row starts at a problem), so they are not computed."""
    block = P.block // task.problem_len * task.problem_len
    base = replace(P, batch=P.tah_batch, block=block, iters=P.tah_base_iters, lr=P.tah_base_lr,
                   warmup=min(50, P.tah_base_iters))
    sft = replace(base, iters=P.tah_sft_iters, lr=P.tah_sft_lr, warmup=min(10, P.tah_sft_iters))
    stage2 = replace(base, iters=P.decider_iters, lr=P.decider_lr, warmup=min(10, P.decider_iters))
    return base, sft, stage2


def tah_protocol(P, args, seed, data, every_arm, tag, fx, n_layer):
    """The paper's protocol (TaH §4.3, §5) at tiny scale. A base model is pretrained on the
    task; from it, on the same batches for the same steps: Standard (fine-tuned as is: it is
    also the oracle's reference, as the paper uses the SFT model), AlwaysThink (every token 2
    passes), TaH stage 1 (oracle depths from the frozen Standard model), then TaH stage 2 (the
    decider imitates the oracle, everything else frozen)."""
    base_P, sft_P, stage2_P = tah_stages(P, data)
    cfg = tah_config(P, data, n_layer)
    torch.manual_seed(seed)
    base = ThinkAtHard(cfg).to(args.device)
    std_loss = lambda m, x, y: m(x, y, mode="standard").loss
    train(f"{tag}/base", base, std_loss, data, base_P, args, seed)
    later = dict(first_batch=base_P.iters)  # the fine-tunes: the batches after the base model's

    def from_base(attention="duo"):
        m = ThinkAtHard(replace(cfg, attention=attention)).to(args.device)
        m.load_state_dict(base.state_dict())
        return m

    models = {"standard": from_base(), "always": from_base(), "tah": from_base()}
    train(f"{tag}/Standard", models["standard"], std_loss, data, sft_P, args, seed, **later)
    oracle = Oracle(copy.deepcopy(models["standard"]).eval().requires_grad_(False), cfg.max_depth, data)
    always_loss = lambda m, x, y: m(x, y, mode="always").loss
    train(f"{tag}/AlwaysThink", models["always"], always_loss, data, sft_P, args, seed, **later)
    stage1 = train_tah(f"{tag}/TaH", models["tah"], oracle, data, (base_P, sft_P, stage2_P), args, seed)
    ev = lambda m, mode, thr=None: tah_eval(m, data, base_P, args, mode, oracle, thr)
    rows = tah_routing_rows(fx, models, ev, seed)
    if isinstance(data, Lookups):  # what the second pass does (TaH Figs. 5, 7)
        rows += tah_inside_rows(models["tah"], data, base_P, args, seed)
        if seed == args.seeds[0]:
            md, trace, names = tah_problem(models["tah"], data, base_P, args)
            save_inside(args, "tah_problem.md", md)
            if MASTER:
                plot_trace(trace, names, models["tah"].cfg.threshold, args.run_dir / "inside" / "tah_problem.png")
    if every_arm:
        for attention in TAH_ATTENTION_ABLATIONS:
            m = from_base(attention)
            train(f"{tag}/TaH stage 1, {attention}", m, stage1, data, sft_P, args, seed, **later)
            if attention == "first_depth":
                rows += result_rows(fx.attention, "duo-causal", seed, ev(models["tah"], "oracle")[0])
            rows += result_rows(fx.attention, attention.replace("_", "-"), seed, ev(m, "oracle")[0])
    return rows


def train_tah(name, model, oracle, data, stages, args, seed):
    """TaH's two stages (§4.3) from the base, on the batches after the base model's: stage 1
    (backbone and LoRA, the oracle's depths), then stage 2 (the decider alone). Returns the
    stage-1 loss (the ablations reuse it)."""
    base_P, sft_P, stage2_P = stages
    stage1 = lambda m, x, y: m.stage1_loss(x, y, oracle(x, y))
    train(f"{name} stage 1", model, stage1, data, sft_P, args, seed, first_batch=base_P.iters)
    model.requires_grad_(False).decider.requires_grad_(True)  # stage 2: only the decider learns
    train(f"{name} stage 2 (decider)", model, lambda m, x, y: m.stage2_loss(x, oracle(x, y))[0],
          data, stage2_P, args, seed, first_batch=base_P.iters + sft_P.iters)
    return stage1


class Oracle:
    """Oracle depths (TaH Eq. 7): a token is hard, 2 passes, iff the frozen reference's top-1
    prediction is not the target and its input token is in the response (task.response, the
    authors' rule); targets of -1 are easy."""

    def __init__(self, ref, max_depth, task):
        self.ref, self.max_depth, self.task = ref, max_depth, task

    @torch.no_grad()
    def __call__(self, x, y):
        return oracle_depths(self.ref(x, mode="standard").logits, y, self.max_depth, self.task.response(x))


def answer_exact(ok, y, problem_len, answers):
    """Per problem: every answer right (only problems whose `answers` targets all lie in the
    block). A greedy decode of the answers is right iff every teacher-forced answer is, so this
    is also greedy decoding's exact match."""
    keep = y != -1
    pid = (torch.arange(1, y.size(1) + 1, device=y.device) // problem_len).expand_as(y)
    pid = pid + torch.arange(y.size(0), device=y.device)[:, None] * (y.size(1) // problem_len + 2)
    pid, good = pid[keep], ok[keep]
    ids, count = pid.unique(return_counts=True)
    wrong = torch.zeros_like(ids).index_add_(0, torch.searchsorted(ids, pid), (~good).long())
    complete = count == answers
    return (wrong[complete] == 0).float().mean().item() if complete.any() else float("nan")


@torch.no_grad()
def tah_eval(model, data, P, args, mode, oracle, threshold=None):
    """Held-out metrics of one routing mode over the answers (the targets): loss, accuracy,
    whole-problem exact match, tokens iterated and passes per token (all positions), and
    per-token outcomes (for revision counts against Standard); for the decider, how well it
    imitates the oracle."""
    model.eval()
    losses, oks, first_oks, hard, went, ems, iterated = [], [], [], [], [], [], []
    for k in range(1 if probing(args) else P.tah_eval_batches):
        x, y = data.batch(args.eval_split, P.batch, P.block, batch_gen(args.eval_seed, k, args.eval_split))
        x, y = x.to(args.device), y.to(args.device)
        depths = oracle(x, y)
        out = model(x, y, mode=mode, depths=depths if mode == "oracle" else None, threshold=threshold)
        keep = y != -1
        ok = out.logits.argmax(-1) == y
        losses.append(out.loss.item())
        ems.append(answer_exact(ok, y, data.problem_len, data.answers))
        iterated.append((out.depths > 1).float().mean().item())
        oks.append(ok[keep])
        first_oks.append((out.first_logits.argmax(-1) == y)[keep])
        hard.append((depths > 1)[keep])
        went.append((out.depths > 1)[keep])
    model.train()
    ok, first_ok, hard, went = (torch.cat(v) for v in (oks, first_oks, hard, went))
    r = {"loss": finite_loss({"loss": float(np.mean(losses))})["loss"], "acc": ok.float().mean().item(),
         "exact match": float(np.mean(ems)),
         "iterated": float(np.mean(iterated)), "passes per token": 1 + float(np.mean(iterated))}
    if mode == "decider":  # imitation of the oracle over answers (other positions are trivially "stop")
        tp, pos, neg = (went & hard).sum().item(), hard.sum().item(), (~hard).sum().item()
        recall, spec = tp / max(pos, 1), (~went & ~hard).sum().item() / max(neg, 1)
        r.update({"decider balanced acc": 0.5 * (recall + spec), "decider recall": recall,
                  "decider precision": tp / max(went.sum().item(), 1)})
    return r, dict(ok=ok, first_ok=first_ok, hard=hard, went=went)


def tah_routing_rows(fx, models, ev, seed):
    """Held-out rows of a TaH suite: Standard, then each of TAH_ARMS with its revisions against
    Standard (and, for the decider, the share of AlwaysThink's gain it gets), the diagnostics,
    and the threshold sweep. ev(model, mode, threshold) -> tah_eval."""
    r_std, o_std = ev(models["standard"], "standard")
    rows = result_rows(fx.routing, STANDARD, seed, r_std)
    sweep = {"standard": r_std}
    for arm, which, mode in TAH_ARMS:
        r, o = ev(models[which], mode)
        # revisions against Standard's prediction of the same token (TaH Fig. 1b)
        r["corrected vs Standard"] = int((o["ok"] & ~o_std["ok"]).sum())
        r["corrupted vs Standard"] = int((~o["ok"] & o_std["ok"]).sum())
        r["corrupted - corrected vs Standard"] = r["corrupted vs Standard"] - r["corrected vs Standard"]
        sweep[models[which].cfg.threshold if mode == "decider" else mode] = r
        if mode == "decider":  # cost beside accuracy: how much of AlwaysThink's gain, at what share of its passes
            gain = sweep["always"]["acc"] - r_std["acc"]
            r["share of AlwaysThink's gain"] = (r["acc"] - r_std["acc"]) / gain if gain > 0 else float("nan")
        rows += result_rows(fx.routing, arm, seed, r)
        rows += tah_diagnostics(fx, mode, o, seed)
    # the compute-accuracy trade-off (TaH Fig. 4): Standard and AlwaysThink are the end points
    for thr in (0.1, 0.3, 0.5, 0.7, 0.8, 0.95):
        sweep[thr] = ev(models["tah"], "decider", thr)[0]
    for key in ["standard"] + sorted(k for k in sweep if not isinstance(k, str)) + ["always"]:
        arm = {"standard": STANDARD, "always": ALWAYS}.get(key, f"TaH decider, threshold {key}")
        rows += result_rows(fx.sweep, arm, seed, {k: sweep[key][k] for k in ("iterated", "acc")})
    return rows


def tah_diagnostics(fx, mode, o, seed):
    """Oracle: where its gain comes from (depth 0 alone vs the sum). Decider: the fate of the
    easy answers it sends on (overthinking)."""
    if mode == "oracle":
        h = o["hard"]
        return result_rows(fx.diag, "TaH under the oracle", seed, {
            "hard share of answers": h.float().mean().item(),
            "depth-0 acc, easy answers": o["first_ok"][~h].float().mean().item(),
            "depth-0 acc, hard answers": o["first_ok"][h].float().mean().item(),
            "summed acc, hard answers": o["ok"][h].float().mean().item()})
    if mode == "decider":
        fp = o["went"] & ~o["hard"]  # easy answers the decider sent on
        return result_rows(fx.diag, "TaH under the decider", seed, {
            "easy answers sent on": fp.float().mean().item(),
            "of those, right at depth 0": o["first_ok"][fp].float().mean().item() if fp.any() else float("nan"),
            "of those, right after depth 1": o["ok"][fp].float().mean().item() if fp.any() else float("nan")})
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
        Claim(f"{task}: duo-causal attention beats first-depth keys (oracle routing)", fx.attention, "duo-causal",
              "first-depth", "acc", +1),
    ]


# TaH inside (TaH Figs. 5 and 7): the probes of inside.py on the lookups model just trained

TAH_ITER = Effect("TaH inside: the tokens the decider sends on, top-1 after the first pass -> after the second "
                  "(in-context lookups; counts over the evaluation batches)",
                  "Qwen3-1.7B: the predictions of the tokens that think twice change across iterations (TaH Fig. 5)")
KINDS = {0: "other tokens (target: the next token)", 1: "one-hop queries", 2: "two-hop queries", 3: "three-hop queries"}
FIXES = "corrected - corrupted"


@torch.no_grad()
def tah_inside_rows(model, data, P, args, seed, threshold=None):
    """For the tokens the decider sends on: their top-1 after the first pass and after the last,
    against the next token, counted by query type (TaH Fig. 5), and the share of each type sent on."""
    model.eval()
    counts, totals = {}, {}
    for k in range(1 if probing(args) else P.tah_eval_batches):
        x, y = data.batch(args.eval_split, P.batch, P.block, batch_gen(args.eval_seed, k, args.eval_split))
        x, y = x.to(args.device), y.to(args.device)
        out = model(x, mode="decider", threshold=threshold)
        nxt = torch.cat([x[:, 1:], y[:, -1:]], 1)  # the next token; the last position's only if it is a target
        kind = data.hops(x)
        for h, c in iteration_outcomes(out.first_logits.argmax(-1), out.logits.argmax(-1), nxt,
                                       (out.depths > 1) & (nxt >= 0), kind).items():
            counts[h] = {o: counts.get(h, {}).get(o, 0) + c[o] for o in OUTCOMES}
        for h in kind[nxt >= 0].unique().tolist():
            totals[h] = totals.get(h, 0) + int(((kind == h) & (nxt >= 0)).sum())
    model.train()
    rows = []
    for h in sorted(totals):  # every kind in the data, sent on or not
        c = counts.get(h, dict.fromkeys(OUTCOMES, 0))
        rows += result_rows(TAH_ITER, KINDS[h], seed, {**c, FIXES: c[OUTCOMES[0]] - c[OUTCOMES[1]],
                                                       "share of the kind sent on": sum(c.values()) / totals[h]})
    return rows


def tah_problem(model, data, P, args):
    """The first held-out problem with a two-hop query, traced through the decider-routed model
    (TaH Figs. 5 and 7): a markdown table of its tokens and a picture of its passes, scores and
    the second pass's duo-causal attention."""
    x, y = data.batch(args.eval_split, P.batch, P.block, batch_gen(args.eval_seed, 0, args.eval_split))
    L = data.problem_len
    problems = x[:, :x.size(1) // L * L].reshape(-1, L)
    idx = problems[(data.hops(problems) == 2).any(1).nonzero()[0, 0]][None].to(args.device)
    model.eval()
    trace = tah_trace(model, idx)
    model.train()
    names = [data.describe(t) for t in idx[0].tolist()]
    lines = ["| position | token | next | passes | p(go on) after pass 1 | top-1 after pass 1 | top-1 after the last |",
             "|---|---|---|---|---|---|---|"]
    for i, name in enumerate(names):
        nxt = cell(names[i + 1]) if i + 1 < L else ""
        lines.append(f"| {i} | {cell(name)} | {nxt} | {trace['passes'][i].item()} | {trace['go'][i].item():.3f} | "
                     f"{cell(data.describe(trace['first'][i].item()))} | {cell(data.describe(trace['final'][i].item()))} |")
    return "\n".join(lines), trace, names


TAH_INSIDE_CLAIMS = [Claim("TaH inside: among the two-hop answers sent on, the second pass corrects more than it "
                           "corrupts", TAH_ITER, KINDS[2], 0, FIXES, +1)]


# TaH-3 vs TaH-2 (TaH App. A.2.1, Table 7): a third pass, for three-hop lookups

TAH3 = Effect("TaH-3 vs TaH-2: lookups with one-, two- and three-hop queries (decider routing)",
              "Qwen3-1.7B avg acc: Standard 47.8; TaH-2 52.8 (5.8% of tokens at 2 passes); TaH-3 53.6 (5.7% at 2, "
              "0.2% at 3) (TaH Table 7)")
TAH2_ARM, TAH3_ARM = "TaH-2 (max 2 passes)", "TaH-3 (max 3 passes)"
DEEPER = "passes, three-hop minus two-hop"


def suite_tah3(P, args, seed, data, every_arm):
    """TaH-3 against TaH-2 on lookups with three-hop queries (a one-layer model follows one link
    per pass, so a three-hop answer needs three). One base and one Standard fine-tune (the oracle's
    reference), then from the base on the same batches: TaH-2 (hard tokens 2 passes) and TaH-3
    (hard tokens binned per sample by the reference's CE into 2 and 3 passes, App. A.2.1), each
    through stage 1 and stage 2."""
    stages = tah_stages(P, data)
    cfg = tah_config(P, data, P.tah_layers)
    torch.manual_seed(seed)
    base = ThinkAtHard(cfg).to(args.device)
    std_loss = lambda m, x, y: m(x, y, mode="standard").loss
    train("tah3/base", base, std_loss, data, stages[0], args, seed)
    models = {}
    for arm, depth in ((STANDARD, 1), (TAH2_ARM, 2), (TAH3_ARM, 3)):
        models[arm] = ThinkAtHard(replace(cfg, max_depth=max(depth, 2))).to(args.device)
        models[arm].load_state_dict(base.state_dict())
        if depth == 1:
            train("tah3/Standard", models[arm], std_loss, data, stages[1], args, seed, first_batch=stages[0].iters)
            ref = copy.deepcopy(models[arm]).eval().requires_grad_(False)
        else:
            train_tah(f"tah3/{arm}", models[arm], Oracle(ref, depth, data), data, stages, args, seed)
    return [r for arm, m in models.items()
            for r in result_rows(TAH3, arm, seed, tah_by_hops(m, data, stages[0], args, arm != STANDARD))]


@torch.no_grad()
def tah_by_hops(model, data, P, args, decider):
    """Answer accuracy and passes per query by hop count, and the share of all positions at 2 and
    at 3 passes, over the evaluation batches (decider routing, or standard)."""
    model.eval()
    ok, passes, kinds, depths = [], [], [], []
    for k in range(1 if probing(args) else P.tah_eval_batches):
        x, y = data.batch(args.eval_split, P.batch, P.block, batch_gen(args.eval_seed, k, args.eval_split))
        x, y = x.to(args.device), y.to(args.device)
        out = model(x, y, mode="decider" if decider else "standard")
        keep = y != -1
        ok.append((out.logits.argmax(-1) == y)[keep])
        passes.append(out.depths[keep])
        kinds.append(data.hops(x)[keep])
        depths.append(out.depths.flatten())
    model.train()
    ok, passes, kinds, depths = (torch.cat(v) for v in (ok, passes, kinds, depths))
    r = {"acc": ok.float().mean().item()}
    for h in range(1, data.max_hops + 1):
        name = {1: "one", 2: "two", 3: "three"}[h]
        r[f"acc, {name}-hop"] = ok[kinds == h].float().mean().item()
        r[f"passes, {name}-hop"] = passes[kinds == h].float().mean().item()
    if data.max_hops == 3:
        r[DEEPER] = r["passes, three-hop"] - r["passes, two-hop"]
    return {**r, "positions at 2 passes": (depths == 2).float().mean().item(),
            "positions at 3 passes": (depths == 3).float().mean().item()}


TAH3_CLAIMS = [
    Claim("TaH-3 beats TaH-2 on three-hop answers", TAH3, TAH3_ARM, TAH2_ARM, "acc, three-hop", +1),
    Claim("TaH-3 gives three-hop queries more passes than two-hop ones", TAH3, TAH3_ARM, 0, DEEPER, +1),
    Claim("TaH-3 beats TaH-2 on all answers", TAH3, TAH3_ARM, TAH2_ARM, "acc", +1),
]


# -----------------------------------------------------------------------------
# MoE: loss-free balancing (and, --suite all, KV-Mirror)


MOE_BALANCE = Effect("MoE: loss-free balancing", "the bias keeps experts balanced without an auxiliary loss (DeepSeek-V3 §2.1.2)")
MOE_MIRROR = Effect("MoE: KV-Mirror", "WeLM: KV-Mirror beats direct K/V reuse (blog; no number given)")
MOE_LOAD = "max/mean expert load (held-out batches)"
MOE_OFF, MOE_ON = "bias update off", "bias update on"


def moe_arms(every_arm):
    """(effect, arm, ModelConfig overrides): loss-free balancing off and on; with --suite all,
    KV-Mirror off (its baseline, "KV-Mirror on", is the "bias update on" model)."""
    arms = [(MOE_BALANCE, MOE_OFF, dict(balance_gamma=0.0)), (MOE_BALANCE, MOE_ON, dict(balance_gamma=1e-3))]
    return arms + ([(MOE_MIRROR, "KV-Mirror off", dict(balance_gamma=1e-3, kv_mirror=False))] if every_arm else [])


def suite_moe(P, args, seed, data, every_arm):
    """Loss-free balancing off vs on (and KV-Mirror off with --suite all), each from scratch."""
    rows, trained = [], {}  # trained: arm -> its held-out metrics
    for effect, arm, overrides in moe_arms(every_arm):
        torch.manual_seed(seed)
        model = Transformer(ModelConfig(**backbone_cfg(P, data.vocab_size, **overrides))).to(args.device)
        train(f"moe/{arm}", model, lm_loss, data, P, args, seed)
        loads = []

        def watch(m, x, y):  # the trained model's expert loads on each held-out batch
            out = m(x, y)[:2]
            loads.append(m.expert_load().float().cpu())
            return out
        r = evaluate(model, data, P, args, watch)
        load = torch.stack(loads)  # (batches, layers, experts)
        r[MOE_LOAD] = (load.max(-1).values / load.mean(-1)).mean().item()
        trained[arm] = r
        if effect is MOE_MIRROR:
            rows += result_rows(MOE_MIRROR, "KV-Mirror on", seed, {k: trained[MOE_ON][k] for k in ("loss", "acc")})
            r = {k: r[k] for k in ("loss", "acc")}
        rows += result_rows(effect, arm, seed, r)
    return rows


MOE_CLAIMS = [
    Claim("loss-free bias balances the experts", MOE_BALANCE, MOE_ON, MOE_OFF, MOE_LOAD, -1),
]


# -----------------------------------------------------------------------------
# Every suite, every claim


SUITES = {"hd": suite_hd, "tah": suite_tah, "tah-add": suite_tah_add, "moe": suite_moe, "hd-progressive": suite_hd_progressive,
          "tah3": suite_tah3}
TEXT_SUITES = ("hd", "hd-progressive", "moe")  # the suites that train on the text
CLAIMS = (HD_CLAIMS + HD_INSIDE_CLAIMS + HD_PROG_CLAIMS + HD_ABLATION_CLAIMS + tah_claims(TAH, "TaH, lookups") + TAH_INSIDE_CLAIMS + MOE_CLAIMS
          + tah_claims(TAH_ADD, "TaH, addition") + TAH3_CLAIMS)


def planned(args, data, todo):
    """What each suite to do trains: its stages in order as (arm, steps), and each arm's seconds
    per step, both read off a probe that runs each suite's protocol once (on the first seed to
    do) with every stage cut to a few steps and every evaluation to one batch. The stages and
    their step counts are the protocol's own; nothing here restates them."""
    stages, rates, args.probe = {}, {}, []
    try:
        for suite, seed in todo:
            if suite not in stages:
                del args.probe[:]
                SUITES[suite](args.P, args, seed, data[suite], args.every_arm)
                stages[suite] = [(arm, steps) for arm, steps, _ in args.probe]
                rates.update({arm: sec for arm, _, sec in args.probe if sec is not None})
    finally:
        args.probe = None
    return stages, rates


# -----------------------------------------------------------------------------
# Command line


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def flag(ap, name, **kw):
    """One option under both spellings, --a_b and --a-b."""
    spellings = dict.fromkeys((f"--{name.replace('-', '_')}", f"--{name.replace('_', '-')}"))
    return ap.add_argument(*spellings, **kw)


def preset_flags(ap):
    """One flag per Preset field, nanoGPT style (--n_layer=4, --plays=macbeth,hamlet): each
    overrides the chosen preset's value."""
    group = ap.add_argument_group("preset overrides (default: the preset's value)")
    for f in fields(Preset):
        kind = type(f.default)
        parse_value = (lambda v: tuple(x for x in v.split(",") if x)) if kind is tuple else kind
        values = ", ".join(f"{k} {getattr(p, f.name)!r}" for k, p in PRESETS.items())
        flag(group, f.name, type=parse_value, default=argparse.SUPPRESS, metavar=kind.__name__.upper(), help=values)


def check_preset(P):
    """Every field in range, and the models it builds valid: one line before any training."""
    for f in fields(Preset):
        v = getattr(P, f.name)
        if isinstance(v, int) and v < 1:
            return f"--{f.name} must be >= 1, got {v}"
        if isinstance(v, float) and not (math.isfinite(v) and v > 0):
            return f"--{f.name} must be a finite number > 0, got {v}"
    if not P.two_hop + P.three_hop < 1:
        return (f"--two_hop + --three_hop must be below 1 (some queries must be one-hop), got {P.two_hop} + "
                f"{P.three_hop}")
    if P.symbols < 3:
        return f"--symbols must be >= 3 (a cycle where two hops differ from one and from none), got {P.symbols}"
    if P.digits > 18:
        return f"--digits must be <= 18 (the operands are int64), got {P.digits}"
    if len(set(P.plays)) != len(P.plays):
        return f"--plays names a play twice: {','.join(P.plays)}"
    for name, task in (("symbols/queries", Lookups(P.symbols, P.queries, P.two_hop)), ("digits", Arith(P.digits))):
        if task.problem_len > P.block:
            return (f"--block {P.block} holds no whole {type(task).__name__} problem ({task.problem_len} "
                    f"tokens): raise --block or lower --{name}")
    try:
        HDConfig(**backbone_cfg(P, 100, layout=P.layout, window=P.window, n_streams=4))
        for task, layers in ((Lookups(P.symbols, P.queries, P.two_hop, P.three_hop), P.tah_layers),
                             (Arith(P.digits), P.add_layers)):
            tah_config(P, task, layers)
    except ValueError as e:
        return f"this preset builds no valid model: {e}"
    return None


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    flag(ap, "suite", default="headline", metavar="{headline,all,hd,tah,moe,...}",
         help="headline: the HD and TaH demonstrations; all: every suite with every ablation arm; or a comma "
              "list of " + ",".join(SUITES))
    flag(ap, "preset", choices=sorted(PRESETS),
         help="the budget: default (when not given) is the measured protocol, on any device; large is wider and "
              "longer, for a GPU, and not yet measured%(default).0s")
    flag(ap, "smoke", action="store_true", help="every suite's code path, tiny and fast (its own preset)")
    flag(ap, "rehearse", action="store_true",
         help="the large preset's every arm at its full shapes, 2 steps each, here (bf16 autocast on CPU): "
              "parameter counts, activation memory, and any error a GPU run would meet early")
    flag(ap, "data", help="train the HD and MoE suites on this UTF-8 text file instead of Shakespeare")
    flag(ap, "accum", type=int, default=1, help="gradient accumulation micro-steps")
    flag(ap, "muon", action="store_true", help="Muon for 2-D weights in the blocks, AdamW for the rest")
    flag(ap, "compile", action="store_true", help="torch.compile the models (on CPU it only checks the compile path)")
    flag(ap, "out", default="out", help="folder for results, checkpoints and the token cache")
    flag(ap, "log_every", type=int, default=50, help="steps between log lines")
    flag(ap, "ckpt_every", type=int, default=50, help="steps between checkpoints")
    flag(ap, "device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    flag(ap, "threads", type=int, default=1,
         help="CPU threads per process (float sums, and so the last digits, depend on it; the README's default run "
              "used 1)")
    flag(ap, "jobs", type=int,
         help="(suite, seed)s trained at once, each in a process of its own; the numbers do not depend on it "
              "(default: on CPU the usable cores // --threads, on CUDA and under torchrun 1)")
    flag(ap, "seed0", type=int, default=0, help="the first seed: a run trains seeds seed0 .. seed0 + seeds - 1")
    flag(ap, "fresh", action="store_true",
         help="delete this configuration's checkpoints and finished rows first, and train everything again")
    flag(ap, "dev", action="store_true", help="evaluate on the dev set instead of the held-out set: for trying things out")
    preset_flags(ap)
    return ap


def parse(argv):
    """The command line, checked whole before anything trains: one line per problem."""
    ap = parser()
    args = ap.parse_args(argv)
    names = {"headline": list(SUITES) if args.smoke else ["hd", "tah"], "all": list(SUITES)}.get(
        args.suite, args.suite.split(","))  # --smoke: every code path
    problem = check_args(args, names)
    if problem:
        ap.error(problem)
    args.preset_name = "smoke" if args.smoke else args.preset or "default"
    P = PRESETS[args.preset_name]
    if args.rehearse:  # the large shapes, every arm, 2 steps each, one seed, one evaluation batch
        args.preset_name, names = "large (rehearsal)", list(SUITES)
        P = replace(PRESETS["large"], iters=2, hd_base_iters=2, hd_cont_iters=2, tah_base_iters=2, tah_sft_iters=2,
                    decider_iters=2, warmup=1, tah_eval_batches=1, seeds=1)
        args.out = args.out if args.out != "out" else "out-rehearsal"
    args.P = replace(P, **{f.name: getattr(args, f.name) for f in fields(Preset) if hasattr(args, f.name)})
    problem = check_preset(args.P) or check_batches(args.P, names, args.accum)
    if problem:
        ap.error(problem)
    args.suites, args.seeds = names, range(args.seed0, args.seed0 + args.P.seeds)
    args.every_arm = args.suite == "all" or args.smoke or args.rehearse
    args.eval_split, args.eval_seed = ("dev", 104729) if args.dev else ("val", 7919)
    if args.jobs is None:
        args.jobs = 1 if DDP or args.device.startswith("cuda") else max(1, usable_cores() // args.threads)
    return args


def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_args(args, names):
    """The flags apart from the preset's: the first problem, as one line, or None."""
    bad = [s for s in names if s not in SUITES]
    if bad:
        return f"unknown suite(s) {bad}; choose headline, all, or from {sorted(SUITES)}"
    if len(set(names)) != len(names):
        return f"--suite {args.suite} names a suite twice"
    if args.smoke and args.preset:
        return "--smoke is its own preset; give --smoke or --preset, not both"
    if args.rehearse and (args.smoke or args.preset or args.suite != "headline"):
        return "--rehearse runs every suite of the large preset; give it without --smoke, --preset or --suite"
    if not args.out.strip() or not is_utf8(args.out) or (args.data and not is_utf8(args.data)):
        return "--out must name a folder, and --out and --data must be UTF-8 paths"
    if args.data and not set(TEXT_SUITES) & set(names):
        return "--data feeds the hd and moe suites only; this run has neither"
    for k in ("accum", "log_every", "ckpt_every", "threads", "jobs"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            return f"--{k} must be >= 1, got {getattr(args, k)}"
    if DDP and (args.jobs or 1) > 1:
        return "--jobs trains in processes of its own; under torchrun give --jobs 1 (each rank is one process)"
    if args.seed0 < 0:
        return f"--seed0 must be >= 0, got {args.seed0}"
    if args.data and not Path(args.data).is_file():
        return f"--data {args.data}: no such file" + (" (it is a folder)" if Path(args.data).is_dir() else "")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        return f"--device must be cpu, cuda or cuda:N, got {args.device!r}"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {args.device}: CUDA is not available"
    if ":" in args.device and int(args.device.split(":")[1]) >= torch.cuda.device_count():
        return f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s)"
    return None


def is_utf8(path):
    try:
        path.encode("utf-8")
        return True
    except UnicodeEncodeError:  # a byte that is not UTF-8 arrives as a surrogate escape
        return False


def check_batches(P, names, accum):
    """Every suite's global batch splits into ranks x micro-steps: checked before the first step."""
    for name, batch in (("batch", P.batch), ("tah_batch", P.tah_batch)):
        used = name == "batch" and bool(set(TEXT_SUITES) & set(names)) or \
            name == "tah_batch" and any(s.startswith("tah") for s in names)
        if used and batch % (WORLD * accum):
            return f"--{name} {batch} does not split into {WORLD} rank(s) x {accum} micro-step(s) (--accum)"
    return None


# -----------------------------------------------------------------------------
# Main: run what is not done yet, then report


def main(argv=None):
    args = parse(argv)
    if DDP:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    try:  # the file system's errors (a path that is a folder, no permission, a full disk): one line each
        run(args, argv)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (--jobs processes are stopped on the way out)
        if MASTER:  # under torchrun every rank gets it
            print("interrupted: what finished is saved (rows after each (suite, seed), checkpoints every "
                  "--ckpt_every steps); run the same command to go on", file=sys.stderr)
        raise SystemExit(130)
    except OSError as e:
        raise SystemExit(f"error: {e.strerror or e} ({e.filename or 'a file of this run'}); nothing of the step that "
                         "met it is saved")
    if DDP:
        dist.destroy_process_group()


def run(args, argv):
    """Train every (suite, seed) not done yet, saving the rows after each, then report."""
    P, out = args.P, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in RESULTS:  # a run that stops early must not leave another run's results beside it
        (out / stale).unlink(missing_ok=True)
    torch.set_float32_matmul_precision("high")
    torch.set_num_threads(args.threads)
    text = load_text(args.data, P.plays, P.block, out) if set(TEXT_SUITES) & set(args.suites) else None
    log(f"preset {args.preset_name}: {P}")
    if text is not None:
        log(f"text: {len(text.tokens):,} tokens, vocab {text.vocab_size:,}")
    rows_path = open_run(args, P, text, out)
    rows = load_rows(rows_path, args.run_key)
    done = {(r["suite"], r["seed"]) for r in rows}
    t0 = time.time()
    todo = [(suite, seed) for suite in args.suites for seed in args.seeds if (suite, seed) not in done]
    data = {**dict.fromkeys(TEXT_SUITES, text), "tah": Lookups(P.symbols, P.queries, P.two_hop), "tah-add": Arith(P.digits),
            "tah3": Lookups(P.symbols, P.queries, P.two_hop, P.three_hop)}
    stages, rates = planned(args, data, todo)
    for suite in args.suites:
        for seed in args.seeds:
            if (suite, seed) in done:
                log(f"{suite} seed {seed}: already done, skipped")
    if args.jobs > 1 and len(todo) > 1:
        rows = train_in_processes(args, todo, data, stages, rates, rows, rows_path)
    else:
        PROGRESS.start([stage for suite, _ in todo for stage in stages[suite]], rates)
        for suite, seed in todo:
            rows = in_order(rows + [{**r, "suite": suite} for r in SUITES[suite](P, args, seed, data[suite],
                                                                                  args.every_arm)])
            if MASTER:
                save_rows(rows_path, rows, args.run_key)
    if MASTER:
        report(rows, args, P, out, argv, time.time() - t0)


def in_order(rows):
    """Rows by suite (in SUITES' order), then seed, whatever order they finished in: the report's
    sums over seeds, and so its last digits, do not depend on --jobs or on a resume."""
    suites = list(SUITES)
    return sorted(rows, key=lambda r: (suites.index(r["suite"]), r["seed"]))


def train_in_processes(args, todo, data, stages, rates, rows, rows_path, work=None):
    """--jobs > 1: the (suite, seed)s to do, longest first, each in a fresh process of
    args.threads threads, args.jobs at a time (`work`, train_one unless a test says otherwise,
    runs one); each one's rows are saved as it finishes. A (suite, seed) computes the same
    numbers in any process (each suite seeds its own generators), so the rows equal a
    one-process run's with the same --threads. An error, or a process that dies, stops them all
    at once with one line; what finished is kept."""
    seconds = {suite: sum(steps * rates.get(arm, 0.0) for arm, steps in stages[suite]) for suite in stages}
    waiting = sorted(todo, key=lambda t: -seconds[t[0]])
    log(f"{len(todo)} (suite, seed)s in {args.jobs} processes at a time, {args.threads} thread(s) each")
    ctx = multiprocessing.get_context("spawn")
    results, running, t0, left = ctx.Queue(), {}, time.time(), sum(seconds[suite] for suite, _ in todo)
    try:
        while waiting or running:
            while waiting and len(running) < args.jobs:
                suite, seed = waiting.pop(0)
                running[suite, seed] = ctx.Process(target=report_to, args=(results, work or train_one, (
                    args, suite, seed, data[suite], stages[suite], rates)), daemon=True)
                with ignoring_ctrl_c():  # the process inherits it: Ctrl-C stops the parent, which stops it
                    running[suite, seed].start()
            try:
                suite, seed, found = results.get(timeout=1.0)
            except queue.Empty:  # a process that ended without a result died (killed, out of memory, a bug)
                for (suite, seed), p in running.items():
                    if p.exitcode not in (None, 0):
                        raise SystemExit(f"error: the process training {suite} seed {seed} died (exit code "
                                         f"{p.exitcode}: killed, out of memory, or the error printed above); the "
                                         f"finished (suite, seed)s are saved: run the same command to go on")
                continue
            running.pop((suite, seed)).join()
            if isinstance(found, str):  # the process's SystemExit: its one line, as in one process
                raise SystemExit(found)
            rows = in_order(rows + found)
            save_rows(rows_path, rows, args.run_key)
            left -= seconds[suite]
            done = len(todo) - len(waiting) - len(running)
            log(f"{suite} seed {seed} finished ({done} of {len(todo)}) | elapsed {(time.time() - t0) / 60:.1f} min | "
                f"~{left / max(1, min(args.jobs, len(todo) - done)) / 60:.1f} min of training left")
    finally:
        for p in running.values():  # stop the others now, not after their (suite, seed)s
            p.terminate()
    return rows


@contextlib.contextmanager
def ignoring_ctrl_c():
    """SIGINT ignored while a --jobs process starts: a process started with it ignored keeps it
    ignored (Python installs its KeyboardInterrupt only where the parent left SIGINT alone), so
    Ctrl-C, which the terminal sends to every process of the run, prints one line, the parent's."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def report_to(results, work, task):
    """A --jobs process: run one (suite, seed) and put what it gives on the parent's queue. It
    ends itself if the parent goes (killed, or stopped by a signal), rather than train on unseen."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()
    results.put(work(task))


def train_one(task):
    """One (suite, seed) in a process of its own: (suite, seed, its rows), or the line of the
    SystemExit that stopped it."""
    args, suite, seed, data, stages, rates = task
    torch.set_float32_matmul_precision("high")
    torch.set_num_threads(args.threads)
    PROGRESS.start(stages, rates)
    try:
        return suite, seed, [{**r, "suite": suite} for r in SUITES[suite](args.P, args, seed, data, args.every_arm)]
    except SystemExit as e:
        return suite, seed, str(e.code)


RESULTS = ("results.md", "results.json", "loss_curves.png", "tah_tradeoff.png", "hd_streams.png", "tah_problem.png")
INSIDE = {"hd_line.md": "HD inside: one held-out line, each stream's top-1 token and its probability (HD Fig. 8)",
          "tah_problem.md": "TaH inside: one held-out lookup problem through the decider (TaH Figs. 5 and 7)"}


def inside_sections(args):
    """The first seed's analyses the suites kept with the run (hd_line, tah_problem), as sections."""
    found = [(f, title) for f, title in INSIDE.items() if (args.run_dir / "inside" / f).exists()]
    return "".join(f"\n\n**{title}**, seed {args.seeds[0]}\n\n" + (args.run_dir / "inside" / f).read_text()
                   for f, title in found)
HERE = Path(__file__).resolve().parent
SOURCES = ("moe.py", "hd.py", "tah.py", "checks.py", "tasks.py", "trainer.py", "report.py", "inside.py", "train_tiny.py")  # all that can change a result


def open_run(args, P, text, out):
    """The folder of this exact configuration (preset, flags, data, code, world size), where
    checkpoints and finished rows live, each carrying the configuration's key; returns the path
    of its rows file."""
    code = [hashlib.sha256((HERE / f).read_bytes()).hexdigest() for f in SOURCES]
    data_key = hashlib.sha256(text.tokens.tobytes()).hexdigest() if text is not None else None
    key = hashlib.sha256(json.dumps([asdict(P), args.muon, args.accum, args.device, args.threads, args.dev, data_key,
                                     code, args.every_arm, args.compile, args.rehearse, args.seed0, WORLD]
                                    ).encode()).hexdigest()[:10]
    args.run_key, args.run_dir = key, out / f"run-{key}"
    if args.fresh and MASTER and args.run_dir.exists():
        shutil.rmtree(args.run_dir)
    args.run_dir.mkdir(exist_ok=True)
    for tmp in args.run_dir.rglob("*.tmp"):  # left by a run killed mid-write
        tmp.unlink(missing_ok=True)
    return args.run_dir / "rows.json"


ROW_KEYS = {"suite", "effect", "paper", "arm", "metric", "seed", "value"}


def rows_digest(rows):
    return hashlib.sha256(json.dumps(rows, indent=1).encode()).hexdigest()


def save_rows(path, rows, key):
    """The finished rows, with the run's key and the sha256 load_rows checks."""
    doc = {"run": key, "sha256": rows_digest(rows), "rows": rows}
    atomic(path, lambda f: f.write(json.dumps(doc, indent=1).encode()))


def load_rows(path, key):
    """The rows of the finished (suite, seed)s of run `key`, or one line naming the file if it
    was changed or belongs to another run."""
    if not path.exists():
        return []
    try:
        doc = json.loads(path.read_text())
        rows = doc["rows"]
        ok = doc["sha256"] == rows_digest(rows) and all(isinstance(r, dict) and r.keys() == ROW_KEYS for r in rows)
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise SystemExit(f"error: {path} is damaged (unreadable, or its checksum does not match); delete it "
                         f"(the checkpoints beside it are reused), or run with --fresh")
    if doc.get("run") != key:
        raise SystemExit(f"error: {path} holds the rows of run {doc.get('run')}, not of this run ({key}); delete "
                         f"it, or run with --fresh")
    return rows


def loss_curves(run_dir):
    """(suite, arm) -> per-seed training losses, from the checkpoints' own record."""
    curves = {}
    for f in sorted((run_dir / "ckpt").glob("*.pt")):
        state = load_checkpoint(f)
        suite, arm = state["meta"]["arm"].split("/", 1)
        curves.setdefault((suite, arm), []).append(state["losses"])
    return curves


def report(rows, args, P, out, argv, seconds):
    """results.md / results.json (and plots with matplotlib) from the rows alone."""
    summary, verdicts = summarize(rows), judge(rows, CLAIMS)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"CPU ({os.cpu_count()} cores; --jobs {args.jobs}, --threads {args.threads})"
    command = " ".join(["python train_tiny.py"] + (sys.argv[1:] if argv is None else argv))
    eval_set = "dev" if args.dev else "held-out"
    header = (f"Measured by `{command}` on {dev}, {P.seeds} seed(s), evaluated on the {eval_set} set; "
              f"{seconds:.0f} s for this invocation.")
    md = table(summary, verdicts, header) + inside_sections(args)
    atomic(out / "results.md", lambda f: f.write((md + "\n").encode()))
    atomic(out / "results.json", lambda f: f.write(json.dumps(
        {"preset": asdict(P), "device": dev, "eval_set": args.eval_split, "rule": RULE, "summary": summary,
         "verdicts": verdicts}, indent=1).encode()))
    sweeps = plot_sweep(summary, out, eval_set, [TAH.sweep.name, TAH_ADD.sweep.name], (STANDARD, ALWAYS))
    streams = plot_streams(summary, out, *({n: fx[j].name for n, fx in HD_INSIDE.items()} for j in range(3)))
    trace = args.run_dir / "inside" / "tah_problem.png"
    if trace.exists():
        shutil.copyfile(trace, out / trace.name)
    png = [p for p in (plot(loss_curves(args.run_dir), out), sweeps, streams, trace.exists() and out / trace.name) if p]
    log("\n" + md + f"\n\nwritten: {out / 'results.md'}, {out / 'results.json'}" + "".join(f", {p}" for p in png))


if __name__ == "__main__":
    main()
