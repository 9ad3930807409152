"""
The verdicts and the report of train_tiny.py, from result rows alone.

A row is {effect, effect_id, paper, arm, arm_id, metric, seed, value}: an Effect and an Arm each
have an identifier, which claims match on, and a label, which the tables show. A Claim says an
arm differs from a baseline (another arm, or a target number) in one metric with the paper's
sign; one rule (RULE) on the per-seed paired differences says "shown" or "not shown". The report is one markdown table per
effect (mean ± std over seeds and the difference to the effect's first arm, paired by seed),
the verdicts, and two plots (with matplotlib): the training loss curves and TaH's
compute-accuracy trade-off.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks import atomic


@dataclass(frozen=True)
class Effect:
    """One comparison of the report, with the paper's figure it is set against. `id` is what
    claims match rows on; `name` is the caption, free to change."""
    id: str
    name: str
    paper: str


@dataclass(frozen=True)
class Arm:
    """One arm of an effect: `id` is what claims match rows on; `label` is what the tables show."""
    id: str
    label: str


def result_rows(effect, arm, seed, metrics):
    """One row per metric of one arm's results in one seed."""
    if not (isinstance(effect, Effect) and isinstance(arm, Arm)):
        raise TypeError(f"result_rows takes an Effect and an Arm, got {type(effect).__name__} and {type(arm).__name__}")
    return [dict(effect=effect.name, effect_id=effect.id, paper=effect.paper, arm=arm.label, arm_id=arm.id, metric=m,
                 seed=seed, value=v) for m, v in metrics.items()]


@dataclass
class Claim:
    """The paper says `arm` differs from `baseline` (another Arm, or a target number) in `metric`
    with sign `sign` (+1: higher)."""
    name: str
    effect: Effect
    arm: Arm
    baseline: object
    metric: str
    sign: int
    margin: float = 0.0  # a non-inferiority claim: the arm may fall short of the baseline by this much

    def __post_init__(self):
        if not (isinstance(self.effect, Effect) and isinstance(self.arm, Arm)
                and isinstance(self.baseline, (Arm, int, float))):
            raise TypeError(f"claim {self.name!r}: an Effect, an Arm and a baseline Arm or number, got "
                            f"{type(self.effect).__name__}, {type(self.arm).__name__}, {type(self.baseline).__name__}")


RULE = ("shown: over >= 2 seeds, the paired difference has the paper's sign in every seed and its mean "
        "exceeds twice its standard deviation across seeds; otherwise not shown")


def verdict(deltas, sign):
    """The one rule (RULE) on per-seed paired differences arm - baseline (finite real numbers, one
    per seed) and the paper's direction (+1 or -1). Under 2 seeds nothing is shown."""
    if type(sign) is not int or sign not in (1, -1):
        raise ValueError(f"sign must be the int +1 or -1 (the paper's direction), got {sign!r}")
    d = finite_reals(deltas, "deltas")
    if len(d) < 2:
        return "not shown"
    right_sign = np.all(np.sign(d) == sign)
    return "shown" if right_sign and abs(d.mean()) > 2 * d.std(ddof=1) else "not shown"


def finite_reals(values, name):
    """values as a 1-D float array, or one line saying why they are not finite real numbers in one
    dimension (a string, a bool, a nested list, nan or inf)."""
    if isinstance(values, np.ndarray):
        ok = values.ndim == 1 and values.dtype.kind in "fiu"
    else:
        ok = isinstance(values, (list, tuple)) and all(
            isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) for v in values)
    if not ok or not np.all(np.isfinite(np.asarray(values, dtype=float))):
        raise ValueError(f"{name} must be finite real numbers in one dimension, got {values!r}")
    if len(values) == 0:
        raise ValueError(f"{name} is empty: there is nothing to judge")
    return np.asarray(values, dtype=float)


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}  # Student's t, 97.5% quantile, by degrees of freedom


