"""
plot.py: draw the DepthBench figures from the JSON that train.py, diagnose.py and profile_gpu.py write.

    python plot.py runs/ --out figs/          # every figure the folder's JSON supports
    python plot.py runs/ --out figs/ --svg    # also an SVG next to each PNG
    python plot.py runs/ --only fig2,fig11    # just some figures (name prefixes)

It reads RUNS_DIR/**/*.json, recognises each file by its "schema" field ("name/version"), draws what it can
and then lists what it drew and what it skipped, and why. There is no torch import: plotting should work on
any machine that has the JSON files, numpy and matplotlib.

Each figure is a function fig_xxx(data, out_path, svg=False) over already-loaded dicts, where
data = {"train": [run, ...], "diagnose": [diag, ...], "profile": [prof, ...]} (each dict carries its file
path in "_path"). It writes out_path and returns {"drew": "what, in words", ...}, or writes nothing and
returns {"skipped": "reason"}. FIGURES at the bottom lists them in paper order and drives main().
"""
import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import matplotlib
matplotlib.use("Agg")  # files only, never a window: works headless, in tests and over ssh
import matplotlib.pyplot as plt
from matplotlib import colors, transforms

# -----------------------------------------------------------------------------
# the contract with the writers, and the look shared by all figures

# schema name -> the one version this file can draw. Another version is skipped loudly, never guessed at.
SCHEMAS = {"depthbench.train": 1, "depthbench.diagnose": 1, "depthbench.profile": 1}

# registry key -> (display name, colour). One colour per design in every figure, so a reader learns it once.
# Hues loosely follow families: norm placement (grey/brown/olive/purple/pink), HC (blues), AttnRes (red/orange).
DESIGNS = {
    "preln": ("Pre-LN", "#4d4d4d"),
    "sandwich": ("Sandwich-LN", "#8c564b"),
    "lns": ("LNS", "#bcbd22"),
    "deepnorm": ("DeepNorm", "#9467bd"),
    "keel": ("KEEL", "#e377c2"),
    "hc": ("HC", "#1f77b4"),
    "mhc": ("mHC", "#17becf"),
    "attnres": ("Full AttnRes", "#d62728"),
    "block_attnres": ("Block AttnRes", "#ff7f0e"),
    "moda": ("MoDA", "#2ca02c"),
}
DPI = 150
STYLES = ["-", "--", ":", "-."]  # line styles tell shapes (n_layer) apart where colour already means design
AR_LABEL = "aspect ratio d_model / n_layer (log scale; deeper →)"


def display(res):
    return DESIGNS.get(res, (str(res), None))[0]


def colour(res):
    return DESIGNS.get(res, (None, "#7f7f7f"))[1]  # an unregistered design still draws, in grey


def design_order(res):
    return list(DESIGNS).index(res) if res in DESIGNS else len(DESIGNS)

# -----------------------------------------------------------------------------
# loading


def check_schema(obj):
    """Return (kind, None) for a JSON this file can draw, else (None, reason to print)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("schema"), str):
        return None, "no 'schema' field (not a depthbench JSON)"
    name, _, version = obj["schema"].rpartition("/")
    if name not in SCHEMAS:
        return None, f"unknown schema {obj['schema']!r}"
    if version != str(SCHEMAS[name]):
        return None, f"schema {obj['schema']}, this plot.py reads version {SCHEMAS[name]}"
    kind = name.split(".")[1]
    # only what every figure of this kind needs; all other fields are optional and checked per figure
    key, typ = {"train": ("config", dict), "diagnose": ("meta", dict), "profile": ("rows", list)}[kind]
    if not isinstance(obj.get(key), typ):
        return None, f"schema {obj['schema']} but no {key!r} {typ.__name__}"
    if kind != "profile" and not isinstance(obj[key].get("residual"), str):
        return None, f"schema {obj['schema']} but no {key}.residual"
    return kind, None


def load_folder(folder):
    """Read folder/**/*.json -> (data by kind, [(path, reason) for every file skipped])."""
    folder = Path(folder)
    data, skipped = {"train": [], "diagnose": [], "profile": []}, []
    for path in sorted(folder.glob("**/*.json")):
        rel = str(path.relative_to(folder))
        try:
            obj = json.loads(path.read_text())  # Python's json also accepts the NaN/Infinity torch writers emit
        except (OSError, UnicodeDecodeError, ValueError) as e:
            skipped.append((rel, f"not valid JSON ({e})"))
            continue
        kind, reason = check_schema(obj)
        if kind is None:
            skipped.append((rel, reason))
            continue
        obj["_path"] = rel
        data[kind].append(obj)
    return data, skipped

# -----------------------------------------------------------------------------
# small helpers


def num(x):
    """JSON value -> float, with null / missing / junk -> nan so it drops out of nanmin/nanmean."""
    try:
        return math.nan if x is None or isinstance(x, bool) else float(x)
    except (TypeError, ValueError):
        return math.nan


def matrix(rows):
    """(Possibly ragged) list of lists with nulls -> masked float array (nulls masked, drawn blank)."""
    rows = [r if isinstance(r, list) else [] for r in (rows or [])]
    a = np.full((len(rows), max((len(r) for r in rows), default=0)), np.nan)
    for i, r in enumerate(rows):
        a[i, :len(r)] = [num(v) for v in r]
    return np.ma.masked_invalid(a)


def metric(doc, key):
    """A diagnose JSON's metric object, or None when it is absent or {"skipped": reason}."""
    m = doc.get(key)
    return m if isinstance(m, dict) and "skipped" not in m else None


