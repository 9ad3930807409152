"""
The figures of train_tiny.py's report, drawn with matplotlib from the report's summary (or, for
the loss curves, the checkpoints' own record of their losses); without matplotlib, none. And the
README's picture of the masks: `python -m lab.figures --docs` draws it from the mask functions.
"""

if __name__ == "__main__" and not __package__:  # by its path lab/ is not importable: one line saying how to run it
    import sys
    print("lab/figures.py runs as a module, from the project's folder: python -m lab.figures --help", file=sys.stderr)
    sys.exit(2)

import shutil
from pathlib import Path

import numpy as np

from hd_experiment import HDInside, hd_effects
from lab.files import atomic, load_checkpoint
from trainer import rank_world


def pyplot():
    """matplotlib's pyplot without a screen, or None where matplotlib is missing (no plots)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def saved(fig, path):
    """A figure laid out, written to path (120 dpi) and closed: its path."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def loss_curves(run_dir):
    """(suite, arm) -> per-seed training losses, from the checkpoints' own record."""
    curves = {}
    for f in sorted((run_dir / "ckpt").glob("*.pt")):
        state = load_checkpoint(f)
        suite, arm = state["meta"]["arm"].split("/", 1)
        curves.setdefault((suite, arm), []).append(state["losses"])
    return curves


