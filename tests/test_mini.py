"""
Tests of mini.py, the one-machine suite: the suite command at a toy size (two designs, two shapes, a few
steps) trains, diagnoses and plots every run, writes the summary, and a second call skips what is done.

    python -m pytest -q tests/test_mini.py
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from depthbench.files import common
import mini
from depthbench.reports import suite_tables
from depthbench.training import job_pool
from test_train import run_json

ROOT = Path(__file__).resolve().parents[1]  # the repository root
# the paper's ten designs in its order (Figure 2, Table 4): what --designs all must mean
PAPER_TEN = ["preln", "sandwich", "lns", "deepnorm", "keel", "hc", "mhc", "attnres", "block_attnres", "moda"]


def test_seeds_given_alone_apply_at_every_shape():
    """--seeds without --deep-seeds: those seeds at every shape, the deepest too (the README's toy trains one seed
    per cell); a suite given neither: 0,1,2, and 0-4 at the deepest; --deep-seeds given: it, at the deepest only."""
    given = mini.parse_args(["--designs", "preln,hc", "--ar", "32,9.1", "--seeds", "0", "--lr", "3e-3"])
    assert mini.seeds_at(given, 9.1) == mini.seeds_at(given, 32) == [0]
    assert len(mini.seed_jobs(given)) == 2 * 2 and "4 seed runs" in mini.plan_line(given)
    neither = mini.parse_args(["--designs", "preln", "--ar", "32,9.1"])
    assert (mini.seeds_at(neither, 32), mini.seeds_at(neither, 9.1)) == ([0, 1, 2], [0, 1, 2, 3, 4])
    both = mini.parse_args(["--designs", "preln", "--ar", "32,9.1", "--seeds", "0", "--deep-seeds", "0,1"])
    assert (mini.seeds_at(both, 32), mini.seeds_at(both, 9.1)) == ([0], [0, 1])


def test_the_readmes_toy_is_as_small_as_it_says():
    """The README's toy line (the one timed there): no LR sweep, one seed per cell at both shapes, its runs as many
    as its comment says."""
    (line,) = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("python mini.py")
               and "# a toy" in line]
    args = mini.parse_args(line.split("#")[0].split()[2:])
    runs = len(mini.sweep_jobs(args)) + len(mini.seed_jobs(args))
    assert mini.sweep_jobs(args) == [] and f"a toy: {runs} runs, {runs} diagnoses" in line and runs == 4


def test_the_header_says_each_ar_asked_and_the_shape_it_gave():
    """--ar 9.1 solves to L9 d88, whose AR (9.78) names the run folders: the suite's header says both, and the run
    records the AR asked (RunConfig.ar_asked) for its figures."""
    args = mini.parse_args(["--designs", "preln", "--ar", "9.1,32", "--seeds", "0"])
    assert mini.shapes_line(args).startswith("shapes: --ar 32 -> L4 d128 (AR 32), --ar 9.1 -> L9 d88 (AR 9.78); ")
    deepest = mini.planned_run(mini.sweep_jobs(args)[0][2])   # the run records both: its figures say both
    assert (deepest.n_layer, round(deepest.ar, 2), deepest.ar_asked) == (9, 9.78, 9.1)


@pytest.mark.slow
def test_toy_suite_sweeps_selects_and_resumes(tmp_path):
    """The toy grid with a 2-LR sweep at every shape: each cell's first seed trains at both LRs (and, the best
    being at an edge, once more x3 beyond it); the cell's LR is the argmin of those final losses; the second
    seed trains only at it; diagnostics, figures and summary.md follow; the same command again does nothing."""
    argv = [sys.executable, "mini.py", "--designs", "preln,attnres", "--ar", "32,9.1", "--seeds", "0,1",
            "--deep-seeds", "", "--steps", "2", "--lr-sweep", "1e-3,1e-2", "--full-sweep", "--diag-samples", "2",
            "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sweep = {}  # (design, L) -> {lr: final val loss}
    for p in (tmp_path / "synthetic-lr").glob("*/*/run.json"):
        run = json.loads(p.read_text())
        assert run["finished"] and run["config"]["seed"] == 0
        sweep.setdefault((run["config"]["residual"], run["config"]["n_layer"]), {})[run["config"]["lr"]] = \
            run["final"]["val_loss"]
    assert len(sweep) == 4                                          # 2 designs x 2 shapes, each swept
    grid = [json.loads(p.read_text()) for p in (tmp_path / "synthetic").glob("*/run.json")]
    assert len(grid) == 8 and all(run["finished"] for run in grid)  # 4 cells x 2 seeds
    for cell, losses in sweep.items():
        edge = min((1e-3, 1e-2), key=losses.get)
        assert set(losses) == {1e-3, 1e-2, float(mini.format_lr(edge * 3 if edge == 1e-2 else edge / 3))}
        runs = [g for g in grid if (g["config"]["residual"], g["config"]["n_layer"]) == cell]
        assert sorted(g["config"]["seed"] for g in runs) == [0, 1]
        assert {g["config"]["lr"] for g in runs} == {min(losses, key=losses.get)}  # the argmin, seeds 0 and 1
    linked = [p for p in (tmp_path / "synthetic").iterdir() if p.is_symlink()]
    assert len(linked) == 4 and all("_s0" in p.name for p in linked)  # seed 0: the sweep's run, not trained again
    diags = sorted((tmp_path / "synthetic").glob("*/diagnose.json"))
    assert len(diags) == 8
    figs = tmp_path / "figs" / "synthetic"
    for name in ("fig2_final_loss_vs_ar", "fig6_depth_use", "fig8_layer_pruning", "mini_composition_vs_depth",
                 "suite_fig2_loss_vs_ar"):
        assert (figs / f"{name}.png").stat().st_size > 1000, name
    table = (tmp_path / "summary.md").read_text()
    for losses in sweep.values():                                   # every sweep run is listed
        assert all(f"{suite_tables.show_lr(lr)}: {v:.4f}" in table for lr, v in losses.items())
    assert table.count("extended once") == 4 and "R scores at the deepest shape" in table
    seeds = table.split("Final val loss per seed")[1].split("Best aspect ratio per design")[0]
    for run in grid:                                                # every seed's loss, for a reader's own interval
        c = run["config"]
        assert f"| {c['residual']} | {c['n_layer']} | {c['d_model']} | {suite_tables.show_lr(c['lr'])} | " in seeds
        assert f" {run['final']['val_loss']:.4f} |" in seeds
    glance = table.split("At a glance")[1].split("\n\nΔ vs Pre-LN paired by seed (")[0]
    (row,) = [line for line in glance.splitlines() if line.startswith("| attnres |")]
    assert len(re.findall(r"\[[+-]\d+\.\d{3}, [+-]\d+\.\d{3}\], (better|worse|unresolved), lower on \d/2 \|", row)) == 2
    assert "| attnres | — (needs three shapes with a finished seed) |" in table  # two shapes: no best AR to fit
    assert "[sweep 8/8]" in r.stdout and "[sweep edge 4/4]" in r.stdout and "[train 4/4]" in r.stdout

    # the same command again: every run is finished and diagnosed, so nothing is trained or diagnosed anew; each
    # job's log names its finished run folder, so not even train.py starts (the logs stay the first call's)
    paths = list((tmp_path / "synthetic-lr").glob("*/*/run.json")) + diags + list((tmp_path / "logs").iterdir())
    before = {p: p.stat().st_mtime_ns for p in paths}
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "[diagnose" not in r.stdout
    assert r.stdout.count(": done before (found done) |") == 8 + 4 + 4 and "ETA after the first run" in r.stdout
    assert {p: p.stat().st_mtime_ns for p in paths} == before


def test_bad_arguments_are_one_line(capsys, tmp_path):
    for argv in (["--probes", "text"], ["--probes", "audio"], ["--ar", "wide"], ["--jobs", "0"],
                 ["--text", str(tmp_path / "missing"), "--out", str(tmp_path)]):  # the corpus fails before any run
        try:
            mini.main(argv)
        except SystemExit as e:
            assert e.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mini.py: error:")


def test_the_sweep_covers_every_text_shape_and_the_deepest_synthetic_one():
    """Before any result: the first phase is the sweep, the first seed of every text cell and of the synthetic
    probe's deepest cells at each LR, deepest shapes first, text runs reading the given corpus."""
    args = mini.parse_args(["--designs", "preln,hc", "--ar", "92,4", "--text", "corpus.txt"])
    args.probes, args.sweep = ["text", "synthetic"], [1e-3, 3e-3, 1e-2]
    jobs = mini.sweep_jobs(args)
    cells = {(f.split("/")[0], a[a.index("--residual") + 1], a[a.index("--ar") + 1]) for f, _, a in jobs}
    assert cells == {("text-lr", d, ar) for d in ("preln", "hc") for ar in ("92", "4")} | {
        ("synthetic-lr", d, "4") for d in ("preln", "hc")}
    assert len(jobs) == 6 * 3 and all(a[a.index("--seed") + 1] == "0" for _, _, a in jobs)
    assert [a[a.index("--ar") + 1] for _, _, a in jobs][:3] == ["4"] * 3
    assert all(("--data" in a and a[a.index("--data") + 1] == "corpus.txt") == f.startswith("text") for f, _, a in jobs)
    assert mini.seed_jobs(args) == []                               # nothing is chosen before the sweep ran
    args.lr, args.sweep = 3e-3, []                                  # --lr: no sweep, every seed at that LR
    assert len(mini.sweep_jobs(args)) == 0 and len(mini.seed_jobs(args)) == 2 * 2 * (3 + 5)  # the deepest: 5 seeds


