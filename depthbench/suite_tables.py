"""
suite_tables.py: what a mini suite folder's runs say, as markdown tables for mini.py's summary.md: one Result per
cell (design, shape, LR) from the run folders, its row with Δ vs Pre-LN (unpaired, and paired by seed through
depthbench/compare.py), R scores at the deepest shape, the paired grid (design x shape) and the README's table at a glance.
It reads run.json and diagnose.json; it trains nothing. mini.py plans and runs the suite; this file reports it.
"""
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from depthbench import common, compare, runlog
from depthbench.common import format_lr, read_json


def done_runs(folder):
    """{run dir: (state, run.json)} of the runs under a folder that are done, by common.run_state: 'finished' (its
    loss counts) or 'diverged' (a result too: never trained again, never chosen). 'partial' and 'new' runs are not
    done. run.json is read by type (depthbench/runlog.py): one that is not train.py's, or has a field missing or of
    another type, is a RunLogError naming the file and the field, never a result."""
    done = {}
    for path in sorted(Path(folder).glob("*/run.json")):
        state = common.run_state(path.parent)
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


def versus(losses, base, digits=4):
    """A design's final val loss against Pre-LN's at the same shape: the difference of the means, and
    whether it exceeds the seed spread (the two designs' ranges over seeds do not overlap)."""
    if not losses or not base:
        return "—"
    delta = np.mean(losses) - np.mean(base)
    apart = max(losses) < min(base) or min(losses) > max(base)
    if len(losses) == 1 or len(base) == 1:
        return f"{delta:+.{digits}f} (one seed)"
    return f"{delta:+.{digits}f} ({'beyond' if apart else 'within'} seed spread)"


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
        cols += [versus(result.loss, base.loss), pair.text(), pair.verdict()]
    else:
        cols += ["—", "—", "—"]
    if probe_name == "synthetic" and result.gaps:
        cols.append(" / ".join(f"{a:.2f}" for a in np.mean(result.gaps, 0)))
    elif probe_name == "synthetic":
        cols.append("—")
    wall = f"{np.mean(result.wall):.0f} s" if result.wall else "—"
    cols += [spread(result.rc, ".1%"), spread(result.rp, ".1%"), wall]
    return "| " + " | ".join(cols) + " |"


def probe_table(probe_name, table, order):
    """A probe's table: one row per (shape, design), shallow to deep, designs in `order` (--designs)."""
    head = ("| design | L | d | AR | LR | seeds | final val loss (mean ± half-range) | vs Pre-LN (unpaired) | Δ vs Pre-LN "
            "paired: mean [range], lower on | paired verdict |")
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


def paired_grid(table, order):
    """Δ vs Pre-LN paired by seed, design x shape: the mean of the per-seed differences, their range, and on how
    many of the seeds both ran the design is lower (compare.paired; a diverged seed counts against its design)."""
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
            parts = []
            if pair and pair.deltas:
                parts.append(f"{pair.mean:+.3f} [{pair.low:+.3f}, {pair.high:+.3f}]")
            if pair and pair.seeds:
                parts.append(f"{pair.lower}/{len(pair.seeds)} lower")
            cols.append(", ".join(parts) or "—")
        lines.append("| " + " | ".join(cols) + " |")
    return lines


def glance(table, order, lrs):
    """The README's table: per design, the final val loss at the shallowest and the deepest shape (mean ± half-range
    over seeds), its difference from Pre-LN's there (unpaired, with beyond/within the seed spread; and on how many
    paired seeds it is lower), and the LR it chose at each shape, shallow to deep: `lrs` {design: [LR or None]}."""
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
            delta = "—"
            if base:
                pair = compare.paired(result.by_seed, base.by_seed)
                delta = f"{versus(result.loss, base.loss, 3)}, lower on {pair.lower}/{len(pair.seeds)}"
            cols.append(delta)
        cols.append(" → ".join(show_lr(lr) if lr else "—" for lr in lrs[name]))
        lines.append("| " + " | ".join(cols) + " |")
    return lines
