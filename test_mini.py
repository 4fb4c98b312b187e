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


def test_toy_suite_writes_figures_and_resumes(tmp_path):
    argv = [sys.executable, "mini.py", "--designs", "preln,attnres", "--ar", "32,9.1", "--seeds", "0", "--steps", "2", "--lr-sweep", "1e-2",
            "--diag-samples", "8", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(argv, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = sorted((tmp_path / "synthetic").glob("*/run.json"))
    assert len(runs) == 4 and all(json.loads(p.read_text())["finished"] for p in runs)
    assert {json.loads(p.read_text())["config"]["n_layer"] for p in runs} == {4, 9}
    diags = sorted((tmp_path / "synthetic").glob("*/diagnose.json"))
    assert len(diags) == 4
    deep = [json.loads(p.read_text()) for p in diags if json.loads(p.read_text())["meta"]["n_layer"] == 9]
    assert all(d["causal_score"]["R_causal"] is not None and "R_perm" in d["permutation_score"] for d in deep)
    figs = tmp_path / "figs" / "synthetic"
    for name in ("fig2_final_loss_vs_ar", "fig6_depth_use", "fig8_layer_pruning", "mini_composition_vs_depth"):
        assert (figs / f"{name}.png").stat().st_size > 1000, name
    # the LR sweep: each design once more at --sweep-ar (9.1 -> L9), LR 1e-2, in its own folder
    sweep = [json.loads(p.read_text())["config"] for p in (tmp_path / "synthetic-lr").glob("*/run.json")]
    assert sorted((c["residual"], c["n_layer"], c["lr"]) for c in sweep) == [("attnres", 9, 0.01), ("preln", 9, 0.01)]
    table = (tmp_path / "summary.md").read_text()
    assert "## synthetic-lr" in table and table.count("| preln |") == 3 and table.count("| attnres |") == 3
    assert table.count("(one seed) |") == 3  # attnres vs preln at each shape and LR, one seed each
    assert "[train 6/6]" in r.stdout and "[diagnose 4/4]" in r.stdout

    # the same command again: every run is finished and diagnosed, so nothing is trained or diagnosed anew
    before = {p: p.stat().st_mtime_ns for p in runs + diags}
    r = subprocess.run(argv, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "[diagnose" not in r.stdout
    assert {p: p.stat().st_mtime_ns for p in runs + diags} == before
    assert all("finished already" in p.read_text() for p in (tmp_path / "logs").glob("synthetic_*.log"))


def test_bad_arguments_are_one_line(capsys, tmp_path):
    for argv in (["--probes", "text"], ["--probes", "audio"], ["--ar", "wide"], ["--jobs", "0"],
                 ["--text", str(tmp_path / "missing"), "--out", str(tmp_path)]):  # the corpus fails before any run
        try:
            mini.main(argv)
        except SystemExit as e:
            assert e.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mini.py: error:")


def test_commands_cover_the_grid():
    """Every (probe, design, AR, seed) once, deepest shapes first, text runs reading the given corpus."""
    args = mini.build_parser().parse_args(["--designs", "preln,hc", "--ar", "92,4", "--seeds", "0,1",
                                           "--text", "corpus.txt"])
    args.probes = ["text", "synthetic"]
    jobs = mini.train_commands(args)
    assert len(jobs) == 2 * 2 * 2 * 2 + 2 * 2 * 2 and len({label for _, label, _ in jobs}) == 24
    sweep = [a for folder, _, a in jobs[:8] if folder.endswith("-lr")]  # the LR sweep first: 2 probes x 2 designs x 2
    assert len(sweep) == 8 and all(a[a.index("--ar") + 1] == "9.1" for a in sweep)
    assert sorted(a[a.index("--lr") + 1] for a in sweep) == ["1e-2"] * 4 + ["1e-3"] * 4
    assert [a[a.index("--ar") + 1] for _, _, a in jobs[8:12]] == ["4"] * 4 and "--lr" not in jobs[8][2]
    assert all(a[a.index("--data-dir") + 1] == str(Path("runs/mini/text-data")) for p, _, a in jobs if "text" in p)
    assert all(("--data" in a and a[a.index("--data") + 1] == "corpus.txt") == (p == "text") for p, _, a in jobs if not p.endswith("-lr"))