@pytest.mark.parametrize("flag, value", [("--ar", "92,,9.1"), ("--designs", "preln,"), ("--seeds", "0,,1"),
                                         ("--deep-seeds", ",0"), ("--lr-sweep", "1e-3,,1e-2"), ("--probes", "text,"),
                                         ("--seeds", ""), ("--designs", "")])
def test_an_empty_list_item_is_refused(capsys, tmp_path, flag, value):
    """An empty item (a doubled or trailing comma) is a typo, not a shorter list: one line, exit 2, nothing written.
    Only --deep-seeds and --lr-sweep take '' (the whole list), for "use --seeds" and "no sweep"."""
    with pytest.raises(SystemExit) as e:
        mini.main([flag, value, "--text", "corpus.txt", "--out", str(tmp_path / "suite")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"mini.py: error: argument {flag}: invalid")
    assert list(tmp_path.iterdir()) == []


def test_the_empty_lists_that_mean_something():
    """--deep-seeds '' means every shape takes --seeds; --lr-sweep '' means no sweep, every run at the preset's LR;
    items are parsed (seeds as ints, LRs as floats) and repeats dropped."""
    args = mini.parse_args(["--designs", "preln", "--ar", "32,9.1,32.0", "--seeds", "3,1,3", "--deep-seeds", "",
                            "--lr-sweep", ""])
    assert (args.ar, args.seeds, args.deep_seeds, args.sweep) == ([32.0, 9.1], [3, 1], [], [])
    assert mini.seeds_at(args, 9.1) == [3, 1] and mini.sweep_jobs(args) == []
    jobs = mini.seed_jobs(args)
    assert [a[a.index("--seed") + 1] for _, _, a in jobs] == ["3", "1"] * 2 and not any("--lr" in a for _, _, a in jobs)


@pytest.mark.slow
def test_a_second_suite_on_the_same_folder_is_refused(tmp_path):
    """While one mini.py holds its suite folder, a second on the same --out says who holds it in one line, exits 2
    and writes nothing: no log (a cell's log is written only by the suite that trains it), no summary.md."""
    out = tmp_path / "suite"
    held = common.lock_folder(out)  # the first suite, as main holds it
    log = out / "logs" / "synthetic_preln_ar32_seed0.log"
    log.parent.mkdir()
    log.write_text("the first suite's run, still training\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    argv = [sys.executable, "mini.py", "--designs", "preln", "--ar", "32", "--seeds", "0", "--deep-seeds", "",
            "--lr-sweep", "", "--steps", "2", "--out", str(out)]
    r = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    held.close()
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"mini.py: error: {out} is in use by pid {os.getpid()}")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not (out / "summary.md").exists() and not (out / "synthetic").exists()


