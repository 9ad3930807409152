"""
The processes of a run, apart from what they train: torchrun's ranks (read once, at import; the
process group; gradients averaged by hand), the --jobs processes (each (suite, seed) in a
fresh process; Ctrl-C and a parent's death), and the progress line that counts down the run
across them. A learner may skip this file.
"""

import contextlib
import datetime
import multiprocessing
import os
import queue
import signal
import socket
import threading
import time

import torch
import torch.distributed as dist


# -----------------------------------------------------------------------------
# Process setup (torchrun): read once, before anything else


def dist_env(env):
    """(ddp, rank, world) from torchrun's variables, with one clear error when they do not fit."""
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
    """torchrun's process group (nccl on CUDA, gloo on CPU), or one line saying why not: an
    address that does not resolve, a port in use, no rendezvous within `timeout` seconds.
    Returns the device this rank trains on."""
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



def sum_over_ranks(params, total, dev):
    """Sum gradients and the loss over DDP ranks by hand (each rank's are weighted by its share of
    the global batch already, trainer.MicroSteps): with routing (MoE, TaH depths) the set of
    parameters that receive a gradient can differ between ranks, which DDP's hooks do not allow.
    A parameter no rank has a gradient for keeps none, as in one process: the optimizer then skips
    it (a zero gradient would still move it through weight decay)."""
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dev)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    for p, any_rank in zip(params, has.tolist()):
        if not any_rank:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    t = torch.tensor(total, device=dev)
    dist.all_reduce(t)
    return t.item()




# -----------------------------------------------------------------------------
# The progress line


class Progress:
    """The whole invocation's progress: the stages it plans to train, in order, as [arm, steps
    left], and the time left, from each arm's own seconds per step (the planning probe's at
    first, then its real steps'), scaled by how much of the time so far went to anything but
    training steps (evaluation, building models). A --jobs process trains one (suite, seed) of
    the run; `run` = (when it started, the parent's prediction of the run's seconds left then,
    the parent's real-over-predicted scale or None) then adds the whole run's time left: that
    prediction counted down, at least this process's own time left. Before anything has
    finished the parent knows no scale, and this process's pace gives it: its timed steps'
    seconds over the probe's for the same steps (start-up, evaluation and the untimed first
    step of a stage left out, so the estimate settles from the first line). A pace over
    SLOW_PACE of what was expected says so on the line (pace_note)."""

    def __init__(self):
        self.plan, self.rate, self.arm, self.stepping, self.t0, self.run = [], {}, 0, 0.0, time.time(), None
        self.probed, self.stepped_probe = {}, 0.0

    def start(self, plan, rates, run=None):
        self.planned, self.plan, self.rate = list(plan), [[arm, steps] for arm, steps in plan], dict(rates)
        self.total, self.arm, self.stepping, self.t0 = sum(s for _, s in plan), 0, 0.0, time.time()
        self.probed, self.run, self.stepped_probe = dict(rates), run, 0.0

    def advance(self, arm, steps=1, seconds=None):
        """`steps` steps of arm done (one, in `seconds`, when timed; a resumed arm's, untimed)."""
        entry = next((p for p in self.plan if p[0] == arm and p[1] > 0), None)
        if entry is not None:
            entry[1] -= steps
        if seconds is not None:
            self.stepping += seconds
            self.stepped_probe += self.probed.get(arm, seconds)
            r = self.rate.get(arm)
            self.rate[arm] = seconds if r is None else 0.8 * r + 0.2 * seconds

    def line(self):
        el = time.time() - self.t0
        left_steps = sum(max(s, 0) for _, s in self.plan)
        known = list(self.rate.values()) or [0.0]
        train_left = sum(max(s, 0) * self.rate.get(a, sum(known) / len(known)) for a, s in self.plan)
        left = train_left * (el / self.stepping if self.stepping > 5.0 else 1.0)  # the first seconds: start-up, not pace
        return (f"arm {self.arm}/{len(self.plan)} | {getattr(self, 'total', 0) - left_steps}/{getattr(self, 'total', 0)} "
                f"steps | elapsed {el / 60:.1f} min" + (f" | ~{left / 60:.1f} min left" if self.rate and self.run else "")
                + self.run_left(el, left) + self.pace_note())

    def pace(self):
        """This process's timed steps' seconds over the probe's prediction of them (1: as probed)."""
        return self.stepping / self.stepped_probe if self.stepped_probe > 0 else 1.0

    def pace_note(self):
        """Said after 10 s of timed steps (a few short steps are noise). One process: the pace
        against the probe's, which ran alone too. A --jobs process: against the run's own
        real-over-predicted scale so far (its processes slow each other, as the probe could not
        see), and nothing before a (suite, seed) has finished."""
        slow = self.pace()
        if self.run is not None:
            slow = slow / self.run[2] if self.run[2] else 0.0
        return (f" | pace {slow:.1f}x what was expected: another job is using the machine?"
                if slow > SLOW_PACE and self.stepping > 10.0 else "")

    def run_left(self, el, left):
        """' | run ~M min left': in one process its own time left (the process is the run); in a
        --jobs process (after its own) the run's prediction, scaled as said."""
        if self.run is None:
            return f" | run ~{left / 60:.1f} min left" if self.rate else ""
        start, predicted, scale = self.run
        if scale is None:  # nothing has finished yet: this process's pace scales the prediction
            predicted *= self.pace()
        return f" | run ~{max(left, start + predicted - time.time()) / 60:.1f} min left"


