"""
plot_suite.py: the mini suite's figures across designs, drawn from one probe folder of mini.py (it runs this after
plot.py):

    python -m depthbench.reports.plot_suite runs/mini/text --out runs/mini/figs/text

- suite_fig2_loss_vs_ar: Figure 2 (left)'s layout, final validation loss vs aspect ratio, one line per design at the
  LR it chose at that shape, the Pre-LN family solid and the cross-layer designs dashed; beside it, each design's loss
  minus Pre-LN's at the same shape, paired by seed (compare.paired, what summary.md reports): the mean of the per-seed
  differences with its 95% t interval as error bars, each seed's difference a dot. The AR ticks name the shapes,
  e.g. "92 (L2)".
- suite_shape_fit: a panel per design, its seeds' losses and their means at each shape, the quadratic in log AR fitted
  to the means (depthbench/reports/shape_fit.py, what summary.md's best-AR table reports), the best AR marked with its
  seed bootstrap interval.
- suite_fig6_depth_use: Figure 6a/c's layout at the deepest shape: R_causal and R_perm (last three quarters), a bar
  per design (the seeds' mean) with each seed a dot of its marker; a design that diverged there is named so. A suite
  of one design draws the same figures (suite_fig2 without its panel relative to Pre-LN when nothing pairs).

It reads what plot.py reads (drawing.load_folder), draws in its look (names, colours) and, like it, imports no torch.
"""
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import matplotlib.pyplot as plt
from matplotlib import transforms

from depthbench.files import common
from depthbench.evaluation import compare
from depthbench.reports import shape_fit
from depthbench.reports import drawing

# the Pre-LN family: one stream, the norms placed within a block (solid lines); the rest mix across layers (dashed)
PRE_LN_FAMILY = ("preln", "sandwich", "lns", "deepnorm", "keel")


@dataclass
class Point:
    """One (design, shape) of the suite, at the LR it chose there."""
    res: str         # the design (a key of residuals.RESIDUALS)
    L: int           # n_layer
    ar: float        # d_model / n_layer, as drawing.shape rounds it
    lr: float        # the chosen LR (common.best_lr over its runs); None when every run diverged
    by_seed: dict    # seed -> final val loss at that LR, None where the seed diverged (every LR's, when lr is None)


def line_style(res):
    return "-" if res in PRE_LN_FAMILY else "--"


def shape_tick(ar, L):
    """An AR tick that names the shape: '92 (L2)', '9.8 (L9)'."""
    text = f"{ar:.0f}" if ar >= 10 else f"{ar:.1f}"
    return f"{text} (L{L})"


def shape_axis(ax, shapes, asked=None):
    """drawing.ar_axis (log, inverted: deeper to the right), ticks written as the shapes {ar: L}, with the --ar asked
    beneath where it differs (asked: drawing.asked_ars)."""
    drawing.ar_axis(ax, list(shapes))
    ars, asked = sorted(shapes), asked or {}
    ticks = [shape_tick(ar, shapes[ar]) for ar in ars]
    for k, ar in enumerate(ars):
        if asked.get(ar):
            ticks[k] += "\n" + drawing.asked_text(asked[ar])
    ax.set_xticks(ars, ticks)
    ax.set_xlabel("aspect ratio d_model / n_layer (depth); deeper →")


def suite_points(runs):
    """{(design, L): Point} of train JSONs: each (design, shape) at its best LR by common.best_lr, the rule of
    mini.py's sweep and plot.fig2_final_loss. An unfinished run is left out (drawing.seed_losses)."""
    groups = {}
    for r in runs:
        res, L, _, ar = drawing.shape(r["config"])
        groups.setdefault((res, L, ar), {}).setdefault(drawing.num(r["config"].get("lr")), []).append(r)
    points = {}
    for (res, L, ar), by_lr in groups.items():
        lr = common.best_lr({lr: drawing.seed_losses(rs) for lr, rs in by_lr.items()})
        chosen = by_lr[lr] if lr is not None else [r for rs in by_lr.values() for r in rs]
        by_seed = {}
        for r in chosen:
            losses = drawing.seed_losses([r])
            if losses:
                by_seed[r["config"].get("seed")] = losses[0]
        points[(res, L)] = Point(res=res, L=L, ar=ar, lr=lr, by_seed=by_seed)
    return points