def sweep_run(folder, lr, loss=None, state="finished"):
    """A sweep run folder as train.py leaves it: run.json (a run at L9 d88, what --ar 9.1 gives at the mini budget),
    and for a finished run a ckpt.pt at its last step."""
    import torch
    folder.mkdir(parents=True)
    run = run_json({"lr": lr, "seed": 0, "n_layer": 9, "d_model": 88}, val_loss=loss, finished=state == "finished",
                   diverged=state == "diverged")
    common.write_json(folder / "run.json", run)
    if state == "finished":
        torch.save({"step": 2}, folder / "ckpt.pt")


def test_a_diverged_sweep_run_is_a_result_never_the_choice(tmp_path):
    """By runlog.run_state: a diverged run is done (listed as diverged) but never chosen, even where it is the only
    one at an edge; an unfinished run is not done; a cell where every run diverged has no LR, so no seeds train."""
    args = mini.parse_args(["--designs", "preln,hc", "--ar", "9.1", "--seeds", "0,1", "--deep-seeds", "",
                            "--out", str(tmp_path)])
    preln, hc = mini.cells(args)
    folder = tmp_path / mini.cell_folder(preln)
    sweep_run(folder / "a", 1e-3, 3.1)
    sweep_run(folder / "b", 3e-3, 3.0)
    sweep_run(folder / "c", 1e-2, state="diverged")       # the other edge: no loss, never the best
    sweep_run(folder / "d", 3e-4, 2.0, state="partial")   # killed early: a too-early loss, not done
    for name, lr in (("a", 1e-3), ("b", 3e-3), ("c", 1e-2)):
        sweep_run(tmp_path / mini.cell_folder(hc) / name, lr, state="diverged")
    assert mini.sweep_result(args, preln)[0] == {1e-3: 3.1, 3e-3: 3.0, 1e-2: None}
    assert mini.chosen_lr(args, preln) == 3e-3 and mini.extension(args, mini.sweep_result(args, preln)[0]) is None
    assert mini.sweep_lines(args, "synthetic")[0] == ("- preln, AR 9.8 (L9, asked 9.1): 1e-3: 3.1000 · "
                                                  "**3e-3: 3.0000** · 1e-2: diverged at step 2")
    assert mini.chosen_lr(args, hc) is None
    jobs = mini.seed_jobs(args)                           # preln's seed 1 at 3e-3 (seed 0 is its sweep run), no hc
    assert [(label.split()[1], a[a.index("--seed") + 1], a[a.index("--lr") + 1]) for _, label, a in jobs] == [
        ("preln", "1", "3e-3")]
    assert (tmp_path / "synthetic" / "b").is_symlink()


