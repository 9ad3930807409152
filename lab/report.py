"""
The report of train_tiny.py, from result rows alone (their vocabulary, Effect, Arm, Claim and
result_rows, is experiment.py's, beside the rule): the tables (a markdown table per effect: mean ± std over seeds, the paired difference
to its first arm), the verdicts' table (judged by experiment.judge), the 95% intervals, and claims
pooled over a grid of cells (RESULTS.md).

A row is {effect, effect_id, paper, arm, arm_id, metric, seed, value}; claims match on the ids,
the tables show the labels.
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/report.py is no script: run python train_tiny.py (it writes the report); python -m lab.figures draws the masks", file=sys.stderr)
    sys.exit(2)

import json

import numpy as np
import torch

from hd import attention_path
from lab.files import atomic


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}  # Student's t, 97.5% quantile, by degrees of freedom


def interval95(deltas):
    """The 95% interval of the mean paired difference (Student's t), or None under 2 seeds."""
    d = np.asarray(deltas, dtype=float)
    if len(d) < 2 or not np.all(np.isfinite(d)):
        return None
    return t_interval(d.mean(), d.std(ddof=1), len(d))


def t_interval(mean, std, n):
    """mean ± the t quantile (n - 1 degrees of freedom) times std / sqrt(n)."""
    half = T975.get(n - 1, 1.96) * std / np.sqrt(n)
    return float(mean - half), float(mean + half)


def pooled(runs):
    """A claim pooled over a grid of cells: runs = [(machine, seed, delta)]. One value per (machine,
    seed): a run repeating another to the last digit counts once, different runs of one (machine,
    seed) (another thread count: the same init and batches) are averaged. Returns n, mean, std and
    the 95% interval (t, n - 1 degrees of freedom)."""
    if not isinstance(runs, (list, tuple)) or not all(isinstance(r, tuple) and len(r) == 3 for r in runs):
        raise ValueError(f"pooled takes a list of (machine, seed, delta) triples, got {runs!r}"[:300])
    if not runs:
        raise ValueError("pooled needs at least one (machine, seed, delta) run: the pool is empty")
    units = {}
    for machine, seed, d in runs:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, float, np.integer, np.floating)) \
                or not np.isfinite(d):
            raise ValueError(f"pooled's deltas must be finite real numbers, got {d!r}")
        units.setdefault((machine, seed), set()).add(float(d))
    with np.errstate(over="ignore"):
        v = [float(np.mean(sorted(ds))) for ds in units.values()]
        mean, std = float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
    if not (np.isfinite(v).all() and np.isfinite(mean) and np.isfinite(std)):
        raise ValueError(f"pooled's deltas overflow a float's range (mean {mean}, std {std}): a mean that overflowed is no "
                         "interval, as it is no verdict")
    return dict(n=len(v), mean=mean, std=std, interval95=interval95(v))


def pooled_cells(cells):
    """pooled's numbers when only each cell's (n, mean, std over its seeds) is known, the cells
    distinct runs of distinct (machine, seed)s (a cell that repeats another is given once)."""
    n = sum(k for k, _, _ in cells)
    mean = sum(k * m for k, m, _ in cells) / n
    ss = sum((k - 1) * s ** 2 + k * (m - mean) ** 2 for k, m, s in cells)
    std = float(np.sqrt(ss / (n - 1)))
    return dict(n=n, mean=float(mean), std=std, interval95=t_interval(mean, std, n))


# -----------------------------------------------------------------------------
# Tables


def summarize(rows):
    """(effect, arm, metric) -> mean and std over seeds, and the difference to the effect's first
    arm paired by seed (same seed: same init and batches, so most of the spread cancels)."""
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
    """The finite values: a metric with no value in a seed is nan there, left out (the table says)."""
    v = np.array(list(values), dtype=float)
    return v[np.isfinite(v)]


def mean_std(v):
    """Mean and standard deviation (n - 1) of v; nan for no values, std 0 for one."""
    if not len(v):
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def is_count(metric):
    """Metrics that count tokens print as whole numbers, without a difference to the first arm."""
    return "vs Standard" in metric or "->" in metric or metric == "corrected - corrupted"


def fmt(metric, x, sign=""):
    """Counts as whole numbers, large values (FLOPs) in 4 significant digits, the rest to 4 decimals;
    sign "+": the sign always written."""
    return f"{x:{sign}.0f}" if is_count(metric) else f"{x:{sign}.4g}" if abs(x) >= 1e5 else f"{x:{sign}.4f}"


def table(summary, verdicts, header, rule):
    """One table per effect (mean ± std over seeds, the paired difference to its first arm), then
    the verdicts."""
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
                    cell += f" (Δ {fmt(m, s['delta_mean'], '+')} ± {fmt(m, s['delta_std'])})"
                if s["n"] < s["seeds"]:
                    cell += f" ({s['n']} of {s['seeds']} seeds)"
                row.append(cell)
            lines.append(f"| {arm} | " + " | ".join(row) + " |")
    if verdicts:
        lines += ["", f"**Verdicts** ({rule}; Δ = arm - baseline, paired by seed)", "",
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


# -----------------------------------------------------------------------------
# How a run's models attend, said in its first lines


PATHS = {"fold": "streams folded, causal kernel", "causal": "causal kernel", "block": "flex block mask",
         "dense": "dense mask"}


def describe(cfg, device):
    """How each layer of the HD model `cfg` attends on this device (hd.attention_path), and TaH's mask."""
    n = cfg.n_streams
    skip = cfg.mirrored.start if cfg.mirror_skip_on else None
    dev = torch.device(device)
    layers = [f"{i} {letter}: {PATHS[attention_path(cfg, i, skip is not None and i >= skip, dev)]}"
              + (" (final stream only)" if skip is not None and i >= skip else "") for i, letter in enumerate(cfg.layout)]
    return f"HD n = {n} attention by layer: {'; '.join(layers)}. TaH: dense masks (duo-causal)"


# -----------------------------------------------------------------------------
# The report of a run


def write_report(rows, verdicts, out, *, header, rule, meta, inside, first_seed, brief=False):
    """<out>/results.md and results.json (meta, the rule, summary, verdicts) from the rows and their
    verdicts, with the first seed's analyses (`inside`: path -> title, those that exist); prints
    the tables (brief: one line). Returns the summary, which the figures read."""
    verdicts = [{**{k: v for k, v in j.items() if k != "verdict"}, "interval95": interval95(j["deltas"]),
                 "verdict": j["verdict"]} for j in verdicts]  # each judged claim with its 95% interval
    summary = summarize(rows)
    md = table(summary, verdicts, header, rule) + "".join(
        f"\n\n**{title}**, seed {first_seed}\n\n" + path.read_text() for path, title in inside.items()
        if path.exists())
    atomic(out / "results.md", lambda f: f.write((md + "\n").encode()))
    atomic(out / "results.json", lambda f: f.write(json.dumps(
        {**meta, "rule": rule, "summary": summary, "verdicts": verdicts}, indent=1).encode()))
    shown = f"{sum(v['verdict'] == 'shown' for v in verdicts)} of {len(verdicts)} claims shown"
    print(("\n" + md if not brief else f"\n{len(rows)} rows of {len(summary)} (effect, arm, metric)s; {shown} (a "
           f"plumbing check decides nothing)") + f"\n\nwritten: {out / 'results.md'}, {out / 'results.json'}", flush=True)
    return summary
