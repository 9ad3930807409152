"""
The runner of train_tiny.py: what turns suites into a run. A learner may skip this file.

A script declares its suites (Suite, below) and presets and hands them over as a Lab:
train_tiny.py ends with `runner.main(argv, LAB)`. The runner imports no demonstration. It owns
the command line (checked whole before anything trains, one line per problem); the run's folder,
key, rows and resume bookkeeping; the planning probe and the plan the progress line counts down;
--jobs processes and Ctrl-C; the report (results.md, results.json, the plots).
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from processes import DDP, MASTER, PROGRESS, WORLD, log, run_in_processes, start_ddp
from report import write_report
from tasks import load_text
from trainer import Run, load_rows, save_rows

MAX_SEED0 = (2**63 - 1 - 2 * 10**9) // 1_000_003 - 10**6  # room for 10^6 seeds and 10^9 steps


# -----------------------------------------------------------------------------
# What a script hands the runner


@dataclass
class Suite:
    """One demonstration, declared in one place; the runner reads everything else off it.

    protocol(P, run, seed, data) trains the arms of one seed and returns (rows, trained): rows
    (report.result_rows; claims match them by the effect's and arm's ids), and what `extra` builds on. An effect's first arm
    is the baseline its other arms are compared with, seed by seed; the report reads only rows.
    extra(P, run, seed, data, trained), on runs of every arm, trains the ablation arms after the
    protocol's, in the same (suite, seed). plots(summary, out, eval_set, run_dir) each draw one
    figure (its path, or None); `inside` names the analyses (markdown) the protocol keeps in
    <run>/inside, with their titles; `outputs` the files of <out> its plots write. Every callable
    is a module-level function, so that a --jobs process receives the suite whole."""
    name: str
    protocol: Callable
    claims: list
    task: Optional[Callable] = None  # Preset -> the task; None: the text (Shakespeare, or --data)
    batch: str = "batch"  # the Preset field that is this suite's global batch
    extra: Optional[Callable] = None
    plots: list = field(default_factory=list)
    inside: dict = field(default_factory=dict)
    outputs: tuple = ()


@dataclass(frozen=True)
class Lab:
    """A script's suites and budgets: `suites` every Suite in the report's order, `headline` the
    names a plain run trains, `presets` name -> Preset ("default", "large" and "smoke"),
    `check(P, device)` the first problem of a preset as one line (or None), `doc` the --help text,
    `describe(P, device)` what a run's first lines say of how its models run."""
    suites: tuple
    headline: tuple
    presets: dict
    check: Callable
    doc: str
    describe: Callable = lambda P, device: ""

    def suite(self, name):
        return next(s for s in self.suites if s.name == name)

    def names(self):
        return [s.name for s in self.suites]


# -----------------------------------------------------------------------------
# Command line


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default, once, in the form the flag takes; a help text that says its own
    default (a default that depends on the machine) is left as it is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
            return text
        return f"{text} (default: {action.default})"


def flag(ap, name, **kw):
    """One option under both spellings, --a_b and --a-b."""
    spellings = dict.fromkeys((f"--{name.replace('-', '_')}", f"--{name.replace('_', '-')}"))
    return ap.add_argument(*spellings, **kw)


def preset_flags(ap, presets):
    """One flag per Preset field, nanoGPT style (--n_layer=4, --plays=macbeth,hamlet): each
    overrides the chosen preset's value."""
    group = ap.add_argument_group("preset overrides (default: the preset's value)")
    for f in fields(presets["default"]):
        kind = type(f.default)
        parse_value = (lambda v: tuple(x for x in v.split(",") if x)) if kind is tuple else kind
        values = ", ".join(f"{k} {flag_form(getattr(p, f.name))}" for k, p in presets.items())
        what = f.metadata.get("help")
        flag(group, f.name, type=parse_value, default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
             help=f"{what}; preset {values}" if what else f"preset {values}")


def flag_form(value):
    """A preset value as the flag takes it: a tuple as a comma list (empty: '')."""
    return (",".join(value) or "''") if isinstance(value, tuple) else str(value)