def relative(points):
    """{(design, L): compare.Paired} of every design but Pre-LN against Pre-LN at the same shape."""
    out = {}
    for (res, L), point in points.items():
        base = points.get(("preln", L))
        if base and res != "preln":
            out[(res, L)] = compare.paired(point.by_seed, base.by_seed)
    return out


def by_design(points):
    """{design: [Point, ...] shallow to deep}, designs in plot's order."""
    out = {}
    for key in sorted(points, key=lambda k: (drawing.design_order(k[0]), k[0], k[1])):
        out.setdefault(key[0], []).append(points[key])
    return out


def draw_losses(ax, points):
    """Left panel: the seeds' mean and range per (design, shape); x at the top for a shape where it diverged at
    every LR. -> the designs marked diverged."""
    top = transforms.blended_transform_factory(ax.transData, ax.transAxes)
    diverged = []
    for res, line in by_design(points).items():
        done = [(p.ar, [v for v in p.by_seed.values() if v is not None]) for p in line if p.lr is not None]
        done = [(ar, ys) for ar, ys in done if ys]
        if done:
            xs, mean = [ar for ar, _ in done], [np.mean(ys) for _, ys in done]
            yerr = [[m - min(ys) for m, (_, ys) in zip(mean, done)], [max(ys) - m for m, (_, ys) in zip(mean, done)]]
            ax.errorbar(xs, mean, yerr=yerr, color=drawing.colour(res), ls=line_style(res), marker="o", capsize=3,
                        label=drawing.display(res))
        for p in line:
            if p.lr is None:
                ax.plot(p.ar, 0.96, "x", color=drawing.colour(res), ms=9, mew=2, transform=top, clip_on=False,
                        label=f"{drawing.display(res)} diverged")
                diverged.append(f"{res}@L{p.L}")
    ax.set(ylabel="final validation loss (nats/token)", title="Final validation loss, each design at its best LR")
    return diverged


def draw_relative(ax, pairs, points):
    """Right panel: per design, the mean of its paired differences from Pre-LN at each shape with its 95% t interval
    as error bars (none where one pair finished), each seed's difference a dot. -> {"design@L<n>": {"mean", "low",
    "high" (the seeds' range), "ci_low", "ci_high" (the interval; None with one pair), "verdict"}}: what it drew."""
    drew = {}
    for res in sorted({k[0] for k in pairs}, key=drawing.design_order):
        keys = sorted((k for k in pairs if k[0] == res and pairs[k].deltas), key=lambda k: points[k].ar)
        if not keys:
            continue
        xs, mean = [points[k].ar for k in keys], [pairs[k].mean for k in keys]
        intervals = [pairs[k].interval or (m, m) for k, m in zip(keys, mean)]
        yerr = [[m - lo for m, (lo, _) in zip(mean, intervals)], [hi - m for m, (_, hi) in zip(mean, intervals)]]
        ax.errorbar(xs, mean, yerr=yerr, color=drawing.colour(res), ls=line_style(res), marker="o", capsize=3,
                    label=drawing.display(res))
        for k, x in zip(keys, xs):
            seeds = list(pairs[k].deltas.values())
            ax.scatter([x] * len(seeds), seeds, color=drawing.colour(res), s=8, alpha=0.5, zorder=3)
            interval = pairs[k].interval or (None, None)
            drew[f"{res}@L{k[1]}"] = {"mean": pairs[k].mean, "low": pairs[k].low, "high": pairs[k].high,
                                      "ci_low": interval[0], "ci_high": interval[1], "verdict": pairs[k].verdict()}
    ax.axhline(0, color=drawing.colour("preln"), lw=1)
    ax.set(ylabel="Δ final val loss vs Pre-LN, same seed (nats/token)",
           title="Relative to Pre-LN at the same shape: paired mean, 95% t interval (dots: seeds)")
    return drew


