"""
Tiny training runs that show the two papers' headline effects with numbers.

    python train_tiny.py                      # HD's expansion factor and TaH on lookups, the measured protocol
    python train_tiny.py --suite all          # every suite with every ablation arm (ablations.py)
    python train_tiny.py --smoke              # every suite's code path in seconds
    torchrun --nproc_per_node=8 train_tiny.py # DDP: the global batch split over ranks

This file holds the budgets (Preset) and the list of what runs. The demonstrations are Suites:
the two headline ones in headline.py (HD's expansion factor, continued from one n=1 checkpoint;
TaH's routing on in-context lookups), the ablations and contrasts in ablations.py, built from
the same pieces. The data lives in tasks.py, the training loop in trainer.py, the verdict rule
and plots in report.py; the command line, the --jobs processes, resume bookkeeping and the
report's files are runner.py's and processes.py's, which a learner may skip.

Each arm trains from the same seed on the same batches; results (mean and spread over seeds,
the paper's figure beside them) are printed as a markdown table and written to
`<out>/results.md` and `<out>/results.json`. A killed run resumes from its checkpoints.
"""

import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch imports: one line and 130, as at every later moment
    signal.signal(signal.SIGINT, lambda sig, frame: sys.exit(print("interrupted during start-up: nothing was "
                                                                    "run or written", file=sys.stderr) or 130))

import math
from dataclasses import dataclass, field, fields

import torch

import ablations
import headline
import runner
from checks import MAX_INT, check_fits
from hd import HDConfig, attention_path
from tasks import Arith, Lookups


# -----------------------------------------------------------------------------
# Presets


def knob(default, what):
    """A Preset field with its --help text."""
    return field(default=default, metadata={"help": what})


