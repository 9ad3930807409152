"""Each figure shows what its caption says: drawn from a small summary, its axes carry the
labels of the plotted quantity, the plotted values are the summary's, and a mean has its error
bars (one std over seeds)."""


if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/test_figures.py is no script: run python -m pytest lab/test_figures.py", file=sys.stderr)
    sys.exit(2)

import numpy as np
import pytest

pytest.importorskip("matplotlib")
import matplotlib.figure  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402

import hd_experiment as hd_x  # noqa: E402
import tah_experiment  # noqa: E402
from hd_experiment import stream_name  # noqa: E402
from lab import figures  # noqa: E402


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    """The figures a plot function saves, kept open to be read."""
    figs = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: (figs.append(self), real(self, *a, **k)))
    monkeypatch.setattr(figures.pyplot(), "close", lambda *a: None)
    return figs, tmp_path


def row(effect, arm, metric, mean, std=0.01):
    """A summary entry, as report.summarize writes it: the plots read labels."""
    return dict(effect=effect, arm=getattr(arm, "label", arm), metric=metric, mean=mean, std=std)


def has_error_bars(ax):
    return any(isinstance(c, ErrorbarContainer) for c in ax.containers)


def test_hd_streams_panel_c_plots_the_top1_disagreement_and_d_the_entropy(drawn):
    figs, out = drawn
    summary, rng = [], np.random.default_rng(0)
    for n, fx in ((n, hd_x.hd_effects(n)) for n in (2, 4)):
        for arm in (hd_x.SAME, hd_x.DIFFERENT):
            summary += [row(fx.cosine.name, arm, m, rng.uniform()) for m in ("input", "block 1", "block 2")]
        summary += [row(fx.mass.name, "block 3 (F)", f"on {stream_name(k, n)}", 1 / n) for k in range(n)]
        for k in range(n):
            summary += [row(fx.head.name, stream_name(k, n), hd_x.DIFFERS, 0.0 if k == n - 1 else 0.4 + 0.01 * k),
                        row(fx.head.name, stream_name(k, n), hd_x.BITS, 8.0 + 0.1 * k, 0.2)]
    assert figures.plot_hd_streams(summary, out, (1, 2, 4)) is not None
    (fig,) = figs
    a, b, c, d = fig.axes
    assert "cosine" in a.get_ylabel() and "attention mass" in b.get_ylabel()
    assert "top-1 differs from the final stream" in c.get_ylabel() and "entropy (bits)" in d.get_ylabel()
    n = 4
    want = [0.4 + 0.01 * k for k in range(n - 1)]  # the earlier streams; the final stream is 0 by definition
    assert any(np.allclose(line.get_ydata(), want) for line in c.get_lines())
    assert all(float(t).is_integer() for t in c.get_xticks()) and c.get_ylim() == (0, 1)
    assert all(has_error_bars(ax) for ax in (a, c, d)) and b.containers  # bars with their error bars
    assert all(ax.get_xlabel() for ax in fig.axes)


def test_the_tradeoff_labels_each_threshold_and_zooms_on_them(drawn):
    figs, out = drawn
    effect = "TaH: decider threshold sweep (in-context lookups, answers)"
    summary = [row(effect, tah_experiment.STANDARD, "iterated", 0.0), row(effect, tah_experiment.STANDARD, "acc", 0.8),
               row(effect, tah_experiment.ALWAYS, "iterated", 1.0), row(effect, tah_experiment.ALWAYS, "acc", 0.95)]
    for t, it in ((0.5, 0.07), (0.9, 0.06)):
        summary += [row(effect, f"TaH decider, threshold {t}", "iterated", it), row(effect, f"TaH decider, threshold {t}",
                                                                                  "acc", 0.95)]
    assert figures.plot_tah_tradeoff(summary, out, "held-out") is not None
    (fig,) = figs
    ax = fig.axes[0]
    inset = ax.child_axes[0]
    assert "positions iterated" in ax.get_xlabel() and "answer accuracy" in ax.get_ylabel()
    assert {t.get_text() for t in inset.texts} == {"0.5", "0.9"}
    assert inset.get_xlim()[1] - inset.get_xlim()[0] < 0.2  # the thresholds' cluster, readable
    assert has_error_bars(ax) and has_error_bars(inset)


