"""
Tiny training runs that show the two papers' headline effects with numbers.

    python train_tiny.py                      # HD's expansion factor and TaH on lookups, the measured protocol
    python train_tiny.py --jobs 1             # the same in this one process: breakpoint() works anywhere
    python train_tiny.py --suite all          # every suite with every ablation arm (lab/ablations.py)
    python train_tiny.py --smoke              # every suite's code path in seconds
    torchrun --nproc_per_node=8 train_tiny.py # DDP: the global batch split over ranks

Read top to bottom: the budgets (Preset), then main: parse the flags, open the run, train and
evaluate each suite's arms seed by seed (train_seed: each paper's experiment, hd_experiment.py and
tah_experiment.py, on the loop of trainer.py and the data of tasks.py), judge every claim by the one
rule (experiment.py), write the report. What a
learner may skip (the command line, the --jobs processes, resuming, the tables and figures) is in lab/.
"""

from lab import startup  # first, before torch imports: Ctrl-C in these first seconds ends the process at once

startup.guard(__name__)

import shutil  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402

import experiment  # noqa: E402
import hd_experiment  # noqa: E402
import tah_experiment  # noqa: E402
from lab import figures, presets, report, runner, tokens  # noqa: E402
from tasks import Lookups, load_text  # noqa: E402
from trainer import log  # noqa: E402


# -----------------------------------------------------------------------------
# Presets


