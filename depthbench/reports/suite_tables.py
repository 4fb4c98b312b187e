"""
suite_tables.py: what a mini suite folder's runs say, as markdown tables for mini.py's summary.md: one Result per
cell (design, shape, LR) from the run folders, its row with Δ vs Pre-LN paired by seed and its 95% interval
(depthbench/evaluation/compare.py: a difference is claimed only where the interval excludes 0), every seed's final loss,
R scores at the deepest shape, the paired grid (design x shape), the README's table at a glance and each design's best
aspect ratio (depthbench/reports/shape_fit.py). It reads run.json and diagnose.json; it trains nothing. mini.py plans
and runs the suite; this file reports it.
"""
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from depthbench.evaluation import compare
from depthbench.files import runlog
from depthbench.files.common import format_lr, read_json
from depthbench.reports import shape_fit


def done_runs(folder):
    """{run dir: (state, run.json)} of the runs under a folder that are done, by runlog.run_state: 'finished' (its
    loss counts) or 'diverged' (a result too: never trained again, never chosen). 'partial' and 'new' runs are not
    done. run.json is read by type (depthbench/files/runlog.py): one that is not train.py's, or has a field missing or
    of another type, is a RunLogError naming the file and the field, never a result."""
    done = {}
    for path in sorted(Path(folder).glob("*/run.json")):
        state = runlog.run_state(path.parent)
        if state in ("finished", "diverged"):
            done[path.parent] = (state, runlog.read_run_log(path))
    return done


def finished_runs(folder):
    """{run dir: run.json} of the finished runs under a folder: the ones with a loss to report and diagnose."""
    return {path: run for path, (state, run) in done_runs(folder).items() if state == "finished"}


def show_lr(lr):
    """An LR as the tables print it, to two significant digits: 3.333333e-4 (1e-3 / 3, a sweep's extension, as its
    run folder names it) -> '3.3e-4'; 3e-3 -> '3e-3'."""
    return format_lr(float(f"{lr:.2g}"))


def spread(values, fmt=".4f"):
    """'mean ± half-range' over seeds ('—' for none)."""
    if not values:
        return "—"
    return f"{np.mean(values):{fmt}} ± {(max(values) - min(values)) / 2:{fmt}}"


def diverged_step(run):
    """The step a diverged run stopped at (its last logged step; train.py logs the step that diverged)."""
    return ((run or {}).get("steps") or [{}])[-1].get("step", "?")


@dataclass
class Result:
    """A cell's runs at one LR in a probe folder: one row of summary.md."""
    loss: list = field(default_factory=list)      # final val loss of each finished seed
    seed: list = field(default_factory=list)      # the finished seeds, in loss's order
    wall: list = field(default_factory=list)      # wall seconds of each finished seed
    gaps: list = field(default_factory=list)      # each finished seed's answer accuracy per gap (synthetic probe)
    rc: list = field(default_factory=list)        # R_causal of each diagnosed seed (diagnose.json beside ckpt.pt)
    rp: list = field(default_factory=list)        # R_perm, last three quarters, of each diagnosed seed
    r_seed: list = field(default_factory=list)    # the diagnosed seeds, in rc's order
    by_seed: dict = field(default_factory=dict)   # seed -> final val loss, None where it diverged (compare.paired)
    diverged: list = field(default_factory=list)  # (seed, the step it diverged at) of each diverged seed


def add_finished(result, path, run):
    """Add a finished run (and its diagnose.json, when readable) to its cell's Result."""
    seed, loss = run["config"].get("seed"), run["final"]["val_loss"]
    result.loss.append(loss)
    result.seed.append(seed)
    result.wall.append(run["wall_s"])
    result.by_seed[seed] = loss
    per = run["evals"][-1].get("per_level") or {}
    result.gaps.append([per[g]["acc"] for g in sorted(per)])
    diag = read_json(path / "diagnose.json") or {}  # unreadable: as missing (main diagnoses it again)
    rc = diag.get("causal_score", {}).get("R_causal")
    rp = diag.get("permutation_score", {}).get("R_perm")  # the last three quarters (diagnose/2)
    if rc is not None and rp is not None:  # None: too shallow to have pairs there
        result.rc.append(rc)
        result.rp.append(rp)
        result.r_seed.append(seed)