def plot(curves, out_dir):
    """Training losses, a panel per suite (curves: (suite, arm) -> per-seed losses), 10-step means
    ± one std over seeds, the paired differences inset; TaH's decider BCE on its own axis."""
    plt = pyplot()
    if plt is None or not curves:
        return None
    suites = sorted({s for s, _ in curves})
    cols = min(3, len(suites))
    fig, axes = plt.subplots(-(-len(suites) // cols), cols, figsize=(5.5 * cols, 4.2 * -(-len(suites) // cols)),
                             squeeze=False)
    for ax in axes.flat[len(suites):]:
        ax.set_visible(False)
    for ax, suite in zip(axes.flat, suites):
        bce, colors = None, {}
        for (s, arm), runs in curves.items():
            if s != suite:
                continue
            k = min(map(len, runs))
            smooth = np.array([np.convolve(r[:k], np.ones(10) / 10, mode="valid") for r in runs])
            mean, std = smooth.mean(0), smooth.std(0, ddof=1) if len(runs) > 1 else np.zeros(smooth.shape[1])
            on = ax
            if "decider" in arm:  # stage 2 trains the decider's BCE: its own scale
                bce = bce or ax.twinx()
                on = bce
            line, = on.plot(mean, label=arm, lw=1, **({"ls": "--", "color": "k"} if on is bce else {}))  # its own axis
            colors[arm] = line.get_color()
            on.fill_between(range(len(mean)), mean - std, mean + std, color=line.get_color(), alpha=0.15, lw=0)
        paired_differences(ax, {arm: runs for (s, arm), runs in curves.items() if s == suite and "decider" not in arm},
                           colors)
        ax.set_title({"hd": "HD (hd suite)", "tah": "TaH on lookups (tah suite)"}.get(suite, f"{suite} suite"),
                     fontsize=9)
        ax.set_xlabel("step of the arm's stage")
        ax.set_ylabel("train loss, next-token CE (nats)")
        if bce is not None:
            bce.set_ylabel("decider BCE (dashed)")
            bce.legend(fontsize=6, loc="center right")
        ax.legend(fontsize=6, loc="upper right")
    return saved(fig, out_dir / "loss_curves.png")


def paired_differences(ax, arms, colors):
    """An inset: the arms that train equally long on the same batches (3 or more), each minus the
    first, seed by seed, then the mean: where curves that overlap part."""
    by_len = {}
    for arm, runs in arms.items():
        by_len.setdefault(min(map(len, runs)), []).append(arm)
    group = max(by_len.values(), key=len)
    if len(group) < 3:
        return
    base, k = group[0], min(map(len, arms[group[0]]))
    inset = ax.inset_axes([0.42, 0.5, 0.36, 0.3])
    for arm in group[1:]:
        d = [np.convolve(np.subtract(a[:k], b[:k]), np.ones(10) / 10, mode="valid") for a, b in zip(arms[arm], arms[base])]
        inset.plot(np.mean(d, axis=0), lw=1, label=arm, color=colors[arm])
    inset.axhline(0, c="gray", lw=0.5)
    inset.set_title(f"minus {base}, paired by seed", fontsize=6)
    inset.tick_params(labelsize=5)
    inset.legend(fontsize=5)


def plot_sweep(summary, out_dir, eval_set, effects, ends):
    """TaH's compute-accuracy trade-off, a panel per effect: accuracy vs positions iterated (mean
    ± std), the decider's thresholds as a labelled curve, `ends` (Standard, AlwaysThink) as
    points; an inset zooms on the thresholds."""
    panels = {}  # effect -> arm -> metric -> (mean, std)
    for s in summary:
        if s["effect"] in effects:
            panels.setdefault(s["effect"], {}).setdefault(s["arm"], {})[s["metric"]] = (s["mean"], s["std"])
    plt = pyplot()
    if not panels or plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (effect, pts) in zip(axes[0], panels.items()):
        sweep = sorted((v["iterated"], v["acc"], a.rsplit(" ", 1)[-1]) for a, v in pts.items() if a not in ends)
        inset = ax.inset_axes([0.45, 0.1, 0.5, 0.45])
        for on in (ax, inset):
            (x, dx), (y, dy) = zip(*[p[0] for p in sweep]), zip(*[p[1] for p in sweep])
            on.errorbar(x, y, xerr=dx, yerr=dy, fmt="o-", ms=3, capsize=2, lw=1, label="TaH decider, by threshold")
        for (x, _), (y, _), t in sweep:
            inset.annotate(t, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        for arm in ends:
            if arm in pts:
                (x, dx), (y, dy) = pts[arm]["iterated"], pts[arm]["acc"]
                ax.errorbar(x, y, xerr=dx, yerr=dy, fmt="s", capsize=2, label=arm)
        inset.set_title("the thresholds (labelled), zoomed", fontsize=7)
        inset.tick_params(labelsize=6)
        ax.set_title(effect.split("(", 1)[-1].rstrip(")"), fontsize=9)
        ax.set_xlabel("positions iterated (fraction of all positions)")
        ax.set_ylabel(f"answer accuracy ({eval_set}; mean ± std over seeds)")
        ax.legend(fontsize=7, loc="upper left")
    return saved(fig, out_dir / "tah_tradeoff.png")


def plot_trace(trace, names, threshold, path, describe=str):
    """One TaH forward drawn (TaH Figs. 5, 7): p(go on) after pass 1 per token (red: it went on)
    and the threshold; below, the second pass's attention of each token that went on over every
    (position, pass) key."""
    plt = pyplot()
    if plt is None:
        return None
    T = len(names)
    deep = "weights" in trace
    fig, axes = plt.subplots(2 if deep else 1, 1, figsize=(max(8, 0.45 * T), 7 if deep else 3.5), squeeze=False)
    ax = axes[0][0]
    colors = ["tab:red" if d > 1 else "tab:gray" for d in trace["passes"].tolist()]
    ax.bar(range(T), trace["go"].tolist(), color=colors)
    ax.axhline(threshold, ls="--", c="k", lw=1, label=f"threshold {threshold} (red: went on)")
    ax.set_xticks(range(T), names, rotation=90, fontsize=8)
    ax.set_ylabel("p(go on) after pass 1")
    ax.legend(fontsize=7)
    if deep:
        ax = axes[1][0]
        w = trace["weights"].float().cpu().numpy()
        keys = [f"{p}.{d + 1}" for p, d in zip(trace["key_pos"].tolist(), trace["key_depth"].tolist())]
        im = ax.imshow(w, aspect="auto", cmap="viridis", vmin=0)
        fig.colorbar(im, ax=ax, label="attention weight")
        ax.set_xticks(range(len(keys)), [f"{names[int(k.split('.')[0])]} {k}" for k in keys], rotation=90,
                      fontsize=7)
        ax.set_yticks(range(w.shape[0]), [f"{names[q]} ({q}.2): {describe(trace['first'][q].item())} -> "
                                          f"{describe(trace['final'][q].item())}"
                                          for q in trace["query_pos"].tolist()], fontsize=8)
        ax.set_xlabel("key: token, position.pass")
        ax.set_ylabel("query (position.pass): top-1 after pass 1 -> pass 2", fontsize=8)
        ax.set_title("second pass: attention of each token that went on (duo-causal, mean over heads)", fontsize=9)
    return saved(fig, path)


def plot_streams(summary, out_dir, cosine, mass, head):
    """HD's streams (Figs. 6, 7), mean ± std over seeds: (a) the cosine of two streams per layer,
    same and different tokens; (b) the final stream's attention mass per stream (largest n);
    (c) how often an earlier stream's top-1 differs from the final's; (d) each stream's entropy."""
    plt = pyplot()
    stats = {(s["effect"], s["arm"], s["metric"]): (s["mean"], s["std"]) for s in summary}
    ran = [n for n in cosine if any(k[0] == cosine[n] for k in stats)]
    if plt is None or not ran:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for n in ran:
        for arm, ls in (("same token", "-"), ("different tokens", ":")):
            pts = [(m, v) for (e, a, m), v in stats.items() if e == cosine[n] and a == arm and m != "where the gap is least"]
            axes[0].errorbar([m for m, _ in pts], [v[0] for _, v in pts], yerr=[v[1] for _, v in pts], ls=ls,
                             marker="o", ms=3, capsize=2, label=f"n={n}, {arm}")
    axes[0].set_xlabel("layer input")
    axes[0].set_ylabel("mean cosine of two streams")
    axes[0].set_title("(a) streams of one token vs of different tokens", fontsize=9)
    n = max(ran)
    layers = list(dict.fromkeys(a for (e, a, m) in stats if e == mass[n]))
    streams = list(dict.fromkeys(m for (e, a, m) in stats if e == mass[n]))
    width = 0.8 / max(1, len(layers))
    for j, layer in enumerate(layers):
        axes[1].bar([k + j * width for k in range(len(streams))], [stats[(mass[n], layer, m)][0] for m in streams],
                    width, yerr=[stats[(mass[n], layer, m)][1] for m in streams], capsize=2, label=layer)
    axes[1].set_xticks([k + 0.4 - width / 2 for k in range(len(streams))], streams, fontsize=8)
    axes[1].set_xlabel("key stream")
    axes[1].set_ylabel("attention mass of final-stream queries")
    axes[1].set_title(f"(b) n={n}: what the final stream reads", fontsize=9)
    for ax, metric, what in ((axes[2], "top-1 differs from the final stream's", "earlier streams"),
                             (axes[3], "entropy (bits)", "every stream")):
        for n in ran:
            arms = [a for (e, a, m) in stats if e == head[n] and m == metric and a.startswith("stream")]
            arms = [a for a in arms if metric.startswith("entropy") or "final" not in a]  # (c): the final stream is 0
            ks = [int(a.split()[1]) for a in arms]
            ax.errorbar(ks, [stats[(head[n], a, metric)][0] for a in arms], yerr=[stats[(head[n], a, metric)][1]
                        for a in arms], marker="o", ms=3, capsize=2, label=f"n={n}")
        ax.set_xticks(range(max(ran) - (metric.startswith("top-1"))))
        ax.set_xlabel(f"stream k ({what}; stream n-1 is the final one)")
    axes[2].set_ylim(0, 1)
    axes[2].set_ylabel("share of positions: top-1 differs from the final stream's")
    axes[2].set_title("(c) an earlier stream's prediction against the final one's", fontsize=9)
    axes[3].ticklabel_format(axis="y", useOffset=False)
    axes[3].set_ylabel("LM-head entropy (bits)")
    axes[3].set_title("(d) the shared head's entropy on each stream", fontsize=9)
    for ax in axes:
        ax.legend(fontsize=7)
    axes[0].tick_params(axis="x", labelsize=7)
    return saved(fig, out_dir / "hd_streams.png")


class Kept:
    """What an experiment keeps of its first seed with the run (trainer.Context.keep, given by
    lab/runner.py): its markdown text as <run>/inside/<name>, and a TaH trace (picture: the
    arguments of plot_trace) drawn beside it as a .png; written by rank 0."""

    def __call__(self, ctx, name, text, picture=None):
        if rank_world()[0] != 0:
            return
        (ctx.run_dir / "inside").mkdir(exist_ok=True)
        atomic(ctx.run_dir / "inside" / name, lambda f: f.write(text.encode()))
        if picture is not None:
            plot_trace(**picture, path=ctx.run_dir / "inside" / Path(name).with_suffix(".png"))


def plot_hd_streams(summary, out, ns):
    """HD's streams figure (plot_streams) over the n > 1 of ns, from the probes' rows (hd_experiment.py)."""
    effects = {n: hd_effects(n) for n in ns if n > 1}
    return plot_streams(summary, out, *({n: getattr(e, f).name for n, e in effects.items()} for f in HDInside._fields))


def plot_tah_tradeoff(summary, out, eval_set):
    """Every TaH task's threshold sweep in the rows, one panel each; its two ends (Standard,
    AlwaysThink) are its arms that are no threshold of the decider."""
    sweeps = list(dict.fromkeys(s["effect"] for s in summary if s["effect"].startswith("TaH: decider threshold")))
    ends = tuple(dict.fromkeys(s["arm"] for s in summary if s["effect"] in sweeps and "threshold" not in s["arm"]))
    return plot_sweep(summary, out, eval_set, sweeps, ends)


def copy_tah_problem(run_dir, out):
    """The traced TaH problem's picture, kept with the run (lab/files.py's Kept), copied out beside the report."""
    trace = run_dir / "inside" / "tah_problem.png"
    return shutil.copyfile(trace, out / trace.name) if trace.exists() else None


# -----------------------------------------------------------------------------
# The masks as one picture (README): HD Figure 3's three masks and TaH's duo-causal mask (Eq. 5)


def mask_panels(n=2, L=4, window=3, depths=(1, 2, 1, 2)):
    """[(title, mask (queries, keys), row labels, column labels)] from the mask functions: hd.py's
    full, local and intra (row "2b": token 2, stream b) and tah.py's duo_causal (row "2.2": token
    2, pass 2), its states in the order a forward appends them."""
    import torch
    from hd import full, intra, local
    from moe import dense_mask
    from tah import dense_batch_mask, duo_causal
    t = torch.arange(n * L)
    hd_names = [f"{i}{'abcdefgh'[k]}" for i in range(L) for k in range(n)]
    panels = [(f"HD {name}", dense_mask(mod, t, t), hd_names, hd_names) for name, mod in
              (("F: full", full), (f"L: local, window {window}", local(window)), ("I: intra-stream", intra(n)))]
    states = [(i, d) for d in range(max(depths)) for i, D in enumerate(depths) if D > d]
    pos, dep = (torch.tensor([s[j] for s in states])[None] for j in (0, 1))
    mod = duo_causal(pos, dep, pos, dep, torch.ones_like(pos, dtype=torch.bool))
    names = [f"{i}.{d + 1}" for i, d in states]  # token.pass
    return panels + [(f"TaH duo-causal, passes {list(depths)}", dense_batch_mask(mod, 1, len(states), len(states),
                                                                                    "cpu")[0, 0], names, names)]


def draw_masks(panels):
    """The panels (mask_panels) side by side, a dark cell where the query (row) sees the key
    (column): a matplotlib figure, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6), squeeze=False)
    for ax, (title, m, rows, cols) in zip(axes[0], panels):
        ax.imshow(np.asarray(m, dtype=float), cmap="Greys", vmin=0, vmax=1)
        ax.set_xticks(range(len(cols)), cols, fontsize=7, rotation=90)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key", fontsize=8)
    axes[0][0].set_ylabel("query", fontsize=8)
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(facecolor="black", label="the query may attend to the key"),
                        Patch(facecolor="white", edgecolor="gray", label="masked")],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def plot_masks(path):
    """The README's picture of the masks (docs/masks.png) at `path`: `python -m lab.figures --docs` draws it."""
    fig = draw_masks(mask_panels())
    if fig is None:
        return None
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def main(argv=None):
    """python -m lab.figures: the masks figure into --out (a folder, made if missing), or with --docs
    into docs/ (the README's); one line for what it cannot honour."""
    import argparse
    ap = argparse.ArgumentParser(description="Draw the masks figure (HD Fig. 3's masks, TaH's duo-causal mask) "
                                             "from the mask functions themselves.")
    ap.add_argument("--out", help="the folder masks.png goes to (default: out)")
    ap.add_argument("--docs", action="store_true", help="rewrite the README's docs/masks.png instead")
    a = ap.parse_args(argv)
    if a.docs and a.out is not None:
        ap.error("--docs writes docs/masks.png: give --docs or --out, not both")
    if a.out is not None and not a.out.strip():
        ap.error("--out must name a folder")
    out = Path("docs" if a.docs else "out" if a.out is None else a.out)
    if out.exists() and not out.is_dir():
        ap.error(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        print(plot_masks(out / "masks.png") or "matplotlib is not installed: nothing drawn")
    except OSError as e:
        raise SystemExit(f"error: {e.strerror or e} ({e.filename or out}): masks.png is not written")


if __name__ == "__main__":
    main()