def interval95(deltas):
    """The 95% confidence interval of the mean paired difference (Student's t, n - 1 degrees of
    freedom; 1.96 beyond 30), or None under 2 seeds. Beside the rule, not part of it."""
    d = np.asarray(deltas, dtype=float)
    if len(d) < 2 or not np.all(np.isfinite(d)):
        return None
    return t_interval(d.mean(), d.std(ddof=1), len(d))


def t_interval(mean, std, n):
    """mean ± the t quantile (n - 1 degrees of freedom) times std / sqrt(n)."""
    half = T975.get(n - 1, 1.96) * std / np.sqrt(n)
    return float(mean - half), float(mean + half)


def pooled(runs):
    """A claim over a grid of cells, from its runs: runs = [(machine, seed, delta)], every cell's
    per-seed paired differences. One value per (machine, seed): a run that repeats another to
    the last digit (TaH at 1 and 2 threads) is counted once, and different runs of one
    (machine, seed) (HD at another thread count) are averaged first, since they share the
    seed's initialization and batches. Returns N (the (machine, seed)s), the mean, the std and
    the 95% interval (t, N - 1 degrees of freedom)."""
    if not runs:
        raise ValueError("pooled needs at least one (machine, seed, delta) run: the pool is empty")
    units = {}
    for machine, seed, d in runs:
        units.setdefault((machine, seed), set()).add(float(finite_reals([d], "a run's delta")[0]))
    v = [float(np.mean(sorted(ds))) for ds in units.values()]
    return dict(n=len(v), mean=float(np.mean(v)), std=float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
                interval95=interval95(v))


def pooled_cells(cells):
    """pooled's numbers when only each cell's (n, mean, std over its seeds) is known, the cells
    distinct runs of distinct (machine, seed)s (a cell that repeats another is given once)."""
    n = sum(k for k, _, _ in cells)
    mean = sum(k * m for k, m, _ in cells) / n
    ss = sum((k - 1) * s ** 2 + k * (m - mean) ** 2 for k, m, s in cells)
    std = float(np.sqrt(ss / (n - 1)))
    return dict(n=n, mean=float(mean), std=std, interval95=t_interval(mean, std, n))


def claim_deltas(rows, claim):
    """Per-seed differences for a claim, from the rows, matched by the effect's and arms' ids."""
    val = {(r["arm_id"], r["metric"], r["seed"]): r["value"] for r in rows if r["effect_id"] == claim.effect.id}
    arm, m = claim.arm.id, claim.metric
    seeds = sorted({s for (a, _, s) in val if a == arm})
    if not isinstance(claim.baseline, Arm):  # a target number
        return [val[(arm, m, s)] - claim.baseline for s in seeds if (arm, m, s) in val]
    base = claim.baseline.id
    return [val[(arm, m, s)] - val[(base, m, s)] for s in seeds if (arm, m, s) in val and (base, m, s) in val]


def judge(rows, claims):
    """Every claim whose effect has rows (its suite ran), by the rule. A claim whose effect ran
    but whose arms have no rows is a bug (an arm renamed on one side): an error, not a skip."""
    out, ran = [], {r["effect_id"] for r in rows}
    for c in claims:
        if c.effect.id not in ran:
            continue
        d = claim_deltas(rows, c)
        if not d:
            raise ValueError(f"claim {c.name!r} finds no {c.metric!r} rows of arm {c.arm.id!r} against "
                             f"{getattr(c.baseline, 'id', c.baseline)!r} in effect {c.effect.id!r}")
        out.append(dict(claim=c.name, metric=c.metric, deltas=d, mean=float(np.mean(d)),
                        std=float(np.std(d, ddof=1)) if len(d) > 1 else 0.0, interval95=interval95(d),
                        verdict=verdict([x + c.sign * c.margin for x in d], c.sign) if np.all(np.isfinite(d))
                        else "not shown"))  # a seed without a value (a rate over no tokens) shows nothing
    return out