def collect(folder):
    """{(design, L, d, lr): Result} of a folder's done runs: finished ones with their losses and R scores, diverged
    ones with the step they diverged at."""
    table = {}
    for path, (state, run) in done_runs(folder).items():
        c = run["config"]
        result = table.setdefault((c["residual"], c["n_layer"], c["d_model"], c["lr"]), Result())
        if state == "finished":
            add_finished(result, path, run)
        else:
            result.by_seed[c.get("seed")] = None
            result.diverged.append((c.get("seed"), diverged_step(run)))
    return table


def diverged_text(result):
    """'seed 1 at step 7, seed 2 at step 9' for a Result's diverged seeds."""
    return ", ".join(f"seed {seed} at step {step}" for seed, step in sorted(result.diverged, key=str))


def base_of(table, key):
    """Pre-LN's Result at the same shape as `key` (the one `shown`), None for Pre-LN itself or none."""
    res, L, d, _ = key
    if res == "preln":
        return None
    return shown(table, "preln", L, d)[1]


def row(probe_name, key, result, base):
    """One row of a probe's table in summary.md."""
    res, L, d, lr = key
    seeds = str(len(result.loss))
    if result.diverged:
        seeds += f" + {len(result.diverged)} diverged ({diverged_text(result)})"
    cols = [res, str(L), str(d), f"{d / L:.1f}", show_lr(lr), seeds, spread(result.loss)]
    if base:
        pair = compare.paired(result.by_seed, base.by_seed)
        cols += [pair.text(), pair.verdict()]
    else:
        cols += ["—", "—"]
    if probe_name == "synthetic" and result.gaps:
        cols.append(" / ".join(f"{a:.2f}" for a in np.mean(result.gaps, 0)))
    elif probe_name == "synthetic":
        cols.append("—")
    wall = f"{np.mean(result.wall):.0f} s" if result.wall else "—"
    cols += [spread(result.rc, ".1%"), spread(result.rp, ".1%"), wall]
    return "| " + " | ".join(cols) + " |"


def probe_table(probe_name, table, order):
    """A probe's table: one row per (shape, design), shallow to deep, designs in `order` (--designs)."""
    head = ("| design | L | d | AR | LR | seeds | final val loss (mean ± half-range) | Δ vs Pre-LN paired: mean [95% "
            "t interval], lower on | verdict (95% interval) |")
    if probe_name == "synthetic":
        head += " answer acc by gap (mean over seeds) |"
    head += " R_causal | R_perm last 3/4 | wall per run |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key in sorted(table, key=lambda k: (k[1], *ranked(order, k))):
        lines.append(row(probe_name, key, table[key], base_of(table, key)))
    return lines


def ranked(order, key):
    """The sort key of a (design, L, d, lr) table key by a list of designs: its place there (others after), name, LR."""
    return order.index(key[0]) if key[0] in order else len(order), key[0], key[3]


def deep_lines(table, order):
    """R_causal / R_perm per seed at the deepest shape, one line per design (and its diverged seeds)."""
    deep = max((k[1] for k in table), default=None)
    if not deep:
        return []
    lines = ["", f"R scores at the deepest shape (L{deep}), per seed:", ""]
    for key in sorted(table, key=lambda k: ranked(order, k)):
        result = table[key]
        if key[1] != deep or not (result.rc or result.diverged):
            continue
        rc, rp = (", ".join(f"{v:.1%}" for v in values) for values in (result.rc, result.rp))
        line = f"- {key[0]}: R_causal {rc or '—'}; R_perm {rp or '—'}"
        if result.r_seed:
            line += f" (seeds {', '.join(map(str, result.r_seed))})"
        if result.diverged:
            line += f"; diverged: {diverged_text(result)}"
        lines.append(line)
    return lines


def shown(table, name, L, d):
    """(key, Result) of a design at a shape in a probe's table: the LR with the most seeds (a cell has one LR unless
    runs of another were added by hand); (None, None) when it has none."""
    found = [(k, r) for k, r in table.items() if k[:3] == (name, L, d)]
    return max(found, key=lambda kr: len(kr[1].by_seed), default=(None, None))