SLOW_PACE = 1.3  # a pace this much slower than expected is said on the progress line (pace_note)
PROGRESS = Progress()


# -----------------------------------------------------------------------------
# --jobs: each (suite, seed) in a process of its own


def run_in_processes(todo, seconds, jobs, threads, make_job, work, on_result):
    """The (suite, seed)s of `todo`, longest first (seconds[suite]: the planning probe's
    prediction of one), each in a fresh process, `jobs` at a time: work(make_job(suite, seed,
    plan)) runs in it (a module-level function: spawn imports it) and returns (suite, seed,
    rows), or (suite, seed, the line of the SystemExit that stopped it); on_result(suite, seed,
    rows) as each finishes. `plan` = (now, the run's predicted seconds left, the real-over-
    predicted scale of what finished, or None) for the process's progress line. An error, or a
    process that dies, stops them all at once with one line."""
    waiting = sorted(todo, key=lambda t: -seconds[t[0]])
    log(f"{len(todo)} (suite, seed)s in {jobs} processes at a time, {threads} thread(s) each")
    mp = multiprocessing.get_context("spawn")
    results, running, started, took, t0 = mp.Queue(), {}, {}, [0.0, 0.0], time.time()
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                scale = took[0] / took[1] if took[1] > 0 else None  # real over predicted seconds, of what finished
                plan = (time.time(), run_left(seconds, waiting, running, started, scale or 1.0, jobs), scale)
                suite, seed = waiting.pop(0)
                started[suite, seed] = time.time()
                job = make_job(suite, seed, plan)
                running[suite, seed] = mp.Process(target=report_to, args=(results, work, job), daemon=True)
                with ctrl_c_deferred():  # Ctrl-C stops the parent (never lost), which stops the processes
                    running[suite, seed].start()
            found = next_result(results, running)
            if found is None:
                continue
            suite, seed, rows = found
            on_result(suite, seed, rows)
            took[0], took[1] = took[0] + time.time() - started[suite, seed], took[1] + seconds[suite]
            done = len(todo) - len(waiting) - len(running)
            log(f"{suite} seed {seed} finished ({done} of {len(todo)}) | elapsed {(time.time() - t0) / 60:.1f} min | "
                f"run ~{run_left(seconds, waiting, running, started, took[0] / took[1], jobs) / 60:.1f} min left")
    finally:
        for p in running.values():  # stop the others now, not after their (suite, seed)s
            if p.is_alive():
                p.terminate()


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
    """While a --jobs process starts (seconds: spawn pickles its job), a Ctrl-C is held and acted
    on once the start returns: never lost, never mid-start. SIGINT is also blocked in this
    thread, so the process, which inherits the mask through fork and exec, holds a Ctrl-C of its
    start-up pending until report_to ignores SIGINT (which drops it) and unblocks it. Ctrl-C,
    sent to every process of the run, so prints one line, the parent's, and the parent stops the
    rest."""
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


def report_to(results, work, job):
    """A --jobs process: ignore Ctrl-C (the parent answers it), run one (suite, seed) and put what
    it gives on the parent's queue. It ends itself if the parent goes (killed, or stopped by a
    signal), rather than train on unseen."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        signal.raise_signal(signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()
    results.put(work(job))


