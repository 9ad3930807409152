"""
Tiny training runs that show the two papers' headline effects with numbers.

    python train_tiny.py                      # HD's expansion factor and TaH on lookups, the measured protocol
    python train_tiny.py --suite all          # every suite with every ablation arm (ablations.py)
    python train_tiny.py --smoke              # every suite's code path in seconds
    torchrun --nproc_per_node=8 train_tiny.py # DDP: the global batch split over ranks

Read top to bottom: the budgets (Preset), then the experiment: for each suite, for each seed,
train_seed trains and evaluates the suite's arms (the protocols of headline.py and ablations.py,
on the loop of trainer.py) and gives their rows; then every claim is judged by one rule and the
report written to <out>/results.md and results.json (report.py, figures.py). The command line,
the --jobs processes, torchrun, resuming and Ctrl-C sit behind runner.Session.
"""

import os
import signal


def interrupted_during_start_up(sig, frame):
    """Ctrl-C before the run opens its folder: nothing is written yet, so the process ends here
    and now. An exception raised instead could land inside an import (torch's, numpy's), where the
    import machinery may lose it, or turn it into another error, and the run would go on."""
    os.write(2, b"interrupted during start-up: nothing was run or written\n")
    os._exit(130)


if __name__ == "__main__":  # Ctrl-C while torch imports: one line and 130, as at every later moment
    signal.signal(signal.SIGINT, interrupted_during_start_up)

import math
import shutil
import time
from dataclasses import asdict, dataclass, field, fields

import torch

import ablations as ab
import figures
import headline as hl
import report
import runner
from checks import MAX_INT, check_fits
from hd import HDConfig, attention_path
from tasks import Arith, Lookups, load_text
from trainer import log, loss_curves


# -----------------------------------------------------------------------------
# Presets


def knob(default, what):
    """A Preset field with its --help text."""
    return field(default=default, metadata={"help": what})


@dataclass
class Preset:
    """One budget for every suite: the HD and MoE suites train the text backbone; the TaH suites
    small dense models on in-context lookups (the headline) and addition (--suite all)."""
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
    hd_ns: tuple = knob((1, 2, 4), "HD: the n of each continued arm, from 1 (the control) up; a claim that each n "
                        "beats n=1, and one per adjacent pair that the gain grows (--suite all: each from scratch too)")
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


# -----------------------------------------------------------------------------
# The experiment: for each suite, for each seed, its arms trained and evaluated; then the verdicts


SUITES = ["hd", "tah", "tah-hidden", "tah-add", "moe", "hd-progressive", "tah3"]  # the report's order
HEADLINE = ["hd", "tah"]  # a plain run; --suite all (and --smoke) runs every suite with its extra arms
TEXT = ["hd", "moe", "hd-progressive"]  # the suites that train on the text (Shakespeare, or --data)


def task(suite, P, text):
    """What a suite trains on: the text, or its synthetic task (tasks.py)."""
    return {"tah": Lookups(P.symbols, P.queries, P.two_hop),
            "tah-hidden": Lookups(P.symbols, P.queries, P.two_hop, per_problem=True),  # hop count once per problem
            "tah-add": Arith(P.digits),
            "tah3": Lookups(P.symbols, P.queries, P.two_hop, P.three_hop)}.get(suite, text)


def train_seed(suite, P, run, seed, data):
    """One (suite, seed)'s result rows: every arm trained on the seed's batches and evaluated on
    the held-out set; with --suite all, then the extra arms (ablations.py) from what it trained."""
    extra = None
    if suite == "hd":  # HD: each n of --hd_ns (1, 2, 4) continued from one n = 1 checkpoint
        rows, trained = hl.hd_protocol(P, run, seed, data)
        extra = ab.hd_ablations
    elif suite == "tah":  # TaH: Standard, AlwaysThink, TaH (oracle, decider) on in-context lookups
        rows, trained = hl.tah_protocol(P, run, seed, data)
        extra = ab.tah_attention_ablations
    elif suite == "tah-hidden":
        rows, trained = ab.tah_hidden(P, run, seed, data)
    elif suite == "tah-add":
        rows, trained = ab.tah_addition(P, run, seed, data)
        extra = ab.tah_attention_ablations
    elif suite == "moe":
        rows, trained = ab.moe_protocol(P, run, seed, data)
        extra = ab.moe_mirror
    elif suite == "hd-progressive":
        rows, trained = ab.hd_progressive(P, run, seed, data)
    else:
        rows, trained = ab.tah3_protocol(P, run, seed, data)
    if run.every_arm and extra is not None:
        rows += extra(P, run, seed, data, trained)
    return rows