def test_paired_differences_count_every_seed_both_ran():
    """compare.paired: the differences of the seeds both finished, their mean, range and 95% t interval; lower/higher
    count every common seed (a diverged seed counts against its design, a seed both diverged on counts neither way);
    'better' only where the interval excludes 0 (tests/test_suite_stats.py has the interval's own tests)."""
    from depthbench.evaluation import compare
    p = compare.paired({0: 2.9, 1: 3.05, 2: 2.8, 5: 1.0}, {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0})
    assert p.seeds == [0, 1, 2] and p.deltas == pytest.approx({0: -0.1, 1: 0.05, 2: -0.2})
    assert (p.lower, p.higher, p.verdict()) == (2, 1, "unresolved")
    assert (p.mean, p.low, p.high) == pytest.approx((-0.25 / 3, -0.2, 0.05))
    half = 4.3026527 * np.std([-0.1, 0.05, -0.2], ddof=1) / np.sqrt(3)  # t(0.975, 2) · sd / √3
    assert p.interval == pytest.approx((-0.25 / 3 - half, -0.25 / 3 + half), abs=1e-6)
    assert p.text() == f"-0.0833 [{-0.25 / 3 - half:+.4f}, {-0.25 / 3 + half:+.4f}], lower on 2/3"
    q = compare.paired({0: None, 1: 3.1, 2: None}, {0: 3.0, 1: 3.0, 2: None})
    assert (q.lower, q.higher, q.diverged, q.verdict()) == (0, 2, [0], "unresolved")  # seed 2: both diverged
    assert q.text() == "+0.1000 [one pair], lower on 0/3 (diverged on seed 0)"
    assert compare.paired({0: None, 1: None}, {0: 3.0, 1: 3.0}).verdict() == "worse"
    assert compare.paired({0: 2.0}, {0: 3.0}).verdict() == "one seed" and compare.paired({}, {0: 3.0}).text() == "—"


