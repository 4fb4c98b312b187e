"""
plot.py: draw the DepthBench figures from the JSON that train.py, diagnose.py and profile_gpu.py write.

    python plot.py runs/ --out figs/          # every figure the folder's JSON supports (--svg: SVGs too)

It reads RUNS_DIR/**/*.json, recognises each file by its "schema" field ("name/version"), draws what it
can, then lists what it drew and what it skipped, and why. No torch here: plotting works on any machine
that has the JSON, numpy and matplotlib.

A figure is fig_xxx(data, out_path, svg=False), data = {"train": [run, ...], "diagnose": [...], "profile": [...]}
(each dict also carries its file path in "_path"). It writes out_path and returns {"drew": "what, in words", ...},
or writes nothing and returns {"skipped": "reason"}. FIGURES at the bottom lists them in paper order for main().
What every figure shares (the JSON schemas, each design's name and colour, the panel helpers, the command line's
loop) is depthbench/reports/drawing.py; the other figures are depthbench/reports/plot_*.py.
"""
import math
import sys

import numpy as np
import matplotlib
matplotlib.use("Agg")  # files only, never a window: works headless, in tests and over ssh
import matplotlib.pyplot as plt
from matplotlib import ticker, transforms

from depthbench.files import common
from depthbench.reports import drawing
from depthbench.reports.drawing import (BYTE_UNITS, CAUSAL_CMAP, FLOP_UNITS, PAPER_FIG6, PERM_CMAP, STYLES, ar_axis,
                                        by_design, colour, design_order, display, grid, heatmap, label, matrix, metric,
                                        num, overlay, per_model, save, seed_losses, shape, unit, with_metric)
from depthbench.reports.plot_eval import fig_dense_weights, fig_token_collapse, fig_zeroshot  # drawn in plot_eval.py


# ----------------------------------------------------------------------------- Fig. 2: loss vs aspect ratio

def fig2_final_loss(data, out_path, svg=False):
    runs = data.get("train", [])
    if not runs:
        return {"skipped": "no train JSON"}
    groups = {}  # (design, AR) -> LR -> runs (the seeds)
    for r in runs:
        res, _, _, ar = shape(r["config"])
        groups.setdefault((res, ar), {}).setdefault(num(r["config"].get("lr")), []).append(r)
    best_lr, points = {}, {}
    for (res, ar), by_lr in groups.items():
        # the point of a (design, AR) is its best LR's seeds: common.best_lr, the choice mini.py makes too
        losses = {lr: seed_losses(rs) for lr, rs in by_lr.items()}
        lr = common.best_lr(losses)
        if lr is not None:
            best_lr[f"{res}@{ar:g}"] = lr
            points[(res, ar)] = [v for v in losses[lr] if v is not None]
    fig, ax = plt.subplots(figsize=(8, 5))
    own_lr = len(set(best_lr.values())) > 1  # each point at its own LR (mini.py's protocol): say which
    for res, (xs, mean, lo, hi) in by_design(points).items():
        yerr = [np.subtract(mean, lo), np.subtract(hi, mean)]  # min-max over seeds
        ax.errorbar(xs, mean, yerr=yerr, color=colour(res), marker="o", capsize=3, label=display(res))
        for x, m in zip(xs, mean):  # every seed as a faint dot, so "3 seeds agree" and "1 seed" look different
            ax.scatter([x] * len(points[(res, x)]), points[(res, x)], color=colour(res), s=10, alpha=0.4)
            if own_lr:
                ax.annotate(f"{best_lr[f'{res}@{x:g}']:g}", (x, m), xytext=(3, 3), textcoords="offset points",
                            fontsize=7, color=colour(res))
    # a diverged run has no loss to plot: an x at the top of the axis at its AR (any LR) marks it,
    # stacked downwards when several designs diverged at the same AR
    diverged, stack = [], {}
    top = transforms.blended_transform_factory(ax.transData, ax.transAxes)
    for r in sorted(runs, key=lambda r: design_order(r["config"]["residual"])):
        if r.get("diverged"):
            res, _, _, ar = shape(r["config"])
            k = stack.setdefault(ar, {}).setdefault(res, len(stack[ar]))
            ax.plot(ar, 0.96 - 0.04 * k, "x", color=colour(res), ms=9, mew=2, transform=top, clip_on=False,
                    label=f"{display(res)} diverged")
            diverged.append(r["_path"])
    if diverged:
        ax.text(0.01, 0.01, "× at top: a run that diverged (any LR) at that shape", transform=ax.transAxes)
    ar_axis(ax, [ar for _, ar in groups], drawing.asked_ars(runs))
    budgets = {b for b in (num(r["config"].get("params_budget")) for r in runs) if math.isfinite(b)}
    fixed = {r["config"].get("fixed", "total") for r in runs}      # what the budget counts (train.py --fixed)
    what = f"{fixed.pop()} " if len(fixed) == 1 else ""
    budget = f" (budget {budgets.pop() / 1e6:.3g}M {what}params)" if len(budgets) == 1 else ""
    ax.set(ylabel="final validation loss (nats/token)", title=f"Final validation loss vs aspect ratio{budget}")
    unfinished = sum(not r.get("finished", True) and not r.get("diverged") for r in runs)
    return save(fig, out_path, svg, f"{len(points)} (design, AR) points from {len(runs)} runs, {len(diverged)} "
                f"diverged run(s) marked, {unfinished} unfinished left out", legend=(ax, [ax]), best_lr=best_lr,
                diverged=diverged)