def claims(P):
    """Every claim, suite by suite: what the paper says, as an arm against a baseline in a metric
    with a sign. A claim is judged where its suite's rows are."""
    return (hl.hd_claims(P.hd_ns) + ab.HD_ABLATION_CLAIMS
            + hl.TAH_CLAIMS + [ab.attention_claim("tah", "TaH, lookups")]
            + hl.tah_claims(ab.TAH_HIDDEN_FX, ab.HIDDEN) + ab.router_claims(ab.TAH_HIDDEN_FX, ab.HIDDEN)
            + hl.inside_claims(ab.TAH_HIDDEN_FX, ab.HIDDEN)
            + hl.tah_claims(ab.TAH_ADD_FX, "TaH, addition") + [ab.attention_claim("tah-add", "TaH, addition")]
            + ab.MOE_CLAIMS + ab.HD_PROG_CLAIMS + ab.TAH3_CLAIMS)


FIGURES = ("loss_curves.png", "hd_streams.png", "tah_tradeoff.png", "tah_problem.png")


def main(argv=None):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here the session answers Ctrl-C
    with runner.Session(argv, __doc__, PRESETS, SUITES, HEADLINE, TEXT, check_preset) as session:
        P, out, t0 = session.P, session.out, time.time()
        for stale in ("results.md", "results.json") + FIGURES:  # a run that stops early leaves no other run's
            (out / stale).unlink(missing_ok=True)
        text = load_text(session.data, P.plays, P.block, out) if set(session.suites) & set(TEXT) else None
        if session.smoke:
            log("--smoke checks the plumbing: every suite's code path on tiny models, one seed, which decides "
                       "nothing (the report is in results.md)")
        log(f"preset {session.preset_name}: {P}")
        log(f"{session.device}, compile {'on' if session.run.compile else 'off'}; {describe(P, session.device)}")
        if text is not None:
            log(f"text: {len(text.tokens):,} tokens, vocab {text.vocab_size:,}")
        for suite in session.suites:
            for seed in session.seeds:
                session.train(train_seed, suite, seed, task(suite, P, text))  # rows saved; the last call waits
        if session.master:  # under torchrun, rank 0
            write_report(session, P, time.time() - t0)


def write_report(session, P, seconds):
    """results.md / results.json from the rows alone, every claim judged by the rule; the figures."""
    out, run = session.out, session.run
    eval_set = "dev" if run.eval_split == "dev" else "held-out"
    header = (f"Measured by `{session.command}` on {session.machine}, {P.seeds} seed(s), evaluated on the {eval_set} "
              f"set; {seconds:.0f} s for this invocation.")
    meta = {"preset": asdict(P), "run": run.run_dir.name, "data": session.data, "device": session.machine,
            "world_size": session.world, "eval_set": run.eval_split}
    summary = report.write_report(session.rows, claims(P), header, run, out, meta,
                                  {**hl.HD_INSIDE_MD, **hl.TAH_INSIDE_MD}, brief=session.smoke)
    drawn = [figures.plot(loss_curves(run.run_dir), out)]
    if "hd" in session.suites:
        drawn.append(hl.plot_hd_streams(summary, out, P.hd_ns))
    if set(session.suites) & {"tah", "tah-hidden", "tah-add"}:
        drawn.append(hl.plot_tah_tradeoff(summary, out, eval_set))
    if "tah" in session.suites:
        drawn.append(hl.copy_tah_problem(run.run_dir, out))
    log("figures: " + ", ".join(str(f) for f in drawn if f))
    if session.smoke and (run.run_dir / "ckpt").is_dir():
        shutil.rmtree(run.run_dir / "ckpt")
        log(f"--smoke: its checkpoints are removed ({run.run_dir / 'ckpt'}); its rows stay in rows.json")


