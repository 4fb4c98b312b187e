"""
Tests of mini.py, the one-machine suite: the suite command at a toy size (two designs, two shapes, a few
steps) trains, diagnoses and plots every run, writes the summary, and a second call skips what is done.

    python -m pytest -q test_mini.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import mini

HERE = Path(__file__).resolve().parent


def test_toy_suite_sweeps_selects_and_resumes(tmp_path):
    """The toy grid with a 2-LR sweep at every shape: each cell's first seed trains at both LRs (and, the best
    being at an edge, once more x3 beyond it); the cell's LR is the argmin of those final losses; the second
    seed trains only at it; diagnostics, figures and summary.md follow; the same command again does nothing."""
    argv = [sys.executable, "mini.py", "--designs", "preln,attnres", "--ar", "32,9.1", "--seeds", "0,1",
            "--deep-seeds", "", "--steps", "2", "--lr-sweep", "1e-3,1e-2", "--full-sweep", "--diag-samples", "8",
            "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(argv, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
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
    for name in ("fig2_final_loss_vs_ar", "fig6_depth_use", "fig8_layer_pruning", "mini_composition_vs_depth"):
        assert (figs / f"{name}.png").stat().st_size > 1000, name
    table = (tmp_path / "summary.md").read_text()
    for losses in sweep.values():                                   # every sweep run is listed
        assert all(f"{mini.format_lr(lr)}: {v:.4f}" in table for lr, v in losses.items())
    assert table.count("extended once") == 4 and "R scores at the deepest shape" in table
    assert "[sweep 8/8]" in r.stdout and "[sweep edge 4/4]" in r.stdout and "[train 4/4]" in r.stdout

    # the same command again: every run is finished and diagnosed, so nothing is trained or diagnosed anew
    paths = list((tmp_path / "synthetic-lr").glob("*/*/run.json")) + diags
    before = {p: p.stat().st_mtime_ns for p in paths}
    r = subprocess.run(argv, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "[diagnose" not in r.stdout
    assert {p: p.stat().st_mtime_ns for p in paths} == before
    assert all("finished already" in p.read_text() for p in (tmp_path / "logs").glob("synthetic*.log"))


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
    args = mini.build_parser().parse_args(["--designs", "preln,hc", "--ar", "92,4", "--text", "corpus.txt"])
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