def fig_suite_loss(data, out_path, svg=False):
    points = suite_points(data.get("train", []))
    if not points:
        return {"skipped": "no train JSON"}
    pairs = relative(points)
    # the panel relative to Pre-LN only where there is a pair: a suite of Pre-LN alone, or without it, has none
    panels, width = (2, 15) if pairs else (1, 8)
    fig, axes = plt.subplots(1, panels, figsize=(width, 5.5), squeeze=False)
    axes = list(axes.flat)
    diverged = draw_losses(axes[0], points)
    drew = draw_relative(axes[1], pairs, points) if pairs else {}
    shapes = {p.ar: p.L for p in points.values()}
    for ax in axes:
        shape_axis(ax, shapes, drawing.asked_ars(data.get("train", [])))
    if diverged:
        axes[0].text(0.01, 0.01, "× at top: diverged at every LR at that shape", transform=axes[0].transAxes)
    designs = len({k[0] for k in points})
    what = f"{designs} design{'s' * (designs > 1)} x {len(shapes)} shapes, {len(drew)} paired points"
    title = "Loss vs aspect ratio across designs (solid: Pre-LN family, dashed: cross-layer)"
    if not pairs:
        title = "Loss vs aspect ratio (no design beside Pre-LN to pair)"
    return drawing.save(fig, out_path, svg, what, title=title, legend=(axes[-1], axes), relative=drew,
                        diverged=diverged)


def seeds_and_lrs(data):
    """{run folder: (seed, lr)} of the train JSONs, to tell which diagnose.json beside them belongs to which."""
    return {Path(r["_path"]).parent: (r["config"].get("seed"), drawing.num(r["config"].get("lr")))
            for r in data.get("train", [])}


def deepest_scores(data, key, field):
    """({design: [(seed, value in %), ...]} at the deepest diagnosed shape, that depth): one value per diagnose JSON
    of a run at its design's chosen LR there (or of no known run)."""
    docs = drawing.with_metric(data, f"{key}.{field}")
    if not docs:
        return {}, None
    deep = max(drawing.shape(g["meta"])[1] for g in docs)
    points, runs = suite_points(data.get("train", [])), seeds_and_lrs(data)
    scores = {}
    for g in docs:
        res, L, _, _ = drawing.shape(g["meta"])
        seed, lr = runs.get(Path(g["_path"]).parent, (None, None))
        chosen = points.get((res, L))
        if L != deep or (chosen and lr is not None and lr != chosen.lr):
            continue
        scores.setdefault(res, []).append((seed, 100 * drawing.num(drawing.metric(g, key).get(field))))
    return scores, deep


def fig_suite_depth_use(data, out_path, svg=False):
    panels = [("causal_score", "R_causal", "R_causal (share of pairs s ≥ ⌈L/4⌉ above threshold)"),
              ("permutation_score", "R_perm", "R_perm (share of pairs i, j ≥ ⌈L/4⌉ above threshold)")]
    if not drawing.with_metric(data, "causal_score.R_causal", "permutation_score.R_perm"):
        return {"skipped": "no diagnose JSON with causal_score.R_causal or permutation_score.R_perm"}
    points = suite_points(data.get("train", []))
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    for ax, (key, field, title) in zip(axes, panels):
        scores, deep = deepest_scores(data, key, field)
        designs = sorted(set(scores) | {r for r, L in points if L == deep}, key=drawing.design_order)
        for i, res in enumerate(designs):
            values = [v for _, v in scores.get(res, []) if math.isfinite(v)]
            if values:
                ax.bar(i, np.mean(values), 0.7, color=drawing.colour(res), alpha=0.75, label=drawing.display(res),
                       hatch=None if res in PRE_LN_FAMILY else "//")
                for seed, v in [(seed, v) for seed, v in scores[res] if math.isfinite(v)]:
                    # each seed a black dot of its marker (drawing.seed_look), named in the legend
                    marker = drawing.seed_look(res, seed)["marker"]
                    ax.scatter([i], [v], color="black", marker=marker, s=14, zorder=3, label=f"seed {seed}")
            else:  # no score: diverged there, or not diagnosed yet
                point = points.get((res, deep))
                why = "diverged" if point and point.lr is None else "no score"
                ax.text(i, 0, why, rotation=90, ha="center", va="bottom", fontsize=8)
            paper = drawing.PAPER_FIG6[field].get(res)
            if paper is not None:
                ax.plot(i, paper, "_", color="black", ms=18, mew=2, label="paper (L32, 8B tokens)")
        ax.set_xticks(range(len(designs)), [drawing.display(r) for r in designs], rotation=40, ha="right")
        pad = max(0.0, (4 - len(designs)) / 2)  # a bar of a one- or two-design suite keeps its width
        ax.set_xlim(-0.5 - pad, len(designs) - 0.5 + pad)
        ax.set(title=f"{title}, L{deep}", ylabel="pairs above threshold (%)")
        ax.grid(axis="y", alpha=0.3)
    what = f"{len(designs)} design{'s' * (len(designs) > 1)} at L{deep}"
    return drawing.save(fig, out_path, svg, what, title="Depth use at the deepest shape, each seed a "
                        "dot (hatched: cross-layer)", legend=(axes[1], axes))


