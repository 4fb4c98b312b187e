"""
mini.py: Mini-DepthBench, the paper's experiment (loss vs aspect ratio per design, and why) at a scale
that one machine runs in an afternoon.

    python mini.py --text austen                           # the suite on 2 CPU cores -> runs/mini
    python mini.py --gpu --text austen                     # one GPU: a bigger budget, more tokens per param
    python mini.py --designs preln,hc --ar 32,9.1 --seeds 0 --steps 20 --lr 3e-3 --diag-samples 8 --out /tmp/toy
                                                           # a toy: 4 runs, 4 diagnoses, the figures (README: its time)
    python mini.py --text austen --probes text --designs all   # the paper's ten designs (the synthetic probe: three)
    python mini.py --text austen --probes text --designs all --report   # summary.md and figures of what is done

Each cell (probe, design, aspect ratio) trains at its best learning rate: the first seed at every LR of
--lr-sweep (in <probe>-lr/<cell>/), the other seeds at the winner (in <probe>/), each run `train.py --preset
mini`, --jobs at a time with one thread each; then diagnose.py, plot.py, depthbench/reports/plot_suite.py and summary.md
(per cell: LR, seeds, mean ± half-range, Δ vs Pre-LN paired by seed with its 95% interval, R scores; every seed's loss;
the LR each design chose beside the paper's; each design's best aspect ratio; every sweep run, a diverged one with its
step). Whatever is done is skipped, so the same command continues a stopped suite; a run is reused only with the
settings that made it, and the runs end with mini.py, kill -9 included (docs/reliability.md#process-lifetime). The
protocol in full: docs/results.md#what-minipy-does.
"""
import contextlib
import io
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from depthbench.files import common  # first, before data.py's numpy and torch: its excepthook makes a Ctrl-C during the imports one line
import data
from depthbench.files import runlog
from depthbench.files.common import ArgParser, comma_list, fail, format_lr, positive, read_json, seed_number, write_atomic
from depthbench.training import job_pool
from depthbench.training.job_pool import found_done, log_path  # noqa: F401 (the tests reach them as mini.<name>)
from depthbench.reports.suite_tables import (Sections, collect, diverged_step, done_runs, finished_runs, probe_report, shape_name,
                                     show_lr)

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
# the synthetic probe's designs with --designs all: it showed nothing at this budget (docs/results.md#synthetic-probe)
SYNTHETIC_DESIGNS = ("preln", "hc", "attnres")
# a suite given neither --seeds nor --deep-seeds: three seeds, five at the deepest shape (where R scores are coarsest)
SEEDS, DEEP_SEEDS = (0, 1, 2), (0, 1, 2, 3, 4)


class Cell(NamedTuple):
    """One cell of the suite: what its runs share; its seeds (and, while it sweeps, its LRs) vary."""
    probe: str    # "text" or "synthetic"
    ar: float     # aspect ratio d_model / n_layer, as given to train.py --ar
    design: str   # a key of residuals.RESIDUALS


def design(name):
    """argparse type: the name of a design (residuals.RESIDUALS), or 'all' (the paper's ten, paper_designs)."""
    from residuals import RESIDUALS
    if name not in RESIDUALS and name != "all":
        raise ValueError(name)
    return name


def paper_designs():
    """The paper's ten designs in its order: residuals.PAPER_DESIGNS (the release's extra baselines are not in it)."""
    from residuals import PAPER_DESIGNS
    return list(PAPER_DESIGNS)


def design_lr(text):
    """argparse type: 'deepnorm=1e-3' -> ('deepnorm', 0.001), a design trained at its own LR, no sweep."""
    name, sep, lr = text.partition("=")
    if not sep or name.strip() == "all":
        raise ValueError(text)
    return design(name.strip()), positive(float)(lr.strip())


design_lr.__name__ = "design=LR"  # argparse names the type in its one-line error


