"""
plot_eval.py: the figures of diagnose.py's evaluation metrics and of the depth weights of the designs beyond the
paper, drawn by plot.py (registered in its FIGURES):

- zeroshot_vs_ar: zero-shot accuracy (lm-eval's acc, solid; acc_norm where a task has it, dashed) against
  aspect ratio, one panel per task, a line per design, chance dotted (docs/diagnostics.md#zero-shot).
- token_collapse_per_layer: stable rank, effective rank and L1/L2 ratio of the token matrix per depth state, a line per
  model, the three side by side (docs/diagnostics.md#token-collapse).
- fig7_dense_weights: the paper's Fig. 7 for DenseFormer's and MUDD's weights over depth, a heatmap per stream
  (docs/diagnostics.md#dense-weights).

They read what plot.py reads and draw in its look (drawing.py); like it, this file imports no torch.
"""
from matplotlib import ticker

from depthbench.reports import drawing

# chance accuracy of each task's choices (four answers, two options, three answers, ...)
CHANCE = {"openbookqa": 1 / 4, "winogrande": 1 / 2, "arc_challenge": 1 / 4, "arc_easy": 1 / 4, "hellaswag": 1 / 4,
          "social_iqa": 1 / 3, "piqa": 1 / 2}
COLLAPSE = [("stable_rank", "stable rank  Σs² / max(s)²"), ("erank", "effective rank  exp(H(s² / Σs²))"),
            ("l1_l2_ratio", "L1/L2 ratio  Σs / √Σs²")]


def fig_zeroshot(data, out_path, svg=False):
    docs = [g for g in drawing.with_metric(data, "zeroshot.tasks") if isinstance(g["zeroshot"]["tasks"], dict)]
    if not docs:
        return {"skipped": "no diagnose JSON with zeroshot.tasks"}
    tasks = list(dict.fromkeys(t for g in docs for t, v in g["zeroshot"]["tasks"].items() if drawing.metric(
        g["zeroshot"]["tasks"], t)))
    if not tasks:
        return {"skipped": "no zero-shot task was scored (every one skipped)"}
    fig, axes = drawing.grid(len(tasks), ncols=4, w=3.8, h=3.2)
    ars = set()
    for ax, task in zip(axes, tasks):
        for key, style in (("acc", "o-"), ("acc_norm", "s--")):
            points = {}  # (design, AR) -> values; seeds of one shape are averaged
            for g in docs:
                res, _, _, ar = drawing.shape(g["meta"])
                result = drawing.metric(g["zeroshot"]["tasks"], task) or {}
                points.setdefault((res, ar), []).append(drawing.num(result.get(key)))
                ars.add(ar)
            for res, (xs, mean, _, _) in drawing.by_design(points).items():
                ax.plot(xs, mean, style, color=drawing.colour(res), label=f"{drawing.display(res)} {key}")
        if task in CHANCE:
            ax.axhline(CHANCE[task], color="grey", ls=":", lw=1)
        drawing.ar_axis(ax, ars)
        ax.set(title=task, ylabel="accuracy", ylim=(0, 1.02))
    return drawing.save(fig, out_path, svg, f"{len(tasks)} task(s) from {len(docs)} diagnose JSON",
                        title="Zero-shot accuracy (lm-eval; solid acc, dashed acc_norm, dotted chance)",
                        legend=(axes[-1], axes), tasks=tasks)


def fig_token_collapse(data, out_path, svg=False):

    def draw(docs, style, axes):
        for g in docs:
            tc = g["token_collapse"]
            for ax, (key, ylabel) in zip(axes, COLLAPSE):
                values = [drawing.num(v) for v in tc.get(key) or []] if isinstance(tc.get(key), list) else []
                look = drawing.seed_look(g["meta"]["residual"], drawing.seed_of(g["meta"]))
                ax.plot(range(len(values)), values, style(g), ms=4, label=drawing.label(g["meta"]), **look)
                ax.set(xlabel="depth state ℓ (0 = embedding)", ylabel=ylabel)
                ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
                ax.grid(alpha=0.3)
        axes[0].axhline(1, color="black", ls="--", lw=0.8)   # every token on one line
        axes[0].set_title("dashed: 1, all tokens on one line")
    return drawing.overlay(data, "token_collapse.erank", out_path, svg,
                           title="Token collapse: singular values of each depth state's token matrix", draw=draw,
                           ncols=3, figsize=(16, 4.2))


def fig_dense_weights(data, out_path, svg=False):
    """One row of heatmaps per model, one per stream (DenseFormer: mix; MUDD: Q, K, V, R): consumers down (block c's
    input, the last row the head's), sources across (0 the embedding, 1 + k block k's output), token-averaged; a
    diverging map centred on 0, since these weights, unlike a softmax's, may be negative."""
    docs = drawing.with_metric(data, "dense_weights.weights")
    if not docs:
        return {"skipped": "no diagnose JSON with dense_weights.weights"}
    panels = max(len(g["dense_weights"]["streams"]) for g in docs)
    fig, axes = drawing.grid(panels * len(docs), ncols=panels, w=3.6, h=3.2)
    for k, g in enumerate(docs):
        dense, row = g["dense_weights"], axes[panels * k:panels * (k + 1)]
        for ax in row[len(dense["streams"]):]:                              # DenseFormer's one stream beside MUDD's 4
            ax.axis("off")
        for ax, name in zip(row, dense["streams"]):
            m = drawing.matrix(dense["weights"].get(name))
            top = max(abs(drawing.finite(m)), default=1.0)
            drawing.heatmap(ax, m, "RdBu_r", title=f"{drawing.label(g['meta'])}: {name}",
                            xlabel="source (0 = emb, 1 + k = block k)", ylabel="consumer block (last = head)",
                            vmin=-top)
    return drawing.save(fig, out_path, svg, f"{len(docs)} model(s)",
                        title="Weights over depth w(source -> consumer), averaged over tokens (DenseFormer, MUDD)")