# -----------------------------------------------------------------------------
# Tables and plots


def summarize(rows):
    """Group rows into (effect, arm, metric) -> mean, std over seeds, and the difference to the
    effect's first arm paired by seed (same seed = same init and batches, so the pairing
    removes most of the seed-to-seed spread)."""
    groups, first_arm, paper = {}, {}, {}
    for r in rows:
        groups.setdefault((r["effect"], r["arm"], r["metric"]), {})[r["seed"]] = r["value"]
        first_arm.setdefault(r["effect"], r["arm"])
        paper.setdefault(r["effect"], r.get("paper", ""))
    out = []
    for (effect, arm, metric), by_seed in groups.items():
        v = finite(by_seed.values())
        mean, std = mean_std(v)
        s = dict(effect=effect, paper=paper[effect], arm=arm, metric=metric, mean=mean, std=std, n=len(v),
                 seeds=len(by_seed), values=by_seed)
        ref = groups.get((effect, first_arm[effect], metric))
        if arm != first_arm[effect] and ref:
            d = finite(by_seed[k] - ref[k] for k in by_seed if k in ref)
            if len(d):
                s["delta_mean"], s["delta_std"] = mean_std(d)
        out.append(s)
    order = {e: i for i, e in enumerate(dict.fromkeys(r["effect"] for r in rows))}
    return sorted(out, key=lambda s: order[s["effect"]])  # stable: arms keep their order


def finite(values):
    """The finite values: a metric that has no value in a seed (a share of a gain that seed does not
    have, a rate over no tokens) is nan there, and the summary is over the other seeds (the table
    says how many)."""
    v = np.array(list(values), dtype=float)
    return v[np.isfinite(v)]


def mean_std(v):
    """Mean and standard deviation (n - 1) of v; nan for no values, std 0 for one."""
    if not len(v):
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def is_count(metric):
    """Metrics that count tokens (revisions against Standard, a pass's outcomes) print as whole
    numbers, without a difference to the first arm."""
    return "vs Standard" in metric or "->" in metric or metric == "corrected - corrupted"


def fmt(metric, x):
    return f"{x:.0f}" if is_count(metric) else f"{x:.4f}"


