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
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import data
from common import ArgParser, fail, format_lr, positive, read_json, seed_number, write_atomic

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


def listed(kind, empty=False):
    """argparse type: a comma list of items that `kind` accepts, kept as written (they go on train.py's command
    line and into run labels), repeats dropped; '' is the empty list where `empty` allows it."""
    def parse(text):
        items = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
        if not (items or empty):
            raise ValueError(text)
        for t in items:
            kind(t)
        return items
    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse


def design(name):
    """argparse type: the name of a design (residuals.RESIDUALS)."""
    from residuals import RESIDUALS
    if name not in RESIDUALS:
        raise ValueError(name)
    return name


def build_parser():
    p = ArgParser(prog="mini.py", description="Mini-DepthBench: train, diagnose and plot designs x shapes x seeds.")
    add = p.add_argument
    add("--out", type=Path, default=Path("runs/mini"), help="suite folder (default runs/mini)")
    add("--designs", type=listed(design), default="preln,hc,attnres", help="comma list (default %(default)s)")
    add("--ar", type=listed(positive(float)), default="92,51,32,17,9.1", help="comma list of aspect ratios (default "
        "92,51,32,17,9.1: L2, 3, 4, 6 and 9, the paper's range 76..9.1)")
    add("--seeds", type=listed(seed_number), default="0,1,2", help="comma list of seeds (default 0,1,2)")
    add("--deep-seeds", type=listed(seed_number, empty=True), default="0,1,2,3,4", help="seeds at the deepest "
        "shape, where R scores are coarsest (default 0,1,2,3,4; '' for --seeds)")
    add("--probes", default=None, help="text,synthetic (default: both when --text is given, else synthetic)")
    add("--text", help="real text for the text probe: 'austen' (six novels, downloaded once) or a .txt/.jsonl/"
        ".parquet file, folder or quoted glob")
    add("--steps", type=positive(), help="override every run's schedule length (a toy or a longer run)")
    add("--lr", type=positive(float), help="one peak LR for every run, no sweep (default: each cell at its best LR "
        "of --lr-sweep)")
    add("--lr-sweep", type=listed(positive(float), empty=True), default="1e-3,3e-3,1e-2", help="the LRs each (probe, "
        "design, shape) trains its first seed at; the lowest final val loss wins, and a best LR at an edge extends "
        "the sweep once by x3 (default 1e-3,3e-3,1e-2; '' for none: the preset's 3e-3)")
    add("--full-sweep", action="store_true", help="sweep every shape of the synthetic probe too (default: only its "
        "deepest; its other shapes take the LR each design chose there, to keep the suite near 3 h on 2 cores)")
    add("--diag-samples", type=positive(), default="32", help="diagnose.py's calibration windows per run (default 32)")
    add("--jobs", type=positive(), help="runs at a time (default 2; 1 with --gpu)")
    add("--gpu", action="store_true", help="one GPU: 10x the budget and more tokens per parameter (SCALES['gpu'])")
    add("--dry-run", action="store_true", help="print the train.py commands and stop")
    return p


def job(args, folder, probe, ar, design, seed, lr):
    """(folder, label, argv) of one train.py run of the suite; lr None: the preset's."""
    argv = [sys.executable, str(HERE / "train.py"), "--preset", "mini", "--residual", design, "--ar", f"{ar:g}",
            "--seed", seed, "--out", str(args.out / folder), *SCALES["gpu" if args.gpu else "cpu"][probe]]
    argv += ["--data", args.text, "--data-dir", str(args.out / "text-data"), "--tokenizer", TEXT_TOKENIZER] \
        if probe == "text" else []
    argv += ["--steps", str(args.steps)] if args.steps else []
    argv += ["--lr", lr] if lr else []
    return folder, f"{folder.split('/')[0]} {design} ar={ar:g} seed={seed}" + (f" lr={lr}" if lr else ""), argv


def cells(args):
    """Every (probe, AR, design), deepest shapes first (the slowest runs start early, so workers finish together)."""
    return list(itertools.product(args.probes, sorted({float(a) for a in args.ar}), args.designs))


def deepest(args):
    return min(float(a) for a in args.ar)


def seeds_at(args, ar):
    return args.deep_seeds or args.seeds if ar == deepest(args) else args.seeds


def sweeps(args, probe, ar):
    """Whether this cell sweeps (else it takes the LR its design chose at the probe's deepest shape)."""
    return bool(args.sweep) and (probe == "text" or args.full_sweep or ar == deepest(args))


def cell_folder(probe, ar, design):
    return f"{probe}-lr/{design}_ar{ar:g}"  # one folder per cell: its sweep runs, the first seed at every LR


def sweep_result(args, probe, ar, design):
    """{lr: final val loss (inf: diverged or none)} of a cell's finished sweep runs, and their run folders."""
    losses, paths = {}, {}
    for path, run in finished_runs(args.out / cell_folder(probe, ar, design)).items():
        lr, loss = run["config"]["lr"], (run.get("final") or {}).get("val_loss")
        losses[lr], paths[lr] = loss if loss is not None else math.inf, path
    return losses, paths


def extension(args, losses):
    """The one extra LR when the sweep's best is at an edge (x3 beyond it), else None."""
    sweep = sorted(args.sweep)
    best = min(sweep, key=lambda lr: losses.get(lr, math.inf))
    return best / 3 if best == sweep[0] and len(sweep) > 1 else best * 3 if best == sweep[-1] else None


