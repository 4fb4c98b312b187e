"""
Tests for plot.py: every figure draws a real (non-blank) PNG from small fixture JSON, the schema
contract is enforced (unknown versions skipped with a message, junk files never crash), diverged runs
are marked rather than dropped, and plot.py never imports torch.

    /work/venv/bin/python -m pytest -q tests/test_plot.py
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import matplotlib.image
import matplotlib.pyplot as plt
import pytest

import plot
from depthbench.reports import drawing

ROOT = Path(__file__).resolve().parents[1]  # the repository root
L = 4  # a tiny model: 4 layers, 8 sublayers, 5 depth states

# -----------------------------------------------------------------------------
# fixture JSON, shaped like what train.py / diagnose.py / profile_gpu.py write (schema version 1)


def train_json(residual="preln", n_layer=4, d_model=128, lr=2e-3, seed=0, diverged=False, final=3.0):
    steps = [{"step": s, "tokens": 1024 * s, "loss": 6.0 - 0.25 * s + 0.01 * seed, "lr": lr,
              "grad_norm": 1.0, "tok_per_s": 1e4} for s in range(1, 11)]
    if diverged:  # loss explodes, then NaN: what a real blow-up looks like in the log
        steps[6:] = [dict(s, loss=v) for s, v in zip(steps[6:], [40.0, 1e4, math.nan, math.nan])]
    return {"schema": "depthbench.train/1",
            "config": {"residual": residual, "n_layer": n_layer, "d_model": d_model, "ar": d_model / n_layer,
                       "lr": lr, "seed": seed, "params_budget": 2_000_000, "data": "synthetic"},
            "params": {"total": 2_000_000, "backbone": 1_800_000, "residual_extra": 100},
            "steps": steps,
            "evals": [{"step": 10, "tokens": 10240, "val_loss": None if diverged else final,
                       "answer_loss": None, "answer_acc": None,  # per gap: deeper solves more (the mini suite's probe)
                       "per_level": None if diverged else {str(g): {"loss": 1.0, "acc": min(1.0, 0.2 * n_layer / g)}
                                                           for g in range(1, 5)}}],
            "final": {"val_loss": None if diverged else final, "answer_loss": None, "answer_acc": None},
            "diverged": diverged, "finished": True, "wall_s": 1.0, "peak_mem_bytes": 0, "device": "cpu",
            "versions": {}}


def tri(n, value, strict=True):
    """n x n upper-triangular list of lists, null on and below the diagonal."""
    return [[value(i, j) if (j > i if strict else True) else None for j in range(n)] for i in range(n)]


def diagnose_json(residual="attnres", n_layer=L, d_model=64):
    """Every metric filled in, except the design-specific ones, which are {"skipped": ...} for other designs as
    diagnose.py writes them. Values shift a little per design so lines don't sit on top of each other."""
    n, S = n_layer, 2 * n_layer  # S sublayers
    rng = np.random.default_rng(n + len(residual))
    o = 0.1 * drawing.design_order(residual)
    sub = [[(n - g) / n * 0.1 * (k + 1) if k + g < n + 1 else None for k in range(n)] for g in range(n)]
    weights = [[1.0 / (c + 1) if s <= c else None for s in range(S + 1)] for c in range(S + 1)]
    schedule = [0.01 if k % 3 == 0 else 0.2 + 0.6 * k / S for k in range(S)]
    lens = [{"index": i, "early_exit_ce": 6 - i * (4 - o) / n, "kl_to_final": (3 - o) * (1 - i / n),
             "top5_overlap": (i / n) ** (1 + o)} for i in range(n + 1)]
    doc = {"schema": "depthbench.diagnose/2",
           "meta": {"residual": residual, "n_layer": n, "d_model": d_model, "ar": d_model / n, "checkpoint": None,
                    "num_samples": 4, "seq_len": 32, "dtype": "float32", "device": "cpu", "seed": 0},
           "angular_distance": {"matrix": tri(n + 1, lambda i, j: (j - i) / (n + 1)), "subsequent": sub,
                                "definition": "mean arccos / pi"},
           "causal_score": {"matrix": tri(n, lambda i, j: float(rng.uniform(0, 1))), "threshold": 0.45, "s_min": 1,
                            "R_causal": 0.05 + 0.2 * o, "n_pairs": 3, "n_above": 1, "variant": "mean_of_ratios"},
           "permutation_score": {"matrix": tri(n, lambda i, j: float(rng.uniform(0, 0.4))), "threshold": 0.15,
                                 "R_perm": 0.1 + 0.3 * o, "R_perm_all": 0.33, "baseline_loss": 3.0},
           "logit_lens": {"states": lens, "final_loss": 2.0 + o},
           "layer_pruning": {"baseline_loss": 3.0,
                             "layers": [{"layer": i, "loss": 3.1 + 0.1 * i, "delta": 0.1 + 0.1 * i} for i in range(n)]},
           "attnres_weights": {"sublayer": weights, "block": [[1.0 / (c + 1) if s <= c else None for s in range(n + 1)]
                                                              for c in range(n + 1)]},
           "transport_erank": {"per_connector": [(2.6 if residual == "hc" else 1.5) + 0.02 * k for k in range(S)],
                               "mean": 2.7, "product": [2.5 / (k + 1) + 1 for k in range(S)]},
           "dead_zone": {"tau": 0.05, "schedule": schedule, "dead": [v < 0.05 for v in schedule],
                         "count_blocks": 1},
           "nll": {"tasks": {"mbpp": {"category": "coding", "nll_mean": 2.0, "num_target_tokens": 100}},
                   "categories": {"coding": {"nll_mean": 2.0 + o}, "stem": {"nll_mean": 2.5},
                                  "math": {"nll_mean": 1.8 + 0.1 * n - o}}},
           "token_collapse": {"stable_rank": [1 + 3 * o + 2 / (i + 1) for i in range(n + 1)],
                              "erank": [2 + 4 * o + 8 / (i + 1) for i in range(n + 1)],
                              "l1_l2_ratio": [1.5 + o + 2 / (i + 1) for i in range(n + 1)], "num_windows": 4},
           "zeroshot": {"tasks": {"arc_easy": {"acc": 0.3 + 0.05 * o + 0.01 * n, "acc_norm": 0.35, "num_examples": 5},
                                  "winogrande": {"acc": 0.5 + 0.02 * n - o / 10, "num_examples": 5},
                                  "piqa": {"skipped": "no piqa.jsonl in z"}},
                        "source": "z", "max_len": 512}}
    if residual not in ("attnres", "block_attnres"):
        doc["attnres_weights"] = {"skipped": "not an AttnRes model"}
    if residual != "block_attnres":
        doc["dead_zone"] = {"skipped": "not Block AttnRes"}
    if residual not in ("hc", "mhc"):
        doc["transport_erank"] = {"skipped": "not HC/mHC"}
    doc["dense_weights"] = dense_json(n, 4 if residual == "mudd" else 1, o)
    if residual not in ("mudd", "denseformer"):
        doc["dense_weights"] = {"skipped": "not DenseFormer or MUDD"}
    return doc


