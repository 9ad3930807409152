"""
The machinery around train_tiny.py's main, a section a job: torchrun's ranks; the command line
(parse_flags: checked whole before anything is written); the run's folder (keyed by everything that
can change a result, so a killed run resumes where it stopped; open_run: Ctrl-C and file errors as
one line); the job pool (Jobs: each (suite, seed) here or in a --jobs process, and the time left).
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/runner.py is no script: run python train_tiny.py", file=sys.stderr)
    sys.exit(2)

import argparse
import contextlib
import datetime
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

import tasks
from lab import flops, startup
from lab.figures import Kept
from lab.files import Checkpoints, load_rows, save_rows
from trainer import Context, log

MAX_SEED0 = (2**63 - 1 - 2 * 10**9) // 1_000_003 - 10**6  # room for 10^6 seeds and 10^9 steps
MAX_THREADS = 4096  # --threads and --jobs: CPU threads and processes
MAX_EVERY = 10**9  # --log_every, --ckpt_every, --accum
EVAL_SEED = {"val": 7919, "dev": 104729}  # the seed of the synthetic tasks' held-out batches, per split


# -----------------------------------------------------------------------------
# torchrun's ranks: read once, at import


def dist_env(env):
    """(ddp, rank, world) from torchrun's variables, or one clear error."""
    if env.get("RANK") is None:
        return False, 0, 1
    if missing := [k for k in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]:
        raise SystemExit(f"error: RANK is set but {', '.join(missing)} not: launch with torchrun, or unset RANK")
    numbers = {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    if not all(v.isdigit() for v in numbers.values()):
        raise SystemExit(f"error: RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers, got {numbers}")
    rank, world, port = (int(numbers[k]) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    if not 0 <= rank < world:
        raise SystemExit(f"error: RANK={rank} is not in [0, WORLD_SIZE={world})")
    if not 0 < port < 65536:
        raise SystemExit(f"error: MASTER_PORT must be a port in 1..65535, got {port}")
    return True, rank, world


DDP, RANK, WORLD = dist_env(os.environ)
MASTER = RANK == 0


def start_ddp(device, timeout=60):
    """torchrun's process group (nccl on CUDA, gloo on CPU), or one line; the device this rank trains on."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        socket.getaddrinfo(addr, port)
    except OSError as e:
        raise SystemExit(f"error: MASTER_ADDR={addr!r} does not resolve ({e.strerror or e}); launch with torchrun")
    try:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as e:  # c10d's DistNetworkError and friends
        raise SystemExit(f"error: the DDP process group did not start at {addr}:{port} "
                         f"({str(e).splitlines()[0][:200]}); is the port free, and did every rank start?")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return device


# -----------------------------------------------------------------------------
# The command line


@dataclass(kw_only=True)
class Flags:
    """The command line, checked: the preset with its overrides, the suites and seeds, and the
    context every protocol reads (ctx; its run_dir comes when the run opens)."""
    preset: object
    preset_name: str
    suites: list
    order: list  # every suite, in the report's order
    seeds: range
    out: Path
    data: str
    jobs: int
    threads: int
    smoke: bool
    fresh: bool
    ctx: Context
    command: str
    machine: str
    world: int = WORLD
    master: bool = MASTER


def flag_form(value):
    """A preset value as the flag takes it: a tuple as a comma list (empty: '')."""
    return (",".join(map(str, value)) or "''") if isinstance(value, tuple) else str(value)


def comma_list(kind, flag):
    """argparse's type for a tuple flag: a comma list of `kind`, one line naming the flag if not."""
    def parse(text):
        try:
            return tuple(kind(x) for x in text.split(",") if x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{flag} takes a comma list of {kind.__name__}s, got {text!r}")
    return parse


def parser(doc, presets, suites, headline):
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = ap.add_argument
    arg("--suite", default="headline", metavar="{headline,all," + ",".join(headline) + ",...}",
        help=f"headline: {' and '.join(headline)}; all: every suite with every ablation arm; or some of " + ",".join(suites))
    arg("--preset", choices=sorted(presets), help="the budget: default (when not given), the measured protocol, on "
        "any device; large, wider and longer, for a GPU, not yet measured")
    arg("--smoke", action="store_true", help="every suite's code path, tiny and fast (its own preset)")
    arg("--data", help="train the text suites on this UTF-8 text file instead of Shakespeare")
    arg("--accum", type=int, default=1, help="gradient accumulation micro-steps (default: 1)")
    arg("--muon", action="store_true", help="Muon for 2-D weights in the blocks, AdamW for the rest")
    arg("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile the training steps; "
        "off by default, since a default run's graphs cost more to compile than they save (RESULTS, 'Compile')")
    arg("--out", default="out", help="folder for results, checkpoints and the token cache (default: out)")
    arg("--log_every", type=int, default=50, help="steps between log lines (default: 50)")
    arg("--ckpt_every", type=int, default=50, help="steps between checkpoints (default: 50)")
    arg("--device", default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu)")
    arg("--threads", type=int, default=1, help="CPU threads per process (default: 1; float sums' last digits vary with it)")
    arg("--jobs", type=int, help="(suite, seed)s trained at once, a process each; no number depends on it (default: the "
        "usable cores // --threads, on a GPU too; torchrun: 1; 1: all in this process, where breakpoint() works)")
    arg("--seed0", type=int, default=0, help="the first seed: a run trains seeds seed0 .. seed0 + seeds - 1 (default: 0)")
    arg("--fresh", action="store_true", help="delete this configuration's checkpoints and rows first, and train anew")
    arg("--dev", action="store_true", help="evaluate on the dev set instead of the held-out set: for trying things out")
    group = ap.add_argument_group("preset overrides (default: the preset's value): the budget, nanoGPT style "
                                  "(--n_layer=4, --plays=macbeth,hamlet)")
    for f in fields(presets["default"]):
        kind = type(f.default)
        values = ", ".join(f"{k} {flag_form(getattr(p, f.name))}" for k, p in presets.items())
        what = f.metadata.get("help")
        group.add_argument(f"--{f.name}", type=comma_list(type(f.default[0]), f.name) if kind is tuple else kind,
                           default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
                           help=f"{what}; preset {values}" if what else f"preset {values}")
    return ap


def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_flags(a, names, suites, text_suites):
    """The flags apart from the preset's: the first problem, as one line, or None."""
    if bad := [s for s in names if s not in suites]:
        return f"unknown suite(s) {bad}; choose headline, all, or from {sorted(suites)}"
    if len(set(names)) != len(names):
        return f"--suite {a.suite} names a suite twice"
    if a.smoke and a.preset:
        return "--smoke is its own preset; give --smoke or --preset, not both"
    if not a.out.strip() or not is_utf8(a.out) or (a.data and not is_utf8(a.data)):
        return "--out must name a folder, and --out and --data must be UTF-8 paths"
    if a.data and not set(names) & set(text_suites):
        return f"--data feeds the suites that train on text ({', '.join(text_suites)}); this run has none"
    for k, most in (("accum", MAX_EVERY), ("log_every", MAX_EVERY), ("ckpt_every", MAX_EVERY),
                    ("threads", MAX_THREADS), ("jobs", MAX_THREADS)):
        if getattr(a, k) is not None and not 1 <= getattr(a, k) <= most:
            return f"--{k} must be an int in [1, {most:,}], got {getattr(a, k)}"
    if DDP and (a.jobs or 1) > 1:
        return "--jobs trains in processes of its own; under torchrun give --jobs 1 (each rank is one process)"
    if not 0 <= a.seed0 <= MAX_SEED0:  # trainer.batch_gen: seed * 1_000_003 + 2 * step + 1 must fit a 64-bit seed
        return (f"--seed0 must be >= 0 and at most {MAX_SEED0:,} (the batch seeds derived from it must fit in 63 "
                f"bits), got {a.seed0}")
    if a.data and not Path(a.data).is_file():
        return f"--data {a.data}: no such file" + (" (it is a folder)" if Path(a.data).is_dir() else "")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", a.device):
        return f"--device must be cpu, cuda or cuda:N, got {a.device!r}"
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {a.device}: CUDA is not available"
    if ":" in a.device and int(a.device.split(":")[1]) >= torch.cuda.device_count():
        return f"--device {a.device}: only {torch.cuda.device_count()} CUDA device(s)"
    return None


def is_utf8(path):
    return not any(0xDC80 <= ord(c) <= 0xDCFF for c in path)  # a byte that is not UTF-8 arrives as a surrogate escape


def parse_flags(argv, *, doc, presets, suites, headline, text_suites, check):
    """The command line checked whole, before anything is written: Flags, or one line and exit 2.
    suites: every suite in the report's order; headline: a plain run's; text_suites: those on text."""
    ap = parser(doc, presets, suites, headline)
    a = ap.parse_args(argv)
    names = {"headline": list(suites) if a.smoke else list(headline), "all": list(suites)}.get(
        a.suite, a.suite.split(","))  # --smoke: every code path
    if problem := check_flags(a, names, suites, text_suites):
        ap.error(problem)
    preset_name = "smoke" if a.smoke else a.preset or "default"
    preset = replace(presets[preset_name], **{f.name: getattr(a, f.name) for f in fields(presets[preset_name])
                                             if hasattr(a, f.name)})
    jobs = a.jobs or (1 if DDP else max(1, usable_cores() // a.threads))  # on one GPU too: the processes share it
    if problem := check(preset, device=a.device, suites=names, text_suites=text_suites, world=WORLD, accum=a.accum,
                        sharing=min(jobs, len(names) * preset.seeds), ablations=a.suite == "all" or a.smoke):
        ap.error(problem)
    if a.data:  # read, tokenized and long enough for the block before the run's folder is made
        try:
            tasks.load_text(a.data, (), preset.block)
        except (SystemExit, OSError) as e:
            ap.error(f"--data {a.data} cannot be read ({e.strerror})" if isinstance(e, OSError) else
                     str(e.code).removeprefix("error: "))
    seeds, split = range(a.seed0, a.seed0 + preset.seeds), "dev" if a.dev else "val"
    ctx = Context(Path(), device=a.device, seeds=seeds, eval_split=split, eval_seed=EVAL_SEED[split],
                  ablations=a.suite == "all" or a.smoke, muon=a.muon, accum=a.accum, compile=a.compile,
                  log_every=a.log_every, ckpt_every=a.ckpt_every, checkpoints=Checkpoints(), keep=Kept(),
                  flops=flops.per_token)
    launch = f"torchrun --nproc_per_node={WORLD} train_tiny.py" if DDP else "python train_tiny.py"
    machine = (torch.cuda.get_device_name() if a.device.startswith("cuda") else
               f"CPU ({os.cpu_count()} cores; --jobs {jobs}, --threads {a.threads})") + f", world size {WORLD}" * DDP
    return Flags(preset=preset, preset_name=preset_name, suites=names, order=list(suites), seeds=seeds,
                 out=Path(a.out), data=a.data, jobs=jobs, threads=a.threads, smoke=a.smoke, fresh=a.fresh, ctx=ctx,
                 command=" ".join([launch] + (sys.argv[1:] if argv is None else argv)), machine=machine)


# -----------------------------------------------------------------------------
# The run's folder, keyed by everything that can change a result, and its finished rows


# A compiled function (CUDA's flex, --compile's models) that meets dynamo's recompile limit stops the run
# rather than fall back to eager with a warning; the limit allows a graph per arm configuration (TaH: 28).
DYNAMO = dict(fail_on_recompile_limit_hit=True, recompile_limit=64)

HERE = Path(__file__).resolve().parent.parent
SOURCES = ("moe.py", "hd.py", "tah.py", "checks.py", "tasks.py", "trainer.py", "experiment.py", "hd_experiment.py",
           "tah_experiment.py", "train_tiny.py", "lab/ablations.py", "lab/report.py", "lab/figures.py", "lab/files.py",
           "lab/tokens.py", "lab/flops.py", "lab/presets.py", "lab/runner.py", "lab/startup.py", "lab/arith.py",
           "lab/compute.py")  # all that can change a result


def set_up_torch(threads):
    torch.set_float32_matmul_precision("high")
    torch.set_num_threads(threads)


def run_key(flags):
    """The configuration's key: the preset, every flag that changes a number, the code and the data."""
    code = [hashlib.sha256((HERE / f).read_bytes()).hexdigest() for f in SOURCES]
    data = hashlib.sha256(Path(flags.data).read_bytes()).hexdigest() if flags.data else None
    c = flags.ctx
    return hashlib.sha256(json.dumps([asdict(flags.preset), c.muon, c.accum, c.device, flags.threads, c.eval_split,
                                      data, code, c.ablations, c.compile, c.seeds.start, WORLD]).encode()).hexdigest()[:10]


def open_folder(flags):
    """<out>/run-<key> (made, or emptied with --fresh), swept of a killed run's temporaries: the
    trainer's context with it, and the rows it holds already."""
    key = run_key(flags)
    run_dir = flags.out / f"run-{key}"
    if flags.fresh and MASTER and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for tmp in [*flags.out.glob("*.tmp"), *run_dir.rglob("*.tmp")]:  # results, a token cache, a checkpoint, rows
        tmp.unlink(missing_ok=True)  # of a run killed mid-write
    return replace(flags.ctx, run_dir=run_dir, run_key=key), load_rows(run_dir / "rows.json", key)


@contextlib.contextmanager
def open_run(flags):
    """The run: torchrun's process group, dynamo's limits, the folder and its rows, the job pool (Jobs).
    On the way out the --jobs processes are waited for, or on an error stopped (Ctrl-C: one line)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here Ctrl-C saves what finished, then one line
    signal.signal(signal.SIGTERM, stop_term)  # a time limit's SIGTERM: stop, and the report of what finished
    stack = contextlib.ExitStack()
    jobs = None
    try:
        if DDP:
            flags = replace(flags, ctx=replace(flags.ctx, device=start_ddp(flags.ctx.device)))
        stack.enter_context(torch._dynamo.config.patch(**DYNAMO))
        set_up_torch(flags.threads)
        ctx, rows = open_folder(flags)
        jobs = Jobs(flags, ctx, rows)
        yield jobs
        jobs.wait()
    except BaseException as e:
        if jobs is not None:
            jobs.stop()
        if not (isinstance(e, Terminated) and jobs is not None):
            raise one_line(e) from None
        jobs.stopped = f"stopped by SIGTERM with {len(jobs.todo)} (suite, seed)s of {len(flags.suites) * len(flags.seeds)} left"
    finally:
        stack.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the report after the run: a SIGTERM ends the process
    if DDP and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def reporting():
    """The report and figures after the run (its guard has closed): Ctrl-C there is the same one
    line and 130, a file error one line; the rows are saved, so the same command writes it again."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    except (KeyboardInterrupt, OSError) as e:
        raise one_line(e) from None


class Terminated(Exception):
    """SIGTERM (a time limit, `timeout`): the run stops, and its report holds what finished."""


def stop_term(sig, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the report is being written
    raise Terminated()


def one_line(e):
    if isinstance(e, KeyboardInterrupt):  # under torchrun every rank gets it
        if MASTER:
            print("interrupted: what finished is saved (rows after each (suite, seed), checkpoints every "
                  "--ckpt_every steps); run the same command to go on", file=sys.stderr)
        return SystemExit(130)
    if isinstance(e, OSError):  # a path that is a folder, no permission, a full disk
        return SystemExit(f"error: {e.strerror or e} ({e.filename or 'a file of this run'}); nothing of the step "
                          f"that met it is saved")
    return e


# -----------------------------------------------------------------------------
# The job pool: each (suite, seed) here, or in a --jobs process of its own, and the time left


class Jobs:
    """The (suite, seed)s of a run, here (--jobs 1) or each in a process of its own; those the rows
    have are skipped; each one's rows saved as it finishes, in the report's order (so the report's
    sums depend neither on --jobs nor on a resume)."""

    def __init__(self, flags, ctx, rows):
        self.flags, self.ctx, self.rows = flags, ctx, rows
        done = {(r["suite"], r["seed"]) for r in rows}
        self.todo = [(s, k) for s in flags.suites for k in flags.seeds if (s, k) not in done]
        self.parallel = flags.jobs > 1 and len(self.todo) > 1
        # inductor's compile workers: a process's share of the cores among the processes that run at once
        self.workers = max(1, usable_cores() // max(1, min(flags.jobs, len(self.todo))))
        self.running, self.took, self.t0, self.stopped = {}, {}, time.time(), None
        if self.parallel:
            log(f"{len(self.todo)} (suite, seed)s in {flags.jobs} processes at a time, {flags.threads} thread(s) each"
                + ("; all at once, so the run's time left comes with the first to finish (till then, each step line "
                   "gives its stage's)" if flags.jobs >= len(self.todo) else ""))

    def submit(self, work, suite, preset, ctx, seed, data):
        """Runs work(suite, preset, ctx, seed, data) -> one (suite, seed)'s rows (a module-level
        function: a spawned process imports it), here or in a --jobs process; skipped if done."""
        if (suite, seed) not in self.todo:
            return log(f"{suite} seed {seed}: already done, skipped")
        if not self.parallel:
            self.running[suite, seed] = (time.time(), None)
            return self.finished(suite, seed, work(suite, preset, ctx, seed, data))
        while len(self.running) >= self.flags.jobs:
            self.collect()
        # The job goes by a file, not down the start's pipe: a job larger than a pipe holds would keep the start
        # waiting on a process that may never read it (one killed at its start: the run would hang for good).
        job, rows = self.files(suite, seed)
        job.write_bytes(pickle.dumps((work, suite, preset, ctx, seed, data, self.flags.threads, self.workers)))
        process = multiprocessing.get_context("spawn").Process(target=in_process, args=(str(job), str(rows)),
                                                               daemon=True)
        self.running[suite, seed] = (time.time(), process)
        with signals_deferred():  # a bounded start (a fork and a few hundred bytes): Ctrl-C or SIGTERM then stops
            process.start()       # the parent (never lost), which stops the processes

    def wait(self):
        """Every row, once the last --jobs process has finished."""
        while self.running:
            self.collect()
        return self.rows

    def collect(self):
        """The next (suite, seed) a --jobs process finished, as it ends (within a second); an error,
        or a process that ended without its rows (killed, out of memory, a bug), stops all."""
        ended = multiprocessing.connection.wait([p.sentinel for _, p in self.running.values()], timeout=1.0)
        for (suite, seed), (_, p) in list(self.running.items()):
            if p.sentinel not in ended:
                continue
            p.join()
            job, out = self.files(suite, seed)
            job.unlink(missing_ok=True)
            if p.exitcode != 0 or not out.exists():
                raise SystemExit(f"error: the process training {suite} seed {seed} {death(p.exitcode)}; the "
                                 f"finished (suite, seed)s are saved: run the same command to go on")
            rows = pickle.loads(out.read_bytes())
            out.unlink()
            if isinstance(rows, str):  # the process's SystemExit: its one line, as in one process
                raise SystemExit(rows)
            self.finished(suite, seed, rows)

    def finished(self, suite, seed, rows):
        self.took.setdefault(suite, []).append(time.time() - self.running.pop((suite, seed))[0])
        self.todo.remove((suite, seed))
        order = self.flags.order
        self.rows = sorted(self.rows + [{**r, "suite": suite} for r in rows],
                           key=lambda r: (order.index(r["suite"]), r["seed"]))
        if MASTER:
            save_rows(self.ctx.run_dir / "rows.json", self.rows, self.ctx.run_key)
        done = sum(map(len, self.took.values()))
        left = time_left(self.todo, self.took, {k: t for k, (t, _) in self.running.items()},
                         self.flags.jobs if self.parallel else 1, time.time())
        log(f"{suite} seed {seed} finished ({done} of {done + len(self.todo)}) | elapsed "
            f"{(time.time() - self.t0) / 60:.1f} min | run ~{left / 60:.1f} min left")

    def stop(self):
        """An error, or Ctrl-C: the processes still training stop now, their job files with them."""
        for _, process in self.running.values():
            if process is not None and process.is_alive():
                process.terminate()
        for (suite, seed), (_, process) in self.running.items():
            process is None or process.join(timeout=10)
            for f in self.files(suite, seed):
                f.unlink(missing_ok=True)

    def files(self, suite, seed):
        """A --jobs process's job file (written before it starts) and rows file (written whole as it ends)."""
        return [self.ctx.run_dir / f"{name}-{suite}-{seed}.tmp" for name in ("job", "rows")]


def death(code):
    """How a --jobs process that left no rows ended: by a signal, named, or with an exit code."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        return f"died, killed by {name}" + (" (kill -9, out of memory or a CPU limit)" if code == -9 else "")
    return f"ended with exit code {code} without its rows (the error printed above)"


def time_left(todo, took, running, jobs, now):
    """The run's seconds left from the pace so far: a (suite, seed) takes its suite's mean time
    (or every finished one's), the waiting ones going in order to the first of `jobs` free."""
    every = [t for ts in took.values() for t in ts]
    guess = {s: sum(ts) / len(ts) for s, ts in took.items()}
    mean = sum(every) / len(every)
    free = sorted([max(0.0, guess.get(s, mean) - (now - t)) for (s, _), t in running.items()] + [0.0] * jobs)[-jobs:]
    for s, k in todo:
        if (s, k) not in running:
            free = sorted([free[0] + guess.get(s, mean)] + free[1:])
    return free[-1]


def in_process(job, out):
    """A --jobs process: trains the (suite, seed) of the job file and writes its rows (or its
    SystemExit's line) to `out`, whole or not at all, for the parent, which sees the process end;
    Ctrl-C is the parent's to answer; it ends if the parent goes (lab/startup.py: watched since the
    process's first import)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    startup.end_with_parent()
    work, suite, preset, ctx, seed, data, threads, compile_threads = pickle.loads(Path(job).read_bytes())
    set_up_torch(threads)
    import torch._inductor.config as inductor
    try:  # inductor's compile workers: the process's share of the cores, not a pool of all of them
        with torch._dynamo.config.patch(**DYNAMO), inductor.patch(compile_threads=compile_threads):
            rows = work(suite, preset, ctx, seed, data)
    except SystemExit as e:
        rows = str(e.code)
    part = Path(out + ".part.tmp")
    part.write_bytes(pickle.dumps(rows))
    os.replace(part, out)


@contextlib.contextmanager
def signals_deferred():
    """A Ctrl-C or a SIGTERM while a --jobs process starts is held until the start returns, never
    lost, and never cuts the start short (a child half-sent its task dies with a traceback). SIGINT
    is also blocked, and so inherited blocked: the child drops its copy of a terminal's Ctrl-C
    (in_process) and only the parent answers, with one line, stopping the rest. SIGTERM stays
    unblocked, so that stopping the child (Process.terminate) works from its first instruction."""
    held, both = [], (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, lambda sig, frame: held.append(sig)) for sig in both}
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        for sig in both:
            signal.signal(sig, before[sig])
    for sig in dict.fromkeys(held):  # answered now as they would have been: raised, ignored, or the default
        signal.raise_signal(sig)