def with_all(names):
    """A --designs list with 'all' replaced by the paper's ten, repeats dropped."""
    out = []
    for name in names:
        out += paper_designs() if name == "all" else [name]
    return list(dict.fromkeys(out))


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
    add("--designs", type=comma_list(design), default="preln,hc,attnres", help="comma list; 'all': the paper's ten "
        "(default %(default)s)")
    add("--synthetic-designs", type=comma_list(design), help="the synthetic probe's designs (default: --designs; "
        f"with --designs all: {','.join(SYNTHETIC_DESIGNS)}, as the synthetic probe showed nothing at this budget)")
    add("--design-lr", type=comma_list(design_lr), default={}, help="comma list of design=LR: that design trains "
        "every seed at this LR, no sweep (e.g. deepnorm=1e-3)")
    add("--ar", type=comma_list(positive(float)), default="92,51,32,17,9.1", help="comma list of aspect ratios "
        "(default 92,51,32,17,9.1: L2, 3, 4, 6 and 9, the paper's range 76..9.1)")
    add("--seeds", type=comma_list(seed_number), help="comma list of seeds, at every shape unless --deep-seeds is "
        "given (default 0,1,2; 0-4 at the deepest)")
    add("--deep-seeds", type=comma_list(seed_number, empty=True), help="seeds at the deepest shape, where R scores are "
        "coarsest (default: --seeds when given, else 0,1,2,3,4; '' for --seeds)")
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
    once = p.add_mutually_exclusive_group()
    once.add_argument("--dry-run", action="store_true", help="print the train.py commands and stop")
    once.add_argument("--report", action="store_true", help="train and diagnose nothing: write summary.md and the "
                      "figures from the runs done so far (e.g. of a suite run in groups of designs, or still running)")
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
    argv.append("--resume")  # a run the suite's Ctrl-C stopped continues from its ckpt.pt (bit-exact), not anew
    return folder, label, argv


def designs_of(args, probe_name):
    """The designs a probe runs: --synthetic-designs for the synthetic probe (parse_args resolves its default; left
    unset, --designs), --designs for the text probe."""
    if probe_name == "synthetic" and args.synthetic_designs:
        return args.synthetic_designs
    return args.designs


def cells(args):
    """Every Cell, deepest shapes first (the slowest runs start early, so workers finish together)."""
    out = []
    for probe_name, ar in itertools.product(args.probes, sorted(set(args.ar))):
        out += [Cell(probe_name, ar, name) for name in designs_of(args, probe_name)]
    return out


def deepest(args):
    return min(args.ar)


def seeds_at(args, ar):
    """The seeds of a shape: --deep-seeds at the deepest ('' there: --seeds), --seeds elsewhere."""
    if ar == deepest(args) and args.deep_seeds:
        return args.deep_seeds
    return args.seeds


def sweeps(args, cell):
    """Whether this cell sweeps (else it takes its --design-lr, or the LR its design chose at the probe's deepest
    shape)."""
    if cell.design in args.design_lr:
        return False
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
    """A cell's LR: its --design-lr, else --lr, else the best of its sweep (with the extension), else its design's at
    the deepest shape; None when its sweep has no finished run yet."""
    if cell.design in args.design_lr:
        return args.design_lr[cell.design]
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


def planned_run(argv):
    """The RunConfig that train.py resolves for a job's command (python train.py ARGS), in this process through the
    same code (train.resolve_grid), or None: not a train.py job, or a command that does not resolve here (train.py
    says why, in the job's log, when it runs)."""
    if Path(argv[1]).name != "train.py":
        return None
    import train
    from depthbench.training import recipe
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = recipe.parse_args(argv[2:])
            (cfg,) = train.resolve_grid(args, world_size=1)
    except SystemExit:
        return None
    return cfg


def check_jobs(jobs):
    """{label: the job's run folder (None: not a train.py job)}. A folder that holds a run made with other settings
    than the job's (runlog.check_same_run: say an earlier suite of other --steps in this --out) is one line naming each
    setting and exit 2, before the phase starts anything: a run answers only for the settings that made it."""
    folders = {}
    for label, argv in jobs:
        cfg = planned_run(argv)
        folders[label] = None
        if cfg is None:
            continue
        folders[label] = Path(cfg.out) / cfg.name
        try:
            runlog.check_same_run(folders[label], cfg)
        except ValueError as e:  # a RunLogError too: a run.json of the wrong types
            fail("mini.py", e)
    return folders



def run_pool(jobs, n, what, log_dir, took=None):
    """job_pool.run_pool of (label, argv) jobs, their run folders checked first (check_jobs) -> the labels that
    failed."""
    return job_pool.run_pool(jobs, check_jobs(jobs), n=n, what=what, log_dir=log_dir, took=took)


