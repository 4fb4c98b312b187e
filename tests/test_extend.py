"""
docs/contributing.md#adding-a-design, literally: a design class defined in this file and one registry
entry (monkeypatched), and train.py, diagnose.py and profile_gpu.py each run it, no other file touched.
CPU only, in-process, about half a minute on two cores:

    python -m pytest -q tests/test_extend.py
"""
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import diagnose
import profile_gpu
import train
from residuals import RESIDUALS, PreLN

TINY = ["--layers", "2", "--params", "100k", "--seq-len", "32", "--global-batch", "8", "--batch-size", "4",
        "--eval-iters", "1", "--log-every", "1"]


class Scaled(PreLN):
    """h = x + a_i F_i(RMSNorm_i(x)): Pre-LN with a learnt scalar a_i per sublayer, init a0 (an option)."""
    paper_lr = 1e-3
    options = {"a0": 1.0}

    @classmethod
    def cost(cls, L, d, T, **options):
        return 2 * L * d * T, 1  # one multiply per channel and sublayer

    def __init__(self, cfg, a0=1.0):
        super().__init__(cfg)
        self.a0 = a0
        self.a = nn.Parameter(torch.full((self.n_sub,), a0))

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        self.a.fill_(self.a0)

    def write(self, s, site, y, aux=None):
        return s + site.pick(self.a) * y

    def sublayer_params(self, i):
        return {**super().sublayer_params(i), "a": self.a[i]}


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setitem(RESIDUALS, "scaled", Scaled)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_an_eleventh_design_trains_diagnoses_and_profiles(tmp_path, capsys):
    """train.py (2 steps, a non-default option), diagnose.py (every metric) and profile_gpu.py (--analytic-only)
    on a design only this test knows: its option reaches the model and the run name, the gradient reaches its
    scalars, a block swap moves them, and its own cost is what profile_gpu reports."""
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--residual", "scaled", "--residual-args", '{"a0": 0.5}', "--max-steps", "2",
                           "--out", str(tmp_path)])
    assert e.value.code == 0
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith("scaled_a0-0.5_")
    run = json.loads((run_dir / "run.json").read_text())
    assert run["config"]["residual_args"] == {"a0": 0.5} and len(run["steps"]) == 2
    assert run["params"]["residual_extra"] == 4                                   # 2L scalars
    a = torch.load(run_dir / "ckpt.pt", weights_only=True)["model"]["res.a"]
    assert a.shape == (4,) and (a != 0.5).all()                                  # AdamW moved every scalar

    out = tmp_path / "diag.json"
    diagnose.main([str(run_dir), "--metrics", "all", "--num-samples", "4", "--seq-len", "16", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["meta"]["residual"] == "scaled" and doc["meta"]["residual_args"] == {"a0": 0.5}
    assert len(doc["causal_score"]["matrix"]) == 2 and len(doc["layer_pruning"]["layers"]) == 2
    assert "skipped" in doc["attnres_weights"] and "skipped" in doc["transport_erank"] and "skipped" in doc["nll"]
    model, *_ = diagnose.load_model(*diagnose.parse_args([str(run_dir)]))
    before = model.res.a.clone()
    diagnose.swap_blocks(model, 0, 1)
    assert torch.equal(model.res.a, before[[2, 3, 0, 1]])                        # the scalars move with their block

    capsys.readouterr()
    profile_gpu.main(["--analytic-only", "--residual", "preln,scaled", "--shapes", "4x64", "--seq", "32", "--json",
                      "--residual-args", '{"a0": 0.5}'])
    pre, scaled = json.loads(capsys.readouterr().out)["rows"]
    assert scaled["residual_overhead_flops"] == 2 * 4 * 64 * 32 and pre["residual_overhead_flops"] == 0
    assert scaled["params"] == pre["params"] + 8
    assert scaled["train_flops_per_token"] == pre["train_flops_per_token"] + 3 * 2 * 4 * 64


def test_fast_kernels_equal_the_reference_for_the_new_design():
    """The registry-wide equivalence test reaches a design added later: Scaled, at both of its shapes."""
    from test_all import KERNEL_SHAPES, assert_kernels_agree
    for shape in KERNEL_SHAPES:
        assert_kernels_agree("scaled", shape)


def test_options_are_checked_against_the_class(tmp_path, capsys):
    """An option no design of the grid declares, or of the wrong type, is one line and exit 2, nothing written."""
    for bad in ['{"a1": 0.5}', '{"a0": "big"}', '[1]']:
        with pytest.raises(SystemExit) as e:
            train.main(TINY + ["--residual", "scaled", "--residual-args", bad, "--out", str(tmp_path)])
        assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:                                        # the class's own value check
        train.main(TINY + ["--residual", "mhc", "--residual-args", '{"init": "nope"}', "--out", str(tmp_path)])
    assert e.value.code == 2 and "nope" in capsys.readouterr().err
    assert not any(Path(tmp_path).iterdir())
