"""
mini.py: Mini-DepthBench, the paper's experiment (loss vs aspect ratio per design, and why) at a scale
that one machine runs in an afternoon.

    python mini.py --text austen                           # the suite on 2 CPU cores -> runs/mini
    python mini.py --gpu --text austen                     # one GPU: a bigger budget, more tokens per param
    python mini.py --designs preln,hc --ar 92,9.1 --seeds 0 --steps 20 --out /tmp/toy   # a toy, in a minute

Each cell (probe, design, aspect ratio) trains at its best learning rate: the first seed at every LR of
--lr-sweep (in <probe>-lr/<cell>/), the other seeds at the winner (in <probe>/), each run `train.py --preset
mini`, --jobs at a time with one thread each; then diagnose.py, plot.py and summary.md. Whatever is done is
skipped, so the same command continues a stopped suite. The protocol in full: docs/results.md#what-minipy-does.
"""
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

import common
import data
from common import ArgParser, comma_list, fail, format_lr, positive, read_json, seed_number, write_atomic

HERE = Path(__file__).resolve().parent
TEXT_TOKENIZER = "bytes"  # the text probe's: main() tokenizes the corpus with it once, every run reads those shards
# train.py settings per probe and scale, on top of --preset mini (docs/results.md#the-regime-search)
SCALES = {
    "cpu": {"synthetic": ["--global-batch", "8", "--steps", "500"],  # on 2 cores: 0.64 tokens per parameter
            "text": ["--seq-len", "256", "--global-batch", "8", "--steps", "300"]},  # 0.77 tokens per parameter
    "gpu": {"synthetic": ["--params", "8M", "--global-batch", "128", "--steps", "6000", "--device", "cuda"],
            "text": ["--params", "8M", "--seq-len", "256", "--global-batch", "128", "--steps", "5000",
                     "--device", "cuda"]},
}
DIAG_METRICS = "causal,perm,pruning"
PROBES = ("text", "synthetic")


class Cell(NamedTuple):
    """One cell of the suite: what its runs share; its seeds (and, while it sweeps, its LRs) vary."""
    probe: str    # "text" or "synthetic"
    ar: float     # aspect ratio d_model / n_layer, as given to train.py --ar
    design: str   # a key of residuals.RESIDUALS


def design(name):
    """argparse type: the name of a design (residuals.RESIDUALS)."""
    from residuals import RESIDUALS
    if name not in RESIDUALS:
        raise ValueError(name)
    return name


def probe(name):
    """argparse type: the name of a probe."""
    if name not in PROBES:
        raise ValueError(name)
    return name


probe.__name__ = f"probe ({' or '.join(PROBES)})"  # argparse names the type in its one-line error


def build_parser():
    p = ArgParser(prog="mini.py", description="Mini-DepthBench: train, diagnose and plot designs x shapes x seeds.")
    add = p.add_argument
    add("--out", type=Path, default=Path("runs/mini"), help="suite folder (default runs/mini)")
    add("--designs", type=comma_list(design), default="preln,hc,attnres", help="comma list (default %(default)s)")
    add("--ar", type=comma_list(positive(float)), default="92,51,32,17,9.1", help="comma list of aspect ratios "
        "(default 92,51,32,17,9.1: L2, 3, 4, 6 and 9, the paper's range 76..9.1)")
    add("--seeds", type=comma_list(seed_number), default="0,1,2", help="comma list of seeds (default 0,1,2)")
    add("--deep-seeds", type=comma_list(seed_number, empty=True), default="0,1,2,3,4", help="seeds at the deepest "
        "shape, where R scores are coarsest (default 0,1,2,3,4; '' for --seeds)")
    add("--probes", type=comma_list(probe), help="text,synthetic (default: both when --text is given, else "
        "synthetic)")
    add("--text", help="real text for the text probe: 'austen' (six novels, downloaded once) or a .txt/.jsonl/"
        ".parquet file, folder or quoted glob")
    add("--steps", type=positive(), help="override every run's schedule length (a toy or a longer run)")
    add("--lr", type=positive(float), help="one peak LR for every run, no sweep (default: each cell at its best LR "
        "of --lr-sweep)")
    add("--lr-sweep", type=comma_list(positive(float), empty=True), default="1e-3,3e-3,1e-2", help="the LRs each "
        "(probe, design, shape) trains its first seed at; the lowest final val loss wins, and a best LR at an edge "
        "extends the sweep once by x3 (default 1e-3,3e-3,1e-2; '' for none: the preset's 3e-3)")
    add("--full-sweep", action="store_true", help="sweep every shape of the synthetic probe too (default: only its "
        "deepest; its other shapes take the LR each design chose there, to keep the suite near 3 h on 2 cores)")
    add("--diag-samples", type=positive(), default="32", help="diagnose.py's calibration windows per run (default 32)")
    add("--jobs", type=positive(), help="runs at a time (default 2; 1 with --gpu)")
    add("--gpu", action="store_true", help="one GPU: 10x the budget and more tokens per parameter (SCALES['gpu'])")
    add("--dry-run", action="store_true", help="print the train.py commands and stop")
    return p


