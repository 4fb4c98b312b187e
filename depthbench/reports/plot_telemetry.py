"""
plot_telemetry.py: what depthbench/training/telemetry.py recorded during training (run.json "telemetry"), drawn from a
folder of runs:

    python -m depthbench.reports.plot_telemetry runs/telemetry --out figs/telemetry

- telemetry_state_rms: the RMS of the state each sublayer reads, over training, one panel per run (steps across,
  depth down): the "curse of depth" is the state growing with depth as training goes on.
- telemetry_statistics: each statistic over training, a panel per statistic, a line per run: the state growth, the
  blocks' update / weight ratio, and what each design declares (HC/mHC transport effective rank, mHC's
  doubly-stochastic error, AttnRes depth entropy and dead sublayers, MoDA's depth share).

What each statistic means: docs/training.md#telemetry. It reads what plot.py reads (drawing.load_folder), draws in its
look and, like it, imports no torch.
"""
import math
import sys

import numpy as np

from depthbench.reports import drawing


def telemetry_runs(data):
    """Train JSONs with telemetry records (train.py, training/telemetry.py), by design then depth then name."""
    runs = [r for r in data.get("train", []) if ((r.get("telemetry") or {}).get("records") or [])]
    return sorted(runs, key=lambda r: (drawing.design_order(r["config"]["residual"]), drawing.shape(r["config"])[1],
                                       r["config"].get("name", "")))


def run_label(run):
    cfg = run["config"]
    lr = drawing.num(cfg.get("lr"))
    return drawing.label(cfg) + (f" lr {lr:g}" if math.isfinite(lr) else "")


def fig_telemetry_state_rms(data, out_path, svg=False):
    """State RMS per sublayer over training, one panel per run side by side: steps across, the sublayer the
    state feeds down (the last row: what the head reads), colour log10 RMS. The curse of depth is the colour
    darkening downwards as training goes on."""
    runs = telemetry_runs(data)
    if not runs:
        return {"skipped": "no train JSON with telemetry records (train.py at an eval, or --stats-every)"}
    fig, axes = drawing.grid(len(runs), ncols=min(len(runs), 3), w=4.4, h=3.6)
    for ax, run in zip(axes, runs):
        records = run["telemetry"]["records"]
        steps = [rec.get("step") for rec in records]
        m = drawing.matrix([rec.get("state_rms") for rec in records]).T          # (sublayers + 1, records)
        m = np.ma.masked_invalid(np.log10(np.ma.masked_less_equal(m, 0).filled(np.nan)))
        drawing.heatmap(ax, m, "viridis", title=run_label(run), xlabel="step", ylabel="state before sublayer i",
                        aspect="auto")
        ticks = sorted(set(np.linspace(0, len(steps) - 1, min(len(steps), 5)).round().astype(int)))
        ax.set_xticks(ticks, [str(steps[k]) for k in ticks])
    title = "State RMS per sublayer over training (log10; last row: the head's input)"
    return drawing.save(fig, out_path, svg, f"{len(runs)} run(s)", title=title)


def telemetry_series(records):
    """{statistic: [value per record]} of a run: generic summaries, then each design statistic (a list: its mean,
    unless the design gives that as key_mean)."""
    series = {}

    def put(key, rec, value):
        series.setdefault(key, [math.nan] * len(records))[rec] = value
    for k, rec in enumerate(records):
        states = [drawing.num(v) for v in rec.get("state_rms") or []]
        if len(states) > 1 and states[0] > 0:
            put("state growth: head / embedding RMS", k, states[-1] / states[0])
        ratios = [drawing.num(v) for v in ((rec.get("update_ratio") or {}).get("blocks") or [])]
        if ratios:
            put("update / weight, mean over blocks", k, float(np.nanmean(ratios)))
        design = rec.get("design") or {}
        for key, value in design.items():
            if isinstance(value, list) and f"{key}_mean" in design:
                continue                                                 # the design gives its own mean
            values = [drawing.num(v) for v in value] if isinstance(value, list) else [drawing.num(value)]
            if values and any(math.isfinite(v) for v in values):
                put(key + (" (mean)" if isinstance(value, list) else ""), k, float(np.nanmean(values)))
    return series


def fig_telemetry_design(data, out_path, svg=False):
    """Each statistic over training, one panel per statistic, a line per run (colour: design, style: depth): the
    state growth and the blocks' update ratio for every design, then what each design declares (HC/mHC transport
    effective rank, mHC's doubly-stochastic error, AttnRes depth entropy and dead sublayers, MoDA's depth share)."""
    runs = telemetry_runs(data)
    per_run = [(run, telemetry_series(run["telemetry"]["records"])) for run in runs]
    keys = list(dict.fromkeys(k for _, series in per_run for k in series))
    if not keys:
        return {"skipped": "no train JSON with telemetry statistics"}
    depths = sorted({drawing.shape(r["config"])[1] for r in runs})
    styles = {L: drawing.STYLES[i % len(drawing.STYLES)] for i, L in enumerate(depths)}
    fig, axes = drawing.grid(len(keys), ncols=min(len(keys), 4), w=3.8, h=3.0)
    for ax, key in zip(axes, keys):
        for run, series in per_run:
            if key in series:
                steps = [drawing.num(rec.get("step")) for rec in run["telemetry"]["records"]]
                look = drawing.seed_look(run["config"]["residual"], drawing.seed_of(run["config"]))
                ax.plot(steps, series[key], ms=4, ls=styles[drawing.shape(run["config"])[1]], label=run_label(run),
                        **look)
        ax.set(title=key, xlabel="step")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    drew = f"{len(runs)} run(s), {len(keys)} statistic(s)"
    return drawing.save(fig, out_path, svg, drew, title="Telemetry over training", legend=(axes[-1], axes))


FIGURES = [("telemetry_state_rms", fig_telemetry_state_rms), ("telemetry_statistics", fig_telemetry_design)]


def main(argv=None):
    return drawing.main(argv, FIGURES, "depthbench.reports.plot_telemetry")


if __name__ == "__main__":
    sys.exit(main())
