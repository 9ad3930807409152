"""bench.py --quick runs every CPU section end to end (the numbers are not asserted: timing
belongs in a benchmark, not a test)."""

import bench


def test_quick_bench_prints_every_section(capfd):
    bench.main(["--quick", "--repeats", "1"])
    out, err = capfd.readouterr()  # what reaches the terminal, C++ writes included
    assert "USDT" not in out + err  # the profiler's own start/stop lines are kept out
    for title in ("1. Attention alone", "2. HD training step", "3. KV-mirror final-stream skip", "4. HD serving",
                  "4b. KV cache", "4c. HD decode tokens/s against prompt length", "4d. Where a decode step's time goes", "5. TaH",
                  "5b. Where TaH's extra cost goes"):
        assert title in out, title
    assert "x |" in out  # ratios were printed