def shapes_of(table):
    """The (L, d) shapes of a probe's table, shallow to deep."""
    return sorted({(k[1], k[2]) for k in table})


def shape_name(L, d):
    """'AR 92 (L2)': a shape as the tables' column heads name it."""
    return f"AR {d / L:.2g} (L{L})"


def claim(pair, digits=3):
    """A paired difference as the grid and the table at a glance give it: '-0.063 [-0.112, -0.014], better, lower on
    3/3' (compare.Paired: the mean, its 95% t interval, the verdict by that interval, the count of seeds lower)."""
    parts = [pair.interval_text(digits), pair.verdict(), f"lower on {pair.lower}/{len(pair.seeds)}"]
    return ", ".join(part for part in parts if part)


def paired_grid(table, order):
    """Δ vs Pre-LN paired by seed, design x shape: the mean of the per-seed differences, its 95% interval, the verdict
    by that interval and on how many of the seeds both ran the design is lower (compare.paired; a diverged seed
    counts against its design)."""
    shapes = shapes_of(table)
    lines = ["| design | " + " | ".join(shape_name(L, d) for L, d in shapes) + " |",
             "|" + "---|" * (len(shapes) + 1)]
    for name in order:
        if name == "preln":
            continue
        cols = [name]
        for L, d in shapes:
            key, result = shown(table, name, L, d)
            base = base_of(table, key) if result else None
            pair = compare.paired(result.by_seed, base.by_seed) if base else None
            cols.append(claim(pair) if pair and pair.seeds else "—")
        lines.append("| " + " | ".join(cols) + " |")
    return lines


def glance(table, order, lrs):
    """The README's table: per design, the final val loss at the shallowest and the deepest shape (mean ± half-range
    over seeds), its difference from Pre-LN's there paired by seed (claim: the mean, its 95% interval, the verdict, on
    how many paired seeds it is lower), and the LR it chose at each shape, shallow to deep: `lrs` {design: [LR or
    None]}."""
    shapes = shapes_of(table)
    if not shapes:
        return []
    ends = [shapes[0], shapes[-1]] if len(shapes) > 1 else shapes
    head = "| design |"
    for L, d in ends:
        head += f" {shape_name(L, d)} | Δ vs Pre-LN |"
    lines = [head + " LR chosen, shallow → deep |", "|" + "---|" * (2 * len(ends) + 2)]
    for name in order:
        cols = [name]
        for L, d in ends:
            key, result = shown(table, name, L, d)
            if not result:
                cols += ["—", "—"]
                continue
            base = base_of(table, key)
            loss = spread(result.loss, ".3f") if result.loss else "all diverged"
            cols.append(f"{loss} ({len(result.loss)})")
            cols.append(claim(compare.paired(result.by_seed, base.by_seed)) if base else "—")
        cols.append(" → ".join(show_lr(lr) if lr else "—" for lr in lrs[name]))
        lines.append("| " + " | ".join(cols) + " |")
    return lines


def seed_cell(result, seed):
    """One seed's final val loss as the per-seed table gives it: '1.8861', 'diverged (step 7)' or '—' (not run)."""
    if seed not in result.by_seed:
        return "—"
    loss = result.by_seed[seed]
    if loss is None:
        step = dict(result.diverged).get(seed, "?")
        return f"diverged (step {step})"
    return f"{loss:.4f}"


def seed_table(table, order):
    """Every cell's final val loss per seed, shallow to deep, designs in `order`: what the intervals are computed
    from, so that a reader can recompute any of them."""
    seeds = sorted({seed for result in table.values() for seed in result.by_seed})
    lines = ["| design | L | d | LR | " + " | ".join(f"seed {seed}" for seed in seeds) + " |",
             "|" + "---|" * (len(seeds) + 4)]
    for key in sorted(table, key=lambda k: (k[1], *ranked(order, k))):
        res, L, d, lr = key
        cells = [seed_cell(table[key], seed) for seed in seeds]
        lines.append(f"| {res} | {L} | {d} | {show_lr(lr)} | " + " | ".join(cells) + " |")
    return lines