def job(args, folder, cell, seed, lr):
    """(folder, label, argv) of one train.py run of the suite: `cell` with `seed` (an int) at `lr` (a float; None:
    the preset's), into args.out / folder."""
    scale = "gpu" if args.gpu else "cpu"
    argv = [sys.executable, str(HERE / "train.py"), "--preset", "mini", "--residual", cell.design, "--ar",
            f"{cell.ar:g}", "--seed", str(seed), "--out", str(args.out / folder), *SCALES[scale][cell.probe]]
    if cell.probe == "text":
        argv += ["--data", args.text, "--data-dir", str(args.out / "text-data"), "--tokenizer", TEXT_TOKENIZER]
    if args.steps:
        argv += ["--steps", str(args.steps)]
    label = f"{folder.split('/')[0]} {cell.design} ar={cell.ar:g} seed={seed}"
    if lr:
        argv += ["--lr", format_lr(lr)]
        label += f" lr={format_lr(lr)}"
    return folder, label, argv


def cells(args):
    """Every Cell, deepest shapes first (the slowest runs start early, so workers finish together)."""
    return [Cell(*c) for c in itertools.product(args.probes, sorted(set(args.ar)), args.designs)]


def deepest(args):
    return min(args.ar)


def seeds_at(args, ar):
    """The seeds of a shape: --deep-seeds at the deepest ('' there: --seeds), --seeds elsewhere."""
    if ar == deepest(args) and args.deep_seeds:
        return args.deep_seeds
    return args.seeds


def sweeps(args, cell):
    """Whether this cell sweeps (else it takes the LR its design chose at the probe's deepest shape)."""
    return bool(args.sweep) and (cell.probe == "text" or args.full_sweep or cell.ar == deepest(args))


def cell_folder(cell):
    """One folder per cell for its sweep runs, the first seed at every LR."""
    return f"{cell.probe}-lr/{cell.design}_ar{cell.ar:g}"


def sweep_result(args, cell):
    """{lr: final val loss (None: diverged)} of a cell's done sweep runs, and their run folders."""
    losses, paths = {}, {}
    for path, (state, run) in done_runs(args.out / cell_folder(cell)).items():
        lr = run["config"]["lr"]
        losses[lr] = (run.get("final") or {}).get("val_loss") if state == "finished" else None
        paths[lr] = path
    return losses, paths


def sweep_choice(losses):
    """The best LR of {lr: one seed's final val loss, None where it diverged} (common.best_lr, the rule plot.py's
    Fig. 2 uses): with one seed per LR, the argmin; a diverged LR never wins. None when none has a loss."""
    return common.best_lr({lr: [loss] for lr, loss in losses.items()})


def extension(args, losses):
    """The one extra LR when the sweep's best (of its own LRs) is at an edge: x3 beyond it; else None. A sweep of
    one LR extends upwards."""
    sweep = sorted(args.sweep)
    best = sweep_choice({lr: losses.get(lr) for lr in sweep})
    if best == sweep[0] and len(sweep) > 1:
        return best / 3
    if best == sweep[-1]:
        return best * 3
    return None


