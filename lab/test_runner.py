"""The machinery around the experiment (lab/runner.py, lab/files.py, lab/startup.py, the flags'
checks): the command line checked whole before anything is written, torchrun's ranks, --jobs
processes that give one process's rows and end with their parent, Ctrl-C and file errors as one
line, checkpoints and rows that resume exactly and refuse what is not theirs, the time left."""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/test_runner.py is no script: run python -m pytest lab/test_runner.py", file=sys.stderr)
    sys.exit(2)

import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from torch._dynamo.testing import CompileCounter

import experiment
import tasks
import tah
import train_tiny as tt
import trainer
from conftest import HERE, SMOKE, examples, flags, patch_train, tiny_backbone
from lab import files, runner
from lab.arith import Arith
from tah import ThinkAtHard


# -----------------------------------------------------------------------------
# data


@pytest.mark.parametrize("world", range(1, 9))
def test_the_smoke_preset_has_a_row_for_every_rank_of_up_to_8(world, monkeypatch, capsys):
    """torchrun --nproc_per_node=8 train_tiny.py --smoke is taken: every suite's batch has a row per rank."""
    monkeypatch.setattr(runner, "WORLD", world)
    assert flags(["--smoke"]).preset == tt.PRESETS["smoke"]  # parsed and checked
    monkeypatch.setattr(runner, "WORLD", 9)
    with pytest.raises(SystemExit):
        flags(["--smoke"])
    assert "--batch 8 has fewer rows than 9 rank(s) x 1 micro-step(s)" in capsys.readouterr().err


def test_ddp_over_three_ranks_has_its_own_run_and_equals_one_process(tmp_path):
    """The same flags under torchrun (gloo, 3 ranks: batches of 8 cut 2, 3, 3 rows) into the same
    --out: a run of its own (the world size is in the key; nothing of the one-process run is
    reused) that trains the same numbers up to float summation order (parameters no rank has a
    gradient for stay untouched, as in one process). Rounding differs (a rank's matmuls see 2 or 3
    rows, not 8) and TaH stage 2's class weight is counted over each rank's decisions, not the
    global batch's: ~1e-4 apart."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    common = ["train_tiny.py", "--preset", "smoke", "--suite", "moe,tah", "--device", "cpu", "--out", str(tmp_path)]
    one = subprocess.run([sys.executable, *common], cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", *common],
                         cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert "already done" not in two.stdout
    runs = sorted(tmp_path.glob("run-*"), key=lambda p: p.stat().st_mtime)
    assert len(runs) == 2
    ck1, ck2 = (sorted(r.glob("ckpt/*.pt")) for r in runs)
    assert [p.name for p in ck1] == [p.name for p in ck2] and ck1
    for a, b in zip(ck1, ck2):
        np.testing.assert_allclose(files.load_checkpoint(a)["losses"], files.load_checkpoint(b)["losses"], rtol=1e-3, atol=1e-5)
    rows1, rows2 = (json.loads((r / "rows.json").read_text())["rows"] for r in runs)
    assert [(r["arm"], r["metric"]) for r in rows1] == [(r["arm"], r["metric"]) for r in rows2]
    # losses only: a count or a share can move by one token where a score sits at a threshold
    losses = [(a["value"], b["value"]) for a, b in zip(rows1, rows2) if a["metric"] == "loss"]
    assert losses
    np.testing.assert_allclose(*zip(*losses), rtol=1e-3, atol=1e-4)


def test_jobs_train_the_same_rows_as_one_process_in_any_order(tmp_path, capsys):
    """--jobs 2 spreads the (suite, seed)s over two processes (which finish in another order
    than one process's): every row, and the report under its header, equals a one-process run's,
    and both runs share one key (the numbers do not depend on --jobs). A resumed run that
    finishes the seeds in another order writes the same report too. In either, each (suite,
    seed)'s "finished" line says the run's time left; a step line, its stage's."""
    argv = ["--preset", "smoke", "--suite", "hd,tah", "--seeds", "2", "--log_every", "1"]  # the headline arms
    for jobs in ("1", "2"):
        tt.main(argv + ["--jobs", jobs, "--out", str(tmp_path / {"1": "one", "2": "two"}[jobs])])
        lines = capsys.readouterr().out.splitlines()
        finished = [l for l in lines if " finished (" in l]
        assert len(finished) == 4 and "(4 of 4)" in finished[-1]
        assert all(re.search(r"\| run ~\d+\.\d min left$", l) for l in finished), finished
        steps = [l for l in lines if "] step " in l]  # one process: its step lines are this process's
        assert all(re.search(r"\| stage ~\d+\.\d min left$", l) for l in steps) and (steps or jobs == "2"), steps
    (one,), (two,) = (list((tmp_path / d).glob("run-*")) for d in ("one", "two"))
    assert one.name == two.name
    rows = [json.loads((r / "rows.json").read_text())["rows"] for r in (one, two)]
    assert rows[0] == rows[1] and {(r["suite"], r["seed"]) for r in rows[0]} == {(s, k) for s in ("hd", "tah")
                                                                                   for k in (0, 1)}
    md = [(tmp_path / d / "results.md").read_text().split("\n", 1)[1] for d in ("one", "two")]
    assert md[0] == md[1]
    doc = json.loads((one / "rows.json").read_text())  # keep only hd seed 1: the rest finishes after it
    files.save_rows(one / "rows.json", [r for r in doc["rows"] if (r["suite"], r["seed"]) == ("hd", 1)], doc["run"])
    tt.main(argv + ["--jobs", "1", "--out", str(tmp_path / "one")])
    assert json.loads((one / "rows.json").read_text())["rows"] == rows[1]
    assert (tmp_path / "one" / "results.md").read_text().split("\n", 1)[1] == md[1]


def stops(suite, P, run, seed, data):  # a (suite, seed) stopped by an error, as a NaN loss stops one
    raise SystemExit(f"error: [moe/arm s{seed}] loss is nan at step 2")


def test_a_worker_stopped_by_an_error_hands_its_one_line_to_the_parent(tmp_path):
    """A SystemExit in a --jobs process (a NaN loss, a damaged checkpoint) comes back as its
    line, which the parent raises (next test); any other error ends the process, which the
    parent reports as died. The job comes in a file and the rows go out in one, written whole."""
    import pickle
    threads, handler = torch.get_num_threads(), signal.getsignal(signal.SIGINT)
    got = []
    try:
        for work, seed, workers in ((stops, 3, 1), (compile_workers, 4, 3)):
            job, out = tmp_path / f"job{seed}", tmp_path / f"rows{seed}"
            job.write_bytes(pickle.dumps((work, "moe", tt.PRESETS["smoke"], trainer.Context(Path(".")), seed, None,
                                          1, workers)))
            runner.in_process(str(job), str(out))
            got.append(pickle.loads(out.read_bytes()))
    finally:
        torch.set_num_threads(threads)  # in_process sets the process up as a worker's
        signal.signal(signal.SIGINT, handler)
    assert got[0] == "error: [moe/arm s3] loss is nan at step 2"
    assert got[1] == 3  # inductor's compile workers: the process's share of the cores
    assert sorted(f.name for f in tmp_path.iterdir()) == ["job3", "job4", "rows3", "rows4"]  # no part left


@pytest.mark.parametrize("cores, jobs, todo, workers", [(16, 16, 10, 1), (16, 4, 10, 4), (16, 16, 2, 8), (2, 2, 1, 2)])
def test_compile_workers_are_the_cores_shared_by_the_processes_that_start(cores, jobs, todo, workers, monkeypatch):
    """16 cores, --jobs 16 and 10 (suite, seed)s: 10 processes start, 1 worker each; 2 of them: 8 each."""
    monkeypatch.setattr(runner, "usable_cores", lambda: cores)
    f = flags(["--smoke", "--jobs", str(jobs), "--seeds", str(todo), "--suite", "moe"])
    assert runner.Jobs(f, f.ctx, []).workers == workers


def compile_workers(suite, P, run, seed, data):
    import torch._inductor.config as inductor
    return inductor.compile_threads


def dies_or_stops(suite, P, run, seed, data):  # a --jobs process's work (module level: a spawned process imports it)
    if seed == 1:
        if run.run_dir.parent.name.endswith("dies"):
            os._exit(3)  # as the OOM killer would end it: no exception, no result
        raise SystemExit("error: [moe/arm s1] loss is nan at step 2")
    time.sleep(120)  # seed 0 would run on: the error must stop it
    return []


def train_all(argv, work, data=None):
    """A run over argv training every (suite, seed) with `work`, as train_tiny.main does."""
    parsed = flags(argv)
    with runner.open_run(parsed) as jobs:
        for suite in parsed.suites:
            for seed in parsed.seeds:
                jobs.submit(work, suite, parsed.preset, jobs.ctx, seed, data)
    return jobs


@pytest.mark.parametrize("how, words", [("dies", "seed 1 ended with exit code 3 without its rows"), ("stops", "loss is nan")])
def test_an_error_in_one_jobs_process_stops_them_all_with_one_line(how, words, tmp_path):
    t0 = time.time()
    with pytest.raises(SystemExit, match=re.escape(words)):
        train_all(["--smoke", "--suite", "moe", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path / how)],
                  dies_or_stops)
    assert time.time() - t0 < 60  # not after seed 0's two minutes


