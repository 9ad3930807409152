"""The report (lab/report.py): pooling over a grid of cells, the t quantiles of its intervals, and
tables over seeds where a metric has no value in some."""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/test_report.py is no script: run python -m pytest lab/test_report.py", file=sys.stderr)
    sys.exit(2)

import numpy as np
import pytest
from hypothesis import given, strategies as st

from conftest import examples
import experiment
import tah_experiment
from lab import report


def test_pooling_refuses_an_empty_pool_and_a_delta_that_is_not_a_finite_number():
    with pytest.raises(ValueError, match="the pool is empty"):
        report.pooled([])
    with pytest.raises(ValueError, match="finite real numbers"):
        report.pooled([("A", 0, 0.1), ("A", 1, float("nan"))])
    assert report.pooled([("A", 0, 0.1), ("A", 1, 0.3)])["mean"] == pytest.approx(0.2)
    for huge in ([("A", s, 1e308) for s in range(3)], [("A", 0, 1e308), ("A", 1, -1e308)]):  # the mean, the std
        with pytest.raises(ValueError, match="overflow a float's range"):  # as report.verdict refuses it
            report.pooled(huge)
    # the 95% interval beside the rule: mean ± t(0.975, n-1) * std / sqrt(n); 1..5 by hand: 3 ± 2.776 * 0.7071
    assert report.interval95([1, 2, 3, 4, 5]) == pytest.approx((3 - 1.9629, 3 + 1.9629), abs=1e-3)
    assert report.interval95([2.0, 4.0]) == pytest.approx((3 - 12.706, 3 + 12.706), abs=1e-3)
    assert report.interval95([1.0]) is None and report.interval95([1.0, float("nan")]) is None


def test_a_metric_without_a_value_in_some_seeds_is_summarized_over_the_others():
    # the decider's "share of AlwaysThink's gain" is nan in a seed where AlwaysThink gains nothing
    fx, rr = tah_experiment.TAH_EFFECTS.routing, experiment.result_rows
    rows = [r for s in range(3) for r in rr(fx, tah_experiment.STANDARD, s, {"acc": 0.5})]
    rows += [r for s, v in enumerate([0.5, float("nan"), 1.5]) for r in rr(fx, tah_experiment.TAH_DECIDER, s, {"share": v})]
    rows += [r for s in range(3) for r in rr(fx, tah_experiment.TAH_DECIDER, s, {"none": float("nan")})]
    rows += [r for s, v in enumerate([0.6, float("nan"), 0.8]) for r in rr(fx, tah_experiment.TAH_DECIDER, s, {"acc": v})]
    summary = report.summarize(rows)
    s = {x["metric"]: x for x in summary}
    acc = next(x for x in summary if x["arm"] == tah_experiment.TAH_DECIDER.label and x["metric"] == "acc")
    assert (acc["delta_mean"], acc["delta_std"]) == pytest.approx((0.2, np.sqrt(0.02)))  # (0.1, 0.3) by hand
    assert (s["share"]["mean"], s["share"]["std"], s["share"]["n"], s["share"]["seeds"]) == (1.0, np.sqrt(0.5), 2, 3)
    md = report.table(summary, [], "", experiment.RULE)
    assert "1.0000 ± 0.7071 (2 of 3 seeds)" in md and "no value" in md and "nan" not in md



def test_table_cells_keep_four_significant_digits_for_large_values_and_four_decimals_for_losses():
    # a FLOPs count printed to 4 decimals is 14 digits, 10 of them noise; a loss keeps its 4 decimals
    assert report.fmt("loss", 5.56204) == "5.5620" and report.fmt("loss", -0.0295, "+") == "-0.0295"
    assert report.fmt("FLOPs", 538_812_345_678.0) == "5.388e+11"
    assert report.fmt("FLOPs", 611_200_000_000.0, "+") == "+6.112e+11"
    assert report.fmt("corrected vs Standard", 777.4) == "777" and report.fmt("loss", 0.0, "+") == "+0.0000"

# -----------------------------------------------------------------------------
# bad input


def test_the_t_quantiles_hold_95_percent_of_students_t():
    """report.T975 against the t density integrated numerically (a brute-force reference)."""
    from math import gamma, pi, sqrt
    for dof, t in report.T975.items():
        x = np.linspace(-t, t, 400_001)
        pdf = gamma((dof + 1) / 2) / (sqrt(dof * pi) * gamma(dof / 2)) * (1 + x ** 2 / dof) ** (-(dof + 1) / 2)
        assert abs(np.trapezoid(pdf, x) - 0.95) < 2e-4, dof


@examples(30)
@given(a=st.lists(st.floats(-1, 1), min_size=2, max_size=6), b=st.lists(st.floats(-1, 1), min_size=2, max_size=6),
       noise=st.floats(0.01, 0.5))
def test_pooled_counts_a_repeated_run_once_and_averages_a_seeds_runs(a, b, noise):
    """The grid's pooled interval, by brute force: machine A's cell given twice (1 and 2 threads,
    equal to every digit) counts once; machine B's two thread counts differ, and each seed is
    their mean; N is the (machine, seed)s and the interval is t with N - 1 degrees of freedom."""
    b2 = [x + noise for x in b]
    runs = ([("A", s, x) for s, x in enumerate(a)] * 2 + [("B", s, x) for s, x in enumerate(b)]
            + [("B", s, x) for s, x in enumerate(b2)])
    units = a + [(x + y) / 2 for x, y in zip(b, b2)]
    got = report.pooled(runs)
    n, m, sd = len(units), float(np.mean(units)), float(np.std(units, ddof=1))
    assert got["n"] == len(a) + len(b)
    assert got["mean"] == pytest.approx(m, abs=1e-12) and got["std"] == pytest.approx(sd, abs=1e-12)
    half = report.T975[n - 1] * sd / np.sqrt(n)
    assert got["interval95"] == pytest.approx((m - half, m + half), abs=1e-12)
    cells = report.pooled_cells([(len(a), np.mean(a), np.std(a, ddof=1)),
                                 (len(b), np.mean(units[len(a):]), np.std(units[len(a):], ddof=1))])
    assert all(np.allclose(cells[k], got[k], atol=1e-12) for k in got)  # the same numbers from the cells' summaries


@pytest.mark.parametrize("runs", [[("A", 0)], [("A", 0, 0.1, 9)], "A0", {"A": 0.1}, [["A", 0, 0.1]]])
def test_pooling_refuses_runs_that_are_not_machine_seed_delta_triples(runs):
    with pytest.raises(ValueError, match=r"pooled takes a list of \(machine, seed, delta\) triples"):
        report.pooled(runs)