def design_losses(points):
    """{design: {AR: its finished seeds' final val losses in seed order}} at each shape's chosen LR, designs in
    plot's order: what shape_fit.fit_design takes (summary.md's best-AR table reads the same runs)."""
    out = {}
    for res, line in by_design(points).items():
        for p in line:
            if p.lr is not None:
                out.setdefault(res, {})[p.ar] = [p.by_seed[s] for s in sorted(p.by_seed) if compare.finite(p.by_seed[s])]
    return out


def draw_fit(ax, res, fit, losses):
    """One design's panel: each seed a dot, the seeds' mean a marker, the fitted quadratic over the measured ARs, the
    best AR a dotted line in its shaded 95% interval."""
    colour = drawing.colour(res)
    for ar, values in losses.items():
        ax.scatter([ar] * len(values), values, color=colour, s=10, alpha=0.5)
    ax.plot(fit.ars, fit.means, "o", color=colour, ms=6)
    xs = np.geomspace(fit.ars[0], fit.ars[-1], 100)
    ax.plot(xs, np.polyval(fit.coef, np.log(xs)), color=colour, ls=line_style(res))
    ax.axvspan(fit.low, fit.high, color=colour, alpha=0.15)
    ax.axvline(fit.best_ar, color="black", ls=":", lw=1)
    ax.set_title(f"{drawing.display(res)}: best AR {fit.best_text()}", fontsize=9)


def fig_suite_shape_fit(data, out_path, svg=False):
    points = suite_points(data.get("train", []))
    fits = {}
    for res, losses in design_losses(points).items():
        fit = shape_fit.fit_design(losses)
        if fit:
            fits[res] = (fit, losses)
    if not fits:
        return {"skipped": "no design with three shapes of finished runs"}
    fig, axes = drawing.grid(len(fits), ncols=5, w=3.4, h=3.0)
    shapes = {p.ar: p.L for p in points.values()}
    for k, (ax, (res, (fit, losses))) in enumerate(zip(axes, fits.items())):
        draw_fit(ax, res, fit, losses)
        shape_axis(ax, {ar: shapes[ar] for ar in fit.ars})
        ax.tick_params(axis="x", labelsize=6)
        ax.set_xlabel("aspect ratio; deeper →", fontsize=8)
        if k % 5 == 0:
            ax.set_ylabel("final val loss", fontsize=8)
    drew = {res: {"best_ar": fit.best_ar, "where": fit.where, "low": fit.low, "high": fit.high,
                  "curvature": fit.curvature} for res, (fit, _) in fits.items()}
    return drawing.save(fig, out_path, svg, f"{len(fits)} designs fitted", fits=drew,
                        title="Loss vs log aspect ratio, a quadratic per design: the best AR (dotted) and its seed "
                        "bootstrap 95% interval (shaded)")


FIGURES = [("suite_fig2_loss_vs_ar", fig_suite_loss), ("suite_fig6_depth_use", fig_suite_depth_use),
           ("suite_shape_fit", fig_suite_shape_fit)]


def main(argv=None):
    return drawing.main(argv, FIGURES, "depthbench.reports.plot_suite")


if __name__ == "__main__":
    sys.exit(main())