def chosen_lr(args, cell):
    """A cell's LR: --lr, else the best of its sweep (with the extension), else its design's at the deepest shape;
    None when its sweep has no finished run yet."""
    if args.lr or not args.sweep:
        return args.lr
    if not sweeps(args, cell):
        return chosen_lr(args, cell._replace(ar=deepest(args)))
    return sweep_choice(sweep_result(args, cell)[0])


def sweep_jobs(args, extend=False):
    """The first seed of every sweeping cell at each LR of the sweep, or (extend) at the one extension LR."""
    out = []
    for cell in cells(args):
        if not sweeps(args, cell):
            continue
        lrs = args.sweep
        if extend:
            lrs = [extension(args, sweep_result(args, cell)[0])]
        seed = seeds_at(args, cell.ar)[0]
        for lr in lrs:
            if lr:
                out.append(job(args, cell_folder(cell), cell, seed=seed, lr=lr))
    return out


def seed_jobs(args):
    """Every seed of every cell at its chosen LR, into the probe's folder; a sweeping cell's first seed is its
    sweep run at that LR, linked there, not trained again. A cell whose sweep has no finished run is left out."""
    out = []
    for cell in cells(args):
        lr, seeds = chosen_lr(args, cell), seeds_at(args, cell.ar)
        if args.sweep and lr is None:
            continue
        if sweeps(args, cell):
            path = sweep_result(args, cell)[1].get(lr)
            if path:
                link = args.out / cell.probe / path.name
                if not link.exists():
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to(os.path.relpath(path, link.parent))
                seeds = seeds[1:]
        out += [job(args, cell.probe, cell, seed=seed, lr=lr) for seed in seeds]
    return out