def parser(lab):
    ap = argparse.ArgumentParser(description=lab.doc, formatter_class=HelpFormatter)
    flag(ap, "suite", default="headline", metavar="{headline,all," + ",".join(lab.headline) + ",...}",
         help=f"headline: {' and '.join(lab.headline)}; all: every suite with every ablation arm; or a comma list of "
              + ",".join(lab.names()))
    flag(ap, "preset", choices=sorted(lab.presets),
         help="the budget: default (when not given) is the measured protocol, on any device; large is wider and "
              "longer, for a GPU, and not yet measured%(default).0s")
    flag(ap, "smoke", action="store_true", help="every suite's code path, tiny and fast (its own preset)")
    flag(ap, "rehearse", action="store_true",
         help="the large preset's every arm at its full shapes, 2 steps each, here (bf16 autocast on CPU): "
              "parameter counts, activation memory, and any error a GPU run would meet early")
    flag(ap, "data", help="train the text suites on this UTF-8 text file instead of Shakespeare")
    flag(ap, "accum", type=int, default=1, help="gradient accumulation micro-steps")
    flag(ap, "muon", action="store_true", help="Muon for 2-D weights in the blocks, AdamW for the rest")
    flag(ap, "compile", action=argparse.BooleanOptionalAction, default=False,
         help="torch.compile the training steps (the backbone and HD whole, TaH per pass): off by default on every "
              "device, since a default run's 11 graphs cost more to compile than they save (RESULTS, 'Compile')")
    flag(ap, "out", default="out", help="folder for results, checkpoints and the token cache")
    flag(ap, "log_every", type=int, default=50, help="steps between log lines")
    flag(ap, "ckpt_every", type=int, default=50, help="steps between checkpoints")
    flag(ap, "device", default="cuda" if torch.cuda.is_available() else "cpu",
         help="cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu)")
    flag(ap, "threads", type=int, default=1,
         help="CPU threads per process (float sums, and so the last digits, depend on it; the README's runs "
              "used 1)")
    flag(ap, "jobs", type=int,
         help="(suite, seed)s trained at once, each in a process of its own; the numbers do not depend on it "
              "(default: the usable cores // --threads, on a CPU and on one GPU, whose launch-bound tiny steps leave "
              "it idle otherwise; under torchrun 1)")
    flag(ap, "seed0", type=int, default=0, help="the first seed: a run trains seeds seed0 .. seed0 + seeds - 1")
    flag(ap, "fresh", action="store_true",
         help="delete this configuration's checkpoints and finished rows first, and train everything again")
    flag(ap, "dev", action="store_true", help="evaluate on the dev set instead of the held-out set: for trying things out")
    preset_flags(ap, lab.presets)
    return ap


@dataclass(frozen=True)
class Options:
    """The command line, checked, and what follows from it: made once by parse."""
    lab: Lab
    P: object  # the preset, with the command line's overrides
    preset_name: str
    suites: list  # the names of the suites to run, in the order given
    seeds: range
    every_arm: bool  # --suite all, --smoke, --rehearse: every suite's extra arms too
    jobs: int
    out: str
    data: Optional[str]
    device: str
    threads: int
    accum: int
    muon: bool
    compile: bool
    rehearse: bool
    log_every: int
    ckpt_every: int
    fresh: bool
    dev: bool
    eval_split: str
    eval_seed: int
    tidy: bool = False  # --smoke: its checkpoints are removed once its report is written


