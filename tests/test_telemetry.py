"""
Tests of depthbench/training/telemetry.py and depthbench/training/trackers.py (docs/training.md#telemetry): training is
bit-identical with and without telemetry, every design (an eleventh defined here too) gets its records, known answers of
the statistics, the TensorBoard events read back with tensorboard's own reader across --resume and a kill, W&B offline,
a missing package, and depthbench/reports/plot_telemetry.py's figures. CPU only, in-process train.py runs at a tiny
shape:

    python -m pytest -q tests/test_telemetry.py

The TensorBoard and W&B tests skip, saying why, where the optional package is not installed.
"""
import importlib.util
import json
import math
import shutil

import pytest
import torch
import torch.nn as nn

from depthbench.reports import drawing
from depthbench.reports import plot_telemetry
from depthbench.training import telemetry
import train
from depthbench.training import trackers
from model import GPT, GPTConfig
from residuals import RESIDUALS, PreLN
from test_train import load_run, one_thread, run_main  # noqa: F401 (one_thread: one intra-op thread here too)

# 2 blocks, d=64: 8 sequences of 32 tokens per step in 2 micro-batches, an eval every 2 steps
TINY = ["--layers", "2", "--params", "100k", "--seq-len", "32", "--global-batch", "8", "--batch-size", "4",
        "--eval-iters", "1", "--log-every", "1", "--eval-every", "2"]
NO_TB = importlib.util.find_spec("tensorboard") is None
NO_WANDB = importlib.util.find_spec("wandb") is None


class Scaled(PreLN):
    """An eleventh design, defined here: h = x + a_i F_i(RMSNorm_i(x)), with its own telemetry (the scalars)."""
    paper_lr = 1e-3

    def __init__(self, cfg):
        super().__init__(cfg)
        self.a = nn.Parameter(torch.ones(self.n_sub))

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        self.a.fill_(1.0)

    def write(self, s, site, y, ctx=None):
        return s + site.pick(self.a) * y

    def telemetry(self, rec):
        return {"a": self.a.tolist()}


@pytest.fixture(autouse=True)
def setup(monkeypatch):
    monkeypatch.setitem(RESIDUALS, "scaled", Scaled)
    monkeypatch.setenv("WANDB_MODE", "offline")          # never the network, even where a key is set
    monkeypatch.setenv("WANDB_SILENT", "true")


# ----------------------------------------------------------------------------- training does not notice

@pytest.mark.parametrize("residual", ["preln", "mhc"])
def test_training_is_bit_identical_with_and_without_telemetry(tmp_path, capsys, residual):
    """Telemetry at every step (the most it can intrude) against none at all: the same losses, gradient norms and
    evals to the last bit, and the same weights in the checkpoint."""
    args = TINY + ["--residual", residual, "--max-steps", "6"]
    assert run_main(args + ["--stats-every", "0", "--out", str(tmp_path / "off")], capsys)[0] == 0
    assert run_main(args + ["--stats-every", "1", "--out", str(tmp_path / "on")], capsys)[0] == 0
    off, on = load_run(tmp_path / "off"), load_run(tmp_path / "on")
    assert off["telemetry"]["records"] == [] and [r["step"] for r in on["telemetry"]["records"]] == list(range(1, 7))
    for key in ("loss", "grad_norm", "lr"):
        assert [s[key] for s in off["steps"]] == [s[key] for s in on["steps"]]
    assert [e["val_loss"] for e in off["evals"]] == [e["val_loss"] for e in on["evals"]]
    a, b = (torch.load(next((tmp_path / k).glob("*/ckpt.pt")), weights_only=True) for k in ("off", "on"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert torch.equal(a["rng"]["cpu"], b["rng"]["cpu"])


def test_stats_leave_the_model_rng_and_gradients_alone():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, d_ff=64, residual="hc"))
    x = torch.randint(0, 64, (2, 16))
    model(x, torch.randint(0, 64, (2, 16)))[1].backward()
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    rng, attributes = torch.get_rng_state(), dict(vars(model.res))
    rec = telemetry.stats(model, x, step=3)
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert vars(model.res) == attributes and "read" not in vars(model.res)  # telemetry set nothing on the design
    assert rec["step"] == 3 and rec["grad_norm"] is None                     # no probe: nothing of a step


# ----------------------------------------------------------------------------- known answers