def fig2_loss_curves(data, out_path, svg=False):
    runs = [r for r in data.get("train", []) if r.get("steps")]
    if not runs:
        return {"skipped": "no train JSON with steps"}
    groups = {}  # one panel per (design, shape), all LRs and seeds in it
    for r in runs:
        res, L, d, ar = shape(r["config"])
        groups.setdefault((design_order(res), -ar, res, L, d, ar), []).append(r)
    fig, axes = grid(len(groups))
    diverged = []
    for ax, key in zip(axes, sorted(groups)):
        _, _, res, L, d, ar = key
        rs = sorted(groups[key], key=lambda r: (num(r["config"].get("lr")), num(r["config"].get("seed"))))
        lrs = sorted({num(r["config"].get("lr")) for r in rs})
        curves = []  # (tokens, loss) per run, without the NaN/inf tail of a diverged run
        for r in rs:
            xy = [(num(s.get("tokens")), num(s.get("loss"))) for s in r["steps"] if isinstance(s, dict)]
            curves.append(np.array([p for p in xy if all(map(math.isfinite, p))]).reshape(-1, 2))
        # y range from the first logged loss down to the best: a spike to 1e4 would flatten everything else
        hi = max((c[0, 1] for c in curves if len(c)), default=1.0)
        lo = min((c[:, 1].min() for c in curves if len(c)), default=0.0)
        for r, xy in zip(rs, curves):
            bad, lr, seed = bool(r.get("diverged")), num(r["config"].get("lr")), drawing.seed_of(r["config"])
            lr_text = common.format_lr(lr) if math.isfinite(lr) else "?"   # as the run folder names it: 2e-3
            name = f"lr {lr_text} seed {'?' if seed is None else seed}"
            if bad:
                name += " DIVERGED"
            alpha = 0.5 if bad else 0.9
            # the LR a line style, the seed a shade and a marker of the design's colour (drawing.seed_look)
            ax.plot(xy[:, 0], xy[:, 1], STYLES[lrs.index(lr) % 4], lw=1, alpha=alpha, label=name,
                    markevery=max(1, len(xy) // 6), ms=4, **drawing.seed_look(res, seed))
            if bad:
                diverged.append(r["_path"])
                if len(xy):  # where it stopped being finite, clipped into view
                    ax.plot(xy[-1, 0], min(xy[-1, 1], hi), "x", color="black", ms=10, mew=2, clip_on=False)
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
        ar_name = drawing.ar_text(ar, drawing.asked_ars(rs).get(ar, ()))
        ax.set(title=f"{display(res)} L{L} d{d:g} (AR {ar_name})", xlabel="tokens", ylabel="train loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    title = "Training loss curves"
    if diverged:
        title += " (× = diverged)"
    return save(fig, out_path, svg, f"{len(runs)} runs in {len(groups)} panels, {len(diverged)} diverged",
                title=title, diverged=diverged)


# ----------------------------------------------------------------------------- Fig. 4: downstream NLL

def fig4_nll(data, out_path, svg=False):
    docs = [g for g in with_metric(data, "nll.categories") if isinstance(g["nll"]["categories"], dict)]
    if not docs:
        return {"skipped": "no diagnose JSON with nll.categories"}
    cats = ["coding", "stem", "math"]  # the paper's three; per-task values stay in the JSON
    fig, axes = plt.subplots(1, len(cats), figsize=(4.5 * len(cats), 4))
    for ax, cat in zip(axes, cats):
        points = {}  # (design, AR) -> values; several JSONs of one shape (seeds) are averaged
        for g in docs:
            res, _, _, ar = shape(g["meta"])
            points.setdefault((res, ar), []).append(num((g["nll"]["categories"].get(cat) or {}).get("nll_mean")))
        for res, (xs, mean, _, _) in by_design(points).items():
            ax.plot(xs, mean, "o-", color=colour(res), label=display(res))
        ar_axis(ax, [ar for _, ar in points])
        ax.set(title=cat, ylabel="NLL per target token (nats)")
    return save(fig, out_path, svg, f"{len(cats)} categories from {len(docs)} diagnose JSON",
                title="Downstream teacher-forced NLL by category", legend=(axes[-1], axes), categories=cats)


# ----------------------------------------------------------------------------- Fig. 5-10: per-model diagnostics

def fig5_angular(data, out_path, svg=False):
    def draw(g, axes):
        m = matrix(g["angular_distance"]["subsequent"])  # row n-1 = gap n, col l = start state
        # origin lower puts n = 1 at the bottom as in the reference; colour limits = data range
        heatmap(axes[0], m, "viridis_r", title=label(g["meta"]), xlabel="layer index ℓ (0 = embedding)",
                ylabel="subsequent n-th layer", origin="lower", extent=(-0.5, m.shape[1] - 0.5, 0.5, m.shape[0] + 0.5))
    return per_model(data, ["angular_distance.subsequent"], out_path, svg,
                     title=r"Angular distance $d(z_\ell, z_{\ell+n})$ (fraction of π)", draw=draw)


def fig6_depth_use(data, out_path, svg=False):
    docs = with_metric(data, "causal_score.R_causal", "permutation_score.R_perm")
    if not docs:
        return {"skipped": "no diagnose JSON with causal_score.R_causal or permutation_score.R_perm"}
    depths = sorted({shape(g["meta"])[1] for g in docs})
    designs = sorted({g["meta"]["residual"] for g in docs}, key=design_order)
    w = 0.8 / len(designs)  # grouped bars: one group per depth, one bar per design
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (key, field, title) in zip(axes, [("causal_score", "R_causal", "R_causal (C > {t}, s ≥ ⌈L/4⌉)"),
                                              ("permutation_score", "R_perm", "R_perm (P > {t}, i, j ≥ ⌈L/4⌉)")]):
        points = {}  # (design, depth) -> values in %; seeds of one shape are averaged
        for g in docs:
            points.setdefault((g["meta"]["residual"], shape(g["meta"])[1]), []).append(
                100 * num((metric(g, key) or {}).get(field)))
        for res, (Ls, mean, _, _) in by_design(points).items():
            x = [depths.index(L) - 0.4 + w * (designs.index(res) + 0.5) for L in Ls]
            ax.bar(x, mean, w, color=colour(res), label=display(res))
        t = next((metric(g, key).get("threshold") for g in docs if metric(g, key)), "?")
        ax.set_xticks(range(len(depths)), [str(L) for L in depths])
        ax.set(title=title.format(t=t), xlabel="depth n_layer", ylabel="pairs above threshold (%)")
        paper = ", ".join(f"{display(r)} {v}%" for r, v in PAPER_FIG6[field].items())
        ax.text(0.01, 0.98, f"paper (L32, 8B tokens): {paper}", transform=ax.transAxes, va="top", fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    return save(fig, out_path, svg, f"{len(designs)} design(s) x {len(depths)} depth(s)", legend=(axes[1], axes))


def fig6_score_maps(data, out_path, svg=False):
    def draw(g, axes):
        causal = matrix((metric(g, "causal_score") or {}).get("matrix"))
        perm = matrix((metric(g, "permutation_score") or {}).get("matrix"))
        axes[0].set_title("C(s, l): not computed"), axes[1].set_title("P(i, j): not computed")  # until drawn
        # C as the reference: limits [0, 99th percentile], so one outlier can't wash it out
        heatmap(axes[0], causal, CAUSAL_CMAP, title=f"{label(g['meta'])}: C(s, l)", xlabel="affected layer l",
                ylabel="removed layer s", vmin=0, top=99)
        heatmap(axes[1], perm, PERM_CMAP, title=f"{label(g['meta'])}: P(i, j)", xlabel="layer index j",
                ylabel="layer index i")
    return per_model(data, ["causal_score.matrix", "permutation_score.matrix"], out_path, svg,
                     title="Layer-skip causal score (left) and weight-swap permutation score (right)", draw=draw,
                     panels=2)


def fig7_attnres_weights(data, out_path, svg=False):
    views = [("sublayer", "source (0 = emb, 2k+1 = attn k, 2k+2 = MLP k)", "consumer sublayer (last = readout)"),
             ("block", "source block (0 = emb)", "consumer block (last = readout)")]

    def draw(g, axes):
        for ax, (view, xlabel, ylabel) in zip(axes, views):
            # rows sum to 1; future sources are null and stay blank
            weights = matrix(g["attnres_weights"].get(view))
            heatmap(ax, weights, "Blues", title=f"{label(g['meta'])}: {view}", xlabel=xlabel, ylabel=ylabel, vmin=0)
    return per_model(data, ["attnres_weights"], out_path, svg,
                     title="AttnRes residual-path weights w(source → consumer), averaged over tokens", draw=draw,
                     panels=2, w=4.4, h=4)


def fig8_pruning(data, out_path, svg=False):
    def draw(g, axes):
        rows = [r for r in g["layer_pruning"]["layers"] if isinstance(r, dict)]
        axes[0].bar([num(r.get("layer")) for r in rows], [num(r.get("delta")) for r in rows],
                    color=colour(g["meta"]["residual"]))
        axes[0].axhline(0, color="black", ls="--", lw=0.8)
        axes[0].set(title=f"{label(g['meta'])} (base {num(g['layer_pruning'].get('baseline_loss')):.3g})",
                    xlabel="skipped layer", ylabel="Δ loss (nats/token)")
    return per_model(data, ["layer_pruning.layers"], out_path, svg,
                     title="Single-layer pruning: loss increase when one layer is skipped", draw=draw)


def fig8_logit_lens(data, out_path, svg=False):
    panels = [("early_exit_ce", "early-exit CE (nats/token)"), ("kl_to_final", "KL(p_final ‖ p_ℓ) (nats)"),
              ("top5_overlap", "top-5 overlap with final (fraction)")]

    def draw(docs, style, axes):
        for g in docs:
            states, res = [s for s in g["logit_lens"]["states"] if isinstance(s, dict)], g["meta"]["residual"]
            for ax, (key, ylabel) in zip(axes, panels):
                ax.plot([num(s.get("index")) for s in states], [num(s.get(key)) for s in states], style(g),
                        ms=4, label=label(g["meta"]), **drawing.seed_look(res, drawing.seed_of(g["meta"])))
                ax.set(xlabel="depth state ℓ (0 = embedding)", ylabel=ylabel)
                ax.grid(alpha=0.3)
            # the real output's loss: the lens should come down to it at the last state
            axes[0].axhline(num(g["logit_lens"].get("final_loss")), color=colour(res), ls="--", lw=0.8)
        axes[0].set_title("dashed: the model's final loss")
    return overlay(data, "logit_lens.states", out_path, svg,
                   title="Logit lens: each depth state decoded with the final norm and head", draw=draw, ncols=3,
                   figsize=(16, 4.2))


def fig9_dead_zone(data, out_path, svg=False):
    def draw(g, axes):
        dz, ax = g["dead_zone"], axes[0]
        sched = [num(v) for v in dz["schedule"]]
        dead = list(dz.get("dead") or []) + [False] * len(sched)
        for b, is_dead in zip(ax.bar(range(len(sched)), sched, color=colour(g["meta"]["residual"])), dead):
            if is_dead:  # hatched grey, not just another hue: readable in print and for colour-blind readers
                b.set(color="#cccccc", hatch="//", edgecolor="black")
        ax.axhline(num(dz.get("tau")), color="black", ls="--", lw=0.8)  # nan (no tau) draws nothing
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        ax.set(title=f"{label(g['meta'])}\n{dz.get('count_blocks', '?')} dead block(s), τ = {num(dz.get('tau')):g}",
               ylim=(0, 1.05), xlabel="consumer sublayer", ylabel="weight on non-embedding sources")
    return per_model(data, ["dead_zone.schedule"], out_path, svg,
                     title="Block AttnRes depth-mixing schedule (hatched = dead, dashed = τ)", draw=draw)


def fig10_transport_erank(data, out_path, svg=False):
    def draw(docs, style, axes):
        for g in docs:
            te = g["transport_erank"]
            look = drawing.seed_look(g["meta"]["residual"], drawing.seed_of(g["meta"]))
            axes[0].plot([num(v) for v in te["per_connector"]], style(g), ms=4,
                         label=f"{label(g['meta'])} (mean {num(te.get('mean')):.2f})", **look)
        # n streams give n x n transport matrices, so the effective rank can't exceed n (the paper's n = 4)
        n = max(np.nan_to_num([num(g["meta"].get("n_streams", 4)) for g in docs], nan=4))
        axes[0].axhline(n, color="black", ls="--", lw=0.8, label=f"max = n = {n:g}")
        axes[0].set(title="HC / mHC residual transport effective rank", xlabel="connector k (2 per layer)",
                    ylabel="effective rank of the stream-mixing matrix", ylim=(0, n + 0.3))
        axes[0].grid(alpha=0.3)
    return overlay(data, "transport_erank.per_connector", out_path, svg, title=None, draw=draw, figsize=(8.5, 4.5))


# ----------------------------------------------------------------------------- Fig. 11: system cost

def fig11_system(data, out_path, svg=False):
    rows, head = {}, {}
    for p in data.get("profile", []):
        for r in p["rows"]:
            if isinstance(r, dict) and isinstance(r.get("residual"), str):
                rows[shape(r)[0], shape(r)[3]] = r  # a later file re-measuring a shape replaces the earlier one
                head = dict(device=p.get("device"), dtype=p.get("dtype"), seq=r.get("seq"), batch=r.get("batch"))
    if not rows:
        return {"skipped": "no profile JSON with rows"}
    batch_kv = any(math.isfinite(num(r.get("kv_cache_bytes_batch"))) for r in rows.values())
    if batch_kv:
        kv_panel = ("kv_cache_bytes_batch", BYTE_UNITS, "KV cache, whole batch")
    else:
        kv_panel = ("kv_cache_bytes", BYTE_UNITS, "KV cache per sequence")
    panels = [("prefill_flops", FLOP_UNITS, "prefill compute per sequence"), kv_panel,
              ("peak_mem_bytes", BYTE_UNITS, "peak memory"), ("fwd_ms", [(1, "ms")], "time per batch")]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for ax, (field, table, title) in zip(axes, panels):
        scale, u = unit([num(r.get(field)) for r in rows.values()], table)
        for f, style in [(field, "o-")] + ([("fwdbwd_ms", "s--")] if field == "fwd_ms" else []):
            for res, (xs, ys, _, _) in by_design({k: [num(r.get(f)) / scale] for k, r in rows.items()}).items():
                ax.plot(xs, ys, style, color=colour(res), label=display(res))
        if not ax.lines:  # e.g. a CPU-only profile: the analytic numbers exist, the measured ones do not
            ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
        ar_axis(ax, [ar for _, ar in rows])
        ax.set(title=title + (" (solid: fwd, dashed: fwd+bwd)" if field == "fwd_ms" else ""), ylabel=f"{title} ({u})")
    title = f"System cost vs aspect ratio ({head['device']}, {head['dtype']}, T = {head['seq']}, batch {head['batch']})"
    return save(fig, out_path, svg, f"{len(rows)} (design, AR) rows", title=title, legend=(axes[-1], axes))


# ----------------------------------------------------------------------------- the mini suite's composition probe

def fig_composition(data, out_path, svg=False):
    """Synthetic probe (mini.py): answer accuracy after a gap of g (g compositions) vs depth, one panel per
    gap, a line per design through the seed means, every seed a faint dot. Which depth solves how many
    compositions, and whether a design moves that line."""
    runs = [r for r in data.get("train", []) if r.get("finished") and (r.get("evals") or [{}])[-1].get("per_level")]
    if not runs:
        return {"skipped": "no finished synthetic-task run (train JSON with per_level accuracy)"}
    gaps = sorted({g for r in runs for g in r["evals"][-1]["per_level"]}, key=int)
    fig, axes = grid(len(gaps), ncols=len(gaps), w=3.4, h=3.2)
    for ax, g in zip(axes, gaps):
        points = {}
        for r in runs:
            res, L, _, _ = shape(r["config"])
            points.setdefault((res, L), []).append(num(r["evals"][-1]["per_level"].get(g, {}).get("acc")))
        for res, (xs, mean, _, _) in by_design(points).items():
            ax.plot(xs, mean, marker="o", color=colour(res), label=display(res))
            for x in xs:
                ax.scatter([x] * len(points[(res, x)]), points[(res, x)], color=colour(res), s=10, alpha=0.4)
        chance = 1 / math.factorial(int(runs[0]["config"].get("group", "s4")[1]))  # |S_n| possible answers
        ax.axhline(chance, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.set(title=f"gap {g} ({g} composition{'s' * (g != '1')})", xlabel="depth n_layer", ylim=(0, 1.02),
               ylabel="answer accuracy" if g == gaps[0] else None)
        ax.grid(alpha=0.3)
    return save(fig, out_path, svg, f"{len(runs)} runs, gaps {', '.join(gaps)}",
                title="Synthetic probe: answers solved vs depth (dotted: chance)", legend=(axes[-1], axes))


# ----------------------------------------------------------------------------- main

FIGURES = [  # (file name without extension, function), in paper order
    ("fig2_final_loss_vs_ar", fig2_final_loss),
    ("fig2_loss_curves", fig2_loss_curves),
    ("fig4_nll_vs_ar", fig4_nll),
    ("fig5_angular_distance", fig5_angular),
    ("fig6_depth_use", fig6_depth_use),
    ("fig6_score_maps", fig6_score_maps),
    ("fig7_attnres_weights", fig7_attnres_weights), ("fig7_dense_weights", fig_dense_weights),  # plot_eval's
    ("fig8_layer_pruning", fig8_pruning),
    ("fig8_logit_lens", fig8_logit_lens),
    ("fig9_dead_zone", fig9_dead_zone),
    ("fig10_transport_erank", fig10_transport_erank),
    ("fig11_system_cost", fig11_system),
    ("mini_composition_vs_depth", fig_composition),
    ("zeroshot_vs_ar", fig_zeroshot), ("token_collapse_per_layer", fig_token_collapse),  # depthbench/reports/plot_eval.py
]


def main(argv=None, figures=FIGURES, prog="plot.py"):
    """plot.py's command line: FIGURES drawn from a folder of JSON (depthbench/reports/drawing.py's loop)."""
    return drawing.main(argv, figures, prog)


if __name__ == "__main__":
    sys.exit(main())