def parse(argv, lab):
    """The command line, checked whole before anything trains: one line per problem."""
    ap = parser(lab)
    a = ap.parse_args(argv)
    names = {"headline": lab.names() if a.smoke else list(lab.headline), "all": lab.names()}.get(
        a.suite, a.suite.split(","))  # --smoke: every code path
    if problem := check_args(a, names, lab):
        ap.error(problem)
    preset_name, out = "smoke" if a.smoke else a.preset or "default", a.out
    P = lab.presets[preset_name]
    if a.rehearse:  # the large shapes, every arm, 2 steps each, one seed, one evaluation batch
        preset_name, names, out = "large (rehearsal)", lab.names(), a.out if a.out != "out" else "out-rehearsal"
        P = replace(lab.presets["large"], iters=2, hd_base_iters=2, hd_cont_iters=2, tah_base_iters=2, tah_sft_iters=2,
                    decider_iters=2, warmup=1, tah_eval_batches=1, seeds=1)
    P = replace(P, **{f.name: getattr(a, f.name) for f in fields(P) if hasattr(a, f.name)})
    if problem := lab.check(P, a.device) or check_batches(P, names, a.accum, lab):
        ap.error(problem)
    jobs = a.jobs or (1 if DDP else max(1, usable_cores() // a.threads))  # on one GPU too: the processes share it
    return Options(lab, P, preset_name, names, range(a.seed0, a.seed0 + P.seeds),
                   a.suite == "all" or a.smoke or a.rehearse, jobs, out, a.data, a.device, a.threads, a.accum, a.muon,
                   a.compile,
                   a.rehearse, a.log_every, a.ckpt_every, a.fresh, a.dev,
                   *(("dev", 104729) if a.dev else ("val", 7919)), tidy=a.smoke)


def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def text_suites(names, lab):
    return [s for s in names if lab.suite(s).task is None]


def check_args(a, names, lab):
    """The flags apart from the preset's: the first problem, as one line, or None."""
    bad = [s for s in names if s not in lab.names()]
    if bad:
        return f"unknown suite(s) {bad}; choose headline, all, or from {sorted(lab.names())}"
    if len(set(names)) != len(names):
        return f"--suite {a.suite} names a suite twice"
    if a.smoke and a.preset:
        return "--smoke is its own preset; give --smoke or --preset, not both"
    if a.rehearse and (a.smoke or a.preset or a.suite != "headline"):
        return "--rehearse runs every suite of the large preset; give it without --smoke, --preset or --suite"
    if not a.out.strip() or not is_utf8(a.out) or (a.data and not is_utf8(a.data)):
        return "--out must name a folder, and --out and --data must be UTF-8 paths"
    if a.data and not text_suites(names, lab):
        return f"--data feeds the suites that train on text ({', '.join(text_suites(lab.names(), lab))}); this run has none"
    return check_process_flags(a) or check_device(a.device)


def check_process_flags(a):
    for k in ("accum", "log_every", "ckpt_every", "threads", "jobs"):
        if getattr(a, k) is not None and getattr(a, k) < 1:
            return f"--{k} must be >= 1, got {getattr(a, k)}"
    if DDP and (a.jobs or 1) > 1:
        return "--jobs trains in processes of its own; under torchrun give --jobs 1 (each rank is one process)"
    if a.seed0 < 0:
        return f"--seed0 must be >= 0, got {a.seed0}"
    if a.seed0 > MAX_SEED0:  # trainer.batch_gen: seed * 1_000_003 + 2 * step + 1 must fit a 64-bit seed
        return f"--seed0 must be at most {MAX_SEED0:,} (the batch seeds derived from it must fit in 63 bits), got {a.seed0}"
    if a.data and not Path(a.data).is_file():
        return f"--data {a.data}: no such file" + (" (it is a folder)" if Path(a.data).is_dir() else "")
    return None


def check_device(device):
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        return f"--device must be cpu, cuda or cuda:N, got {device!r}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {device}: CUDA is not available"
    if ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
        return f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)"
    return None


def is_utf8(path):
    return not any(0xDC80 <= ord(c) <= 0xDCFF for c in path)  # a byte that is not UTF-8 arrives as a surrogate escape


def check_batches(P, names, accum, lab):
    """Every suite's global batch has a row for each rank's each micro-step: checked before the first
    step (an uneven cut is fine: trainer.MicroSteps weights each piece by its rows)."""
    for batch_field in dict.fromkeys(lab.suite(s).batch for s in names):
        batch = getattr(P, batch_field)
        if batch < WORLD * accum:
            return f"--{batch_field} {batch} has fewer rows than {WORLD} rank(s) x {accum} micro-step(s) (--accum)"
    return None


# -----------------------------------------------------------------------------
# Main: run what is not done yet, then report


def main(argv, lab):
    try:  # the file system's errors (a path that is a folder, no permission, a full disk): one line each
        opts = parse(argv, lab)
        if DDP:
            opts = replace(opts, device=start_ddp(opts.device))  # trainer.py: the process group, or one line why not
        with torch._dynamo.config.patch(**DYNAMO):
            run(opts, argv)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (--jobs processes are stopped on the way out)
        if MASTER:  # under torchrun every rank gets it
            print("interrupted: what finished is saved (rows after each (suite, seed), checkpoints every "
                  "--ckpt_every steps); run the same command to go on", file=sys.stderr)
        raise SystemExit(130)
    except OSError as e:
        where = e.filename or "a file of this run"
        raise SystemExit(f"error: {e.strerror or e} ({where}); nothing of the step that met it is saved")
    if DDP:
        dist.destroy_process_group()


def run(opts, argv):
    """Train every (suite, seed) not done yet, saving the rows after each, then report."""
    P, out, lab = opts.P, Path(opts.out), opts.lab
    out.mkdir(parents=True, exist_ok=True)
    for tmp in out.glob("*.tmp"):  # results or a token cache of a run killed mid-write
        tmp.unlink(missing_ok=True)
    for stale in result_files(lab):  # a run that stops early must not leave another run's results beside it
        (out / stale).unlink(missing_ok=True)
    set_up_torch(opts.threads)
    text = load_text(opts.data, P.plays, P.block, out) if text_suites(opts.suites, lab) else None
    if opts.tidy:
        log("--smoke checks the plumbing: every suite's code path on tiny models, one seed, which decides nothing "
            "(the report is in results.md)")
    log(f"preset {opts.preset_name}: {P}")
    log(f"{opts.device}, compile {'on' if opts.compile else 'off'}; {lab.describe(P, opts.device)}")
    if text is not None:
        log(f"text: {len(text.tokens):,} tokens, vocab {text.vocab_size:,}")
    ctx = open_run(opts, text, out)
    rows = load_rows(ctx.run_dir / "rows.json", ctx.run_key)
    done = {(r["suite"], r["seed"]) for r in rows}
    t0 = time.time()
    todo = [(suite, seed) for suite in opts.suites for seed in opts.seeds if (suite, seed) not in done]
    data = {s: text if lab.suite(s).task is None else lab.suite(s).task(P) for s in opts.suites}
    stages, rates = planned(opts, ctx, data, todo)
    for suite, seed in [(suite, seed) for suite in opts.suites for seed in opts.seeds if (suite, seed) in done]:
        log(f"{suite} seed {seed}: already done, skipped")
    if opts.jobs > 1 and len(todo) > 1:
        rows = train_in_processes(opts, ctx, todo, data, stages, rates, rows)
    else:
        PROGRESS.start([stage for suite, _ in todo for stage in stages[suite]], rates)
        for suite, seed in todo:
            rows = in_order(rows + run_suite(lab.suite(suite), P, ctx, seed, data[suite]), lab)
            if MASTER:
                save_rows(ctx.run_dir / "rows.json", rows, ctx.run_key)
    if MASTER:
        report(rows, opts, ctx, out, argv, time.time() - t0)
        if opts.tidy and (ctx.run_dir / "ckpt").is_dir():
            shutil.rmtree(ctx.run_dir / "ckpt")
            log(f"--smoke: its checkpoints are removed ({ctx.run_dir / 'ckpt'}); its rows stay in rows.json")


def run_suite(suite, P, run, seed, data):
    """One (suite, seed): its protocol, then (on runs of every arm) its extra arms; rows tagged
    with the suite."""
    rows, trained = suite.protocol(P, run, seed, data)
    if run.every_arm and suite.extra is not None:
        rows += suite.extra(P, run, seed, data, trained)
    return [{**r, "suite": suite.name} for r in rows]


def planned(opts, run, data, todo):
    """What each suite to do trains: its stages in order as (arm, steps), and each arm's seconds
    per step, both read off a probe that runs each suite's protocol once (on the first seed to
    do) with every stage cut to a few steps and every evaluation to one batch (a Run whose
    `probe` collects them). The stages and their step counts are the protocol's own; nothing
    here restates them."""
    stages, rates = {}, {}
    for suite, seed in todo:
        if suite not in stages:
            probe = replace(run, probe=[])
            run_suite(opts.lab.suite(suite), opts.P, probe, seed, data[suite])
            stages[suite] = [(arm, steps) for arm, steps, _ in probe.probe]
            rates.update({arm: sec for arm, _, sec in probe.probe if sec is not None})
    return stages, rates


def in_order(rows, lab):
    """Rows by suite (the Lab's order), then seed: the report's sums over seeds, and so its last
    digits, depend neither on --jobs nor on a resume."""
    suites = lab.names()
    return sorted(rows, key=lambda r: (suites.index(r["suite"]), r["seed"]))


# -----------------------------------------------------------------------------
# Every process's torch settings


def set_up_torch(threads):
    torch.set_float32_matmul_precision("high")
    torch.set_num_threads(threads)


# Every process of a run: a compiled function (CUDA's flex, --compile's models) that meets dynamo's
# recompile limit stops the run, instead of falling back with a warning to eager (for flex: the unfused
# kernel). The limit allows a graph per arm configuration (--suite all: TaH's passes take 28).
DYNAMO = dict(fail_on_recompile_limit_hit=True, recompile_limit=64)


# -----------------------------------------------------------------------------
# --jobs: each (suite, seed) in a process of its own


class Job(NamedTuple):
    """What a --jobs process trains: one (suite, seed), with the plan its progress line counts
    down and `run_plan` (the parent's clock, prediction and scale: trainer.Progress)."""
    suite: Suite
    seed: int
    P: object
    run: Run
    data: object
    stages: list
    rates: dict
    run_plan: tuple
    threads: int


def train_in_processes(opts, ctx, todo, data, stages, rates, rows, work=None):
    """--jobs > 1: each (suite, seed) to do in a fresh process of opts.threads threads, opts.jobs
    at a time (processes.run_in_processes; `work`, train_one unless a test says otherwise, runs
    one), its rows saved as it finishes: the same rows as one process's with the same --threads
    (each suite seeds its own generators). What finished is kept."""
    seconds = {suite: sum(steps * rates.get(arm, 0.0) for arm, steps in stages[suite]) for suite in stages}
    done = [rows]

    def save(suite, seed, found):
        done[0] = in_order(done[0] + found, opts.lab)
        save_rows(ctx.run_dir / "rows.json", done[0], ctx.run_key)

    def job(suite, seed, plan):
        return Job(opts.lab.suite(suite), seed, opts.P, ctx, data[suite], stages[suite], rates, plan, opts.threads)
    run_in_processes(todo, seconds, opts.jobs, opts.threads, job, work or train_one, save)
    return done[0]


def train_one(job):
    """One (suite, seed) in a process of its own: (suite, seed, its rows), or the line of the
    SystemExit that stopped it."""
    set_up_torch(job.threads)
    PROGRESS.start(job.stages, job.rates, job.run_plan)
    try:
        with torch._dynamo.config.patch(**DYNAMO):
            return job.suite.name, job.seed, run_suite(job.suite, job.P, job.run, job.seed, job.data)
    except SystemExit as e:
        return job.suite.name, job.seed, str(e.code)


# -----------------------------------------------------------------------------
# The run's folder and key


HERE = Path(__file__).resolve().parent
SOURCES = ("moe.py", "hd.py", "tah.py", "checks.py", "tasks.py", "trainer.py", "report.py", "inside.py",
           "processes.py", "headline.py", "ablations.py", "runner.py", "train_tiny.py")  # all that can change a result


def open_run(opts, text, out):
    """The folder of this exact configuration (preset, flags, data, code, world size), where
    checkpoints and finished rows live, each carrying the configuration's key; returns the
    run's context (trainer.Run), made here once."""
    code = [hashlib.sha256((HERE / f).read_bytes()).hexdigest() for f in SOURCES]
    data_key = hashlib.sha256(text.tokens.tobytes()).hexdigest() if text is not None else None
    key = hashlib.sha256(json.dumps([asdict(opts.P), opts.muon, opts.accum, opts.device, opts.threads, opts.dev,
                                     data_key, code, opts.every_arm, opts.compile, opts.rehearse, opts.seeds.start,
                                     WORLD]).encode()).hexdigest()[:10]
    run_dir = out / f"run-{key}"
    if opts.fresh and MASTER and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(exist_ok=True)
    for tmp in run_dir.rglob("*.tmp"):  # left by a run killed mid-write
        tmp.unlink(missing_ok=True)
    return Run(run_dir, key, opts.device, opts.seeds, opts.eval_split, opts.eval_seed, opts.every_arm, opts.muon,
               opts.accum, opts.compile, opts.rehearse, opts.log_every, opts.ckpt_every)


# -----------------------------------------------------------------------------
# The report


def result_files(lab):
    """What a run writes in <out>: the results, the loss curves, and every suite's plots."""
    return ("results.md", "results.json", "loss_curves.png", *{f: 0 for s in lab.suites for f in s.outputs})


def claims(lab):
    return [c for s in lab.suites for c in s.claims]


def report(rows, opts, run, out, argv, seconds):
    """results.md / results.json (and plots with matplotlib) from the rows alone (report.py)."""
    dev = torch.cuda.get_device_name() if opts.device.startswith("cuda") else \
        f"CPU ({os.cpu_count()} cores; --jobs {opts.jobs}, --threads {opts.threads})"
    launch = f"torchrun --nproc_per_node={WORLD} train_tiny.py" if DDP else "python train_tiny.py"
    command = " ".join([launch] + (sys.argv[1:] if argv is None else argv))
    dev += f", world size {WORLD}" if DDP else ""
    header = (f"Measured by `{command}` on {dev}, {opts.P.seeds} seed(s), evaluated on the "
              f"{'dev' if opts.dev else 'held-out'} set; {seconds:.0f} s for this invocation.")
    write_report(rows, opts.lab.suites, [opts.lab.suite(s) for s in opts.suites], header, run, out,
                 {"preset": asdict(opts.P), "run": run.run_dir.name, "data": opts.data, "device": dev, "world_size": WORLD,
                  "eval_set": opts.eval_split}, brief=opts.tidy)