def dense_json(n, streams, o):
    """diagnose.py's dense metric: per stream, rows of consumers 0 .. n (the head only in the last stream), sources
    0 .. n, some weights negative."""
    names = ["Q", "K", "V", "R"][:streams] if streams == 4 else ["mix"]
    rows = [[(0.9 - o if s == c else 0.1 - 0.05 * s) if s <= c else None for s in range(n + 1)] for c in range(n + 1)]
    weights = {name: rows[:n] + [rows[n] if k == len(names) - 1 else None] for k, name in enumerate(names)}
    return {"streams": names, "weights": weights, "n_sources": n + 1, "first_block": 0}


def profile_json(gpu=True):
    rows = []
    for res in ["preln", "hc", "attnres"]:
        for n, d in [(2, 192), (4, 128), (8, 96)]:
            rows.append({"residual": res, "n_layer": n, "d_model": d, "d_ff": 8 * d // 3, "ar": d / n, "seq": 256,
                         "batch": 8, "prefill_flops": 2e9 * n, "prefill_flops_head": 1e8,
                         "residual_overhead_flops": 1e6, "train_flops_per_token": 1e7,
                         "kv_cache_bytes": 4 * n * d * 256, "kv_cache_bytes_batch": 32 * n * d * 256,
                         "weight_bytes": 4e6, "fwd_ms": 1.0 * n if gpu else None,
                         "fwdbwd_ms": 3.0 * n if gpu else None, "tok_per_s": 1e5 if gpu else None,
                         "peak_mem_bytes": 1e8 * n if gpu else None, "peak_mem_kind": "allocated" if gpu else None})
    return {"schema": "depthbench.profile/1", "device": "NVIDIA H200", "dtype": "bfloat16", "rows": rows}


def write(folder, rel, obj):
    path = Path(folder) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