def shape(cfg):
    """(residual, n_layer, d_model, ar) from a train config, diagnose meta or profile row."""
    L, d, ar = num(cfg.get("n_layer")), num(cfg.get("d_model")), num(cfg.get("ar"))
    L = int(L) if math.isfinite(L) else 0
    if math.isnan(ar) and L:
        ar = d / L
    return cfg.get("residual"), L, d, round(ar, 3)  # rounded so 32.0 and 32.0000001 are one point


def label(meta):
    res, L, d, ar = shape(meta)
    return f"{display(res)} L{L} d{d:g}" if L else display(res)


def with_metric(data, key, field):
    """Diagnose JSONs whose metric `key` has a non-empty `field`, sorted by design then depth."""
    docs = [g for g in data.get("diagnose", []) if (metric(g, key) or {}).get(field)]
    return sorted(docs, key=lambda g: (design_order(g["meta"]["residual"]), shape(g["meta"])[1]))


def grid(n, ncols=4, w=3.8, h=3.2):
    """n panels in rows of ncols; returns (fig, list of n axes)."""
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat[:n])


def save(fig, out_path, svg=False):
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_path, dpi=DPI)
    if svg:
        fig.savefig(out_path.with_suffix(".svg"))
    plt.close(fig)


def ar_axis(ax, ars):
    """Log x axis of aspect ratio, inverted so wide-shallow is left and deep-narrow is right."""
    ax.set_xscale("log")
    ars = sorted(set(a for a in ars if math.isfinite(a) and a > 0))
    if ars:
        ax.set_xticks(ars, [f"{a:g}" for a in ars])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlim(max(ars) * 1.15, min(ars) / 1.15)  # (left, right) = (wide, deep): inverted on purpose
    ax.set_xlabel(AR_LABEL)
    ax.grid(alpha=0.3)


def by_design(points):
    """{(res, x): [y, ...]} -> {res: (xs, mean, min, max)} sorted by x, dropping nan ys."""
    out = {}
    for (res, x), ys in sorted(points.items(), key=lambda kv: (design_order(kv[0][0]), kv[0][1])):
        ys = [y for y in ys if math.isfinite(y)]
        if ys:
            xs, mean, lo, hi = out.setdefault(res, ([], [], [], []))
            xs.append(x), mean.append(np.mean(ys)), lo.append(min(ys)), hi.append(max(ys))
    return out


def legend_once(ax, axes):
    """One legend entry per label over all `axes` (bars and markers repeat labels), right of `ax`."""
    uniq = {}
    for a in axes:
        for h, lab in zip(*a.get_legend_handles_labels()):
            uniq.setdefault(lab, h)
    ax.legend(uniq.values(), uniq.keys(), fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))


def heatmap(ax, m, cmap, norm, title, xlabel, ylabel, **kw):
    im = ax.imshow(m, cmap=cmap, norm=norm, interpolation="nearest", **kw)
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)