def test_the_loss_curves_give_the_decider_its_own_axis_and_a_band_over_seeds(drawn):
    figs, out = drawn
    rng = np.random.default_rng(1)
    curves = {("hd", arm): [list(5 + rng.normal(0, 0.01, 40)) for _ in range(3)]
              for arm in ("n=1 continued", "n=2 continued", "n=4 continued")}
    curves[("tah", "Standard")] = [list(rng.uniform(0, 1, 30)) for _ in range(3)]
    curves[("tah", "TaH stage 2 (decider)")] = [list(rng.uniform(0, 0.3, 30)) for _ in range(3)]
    assert figures.plot(curves, out) is not None
    (fig,) = figs
    hd, tah = [ax for ax in fig.axes if ax.get_title()][:2]
    assert "nats" in hd.get_ylabel() and hd.get_title() != "hd"
    assert any("BCE" in ax.get_ylabel() for ax in fig.axes)  # the decider's loss on an axis of its own
    assert hd.collections  # the band of ± one std over seeds
    assert hd.child_axes and "paired by seed" in hd.child_axes[0].get_title()  # the overlapping arms' differences
    inset = hd.child_axes[0]
    color = {line.get_label(): line.get_color() for line in hd.get_lines()}
    assert [line.get_color() for line in inset.get_lines()[:2]] == [color["n=2 continued"], color["n=4 continued"]]
    figs.clear()
    assert figures.plot({(f"suite{k}", "arm"): [[1.0] * 20] for k in range(7)}, out) is not None  # --smoke's 7 suites
    (fig,) = figs
    assert fig.get_size_inches()[0] <= 3 * 5.5  # three panels a row, not one wide strip


def test_the_problem_figure_has_a_colorbar_and_names_each_answer_before_and_after(drawn):
    import torch
    figs, out = drawn
    trace = dict(passes=torch.tensor([1, 2, 1]), go=torch.tensor([0.1, 0.95, 0.2]), first=torch.tensor([4, 5, 6]),
                 final=torch.tensor([4, 7, 6]), weights=torch.tensor([[0.5, 0.3, 0.2]]), query_pos=torch.tensor([1]),
                 key_pos=torch.tensor([0, 1, 1]), key_depth=torch.tensor([0, 0, 1]))
    figures.plot_trace(trace, ["a", "b?2", "c"], 0.9, out / "p.png", describe=lambda i: f"t{i}")
    (fig,) = figs
    labels = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert labels == ["b?2 (1.2): t5 -> t7"]
    assert any(ax.get_ylabel() == "attention weight" for ax in fig.axes)  # the colorbar
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["a 0.1", "b?2 1.1", "b?2 1.2"]


@pytest.mark.parametrize("argv, words", [
    (["--out", ""], "--out must name a folder"),
    (["--docs", "--out", "x"], "give --docs or --out, not both"),
    (["--bogus"], "unrecognized arguments"),
])
def test_report_py_refuses_what_it_cannot_honour_in_one_line(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        figures.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_report_py_says_in_one_line_when_its_folder_is_a_file_or_cannot_be_written(tmp_path, monkeypatch, capsys):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as e:
        figures.main(["--out", str(tmp_path / "f")])
    assert e.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(figures, "plot_masks", denied)
    with pytest.raises(SystemExit, match=r"^error: Permission denied \(.*masks.png\): masks.png is not written$"):
        figures.main(["--out", str(tmp_path / "ro")])


def test_the_masks_picture_shows_the_mask_functions_cells():
    """figures.mask_panels on tiny sizes against the papers' definitions (a loop per cell), and
    the drawn figure's pixel at each cell's centre: dark exactly where the query sees the key."""
    pytest.importorskip("matplotlib")
    n, L, window, depths = 2, 3, 2, (2, 1, 2)
    panels = figures.mask_panels(n, L, window, depths)
    t = range(n * L)
    want = [[[kv <= q for kv in t] for q in t], [[0 <= q - kv < window for kv in t] for q in t],
            [[kv <= q and kv % n == q % n for kv in t] for q in t]]
    states = [(i, d) for d in range(2) for i, D in enumerate(depths) if D > d]  # the order a forward appends
    want.append([[j <= i and k <= d for (j, k) in states] for (i, d) in states])  # TaH Eq. 5
    assert [m.tolist() for _, m, _, _ in panels] == want
    assert panels[-1][2] == [f"{i}.{d + 1}" for i, d in states]  # token.pass, passes counted from 1
    fig = figures.draw_masks(panels)
    assert [t.get_text() for t in fig.legends[0].texts] == ["the query may attend to the key", "masked"]
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].mean(-1)  # (H, W) brightness, row 0 at the top
    for ax, (_, m, _, _) in zip(fig.axes, panels):
        for q in range(m.shape[0]):
            for k in range(m.shape[1]):
                x, y = ax.transData.transform((k, q))  # the cell's centre, y from the bottom
                dark = pixels[int(round(pixels.shape[0] - y)), int(round(x))] < 128
                assert dark == bool(m[q, k]), (ax.get_title(), q, k)
    figures.pyplot().close(fig)