def test_designs_all_is_the_papers_ten_and_the_synthetic_probe_stays_at_three():
    """--designs all: the paper's ten in its order (not the release's extra baselines); the synthetic probe keeps
    preln,hc,attnres unless --synthetic-designs says otherwise; without 'all' both probes take --designs."""
    args = mini.parse_args(["--designs", "all", "--text", "corpus.txt"])
    assert args.designs == PAPER_TEN and args.synthetic_designs == ["preln", "hc", "attnres"]
    assert {c.design for c in mini.cells(args) if c.probe == "synthetic"} == {"preln", "hc", "attnres"}
    assert len(mini.cells(args)) == 5 * 10 + 5 * 3 and len(mini.sweep_jobs(args)) == 5 * 10 * 3 + 3 * 3
    assert mini.synthetic_note(args)[0].startswith("The synthetic probe stays at preln, hc, attnres: it showed nothing")
    args = mini.parse_args(["--designs", "hc,all", "--synthetic-designs", "all"])
    assert args.designs[0] == "hc" and sorted(args.designs) == sorted(PAPER_TEN) and len(args.synthetic_designs) == 10
    args = mini.parse_args(["--designs", "preln,lns"])
    assert args.synthetic_designs == ["preln", "lns"] and mini.synthetic_note(args) == []


@pytest.mark.parametrize("value", ["deepnorm", "deepnorm=", "deepnorm=-1", "nodesign=1e-3", "all=1e-3",
                                   "deepnorm=1e-3,"])
