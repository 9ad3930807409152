"""
The runner of train_tiny.py: what turns the suites into a run. A learner may skip this file.

The command line (checked whole before anything trains, one line per problem); the run's
folder, key, rows and resume bookkeeping; the planning probe and the plan the progress line
counts down; --jobs processes and Ctrl-C; the report (results.md, results.json, the plots).
Every suite is read off SUITES: ablations.SUITES, the headline suites of train_tiny.py with
their extra arms, then the rest.
"""

import argparse
import contextlib
import hashlib
import json
import math
import multiprocessing.util
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

import ablations
import train_tiny
from hd import HDConfig
from report import RULE, judge, plot, summarize, table
from tasks import Arith, Lookups, atomic, load_text
from train_tiny import PRESETS, Preset, backbone_cfg, tah_config
from trainer import DDP, MASTER, PROGRESS, WORLD, log, loss_curves, start_ddp

SUITES = {s.name: s for s in ablations.SUITES}  # the registry: every suite the runner knows, in report order
HEADLINE = [s.name for s in train_tiny.HEADLINE]
MAX_SEED0 = (2**63 - 1 - 2 * 10**9) // 1_000_003 - 10**6  # room for 10^6 seeds and 10^9 steps


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


def parser():
    ap = argparse.ArgumentParser(description=train_tiny.__doc__, formatter_class=HelpFormatter)
    flag(ap, "suite", default="headline", metavar="{headline,all," + ",".join(HEADLINE) + ",...}",
         help=f"headline: {' and '.join(HEADLINE)}; all: every suite with every ablation arm; or a comma list of "
              + ",".join(SUITES))
    flag(ap, "preset", choices=sorted(PRESETS),
         help="the budget: default (when not given) is the measured protocol, on any device; large is wider and "
              "longer, for a GPU, and not yet measured%(default).0s")
    flag(ap, "smoke", action="store_true", help="every suite's code path, tiny and fast (its own preset)")
    flag(ap, "rehearse", action="store_true",
         help="the large preset's every arm at its full shapes, 2 steps each, here (bf16 autocast on CPU): "
              "parameter counts, activation memory, and any error a GPU run would meet early")
    flag(ap, "data", help="train the text suites on this UTF-8 text file instead of Shakespeare")
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
    names = {"headline": list(SUITES) if args.smoke else HEADLINE, "all": list(SUITES)}.get(
        args.suite, args.suite.split(","))  # --smoke: every code path
    if problem := check_args(args, names):
        ap.error(problem)
    args.preset_name = "smoke" if args.smoke else args.preset or "default"
    P = PRESETS[args.preset_name]
    if args.rehearse:  # the large shapes, every arm, 2 steps each, one seed, one evaluation batch
        args.preset_name, names = "large (rehearsal)", list(SUITES)
        P = replace(PRESETS["large"], iters=2, hd_base_iters=2, hd_cont_iters=2, tah_base_iters=2, tah_sft_iters=2,
                    decider_iters=2, warmup=1, tah_eval_batches=1, seeds=1)
        args.out = args.out if args.out != "out" else "out-rehearsal"
    args.P = replace(P, **{f.name: getattr(args, f.name) for f in fields(Preset) if hasattr(args, f.name)})
    if problem := check_preset(args.P) or check_batches(args.P, names, args.accum):
        ap.error(problem)
    args.suites, args.seeds = names, range(args.seed0, args.seed0 + args.P.seeds)
    args.every_arm = args.suite == "all" or args.smoke or args.rehearse
    args.eval_split, args.eval_seed = ("dev", 104729) if args.dev else ("val", 7919)
    if args.jobs is None:
        args.jobs = 1 if DDP or args.device.startswith("cuda") else max(1, usable_cores() // args.threads)
    return args


def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def text_suites(names):
    return [s for s in names if SUITES[s].task is None]


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
    if args.data and not text_suites(names):
        return f"--data feeds the suites that train on text ({', '.join(text_suites(SUITES))}); this run has none"
    return check_process_flags(args) or check_device(args.device)


def check_process_flags(args):
    for k in ("accum", "log_every", "ckpt_every", "threads", "jobs"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            return f"--{k} must be >= 1, got {getattr(args, k)}"
    if DDP and (args.jobs or 1) > 1:
        return "--jobs trains in processes of its own; under torchrun give --jobs 1 (each rank is one process)"
    if args.seed0 < 0:
        return f"--seed0 must be >= 0, got {args.seed0}"
    if args.seed0 > MAX_SEED0:  # trainer.batch_gen: seed * 1_000_003 + 2 * step + 1 must fit a 64-bit seed
        return f"--seed0 must be at most {MAX_SEED0:,} (the batch seeds derived from it must fit in 63 bits), got {args.seed0}"
    if args.data and not Path(args.data).is_file():
        return f"--data {args.data}: no such file" + (" (it is a folder)" if Path(args.data).is_dir() else "")
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
    return check_models(P)


def check_models(P):
    for name, task in (("symbols/queries", Lookups(P.symbols, P.queries, P.two_hop, per_problem=True)),
                       ("digits", Arith(P.digits))):
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


def check_batches(P, names, accum):
    """Every suite's global batch splits into ranks x micro-steps: checked before the first step."""
    for field in dict.fromkeys(SUITES[s].batch for s in names):
        batch = getattr(P, field)
        if batch % (WORLD * accum):
            return f"--{field} {batch} does not split into {WORLD} rank(s) x {accum} micro-step(s) (--accum)"
    return None


# -----------------------------------------------------------------------------
# Main: run what is not done yet, then report


def main(argv=None):
    args = parse(argv)
    try:  # the file system's errors (a path that is a folder, no permission, a full disk): one line each
        if DDP:
            start_ddp(args)  # trainer.py: the process group, or one line saying why not
        run(args, argv)
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


def run(args, argv):
    """Train every (suite, seed) not done yet, saving the rows after each, then report."""
    P, out = args.P, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for tmp in out.glob("*.tmp"):  # results or a token cache of a run killed mid-write
        tmp.unlink(missing_ok=True)
    for stale in result_files():  # a run that stops early must not leave another run's results beside it
        (out / stale).unlink(missing_ok=True)
    torch.set_float32_matmul_precision("high")
    torch.set_num_threads(args.threads)
    text = load_text(args.data, P.plays, P.block, out) if text_suites(args.suites) else None
    log(f"preset {args.preset_name}: {P}")
    if text is not None:
        log(f"text: {len(text.tokens):,} tokens, vocab {text.vocab_size:,}")
    rows_path = open_run(args, P, text, out)
    rows = load_rows(rows_path, args.run_key)
    done = {(r["suite"], r["seed"]) for r in rows}
    t0 = time.time()
    todo = [(suite, seed) for suite in args.suites for seed in args.seeds if (suite, seed) not in done]
    data = {s: text if SUITES[s].task is None else SUITES[s].task(P) for s in args.suites}
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
            rows = in_order(rows + run_suite(suite, args, seed, data[suite]))
            if MASTER:
                save_rows(rows_path, rows, args.run_key)
    if MASTER:
        report(rows, args, P, out, argv, time.time() - t0)


def run_suite(name, args, seed, data):
    """One (suite, seed): its protocol, then (--suite all) its extra arms; rows tagged with the suite."""
    suite = SUITES[name]
    rows, trained = suite.protocol(args.P, args, seed, data)
    if args.every_arm and suite.extra is not None:
        rows += suite.extra(args.P, args, seed, data, trained)
    return [{**r, "suite": name} for r in rows]


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
                run_suite(suite, args, seed, data[suite])
                stages[suite] = [(arm, steps) for arm, steps, _ in args.probe]
                rates.update({arm: sec for arm, _, sec in args.probe if sec is not None})
    finally:
        args.probe = None
    return stages, rates


def in_order(rows):
    """Rows by suite (SUITES' order), then seed: the report's sums over seeds, and so its last
    digits, depend neither on --jobs nor on a resume."""
    suites = list(SUITES)
    return sorted(rows, key=lambda r: (suites.index(r["suite"]), r["seed"]))


# -----------------------------------------------------------------------------
# --jobs: each (suite, seed) in a process of its own


def train_in_processes(args, todo, data, stages, rates, rows, rows_path, work=None):
    """--jobs > 1: the (suite, seed)s to do, longest first, each in a fresh process of
    args.threads threads, args.jobs at a time (`work`, train_one unless a test says otherwise,
    runs one), its rows saved as it finishes: the same rows as one process's with the same
    --threads (each suite seeds its own generators). An error, or a process that dies, stops
    them all at once with one line; what finished is kept."""
    seconds = {suite: sum(steps * rates.get(arm, 0.0) for arm, steps in stages[suite]) for suite in stages}
    waiting = sorted(todo, key=lambda t: -seconds[t[0]])
    log(f"{len(todo)} (suite, seed)s in {args.jobs} processes at a time, {args.threads} thread(s) each")
    ctx = multiprocessing.get_context("spawn")
    results, running, started, took, t0 = ctx.Queue(), {}, {}, [0.0, 0.0], time.time()
    try:
        while waiting or running:
            while waiting and len(running) < args.jobs:
                scale = took[0] / took[1] if took[1] > 0 else None  # real over predicted seconds, of what finished
                run = (time.time(), run_left(seconds, waiting, running, started, scale or 1.0, args.jobs), scale)
                suite, seed = waiting.pop(0)
                started[suite, seed] = time.time()
                running[suite, seed] = ctx.Process(target=report_to, args=(results, work or train_one, (
                    args, suite, seed, data[suite], stages[suite], rates, run)), daemon=True)
                with ctrl_c_deferred():  # Ctrl-C stops the parent (never lost), which stops the processes
                    running[suite, seed].start()
            found = next_result(results, running)
            if found is None:
                continue
            suite, seed, rows = found[0], found[1], in_order(rows + found[2])
            save_rows(rows_path, rows, args.run_key)
            took[0], took[1] = took[0] + time.time() - started[suite, seed], took[1] + seconds[suite]
            done = len(todo) - len(waiting) - len(running)
            log(f"{suite} seed {seed} finished ({done} of {len(todo)}) | elapsed {(time.time() - t0) / 60:.1f} min | "
                f"run ~{run_left(seconds, waiting, running, started, took[0] / took[1], args.jobs) / 60:.1f} min left")
    finally:
        for p in running.values():  # stop the others now, not after their (suite, seed)s
            if p.is_alive():
                p.terminate()
    return rows


def run_left(seconds, waiting, running, started, scale, jobs):
    """The run's seconds left, as scheduled: the running (suite, seed)s finish, the waiting ones go in
    order to the first process free; every time is the probe's prediction times `scale`."""
    free = sorted([max(0.0, seconds[s] * scale - (time.time() - started[s, k])) for s, k in running] + [0.0] * jobs)
    free = free[-jobs:]
    for s, _ in waiting:
        free = sorted([free[0] + seconds[s] * scale] + free[1:])
    return free[-1]


def next_result(results, running):
    """The next finished (suite, seed, rows), or None after a second without one; a process's
    SystemExit line, or a process that died without a result, stops the run."""
    try:
        suite, seed, found = results.get(timeout=1.0)
    except queue.Empty:  # a process that ended without a result died (killed, out of memory, a bug)
        for (suite, seed), p in running.items():
            if p.exitcode not in (None, 0):
                raise SystemExit(f"error: the process training {suite} seed {seed} died (exit code "
                                 f"{p.exitcode}: killed, out of memory, or the error printed above); the "
                                 f"finished (suite, seed)s are saved: run the same command to go on")
        return None
    running.pop((suite, seed)).join()
    if isinstance(found, str):  # the process's SystemExit: its one line, as in one process
        raise SystemExit(found)
    return suite, seed, found


@contextlib.contextmanager
def ctrl_c_deferred():
    """While a --jobs process starts (seconds: spawn pickles its task), a Ctrl-C is held and acted
    on once the start returns: never lost, never mid-start. The process is launched under
    `sh -c 'trap "" INT; exec python ...'`, so it ignores SIGINT from its interpreter's first
    line (Python installs KeyboardInterrupt only where SIGINT is not ignored): Ctrl-C, sent to
    every process of the run, prints one line, the parent's, and the parent stops the rest."""
    held = []
    before = signal.signal(signal.SIGINT, lambda sig, frame: held.append(sig))
    spawn = multiprocessing.util.spawnv_passfds
    multiprocessing.util.spawnv_passfds = lambda path, args, fds: spawn(
        b"/bin/sh", ["/bin/sh", "-c", 'trap "" INT; exec "$0" "$@"', os.fsdecode(path), *args[1:]], fds)
    try:
        yield
    finally:
        multiprocessing.util.spawnv_passfds = spawn
        signal.signal(signal.SIGINT, before)
    if held and callable(before):  # Python's handler raises KeyboardInterrupt; an ignored SIGINT stays ignored
        before(signal.SIGINT, None)


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
    args, suite, seed, data, stages, rates, run = task
    torch.set_float32_matmul_precision("high")
    torch.set_num_threads(args.threads)
    PROGRESS.start(stages, rates, run)
    try:
        return suite, seed, run_suite(suite, args, seed, data)
    except SystemExit as e:
        return suite, seed, str(e.code)


# -----------------------------------------------------------------------------
# The run's folder, key and rows


HERE = Path(__file__).resolve().parent
SOURCES = ("moe.py", "hd.py", "tah.py", "checks.py", "tasks.py", "trainer.py", "report.py", "inside.py",
           "train_tiny.py", "ablations.py", "runner.py")  # all that can change a result


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


# -----------------------------------------------------------------------------
# The report


def result_files():
    """What a run writes in <out>: the results, the loss curves, and every suite's plots."""
    return ("results.md", "results.json", "loss_curves.png", *{f: 0 for s in SUITES.values() for f in s.outputs})


def claims():
    return [c for s in SUITES.values() for c in s.claims]


def inside_sections(args):
    """The first seed's analyses the suites kept with the run (hd_line, tah_problem), as sections."""
    titles = {f: title for s in SUITES.values() for f, title in s.inside.items()}
    found = [(f, title) for f, title in titles.items() if (args.run_dir / "inside" / f).exists()]
    return "".join(f"\n\n**{title}**, seed {args.seeds[0]}\n\n" + (args.run_dir / "inside" / f).read_text()
                   for f, title in found)


def report(rows, args, P, out, argv, seconds):
    """results.md / results.json (and plots with matplotlib) from the rows alone."""
    summary, verdicts = summarize(rows), judge(rows, claims())
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
    plots = dict.fromkeys(p for s in args.suites for p in SUITES[s].plots)
    png = [plot(loss_curves(args.run_dir), out)] + [p(summary, out, eval_set, args.run_dir) for p in plots]
    log("\n" + md + f"\n\nwritten: {out / 'results.md'}, {out / 'results.json'}" + "".join(f", {p}" for p in png if p))