def table(summary, verdicts, header):
    """One small table per effect (arms x metrics: mean ± std over seeds, and the difference to
    the effect's first arm paired by seed), then the verdicts."""
    lines = [header]
    effects = dict.fromkeys(s["effect"] for s in summary)
    for effect in effects:
        cells = [s for s in summary if s["effect"] == effect]
        metrics = list(dict.fromkeys(s["metric"] for s in cells))
        arms = list(dict.fromkeys(s["arm"] for s in cells))
        paper = cells[0]["paper"]
        lines += ["", f"**{effect}**" + (f" (paper: {paper})" if paper else ""), "",
                  "| arm | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
        for arm in arms:
            row = []
            for m in metrics:
                s = next((c for c in cells if c["arm"] == arm and c["metric"] == m), None)
                if s is None:
                    row.append("")
                    continue
                if not s["n"]:
                    row.append("no value")
                    continue
                cell = f"{fmt(m, s['mean'])} ± {fmt(m, s['std'])}"
                if "delta_mean" in s and not is_count(m):
                    cell += f" (Δ {s['delta_mean']:+.4f} ± {s['delta_std']:.4f})"
                if s["n"] < s["seeds"]:
                    cell += f" ({s['n']} of {s['seeds']} seeds)"
                row.append(cell)
            lines.append(f"| {arm} | " + " | ".join(row) + " |")
    if verdicts:
        lines += ["", f"**Verdicts** ({RULE}; Δ = arm - baseline, paired by seed)", "",
                  "| claim | metric | Δ mean ± std | mean / std | 95% interval (t) | per seed | verdict |",
                  "|---|---|---|---|---|---|---|"]
        if all(len(v["deltas"]) < 2 for v in verdicts):
            lines[-3] += (" With one seed the rule cannot say shown: every verdict here is \"not shown\" "
                          "whatever the numbers, and decides nothing. Run two seeds or more.")
        for v in verdicts:
            per = ", ".join(f"{d:+.4g}" for d in v["deltas"])
            ratio = f"{abs(v['mean']) / v['std']:.1f}" if v["std"] > 0 else ""
            ci = "[{:+.4g}, {:+.4g}]".format(*v["interval95"]) if v.get("interval95") else ""
            spread = f" ± {v['std']:.4f}" if len(v["deltas"]) > 1 else " (one seed)"
            lines.append(f"| {v['claim']} | {v['metric']} | {v['mean']:+.4f}{spread} | {ratio} | {ci} | {per} | "
                         f"**{v['verdict']}** |")
        lines += ["", "These verdicts are this run's cell (its seeds, thread count and machine). RESULTS.md, \"The grid "
                  "of cells\", reports each headline claim over every cell measured, with a pooled 95% interval."]
    return "\n".join(lines)


def cell(text):
    """A token as a markdown table cell."""
    return "`" + text.replace("\n", "⏎").replace("|", "\\|").replace("`", "'") + "`"


def trace_table(trace, names, describe):
    """One TaH forward (inside.tah_trace) as a markdown table, a row per token: its passes, the
    decider's p(go on) after the first pass, its top-1 after the first pass and after the last."""
    lines = ["| position | token | next | passes | p(go on) after pass 1 | top-1 after pass 1 | top-1 after the last |",
             "|---|---|---|---|---|---|---|"]
    for i, name in enumerate(names):
        nxt = cell(names[i + 1]) if i + 1 < len(names) else ""
        lines.append(f"| {i} | {cell(name)} | {nxt} | {trace['passes'][i].item()} | {trace['go'][i].item():.3f} | "
                     f"{cell(describe(trace['first'][i].item()))} | {cell(describe(trace['final'][i].item()))} |")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot without a screen, or None where matplotlib is missing (no plots)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(curves, out_dir):
    """Training losses, one panel per suite (curves: (suite, arm) -> per-seed loss lists): the
    mean over seeds, 10-step mean, with a band of ± one std over seeds; an inset of the arms that
    train equally long, each minus the first, paired by seed (paired_differences), where curves
    that overlap part; TaH's decider (a BCE, not a next-token loss) on an axis of its own."""
    plt = pyplot()
    if plt is None or not curves:
        return None
    suites = sorted({s for s, _ in curves})
    fig, axes = plt.subplots(1, len(suites), figsize=(5.5 * len(suites), 4.2), squeeze=False)
    for ax, suite in zip(axes[0], suites):
        bce = None
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
            line, = on.plot(mean, label=arm, lw=1, ls="--" if on is bce else "-")
            on.fill_between(range(len(mean)), mean - std, mean + std, color=line.get_color(), alpha=0.15, lw=0)
        paired_differences(ax, {arm: runs for (s, arm), runs in curves.items() if s == suite and "decider" not in arm})
        ax.set_title({"hd": "HD (hd suite)", "tah": "TaH on lookups (tah suite)"}.get(suite, f"{suite} suite"),
                     fontsize=9)
        ax.set_xlabel("step of the arm's stage")
        ax.set_ylabel("train loss, next-token CE (nats)")
        if bce is not None:
            bce.set_ylabel("decider BCE (dashed)")
            bce.legend(fontsize=6, loc="center right")
        ax.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    path = out_dir / "loss_curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def paired_differences(ax, arms):
    """An inset of ax: the arms that train equally long on the same batches (three or more, the
    first of them the baseline), each minus the baseline, seed by seed, then the mean (10-step
    mean): where curves that overlap on the main axes part."""
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
        inset.plot(np.mean(d, axis=0), lw=1, label=arm)
    inset.axhline(0, c="gray", lw=0.5)
    inset.set_title(f"minus {base}, paired by seed", fontsize=6)
    inset.tick_params(labelsize=5)
    inset.legend(fontsize=5)


def plot_sweep(summary, out_dir, eval_set, effects, ends):
    """TaH's compute-accuracy trade-off, one panel per effect in `effects` (one per task):
    answer accuracy (on eval_set) vs positions iterated, mean ± std over seeds, the decider's
    thresholds as a curve with each point labelled, the arms named in `ends` (Standard and
    AlwaysThink) as end points; an inset zooms on the thresholds, which crowd near each other."""
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
    fig.tight_layout()
    path = out_dir / "tah_tradeoff.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_trace(trace, names, threshold, path, describe=str):
    """One TaH forward drawn (TaH Figs. 5 and 7): per token, the decider's probability of going
    on after the first pass (bars, red where the token ran a second pass), the threshold; below,
    the second pass's attention (mean over heads) of each token that went on over every
    (position, pass) key, each query labelled with its top-1 after pass 1 and after pass 2
    (`describe` names a token id)."""
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_streams(summary, out_dir, cosine, mass, head):
    """HD's streams (HD Figs. 6 and 7) from the rows, mean ± std over seeds: (a) cosine of two
    streams per layer, same token and different tokens, per n (effects `cosine`, n -> effect
    name); (b) the final stream's attention mass per stream in each cross-stream layer (the
    largest n, `mass`); (c) how often each earlier stream's top-1 differs from the final
    stream's and (d) each stream's LM-head entropy (`head`)."""
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
    fig.tight_layout()
    path = out_dir / "hd_streams.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -----------------------------------------------------------------------------
# The masks as one picture (README): HD Figure 3's three masks and TaH's duo-causal mask (Eq. 5)


def mask_panels(n=2, L=4, window=3, depths=(1, 2, 1, 2)):
    """[(title, boolean matrix (queries, keys), query labels, key labels)] from the mask functions
    themselves: hd.py's full, local and intra over n streams of L tokens (row "2b": token 2,
    stream b), and tah.py's duo_causal over one row of passes per token (row "2.2": token 2 in
    pass 2), its states ordered pass by pass as a forward appends them."""
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
    """The README's picture of the masks (docs/masks.png) at `path`: `python report.py` draws it."""
    fig = draw_masks(mask_panels())
    if fig is None:
        return None
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


# -----------------------------------------------------------------------------
# The report of a run


def write_report(rows, claims, header, run, out, meta, inside, brief=False):
    """<out>/results.md and results.json (`meta`, then the rule, summary and verdicts) from the
    rows alone, judged by every claim whose effect has rows, with the first seed's analyses kept
    in <run>/inside (`inside`: file -> title). Prints the tables (brief: one line). Returns the
    summary, which the figures read."""
    summary, verdicts = summarize(rows), judge(rows, claims)
    kept = [(f, title) for f, title in inside.items() if (run.run_dir / "inside" / f).exists()]
    md = table(summary, verdicts, header) + "".join(
        f"\n\n**{title}**, seed {run.seeds[0]}\n\n" + (run.run_dir / "inside" / f).read_text() for f, title in kept)
    atomic(out / "results.md", lambda f: f.write((md + "\n").encode()))
    atomic(out / "results.json", lambda f: f.write(json.dumps(
        {**meta, "rule": RULE, "summary": summary, "verdicts": verdicts}, indent=1).encode()))
    shown = f"{sum(v['verdict'] == 'shown' for v in verdicts)} of {len(verdicts)} claims shown"
    print(("\n" + md if not brief else f"\n{len(rows)} rows of {len(summary)} (effect, arm, metric)s; {shown} (a "
           f"plumbing check decides nothing)") + f"\n\nwritten: {out / 'results.md'}, {out / 'results.json'}", flush=True)
    return summary


def main(argv=None):
    """python report.py: the masks figure into --out (a folder, made if missing), or with --docs
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
