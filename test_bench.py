"""bench.py --quick runs every CPU section end to end (the numbers are not asserted: timing
belongs in a benchmark, not a test)."""

import bench


def test_quick_bench_prints_every_section(capfd):
    bench.main(["--quick", "--repeats", "1"])
    out, err = capfd.readouterr()  # what reaches the terminal, C++ writes included
    assert "USDT" not in out + err  # the profiler's own start/stop lines are kept out
    for title in ("1. Attention alone", "2. HD training step", "3. KV-mirror final-stream skip", "4. HD serving",
                  "4b. KV cache", "4c. HD decode tokens/s against prompt length", "4d. Where a decode step's time goes",
                  "4e. Attention of a decode step", "4f. The L layer alone", "5. TaH",
                  "5b. Where TaH's extra cost goes"):
        assert title in out, title
    assert "x |" in out  # ratios were printed


def test_compiled_decode_section_compiles_and_compares_tokens(capfd):
    """bench.py --compile (4g) on one small row: torch.compile of the decode step runs on the
    CPU and its greedy tokens are compared with eager's (a compile: about a minute). Whether
    they agree is a measurement (float32 sums may reassociate), so either answer passes."""
    bench.main(["--compile", "--quick", "--repeats", "1"])
    out, _ = capfd.readouterr()
    assert "4g. A compiled decode step" in out
    assert "| yes |" in out or "| no |" in out
