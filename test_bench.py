"""bench.py --quick runs every CPU section end to end (the numbers are not asserted: timing
belongs in a benchmark, not a test)."""

import pytest
import torch

import bench
import tah


def test_quick_bench_prints_every_section(capfd):
    bench.main(["--quick", "--repeats", "1"])
    out, err = capfd.readouterr()  # what reaches the terminal, C++ writes included
    assert "USDT" not in out + err  # the profiler's own start/stop lines are kept out
    for title in ("1. Attention alone", "2. HD training step", "3. KV-mirror final-stream skip", "4. HD serving",
                  "4b. KV cache", "4c. HD decode tokens/s against prompt length", "4d. Where a decode step's time goes",
                  "4e. Attention of a decode step", "4f. The L layer alone", "4h. The MoE layer alone", "5. TaH",
                  "5b. Where TaH's extra cost goes"):
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



def test_compiled_training_section_compares_the_two_runs_loss_by_loss(capfd, monkeypatch):
    """6b (gpu_check.sh's compiled-training check), run here on the CPU: from one init on the same
    batches, eager and "compiled" train step for step; "agree" when every step's losses are within
    the tolerance, and "DISAGREE" when the compiled arm's loss is off by 5%. The "compiled" model is
    the model itself, its loss scaled: what is tested is the comparison (test_compile.py compiles)."""
    def off_by(scale):
        def compile_(model, **kw):
            return lambda x, y: (lambda logits, loss: (logits, loss * scale))(*model(x, y))
        return compile_
    for scale, verdict, first_step in ((1.0, "-> agree", "0.00%"), (1.05, "-> DISAGREE", "5.00%")):
        monkeypatch.setattr(torch, "compile", off_by(scale))
        bench.compiled_training_agrees(32, 1, device="cpu", steps=3, B=2, L=8, n=2)
        out, _ = capfd.readouterr()
        steps = [r for r in out.splitlines() if r.startswith(("| 1 |", "| 2 |", "| 3 |"))]
        assert len(steps) == 3 and verdict in out, out
        assert steps[0].endswith(f"| {first_step} |"), steps[0]  # one init, one batch: only the scale differs


@pytest.mark.parametrize("argv, says", [
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--repeats", "two"], "invalid int value"),
    (["--compile", "--cuda"], "give one"),
    (["--fast"], "unrecognized arguments"),
])
def test_bench_flags_fail_with_one_line_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