@dataclass
class Preset:
    """One budget for every suite. The HD and MoE suites train the text backbone; the TaH suites
    train their own small dense models on synthetic tasks (TaH needs a model that is short of
    depth for its hardest tokens, see headline.TAH): in-context lookups (the headline) and
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
    block: int = knob(64, "tokens per sequence (text suites)")
    batch: int = knob(8, "global batch in sequences (text suites)")
    iters: int = knob(300, "steps of every from-scratch HD arm and of the MoE arms (--suite all, moe)")
    lr: float = knob(3e-3, "peak learning rate of those arms and of the HD backbone")
    warmup: int = knob(20, "warm-up steps of the text suites' stages")
    hd_base_iters: int = knob(150, "HD: steps of the n=1 backbone every arm continues from")
    hd_cont_iters: int = knob(160, "HD: steps every arm continues from the n=1 checkpoint")
    hd_cont_lr: float = knob(3e-3, "HD: the continuation's peak learning rate (warmup, then cosine)")
    # TaH: in-context lookups (Lookups) on tah_layers; addition (Arith, --suite all) on add_layers
    symbols: int = 8
    queries: int = 5
    two_hop: float = 0.3
    three_hop: float = knob(0.2, "--suite tah3: the share of three-hop queries")
    tah_layers: int = 1
    tah_ffn_hidden: int = knob(48, "TaH's FFN width, narrow: one pass cannot decode two hops from the listed pairs")
    digits: int = 4
    add_layers: int = 3
    tah_batch: int = 32
    tah_base_iters: int = knob(500, "TaH: steps of the base model every TaH arm starts from")
    tah_base_lr: float = 2e-3
    tah_sft_iters: int = knob(400, "TaH: steps of Standard, AlwaysThink and TaH stage 1, each from the base")
    tah_sft_lr: float = 2e-3
    decider_iters: int = knob(400, "TaH: steps of stage 2 (the decider)")
    decider_lr: float = 3e-3
    tah_eval_batches: int = knob(10, "TaH: held-out batches of every evaluation")
    seeds: int = knob(5, "seeds per arm (seed0 .. seed0 + seeds - 1)")
    plays: tuple = knob(("macbeth", "hamlet", "othello", "king-lear"), "the Shakespeare plays of the text, a comma "
                        "list ('': every play)")


PRESETS = {
    "default": Preset(),  # the measured protocol (README, RESULTS), on any device
    "large": Preset(  # not yet measured: wider, deeper, longer, for a GPU; opt-in (--preset large)
        n_layer=8, n_embd=192, n_head=18, n_kv_head=3, head_dim=32, n_experts=16, top_k=2, expert_hidden=192,
        ffn_hidden=576, layout="IIFIILII", window=64, block=128, batch=32, iters=600, lr=2e-3, warmup=50,
        hd_base_iters=600, hd_cont_iters=300, hd_cont_lr=2e-3, digits=6, add_layers=4, tah_batch=64,
        tah_base_iters=1500, tah_sft_iters=800, decider_iters=1200, seeds=5, plays=()),
    "smoke": Preset(  # head_dim 16: CUDA's flex kernels; batches of 8: a row for each of up to 8 torchrun ranks
        n_layer=3, n_embd=32, n_head=6, n_kv_head=2, head_dim=16, n_experts=4, expert_hidden=32, ffn_hidden=64,
        layout="IFL", window=8, block=32, batch=8, iters=4, warmup=2, hd_base_iters=4, hd_cont_iters=3, symbols=4,
        queries=2, digits=2, tah_batch=8, tah_base_iters=4, tah_sft_iters=3, decider_iters=3, tah_eval_batches=1,
        seeds=1, plays=("macbeth",)),
}



MAX_STEPS, MAX_SEEDS = 10**6, 1000  # the counts' stated maxima: steps (every *iters, warm-up, batches), seeds
COUNTS = {"seeds": MAX_SEEDS, **{f: MAX_STEPS for f in ("iters", "warmup", "hd_base_iters", "hd_cont_iters",
                                                          "tah_base_iters", "tah_sft_iters", "decider_iters",
                                                          "tah_eval_batches")}}
TEXT_VOCAB = 100_000  # the text's vocabulary is known only once it is read: at most cl100k's, for the size rule


def check_preset(P, device="cpu"):
    """Every field in range, and the models it builds valid and within the device's memory (the
    one rule for sizes, checks.check_fits): one line before anything is allocated or written."""
    for f in fields(Preset):
        v = getattr(P, f.name)
        if isinstance(v, int) and not 1 <= v <= COUNTS.get(f.name, MAX_INT):
            return f"--{f.name} must be an int in [1, {COUNTS.get(f.name, MAX_INT):,}], got {v}"
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
    return check_models(P, device)


def check_models(P, device):
    for name, task in (("symbols/queries", Lookups(P.symbols, P.queries, P.two_hop, per_problem=True)),
                       ("digits", Arith(P.digits))):
        if task.problem_len > P.block:
            return (f"--block {P.block} holds no whole {type(task).__name__} problem ({task.problem_len} "
                    f"tokens): raise --block or lower --{name}")
    try:
        cfgs = [(HDConfig(**headline.backbone_cfg(P, TEXT_VOCAB, layout=P.layout, window=P.window,
                                                  n_streams=max(headline.HD_CONT_NS))), P.batch)]
        for task, layers in ((Lookups(P.symbols, P.queries, P.two_hop, P.three_hop), P.tah_layers),
                             (Arith(P.digits), P.add_layers)):
            cfgs.append((headline.tah_config(P, task, layers), P.tah_batch))
    except ValueError as e:
        return f"this preset builds no valid model: {e}"
    for cfg, batch in cfgs:  # the largest model of each kind, training at its batch
        try:
            check_fits(cfg, batch, training=True, device=device)
        except ValueError as e:
            return f"{e} (--batch {P.batch}, --tah_batch {P.tah_batch})"
    return None


PATHS = {"fold": "streams folded, causal kernel", "causal": "causal kernel", "block": "flex block mask",
         "dense": "dense mask"}


def describe(P, device):
    """How each layer of the HD n = 4 model attends on this device (hd.attention_path), and TaH's mask."""
    cfg = HDConfig(**headline.backbone_cfg(P, 100, layout=P.layout, window=P.window, n_streams=4))
    skip = cfg.mirrored.start if cfg.mirror_skip_on else None
    dev = torch.device(device)
    layers = [f"{i} {letter}: {PATHS[attention_path(cfg, i, skip is not None and i >= skip, dev)]}"
              + (" (final stream only)" if skip is not None and i >= skip else "") for i, letter in enumerate(cfg.layout)]
    return f"HD n = 4 attention by layer: {'; '.join(layers)}. TaH: dense masks (duo-causal)"


# -----------------------------------------------------------------------------
# What runs: the headline suites by default; with --suite all (or --smoke) every suite of
# ablations.SUITES, the headline ones with their extra arms, in the report's order


LAB = runner.Lab(suites=tuple(ablations.SUITES), headline=(headline.HD.name, headline.TAH.name), presets=PRESETS,
                 check=check_preset, doc=__doc__, describe=describe)


def main(argv=None):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here runner.main answers Ctrl-C
    runner.main(argv, LAB)


if __name__ == "__main__":
    main()