def sleeps(suite, P, run, seed, data):  # a (suite, seed) that trains for long (module level, for a spawned process)
    (run.run_dir.parent / f"pid{seed}").write_text(str(os.getpid()))
    time.sleep(120)
    return []


def running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def pids_written(files):
    """The pids a test's processes wrote into files, once every file holds one (120 s at most)."""
    for _ in range(1200):
        if all(f.exists() and f.read_text() for f in files):
            break
        time.sleep(0.1)
    return [int(f.read_text()) for f in files]


def all_ended(pids):
    """Whether every process has ended within 10 s."""
    for _ in range(100):
        if not any(running(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def sessions_script(argv, data="None"):
    return (f"import sys; sys.path.insert(0, {str(HERE)!r}); from lab import test_runner as t\n"
            f"t.train_all({argv!r}, t.sleeps, {data})\n")


def quick(suite, P, run, seed, data):  # a (suite, seed) that finishes at once with one row
    return [dict(effect="e", effect_id="e", paper="p", arm="a", arm_id="a", metric="m", seed=seed, value=len(data))]


def loaded(pid, library):
    """Whether process `pid` has mapped a shared library whose path holds `library` (an import's mark)."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def workers_of(parent):
    """The pids of `parent`'s --jobs processes (multiprocessing's spawned children, not its resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(") ", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("moment", ["start", "imports"])
def test_a_jobs_process_killed_as_it_starts_ends_the_run_in_one_line_and_it_resumes(moment, tmp_path):
    """kill -9 of a --jobs process the moment it appears (before it has read its job, which is
    larger than a pipe holds), or while it imports torch (as the OOM killer would): the run ends
    by itself within seconds in one line naming the process and its signal, the other process
    stopped, nothing half-written; the same command then finishes. (Before: the parent sat in the
    start's pipe write for good, deaf to Ctrl-C and SIGTERM.)"""
    argv = ["--smoke", "--suite", "moe", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path)]
    script = sessions_script(argv, "'x' * 300_000").replace("t.sleeps", "t.quick")
    run = subprocess.Popen([sys.executable, "-c", script], cwd=HERE, start_new_session=True, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    killed = None
    for _ in range(60_000):  # the first worker, at the moment named (a reported state, not a delay)
        found = workers_of(run.pid)
        if found and (moment == "start" or loaded(found[0], "libtorch")):
            os.kill(found[0], signal.SIGKILL)
            killed = found[0]
            break
        if run.poll() is not None:
            break
        time.sleep(0.002)
    t0 = time.time()
    out, err = run.communicate(timeout=60)
    assert killed is not None, err
    assert time.time() - t0 < 15, err  # noticed within seconds, not after the other's job
    assert run.returncode == 1 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert re.search(r"the process training moe seed \d died, killed by SIGKILL", last) and "go on" in last, err
    assert not list(tmp_path.rglob("*.tmp"))
    for rows_file in tmp_path.glob("run-*/rows.json"):  # whole: the seed that finished, if one did
        assert len(json.loads(rows_file.read_text())["rows"]) <= 1
    for _ in range(100):
        if not session_processes(run.pid):
            break
        time.sleep(0.1)
    assert session_processes(run.pid) == []
    again = subprocess.run([sys.executable, "-c", script], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    rows = json.loads(next(tmp_path.glob("run-*/rows.json")).read_text())["rows"]
    assert [(r["seed"], r["value"]) for r in rows] == [(0, 300_000), (1, 300_000)]


def test_a_run_with_every_suite_seed_at_once_says_when_its_time_left_comes(tmp_path, capsys):
    """Nothing finishes before the end when every (suite, seed) runs at once: the first line says
    so, and only then."""
    for jobs, seeds, at_once in (("2", "2", True), ("2", "3", False)):
        with runner.open_run(flags(["--smoke", "--suite", "moe", "--seeds", seeds, "--jobs", jobs, "--out",
                                    str(tmp_path / seeds)])):
            pass
        said = capsys.readouterr().out
        assert f"{seeds} (suite, seed)s in 2 processes at a time" in said
        assert ("all at once, so the run's time left comes with the first to finish" in said) == at_once, said


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_jobs_processes_end_when_their_parent_is_killed(tmp_path):
    """kill -9 of the parent leaves no process training on unseen (each watches its parent)."""
    argv = ["--smoke", "--suite", "moe", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path)]
    parent = subprocess.Popen([sys.executable, "-c", sessions_script(argv)], cwd=HERE)
    pids = pids_written([tmp_path / "pid0", tmp_path / "pid1"])
    assert all(running(p) for p in pids)
    parent.kill()
    parent.wait()
    assert all_ended(pids)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("jobs", [1, 2])
def test_ctrl_c_stops_the_run_with_one_line_and_leaves_no_process(jobs, tmp_path):
    """Ctrl-C (SIGINT to the run's whole process group, as a terminal sends it): exit code 130,
    one line, no traceback from the parent or a --jobs process, and no process left. The run starts
    with Python's own SIGINT handler, as from a terminal (a shell's background job, such as a test
    run started with &, would pass SIGINT ignored on to it)."""
    argv = ["--smoke", "--suite", "moe", "--seeds", str(jobs), "--jobs", str(jobs), "--out", str(tmp_path)]
    script = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" + sessions_script(argv)
    run = subprocess.Popen([sys.executable, "-c", script], cwd=HERE, start_new_session=True, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pids = pids_written([tmp_path / f"pid{s}" for s in range(jobs)])
    time.sleep(0.5)
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.count("interrupted: what finished is saved") == 1, err
    assert all_ended(pids)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("library", ["_multiarray_umath", "libtorch_cpu"])  # numpy's, then torch's (~1.5 s to go)
def test_ctrl_c_during_start_up_prints_one_line_and_exits_130(library, tmp_path):
    """While torch and the project import (the first seconds): exit 130 and one line, no traceback,
    nothing written. The signal goes when the process has loaded numpy's or torch's extension (a
    moment it shows, as on a loaded machine it comes later), not after a fixed delay."""
    run = subprocess.Popen([sys.executable, "train_tiny.py", "--smoke", "--out", str(tmp_path / "out")], cwd=HERE,
                           start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for _ in range(120_000):
        if loaded(run.pid, library) or run.poll() is not None:
            break
        time.sleep(0.001)
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted during start-up: nothing was run or written"], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_sigterm_stops_the_run_and_writes_the_report_of_what_finished_marked_partial(jobs, tmp_path):
    """A time limit's SIGTERM (timeout, a GPU check's step) once a (suite, seed) has finished: the
    processes stop, and results.md/.json hold the finished rows, marked partial, before the exit."""
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "train_tiny.py", "--smoke", "--suite", "moe,tah", "--seeds", "3", "--jobs",
                            jobs, "--out", str(out)], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = []
    for line in run.stdout:  # the first (suite, seed) to finish
        said.append(line)
        if "finished (1 of 6)" in line:
            break
    run.send_signal(signal.SIGTERM)
    said.append(run.communicate(timeout=60)[0])
    text = "".join(said)
    assert run.returncode == 1 and "results.md holds what finished, marked partial" in text, text[-2000:]
    md, doc = (out / "results.md").read_text(), json.loads((out / "results.json").read_text())
    assert "**Partial: stopped by SIGTERM with" in md and doc["partial"].startswith("stopped by SIGTERM"), md[:500]
    rows = json.loads(next(out.glob("run-*/rows.json")).read_text())["rows"]
    assert 1 <= len({(r["suite"], r["seed"]) for r in rows}) < 6 and "Traceback" not in text
    assert sum(s["n"] for s in doc["summary"]) >= 1


FIGURES_INTERRUPT = """
import signal, sys
sys.path.insert(0, {here!r})
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal
import train_tiny
from lab import figures
plot = figures.plot
def interrupted(*args, **kw):  # Ctrl-C the moment the first figure is drawn
    signal.raise_signal(signal.SIGINT)
    return plot(*args, **kw)
figures.plot = interrupted
train_tiny.main({argv!r})
print("ran on past the figures")
"""


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_while_the_figures_are_drawn_is_one_line_and_130_and_the_run_resumes(jobs, tmp_path):
    """Ctrl-C after the run, while its report's figures are drawn: the one line and 130 (before:
    a traceback, exit 1); the same command then writes the same report."""
    argv = ["--smoke", "--suite", "moe", "--seeds", "2", "--jobs", jobs, "--out", str(tmp_path)]
    run = subprocess.run([sys.executable, "-c", FIGURES_INTERRUPT.format(here=str(HERE), argv=argv)], cwd=HERE,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 130, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == ["interrupted: what finished is saved (rows after each (suite, seed), "
                                               "checkpoints every --ckpt_every steps); run the same command to go on"]
    assert "ran on past" not in run.stdout
    before = (tmp_path / "results.md").read_text().split("\n", 1)[1]
    again = subprocess.run([sys.executable, "train_tiny.py", *argv], cwd=HERE, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and "already done, skipped" in again.stdout, again.stderr[-2000:]
    assert (tmp_path / "results.md").read_text().split("\n", 1)[1] == before


@pytest.mark.parametrize("value, said", [("", []), ("abc", ["note: OMP_NUM_THREADS='abc' is not a thread count; "
                                                                 "read as unset"]), ("2", [])])
def test_an_empty_or_invalid_omp_num_threads_reads_as_unset(value, said, tmp_path):
    """OMP_NUM_THREADS empty or not a thread count: no libgomp warning in the run's stderr nor its
    --jobs processes' (at most the one note); the tests' own processes read it as unset too."""
    env = {**os.environ, "OMP_NUM_THREADS": value}
    run = subprocess.run([sys.executable, "train_tiny.py", "--smoke", "--suite", "moe", "--seeds", "2", "--jobs", "2",
                          "--out", str(tmp_path)], cwd=HERE, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and run.stderr.splitlines() == said, run.stderr
    kept = os.environ.get("OMP_NUM_THREADS")  # conftest's start-up dropped a bad value before torch loaded
    assert kept is None or all(x.strip().isdigit() and int(x) > 0 for x in kept.split(","))


SEMAPHORES = """
import os, signal, sys
sys.path.insert(0, {here!r})
import train_tiny
from lab import figures
def plot(*args, **kw):  # a time limit's SIGTERM as the report's figures are drawn: the process ends at once
    os.kill(os.getpid(), signal.SIGTERM)
figures.plot = plot
train_tiny.main({argv!r})
"""


def test_a_sigterm_during_a_jobs_runs_report_leaves_no_leaked_semaphore(tmp_path):
    """--jobs processes hand their jobs and rows over by files and are watched by their sentinels:
    no multiprocessing queue whose semaphores the resource tracker would find leaked (and warn
    about in two lines) when a SIGTERM ends the process as it writes its report."""
    argv = ["--smoke", "--suite", "moe", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path)]
    run = subprocess.run([sys.executable, "-c", SEMAPHORES.format(here=str(HERE), argv=argv)], cwd=HERE,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGTERM and run.stderr == "", run.stderr


STARTUP_INTERRUPT = """
import runpy, signal, sys
module = sys.argv.pop(1)
class Interrupt:  # a meta-path finder: Ctrl-C the moment the named module is looked for
    def find_spec(self, name, path=None, target=None):
        if name == module:
            signal.raise_signal(signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv[0] = "train_tiny.py"
runpy.run_path("train_tiny.py", run_name="__main__")
print("ran on past", module)
"""


@pytest.mark.parametrize("module", ["numpy._core._exceptions", "numpy.exceptions", "numpy._core._multiarray_umath",
                                    "torch._C", "torch.nn.functional", "hd"])
def test_ctrl_c_inside_an_import_during_start_up_ends_the_process(module, tmp_path):
    """SIGINT while torch, numpy or the project is being imported, at named moments (torch imports
    numpy from C and drops the error an exception would be there; numpy cannot import its
    extension twice): exit 130, the one line, nothing run or written."""
    run = subprocess.run([sys.executable, "-c", STARTUP_INTERRUPT, module, "--smoke", "--out", str(tmp_path / "out")],
                         cwd=HERE, capture_output=True, text=True, timeout=120)
    assert run.returncode == 130, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == ["interrupted during start-up: nothing was run or written"], run.stderr
    assert "ran on past" not in run.stdout and not (tmp_path / "out").exists()


FIRST_IMPORT_AFTER_GUARD = """
import runpy, signal, sys
script = sys.argv.pop(1)
class Interrupt:  # Ctrl-C at the first import looked for once the start-up handler is in place
    def find_spec(self, name, path=None, target=None):
        if getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "interrupted_during_start_up":
            sys.meta_path.remove(self)
            signal.raise_signal(signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
print("ran on past", script)
"""


def test_ctrl_c_is_caught_from_the_first_lines_of_every_entry_script(tmp_path):
    """train_tiny.py, sample.py and bench.py install the start-up handler first: importing lab.startup
    loads nothing but itself, lab and signal (os and sys come with the interpreter), so the window
    without it is the interpreter's own start-up; and a Ctrl-C at the very next import ends the
    process with the one line and 130."""
    run = subprocess.run([sys.executable, "-c", "import sys; before = set(sys.modules); from lab import startup; "
                          "print(sorted(set(sys.modules) - before))"], cwd=HERE, capture_output=True, text=True)
    assert eval(run.stdout) == ["lab", "lab.startup", "signal"], run.stdout + run.stderr
    for script in ("train_tiny.py", "sample.py", "bench.py"):
        run = subprocess.run([sys.executable, "-c", FIRST_IMPORT_AFTER_GUARD, script, "--out", str(tmp_path / "out")],
                             cwd=HERE, capture_output=True, text=True, timeout=120)
        assert run.returncode == 130, (script, run.stderr[-2000:])
        assert run.stderr.strip().splitlines() == ["interrupted during start-up: nothing was run or written"], run.stderr
        assert "ran on past" not in run.stdout and not (tmp_path / "out").exists()


def test_jobs_default_to_the_cores_per_thread_and_refuse_torchrun(monkeypatch, capsys):
    monkeypatch.setattr(runner, "usable_cores", lambda: 4)
    assert flags(["--smoke"]).jobs == 4
    assert flags(["--smoke", "--threads", "2"]).jobs == 2
    assert flags(["--smoke", "--threads", "8"]).jobs == 1
    assert flags(["--smoke", "--jobs", "3"]).jobs == 3
    monkeypatch.setattr(runner, "DDP", True)
    assert flags(["--smoke"]).jobs == 1
    with pytest.raises(SystemExit):
        flags(["--smoke", "--jobs", "2"])
    assert "under torchrun give --jobs 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--suite", "nope"], "unknown suite"),
    (["--seeds", "0"], "--seeds"),
    (["--iters", "-3"], "--iters"),
    (["--frobnicate"], "unrecognized"),
    (["--data", "/no/such/file.txt"], "no such file"),
    (["--device", "foo"], "--device must be"),
    (["--device", "meta"], "--device must be"),
    (["--suite", "moe,moe"], "twice"),
    (["--smoke", "--preset", "default"], "not both"),
    (["--seed0", "-1"], "--seed0 must be >= 0"),
    (["--suite", "tah,moe", "--accum", "3", "--batch", "2"], "--batch 2 has fewer rows than 1 rank(s) x 3"),
    (["--hd_ns", "2,4"], "--hd_ns must start at 1"),
    (["--hd_ns", "1,4,2"], "and rise"),
    (["--hd_ns", "1"], "two values or more"),
    (["--hd_ns", "1,x"], "--hd_ns takes a comma list of ints, got '1,x'"),
    (["--suite", "tah", "--accum", "8", "--tah_batch", "7", "--batch", "9"], "--tah_batch 7 has fewer rows"),
    (["--out", ""], "--out must name a folder"),
    (["--threads", "0"], "--threads"),
    (["--jobs", "0"], "--jobs must be an int in [1, 4,096], got 0"),
    *[([f"--{f}", str(10**24)], f"--{f} must be an int in [1, {most}], got 1{'0' * 24}")
      for f, most in (("threads", "4,096"), ("jobs", "4,096"), ("accum", "1,000,000,000"),
                      ("log_every", "1,000,000,000"), ("ckpt_every", "1,000,000,000"))],
    (["--lr=nan"], "--lr must be a finite number"),
    (["--n_layer=0"], "--n_layer must be an int in [1, "),
    *[([f"--{f}", str(10**30)], f"--{f} must be an int in [1, 9,007,199,254,740,992], got 1{'0' * 30}")
      for f in ("n_embd", "n_head", "head_dim", "n_experts", "expert_hidden", "batch", "tah_batch", "window")],
    (["--iters", str(10**30)], "--iters must be an int in [1, 1,000,000]"),
    (["--seeds", str(10**30)], "--seeds must be an int in [1, 1,000]"),
    (["--warmup", str(10**7)], "--warmup must be an int in [1, 1,000,000]"),
    (["--batch", str(10**8)], "and the cpu has"),  # the size rule: the estimate and the machine's memory
    (["--n_embd", str(2**20)], "needs ~"),
    (["--layout=IIF"], "builds no valid model: layout"),
    (["--n_layer=2.5"], "invalid int value"),
    (["--smoke", "--suite", "tah", "--digits=16"], "holds no whole Arith problem"),
    (["--block=1"], "holds no whole Lookups problem"),
    (["--digits=19"], "--digits must be <= 18"),
    (["--plays=macbeth,macbeth"], "names a play twice"),
    (["--seed0", "100000000000000"], "--seed0 must be >= 0 and at most"),
    (["--seed0", str(2**64)], "--seed0 must be >= 0 and at most"),
    (["--seed0", "1e30"], "invalid int value"),
    # --suite hd-compute: its longest stage (n = 1 for max(--hd_ns) x the steps) and its arms' sizes
    (["--suite", "hd-compute", "--hd_cont_iters", "1000000"], "continues n = 1 for 4x --hd_cont_iters"),
    (["--suite", "hd-compute", "--hd_cont_iters", "250001"], "4 x 250,001 steps"),
    (["--suite", "hd-compute", "--hd_ns", "1,2", "--batch", "937", "--jobs", "1"], "needs ~"),
    (["--suite", "hd-compute", "--hd_ns", "1,2,16", "--batch", "200", "--jobs", "1"], "needs ~"),
])
def test_bad_arguments_exit_with_one_clear_message(argv, words, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        flags(argv + ([] if "--out" in argv else ["--out", str(tmp_path / "out")]))
    assert e.value.code != 0
    assert words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_missing_package_fails_clearly():
    with pytest.raises(SystemExit, match="not installed"):
        tasks.package_dir("no_such_package_here")


def block_path(path, as_folder):
    """Put a folder (or a file) where the run expects a file (or a folder)."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.mkdir() if as_folder else path.write_text("x")


@pytest.mark.parametrize("case", ["out under a file", "rows.json a folder", "run folder a file", "ckpt a file",
                                  "token cache a folder", "data unreadable", "disk full"])
def test_file_system_errors_stop_with_one_line(case, tmp_path, monkeypatch, capsys):
    """Each file-system error gets one line (no traceback) from the one boundary in main."""
    argv = ["--preset", "smoke", "--suite", "moe", "--out", str(tmp_path)]  # keeps its checkpoints, unlike --smoke
    tt.main(argv)  # a finished run to spoil
    run = next(tmp_path.glob("run-*"))
    if case == "out under a file":
        block_path(tmp_path / "blocker", as_folder=False)
        argv[-1] = str(tmp_path / "blocker" / "sub")
    elif case == "rows.json a folder":
        block_path(run / "rows.json", as_folder=True)
    elif case == "run folder a file":
        block_path(run, as_folder=False)
    elif case == "ckpt a file":
        (run / "rows.json").unlink()
        block_path(run / "ckpt", as_folder=False)
    elif case == "token cache a folder":
        block_path(next(tmp_path.glob("shakespeare_*.npz")), as_folder=True)
    elif case == "data unreadable":
        data = tmp_path / "text.txt"
        data.write_text("some words " * 2000)
        argv += ["--data", str(data)]
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda p: (_ for _ in ()).throw(PermissionError(
            13, "Permission denied", str(p))) if p == data else real(p))
    else:  # the checkpoint writer meets a full disk
        (run / "rows.json").unlink()
        shutil.rmtree(run / "ckpt")
        monkeypatch.setattr(files, "atomic", lambda path, write: (_ for _ in ()).throw(OSError(
            28, "No space left on device", str(path))))
    with pytest.raises(SystemExit, match="^(error: |2$)") as e:  # unreadable --data: refused with the flags (2)
        tt.main(argv)
    assert "\n" not in str(e.value.code)
    if case == "data unreadable":
        assert e.value.code == 2 and "cannot be read (Permission denied)" in capsys.readouterr().err


def test_non_utf8_paths_and_a_non_numeric_port_are_refused(capsys):
    with pytest.raises(SystemExit):
        flags(["--out", "out-\udcff"])  # a byte that is not UTF-8, as Python passes it on
    assert "UTF-8 paths" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="MASTER_PORT"):
        runner.dist_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "x"})


def test_data_that_no_suite_reads_or_that_is_a_folder_is_refused(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("some text " * 100)
    with pytest.raises(SystemExit):
        flags(["--data", str(f), "--suite", "tah"])
    with pytest.raises(SystemExit):
        flags(["--data", str(tmp_path)])
    err = capsys.readouterr().err
    assert "suites that train on text (hd, moe, hd-progressive, hd-compute-lr, hd-compute)" in err and "it is a folder" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused(capsys):
    with pytest.raises(SystemExit):
        flags(["--device", "cuda:0"])
    assert "CUDA is not available" in capsys.readouterr().err


def test_rank_without_world_size_is_one_clear_error():
    assert runner.dist_env({}) == (False, 0, 1)
    launched = {"LOCAL_RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}  # what torchrun sets
    assert runner.dist_env({"RANK": "1", "WORLD_SIZE": "2", **launched}) == (True, 1, 2)
    with pytest.raises(SystemExit, match="WORLD_SIZE"):
        runner.dist_env({"RANK": "0"})
    with pytest.raises(SystemExit, match="not in"):
        runner.dist_env({"RANK": "3", "WORLD_SIZE": "2", **launched})
    with pytest.raises(SystemExit, match="MASTER_ADDR, MASTER_PORT not: launch with torchrun"):
        runner.dist_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})


@pytest.mark.parametrize("content, words", [(b"", "empty"), (b"\x00\x01\x02binary\x00" * 50, "binary"),
                                            (b"\xff\xfe\xfa" * 50, "not UTF-8"), (b"Too short.", "too short")])
def test_bad_data_files_fail_before_any_folder_is_made(tmp_path, content, words, capsys):
    """--data read, decoded and tokenized with the flags: one line, and no --out folder left behind."""
    f = tmp_path / "d.txt"
    f.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        tt.main(["--smoke", "--suite", "moe", "--data", str(f), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_damaged_or_foreign_checkpoint_gives_one_line_naming_the_file(tmp_path):
    P = trainer.Stage(steps=3, lr=3e-3, warmup=1, batch=4, block=16)
    key = ["k1"]  # the configuration the next train call belongs to
    train = lambda name, seed=0: trainer.train(name, tiny_backbone(), experiment.lm_loss, Arith(2), P,
                                               ctx=trainer.Context(tmp_path, key[0], log_every=100, ckpt_every=1,
                                                               checkpoints=files.Checkpoints()),
                                               seed=seed)
    train("arm")
    train("other", seed=1)
    ckpt, other = tmp_path / "ckpt" / "arm_s0.pt", tmp_path / "ckpt" / "other_s1.pt"
    good = ckpt.read_bytes()
    state = files.load_checkpoint(ckpt)
    assert state["meta"] == dict(arm="arm", seed=0, iters=3, run="k1") and state["iter"] == 3
    key[0] = "k2"  # the same arm's checkpoint, of another configuration
    with pytest.raises(SystemExit, match=f"{ckpt.name} holds .*'k1'.* not .*'k2'"):
        train("arm")
    key[0] = "k1"
    at = len(good) // 2  # one changed byte anywhere: the checksum no longer matches
    ckpt.write_bytes(good[:at] + bytes([good[at] ^ 1]) + good[at + 1:])
    with pytest.raises(SystemExit, match=f"{ckpt.name} is damaged.*--fresh"):
        train("arm")
    ckpt.write_bytes(good[:100])  # truncated
    with pytest.raises(SystemExit, match=f"{ckpt.name} is damaged"):
        train("arm")
    ckpt.write_bytes(other.read_bytes())  # another arm's finished checkpoint copied in place
    with pytest.raises(SystemExit, match=f"{ckpt.name} holds .*'other'.* not .*'arm'"):
        train("arm")
    nan_model = tiny_backbone()
    with torch.no_grad():
        for p in nan_model.parameters():
            p.fill_(float("nan"))
    files.write_checkpoint(ckpt, {**state, "model": nan_model.state_dict(), "opts": []})  # intact, this arm's, non-finite
    with pytest.raises(SystemExit, match="non-finite weights"):
        train("arm")
    ckpt.write_bytes(good)
    assert train("arm") == state["losses"]  # the intact file is used as it is


def test_damaged_rows_file_orphaned_temporaries_and_fresh(tmp_path):
    argv = ["--preset", "smoke", "--suite", "tah", "--out", str(tmp_path)]  # keeps its checkpoints
    tt.main(argv)
    (run,) = tmp_path.glob("run-*")
    orphan = run / "ckpt" / "x.pt.123.tmp"
    orphan.write_bytes(b"half")
    tt.main(argv)
    assert not orphan.exists()
    good = (run / "rows.json").read_text()
    doc = json.loads(good)
    v = repr(doc["rows"][0]["value"])  # as json wrote it
    i = good.index(f": {v}") + len(v) + 1  # its last digit
    one_digit = good[:i] + ("1" if good[i] != "1" else "2") + good[i + 1:]
    for damaged in ('[{"suite": "tah", ', "{}", "[1]", '[{"suite": "tah"}]', one_digit,
                    json.dumps({"sha256": doc["sha256"], "rows": [{"suite": "tah"}]})):
        assert damaged != good
        (run / "rows.json").write_text(damaged)
        with pytest.raises(SystemExit, match="rows.json is damaged"):
            tt.main(argv)
    (run / "rows.json").write_text(good)
    other = tmp_path / "other"
    tt.main(argv[:-1] + [str(other), "--tah_sft_lr=0.003"])  # another configuration's finished rows, copied in
    (run / "rows.json").write_text(next(other.glob("run-*/rows.json")).read_text())
    with pytest.raises(SystemExit, match="holds the rows of run .*, not of this run"):
        tt.main(argv)
    tt.main(argv + ["--fresh"])
    assert json.loads((run / "rows.json").read_text())["rows"]


def test_the_run_key_covers_every_source_file_a_run_imports():
    """SOURCES = train_tiny.py and every module of the project it imports, directly or not (read
    from their import statements, lab/'s too): a new module a run imports must join the run key."""
    import ast

    def files_of(node):
        if isinstance(node, ast.Import):
            return [a.name.replace(".", "/") + ".py" for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module.replace(".", "/")
            return [f"{base}.py"] + [f"{base}/{a.name}.py" for a in node.names]
        return []
    seen, todo = set(), ["train_tiny.py", "lab/__init__.py"]
    while todo:
        name = todo.pop()
        seen.add(name)
        for node in ast.walk(ast.parse((HERE / name).read_text())):
            todo += [f for f in files_of(node) if (HERE / f).is_file() and f not in seen]
    assert set(runner.SOURCES) == seen - {"lab/__init__.py"}


def test_the_run_key_changes_with_the_data_content(tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("When shall we three meet again\nIn thunder, lightning, or in rain?\n" * 60)
    argv = ["--smoke", "--suite", "moe", "--data", str(f), "--out", str(tmp_path / "out")]
    tt.main(argv)
    f.write_text("When the hurlyburly's done,\nWhen the battle's lost and won.\n" * 60)
    tt.main(argv)
    assert len(list((tmp_path / "out").glob("run-*"))) == 2  # the edited file was not taken as done


KILLS = [("moe/bias update on", 2), ("moe/bias update off", 1), ("tah/TaH stage 1", 2), ("hd/n=2 continued", 1),
         ("tah-hidden/token-type router", 2), ("tah3/TaH-3, iterated labels (max 3 passes) stage 1", 1),
         ("hd/n=2 continued, objective sum", 1)]  # one kill per suite family, and an ablation arm


def test_every_reported_number_is_the_same_after_a_kill_and_resume(tmp_path, monkeypatch, smoke_run):
    """One run of every suite and arm, killed at each of KILLS in turn and resumed after each,
    reports what the run never killed (smoke_run) reports."""
    real, killed = trainer.train, []

    class Killed(Exception):
        pass

    def dies_once_at_each(name, model, loss_fn, data, P, *, ctx, seed, on_step=None, **kw):
        def kill(done):
            if (name, done) in KILLS and (name, done) not in killed:
                killed.append((name, done))
                raise Killed
        return real(name, model, loss_fn, data, P, ctx=ctx, seed=seed, on_step=kill, **kw)
    patch_train(monkeypatch, dies_once_at_each)
    for _ in range(len(KILLS)):
        with pytest.raises(Killed):
            tt.main(SMOKE + ["--out", str(tmp_path)])
    tt.main(SMOKE + ["--out", str(tmp_path)])
    a, b = (json.loads((d / "results.json").read_text()) for d in (smoke_run[0], tmp_path))
    assert sorted(killed) == sorted(KILLS) and a["summary"] == b["summary"] and a["verdicts"] == b["verdicts"]


def test_compile_trains_through_the_compiled_models_and_matches_eager(tmp_path, monkeypatch):
    """--compile trains through torch.compile(model, fullgraph=True) for the backbone and HD, and
    gives the eager numbers up to float reordering; without the flag nothing is compiled on the
    CPU. Compiled with aot_eager (dynamo's and autograd's tracing, in seconds): test_compile.py
    compiles with inductor, as a GPU run does."""
    real, calls = torch.compile, []

    def compile_traced(model, **kw):
        calls.append((type(model).__name__, kw.get("fullgraph")))
        return real(model, **{**kw, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", compile_traced)
    common = ["--preset", "smoke", "--suite", "moe", "--device", "cpu", "--jobs", "1"]  # headline arms only
    for flag, out in (([], "eager"), (["--compile"], "compiled")):
        tt.main(common + flag + ["--out", str(tmp_path / out)])
        if not flag:
            assert calls == []
    assert calls and all(c == ("Transformer", True) for c in calls), calls
    eager, compiled = (json.loads((tmp_path / d / "results.json").read_text())["summary"] for d in ("eager", "compiled"))
    assert [(s["arm"], s["metric"]) for s in eager] == [(s["arm"], s["metric"]) for s in compiled]
    for a, b in zip(eager, compiled):
        assert b["mean"] == pytest.approx(a["mean"], rel=1e-3, abs=1e-3), (a["arm"], a["metric"])


def test_preset_fields_are_flags_the_nanogpt_way():
    args = flags(["--n_layer=4", "--layout=IIFL", "--plays=macbeth,hamlet", "--lr", "0.01", "--seeds=1",
                    "--hd_ns=1,2,8"])
    assert (args.preset.n_layer, args.preset.layout, args.preset.plays, args.preset.lr, args.preset.seeds, args.preset.hd_ns) == (
        4, "IIFL", ("macbeth", "hamlet"), 0.01, 1, (1, 2, 8))
    assert args.preset.n_embd == tt.PRESETS["default"].n_embd  # the rest from the preset
    other = flags(["--n_layer=4", "--layout=IIFL", "--log_every=7", "--ckpt_every", "9", "--seed0=3"])
    assert (other.preset.n_layer, other.ctx.log_every, other.ctx.ckpt_every, list(other.seeds)) == (4, 7, 9, [3, 4, 5, 6, 7])
    assert flags([]).preset_name == "default"  # on any device: the measured protocol
    assert flags(["--smoke", "--iters=7"]).preset == replace(tt.PRESETS["smoke"], iters=7)


def test_summing_over_ranks_leaves_a_parameter_no_rank_has_a_gradient_for_untouched(tmp_path):
    """In one process the optimizer skips a parameter without a gradient (TaH's LoRA and decider
    while the Standard model trains); filling it with zeros under DDP would let AdamW's weight
    decay move it, and the runs would part. One rank of a real process group."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        used, unused = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3, 3))
        (used * 2).sum().backward()
        assert trainer.sum_over_ranks([used, unused], 1.5, "cpu") == 1.5
        assert unused.grad is None and torch.equal(used.grad, torch.full((3, 3), 2.0))
        before = unused.detach().clone()
        opt = torch.optim.AdamW([used, unused], lr=0.1, weight_decay=0.1)
        opt.step()
        assert torch.equal(unused, before)
    finally:
        dist.destroy_process_group()


class SlowToPickle:
    """Task data whose pickling (in the parent, as it writes the job's file before Process.start)
    takes 3 s: a wide start-up window. It marks the window's start in a file; unpickled in the
    process, it records its pid."""

    def __init__(self, folder):
        self.folder = folder

    def __reduce__(self):
        (Path(self.folder) / "starting").write_text("")
        time.sleep(3)
        return record_pid, (self.folder,)


def record_pid(folder):
    (Path(folder) / "pid0").write_text(str(os.getpid()))
    return None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_while_a_jobs_process_starts_is_not_lost(tmp_path):
    """SIGINT to the run's process group while the parent starts a --jobs process (its task takes
    3 s to pickle): the run stops with exit code 130 and one line, no traceback from either
    process, and no process left. (Before: SIGINT was ignored there, and lost.)"""
    argv = ["--smoke", "--suite", "moe", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path)]
    script = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              + sessions_script(argv, f"t.SlowToPickle({str(tmp_path)!r})"))
    run = subprocess.Popen([sys.executable, "-c", script], cwd=HERE, start_new_session=True, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for _ in range(1200):
        if (tmp_path / "starting").exists():
            break
        time.sleep(0.1)
    time.sleep(1.0)  # inside the 3-second start
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.count("interrupted: what finished is saved") == 1, err
    assert all_ended(pids_written([tmp_path / "pid0"]) if (tmp_path / "pid0").exists() else [])


@pytest.mark.parametrize("sig, raised", [(signal.SIGTERM, runner.Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_during_a_jobs_process_start_is_answered_after_it(sig, raised):
    """A SIGTERM or Ctrl-C that lands inside a --jobs process's start (signals_deferred) is held
    until the start returns, then answered by the run's own handler. (Before, a SIGTERM cut the
    start short: the process, half-sent its task, died on an EOFError's traceback.)"""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, runner.stop_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    steps = []
    try:
        with pytest.raises(raised):
            with runner.signals_deferred():
                signal.raise_signal(sig)
                steps.append("the start went on")
        assert steps == ["the start went on"]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_a_master_port_out_of_range_is_refused_at_start():
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="99999")
    with pytest.raises(SystemExit, match="MASTER_PORT must be a port in 1..65535, got 99999"):
        runner.dist_env(env)


@pytest.mark.parametrize("case", ["unresolvable address", "port in use"])
def test_a_ddp_set_up_that_cannot_start_stops_with_one_line(case, monkeypatch):
    """The process group's set-up sits inside main's error boundary: an address that does not
    resolve is refused before c10d's retries; a port another process listens on gives one line."""
    import socket
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    addr = "no.such.host.invalid" if case == "unresolvable address" else "127.0.0.1"
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=addr,
                     MASTER_PORT=str(busy.getsockname()[1])).items():
        monkeypatch.setenv(k, v)
    try:
        with pytest.raises(SystemExit) as e:
            runner.start_ddp("cpu", timeout=20)
    finally:
        busy.close()
    line = str(e.value.code)
    assert line.startswith("error: ") and "\n" not in line
    assert ("does not resolve" if case == "unresolvable address" else "did not start") in line


def test_a_token_cache_that_is_a_folder_stops_with_one_line_naming_it(tmp_path, capsys):
    tt.main(["--smoke", "--suite", "moe", "--out", str(tmp_path)])
    (cache,) = tmp_path.glob("*.npz")
    cache.unlink()
    cache.mkdir()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        tt.main(["--smoke", "--suite", "moe", "--out", str(tmp_path)])
    assert str(e.value.code) == f"error: the token cache {cache} is a folder; remove it, or choose another --out"
    assert "tokenizing" not in capsys.readouterr().err


def test_a_full_disk_names_the_file_being_written(tmp_path):
    def full(f):
        raise OSError(28, "No space left on device")  # as a write() raises it: no file name
    with pytest.raises(OSError) as e:
        files.atomic(tmp_path / "results.md", full)
    assert e.value.filename == str(tmp_path / "results.md") and e.value.strerror == "No space left on device"
    assert not list(tmp_path.iterdir())  # no .tmp left


def test_temporaries_of_a_run_killed_mid_write_are_swept_from_out(tmp_path):
    tt.main(["--smoke", "--suite", "moe", "--out", str(tmp_path)])
    left = [tmp_path / f"results.md.{os.getpid()}.tmp", tmp_path / "results.json.7.tmp", tmp_path / "x.npz.7.tmp"]
    for f in left:
        f.write_text("half")
    tt.main(["--smoke", "--suite", "moe", "--out", str(tmp_path)])
    assert not any(f.exists() for f in left)


@pytest.mark.parametrize("durations, jobs", [((110, 90), 2), ((110, 90), 1), ((110, 30), 2), ((60, 60, 20, 200), 4)])
def test_the_time_left_is_within_30_percent_once_each_suite_has_finished_a_seed(durations, jobs):
    """time_left against the truth of a simulated run (5 seeds of suites that take these seconds,
    scheduled as Session.train schedules them: in order, on the first of `jobs` processes free,
    each seed of a suite within 10% of the others): after every finish once each suite has
    finished a seed, the estimate is within 30% of the time that is really left."""
    import random
    rng = random.Random(0)
    units = [(s, k) for k in range(5) for s in range(len(durations))]  # seed by seed, as --suite order x seeds
    units = sorted(units)  # train_tiny's loop: suite by suite, then seed
    took = {u: durations[u[0]] * rng.uniform(0.95, 1.05) for u in units}
    free, ends, starts = [0.0] * jobs, {}, {}
    for u in units:
        i = free.index(min(free))
        starts[u], ends[u] = free[i], free[i] + took[u]
        free[i] = ends[u]
    finish = max(ends.values())
    for now in sorted(ends.values()):
        done = [u for u in units if ends[u] <= now]
        seen = {}
        for u in done:
            seen.setdefault(u[0], []).append(took[u])
        if len(seen) < len(durations):
            continue
        running = {u: starts[u] for u in units if starts[u] <= now < ends[u]}
        todo = [u for u in units if ends[u] > now]
        left = runner.time_left(todo, seen, running, jobs, now)
        assert abs(left - (finish - now)) <= 0.3 * (finish - now) + 1e-9, (now, left, finish - now)


def test_help_gives_each_default_once_in_the_form_the_flag_takes(capsys):
    """--help: no flag shows two defaults or "(default: None)"; --device says its default depends
    on the machine; a preset override lists every preset's value as the flag takes it."""
    with pytest.raises(SystemExit):
        tt.main(["--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    flags = re.split(r" (?=--[a-z_]+[ ,])", text.split("options:")[1])
    assert len(flags) > 40
    for f in flags:
        assert f.count("(default:") + f.count("; default:") <= 1, f
        assert "(default: None)" not in f and "(default: False)" not in f, f
    assert "cuda where torch sees a GPU, else cpu" in text
    assert "--threads THREADS CPU threads per process" in text and "(default: 1)" in text
    assert "preset default macbeth,hamlet,othello,king-lear, large '', smoke macbeth" in text
    assert "('macbeth'" not in text


@given(st.lists(st.floats(1, 100), min_size=0, max_size=6), st.lists(st.floats(1, 100), min_size=1, max_size=3),
       st.integers(1, 3), st.floats(0, 50))
@examples(100)
def test_the_jobs_time_left_is_when_the_last_process_is_free(waiting, running, jobs, ran):
    """runner.time_left: the running units finish, each waiting one goes (in order) to the first
    process free, every unit its suite's mean time so far. Against a step-by-step simulation of
    that schedule: the time left is the moment the last process is done, not the first."""
    running = running[:jobs]
    took = {f"w{i}": [s] for i, s in enumerate(waiting)} | {f"r{i}": [s] for i, s in enumerate(running)}
    now = 1000.0
    got = runner.time_left([(f"r{i}", 0) for i in range(len(running))] + [(f"w{i}", 0) for i in range(len(waiting))],
                           took, {(f"r{i}", 0): now - ran for i in range(len(running))}, jobs, now)
    busy = [max(0.0, s - ran) for s in running] + [0.0] * (jobs - len(running))  # each process: when it is free
    for s in waiting:
        first = busy.index(min(busy))
        busy[first] += s
    assert got == pytest.approx(max(busy), abs=1e-6)


def test_compiled_training_is_one_graph_per_arm_configuration_and_none_for_a_later_seed(tmp_path, monkeypatch):
    """--compile on the headline suites (the default run's arms, at the smoke preset's sizes; HD over
    two seeds, TaH three), dynamo's recompile limit an error: the backbone and HD compile once per
    distinct configuration, TaH a bounded number of pass graphs, and its third seed compiles nothing. (The
    second seed still compiles some TaH pass graphs: the first seed's last pass graphs met
    fewer guard cases (a pass under no_grad after one under grad, a LoRA frozen for stage 2,
    the recorded trace of seed 0's problem); once met, they are reused.) Traced with
    dynamo's "eager" backend (its tracing decides graphs and recompiles; test_hd.py and test_tah.py
    compile with inductor)."""
    whole, passes = CompileCounter(), CompileCounter()
    real, configs, seen = torch.compile, set(), collections.defaultdict(int)

    def counted(model, **kw):
        configs.add((type(model).__name__, repr(model.cfg)))
        return real(model, **{**kw, "backend": whole})
    monkeypatch.setattr(torch, "compile", counted)
    monkeypatch.setattr(tah, "COMPILED_PASS", real(ThinkAtHard.run_pass, backend=passes, fullgraph=True, dynamic=True))
    real_train = trainer.train

    def train(name, model, *a, **kw):
        out = real_train(name, model, *a, **kw)
        seed = kw["seed"]
        seen[seed] = whole.frame_count + passes.frame_count  # graphs after each seed's stages
        return out
    patch_train(monkeypatch, train)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=64):
        for suite, seeds in (("hd", "2"), ("tah", "3")):  # HD's later seed: no graph beyond one per configuration
            tt.main(["--preset", "smoke", "--suite", suite, "--compile", "--seeds", seeds, "--jobs", "1", "--out",
                     str(tmp_path / suite)])
    assert whole.frame_count == len(configs) > 0, (whole.frame_count, configs)
    assert 0 < passes.frame_count <= 16, passes.frame_count
    assert seen[2] == seen[1], dict(seen)  # seed 2 trained through the graphs of seeds 0 and 1


# -----------------------------------------------------------------------------
# 5. No tensor made without a device: on a GPU such a tensor lands on the CPU (a copy each step, and a
# CUDA graph cannot hold it). Pinned on the CPU with meta as the default device: a tensor made without
# device= is meta, and fails the first op that meets the CPU's.


class SlowToUnpickle:
    """Task data that a --jobs process takes a minute to unpickle: its start-up, before any line of
    in_process runs. The process records its pid first."""

    def __init__(self, folder):
        self.folder = folder

    def __reduce__(self):
        return slow_start, (self.folder,)


def slow_start(folder):
    (Path(folder) / f"pid{os.getpid()}").write_text(str(os.getpid()))
    time.sleep(60)


def session_processes(sid):
    """The pids of the processes alive in session `sid` (a run started in a session of its own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_jobs_processes_end_within_seconds_when_the_parent_dies_during_their_start_up(tmp_path):
    """kill -9 of the parent while its --jobs processes are still starting (unpickling their task,
    as importing torch would hold them): they end within seconds, and nothing of the run's session
    stays (multiprocessing's resource tracker neither). They watch their parent from their first
    import of lab/, not from a thread in_process starts after its start-up."""
    argv = ["--smoke", "--suite", "moe", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path)]
    parent = subprocess.Popen([sys.executable, "-c", sessions_script(argv, f"t.SlowToUnpickle({str(tmp_path)!r})")],
                              cwd=HERE, start_new_session=True)
    for _ in range(600):
        if len(list(tmp_path.glob("pid*"))) == 2:
            break
        time.sleep(0.1)
    pids = [int(f.read_text()) for f in tmp_path.glob("pid*")]
    assert len(pids) == 2 and all(running(p) for p in pids)
    parent.kill()
    parent.wait()
    assert all_ended(pids)
    for _ in range(100):
        if not session_processes(parent.pid):
            break
        time.sleep(0.1)
    assert session_processes(parent.pid) == []