def described(default, what):
    """A Preset field with what it is for, which --help prints."""
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
    block: int = described(64, "tokens per sequence (text suites)")
    batch: int = described(8, "global batch in sequences (text suites)")
    iters: int = described(300, "steps of every from-scratch HD arm and of the MoE arms (--suite all, moe)")
    lr: float = described(3e-3, "peak learning rate of those arms and of the HD backbone")
    warmup: int = described(20, "warm-up steps of the text suites' stages")
    hd_base_iters: int = described(150, "HD: steps of the n=1 backbone every arm continues from")
    hd_cont_iters: int = described(160, "HD: steps every arm continues from the n=1 checkpoint")
    hd_cont_lr: float = described(3e-3, "HD: the continuation's peak learning rate (warmup, then cosine)")
    hd_ns: tuple = described((1, 2, 4), "HD: the n of each continued arm, from 1 (the control) up; a claim that each n "
                        "beats n=1, and one per adjacent pair that the gain grows (--suite all: each from scratch too)")
    # TaH: in-context lookups (Lookups) on tah_layers; addition (Arith, --suite all) on add_layers
    symbols: int = 8
    queries: int = 5
    two_hop: float = 0.3
    three_hop: float = described(0.2, "--suite tah3: the share of three-hop queries")
    tah_layers: int = 1
    tah_ffn_hidden: int = described(48, "TaH's FFN width, narrow: one pass cannot decode two hops from the listed pairs")
    digits: int = 4
    add_layers: int = 3
    tah_batch: int = 32
    tah_base_iters: int = described(500, "TaH: steps of the base model every TaH arm starts from")
    tah_base_lr: float = 2e-3
    tah_sft_iters: int = described(400, "TaH: steps of Standard, AlwaysThink and TaH stage 1, each from the base")
    tah_sft_lr: float = 2e-3
    decider_iters: int = described(400, "TaH: steps of stage 2 (the decider)")
    decider_lr: float = 3e-3
    tah_eval_batches: int = described(10, "TaH: held-out batches of every evaluation")
    seeds: int = described(5, "seeds per arm (seed0 .. seed0 + seeds - 1)")
    plays: tuple = described(("macbeth", "hamlet", "othello", "king-lear"), "the Shakespeare plays of the text, a comma "
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


SUITES = ["hd", "tah", "tah-hidden", "tah-add", "moe", "hd-progressive", "tah3", "hd-compute-lr",
          "hd-compute"]  # the report's order
HEADLINE = ["hd", "tah"]  # a plain run; --suite all (and --smoke) runs every suite with its extra arms
TEXT = ["hd", "moe", "hd-progressive", "hd-compute-lr", "hd-compute"]  # the suites on the text (Shakespeare, or --data)


def main(argv=None):
    flags = runner.parse_flags(argv, doc=__doc__, presets=PRESETS, suites=SUITES, headline=HEADLINE, text_suites=TEXT,
                               check=presets.check_preset)
    preset, started = flags.preset, time.time()
    with runner.open_run(flags) as jobs:  # the run's folder and its finished rows; from here Ctrl-C saves what finished
        ctx = jobs.ctx  # the run's context (trainer.Context): its folder, device, seeds, evaluation split
        text = (load_text(flags.data, preset.plays, preset.block, tokens.TokenCaches(flags.out))
                if set(flags.suites) & set(TEXT) else None)
        say_what_runs(flags, text)
        for suite in flags.suites:
            for seed in flags.seeds:  # train_seed(...) here, or in a --jobs process of its own
                jobs.submit(train_seed, suite, preset, ctx, seed, task(suite, preset, text))
        jobs.wait()
    if flags.master:  # under torchrun, rank 0; after SIGTERM (a time limit), the report of what finished
        with runner.reporting():  # Ctrl-C here too: one line
            write_report(flags, ctx, jobs.rows, time.time() - started, stopped=jobs.stopped)


def task(suite, preset, text):
    """What a suite trains on: the text, or its synthetic task (tasks.py; --suite all's addition: lab/arith.py)."""
    p = preset
    if suite == "tah-add":
        from lab.arith import Arith
        return Arith(p.digits)
    if suite in ("tah", "tah-hidden", "tah3"):  # lookups; tah-hidden: the hop count once per problem
        return Lookups(p.symbols, p.queries, p.two_hop, p.three_hop if suite == "tah3" else 0.0,
                       per_problem=suite == "tah-hidden")
    return text


def train_seed(suite, preset, ctx, seed, data):
    """One (suite, seed)'s result rows: every arm trained on the seed's batches and evaluated on
    the held-out set, with the probes of what the trained models do. The headline suites' protocols
    (hd_experiment.py, tah_experiment.py); the rest, and every extra arm under --suite all, from
    lab/ablations.py."""
    if suite == "hd" and not ctx.ablations:  # HD: each n of --hd_ns (1, 2, 4) continued from one n = 1 checkpoint
        return hd_experiment.hd_protocol(preset, ctx, seed, data)[0]
    if suite == "tah" and not ctx.ablations:  # TaH: Standard, AlwaysThink, TaH (oracle, decider) on lookups
        return tah_experiment.tah_protocol(preset, ctx, seed, data)[0]
    from lab import ablations
    return ablations.train_seed(suite, preset, ctx, seed, data)


def claims(flags):
    """Every claim of the suites that ran: what the paper says, as an arm against a baseline in a
    metric with a sign."""
    headline = ((hd_experiment.hd_claims(flags.preset.hd_ns) if "hd" in flags.suites else [])
                + (tah_experiment.TAH_CLAIMS if "tah" in flags.suites else []))
    if not (set(flags.suites) - set(HEADLINE) or flags.ctx.ablations):
        return headline
    from lab import ablations
    return headline + ablations.claims(flags.preset)


FIGURES = ("loss_curves.png", "hd_streams.png", "tah_tradeoff.png", "tah_problem.png", "hd_compute.png")


def say_what_runs(flags, text):
    """The run's first lines, and no report of an earlier run left beside this one's."""
    for stale in ("results.md", "results.json") + FIGURES:
        (flags.out / stale).unlink(missing_ok=True)
    if flags.smoke:
        log("--smoke checks the plumbing: every suite's code path on tiny models, one seed, which decides nothing "
            "(the report is in results.md)")
    log(f"preset {flags.preset_name}: {flags.preset}")
    log(f"{flags.ctx.device}, compile {'on' if flags.ctx.compile else 'off'}; "
        f"{report.describe(hd_experiment.hd_config(flags.preset, 100, max(flags.preset.hd_ns)), flags.ctx.device)}")
    if text is not None:
        log(f"text: {len(text.tokens):,} tokens, vocab {text.vocab_size:,}")


def write_report(flags, ctx, rows, seconds, stopped=None):
    """results.md and results.json from the rows alone, every claim judged by the rule
    (experiment.judge); then the figures. stopped: the run was stopped (SIGTERM), the report partial."""
    eval_set = "dev" if ctx.eval_split == "dev" else "held-out"
    header = (f"Measured by `{flags.command}` on {flags.machine}, {flags.preset.seeds} seed(s), evaluated on the "
              f"{eval_set} set; {seconds:.0f} s for this invocation.") + (f"\n\n**Partial: {stopped}**" if stopped else "")
    meta = {"preset": asdict(flags.preset), "run": ctx.run_dir.name, "data": flags.data, "device": flags.machine,
            "world_size": flags.world, "eval_set": ctx.eval_split, "partial": stopped}
    kept = {ctx.run_dir / "inside" / name: title for name, title in (hd_experiment.KEPT | tah_experiment.KEPT).items()}
    summary = report.write_report(rows, experiment.judge(rows, claims(flags)), flags.out, header=header,
                                  rule=experiment.RULE, meta=meta, inside=kept, first_seed=ctx.seeds[0], brief=flags.smoke)
    if stopped:
        raise SystemExit(f"{stopped}: results.md holds what finished, marked partial; run the same command to go on")
    drawn = [figures.plot(figures.loss_curves(ctx.run_dir), flags.out)]
    if "hd" in flags.suites:
        drawn.append(figures.plot_hd_streams(summary, flags.out, flags.preset.hd_ns))
    if set(flags.suites) & {"tah", "tah-hidden", "tah-add"}:
        drawn.append(figures.plot_tah_tradeoff(summary, flags.out, eval_set))
    if "tah" in flags.suites:
        drawn.append(figures.copy_tah_problem(ctx.run_dir, flags.out))
    if "hd-compute-lr" in flags.suites:  # the search's choice, which lab/compute.py's RATES holds
        from lab import compute
        log(f"hd-compute-lr chose (rate, added) per way: {compute.search_choice(rows)} (RATES: {compute.RATES})")
    if "hd-compute" in flags.suites:  # loss against training FLOPs (--suite hd-compute, or all)
        from lab import compute
        drawn.append(compute.plot(summary, flags.out, flags.preset.hd_ns))
    log("figures: " + ", ".join(str(f) for f in drawn if f))
    if flags.smoke and (ctx.run_dir / "ckpt").is_dir():
        shutil.rmtree(ctx.run_dir / "ckpt")
        log(f"--smoke: its checkpoints are removed ({ctx.run_dir / 'ckpt'}); its rows stay in rows.json")


if __name__ == "__main__":
    main()
