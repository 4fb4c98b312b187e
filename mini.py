"""
mini.py: Mini-DepthBench, the paper's experiment (loss vs aspect ratio per design, and why) at a scale
that one machine runs in an afternoon.

    python mini.py --text austen                           # the suite on 2 CPU cores -> runs/mini
    python mini.py --gpu --text austen                     # one GPU: a bigger budget, more tokens per param
    python mini.py --designs preln,hc --ar 92,9.1 --seeds 0 --steps 20 --out /tmp/toy   # a toy, in a minute

For each probe (real text read as bytes, and the synthetic composition task scored on answers alone),
design, aspect ratio and seed it trains one model with `train.py --preset mini`, --jobs runs at a time
with one thread each (on 2 cores, two 1-thread runs beat one 2-thread run); then `diagnose.py` on every
finished run; then `plot.py` on each probe's folder, and a table of the outcome in summary.md. Every
piece that is already done is skipped, so the same command continues a stopped suite.
"""
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import data
from common import ArgParser, fail, positive, read_json, seed_number, write_atomic

HERE = Path(__file__).resolve().parent
TEXT_TOKENIZER = "bytes"  # the text probe's: main() tokenizes the corpus with it once, every run reads those shards
# train.py settings per probe and scale (on top of --preset mini); see the README's mini-suite section
SCALES = {
    # 2 cores, under 2 h for 3 designs x 5 ARs x 2 seeds x 2 probes (README: the regime search)
    "cpu": {"synthetic": ["--global-batch", "8", "--steps", "500"],
            "text": ["--seq-len", "256", "--global-batch", "8", "--steps", "300"]},
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
    p = ArgParser(prog="mini.py", description="Mini-DepthBench: train, diagnose and plot a design x shape x seed grid.")
    add = p.add_argument
    add("--out", type=Path, default=Path("runs/mini"), help="suite folder (default runs/mini)")
    add("--designs", type=listed(design), default="preln,hc,attnres", help="comma list of designs (default "
        "preln,hc,attnres)")
    add("--ar", type=listed(positive(float)), default="92,51,32,17,9.1", help="comma list of aspect ratios (default "
        "92,51,32,17,9.1: L2, 3, 4, 6 and 9, the paper's range 76..9.1)")
    add("--seeds", type=listed(seed_number), default="0,1", help="comma list of seeds (default 0,1)")
    add("--probes", default=None, help="text,synthetic (default: both when --text is given, else synthetic)")
    add("--text", help="real text for the text probe: 'austen' (six novels, downloaded once) or a .txt/.jsonl/"
        ".parquet file, folder or quoted glob")
    add("--steps", type=positive(), help="override every run's schedule length (a toy or a longer run)")
    add("--lr", type=positive(float), help="peak LR for every run (default: the mini preset's, 3e-3)")
    add("--lr-sweep", type=listed(positive(float), empty=True), default="1e-3,1e-2", help="more LRs for each design "
        "at --sweep-ar, first seed only, in <probe>-lr/ (default 1e-3,1e-2, around the preset's 3e-3; '' for none)")
    add("--sweep-ar", default="9.1", type=positive(float), help="the shape of the LR sweep (default 9.1)")
    add("--diag-samples", type=positive(), default="32", help="diagnose.py's calibration windows per run (default 32)")
    add("--jobs", type=positive(), help="runs at a time (default 2; 1 with --gpu)")
    add("--gpu", action="store_true", help="one GPU: 10x the budget and more tokens per parameter (SCALES['gpu'])")
    add("--dry-run", action="store_true", help="print the train.py commands and stop")
    return p


def train_commands(args):
    """One (folder, label, argv) per run, in the order they will run: the LR sweep, then the grid deepest
    first (the slowest runs start early, so two workers finish together)."""
    scale = SCALES["gpu" if args.gpu else "cpu"]
    ars, designs, seeds = sorted({float(a) for a in args.ar}), args.designs, args.seeds
    runs = [(f"{p}-lr", p, args.sweep_ar, d, seeds[0], lr)
            for p, d, lr in itertools.product(args.probes, designs, args.lr_sweep)]
    runs += [(p, p, ar, d, s, args.lr) for p, ar, d, s in itertools.product(args.probes, ars, designs, seeds)]
    jobs = []
    for folder, probe, ar, design, seed, lr in runs:
        argv = [sys.executable, str(HERE / "train.py"), "--preset", "mini", "--residual", design,
                "--ar", f"{ar:g}", "--seed", seed, "--out", str(args.out / folder), *scale[probe]]
        argv += ["--data", args.text, "--data-dir", str(args.out / "text-data"), "--tokenizer", TEXT_TOKENIZER] \
            if probe == "text" else []
        argv += ["--steps", str(args.steps)] if args.steps else []
        argv += ["--lr", str(lr)] if lr else []
        jobs.append((folder, f"{folder} {design} ar={ar:g} seed={seed}" + (f" lr={lr}" if lr else ""), argv))
    return jobs


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
    """{run dir: run.json} of the finished runs under a probe's folder."""
    runs = {}
    for path in sorted(Path(folder).glob("*/run.json")):
        run = read_json(path)
        if run and run.get("finished"):
            runs[path.parent] = run
    return runs


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
    """{(design, L, d, lr): {"loss", "gaps", "rc", "rp", "wall"} lists over seeds} of a probe folder's runs."""
    cells = {}
    for path, run in finished_runs(folder).items():
        c = run["config"]
        diag = read_json(path / "diagnose.json") or {}  # unreadable: as missing (main diagnoses it again)
        cell = cells.setdefault((c["residual"], c["n_layer"], c["d_model"], c["lr"]),
                                {"loss": [], "gaps": [], "rc": [], "rp": [], "wall": []})
        cell["loss"].append(run["final"]["val_loss"])
        cell["wall"].append(run["wall_s"])
        per = run["evals"][-1].get("per_level") or {}
        cell["gaps"].append([per[g]["acc"] for g in sorted(per)])
        for key, metric, field in (("rc", "causal_score", "R_causal"), ("rp", "permutation_score", "R_perm")):
            # R_perm: the last three quarters (diagnose/2); None: too shallow to have pairs there
            if diag.get(metric, {}).get(field) is not None:
                cell[key].append(diag[metric][field])
    return cells


def summary(args):
    """summary.md: per probe (and its LR sweep), design and shape the final val loss over seeds and its
    difference from Pre-LN's; per-gap answer accuracy for the synthetic probe; R_causal / R_perm (last 3/4)
    from diagnose.py. Returns the markdown."""
    lines = ["# Mini-DepthBench summary", "",
             f"Command: `python mini.py {' '.join(sys.argv[1:])}`", ""]
    for folder in [f for p in args.probes for f in (p, f"{p}-lr") if (args.out / f).is_dir()]:
        cells = collect(args.out / folder)
        head = "| design | L | d | AR | LR | final val loss (mean ± half-range, seeds) | vs Pre-LN |"
        head += " answer acc by gap (mean over seeds) |" if folder.startswith("synthetic") else ""
        head += " R_causal | R_perm last 3/4 | wall per run |"
        lines += [f"## {folder}", "", head, "|" + "---|" * (head.count("|") - 1)]
        for (res, L, d, lr), cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][3], kv[0][0])):
            base = cells.get(("preln", L, d, lr), {}).get("loss") if res != "preln" else None
            row = (f"| {res} | {L} | {d} | {d / L:.1f} | {lr:g} | {spread(cell['loss'])} ({len(cell['loss'])}) | "
                   f"{versus(cell['loss'], base)} |")
            if folder.startswith("synthetic"):
                row += " " + " / ".join(f"{a:.2f}" for a in np.mean(cell["gaps"], 0)) + " |"
            row += f" {spread(cell['rc'], '.1%')} | {spread(cell['rp'], '.1%')} | {np.mean(cell['wall']):.0f} s |"
            lines.append(row)
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
    jobs = train_commands(args)
    if args.dry_run:
        print("\n".join(" ".join(argv[1:]) for _, _, argv in jobs))
        return 0
    t0 = time.time()
    if "text" in args.probes:  # tokenized once here, not by two runs at the same time
        try:
            data.prepare(args.text, args.out / "text-data", TEXT_TOKENIZER)
        except data.DataError as e:
            fail("mini.py", e)
    print(f"mini suite: {len(jobs)} runs ({len(args.probes)} probes x {len(args.designs)} designs x "
          f"{len(args.ar)} ARs x {len(args.seeds)} seeds, and the LR sweep: "
          f"{sum(f.endswith('-lr') for f, _, _ in jobs)} runs at AR {args.sweep_ar:g}), {args.jobs} at a time -> {args.out}")
    failed = run_pool([(label, argv) for _, label, argv in jobs], args.jobs, "train", args.out / "logs")
    diag_jobs = []
    for probe in args.probes:
        for path in finished_runs(args.out / probe):
            if read_json(path / "diagnose.json") is None:  # missing, or unreadable: diagnosed again
                diag_jobs.append((f"diagnose {path.name}",  # writes diagnose.json beside the run's ckpt.pt
                                  [sys.executable, str(HERE / "diagnose.py"), str(path), "--metrics", DIAG_METRICS,
                                   "--num-samples", str(args.diag_samples)]))
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