def test_state_and_output_rms_known_answers():
    """Pre-LN with W_o and W_2 zeroed: every output is 0, so every state is the embedding; then with them back,
    state i+1 = state i + output i, checked against the model's own recorded depth states."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=3, d_model=32, n_head=2, d_ff=64))
    x = torch.randint(0, 64, (2, 16))
    emb = model.wte(x).detach().double().pow(2).mean().sqrt().item()
    saved = {}
    for b, block in enumerate(model.blocks):
        for name, lin in (("wo", block.attn.wo), ("w2", block.mlp.w2)):
            saved[(b, name)] = lin.weight.detach().clone()
            lin.weight.data.zero_()
    rec = telemetry.stats(model, x)
    assert rec["out_rms"] == [0.0] * 6 and rec["state_rms"] == pytest.approx([emb] * 7, rel=1e-12)
    for (b, name), w in saved.items():
        getattr(model.blocks[b].attn if name == "wo" else model.blocks[b].mlp, name).weight.data.copy_(w)
    states, outs, recorded = telemetry.sublayer_rms(model, x)
    assert states[0::2] == pytest.approx([telemetry.rms(z) for z in recorded.states], rel=1e-12)
    assert all(o > 0 for o in outs) and len(states) == 7


def test_probe_update_ratio_is_lr_times_grad_over_weight_under_sgd():
    """Under plain SGD the update is -lr g, so the ratio is lr |g| / |W| per group, exactly; unarmed steps are not
    captured."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, d_ff=64, residual="attnres"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = telemetry.Probe.of(model)
    telemetry.attach(probe, opt)
    assert probe.names == ["block.0", "block.1", "embed", "head", "design"]
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    opt.step()
    assert probe.step is None                                                 # not armed: nothing captured
    probe.armed, probe.target = True, 7
    grads = telemetry.group_norms([[p.grad for p in ps] for ps in probe.params])
    weights = telemetry.group_norms(probe.params)
    opt.step()
    assert probe.step == 7 and not probe.armed and probe.grad_norm == pytest.approx(grads, rel=1e-12)
    assert probe.update_ratio == pytest.approx([0.1 * g / w for g, w in zip(grads, weights)], rel=1e-5)


# ----------------------------------------------------------------------------- every design

DESIGN_KEYS = {"hc": {"erank", "erank_mean", "res_from_identity"},
               "mhc": {"erank", "erank_mean", "res_from_identity", "ds_error"},
               "attnres": {"depth_entropy", "depth_entropy_mean", "embedding_weight", "dead_sublayers"},
               "block_attnres": {"depth_entropy", "depth_entropy_mean", "embedding_weight", "dead_sublayers"},
               "moda": {"depth_share", "depth_share_mean"}, "scaled": {"a"},
               "mudd": {"embedding_weight", "newest_weight"}, "denseformer": {"embedding_weight", "newest_weight"},
               "resformer": {"lambda_first", "lambda_own"},
               "hybrid": {"depth_entropy", "depth_entropy_mean", "embedding_weight", "dead_sublayers"}}  # L2: all deep


