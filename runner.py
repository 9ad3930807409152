"""
The machinery of train_tiny.py, behind two calls:

    with runner.Session(argv, ...) as run:     # the command line, torchrun, the run's folder, Ctrl-C
        run.train(work, suite, seed, data)     # each (suite, seed): here, or in a --jobs process

A Session checks the command line whole before anything trains, opens the run's folder (keyed
by everything that can change a result, so a killed run resumes), skips the (suite, seed)s
already done, saves each one's rows as it finishes and says the run's time left from the pace
so far. Ctrl-C and file-system errors end it with one line.
"""

import argparse
import contextlib
import datetime
import hashlib
import json
import multiprocessing
import os
import queue
import re
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

from tasks import atomic
from trainer import Run

MAX_SEED0 = (2**63 - 1 - 2 * 10**9) // 1_000_003 - 10**6  # room for 10^6 seeds and 10^9 steps


# -----------------------------------------------------------------------------
# torchrun's ranks: read once, at import


def dist_env(env):
    """(ddp, rank, world) from torchrun's variables, or one clear error."""
    if env.get("RANK") is None:
        return False, 0, 1
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise SystemExit(f"error: RANK={env.get('RANK')!r} needs an integer WORLD_SIZE (got "
                         f"{env.get('WORLD_SIZE')!r}); launch with torchrun, or unset RANK")
    if not 0 <= rank < world:
        raise SystemExit(f"error: RANK={rank} is not in [0, WORLD_SIZE={world})")
    missing = [k for k in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise SystemExit(f"error: RANK is set but {', '.join(missing)} not: launch with torchrun, or unset RANK")
    if not env["MASTER_PORT"].isdigit() or not env["LOCAL_RANK"].isdigit():
        raise SystemExit(f"error: MASTER_PORT and LOCAL_RANK must be integers, got {env['MASTER_PORT']!r} and "
                         f"{env['LOCAL_RANK']!r}")
    if not 0 < int(env["MASTER_PORT"]) < 65536:
        raise SystemExit(f"error: MASTER_PORT must be a port in 1..65535, got {env['MASTER_PORT']}")
    return True, rank, world


DDP, RANK, WORLD = dist_env(os.environ)
MASTER = RANK == 0


def start_ddp(device, timeout=60):
    """torchrun's process group (nccl on CUDA, gloo on CPU), or one line saying why not; returns
    the device this rank trains on."""
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


def log(*a):
    if MASTER:
        print(*a, flush=True)


# -----------------------------------------------------------------------------
# The command line


def flag_form(value):
    """A preset value as the flag takes it: a tuple as a comma list (empty: '')."""
    return (",".join(map(str, value)) or "''") if isinstance(value, tuple) else str(value)


def parser(doc, presets, suites, headline):
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = ap.add_argument
    arg("--suite", default="headline", metavar="{headline,all," + ",".join(headline) + ",...}",
        help=f"headline: {' and '.join(headline)}; all: every suite with every ablation arm; or a comma list of "
             + ",".join(suites))
    arg("--preset", choices=sorted(presets), help="the budget: default (when not given) is the measured protocol, "
        "on any device; large is wider and longer, for a GPU, and not yet measured")
    arg("--smoke", action="store_true", help="every suite's code path, tiny and fast (its own preset)")
    arg("--data", help="train the text suites on this UTF-8 text file instead of Shakespeare")
    arg("--accum", type=int, default=1, help="gradient accumulation micro-steps (default: 1)")
    arg("--muon", action="store_true", help="Muon for 2-D weights in the blocks, AdamW for the rest")
    arg("--compile", action=argparse.BooleanOptionalAction, default=False,
        help="torch.compile the training steps (the backbone and HD whole, TaH per pass): off by default on every "
             "device, since a default run's 11 graphs cost more to compile than they save (RESULTS, 'Compile')")
    arg("--out", default="out", help="folder for results, checkpoints and the token cache (default: out)")
    arg("--log_every", type=int, default=50, help="steps between log lines (default: 50)")
    arg("--ckpt_every", type=int, default=50, help="steps between checkpoints (default: 50)")
    arg("--device", default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu)")
    arg("--threads", type=int, default=1, help="CPU threads per process (default: 1); float sums, and so the "
        "last digits, depend on it (the README's runs used 1)")
    arg("--jobs", type=int,
        help="(suite, seed)s trained at once, each in a process of its own; the numbers do not depend on it "
             "(default: the usable cores // --threads, on a CPU and on one GPU, whose launch-bound tiny steps leave "
             "it idle otherwise; under torchrun 1)")
    arg("--seed0", type=int, default=0, help="the first seed: a run trains seeds seed0 .. seed0 + seeds - 1 (default: 0)")
    arg("--fresh", action="store_true",
        help="delete this configuration's checkpoints and finished rows first, and train everything again")
    arg("--dev", action="store_true", help="evaluate on the dev set instead of the held-out set: for trying things out")
    group = ap.add_argument_group("preset overrides (default: the preset's value): the budget, nanoGPT style "
                                  "(--n_layer=4, --plays=macbeth,hamlet)")
    for f in fields(presets["default"]):
        kind, one = type(f.default), type(f.default[0]) if isinstance(f.default, tuple) else None
        values = ", ".join(f"{k} {flag_form(getattr(p, f.name))}" for k, p in presets.items())
        what = f.metadata.get("help")
        group.add_argument(f"--{f.name}", type=(lambda v, one=one: tuple(one(x) for x in v.split(",") if x)) if one
                           else kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
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
    for k in ("accum", "log_every", "ckpt_every", "threads", "jobs"):
        if getattr(a, k) is not None and getattr(a, k) < 1:
            return f"--{k} must be >= 1, got {getattr(a, k)}"
    if DDP and (a.jobs or 1) > 1:
        return "--jobs trains in processes of its own; under torchrun give --jobs 1 (each rank is one process)"
    if not 0 <= a.seed0 <= MAX_SEED0:  # trainer.batch_gen: seed * 1_000_003 + 2 * step + 1 must fit a 64-bit seed
        return (f"--seed0 must be >= 0 and at most {MAX_SEED0:,} (the batch seeds derived from it must fit in 63 "
                f"bits), got {a.seed0}")
    if a.data and not Path(a.data).is_file():
        return f"--data {a.data}: no such file" + (" (it is a folder)" if Path(a.data).is_dir() else "")
    return check_device(a.device)


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


# Every process of a run: a compiled function (CUDA's flex, --compile's models) that meets dynamo's
# recompile limit stops the run, instead of falling back with a warning to eager (for flex: the unfused
# kernel). The limit allows a graph per arm configuration (--suite all: TaH's passes take 28).
DYNAMO = dict(fail_on_recompile_limit_hit=True, recompile_limit=64)

HERE = Path(__file__).resolve().parent
SOURCES = ("moe.py", "hd.py", "tah.py", "checks.py", "tasks.py", "trainer.py", "report.py", "figures.py", "inside.py",
           "headline.py", "ablations.py", "runner.py", "train_tiny.py")  # all that can change a result


def set_up_torch(threads):
    torch.set_float32_matmul_precision("high")
    torch.set_num_threads(threads)


# -----------------------------------------------------------------------------
# The session


class Session:
    """One invocation of train_tiny.py, made from the command line (checked whole, before anything
    is written): P (the preset with its overrides), suites, seeds and the flags as attributes.
    Entered, it opens the run (`run`, the trainer's context) and its finished rows (`rows`).

    presets: name -> Preset; suites: every suite, in the report's order; headline: those a plain
    run trains; text_suites: those that read the text; check(P, device, suites, world, accum):
    a preset's first problem as one line, or None."""

    def __init__(self, argv, doc, presets, suites, headline, text_suites, check):
        ap = parser(doc, presets, suites, headline)
        a = ap.parse_args(argv)
        names = {"headline": list(suites) if a.smoke else list(headline), "all": list(suites)}.get(
            a.suite, a.suite.split(","))  # --smoke: every code path
        if problem := check_flags(a, names, suites, text_suites):
            ap.error(problem)
        self.preset_name = "smoke" if a.smoke else a.preset or "default"
        P = presets[self.preset_name]
        self.P = replace(P, **{f.name: getattr(a, f.name) for f in fields(P) if hasattr(a, f.name)})
        self.jobs = a.jobs or (1 if DDP else max(1, usable_cores() // a.threads))  # one GPU too: processes share it
        if problem := check(self.P, a.device, names, WORLD, a.accum, min(self.jobs, len(names) * self.P.seeds)):
            ap.error(problem)
        self.suites, self.seeds, self.out, self.data, self.device = names, range(a.seed0, a.seed0 + self.P.seeds), \
            Path(a.out), a.data, a.device
        self.every_arm, self.smoke, self.fresh = a.suite == "all" or a.smoke, a.smoke, a.fresh
        self.threads, self.order, self.world, self.master = a.threads, list(suites), WORLD, MASTER
        self.run = Run(Path(), None, a.device, self.seeds, *(("dev", 104729) if a.dev else ("val", 7919)),
                       self.every_arm, a.muon, a.accum, a.compile, a.log_every, a.ckpt_every)
        launch = f"torchrun --nproc_per_node={WORLD} train_tiny.py" if DDP else "python train_tiny.py"
        self.command = " ".join([launch] + (sys.argv[1:] if argv is None else argv))
        self.machine = (torch.cuda.get_device_name() if a.device.startswith("cuda") else
                        f"CPU ({os.cpu_count()} cores; --jobs {self.jobs}, --threads {self.threads})") + \
            (f", world size {WORLD}" if DDP else "")
        self.rows, self.running, self.took, self.stack = [], {}, {}, contextlib.ExitStack()

    def __enter__(self):
        try:
            self.open()
        except BaseException as e:
            self.__exit__(type(e), e, None)
            raise
        return self

    def open(self):
        """The process group, the run's folder (swept of a killed run's temporaries), its rows."""
        if DDP:
            self.device = start_ddp(self.device)
            self.run = replace(self.run, device=self.device)
        self.stack.enter_context(torch._dynamo.config.patch(**DYNAMO))
        self.out.mkdir(parents=True, exist_ok=True)
        for tmp in self.out.glob("*.tmp"):  # results or a token cache of a run killed mid-write
            tmp.unlink(missing_ok=True)
        set_up_torch(self.threads)
        code = [hashlib.sha256((HERE / f).read_bytes()).hexdigest() for f in SOURCES]
        data = hashlib.sha256(Path(self.data).read_bytes()).hexdigest() if self.data else None
        r = self.run
        key = hashlib.sha256(json.dumps([asdict(self.P), r.muon, r.accum, r.device, self.threads, r.eval_split, data,
                                         code, r.every_arm, r.compile, r.seeds.start, WORLD]).encode())
        run_dir = self.out / f"run-{key.hexdigest()[:10]}"
        if self.fresh and MASTER and run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(exist_ok=True)
        for tmp in run_dir.rglob("*.tmp"):  # left by a run killed mid-write
            tmp.unlink(missing_ok=True)
        self.run = replace(r, run_dir=run_dir, run_key=key.hexdigest()[:10])
        self.rows = load_rows(run_dir / "rows.json", self.run.run_key)
        done = {(r["suite"], r["seed"]) for r in self.rows}
        self.todo = [(s, k) for s in self.suites for k in self.seeds if (s, k) not in done]
        self.waiting = list(self.todo)  # not started yet
        self.parallel = self.jobs > 1 and len(self.todo) > 1
        self.t0 = time.time()
        if self.parallel:
            log(f"{len(self.todo)} (suite, seed)s in {self.jobs} processes at a time, {self.threads} thread(s) each"
                + ("; all at once, so the run's time left comes with the first to finish (till then, each step line "
                   "gives its stage's)" if self.jobs >= len(self.todo) else ""))
            self.results = multiprocessing.get_context("spawn").Queue()

    def train(self, work, suite, seed, data):
        """One (suite, seed)'s rows = work(suite, P, run, seed, data), here or in a --jobs process
        (work: a module-level function), saved as it finishes; skipped if done. The call for the
        last (suite, seed) to do returns once every process has finished."""
        if (suite, seed) not in self.todo:
            return log(f"{suite} seed {seed}: already done, skipped")
        self.waiting.remove((suite, seed))
        if not self.parallel:
            self.running[suite, seed] = (time.time(), None)
            return self.finished(suite, seed, work(suite, self.P, self.run, seed, data))
        while len(self.running) >= self.jobs:
            self.collect()
        job = (work, suite, self.P, self.run, seed, data, self.threads, max(1, usable_cores() // self.jobs))
        process = multiprocessing.get_context("spawn").Process(target=in_process, args=(self.results, job), daemon=True)
        self.running[suite, seed] = (time.time(), process)
        with ctrl_c_deferred():  # Ctrl-C stops the parent (never lost), which stops the processes
            process.start()
        while not self.waiting and self.running:  # the last one to do: wait for every process
            self.collect()

    def collect(self):
        """The next (suite, seed) a --jobs process finished (waiting at most a second); a process's
        error, or one that died, stops the run."""
        try:
            suite, seed, rows = self.results.get(timeout=1.0)
        except queue.Empty:  # a process that ended without a result died (killed, out of memory, a bug)
            for (suite, seed), (_, p) in self.running.items():
                if p.exitcode not in (None, 0):
                    raise SystemExit(f"error: the process training {suite} seed {seed} died (exit code "
                                     f"{p.exitcode}: killed, out of memory, or the error printed above); the "
                                     f"finished (suite, seed)s are saved: run the same command to go on")
            return
        self.running[suite, seed][1].join()
        if isinstance(rows, str):  # the process's SystemExit: its one line, as in one process
            raise SystemExit(rows)
        self.finished(suite, seed, rows)

    def finished(self, suite, seed, rows):
        self.took.setdefault(suite, []).append(time.time() - self.running.pop((suite, seed))[0])
        self.todo.remove((suite, seed))
        self.rows = sorted(self.rows + [{**r, "suite": suite} for r in rows],  # the report's sums do not depend
                           key=lambda r: (self.order.index(r["suite"]), r["seed"]))  # on --jobs or a resume
        if MASTER:
            save_rows(self.run.run_dir / "rows.json", self.rows, self.run.run_key)
        done = sum(map(len, self.took.values()))
        left = time_left(self.todo, self.took, {k: t for k, (t, _) in self.running.items()},
                         self.jobs if self.parallel else 1, time.time())
        log(f"{suite} seed {seed} finished ({done} of {done + len(self.todo)}) | elapsed "
            f"{(time.time() - self.t0) / 60:.1f} min | run ~{left / 60:.1f} min left")

    def __exit__(self, kind, e, tb):
        first = e
        try:
            while e is None and self.running:  # the last --jobs processes
                self.collect()
        except BaseException as late:
            e = late
        for _, process in self.running.values():  # an error, or Ctrl-C: stop the others now
            if process is not None and process.is_alive():
                process.terminate()
        self.stack.close()
        if e is None and DDP and dist.is_initialized():
            dist.destroy_process_group()
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C: one line, not a traceback (under torchrun every rank gets it)
            if MASTER:
                print("interrupted: what finished is saved (rows after each (suite, seed), checkpoints every "
                      "--ckpt_every steps); run the same command to go on", file=sys.stderr)
            raise SystemExit(130) from None
        if isinstance(e, OSError):  # the file system's: a path that is a folder, no permission, a full disk
            raise SystemExit(f"error: {e.strerror or e} ({e.filename or 'a file of this run'}); nothing of the step "
                             f"that met it is saved") from None
        if e is not first:
            raise e
        return False


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


# -----------------------------------------------------------------------------
# --jobs: each (suite, seed) in a process of its own


def in_process(results, job):
    """A --jobs process: trains one (suite, seed) and puts (suite, seed, rows or its SystemExit's
    line) on the parent's queue; Ctrl-C is the parent's to answer; it ends if the parent goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        signal.raise_signal(signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()
    work, suite, P, run, seed, data, threads, compile_threads = job
    set_up_torch(threads)
    import torch._inductor.config as inductor
    try:  # inductor's compile workers: the process's share of the cores, not a pool of all of them
        with torch._dynamo.config.patch(**DYNAMO), inductor.patch(compile_threads=compile_threads):
            rows = work(suite, P, run, seed, data)
    except SystemExit as e:
        rows = str(e.code)
    results.put((suite, seed, rows))


@contextlib.contextmanager
def ctrl_c_deferred():
    """A Ctrl-C while a --jobs process starts is held until the start returns, never lost. The
    blocked SIGINT is inherited, so the child drops its copy (in_process) and only the parent
    answers, with one line, stopping the rest."""
    held = []
    before = signal.signal(signal.SIGINT, lambda sig, frame: held.append(sig))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, before)
    if held and callable(before):  # Python's handler raises KeyboardInterrupt; an ignored SIGINT stays ignored
        before(signal.SIGINT, None)


# -----------------------------------------------------------------------------
# The finished rows of a run (resume: a (suite, seed) whose rows are saved is not trained again)


ROW_KEYS = {"suite", "effect", "effect_id", "paper", "arm", "arm_id", "metric", "seed", "value"}


def rows_digest(rows):
    return hashlib.sha256(json.dumps(rows, indent=1).encode()).hexdigest()


def save_rows(path, rows, key):
    """The finished rows, with the run's key and the sha256 load_rows checks."""
    doc = {"run": key, "sha256": rows_digest(rows), "rows": rows}
    atomic(path, lambda f: f.write(json.dumps(doc, indent=1).encode()))


def load_rows(path, key):
    """The finished rows of run `key`, or one line if the file was changed or is another run's."""
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