def two_slope(vmin, vmax, frac):
    """Colour norm with its middle colour at vmin + frac*(vmax-vmin) (the reference heatmaps' choice)."""
    if not (math.isfinite(vmin) and math.isfinite(vmax) and vmax > vmin):
        return colors.Normalize(0, max(vmax, 1) if math.isfinite(vmax) else 1)
    return colors.TwoSlopeNorm(vcenter=vmin + frac * (vmax - vmin), vmin=vmin, vmax=vmax)


def finite(m):
    v = np.ma.compressed(m)
    return v[np.isfinite(v)]


def unit(values, table):
    """Pick the largest (scale, name) from table that the data reaches, e.g. TFLOP vs GFLOP."""
    top = max((v for v in values if math.isfinite(v)), default=0)
    return next(((s, u) for s, u in table if top >= s), table[-1])


FLOP_UNITS = [(1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1, "FLOP")]
BYTE_UNITS = [(1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B")]

# -----------------------------------------------------------------------------
# Fig. 2: final loss vs aspect ratio, and the loss curves behind it


def final_val(run):
    """A run's final validation loss: final.val_loss, else the last eval's, else nan."""
    v = num((run.get("final") or {}).get("val_loss"))
    evals = run.get("evals") or []
    return num(evals[-1].get("val_loss")) if math.isnan(v) and evals and isinstance(evals[-1], dict) else v


def fig2_final_loss(data, out_path, svg=False):
    runs = data.get("train", [])
    if not runs:
        return {"skipped": "no train JSON"}
    # group seeds by (design, AR, LR); a diverged seed has no usable loss but must still count against its LR
    groups = {}
    for r in runs:
        res, L, d, ar = shape(r["config"])
        groups.setdefault((res, ar), {}).setdefault(num(r["config"].get("lr")), []).append(r)
    best_lr, points, diverged = {}, {}, []
    for (res, ar), by_lr in groups.items():
        diverged += [r["_path"] for rs in by_lr.values() for r in rs if r.get("diverged")]
        # best LR = fewest diverged seeds first, then lowest mean final val loss: an LR that only
        # sometimes blows up should not win because its surviving seeds happen to be good
        scored = []
        for lr, rs in by_lr.items():
            vals = [final_val(r) for r in rs if not r.get("diverged") and math.isfinite(final_val(r))]
            if vals:
                scored.append((sum(bool(r.get("diverged")) for r in rs), np.mean(vals), lr, vals))
        if scored:
            _, _, lr, vals = min(scored, key=lambda s: s[:2])
            best_lr[f"{res}@{ar:g}"], points[(res, ar)] = lr, vals
    fig, ax = plt.subplots(figsize=(8, 5))
    for res, (xs, mean, lo, hi) in by_design(points).items():
        yerr = [np.subtract(mean, lo), np.subtract(hi, mean)]  # min-max over seeds
        ax.errorbar(xs, mean, yerr=yerr, color=colour(res), marker="o", capsize=3, label=display(res))
        for x in xs:  # every seed as a faint dot, so "3 seeds agree" and "1 seed" look different
            ax.scatter([x] * len(points[(res, x)]), points[(res, x)], color=colour(res), s=10, alpha=0.4)
    # diverged runs: an x at the top of the axis at their AR, staggered per design so they do not overlap
    top = transforms.blended_transform_factory(ax.transData, ax.transAxes)
    for r in runs:
        if r.get("diverged"):
            res, _, _, ar = shape(r["config"])
            ax.plot(ar, 0.96 - 0.025 * design_order(res), "x", color=colour(res), ms=9, mew=2, transform=top,
                    label=f"{display(res)} (diverged)")
    ar_axis(ax, [ar for _, ar in groups])
    budgets = {num(r["config"].get("params_budget")) for r in runs}
    budget = f" (budget {budgets.pop() / 1e6:.3g}M params)" if len(budgets) == 1 else ""
    ax.set(ylabel="final validation loss (nats/token)", title=f"Final validation loss vs aspect ratio{budget}")
    if diverged:
        ax.text(0.01, 0.01, "× at top: a run that diverged (any LR) at that shape", transform=ax.transAxes,
                fontsize=8, va="bottom")
    legend_once(ax, [ax])
    save(fig, out_path, svg)
    note = f", {len(diverged)} diverged run(s) marked" if diverged else ""
    return {"drew": f"{len(points)} (design, AR) points from {len(runs)} runs{note}", "best_lr": best_lr,
            "diverged": diverged}


def fig2_loss_curves(data, out_path, svg=False):
    runs = [r for r in data.get("train", []) if r.get("steps")]
    if not runs:
        return {"skipped": "no train JSON with steps"}
    groups = {}
    for r in runs:
        res, L, d, ar = shape(r["config"])
        groups.setdefault((design_order(res), -ar, res, L, d, ar), []).append(r)
    fig, axes = grid(len(groups))
    diverged = []
    for ax, key in zip(axes, sorted(groups)):
        _, _, res, L, d, ar = key
        rs = sorted(groups[key], key=lambda r: (num(r["config"].get("lr")), num(r["config"].get("seed"))))
        lrs = sorted({num(r["config"].get("lr")) for r in rs})
        top = max((num(s.get("loss")) for r in rs for s in r["steps"][:1]), default=math.nan)
        for r in rs:
            xy = [(num(s.get("tokens")), num(s.get("loss"))) for s in r["steps"] if isinstance(s, dict)]
            xy = np.array([p for p in xy if math.isfinite(p[0]) and math.isfinite(p[1])]).reshape(-1, 2)
            lr, seed = num(r["config"].get("lr")), r["config"].get("seed", "?")
            name = f"lr {lr:g} seed {seed}" + (" DIVERGED" if r.get("diverged") else "")
            line, = ax.plot(xy[:, 0], xy[:, 1], STYLES[lrs.index(lr) % 4], color=colour(res), lw=1,
                            alpha=0.9 if not r.get("diverged") else 0.5, label=name)
            if r.get("diverged"):
                diverged.append(r["_path"])
                if len(xy):  # mark where it stopped being finite, clipped into view
                    y = min(xy[-1, 1], top) if math.isfinite(top) else xy[-1, 1]
                    ax.plot(xy[-1, 0], y, "x", color="black", ms=10, mew=2)
        if math.isfinite(top):  # a spike to 1e4 would flatten every other curve
            ax.set_ylim(top=top * 1.05)
        ax.set(title=f"{display(res)}  L{L} d{d:g} (AR {ar:g})", xlabel="tokens", ylabel="train loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("Training loss curves (× = diverged)" if diverged else "Training loss curves")
    save(fig, out_path, svg)
    return {"drew": f"{len(runs)} runs in {len(groups)} panels" + (f", {len(diverged)} diverged" if diverged else ""),
            "diverged": diverged}

# -----------------------------------------------------------------------------
# Fig. 4: downstream NLL per category


def fig4_nll(data, out_path, svg=False):
    docs = [g for g in data.get("diagnose", []) if isinstance((metric(g, "nll") or {}).get("categories"), dict)]
    if not docs:
        return {"skipped": "no diagnose JSON with nll.categories"}
    cats = ["coding", "stem", "math"]
    cats += sorted({c for g in docs for c in g["nll"]["categories"]} - set(cats))
    fig, axes = plt.subplots(1, len(cats), figsize=(4.5 * len(cats), 4), squeeze=False)
    for ax, cat in zip(axes[0], cats):
        points = {}
        for g in docs:
            res, _, _, ar = shape(g["meta"])
            points.setdefault((res, ar), []).append(num((g["nll"]["categories"].get(cat) or {}).get("nll_mean")))
        for res, (xs, mean, lo, hi) in by_design(points).items():
            ax.plot(xs, mean, "o-", color=colour(res), label=display(res))
        ar_axis(ax, [ar for _, ar in points])
        ax.set(title=f"{cat}", ylabel="NLL per target token (nats)")
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("Downstream teacher-forced NLL by category")
    save(fig, out_path, svg)
    return {"drew": f"{len(cats)} categories from {len(docs)} diagnose JSON", "categories": cats}

# -----------------------------------------------------------------------------
# Fig. 5: angular distance


def fig5_angular(data, out_path, svg=False):
    docs = with_metric(data, "angular_distance", "subsequent")
    if not docs:
        return {"skipped": "no diagnose JSON with angular_distance.subsequent"}
    fig, axes = grid(len(docs))
    for ax, g in zip(axes, docs):
        m = matrix(g["angular_distance"]["subsequent"])  # row n-1 = gap n, col l = start state
        v = finite(m)
        L = m.shape[0]
        # origin lower: n = 1 at the bottom, as in the reference; limits = data range, not [0, 1]
        heatmap(ax, m, "viridis_r", colors.Normalize(v.min() if v.size else 0, v.max() if v.size else 1),
                label(g["meta"]), "layer index ℓ (0 = embedding)", "subsequent n-th layer",
                origin="lower", extent=(-0.5, m.shape[1] - 0.5, 0.5, L + 0.5))
        step = max(1, L // 4)
        ax.set_xticks(range(0, m.shape[1], step)), ax.set_yticks(range(1, L + 1, step))
    fig.suptitle("Angular distance d(z_ℓ, z_ℓ+n) (fraction of π)")
    save(fig, out_path, svg)
    return {"drew": f"{len(docs)} heatmaps"}

# -----------------------------------------------------------------------------
# Fig. 6: how much of its depth a model uses: R_causal and R_perm, and the maps behind them


def fig6_depth_use(data, out_path, svg=False):
    parts = [("causal_score", "R_causal", "R_causal (C > {t}, s ≥ ⌈L/4⌉)"),
             ("permutation_score", "R_perm", "R_perm (P > {t}, all pairs)")]
    docs = [g for g in data.get("diagnose", []) if any(math.isfinite(num((metric(g, k) or {}).get(f)))
                                                        for k, f, _ in parts)]
    if not docs:
        return {"skipped": "no diagnose JSON with causal_score.R_causal or permutation_score.R_perm"}
    depths = sorted({shape(g["meta"])[1] for g in docs})
    designs = sorted({g["meta"]["residual"] for g in docs}, key=design_order)
    w = 0.8 / len(designs)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (key, field, title) in zip(axes, parts):
        for j, res in enumerate(designs):
            for i, L in enumerate(depths):  # seeds of one (design, L) are averaged
                v = [num(metric(g, key).get(field)) for g in docs if metric(g, key) and
                     g["meta"]["residual"] == res and shape(g["meta"])[1] == L]
                v = [x for x in v if math.isfinite(x)]
                if v:
                    ax.bar(i - 0.4 + w * (j + 0.5), 100 * np.mean(v), w, color=colour(res), label=display(res))
        t = next((metric(g, key).get("threshold") for g in docs if metric(g, key)), "?")
        ax.set_xticks(range(len(depths)), [str(L) for L in depths])
        ax.set(title=title.format(t=t), xlabel="depth n_layer", ylabel="pairs above threshold (%)")
        ax.grid(axis="y", alpha=0.3)
    legend_once(axes[1], axes)
    save(fig, out_path, svg)
    return {"drew": f"{len(designs)} designs x {len(depths)} depths"}


CAUSAL_CMAP = colors.LinearSegmentedColormap.from_list("causal", ["white", "#9bd4e5", "#0072b2", "#08306b"])
PERM_CMAP = colors.LinearSegmentedColormap.from_list("perm", ["#0b3c78", "#f7f3ec", "#7b001c"])


def fig6_score_maps(data, out_path, svg=False):
    docs = [g for g in data.get("diagnose", [])
            if (metric(g, "causal_score") or {}).get("matrix") or (metric(g, "permutation_score") or {}).get("matrix")]
    if not docs:
        return {"skipped": "no diagnose JSON with causal_score.matrix or permutation_score.matrix"}
    docs.sort(key=lambda g: (design_order(g["meta"]["residual"]), shape(g["meta"])[1]))
    fig, axes = grid(2 * len(docs))  # causal and permutation side by side for each model
    for i, g in enumerate(docs):
        for ax, key in zip(axes[2 * i:2 * i + 2], ["causal_score", "permutation_score"]):
            m = matrix((metric(g, key) or {}).get("matrix"))
            v = finite(m)
            if not v.size:
                ax.text(0.5, 0.5, f"{key}: not computed", ha="center", transform=ax.transAxes)
                ax.axis("off")
            elif key == "causal_score":  # colour limits as in the reference: [0, p99], middle at 0.4*p99
                heatmap(ax, m, CAUSAL_CMAP, two_slope(0.0, float(np.percentile(v, 99)), 0.4),
                        f"{label(g['meta'])}: C(s, l)", "affected layer l", "removed layer s")
            else:
                heatmap(ax, m, PERM_CMAP, two_slope(float(v.min()), float(v.max()), 0.4),
                        f"{label(g['meta'])}: P(i, j)", "layer index j", "layer index i")
    fig.suptitle("Layer-skip causal score (left) and weight-swap permutation score (right)")
    save(fig, out_path, svg)
    return {"drew": f"score maps for {len(docs)} models"}

# -----------------------------------------------------------------------------
# Fig. 7-10: per-design diagnostics


def fig7_attnres_weights(data, out_path, svg=False):
    docs = with_metric(data, "attnres_weights", "sublayer")
    if not docs:
        return {"skipped": "no diagnose JSON with attnres_weights"}
    fig, axes = grid(2 * len(docs), w=4.4, h=4)
    for i, g in enumerate(docs):
        views = [("sublayer", "source (0 = emb, 2k+1 = attn k, 2k+2 = MLP k)", "consumer sublayer (last = readout)"),
                 ("block", "source block (0 = emb)", "consumer block (last = readout)")]
        for ax, (view, xl, yl) in zip(axes[2 * i:2 * i + 2], views):
            m = matrix(g["attnres_weights"].get(view))
            if not finite(m).size:
                ax.text(0.5, 0.5, f"no {view} view", ha="center", transform=ax.transAxes), ax.axis("off")
                continue
            heatmap(ax, m, "Blues", colors.Normalize(0, max(float(finite(m).max()), 1e-9)),
                    f"{label(g['meta'])}: {view}", xl, yl)
    fig.suptitle("AttnRes residual-path weights w(source → consumer), averaged over tokens")
    save(fig, out_path, svg)
    return {"drew": f"{len(docs)} models"}


def fig8_pruning(data, out_path, svg=False):
    docs = with_metric(data, "layer_pruning", "layers")
    if not docs:
        return {"skipped": "no diagnose JSON with layer_pruning.layers"}
    fig, axes = grid(len(docs))
    for ax, g in zip(axes, docs):
        rows = [r for r in g["layer_pruning"]["layers"] if isinstance(r, dict)]
        ax.bar([num(r.get("layer")) for r in rows], [num(r.get("delta")) for r in rows], color=colour(g["meta"]["residual"]))
        ax.axhline(0, color="black", ls="--", lw=0.8)
        base = num(g["layer_pruning"].get("baseline_loss"))
        ax.set(title=f"{label(g['meta'])} (base {base:.3g})", xlabel="skipped layer",
               ylabel="Δ loss (nats/token)")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Single-layer pruning: loss increase when one layer is skipped")
    save(fig, out_path, svg)
    return {"drew": f"{len(docs)} models"}


def shape_styles(docs):
    depths = sorted({shape(g["meta"])[1] for g in docs})
    return {L: STYLES[i % len(STYLES)] for i, L in enumerate(depths)}


def fig8_logit_lens(data, out_path, svg=False):
    docs = with_metric(data, "logit_lens", "states")
    if not docs:
        return {"skipped": "no diagnose JSON with logit_lens.states"}
    ls = shape_styles(docs)
    panels = [("early_exit_ce", "early-exit CE (nats/token)"), ("kl_to_final", "KL(p_final ‖ p_ℓ) (nats)"),
              ("top5_overlap", "top-5 overlap with final (fraction)")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for g in docs:
        res, L = g["meta"]["residual"], shape(g["meta"])[1]
        states = [s for s in g["logit_lens"]["states"] if isinstance(s, dict)]
        xs = [num(s.get("index")) for s in states]
        for ax, (key, yl) in zip(axes, panels):
            ax.plot(xs, [num(s.get(key)) for s in states], ls[L], marker=".", color=colour(res), label=label(g["meta"]))
        final = num(g["logit_lens"].get("final_loss"))
        if math.isfinite(final):  # where the real output ends up: the lens should approach it
            axes[0].axhline(final, color=colour(res), ls="--", lw=0.8, alpha=0.6)
    for ax, (key, yl) in zip(axes, panels):
        ax.set(xlabel="depth state ℓ (0 = embedding)", ylabel=yl)
        ax.grid(alpha=0.3)
    axes[0].set_title("dashed: final loss")
    axes[2].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("Logit lens: decoding each depth state with the final norm and head")
    save(fig, out_path, svg)
    return {"drew": f"{len(docs)} models"}


def fig9_dead_zone(data, out_path, svg=False):
    docs = with_metric(data, "dead_zone", "schedule")
    if not docs:
        return {"skipped": "no diagnose JSON with dead_zone.schedule"}
    fig, axes = grid(len(docs))
    total = 0
    for ax, g in zip(axes, docs):
        dz = g["dead_zone"]
        sched = [num(v) for v in dz["schedule"]]
        dead = list(dz.get("dead") or []) + [False] * len(sched)
        tau = num(dz.get("tau"))
        bars = ax.bar(range(len(sched)), sched, color=colour(g["meta"]["residual"]))
        for b, is_dead in zip(bars, dead):
            if is_dead:  # dead = reads (almost) only the embedding: hatched grey, not just a different hue
                b.set(color="#cccccc", hatch="//", edgecolor="black")
        if math.isfinite(tau):
            ax.axhline(tau, color="black", ls="--", lw=0.8, label=f"τ = {tau:g}")
            ax.legend(fontsize=7)
        n = dz.get("count_blocks", sum(map(bool, dead[:len(sched)])))
        total += int(num(n)) if math.isfinite(num(n)) else 0
        ax.set(title=f"{label(g['meta'])}: {n} dead block(s)", xlabel="consumer sublayer",
               ylabel="weight on non-embedding sources", ylim=(0, 1.05))
    fig.suptitle("Block AttnRes depth-mixing schedule (hatched = dead zone)")
    save(fig, out_path, svg)
    return {"drew": f"{len(docs)} models, {total} dead blocks in all"}


def fig10_transport_erank(data, out_path, svg=False):
    docs = with_metric(data, "transport_erank", "per_connector")
    if not docs:
        return {"skipped": "no diagnose JSON with transport_erank.per_connector"}
    ls = shape_styles(docs)
    with_product = any(g["transport_erank"].get("product") for g in docs)
    fig, axes = plt.subplots(1, 2 if with_product else 1, figsize=(13 if with_product else 7.5, 4.2), squeeze=False)
    axes = axes[0]
    for g in docs:
        te, res, L = g["transport_erank"], g["meta"]["residual"], shape(g["meta"])[1]
        mean = num(te.get("mean"))
        axes[0].plot([num(v) for v in te["per_connector"]], ls[L], marker=".", color=colour(res),
                     label=f"{label(g['meta'])} (mean {mean:.2f})")
        if with_product and te.get("product"):
            axes[1].plot([num(v) for v in te["product"]], ls[L], marker=".", color=colour(res), label=label(g["meta"]))
    n = max(int(num(g["meta"].get("n_streams"))) if math.isfinite(num(g["meta"].get("n_streams"))) else 4 for g in docs)
    titles = ["per connector", "running product up to connector k"]
    for ax, t in zip(axes, titles):  # n streams => an n x n matrix: erank can't exceed n
        ax.axhline(n, color="black", ls="--", lw=0.8, label=f"max = n = {n}")
        ax.set(title=t, xlabel="connector k (2 per layer)", ylabel="effective rank", ylim=(0, n + 0.3))
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("HC / mHC residual transport effective rank")
    save(fig, out_path, svg)
    return {"drew": f"{len(docs)} models"}

# -----------------------------------------------------------------------------
# Fig. 11: system cost


def fig11_system(data, out_path, svg=False):
    rows = {}
    meta = {}
    for p in data.get("profile", []):
        for r in p["rows"]:
            if isinstance(r, dict) and isinstance(r.get("residual"), str):
                rows[shape(r)[0], shape(r)[3]] = r  # a later file re-measuring a shape replaces the earlier one
                meta = {"device": p.get("device", "?"), "dtype": p.get("dtype", "?"), "seq": r.get("seq"),
                        "batch": r.get("batch")}
    if not rows:
        return {"skipped": "no profile JSON with rows"}
    kv = "kv_cache_bytes_batch" if any(math.isfinite(num(r.get("kv_cache_bytes_batch"))) for r in rows.values()) \
        else "kv_cache_bytes"
    panels = [("prefill_flops", FLOP_UNITS, "prefill compute per sequence"),
              (kv, BYTE_UNITS, "KV cache" + (" (whole batch)" if kv.endswith("batch") else " per sequence")),
              ("peak_mem_bytes", BYTE_UNITS, "peak memory"), ("fwd_ms", [(1, "ms")], "forward time")]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    designs = sorted({res for res, _ in rows}, key=design_order)
    for ax, (field, table, title) in zip(axes, panels):
        scale, u = unit([num(r.get(field)) for r in rows.values()], table)
        drawn = False
        for res in designs:
            pts = sorted((ar, r) for (rr, ar), r in rows.items() if rr == res)
            for f, style in [(field, "o-"), ("fwdbwd_ms", "s--")] if field == "fwd_ms" else [(field, "o-")]:
                y = [num(r.get(f)) / scale for _, r in pts]
                if any(math.isfinite(v) for v in y):
                    ax.plot([ar for ar, _ in pts], y, style, color=colour(res),
                            label=display(res) if f == field else None)
                    drawn = True
        if not drawn:  # e.g. a CPU-only profile: analytic numbers exist, measured ones do not
            ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
        ar_axis(ax, [ar for _, ar in rows])
        ax.set(title=title + (" (dashed: fwd+bwd)" if field == "fwd_ms" else ""), ylabel=f"{title.split(' (')[0]} ({u})")
    axes[-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"System cost vs aspect ratio ({meta['device']}, {meta['dtype']}, T = {meta['seq']}, "
                 f"batch {meta['batch']})")
    save(fig, out_path, svg)
    return {"drew": f"{len(rows)} (design, AR) rows, {len(designs)} designs"}

# -----------------------------------------------------------------------------
# main


FIGURES = [  # (file name without extension, function), in paper order
    ("fig2_final_loss_vs_ar", fig2_final_loss),
    ("fig2_loss_curves", fig2_loss_curves),
    ("fig4_nll_vs_ar", fig4_nll),
    ("fig5_angular_distance", fig5_angular),
    ("fig6_depth_use", fig6_depth_use),
    ("fig6_score_maps", fig6_score_maps),
    ("fig7_attnres_weights", fig7_attnres_weights),
    ("fig8_layer_pruning", fig8_pruning),
    ("fig8_logit_lens", fig8_logit_lens),
    ("fig9_dead_zone", fig9_dead_zone),
    ("fig10_transport_erank", fig10_transport_erank),
    ("fig11_system_cost", fig11_system),
]


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block: easier to spot in a sweep log
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    parser = Parser(prog="plot.py", description="Draw DepthBench figures from a folder of JSON results.")
    parser.add_argument("runs_dir", type=Path, help="folder searched recursively for *.json (train/diagnose/profile)")
    parser.add_argument("--out", type=Path, default=Path("figs"), help="folder for the figures (created if missing)")
    parser.add_argument("--svg", action="store_true", help="also write an SVG next to each PNG")
    parser.add_argument("--only", default="", help="comma-separated figure name prefixes, e.g. 'fig2,fig11'")
    args = parser.parse_args(argv)
    if not args.runs_dir.is_dir():
        parser.error(f"runs_dir {str(args.runs_dir)!r} is not a folder")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} exists and is not a folder")
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    figures = [(n, f) for n, f in FIGURES if not only or any(n.startswith(o) for o in only)]
    if not figures:
        parser.error(f"--only {args.only!r} matches no figure (names: {', '.join(n for n, _ in FIGURES)})")

    data, skipped = load_folder(args.runs_dir)
    counts = ", ".join(f"{len(v)} {k}" for k, v in data.items())
    print(f"read {args.runs_dir}: {counts}; {len(skipped)} file(s) skipped")
    for path, reason in skipped:
        print(f"  skipped {path}: {reason}")
    failed = 0
    for name, fn in figures:
        out = args.out / f"{name}.png"
        try:
            info = fn(data, out, svg=args.svg)
        except Exception as e:  # one odd field should cost one figure, not the whole run; say so loudly
            print(f"{name}: FAILED ({type(e).__name__}: {e})")
            failed += 1
            continue
        print(f"{name}: skipped ({info['skipped']})" if "skipped" in info else f"{name}: {out} ({info['drew']})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