def test_a_bad_design_lr_is_one_line(capsys, tmp_path, value):
    with pytest.raises(SystemExit) as e:
        mini.main(["--design-lr", value, "--out", str(tmp_path / "suite")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("mini.py: error: argument --design-lr")
    assert list(tmp_path.iterdir()) == []


def test_a_design_lr_trains_every_seed_there_and_table4_says_so(tmp_path):
    """--design-lr: that design neither sweeps nor takes --lr, every seed of its cells trains at its LR; Table 4 lists
    each design's choice per shape beside the paper's optimum (residuals' paper_lr), 'all diverged' where no sweep
    LR finished, '—' where nothing ran yet."""
    args = mini.parse_args(["--designs", "preln,lns,deepnorm", "--ar", "32,9.1", "--seeds", "0,1", "--deep-seeds",
                            "", "--probes", "synthetic", "--full-sweep", "--design-lr", "deepnorm=1e3",
                            "--lr-sweep", "1e-3,1e-2", "--out", str(tmp_path)])
    assert {(a[a.index("--residual") + 1]) for _, _, a in mini.sweep_jobs(args)} == {"preln", "lns"}
    sweep_run(tmp_path / "synthetic-lr" / "preln_ar9.1" / "a", 1e-3, 3.1)
    sweep_run(tmp_path / "synthetic-lr" / "preln_ar9.1" / "b", 1e-2, 3.0)
    sweep_run(tmp_path / "synthetic-lr" / "lns_ar9.1" / "a", 1e-3, state="diverged")
    jobs = [(label.split()[1], a[a.index("--ar") + 1], a[a.index("--lr") + 1]) for _, label, a in mini.seed_jobs(args)]
    assert sorted(j for j in jobs if j[0] == "deepnorm") == [("deepnorm", "32", "1e3")] * 2 + [("deepnorm", "9.1",
                                                                                                  "1e3")] * 2
    assert mini.table4(args, "synthetic") == [
        "| design | paper's optimum | AR 32 | AR 9.8 (L9, asked 9.1) |", "|---|---|---|---|",  # AR 32: no run yet
        "| preln | 2e-3 | — | 1e-2 |", "| lns | 1e-2 | — | all diverged |", "| deepnorm | 1e-3 | 1e3 (set) | 1e3 (set) |"]


def test_a_diverged_run_is_a_result_in_the_progress_line(tmp_path):
    """outcome(): train.py's exit 1 with its 'diverged at step' line is 'diverged', not a failure; a run found done
    before is 'done before' (left out of the ETA); any other non-zero exit is FAILED."""
    cases = [(0, "done: x at step 4", "ok"), (0, "finished already (run.json says so): skipping", "done before"),
             (1, "train.py: error: x diverged at step 3 (loss nan", "diverged"),
             (1, "diverged already (run.json says so): skipping", "diverged"), (1, "Traceback ...", "FAILED"),
             (2, "train.py: error: bad input", "FAILED")]
    for rc, text, want in cases:
        (tmp_path / "log").write_text(text + "\n")
        assert job_pool.outcome(rc, tmp_path / "log") == want, text
    assert job_pool.outcome(0, tmp_path / "missing.log") == "ok"


AUSTEN = ROOT.parent / "shared" / "data" / "austen"


@pytest.mark.slow
@pytest.mark.skipif(not AUSTEN.is_dir(), reason="needs the Austen corpus in ../shared/data/austen")
def test_toy_suite_with_a_design_forced_to_diverge(tmp_path):
    """The text toy grid with three designs, DeepNorm forced to diverge (--design-lr at an absurd LR): the suite does
    not fail, its two DeepNorm runs are reported diverged (progress lines, summary.md with the step, paired against
    Pre-LN as higher on every seed), and the other two designs' cells complete: both seeds trained, diagnosed, in
    summary.md (LNS paired against Pre-LN) and the suite figures. Two designs beside the diverged one show all of
    it (Pre-LN to pair with, one more to be paired); a third (Sandwich-LN) added 2 runs and 2 diagnoses, nothing
    the others do not show, and ~20 s (53 -> 32 s)."""
    argv = [sys.executable, "mini.py", "--designs", "preln,lns,deepnorm", "--ar", "32", "--seeds", "0,1",
            "--deep-seeds", "", "--steps", "4", "--lr", "3e-3", "--design-lr", "deepnorm=1e6", "--probes", "text",
            "--text", str(AUSTEN), "--diag-samples", "2", "--out", str(tmp_path)]
    r = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0 and "FAILED" not in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[train] 6 runs, 2 at a time" in r.stdout and "[diagnose] 4 runs, 2 at a time" in r.stdout
    assert r.stdout.count(": diverged in ") == 2 and r.stdout.count("text deepnorm ar=32") == 2
    runs = {(run["config"]["residual"], run["config"]["seed"]): run
            for run in (json.loads(p.read_text()) for p in (tmp_path / "text").glob("*/run.json"))}
    assert len(runs) == 6
    for (res, seed), run in runs.items():
        assert run["diverged"] == (res == "deepnorm") and run["finished"] == (res != "deepnorm")
        assert run["config"]["lr"] == (1e6 if res == "deepnorm" else 3e-3)
        assert (tmp_path / "text" / run["config"]["name"] / "diagnose.json").exists() == (res != "deepnorm")
    table = (tmp_path / "summary.md").read_text()
    steps = [runs[("deepnorm", s)]["steps"][-1]["step"] for s in (0, 1)]
    deep_row = next(line for line in table.splitlines() if line.startswith("| deepnorm |"))
    assert f"| 0 + 2 diverged (seed 0 at step {steps[0]}, seed 1 at step {steps[1]}) | — |" in deep_row
    assert "| lower on 0/2 (diverged on seed 0, 1) | worse |" in deep_row
    for res in ("preln", "lns"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {res} |"))
        losses = [runs[(res, s)]["final"]["val_loss"] for s in (0, 1)]
        assert f"| 3e-3 | 2 | {suite_tables.spread(losses)} |" in row
        if res != "preln":
            deltas = [losses[s] - runs[("preln", s)]["final"]["val_loss"] for s in (0, 1)]
            half = 12.7062047 * np.std(deltas, ddof=1) / np.sqrt(2)  # the 95% t interval of two: t(0.975, 1)
            assert f"{np.mean(deltas):+.4f} [{np.mean(deltas) - half:+.4f}, {np.mean(deltas) + half:+.4f}], lower on" in row
    assert "| deepnorm | 1e-3 | 1e6 (set) |" in table and "| lns | 1e-2 | 3e-3 |" in table
    for name in ("fig2_final_loss_vs_ar", "suite_fig2_loss_vs_ar", "suite_fig6_depth_use"):
        assert (tmp_path / "figs" / "text" / f"{name}.png").stat().st_size > 1000, name


def test_the_eta_counts_trained_runs_only_and_the_plan_counts_the_whole_grid():
    """progress_line: no ETA before a run has trained (a resumed suite skipping what is done), then the mean of the
    trained runs x the phase's jobs left / the jobs at a time. plan_line: the ten-design text grid is 10 designs x 5
    shapes x 3 LRs of sweep, at most one edge run per cell, and 10 x (4 x 3 + 5) seeds less the 50 sweep runs."""
    phase = job_pool.Progress("sweep", total=10, n=2, t0=time.time())
    assert job_pool.progress_line(phase, 3, "x: done before in 8 s", []).endswith("ETA after the first run it trains")
    assert job_pool.progress_line(phase, 4, "x: ok in 60 s", [60.0, 120.0]).endswith("ETA 4.5 min for this phase")
    args = mini.parse_args(["--text", "austen", "--probes", "text", "--designs", "all"])
    assert mini.plan_line(args).startswith("plan: 150 sweep runs, up to 50 edge runs, 120 seed runs")
    args = mini.parse_args(["--designs", "preln,hc", "--design-lr", "hc=1e-3", "--ar", "32,9.1"])  # synthetic
    assert mini.plan_line(args).startswith("plan: 3 sweep runs, up to 1 edge runs, 15 seed runs")


def test_the_glance_table_has_both_ends_paired_counts_and_the_chosen_lrs():
    """glance(): per design, the shallowest and the deepest shape's loss (mean ± half-range, seeds), Δ vs Pre-LN
    there paired by seed (mean, 95% t interval, the verdict by it) and on how many paired seeds the design is lower (a
    diverged seed counts against it); a design with no finished seed at a shape says so."""
    args = mini.parse_args(["--designs", "preln,hc", "--ar", "92,9.1", "--lr", "3e-3", "--probes", "text", "--text",
                            "corpus.txt"])

    def result(losses):
        r = suite_tables.Result(by_seed=dict(enumerate(losses)))
        r.loss = [v for v in losses if v is not None]
        return r

    table = {("preln", 2, 184, 3e-3): result([2.0, 2.1, 1.9]), ("hc", 2, 184, 3e-3): result([1.8, 1.9, 2.05]),
             ("preln", 9, 88, 3e-3): result([2.0, 2.2]), ("hc", 9, 88, 3e-3): result([1.7, None]),
             ("hc", 9, 88, 1e-2): result([None, None])}  # fewer seeds: not the one shown
    # L2: differences -0.2, -0.2, +0.15: mean -0.083, sd 0.2021, ± 4.3027 · 0.2021 / √3 = 0.502
    assert suite_tables.glance(table, args.designs, mini.chosen_lrs(args, "text")) == [
        "| design | AR 92 (L2) | Δ vs Pre-LN | AR 9.8 (L9) | Δ vs Pre-LN | LR chosen, shallow → deep |",
        "|---|---|---|---|---|---|",
        "| preln | 2.000 ± 0.100 (3) | — | 2.100 ± 0.100 (2) | — | 3e-3 → 3e-3 |",
        "| hc | 1.917 ± 0.125 (3) | -0.083 [-0.585, +0.419], unresolved, lower on 2/3 | 1.700 ± 0.000 (1) | "
        "-0.300 [one pair], unresolved, lower on 1/2 | 3e-3 → 3e-3 |"]
    table[("hc", 9, 88, 3e-3)] = result([None, None, None])
    shown = suite_tables.glance(table, args.designs, mini.chosen_lrs(args, "text"))
    assert shown[3].split(" | ")[3:5] == ["all diverged (0)", "worse, lower on 0/2"]


def test_a_job_whose_run_is_done_is_not_started_again(tmp_path, capsys):
    """found_done: the job's run folder (the one train.py resolves its command to, in mini.py's process), when
    runlog.run_state says it is done ('finished' -> 'done before', 'diverged'); a partial run, no folder, or a job
    that is not train.py's -> None (the job runs). A run.json of the wrong types is refused in one line naming it."""
    args = mini.parse_args(["--designs", "preln", "--ar", "32", "--seeds", "0", "--deep-seeds", "", "--lr", "3e-3",
                            "--steps", "2", "--out", str(tmp_path)])
    (_, label, argv), = mini.seed_jobs(args)
    (folder,) = mini.check_jobs([(label, argv)]).values()  # nothing there yet: no state
    assert folder == tmp_path / "synthetic" / "preln_ar32_lr3e-3_s0" and mini.found_done(folder) is None
    assert mini.planned_run([sys.executable, "diagnose.py", str(folder)]) is None and mini.found_done(None) is None
    import train
    with pytest.raises(SystemExit) as e:
        train.main(argv[2:])
    assert e.value.code == 0 and mini.found_done(folder) == "done before"
    log = json.loads((folder / "run.json").read_text())
    common.write_json(folder / "run.json", {**log, "finished": False, "diverged": True})
    assert mini.found_done(folder) == "diverged"
    common.write_json(folder / "run.json", {**log, "finished": False})
    assert mini.found_done(folder) is None
    common.write_json(folder / "run.json", {**log, "finished": "no"})  # not read by truthiness
    with pytest.raises(SystemExit) as e:
        mini.check_jobs([(label, argv)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines() == [
        f"mini.py: error: {folder / 'run.json'}: field 'finished' is a string, not true or false"]


def test_the_paired_grid_gives_each_design_and_shape_its_paired_differences():
    """paired_grid(): per design (not Pre-LN) and shape, the mean of the per-seed differences from Pre-LN, its 95% t
    interval, the verdict by it, and the count of seeds lower; a seed the design diverged on counts against it (on
    every seed: worse); no Pre-LN there: '—'."""
    args = mini.parse_args(["--designs", "preln,hc", "--ar", "92,9.1", "--lr", "3e-3"])
    table = {("preln", 2, 184, 3e-3): suite_tables.Result(by_seed={0: 2.0, 1: 2.1, 2: 1.9}),
             ("hc", 2, 184, 3e-3): suite_tables.Result(by_seed={0: 1.8, 1: 1.9, 2: 2.05}),
             ("hc", 9, 88, 3e-3): suite_tables.Result(by_seed={0: None, 1: None}),
             ("hc", 3, 152, 3e-3): suite_tables.Result(by_seed={0: 1.9})}
    table[("preln", 9, 88, 3e-3)] = suite_tables.Result(by_seed={0: 2.0, 1: 2.2})
    assert suite_tables.paired_grid(table, args.designs) == [
        "| design | AR 92 (L2) | AR 51 (L3) | AR 9.8 (L9) |", "|---|---|---|---|",
        "| hc | -0.083 [-0.585, +0.419], unresolved, lower on 2/3 | — | worse, lower on 0/2 |"]