def sweep_lines(args, probe):
    """One line per swept cell: every LR's final val loss (first seed; 'diverged at step N' where it did), the chosen
    one in bold."""
    lines = []
    for cell in cells(args):
        if cell.probe != probe or not sweeps(args, cell):
            continue
        losses, paths = sweep_result(args, cell)
        if not losses:
            continue
        best, ext = sweep_choice(losses), extension(args, losses)
        runs = []
        for lr, loss in sorted(losses.items()):
            text = f"{show_lr(lr)}: {loss:.4f}" if loss is not None else ""
            if loss is None:
                text = f"{show_lr(lr)}: diverged at step {diverged_step(read_json(paths[lr] / 'run.json'))}"
            if lr == best:
                text = f"**{text}**"
            runs.append(text)
        line = f"- {cell.design}, {shape_label(args, cell.probe, cell.ar)}: {' · '.join(runs)}"
        if ext:
            line += f" (best at the sweep's edge: extended once to {show_lr(ext)})"
        lines.append(line)
    return lines


def shape_label(args, probe_name, ar):
    """A table's name for the shape that --ar `ar` gave: 'AR 9.8 (L9, asked 9.1)' (suite_tables.shape_name: the AR of
    the shape solved at the budget, e.g. 9.1 gives L9 d88; the AR asked where it differs) read from a done sweep run
    of that AR; 'AR 9.1' before there is one."""
    for name in designs_of(args, probe_name):
        for _, run in done_runs(args.out / cell_folder(Cell(probe_name, ar, name))).values():
            L, d = run["config"]["n_layer"], run["config"]["d_model"]
            label = shape_name(L, d)
            if f"{d / L:.2g}" != f"{ar:.2g}":
                label = f"{label[:-1]}, asked {ar:g})"
            return label
    return f"AR {ar:g}"


def shapes_line(args):
    """'shapes: --ar 32 -> L4 d128 (AR 32), --ar 9.1 -> L9 d88 (AR 9.78)': each AR asked and the shape solved for it
    at the budget (train.py's, through planned_run), whose AR the run folders and the figures name."""
    parts = []
    for ar in sorted(set(args.ar), reverse=True):
        cell = Cell(args.probes[0], ar, designs_of(args, args.probes[0])[0])
        cfg = planned_run(job(args, cell.probe, cell, seed=0, lr=None)[2])
        got = "train.py's log says why it does not resolve"
        if cfg:
            got = f"L{cfg.n_layer} d{cfg.d_model} (AR {round(cfg.ar, 2):g})"
        parts.append(f"--ar {ar:g} -> {got}")
    return "shapes: " + ", ".join(parts) + "; the run folders and figures name the shape's AR"


def table4(args, probe_name="text"):
    """Table 4 on one machine, as markdown for docs/results.md: per design, the LR it chose at each shape (shallow
    to deep) beside the paper's optimum (the design class's paper_lr). '—': not swept yet; 'all diverged': no LR
    of its sweep finished; 'set': --design-lr."""
    from residuals import RESIDUALS
    ars = sorted(set(args.ar), reverse=True)
    head = "| design | paper's optimum | " + " | ".join(shape_label(args, probe_name, ar) for ar in ars) + " |"
    lines = [head, "|" + "---|" * (len(ars) + 2)]
    for name in designs_of(args, probe_name):
        chosen = []
        for ar in ars:
            cell = Cell(probe_name, ar, name)
            lr = chosen_lr(args, cell)
            text = show_lr(lr) if lr else "—"
            if lr is None and sweeps(args, cell) and sweep_result(args, cell)[0]:
                text = "all diverged"
            if name in args.design_lr:
                text += " (set)"
            chosen.append(text)
        paper = getattr(RESIDUALS.get(name), "paper_lr", None)
        lines.append(f"| {name} | {format_lr(paper) if paper else '—'} | " + " | ".join(chosen) + " |")
    return lines


def chosen_lrs(args, probe_name):
    """{design: the LR it chose at each shape, shallow to deep (None: not yet)}, for the table at a glance."""
    ars = sorted(set(args.ar), reverse=True)
    return {name: [chosen_lr(args, Cell(probe_name, ar, name)) for ar in ars] for name in designs_of(args, probe_name)}


def synthetic_note(args):
    """The one sentence on the synthetic probe where it runs fewer designs than the text probe."""
    if len(args.synthetic_designs) >= len(args.designs):
        return []
    where = "" if "synthetic" in args.probes else " (not run by this command)"
    return [f"The synthetic probe stays at {', '.join(args.synthetic_designs)}{where}: it showed nothing at this "
            "budget (docs/results.md#synthetic-probe).", ""]