def chosen_lr(args, probe, ar, design):
    """A cell's LR: --lr, else the argmin of its sweep (with the extension), else its design's at the deepest shape."""
    if args.lr or not args.sweep:
        return args.lr
    if not sweeps(args, probe, ar):
        return chosen_lr(args, probe, deepest(args), design)
    losses = sweep_result(args, probe, ar, design)[0]
    return min(losses, key=losses.get) if losses else None


def sweep_jobs(args, extend=False):
    """The first seed of every sweeping cell at each LR of the sweep, or (extend) at the one extension LR."""
    out = []
    for probe, ar, design in cells(args):
        if sweeps(args, probe, ar):
            lrs = args.sweep if not extend else [extension(args, sweep_result(args, probe, ar, design)[0])]
            out += [job(args, cell_folder(probe, ar, design), probe, ar, design, seeds_at(args, ar)[0], format_lr(lr))
                    for lr in lrs if lr]
    return out


def seed_jobs(args):
    """Every seed of every cell at its chosen LR, into the probe's folder; a sweeping cell's first seed is its
    sweep run at that LR, linked there, not trained again. A cell whose sweep has no finished run is left out."""
    out = []
    for probe, ar, design in cells(args):
        lr, seeds = chosen_lr(args, probe, ar, design), seeds_at(args, ar)
        if args.sweep and lr is None:
            continue
        if sweeps(args, probe, ar):
            path = sweep_result(args, probe, ar, design)[1].get(lr)
            link = args.out / probe / path.name if path else None
            if link and not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(os.path.relpath(path, link.parent))
            seeds = seeds[1:] if path else seeds
        out += [job(args, probe, probe, ar, design, seed, lr and format_lr(lr)) for seed in seeds]
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


def finished_runs(folder):
    """{run dir: run.json} of the finished runs under a folder."""
    runs = {path.parent: read_json(path) for path in sorted(Path(folder).glob("*/run.json"))}
    return {path: run for path, run in runs.items() if run and run.get("finished")}


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
    """One line per swept cell: every LR's final val loss (seed 0), the chosen one in bold."""
    lines = []
    for _, ar, design in [c for c in cells(args) if c[0] == probe and sweeps(args, *c[:2])]:
        losses = sweep_result(args, probe, ar, design)[0]
        if losses:
            best, ext = min(losses, key=losses.get), extension(args, losses)
            runs = " · ".join(f"**{format_lr(lr)}: {v:.4f}**" if lr == best else f"{format_lr(lr)}: {v:.4f}"
                              for lr, v in sorted(losses.items()))
            lines.append(f"- {design}, AR {ar:g}: {runs}"
                         + (f" (best at the sweep's edge: extended once to {format_lr(ext)})" if ext else ""))
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


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    args.jobs = args.jobs or (1 if args.gpu else 2)
    args.probes = list(dict.fromkeys((args.probes or ("text,synthetic" if args.text else "synthetic")).split(",")))
    if set(args.probes) - {"text", "synthetic"}:
        parser.error(f"--probes: choose from text, synthetic, got {','.join(args.probes)}")
    if "text" in args.probes and not args.text:
        parser.error("the text probe needs --text ('austen', or a local corpus: a file, folder or quoted glob)")
    args.sweep = [] if args.lr else [float(lr) for lr in args.lr_sweep]
    if args.dry_run:  # the first phase; what follows depends on its results
        print("\n".join(" ".join(argv[1:]) for _, _, argv in sweep_jobs(args) or seed_jobs(args)))
        return 0
    t0 = time.time()
    if "text" in args.probes:  # tokenized once here, not by two runs at the same time
        try:
            data.prepare(args.text, args.out / "text-data", TEXT_TOKENIZER)
        except data.DataError as e:
            fail("mini.py", e)
    print(f"mini suite: {len(args.probes)} probes x {len(args.designs)} designs x {len(args.ar)} ARs, seeds "
          f"{','.join(args.seeds)} (deepest: {','.join(args.deep_seeds or args.seeds)}), " +
          (f"LR {args.lr:g}" if args.lr else f"each at its best LR of {','.join(args.lr_sweep) or 'the preset'}") +
          f", {args.jobs} runs at a time -> {args.out}")
    failed = []
    for what, jobs in (("sweep", lambda: sweep_jobs(args)), ("sweep edge", lambda: sweep_jobs(args, extend=True)),
                       ("train", lambda: seed_jobs(args))):  # each phase's runs follow from the ones before
        failed += run_pool([(label, argv) for _, label, argv in jobs()], args.jobs, what, args.out / "logs")
    # diagnose.py writes diagnose.json beside each run's ckpt.pt; a missing or unreadable one is diagnosed again
    diag_jobs = [(f"diagnose {path.name}", [sys.executable, str(HERE / "diagnose.py"), str(path), "--metrics",
                                            DIAG_METRICS, "--num-samples", str(args.diag_samples)])
                 for probe in args.probes for path in finished_runs(args.out / probe)
                 if read_json(path / "diagnose.json") is None]
    failed += run_pool(diag_jobs, args.jobs, "diagnose", args.out / "logs")
    for probe in args.probes:
        subprocess.run([sys.executable, str(HERE / "plot.py"), str(args.out / probe), "--out",
                        str(args.out / "figs" / probe)], check=False)
    text = summary(args)
    write_atomic(args.out / "summary.md", text)
    print(text)
    print(f"mini suite done in {(time.time() - t0) / 60:.1f} min; figures in {args.out / 'figs'}, "
          f"table in {args.out / 'summary.md'}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