@pytest.fixture
def full_dir(tmp_path):
    """A folder with something for every figure: a small sweep, diagnoses of two designs and depths, a profile."""
    runs = tmp_path / "runs"
    for res in ["preln", "attnres"]:
        for n, d in [(2, 192), (4, 128), (8, 96)]:
            for lr in [1e-3, 2e-3]:
                for seed in [0, 1]:
                    write(runs, f"{res}_L{n}_lr{lr}_s{seed}/run.json",
                          train_json(res, n, d, lr, seed, final=3.0 + 0.1 * n - 100 * lr + 0.01 * seed))
    write(runs, "hc_L4_s0/run.json", train_json("hc", 4, 128, 2e-3, 0, diverged=True))
    for res in ["preln", "hc", "attnres", "block_attnres", "mudd", "denseformer"]:
        for n in [4, 8]:
            write(runs, f"diag/{res}_L{n}.json", diagnose_json(res, n, 256 // n))
    write(runs, "profile/h200.json", profile_json())
    return runs


def assert_png(path):
    """Exists, is a PNG by its magic bytes, has some size, and is not one flat colour."""
    path = Path(path)
    assert path.exists(), path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img[..., :3].std() > 0.01  # a blank white canvas has std 0

# -----------------------------------------------------------------------------
# tests


@pytest.mark.slow
@pytest.mark.parametrize("name,fn", plot.FIGURES, ids=[n for n, _ in plot.FIGURES])
def test_each_figure_draws_a_png(full_dir, tmp_path, name, fn):
    """Every figure function draws a non-blank PNG from fixture JSON and says what it drew."""
    data, skipped = drawing.load_folder(full_dir)
    assert skipped == []
    info = fn(data, tmp_path / "figs" / f"{name}.png")
    assert "drew" in info, info
    assert_png(tmp_path / "figs" / f"{name}.png")


@pytest.mark.parametrize("name,fn", plot.FIGURES, ids=[n for n, _ in plot.FIGURES])
def test_each_figure_skips_without_its_data(tmp_path, name, fn):
    """With nothing to draw, a figure writes no file and gives a reason."""
    info = fn({"train": [], "diagnose": [], "profile": []}, tmp_path / "x.png")
    assert info.get("skipped") and not (tmp_path / "x.png").exists()


def test_composition_figure_counts_finished_synthetic_runs(full_dir, tmp_path):
    """The composition probe draws every finished run with per-gap accuracy (not the diverged one) and
    every gap; a run without per_level (real text) is left out."""
    data, _ = drawing.load_folder(full_dir)
    data["train"].append(dict(train_json("preln", 2, 192), evals=[{"step": 10, "per_level": None}]))
    info = plot.fig_composition(data, tmp_path / "c.png")
    assert info["drew"] == "24 runs, gaps 1, 2, 3, 4"
    assert_png(tmp_path / "c.png")


@pytest.mark.slow
def test_imports_without_torch():
    """plot.py (and depthbench/reports/plot_suite.py, depthbench/reports/plot_telemetry.py) must work where torch is
    absent: each imports with torch
    blocked, and never pulls torch in."""
    for module in ("plot", "depthbench.reports.plot_suite", "depthbench.reports.plot_telemetry"):
        blocked = f"import sys; sys.modules['torch'] = None; import {module}"  # any 'import torch' would raise
        absent = f"import sys, {module}; assert 'torch' not in sys.modules"
        for code in (blocked, absent):
            r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr


def test_diverged_run_is_marked_not_dropped(full_dir, tmp_path):
    """The diverged HC run shows up in what fig2 and the loss curves report as marked."""
    data, _ = drawing.load_folder(full_dir)
    div = str(Path("hc_L4_s0") / "run.json")
    assert plot.fig2_final_loss(data, tmp_path / "a.png")["diverged"] == [div]
    assert plot.fig2_loss_curves(data, tmp_path / "b.png")["diverged"] == [div]


def test_best_lr_is_lowest_mean_over_seeds(tmp_path):
    """Per (design, AR) the LR with the lowest mean final val loss wins; an LR with a diverged seed loses, and
    an unfinished run does not count."""
    runs = [train_json("preln", 4, 128, 1e-3, s, final=3.0 + s) for s in (0, 1)]       # mean 3.5
    runs += [train_json("preln", 4, 128, 2e-3, s, final=3.2 + 0.1 * s) for s in (0, 1)]  # mean 3.25: best
    runs += [train_json("preln", 4, 128, 4e-3, 0, final=2.0),                           # lower, but
             train_json("preln", 4, 128, 4e-3, 1, diverged=True)]                       # one seed blew up
    runs += [dict(train_json("preln", 4, 128, 8e-3, 0, final=1.0), finished=False)]     # killed early: ignored
    for i, r in enumerate(runs):
        r["_path"] = f"r{i}.json"
    info = plot.fig2_final_loss({"train": runs}, tmp_path / "f.png")
    assert info["best_lr"] == {"preln@32": 2e-3}
    assert info["diverged"] == ["r5.json"]
    assert "1 unfinished left out" in info["drew"]


def test_a_linked_run_folder_is_read_once(tmp_path):
    """mini.py links a cell's first seed from its sweep folder into the probe's: plotting the probe reads the
    link, and plotting the folder above both reads that run once, not twice."""
    sweep = write(tmp_path, "text-lr/preln_ar32/s0/run.json", train_json(seed=0, final=3.0)).parent
    write(tmp_path, "text/s1/run.json", train_json(seed=1, final=3.2))
    (tmp_path / "text" / "s0").symlink_to(sweep, target_is_directory=True)
    assert sorted(r["config"]["seed"] for r in drawing.load_folder(tmp_path / "text")[0]["train"]) == [0, 1]
    data, skipped = drawing.load_folder(tmp_path)
    assert sorted(r["config"]["seed"] for r in data["train"]) == [0, 1] and not skipped


def test_other_schema_version_is_skipped_by_name(tmp_path):
    """A depthbench.train/2 file is not drawn; the reason names the version found and the one supported."""
    write(tmp_path, "new/run.json", dict(train_json(), schema="depthbench.train/2"))
    write(tmp_path, "ok/run.json", train_json())
    data, skipped = drawing.load_folder(tmp_path)
    assert len(data["train"]) == 1 and data["train"][0]["_path"] == str(Path("ok/run.json"))
    assert skipped == [(str(Path("new/run.json")), "schema depthbench.train/2, this plot.py reads version 1")]


def test_diagnose_v1_is_read_with_the_last_three_quarters_as_headline(tmp_path):
    """diagnose/1 (R_perm = all pairs, R_perm_last34) is drawn as /2: R_perm = the last three quarters."""
    old = diagnose_json("hc", 4)
    old["schema"] = "depthbench.diagnose/1"
    old["permutation_score"] = {"R_perm": 0.5, "R_perm_last34": 0.25, "threshold": 0.15}
    write(tmp_path, "d/diagnose.json", old)
    data, skipped = drawing.load_folder(tmp_path)
    assert not skipped
    perm = data["diagnose"][0]["permutation_score"]
    assert (perm["R_perm"], perm["R_perm_all"]) == (0.25, 0.5)


def test_junk_json_is_skipped_with_a_reason(tmp_path):
    """Broken, schema-less, unknown-schema and incomplete files are listed as skipped, never raised."""
    write(tmp_path, "broken.json", "{not json")
    write(tmp_path, "list.json", [1, 2])
    write(tmp_path, "other.json", {"schema": "somebody.else/1"})
    write(tmp_path, "noconfig.json", {"schema": "depthbench.train/1"})
    write(tmp_path, "listmeta.json", {"schema": "depthbench.diagnose/1", "meta": [1]})
    data, skipped = drawing.load_folder(tmp_path)
    assert sum(map(len, data.values())) == 0
    reasons = dict(skipped)
    assert "not valid JSON" in reasons["broken.json"]
    assert "no 'schema'" in reasons["list.json"]
    assert "unknown schema" in reasons["other.json"]
    assert "config" in reasons["noconfig.json"]
    assert "meta" in reasons["listmeta.json"]


def test_main_draws_exactly_what_the_folder_supports(tmp_path, capsys):
    """Train runs only: the two fig2 files and the composition probe are drawn, every diagnose/profile figure is
    listed as skipped."""
    runs = tmp_path / "runs"
    write(runs, "a/run.json", train_json("preln"))
    write(runs, "b/run.json", train_json("hc", diverged=True))
    write(runs, "c/run.json", dict(train_json(), schema="depthbench.train/2"))
    diag = diagnose_json("preln")
    diag["attnres_weights"] = {"skipped": "not an AttnRes model"}  # present but not applicable
    for key in ["dead_zone", "transport_erank", "nll", "angular_distance", "causal_score",
                "permutation_score", "logit_lens", "layer_pruning", "token_collapse", "zeroshot"]:
        del diag[key]
    write(runs, "diag.json", diag)
    out = tmp_path / "figs"
    assert plot.main([str(runs), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["fig2_final_loss_vs_ar.png", "fig2_loss_curves.png",
                                                     "mini_composition_vs_depth.png"]
    text = capsys.readouterr().out
    assert "skipped c/run.json: schema depthbench.train/2, this plot.py reads version 1" in text.replace("\\", "/")
    assert "fig7_attnres_weights: skipped (no diagnose JSON with attnres_weights)" in text
    assert "fig11_system_cost: skipped" in text
    assert "1 diverged run(s) marked" in text


def test_malformed_fields_cost_a_figure_not_the_run(tmp_path, capsys):
    """Schema-valid JSON with junk inside (strings for lists, nulls, wrong types): main finishes, prints a
    one-line FAILED or a figure for each, and never raises."""
    run = dict(train_json(), steps="x", evals=5, final=None)
    run["config"] = dict(run["config"], lr="abc", n_layer=None)
    diag = diagnose_json("block_attnres")
    for key, field in [("angular_distance", "subsequent"), ("causal_score", "matrix"), ("attnres_weights", "block")]:
        diag[key][field] = "oops"
    diag["logit_lens"]["states"] = [1, None]
    diag["layer_pruning"]["layers"] = "x"
    diag["dead_zone"] = {"schedule": [None, "a", 0.3]}
    diag["nll"] = {"categories": {"coding": 3}}
    prof = {"schema": "depthbench.profile/1", "rows": [1, {"residual": "hc"}, {"residual": "preln", "ar": "x"}]}
    for name, obj in [("run.json", run), ("diag.json", diag), ("prof.json", prof)]:
        write(tmp_path / "runs", name, obj)
    assert plot.main([str(tmp_path / "runs"), "--out", str(tmp_path / "figs")]) in (0, 1)
    lines = capsys.readouterr().out.splitlines()
    names = [n for n, _ in plot.FIGURES]
    assert sorted(line.split(":")[0] for line in lines if line.split(":")[0] in names) == sorted(names)


def test_a_field_of_the_wrong_type_skips_its_file_by_name(tmp_path, capsys):
    """Right schema, wrong field types ("evals": 5, "config": [], a null eval, a number for a gap's result): each file
    is skipped with one line naming it and the field, and every figure is drawn from the rest, none FAILED."""
    runs = tmp_path / "runs"
    for seed in (0, 1):
        write(runs, f"good{seed}/run.json", train_json("preln", seed=seed))
    bad = {"evals": dict(train_json(), evals=5), "config": dict(train_json(), config=[]),
           "evals[0]": dict(train_json(), evals=[None]),
           "evals[0].per_level.2": dict(train_json(), evals=[dict(train_json()["evals"][0], per_level={"2": 0.5})])}
    for k, (field, obj) in enumerate(bad.items()):
        write(runs, f"bad{k}/run.json", obj)
    assert plot.main([str(runs), "--out", str(tmp_path / "figs")]) == 0
    lines = capsys.readouterr().out.replace("\\", "/").splitlines()
    for k, field in enumerate(bad):
        said = [line for line in lines if line.startswith(f"  skipped bad{k}/run.json: ")]
        assert len(said) == 1 and f"field {field!r} is " in said[0], (field, said)
    assert lines[0].endswith("2 train, 0 diagnose, 0 profile; 4 file(s) skipped")
    assert any(line.startswith("fig2_final_loss_vs_ar: ") and "from 2 runs" in line for line in lines)
    assert not [line for line in lines if "FAILED" in line]


@pytest.mark.slow
def test_main_draws_everything_with_svg(full_dir, tmp_path, capsys):
    """A complete folder gives every figure, as PNG and SVG; --only narrows it down."""
    out = tmp_path / "figs"
    assert plot.main([str(full_dir), "--out", str(out), "--svg"]) == 0
    names = {n for n, _ in plot.FIGURES}
    assert {p.stem for p in out.glob("*.png")} == names
    assert {p.stem for p in out.glob("*.svg")} == names
    assert "skipped (" not in capsys.readouterr().out


def test_profile_without_gpu_timings_still_draws(tmp_path):
    """A CPU profile (no measured times or memory) still gives the analytic panels."""
    prof = dict(profile_json(gpu=False), _path="p.json")
    assert "drew" in plot.fig11_system({"profile": [prof]}, tmp_path / "p.png")
    assert_png(tmp_path / "p.png")


@pytest.mark.parametrize("args", [["/no/such/folder"], [str(ROOT), "--only", "fig99"], ["--bogus"]])
def test_bad_arguments_exit_2_with_one_line(args):
    """Bad arguments: exit status 2 and a single line on stderr (no usage block, no traceback)."""
    r = subprocess.run([sys.executable, "plot.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr, r.stderr


def test_a_zero_score_is_data_not_missing():
    """A seed whose R_causal is 0.0 must enter the seed mean of Fig. 6 (it was once dropped as 'empty'),
    while a null or an empty list is missing."""
    def doc(seed, value):
        return {"meta": {"residual": "hc", "n_layer": 6, "d_model": 104, "seed": seed},
                "causal_score": {"R_causal": value, "matrix": []}}
    data = {"diagnose": [doc(0, 1 / 6), doc(1, 0.0), doc(2, None)]}
    assert [g["meta"]["seed"] for g in drawing.with_metric(data, "causal_score.R_causal")] == [0, 1]
    assert drawing.with_metric(data, "causal_score.matrix") == []


# ----------------------------------------------------------------------------- depthbench/reports/plot_suite.py: the
# suite across designs

def suite_dir(tmp_path):
    """A mini suite's probe folder: the ten designs x three shapes x three seeds at 2e-3 (Pre-LN also at 1e-2 at
    the shallowest, worse, so not its choice); MoDA diverged on every seed at the deepest shape, Sandwich on seed 2
    there; a diagnose.json beside each run of the deepest shape that finished."""
    runs = tmp_path / "text"
    for i, res in enumerate(drawing.DESIGNS):
        for n, d in [(2, 184), (4, 128), (9, 88)]:
            for seed in range(3):
                diverged = (res == "moda" and n == 9) or (res == "sandwich" and n == 9 and seed == 2)
                final = suite_loss(i, n, seed)
                write(runs, f"{res}_L{n}_s{seed}/run.json", train_json(res, n, d, 2e-3, seed, diverged, final))
                if n == 9 and not diverged:
                    write(runs, f"{res}_L{n}_s{seed}/diagnose.json", diagnose_json(res, n, d))
    for seed in range(3):
        write(runs, f"preln_L2_lr1e-2_s{seed}/run.json", train_json("preln", 2, 184, 1e-2, seed, final=5.0))
    return runs


def suite_loss(i, n, seed):
    """The i-th design's final loss at depth n on a seed: seeds differ, and by how much differs between designs."""
    return 3.0 + 0.01 * (i - 4) - 0.02 * n + 0.004 * seed * (i % 3) + 0.001 * seed


def test_suite_figures_draw_ten_designs_and_the_paired_differences(tmp_path):
    """Both suite figures are written; the relative panel plots, per design and shape, the mean, least and greatest
    of the per-seed differences from Pre-LN and their 95% t interval (compare.paired, by hand here: mean ±
    t(0.975, n-1) · sd / √n); a shape where a design diverged at every LR is marked, never plotted, and a diverged
    seed drops out of the pairs."""
    from depthbench.reports import plot_suite
    data, skipped = drawing.load_folder(suite_dir(tmp_path))
    assert skipped == []
    info = plot_suite.fig_suite_loss(data, tmp_path / "loss.png")
    assert_png(tmp_path / "loss.png")
    assert info["diverged"] == ["moda@L9"]
    names = list(drawing.DESIGNS)
    t975 = {1: 12.7062047, 2: 4.3026527}  # Student's t, 97.5th percentile, by degrees of freedom
    expected = {}
    for i, res in enumerate(names[1:], start=1):
        for n in (2, 4, 9):
            seeds = [s for s in range(3) if not (res == "sandwich" and n == 9 and s == 2)]
            if res == "moda" and n == 9:
                continue
            deltas = [suite_loss(i, n, s) - suite_loss(0, n, s) for s in seeds]
            half = t975[len(deltas) - 1] * np.std(deltas, ddof=1) / np.sqrt(len(deltas))
            expected[f"{res}@L{n}"] = (np.mean(deltas), min(deltas), max(deltas), np.mean(deltas) - half,
                                       np.mean(deltas) + half)
    assert set(info["relative"]) == set(expected)
    for key, want in expected.items():
        got = info["relative"][key]
        assert tuple(got[f] for f in ("mean", "low", "high", "ci_low", "ci_high")) == pytest.approx(want, abs=1e-6), key
    assert len({round(v["high"] - v["low"], 9) for v in info["relative"].values()}) > 1  # seed ranges differ
    for key, (_, _, _, ci_low, ci_high) in expected.items():  # the verdict: the interval's side of 0
        want = "worse" if ci_low > 0 else "unresolved"
        assert info["relative"][key]["verdict"] == ("better" if ci_high < 0 else want), key
    assert {v["verdict"] for v in info["relative"].values()} == {"worse", "unresolved"}  # the fixture: Pre-LN lowest
    info = plot_suite.fig_suite_depth_use(data, tmp_path / "depth.png")
    assert_png(tmp_path / "depth.png")
    assert info["drew"] == "10 designs at L9"


@pytest.mark.slow
def test_the_shape_fit_figure_draws_each_designs_fit(tmp_path):
    """suite_shape_fit: a panel per design with three shapes of finished runs (not MoDA, diverged at L9), each with
    shape_fit.fit_design of its finished seeds in seed order (what summary.md's table computes); the fixture's loss
    falls with depth at every shape, ever less steeply in log AR, so every best AR is the deepest measured, 'monotone'."""
    from depthbench.reports import plot_suite, shape_fit
    data, _ = drawing.load_folder(suite_dir(tmp_path))
    info = plot_suite.fig_suite_shape_fit(data, tmp_path / "fit.png")
    assert_png(tmp_path / "fit.png")
    assert sorted(info["fits"]) == sorted(r for r in drawing.DESIGNS if r != "moda")
    for i, res in enumerate(drawing.DESIGNS):
        if res == "moda":
            continue
        losses = {round(d / n, 3): [suite_loss(i, n, s) for s in range(3) if not (res == "sandwich" and n == 9 and
                                                                                 s == 2)]
                  for n, d in [(2, 184), (4, 128), (9, 88)]}
        fit = shape_fit.fit_design(losses)
        got = info["fits"][res]
        assert (got["best_ar"], got["low"], got["high"], got["curvature"]) == pytest.approx(
            (fit.best_ar, fit.low, fit.high, fit.curvature)), res
        assert (got["best_ar"], got["where"]) == (pytest.approx(88 / 9, abs=1e-3), "monotone"), res
    assert "skipped" in plot_suite.fig_suite_shape_fit({"train": data["train"][:3]}, tmp_path / "none.png")


def test_suite_ticks_name_the_shapes_and_families_differ():
    from depthbench.reports import plot_suite
    assert [plot_suite.shape_tick(ar, L) for ar, L in [(92.0, 2), (17.33, 6), (9.78, 9)]] == [
        "92 (L2)", "17 (L6)", "9.8 (L9)"]
    styles = {res: plot_suite.line_style(res) for res in drawing.DESIGNS}
    assert {res for res, s in styles.items() if s == "-"} == set(plot_suite.PRE_LN_FAMILY)
    assert len(set(styles.values())) == 2 and len({drawing.colour(r) for r in drawing.DESIGNS}) == 10


@pytest.mark.slow
def test_plot_suite_main_draws_its_figures(tmp_path, capsys):
    from depthbench.reports import plot_suite
    out = tmp_path / "figs"
    assert plot_suite.main([str(suite_dir(tmp_path)), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["suite_fig2_loss_vs_ar.png", "suite_fig6_depth_use.png",
                                                     "suite_shape_fit.png"]
    with pytest.raises(SystemExit) as e:
        plot_suite.main([str(tmp_path / "missing")])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("depthbench.reports.plot_suite: error:")


def test_zeroshot_figure_has_a_panel_per_scored_task_and_a_line_per_design(full_dir, tmp_path, monkeypatch):
    """Tasks in the order the JSON gives them, a task every JSON skipped left out; per panel a line per design for
    acc, and for acc_norm only where the task reports it (WinoGrande does not)."""
    from matplotlib.axes import Axes
    from depthbench.reports import plot_eval
    drawn, plot_line = [], Axes.plot

    def recording_plot(ax, *args, **kw):
        drawn.append((ax, kw.get("label")))
        return plot_line(ax, *args, **kw)
    monkeypatch.setattr(Axes, "plot", recording_plot)
    data, _ = drawing.load_folder(full_dir)
    info = plot_eval.fig_zeroshot(data, tmp_path / "z.png")
    assert info["tasks"] == ["arc_easy", "winogrande"] and info["drew"] == "2 task(s) from 12 diagnose JSON"
    assert_png(tmp_path / "z.png")
    panels = list(dict.fromkeys(ax for ax, _ in drawn))
    designs = ["Pre-LN", "HC", "Full AttnRes", "Block AttnRes", "mudd", "denseformer"]   # (no colour or name yet)
    assert [sorted(label for ax, label in drawn if ax is p) for p in panels] == [
        sorted([f"{d} acc" for d in designs] + [f"{d} acc_norm" for d in designs]), sorted(f"{d} acc" for d in designs)]
    skipped = {"diagnose": [dict(diagnose_json(), zeroshot={"tasks": {"piqa": {"skipped": "no data"}}})]}
    assert "every one skipped" in plot_eval.fig_zeroshot(skipped, tmp_path / "z3.png")["skipped"]


@pytest.mark.slow
def test_dense_weights_figure_has_a_panel_per_stream(full_dir, tmp_path, monkeypatch):
    """diagnose.py's dense metric as the paper's Fig. 7: per model a row of heatmaps, one per stream (MUDD's Q, K, V,
    R; DenseFormer's mix, the rest of its row blank), each the stream's consumer x source matrix; the other designs'
    JSON (skipped) draw nothing."""
    from depthbench.reports import plot_eval
    drawn, heatmap = [], drawing.heatmap
    monkeypatch.setattr(drawing, "heatmap", lambda ax, m, *a, **kw: drawn.append((kw["title"], m.shape)) or heatmap(
        ax, m, *a, **kw))
    data, _ = drawing.load_folder(full_dir)
    info = plot_eval.fig_dense_weights(data, tmp_path / "w.png")
    assert info["drew"] == "4 model(s)"
    assert_png(tmp_path / "w.png")
    titles = sorted(t.split(": ")[1] for t, _ in drawn)
    assert titles == sorted(["Q", "K", "V", "R", "mix"] * 2)
    assert {shape for _, shape in drawn} == {(5, 5), (9, 9)}


def test_token_collapse_figure_draws_a_line_per_model_and_metric(full_dir, tmp_path):
    from depthbench.reports import plot_eval
    data, _ = drawing.load_folder(full_dir)
    info = plot_eval.fig_token_collapse(data, tmp_path / "t.png")
    assert info["drew"] == "12 model(s)"
    assert_png(tmp_path / "t.png")


# ----------------------------------------------------------------------------- a tiny suite at a glance (issue 67)

def tiny_suite(tmp_path, designs, seeds):
    """A mini suite's probe folder of `designs` x two shapes (L4 d128: AR 32; L9 d88: AR 9.78, what --ar 9.1 gives)
    x `seeds` at 2e-3, each run diagnosed, the diagnosis's own seed 7 (diagnose.py --seed): the run's names it."""
    runs = tmp_path / "text"
    for res in designs:
        for n, d in [(4, 128), (9, 88)]:
            for seed in seeds:
                run = train_json(res, n, d, 2e-3, seed, final=3 - 0.02 * n)
                run["config"]["ar_asked"] = {4: 32.0, 9: 9.1}[n]   # what recipe.resolve records of --ar
                write(runs, f"{res}_L{n}_s{seed}/run.json", run)
                write(runs, f"{res}_L{n}_s{seed}/diagnose.json", dict(diagnose_json(res, n, d)))
    data, skipped = drawing.load_folder(runs)
    assert skipped == []
    for g in data["diagnose"]:
        g["meta"]["seed"] = 7
    return data


def drawn(monkeypatch, fn, data, path):
    """The matplotlib Figure that figure function `fn` draws (drawing.save closes it: kept open here)."""
    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", kept.append)
    info = fn(data, path)
    monkeypatch.setattr(plt, "close", close)
    assert "skipped" not in info and len(kept) == 1, info
    return kept[0]


def legend_texts(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []


@pytest.mark.parametrize("designs, seeds", [(["hc"], [0]), (["preln", "hc"], [0, 1])])
def test_a_tiny_suites_figures_name_each_design_shape_and_seed(tmp_path, monkeypatch, designs, seeds):
    """The figures of a one-design one-seed suite and of a two-design two-seed one, as matplotlib objects: every
    per-run panel titled with its design, shape and (the run's) seed; on the loss curves each seed its own legend
    entry, shade and marker within its design's colour; the AR ticks and titles as the run folders name the shapes,
    with the --ar asked where it differs (asked 9.1, got 9.78); the suite
    figure relative to Pre-LN only where a design pairs with it; each seed named in the depth-use legend."""
    from matplotlib.figure import Figure
    from depthbench.reports import plot_suite
    monkeypatch.setattr(Figure, "savefig", lambda *args, **kwargs: None)  # the objects are checked, not the pixels
    data, names = tiny_suite(tmp_path, designs, seeds), [drawing.display(r) for r in designs]
    runs = [f"{name} {shape} seed {s}" for name in names for shape in ("L4 d128", "L9 d88") for s in seeds]
    fig = drawn(monkeypatch, plot.fig8_pruning, data, tmp_path / "pruning.png")
    assert sorted(ax.get_title() for ax in fig.axes) == sorted(f"{run} (base 3)" for run in runs)
    fig = drawn(monkeypatch, plot.fig2_loss_curves, data, tmp_path / "curves.png")
    assert [ax.get_title() for ax in fig.axes] == [f"{n} {shape}" for n in names for shape in
                                                   ("L4 d128 (AR 32)", "L9 d88 (AR 9.78, asked 9.1)")]
    for ax in fig.axes:
        assert legend_texts(ax) == [f"lr 2e-3 seed {s}" for s in seeds]
        looks = [(line.get_color(), line.get_marker()) for line in ax.get_lines()]
        assert len(set(looks)) == len(seeds) == len({colour for colour, _ in looks})
    fig = drawn(monkeypatch, plot.fig2_final_loss, data, tmp_path / "final.png")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["9.78\nasked 9.1", "32"]
    assert legend_texts(fig.axes[0]) == names
    fig = drawn(monkeypatch, plot.fig8_logit_lens, data, tmp_path / "lens.png")
    assert sorted(legend_texts(fig.axes[-1])) == sorted(runs)
    fig = drawn(monkeypatch, plot_suite.fig_suite_loss, data, tmp_path / "suite.png")
    assert len(fig.axes) == 1 + ("preln" in designs and len(designs) > 1)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["9.8 (L9)\nasked 9.1", "32 (L4)"]
    fig = drawn(monkeypatch, plot_suite.fig_suite_depth_use, data, tmp_path / "depth.png")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == names
    assert [f"seed {s}" for s in seeds] == [t for t in legend_texts(fig.axes[1]) if t.startswith("seed")]