def summary(args):
    """summary.md: per probe, suite_tables.probe_report of its runs (each cell's final val loss over seeds, Δ vs Pre-LN
    paired by seed with its 95% interval, R scores, the paired grid, every seed's loss, each design's best aspect
    ratio) with what mini.py knows: Table 4 (table4), the LRs chosen (chosen_lrs), the sweep runs (sweep_lines).
    Returns the markdown."""
    lines = ["# Mini-DepthBench summary", "", f"Command: `python mini.py {' '.join(sys.argv[1:])}`", ""]
    lines += synthetic_note(args)
    for probe_name in [p for p in args.probes if (args.out / p).is_dir()]:
        table, order = collect(args.out / probe_name), designs_of(args, probe_name)
        known = Sections(table4=table4(args, probe_name), lrs=chosen_lrs(args, probe_name),
                         sweep=sweep_lines(args, probe_name))
        lines += probe_report(probe_name, table, order, known)
    return "\n".join(lines)


def parse_args(argv):
    """The command line, with what its defaults depend on resolved: jobs, probes, the sweep's LRs. Every option given
    applies, or one line and exit 2 (check_applies)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = parser.given(args)
    if args.jobs is None:
        args.jobs = 1 if args.gpu else 2
    if args.probes is None:
        args.probes = ["text", "synthetic"] if args.text else ["synthetic"]
    if "text" in args.probes and not args.text:
        parser.error("the text probe needs --text ('austen', or a local corpus: a file, folder or quoted glob)")
    args.sweep = [] if args.lr else list(args.lr_sweep)
    if args.deep_seeds is None:  # --seeds alone: those seeds at every shape; neither: the paper-like five there
        args.deep_seeds = list(DEEP_SEEDS) if args.seeds is None else []
    args.seeds = args.seeds or list(SEEDS)
    synthetic = args.synthetic_designs or (SYNTHETIC_DESIGNS if "all" in args.designs else args.designs)
    args.designs, args.synthetic_designs = with_all(args.designs), with_all(synthetic)
    check_applies(parser, args, given)
    args.design_lr = dict(args.design_lr)
    return args


def check_applies(parser, args, given):
    """The options that would be silently ignored, refused: a design named twice in --design-lr (which LR?) or one
    this command does not run; --lr-sweep or --full-sweep beside --lr (no sweep), --full-sweep with no sweep;
    --synthetic-designs without the synthetic probe, --text without the text probe."""
    names = [name for name, _ in args.design_lr]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        parser.error(f"--design-lr names {twice[0]} twice: give each design one LR")
    run = {name for p in args.probes for name in designs_of(args, p)}
    unused = [name for name in names if name not in run]
    if unused:
        parser.error(f"--design-lr {unused[0]}: not a design this command runs ({', '.join(sorted(run))})")
    if args.lr and ("--lr-sweep" in given or args.full_sweep):
        parser.error("--lr trains every run at one LR, no sweep: --lr-sweep and --full-sweep do not apply")
    if args.full_sweep and not args.sweep:
        parser.error("--full-sweep widens the LR sweep, but --lr-sweep '' asks for none")
    if "--synthetic-designs" in given and "synthetic" not in args.probes:
        parser.error("--synthetic-designs applies to the synthetic probe, which --probes leaves out")
    if args.text and "text" not in args.probes:
        parser.error("--text is the text probe's corpus, but --probes leaves the text probe out")


def plan_line(args):
    """The whole grid up front, as each phase only learns its jobs from the one before: the sweep's runs, at most
    one edge run per sweeping cell, the seed runs (a sweeping cell's first seed is its sweep run) and the diagnoses."""
    sweeping = [cell for cell in cells(args) if sweeps(args, cell)]
    seed_runs = sum(len(seeds_at(args, cell.ar)) for cell in cells(args)) - len(sweeping)
    sweep_runs = len(sweeping) * len(args.sweep)
    return (f"plan: {sweep_runs} sweep runs, up to {len(sweeping) if args.sweep else 0} edge runs, {seed_runs} seed "
            f"runs, then diagnose.py on each finished seed run; what is done already is skipped")


def run_suite(args):
    """The three training phases, each following from the results before it, then diagnose.py on every finished run
    that lacks a diagnose.json and the figures -> the labels of the jobs that failed."""
    failed, took = [], []  # took: the training runs' seconds, for the ETA of every phase that trains
    phases = (("sweep", lambda: sweep_jobs(args)), ("sweep edge", lambda: sweep_jobs(args, extend=True)),
              ("train", lambda: seed_jobs(args)))
    print(plan_line(args), flush=True)
    for what, jobs in phases:
        failed += run_pool([(label, argv) for _, label, argv in jobs()], args.jobs, what, args.out / "logs", took=took)
    # diagnose.py writes diagnose.json beside each run's ckpt.pt; a missing or unreadable one is diagnosed again
    diag_jobs = []
    for probe_name in args.probes:
        for path in finished_runs(args.out / probe_name):
            if read_json(path / "diagnose.json") is None:
                argv = [sys.executable, str(HERE / "diagnose.py"), str(path), "--metrics", DIAG_METRICS,
                        "--num-samples", str(args.diag_samples)]
                diag_jobs.append((f"diagnose {path.name}", argv))
    failed += run_pool(diag_jobs, args.jobs, "diagnose", args.out / "logs")
    draw_figures(args)
    return failed


def draw_figures(args):
    """plot.py and plot_suite per probe, into figs/<probe>/ -> those that failed (each costs itself, not the suite)."""
    scripts = ([str(HERE / "plot.py")], ["-m", "depthbench.reports.plot_suite"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    failed = []  # each figure command that failed: 'plot.py synthetic (exit 1)' (--report exits 1 naming them)
    for probe_name in args.probes:
        if not (args.out / probe_name).is_dir():      # a report while the sweep runs
            print(f"figures of the {probe_name} probe: none yet (no seed run has started)")
            continue
        for script in scripts:
            # plot_suite: the figures across designs (Fig. 2 left with Δ vs Pre-LN paired, Fig. 6a/c at the deepest)
            command = [sys.executable, *script, str(args.out / probe_name), "--out", str(args.out / "figs" / probe_name)]
            code = subprocess.run(command, check=False, env=env, preexec_fn=common.end_with_parent()).returncode
            failed += [f"{Path(script[-1]).name} {probe_name} (exit {code})"] if code else []
    return failed


def report(args):
    """--report: summary.md and figures of the runs done so far, training nothing. No run, or a run.json the table cannot
    read: one line, exit 2, nothing written; then the figures: one that fails gives one line naming it, exit 1."""
    runs = [path for p in args.probes for sub in (p, f"{p}-lr") for path in (args.out / sub).glob("**/run.json")]
    if not runs:
        fail("mini.py", f"--report: {args.out} holds no run of the {' and '.join(args.probes)} probe (is --out the "
             "suite's folder?); nothing written")
    try:
        text = summary(args)
    except runlog.RunLogError as e:
        fail("mini.py", f"--report: {e}; nothing written (no figure, summary.md as it was): move the run folder "
             "away, or fix the field")
    failed = draw_figures(args)
    write_atomic(args.out / "summary.md", text)
    if failed:  # never "wrote the figures" when one was not drawn: one line naming each, exit 1
        fail("mini.py", f"--report: {', '.join(failed)} failed (its lines above); wrote {args.out / 'summary.md'}", code=1)
    print(f"wrote {args.out / 'summary.md'} and the figures in {args.out / 'figs'} from the runs done so far")


def suite(args):
    """The suite, with its folder locked: trained, diagnosed, drawn and summarized -> the exit code."""
    try:
        # One suite per folder, held to the end (released when this process ends, even killed). Each cell's log is
        # locked too (job_pool.open_log), with the run that writes it: a run of a killed suite keeps its log.
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
    lrs = f"LR {format_lr(args.lr)}" if args.lr else f"each at its best LR of {sweep}"
    for name, lr in args.design_lr.items():
        lrs += f", {name} at {format_lr(lr)}"
    designs = " + ".join(f"{p} x {len(designs_of(args, p))} designs" for p in args.probes)
    print(f"mini suite: {designs} x {len(args.ar)} ARs, seeds {seeds} (deepest: {deep}), {lrs}, {args.jobs} runs at a "
          f"time -> {args.out}")
    print(shapes_line(args), flush=True)
    failed = run_suite(args)
    text = summary(args)
    write_atomic(args.out / "summary.md", text)
    print(text)
    print(f"mini suite done in {(time.time() - t0) / 60:.1f} min; figures in {args.out / 'figs'}, "
          f"table in {args.out / 'summary.md'}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    lock.close()
    return 1 if failed else 0


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:  # the first phase; what follows depends on its results
        print("\n".join(" ".join(argv[1:]) for _, _, argv in sweep_jobs(args) or seed_jobs(args)))
        return 0
    try:
        return report(args) if args.report else suite(args)
    except runlog.RunLogError as e:  # a run.json the suite reads, of the wrong types: never a result
        fail("mini.py", f"{e}; move the run folder away, or fix the field")


if __name__ == "__main__":
    with common.one_line_faults("mini.py"):  # Ctrl-C or SIGTERM: the running trainings save, then one line
        sys.exit(main())