@pytest.mark.parametrize("residual", list(RESIDUALS) + ["scaled"])
def test_every_design_writes_telemetry(tmp_path, capsys, residual):
    """The registry and an eleventh design: records at each eval with the generic part (2L + 1 states, 2L outputs,
    L blocks' gradient and update, all finite and positive) and the design's own statistics, in range."""
    code, _, err = run_main(TINY + ["--residual", residual, "--max-steps", "4", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    tel = load_run(tmp_path)["telemetry"]
    assert tel["stats_every"] is None and set(tel["definitions"]) == set(telemetry.DEFINITIONS)
    assert [r["step"] for r in tel["records"]] == [2, 4]
    for rec in tel["records"]:
        assert len(rec["state_rms"]) == 5 and len(rec["out_rms"]) == 4
        assert all(v > 0 for v in rec["state_rms"] + rec["out_rms"])
        for key in ("grad_norm", "update_ratio"):
            assert len(rec[key]["blocks"]) == 2 and all(v > 0 for v in rec[key]["blocks"])
            assert rec[key]["embed"] > 0 and rec[key]["head"] > 0
        design = rec["design"]
        assert set(design) == DESIGN_KEYS.get(residual, set())
        if residual in ("hc", "mhc"):
            assert len(design["erank"]) == 4 and all(1 <= e <= 4 + 1e-9 for e in design["erank"])
        if residual == "mhc":
            assert max(design["ds_error"]) < 1e-3                          # Sinkhorn's 20 iterations converge
        if residual in ("attnres", "block_attnres"):
            # consumer k = 1..4 mixes k + 1 sources at L2 (Block AttnRes: 4 groups of one sublayer, as Full)
            assert all(0 <= h <= math.log(k + 1) + 1e-6 for k, h in enumerate(design["depth_entropy"], 1))
            assert 1 <= design["dead_sublayers"] <= 4                        # sublayer 0 reads only the embedding
        if residual == "moda":
            assert len(design["depth_share"]) == 1 and 0 < design["depth_share"][0] < 1
        if residual in ("mudd", "denseformer"):       # block 1's input and the head's, near their init (0 and 1)
            assert len(design["embedding_weight"]) == len(design["newest_weight"]) == 2
            assert all(abs(w) < 0.1 for w in design["embedding_weight"])
            assert all(abs(w - 1) < 0.1 for w in design["newest_weight"])
        if residual == "resformer":                   # block 1's pair, near its init 0.5
            assert len(design["lambda_first"]) == 1 and abs(design["lambda_first"][0] - 0.5) < 0.1


# ----------------------------------------------------------------------------- trackers

def events(run_dir):
    """{tag: [steps]} of a run's TensorBoard folder, through tensorboard's own reader (which applies purges)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.skipif(NO_TB, reason="the optional tensorboard package is not installed (pip install tensorboard)")
def test_tensorboard_events_read_back_across_resume_and_a_kill(tmp_path, capsys):
    """Steps 1-4, --resume to 6, then the step-4 checkpoint put back as if the run had been killed after step 6
    without saving, and --resume to 8: every step once, evals at 2, 4, 6 and 8, telemetry with them."""
    args = TINY + ["--residual", "hc", "--log-to", "tensorboard", "--out", str(tmp_path)]
    assert run_main(args + ["--max-steps", "4"], capsys)[0] == 0
    (run_dir,) = tmp_path.iterdir()
    shutil.copy(run_dir / "ckpt.pt", tmp_path / "ckpt4.pt")
    assert run_main(args + ["--max-steps", "6", "--resume"], capsys)[0] == 0
    shutil.copy(tmp_path / "ckpt4.pt", run_dir / "ckpt.pt")                    # back to step 4: 5 and 6 again
    assert run_main(args + ["--max-steps", "8", "--resume"], capsys)[0] == 0
    tags = events(run_dir)
    assert tags["train/loss"] == list(range(1, 9)) and tags["train/grad_norm"] == list(range(1, 9))
    for tag in ("eval/val_loss", "eval/answer_acc", "telemetry/state_rms/0", "telemetry/out_rms/3",
                "telemetry/grad_norm/blocks/1", "telemetry/design/erank_mean"):
        assert tags[tag] == [2, 4, 6, 8], tag
    run = json.loads((run_dir / "run.json").read_text())
    assert [r["step"] for r in run["telemetry"]["records"]] == [2, 4, 6, 8]
    assert [s["step"] for s in run["steps"]] == list(range(1, 9))


@pytest.mark.slow
@pytest.mark.skipif(NO_WANDB, reason="the optional wandb package is not installed (pip install wandb)")
def test_wandb_offline_writes_its_run_folder_and_resumes_the_same_run(tmp_path, capsys):
    args = TINY + ["--log-to", "wandb", "--out", str(tmp_path)]
    assert run_main(args + ["--max-steps", "2"], capsys)[0] == 0
    (run_dir,) = tmp_path.iterdir()
    run_id = json.loads((run_dir / "run.json").read_text())["telemetry"]["wandb_id"]
    assert run_main(args + ["--max-steps", "4", "--resume"], capsys)[0] == 0
    assert json.loads((run_dir / "run.json").read_text())["telemetry"]["wandb_id"] == run_id
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(run_id) for f in folders)
    assert all(list(f.glob("*.wandb")) for f in folders)                    # each holds its run's records


def test_a_missing_tracker_package_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", "no_such_package_for_depthbench")
    code, _, err = run_main(TINY + ["--log-to", "tensorboard", "--out", str(tmp_path)], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "pip install no_such_package_for_depthbench" in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_trackers_never_write_a_step_twice():
    class Recorder(trackers.Tracker):
        def __init__(self, floor):
            super().__init__(floor)
            self.seen = []

        def write(self, step, scalars):
            self.seen.append(step)
    t = Recorder(floor=4)
    for step in (3, 4, 5, 5, 6):
        t.log(step, {"x": 1.0})
    t.log(7, {})
    assert t.seen == [5, 5, 6]          # steps up to the resumed one skipped; one step may carry several calls


# ----------------------------------------------------------------------------- depthbench/reports/plot_telemetry.py

def test_plot_draws_the_telemetry_figures(tmp_path, capsys):
    for residual in ("preln", "hc"):
        args = TINY + ["--residual", residual, "--max-steps", "4", "--stats-every", "1", "--out", str(tmp_path / "r")]
        assert run_main(args, capsys)[0] == 0
    data, skipped = drawing.load_folder(tmp_path / "r")
    assert not skipped and len(data["train"]) == 2
    out = plot_telemetry.fig_telemetry_state_rms(data, tmp_path / "f" / "rms.png")
    assert out == {"drew": "2 run(s)"} and (tmp_path / "f" / "rms.png").stat().st_size > 0
    (hc,) = [r for r in data["train"] if r["config"]["residual"] == "hc"]
    series = plot_telemetry.telemetry_series(hc["telemetry"]["records"])
    assert set(series) == {"state growth: head / embedding RMS", "update / weight, mean over blocks", "erank_mean",
                           "res_from_identity (mean)"}
    assert all(len(v) == 4 for v in series.values())
    assert "statistic" in plot_telemetry.fig_telemetry_design(data, tmp_path / "f" / "stats.png")["drew"]
    assert "skipped" in plot_telemetry.fig_telemetry_state_rms({"train": []}, tmp_path / "f" / "none.png")
    assert [name for name, _ in plot_telemetry.FIGURES] == ["telemetry_state_rms", "telemetry_statistics"]