def design_fit(table, name):
    """shape_fit.fit_design of one design over the shapes of a probe's table, each at its shown LR: {AR: its finished
    seeds' losses in seed order}."""
    losses = {}
    for L, d in shapes_of(table):
        _, result = shown(table, name, L, d)
        if result:
            by_seed = result.by_seed
            losses[d / L] = [by_seed[seed] for seed in sorted(by_seed) if compare.finite(by_seed[seed])]
    return shape_fit.fit_design(losses)


def fit_table(table, order):
    """Per design, its best aspect ratio at this budget (shape_fit: the vertex of a quadratic in ln AR fitted to the
    shapes' seed means, or the measured edge), the seed bootstrap's 95% interval, the curvature, the share of
    resamples with an interior minimum and the fit's rms residual."""
    lines = ["| design | best AR | 95% interval (seed bootstrap) | curvature d²loss/d(ln AR)² | interior minimum in "
             "| fit rms |", "|---|---|---|---|---|---|"]
    for name in order:
        fit = design_fit(table, name)
        if fit is None:
            lines.append(f"| {name} | — (needs three shapes with a finished seed) | — | — | — | — |")
            continue
        lines.append(f"| {name} | {fit.best_text()} | [{fit.low:.2g}, {fit.high:.2g}] | {fit.curvature:+.4f} | "
                     f"{fit.vertex_share:.0%} of resamples | {fit.rms:.4f} |")
    return lines


@dataclass
class Sections:
    """What mini.py knows of a probe beyond its runs' folder, for probe_report: its plan and its sweeps."""
    table4: list   # the LR each design chose per shape beside the paper's (mini.table4), markdown lines
    lrs: dict      # {design: the LR it chose at each shape, shallow to deep} (mini.chosen_lrs), for the glance
    sweep: list    # one line per swept cell (mini.sweep_lines); empty without a sweep


def probe_report(probe_name, table, order, known):
    """A probe's part of summary.md, from its table (collect) and `known` (Sections): the per-cell table, R scores at
    the deepest shape, Table 4, the table at a glance, the paired grid, every seed's loss, the best aspect ratio per
    design, every sweep run. Markdown lines."""
    rule = ("95% t interval of the mean over the seeds both finished; 'better'/'worse' only where it excludes 0, "
            "else 'unresolved' (depthbench/evaluation/compare.py)")
    lines = [f"## {probe_name}", "", *probe_table(probe_name, table, order), *deep_lines(table, order)]
    lines += ["", f"The LR each design chose per shape ({probe_name} probe; Table 4 of the paper: its optimum at "
              "400M):", "", *known.table4]
    lines += ["", f"At a glance ({probe_name} probe; the README's table): the shallowest and the deepest shape, mean "
              f"± half-range (seeds), and Δ vs Pre-LN paired by seed: its mean [{rule}], and on how many paired seeds "
              "the design is lower:", "", *glance(table, order, known.lrs)]
    lines += ["", f"Δ vs Pre-LN paired by seed ({probe_name} probe): the mean of the per-seed differences [{rule}], "
              "and on how many of the seeds both ran the design is lower:", "", *paired_grid(table, order)]
    lines += ["", f"Final val loss per seed ({probe_name} probe; each cell at its LR): what every interval above is "
              "computed from.", "", *seed_table(table, order)]
    lines += ["", f"Best aspect ratio per design ({probe_name} probe; depthbench/reports/shape_fit.py): the vertex of a "
              "quadratic in ln AR fitted to the shapes' seed means, or the measured edge where the fit has no "
              "minimum inside them (monotone, or concave); its 95% interval from "
              f"{shape_fit.BOOTSTRAP} resamples of each shape's seeds (RNG seed {shape_fit.RNG_SEED}), seed noise "
              "only; a best AR at the smallest measured AR: the design wants the deepest shape at this budget.", "",
              *fit_table(table, order)]
    if known.sweep:
        lines += ["", "LR sweep (first seed; final val loss at each LR, the chosen one in bold):", "", *known.sweep]
    lines.append("")
    return lines