def run_pool(jobs, n, what, log_dir):
    """Run (label, argv) jobs, n at a time, one thread each; print a progress line per finished job.
    Returns the labels that failed (their logs say why)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    pending, running, failed, t0, done = list(jobs), {}, [], time.time(), 0
    while pending or running:
        while pending and len(running) < n:
            label, argv = pending.pop(0)
            log = open(log_dir / (label.replace(" ", "_").replace("=", "") + ".log"), "w")
            running[subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)] = (label, log, time.time())
        for proc in [p for p in running if p.poll() is not None]:
            label, log, start = running.pop(proc)
            log.close()
            done += 1
            if proc.returncode != 0:
                failed.append(label)
            elapsed = time.time() - t0
            eta = elapsed / done * (len(jobs) - done)
            print(f"[{what} {done}/{len(jobs)}] {label}: {'ok' if proc.returncode == 0 else 'FAILED'} in "
                  f"{time.time() - start:.0f} s | elapsed {elapsed / 60:.1f} min, ETA {eta / 60:.1f} min", flush=True)
        time.sleep(0.2)
    return failed


def done_runs(folder):
    """{run dir: (state, run.json)} of the runs under a folder that are done, by common.run_state: 'finished' (its
    loss counts) or 'diverged' (a result too: never trained again, never chosen). 'partial' and 'new' runs are not
    done, nor is a folder whose run.json is not train.py's (train.py refuses it, in the cell's log)."""
    done = {}
    for path in sorted(Path(folder).glob("*/run.json")):
        try:
            state = common.run_state(path.parent)
        except ValueError:
            continue
        if state in ("finished", "diverged"):
            done[path.parent] = (state, read_json(path))
    return done


def finished_runs(folder):
    """{run dir: run.json} of the finished runs under a folder: the ones with a loss to report and diagnose."""
    return {path: run for path, (state, run) in done_runs(folder).items() if state == "finished"}


def spread(values, fmt=".4f"):
    """'mean ± half-range' over seeds ('—' for none)."""
    if not values:
        return "—"
    return f"{np.mean(values):{fmt}} ± {(max(values) - min(values)) / 2:{fmt}}"


def versus(losses, base):
    """A design's final val loss against Pre-LN's at the same shape: the difference of the means, and
    whether it exceeds the seed spread (the two designs' ranges over seeds do not overlap)."""
    if not losses or not base:
        return "—"
    delta = np.mean(losses) - np.mean(base)
    apart = max(losses) < min(base) or min(losses) > max(base)
    if len(losses) == 1 or len(base) == 1:
        return f"{delta:+.4f} (one seed)"
    return f"{delta:+.4f} ({'beyond' if apart else 'within'} seed spread)"


def collect(folder):
    """{(design, L, d, lr): {"loss", "gaps", "rc", "rp", "wall", "seed"} lists over seeds} of a folder's runs."""
    cells = {}
    for path, run in finished_runs(folder).items():
        c = run["config"]
        diag = read_json(path / "diagnose.json") or {}  # unreadable: as missing (main diagnoses it again)
        cell = cells.setdefault((c["residual"], c["n_layer"], c["d_model"], c["lr"]),
                                {"loss": [], "gaps": [], "rc": [], "rp": [], "wall": [], "seed": []})
        cell["loss"].append(run["final"]["val_loss"])
        cell["wall"].append(run["wall_s"])
        cell["seed"].append(c.get("seed"))
        per = run["evals"][-1].get("per_level") or {}
        cell["gaps"].append([per[g]["acc"] for g in sorted(per)])
        for key, metric, field in (("rc", "causal_score", "R_causal"), ("rp", "permutation_score", "R_perm")):
            # R_perm: the last three quarters (diagnose/2); None: too shallow to have pairs there
            if diag.get(metric, {}).get(field) is not None:
                cell[key].append(diag[metric][field])
    return cells


def sweep_lines(args, probe):
    """One line per swept cell: every LR's final val loss (first seed; 'diverged' where it did), the chosen one in
    bold."""
    lines = []
    for cell in cells(args):
        if cell.probe != probe or not sweeps(args, cell):
            continue
        losses = sweep_result(args, cell)[0]
        if not losses:
            continue
        best, ext = sweep_choice(losses), extension(args, losses)
        runs = []
        for lr, loss in sorted(losses.items()):
            text = f"{format_lr(lr)}: " + ("diverged" if loss is None else f"{loss:.4f}")
            if lr == best:
                text = f"**{text}**"
            runs.append(text)
        line = f"- {cell.design}, AR {cell.ar:g}: {' · '.join(runs)}"
        if ext:
            line += f" (best at the sweep's edge: extended once to {format_lr(ext)})"
        lines.append(line)
    return lines


def summary(args):
    """summary.md: per probe, design and shape, at the cell's LR, the final val loss over seeds and its difference
    from Pre-LN's; per-gap answer accuracy for the synthetic probe; R_causal / R_perm (last 3/4) from diagnose.py,
    per seed at the deepest shape; then every sweep run. Returns the markdown."""
    lines = ["# Mini-DepthBench summary", "", f"Command: `python mini.py {' '.join(sys.argv[1:])}`", ""]
    for probe in [p for p in args.probes if (args.out / p).is_dir()]:
        table = collect(args.out / probe)
        head = "| design | L | d | AR | LR | seeds | final val loss (mean ± half-range) | vs Pre-LN |"
        head += " answer acc by gap (mean over seeds) |" if probe == "synthetic" else ""
        head += " R_causal | R_perm last 3/4 | wall per run |"
        lines += [f"## {probe}", "", head, "|" + "---|" * (head.count("|") - 1)]
        for (res, L, d, lr), cell in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            base = next((c["loss"] for k, c in table.items() if k[:3] == ("preln", L, d) and res != "preln"), None)
            row = (f"| {res} | {L} | {d} | {d / L:.1f} | {lr:g} | {len(cell['loss'])} | {spread(cell['loss'])} | "
                   f"{versus(cell['loss'], base)} |")
            if probe == "synthetic":
                row += " " + " / ".join(f"{a:.2f}" for a in np.mean(cell["gaps"], 0)) + " |"
            row += f" {spread(cell['rc'], '.1%')} | {spread(cell['rp'], '.1%')} | {np.mean(cell['wall']):.0f} s |"
            lines.append(row)
        deep = max((k[1] for k in table), default=None)
        if deep:
            lines += ["", f"R scores at the deepest shape (L{deep}), per seed:", ""]
            for (res, L, d, lr), cell in sorted(table.items()):
                if L == deep and cell["rc"]:
                    rc, rp = (", ".join(f"{v:.1%}" for v in cell[key]) for key in ("rc", "rp"))
                    lines.append(f"- {res}: R_causal {rc}; R_perm {rp} (seeds {', '.join(map(str, cell['seed']))})")
        sweep = sweep_lines(args, probe)
        if sweep:
            lines += ["", "LR sweep (first seed; final val loss at each LR, the chosen one in bold):", "", *sweep]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv):
    """The command line, with what its defaults depend on resolved: jobs, probes, the sweep's LRs."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.jobs is None:
        args.jobs = 1 if args.gpu else 2
    if args.probes is None:
        args.probes = ["text", "synthetic"] if args.text else ["synthetic"]
    if "text" in args.probes and not args.text:
        parser.error("the text probe needs --text ('austen', or a local corpus: a file, folder or quoted glob)")
    args.sweep = [] if args.lr else list(args.lr_sweep)
    return args


def run_suite(args):
    """The three training phases, each following from the results before it, then diagnose.py on every finished run
    that lacks a diagnose.json and plot.py per probe -> the labels of the jobs that failed."""
    failed = []
    phases = (("sweep", lambda: sweep_jobs(args)), ("sweep edge", lambda: sweep_jobs(args, extend=True)),
              ("train", lambda: seed_jobs(args)))
    for what, jobs in phases:
        failed += run_pool([(label, argv) for _, label, argv in jobs()], args.jobs, what, args.out / "logs")
    # diagnose.py writes diagnose.json beside each run's ckpt.pt; a missing or unreadable one is diagnosed again
    diag_jobs = []
    for probe_name in args.probes:
        for path in finished_runs(args.out / probe_name):
            if read_json(path / "diagnose.json") is None:
                argv = [sys.executable, str(HERE / "diagnose.py"), str(path), "--metrics", DIAG_METRICS,
                        "--num-samples", str(args.diag_samples)]
                diag_jobs.append((f"diagnose {path.name}", argv))
    failed += run_pool(diag_jobs, args.jobs, "diagnose", args.out / "logs")
    for probe_name in args.probes:
        subprocess.run([sys.executable, str(HERE / "plot.py"), str(args.out / probe_name), "--out",
                        str(args.out / "figs" / probe_name)], check=False)
    return failed


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:  # the first phase; what follows depends on its results
        print("\n".join(" ".join(argv[1:]) for _, _, argv in sweep_jobs(args) or seed_jobs(args)))
        return 0
    try:
        # One suite per folder, held to the end (released when this process ends, even killed). It also keeps each
        # cell's log to the process that trains it: run_pool opens logs/<cell>.log with "w" before train.py locks
        # the run folder, so without this a second mini.py would truncate the log of a run the first is training.
        lock = common.lock_folder(args.out)
    except ValueError as e:
        fail("mini.py", e)
    t0 = time.time()
    if "text" in args.probes:  # tokenized once here, not by two runs at the same time
        try:
            data.prepare(args.text, args.out / "text-data", TEXT_TOKENIZER)
        except data.DataError as e:
            fail("mini.py", e)
    seeds, deep = ",".join(map(str, args.seeds)), ",".join(map(str, args.deep_seeds or args.seeds))
    sweep = ",".join(map(format_lr, args.lr_sweep)) or "the preset"
    lrs = f"LR {args.lr:g}" if args.lr else f"each at its best LR of {sweep}"
    print(f"mini suite: {len(args.probes)} probes x {len(args.designs)} designs x {len(args.ar)} ARs, seeds {seeds} "
          f"(deepest: {deep}), {lrs}, {args.jobs} runs at a time -> {args.out}")
    failed = run_suite(args)
    text = summary(args)
    write_atomic(args.out / "summary.md", text)
    print(text)
    print(f"mini suite done in {(time.time() - t0) / 60:.1f} min; figures in {args.out / 'figs'}, "
          f"table in {args.out / 'summary.md'}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    lock.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