# -----------------------------------------------------------------------------
# A preset's checks (runner.Session runs them before anything is written), and what a run's first
# lines say of how its models attend


MAX_STEPS, MAX_SEEDS = 10**6, 1000  # the counts' stated maxima: steps (every *iters, warm-up, batches), seeds
COUNTS = {"seeds": MAX_SEEDS, **{f: MAX_STEPS for f in ("iters", "warmup", "hd_base_iters", "hd_cont_iters",
                                                          "tah_base_iters", "tah_sft_iters", "decider_iters",
                                                          "tah_eval_batches")}}
TEXT_VOCAB = 100_000  # the text's vocabulary is known only once it is read: at most cl100k's, for the size rule


def check_preset(P, device="cpu", suites=(), world=1, accum=1, sharing=1):
    """Every field in range, each suite's global batch cut into `world` ranks x `accum` micro-steps
    (an uneven cut is fine), and the models it builds valid and within the device's memory, shared
    by `sharing` processes (the one rule for sizes, checks.check_fits): one line before anything is
    allocated or written."""
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
    if P.hd_ns[:1] != (1,) or len(P.hd_ns) < 2 or list(P.hd_ns) != sorted(set(P.hd_ns)) or max(P.hd_ns) > 64:
        return f"--hd_ns must start at 1 (the control) and rise, at most 64, two values or more, got {P.hd_ns}"
    for batch_field in dict.fromkeys("batch" if s in TEXT else "tah_batch" for s in suites):
        if getattr(P, batch_field) < world * accum:
            return f"--{batch_field} {getattr(P, batch_field)} has fewer rows than {world} rank(s) x {accum} micro-step(s) " \
                   "(--accum)"
    return check_models(P, device, sharing)


def check_models(P, device, sharing=1):
    for name, task in (("symbols/queries", Lookups(P.symbols, P.queries, P.two_hop, per_problem=True)),
                       ("digits", Arith(P.digits))):
        if task.problem_len > P.block:
            return (f"--block {P.block} holds no whole {type(task).__name__} problem ({task.problem_len} "
                    f"tokens): raise --block or lower --{name}")
    try:
        cfgs = [(HDConfig(**hl.backbone_cfg(P, TEXT_VOCAB, layout=P.layout, window=P.window,
                                            n_streams=max(P.hd_ns))), P.batch)]
        for task, layers in ((Lookups(P.symbols, P.queries, P.two_hop, P.three_hop), P.tah_layers),
                             (Arith(P.digits), P.add_layers)):
            cfgs.append((hl.tah_config(P, task, layers), P.tah_batch))
    except ValueError as e:
        return f"this preset builds no valid model: {e}"
    for cfg, batch in cfgs:  # the largest model of each kind, training at its batch
        try:
            check_fits(cfg, batch, training=True, device=device, sharing=sharing)
        except ValueError as e:
            return f"{e} (--batch {P.batch}, --tah_batch {P.tah_batch})"
    return None


PATHS = {"fold": "streams folded, causal kernel", "causal": "causal kernel", "block": "flex block mask",
         "dense": "dense mask"}


def describe(P, device):
    """How each layer of the largest HD model attends on this device (hd.attention_path), and TaH's mask."""
    n = max(P.hd_ns)
    cfg = HDConfig(**hl.backbone_cfg(P, 100, layout=P.layout, window=P.window, n_streams=n))
    skip = cfg.mirrored.start if cfg.mirror_skip_on else None
    dev = torch.device(device)
    layers = [f"{i} {letter}: {PATHS[attention_path(cfg, i, skip is not None and i >= skip, dev)]}"
              + (" (final stream only)" if skip is not None and i >= skip else "") for i, letter in enumerate(cfg.layout)]
    return f"HD n = {n} attention by layer: {'; '.join(layers)}. TaH: dense masks (duo-causal)"


if __name__ == "__main__":
    main()
