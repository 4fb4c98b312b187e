"""
diagnose.py's tests: known answers for every metric, the interventions, and the command line.

    python -m pytest -q tests/test_diagnose.py

CPU only, fp32, tiny models (3-4 blocks, width 32); well under a minute on 2 cores.
"""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import diagnose as dg
import ops
from data import ByteTokenizer
from depthbench.evaluation import nll
from depthbench.evaluation.interventions import block_tensors
from model import GPT, GPTConfig
from ops import rope_cos_sin
from depthbench.evaluation import observe
from residuals import RESIDUALS

ROOT = Path(__file__).resolve().parents[1]  # the repository root
ALL = list(RESIDUALS)
V = 32
ARGS = SimpleNamespace(causal_threshold=0.45, perm_threshold=0.15, dead_tau=0.05, eps=1e-8)


def build(residual, L=3, seed=0, **residual_args):
    if residual == "block_attnres" and not residual_args:
        residual_args = {"n_groups": 4}  # 6 sublayers in 4 groups of 1-2: boundaries inside and between blocks
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=V, n_layer=L, d_model=32, n_head=2, d_ff=96, residual=residual, residual_args=residual_args)
    return GPT(cfg).eval()


def tokens(B=2, T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, V, (B, T + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def layer_metrics(model, todo=("angular", "causal", "pruning", "lens", "attnres", "deadzone", "erank"), batches=None):
    """{metric name: its JSON object} of the metrics `todo` on the batches (default: one batch of tokens()), as
    diagnose.py computes a group of them: one recording pass for what they need."""
    rows = [dg.BY_NAME[m] for m in todo]
    out = dg.run_group(rows, dg.Inputs(model, ARGS, None, device="cpu", batches=batches or [tokens()]))
    return {m.name: out[m.key] for m in rows}


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "diagnose.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})})


# ----------------------------------------------------------------------------- the trunk loop and the skip rules

def trunk(model, x, skip=None):
    """(logits, depth states, lens readouts) of the observed forward (evaluation/observe.py), block `skip` left out."""
    logits, rec = dg.recording(model, x, skip=skip)
    return logits, rec.states, rec.readouts


@pytest.mark.parametrize("residual", ALL)
def test_recording_forward_equals_the_plain_forward(residual):
    """The observed forward (diagnose's only trunk loop) gives the plain forward's logits exactly, L + 1 states,
    and a last lens readout that is what the head reads."""
    model = build(residual)
    x, _ = tokens()
    with torch.no_grad():
        logits = model(x)[0]
        logits2, states, readouts = trunk(model, x)
    assert torch.equal(logits, logits2)
    assert len(states) == len(readouts) == 4
    assert torch.equal(model.lm_head(readouts[-1]), logits)  # the lens' last readout is the model's own


NEXT_OUTPUT = ("attnres", "block_attnres", "hybrid")   # AttnRes' next-output rule (the hybrid's default deep part)


@pytest.mark.parametrize("residual, args", [(r, {}) for r in ALL if r not in NEXT_OUTPUT] + [("hybrid", {"deep": "hc"})])
def test_skipped_block_returns_its_input(residual, args):
    """Residual family, HC/mHC, MoDA and the designs beyond the paper (a hybrid's Pre-LN blocks, its hand-over block
    and its deep blocks): with block s skipped, z_(s+1) equals z_s exactly."""
    model = build(residual, **args)
    x, _ = tokens()
    for s in range(3):
        with torch.no_grad():
            _, states, _ = trunk(model, x, skip=s)
        assert torch.equal(states[s + 1], states[s])


def test_block_attnres_of_single_sublayer_groups_equals_full_under_every_skip():
    """Group bookkeeping under skips: Block AttnRes with 2L groups behaves like Full AttnRes, skip or not."""
    full, block = build("attnres"), build("block_attnres", n_groups=6)
    block.load_state_dict(full.state_dict())
    x, _ = tokens()
    for s in [None, 0, 1, 2]:
        with torch.no_grad():
            a, b = trunk(full, x, skip=s), trunk(block, x, skip=s)
        assert torch.allclose(a[0], b[0], atol=1e-6) and all(torch.allclose(u, v, atol=1e-6) for u, v in zip(a[1], b[1]))


def test_block_attnres_skip_keeps_the_open_group_across_a_boundary():
    """Block AttnRes, L3 in 4 groups [0, 0 | 1 | 2, 2 | 3] of sublayers: block 1 (sublayers 2, 3) holds two
    group boundaries. Skipped, it returns its inputs unchanged (the reference's skip_block): the open
    group f0 + f1 is not closed, and block 2's attention output joins that same running sum."""
    model = build("block_attnres")
    assert model.res.group == [0, 0, 1, 2, 2, 3]
    with torch.no_grad():
        model.res.queries.normal_(0, 1.0)                # non-uniform depth weights: the test has teeth
    x, _ = tokens()
    res = model.res
    rope = rope_cos_sin(x.size(1), model.cfg.head_dim, model.cfg.rope_theta, x.device)

    def sublayer(s, i):
        f = model.blocks[i // 2].attn if i % 2 == 0 else model.blocks[i // 2].mlp
        site = res.sites[i]
        y = f(res.read(s, site)[0], rope)[0] if i % 2 == 0 else f(res.read(s, site)[0])
        return res.write(s, site, y, {})

    with torch.no_grad():
        s = sublayer(sublayer(res.init_stream(model.wte(x)), 0), 1)
        open_group = sublayer(sublayer(s, 4), 5)                       # block 1 left out, its inputs unchanged
        bank, partial = s
        closed = sublayer(sublayer((bank.push(partial), None), 4), 5)                # the rule this replaces
        # the bank's completed sources: [e, f0+f1+f4] vs [e, f0+f1, f4]
        assert len(open_group[0]) == 2 and len(closed[0]) == 3
        expect, other = (model.lm_head(res.collapse(t)) for t in (open_group, closed))
        logits, states, _ = trunk(model, x, skip=1)
    torch.testing.assert_close(logits, expect, rtol=0, atol=1e-6)
    assert (logits - other).abs().max() > 1e-4
    assert torch.equal(states[2], s[1])                                # z_2: the running sum f0 + f1


def test_attnres_next_output_rule():
    """Full AttnRes, block 1 of 3 skipped: block 2 reads (and z_2 is) the newest source, block 0's MLP output."""
    model = build("attnres")
    x, _ = tokens()
    with torch.no_grad():
        s = model.res.init_stream(model.wte(x))
        rope = rope_cos_sin(x.size(1), model.cfg.head_dim, model.cfg.rope_theta, x.device)
        attn0, mlp0_site = model.res.sites[0], model.res.sites[1]
        s = model.res.write(s, attn0, model.blocks[0].attn(model.res.read(s, attn0)[0], rope)[0], {})
        mlp0 = model.blocks[0].mlp(model.res.read(s, mlp0_site)[0])
        _, states, _ = trunk(model, x, skip=1)
    assert torch.allclose(states[2], mlp0, atol=1e-6)


@pytest.mark.parametrize("residual", ["preln", "sandwich", "lns", "hc", "moda"])
def test_blocks_that_output_zero_have_no_causal_effect_and_prune_for_free(residual):
    """Blocks 2-3 of 4 with W_o = W_2 = 0 write nothing: C(s, l) = 0 for l >= 2 and pruning them costs 0."""
    model = build(residual, L=4)
    with torch.no_grad():
        for b in (2, 3):
            model.blocks[b].attn.wo.weight.zero_()
            model.blocks[b].mlp.w2.weight.zero_()
    out = layer_metrics(model, ("causal", "pruning"))
    C = out["causal"]["matrix"]
    assert all(C[s][l] == 0.0 for l in (2, 3) for s in range(l))
    assert C[0][1] > 0
    deltas = [r["delta"] for r in out["pruning"]["layers"]]
    assert deltas[2] == 0.0 and deltas[3] == 0.0 and deltas[0] != 0.0


# ----------------------------------------------------------------------------- swaps

def loss(model):
    x, y = tokens()
    with torch.no_grad():
        return dg.ce_sum(model(x)[0], y)


@pytest.mark.parametrize("residual", [r for r in ALL if r != "lns"])  # LNS' scale moves too: see below
def test_swapping_identical_blocks_changes_nothing(residual):
    """Block 2 made a copy of block 1 (all its tensors): P(1, 2) = 0 exactly (4 blocks, so that for MoDA
    neither is the last block, which has no W_kv)."""
    model = build(residual, L=4)
    with torch.no_grad():
        for name, t in block_tensors(model, 1).items():
            block_tensors(model, 2)[name].copy_(t)
    P = dg.permutation(model, [tokens()], 0.15)["matrix"]
    assert P[1][2] == 0.0 and P[0][1] > 0


@pytest.mark.parametrize("residual", ALL)
def test_swapping_twice_restores_the_model_exactly(residual):
    model = build(residual)
    before, base = {k: v.clone() for k, v in model.state_dict().items()}, loss(model)
    assert dg.swap_blocks(model, 0, 2) > 0
    assert loss(model) != base
    dg.swap_blocks(model, 0, 2)
    assert loss(model) == base
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("residual", ["sandwich", "lns", "keel", "hc", "mhc", "attnres", "block_attnres", "moda"])
def test_a_swap_moves_the_residuals_own_tensors_once(residual):
    """After swap(0, 1), block 0's connector / norm / mixer tensors are block 1's old ones and vice versa."""
    model = build(residual)
    with torch.no_grad():  # make every tensor distinct, so a swap is visible
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    old = [{k: t.clone() for k, t in block_tensors(model, b).items()} for b in (0, 1)]
    own = [k for k in old[0] if not k.startswith("block.") and k in old[1]]
    assert own, "the design owns tensors per block"
    scales = [float(getattr(site, "scale", 0.0)) for site in model.res.sites]
    dg.swap_blocks(model, 0, 1)
    new = [block_tensors(model, b) for b in (0, 1)]
    for k in old[0]:
        if k in old[1] and old[0][k].shape == old[1][k].shape:
            assert torch.equal(new[0][k], old[1][k]) and torch.equal(new[1][k], old[0][k]), k
        else:  # no partner (KEEL block 0 has no attention post-norm): stays
            assert torch.equal(new[0][k], old[0][k]), k
    if residual == "lns":
        assert [float(site.scale) for site in model.res.sites[:4]] == scales[2:4] + scales[:2]


def test_a_tensor_under_two_names_is_swapped_once(monkeypatch):
    """The reference's HC defect: a module registered twice was swapped twice (a no-op). Here: once."""
    model = build("hc")
    plain = model.res.sublayer_params
    monkeypatch.setattr(model.res, "sublayer_params",
                        lambda i: {**plain(i), "alias": model.blocks[i // 2].attn.wq.weight})
    a, b = model.blocks[0].attn.wq.weight.clone(), model.blocks[1].attn.wq.weight.clone()
    dg.swap_blocks(model, 0, 1)
    assert torch.equal(model.blocks[0].attn.wq.weight, b) and torch.equal(model.blocks[1].attn.wq.weight, a)


# ----------------------------------------------------------------------------- metric math, known answers

def test_angular_distance_of_a_state_with_itself_is_0_and_with_its_opposite_is_1():
    z = torch.randn(50, 16)
    sums = dg.angle_sums([z, z.clone(), -z, torch.roll(z, 1, dims=1)])
    d = sums / (50 * math.pi)
    assert d[0, 1].item() < 1e-6 and abs(d[0, 2].item() - 1) < 1e-6 and 0.1 < d[0, 3].item() < 0.9


def test_effective_rank():
    assert ops.erank(torch.eye(4)) == pytest.approx(4.0)
    assert ops.erank(torch.outer(torch.arange(1.0, 5.0), torch.ones(4))) == pytest.approx(1.0)
    assert ops.erank(torch.full((4, 4), 0.25)) == pytest.approx(1.0)
    assert 1.0 < ops.erank(torch.diag(torch.tensor([1.0, 0.1, 0.1, 0.1]))) < 4.0


def test_r_causal_counts_only_the_last_three_quarters():
    """L = 8: s_min = 2, pairs 2 <= s < l <= 7: 15 of them. Above 0.45 (strictly): 3 counted, 3 not."""
    L = 8
    C = [[0.1 if l > s else None for l in range(L)] for s in range(L)]
    C[2][3] = C[5][7] = C[6][7] = 0.9      # counted
    C[0][1] = C[1][7] = 0.9                # s < s_min: not counted
    C[3][4] = 0.45                         # not strictly above
    assert dg.share_above(C, 0.45, L, math.ceil(L / 4)) == (15, 3, 3 / 15)


def test_r_perm_headline_counts_the_last_three_quarters():
    """L = 7: s_min = ceil(7/4) = 2 (floor would give 1), so the headline R_perm counts the 10 pairs
    2 <= i < j <= 6 and R_perm_all all 21; strictly above 0.15."""
    L = 7
    P = [[0.0 if j > i else None for j in range(L)] for i in range(L)]
    P[2][3] = P[5][6] = 0.2                # counted in both
    P[1][2] = P[0][6] = 0.2                # i < ceil(L/4): all pairs only
    P[4][5] = 0.15                         # not strictly above
    out = dg.perm_shares(P, 0.15, L)
    assert (out["n_pairs"], out["n_above"], out["R_perm"], out["s_min"]) == (10, 2, 2 / 10, 2)
    assert (out["n_pairs_all"], out["n_above_all"], out["R_perm_all"]) == (21, 4, 4 / 21)


def test_dead_zone_schedule_and_block_count():
    """Weights of 2L + 1 consumers (index 0 = embedding); a block is dead when both its sublayers are."""
    L = 3
    w = [[1.0], [0.99, 0.01], [0.97, 0.03], [0.5, 0.5], [0.96, 0.04], [0.98, 0.02], [0.2, 0.8]]
    dz = ops.dead_zone(w, L, 0.05)
    assert dz["dead"] == [True, True, True, False, True, True]
    assert dz["count_blocks"] == 2 and dz["count_sublayers"] == 5 and dz["head"] == pytest.approx(0.8)


@pytest.mark.parametrize("residual", ALL)
def test_logit_lens_ends_at_the_models_output(residual):
    """The last depth state decodes to the model's own distribution: KL 0, overlap 1, CE = the final loss."""
    lens = layer_metrics(build(residual), ("lens",))["lens"]
    last = lens["states"][-1]
    assert len(lens["states"]) == 4
    assert abs(last["kl_to_final"]) < 1e-6 and last["top5_overlap"] == 1.0
    assert last["early_exit_ce"] == pytest.approx(lens["final_loss"], rel=1e-6)  # fp32 sums


def test_design_metrics_apply_only_to_their_designs():
    """Not applicable = {"skipped": reason}, not an error; the design's own metrics are filled in."""
    pre, hc, full, block = (layer_metrics(build(r)) for r in ("preln", "hc", "attnres", "block_attnres"))
    for key in ("attnres", "deadzone", "erank"):
        assert set(pre[key]) == {"skipped"} and pre[key]["skipped"]
    assert hc["erank"]["per_connector"] == pytest.approx([4.0] * 6)  # HC starts at A_r = I
    assert "skipped" in hc["attnres"] and "skipped" not in full["deadzone"] and "skipped" not in block["deadzone"]
    rows = full["attnres"]["sublayer"]
    assert len(rows) == 7 and all(sum(v for v in r if v is not None) == pytest.approx(1.0) for r in rows)
    assert rows[3][4] is None and rows[3][3] is not None            # consumer 3 sees sources 0..3
    assert len(full["attnres"]["block"]) == 4 and full["attnres"]["block"][1][:2] == pytest.approx([1 / 3, 2 / 3])


# ----------------------------------------------------------------------------- downstream NLL

def test_nll_counts_exactly_the_answer_tokens():
    """Bytes tokenizer: answer tokens = answer bytes. Hand counts: gsm8k " 3 + 2 = 5\\n#### 5" = 17, then
    19, 18, 17 = 71; mbpp: the prompt's final newline moves to the code, a newline is appended: 33 x 3."""
    tok = ByteTokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, n_layer=2, d_model=32, n_head=2, d_ff=96)).eval()
    for task, count in (("gsm8k", 71), ("mbpp", 99)):
        rows = nll.nll_rows(task, ROOT / "fixtures" / "nll", None)
        total, n = nll.nll_task(model, tok, rows, task, 4096, 2, "cpu")
        assert n == count and 0 < total / n < 20
    # batching and right-padding change nothing: one example at a time gives the same sum
    rows = nll.nll_rows("sciq", ROOT / "fixtures" / "nll", None)
    assert nll.nll_task(model, tok, rows, "sciq", 4096, 3, "cpu")[0] == pytest.approx(
        nll.nll_task(model, tok, rows, "sciq", 4096, 1, "cpu")[0], rel=1e-5)


def test_nll_formats():
    p, t = nll.nll_pair("gsm8k", {"question": "Q?", "answer": "42"})
    assert (p, t) == ("Question: Q?\nAnswer:", " 42")
    row = {"Record ID": "r", "Question": "Q", "Correct Answer": " a ", "Incorrect Answer 1": "b",
           "Incorrect Answer 2": "c", "Incorrect Answer 3": "d", "Explanation": ""}
    p, t = nll.nll_pair("gpqa_diamond", row)
    assert t == " a" and p.startswith("Question: Q\nChoices:\nA. ") and p.endswith("\nAnswer:")
    assert sorted(line[3:] for line in p.splitlines()[2:6]) == ["a", "b", "c", "d"]   # stripped, shuffled
    assert p == nll.nll_pair("gpqa_diamond", row)[0]                  # the shuffle is seeded by the record
    p2, _ = nll.nll_pair("gpqa_diamond", {**row, "Question": " \n Q \n"})  # the question stripped, as the reference
    assert p2 == p
    assert nll.nll_pair("humaneval", {"prompt": "def f():", "canonical_solution": "x"}) == ("def f():", "x")  # no separator
    assert nll.encode_pair(ByteTokenizer(), "ab \n", "cd") == (list(b"ab"), list(b" \ncd"))


# ----------------------------------------------------------------------------- command line

@pytest.mark.slow
def test_cli_on_a_checkpoint_writes_every_metric(tmp_path):
    """A checkpoint in train.py's format, synthetic calibration: every metric computed or skipped with a reason."""
    model = build("hc", L=2)
    cfg = {**model.cfg.__dict__, "vocab_size": 25}
    model = GPT(GPTConfig(**cfg))
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"model": model.state_dict(), "model_config": cfg, "step": 7,
                "config": {"data": "synthetic", "data_dir": None, "tokenizer": None, "max_gap": 4, "seq_len": 16,
                           "seed": 3}}, run / "ckpt.pt")
    r = run_cli(str(run), "--num-samples", "4", "--batch-size", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads((run / "diagnose.json").read_text())
    assert out["schema"] == "depthbench.diagnose/2"
    assert out["meta"]["step"] == 7 and out["meta"]["seed"] == 3
    assert {m: (v["num_samples"], v["seq_len"]) for m, v in out["meta"]["samples"].items()} == {
        m.name: (4, 16) for m in dg.METRICS if m.protocol}   # --num-samples for every metric, the run's 16 tokens
    for m in dg.METRICS:
        assert m.key in out
    assert out["nll"]["skipped"] and out["zeroshot"]["skipped"] and out["attnres_weights"]["skipped"] and len(out["transport_erank"]["per_connector"]) == 4
    assert len(out["angular_distance"]["matrix"]) == 3 and out["angular_distance"]["matrix"][1][0] is None
    assert out["permutation_score"]["swap_dedup"] is True and out["causal_score"]["n_pairs"] == 0


def release_windows(paths, n, T, seed):
    """The release's token-shard rule, written out again: every file draw first (weights = usable lengths), then a
    start per drawn file."""
    import numpy as np
    arrays = [np.load(p) for p in paths]
    usable = np.array([max(0, len(a) - T) for a in arrays], dtype=np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(arrays), size=n, p=usable / usable.sum())
    out = []
    for k in picks:
        start = int(rng.integers(0, len(arrays[k]) - T))
        out.append(arrays[k][start:start + T].astype(np.int64))
    return np.stack(out)


def test_token_shard_windows_follow_the_release_rule(tmp_path):
    """Same seed, same windows as the rule reimplemented here; another seed others; a file too short is never drawn;
    the windows are slices of their file (values encode file and position)."""
    import numpy as np
    from depthbench.evaluation import windows
    lengths = [300, 40, 5, 1000]
    paths = []
    for f, n in enumerate(lengths):
        paths.append(tmp_path / f"eval_{f}.npy")
        np.save(paths[-1], (np.arange(n) + 10_000 * f).astype(np.uint16))
    got = windows.token_windows(paths, 64, 16, seed=42)
    assert got.dtype == torch.int64 and got.shape == (64, 16)
    assert np.array_equal(got.numpy(), release_windows(paths, 64, 16, 42))
    assert not torch.equal(got, windows.token_windows(paths, 64, 16, seed=43))
    files = (got[:, 0] // 10_000).tolist()
    assert 2 not in files and set(files) <= {0, 1, 3}
    assert torch.equal(got[:, 1:] - got[:, :-1], torch.ones(64, 15, dtype=torch.int64))   # contiguous slices


@pytest.mark.slow
def test_cli_defaults_are_the_release_protocol_per_metric(tmp_path, capsys):
    """No --num-samples/--seq-len: each metric gets the release's windows x tokens (capped at the run's length),
    metrics with one setting share one sweep; --token-data-glob gives the release's windows (a process, as typed);
    the help says the same; bf16 needs CUDA (those two in this process: the same main, without ~4 s of imports
    each; every script's --help also runs as a process in tests/test_first_day.py)."""
    import numpy as np
    for f in range(2):
        np.save(tmp_path / f"eval_{f}.npy", np.random.default_rng(f).integers(0, V, 4000).astype(np.uint16))
    r = run_cli("--init", "preln", "--layers", "2", "--width", "32", "--heads", "2", "--vocab", str(V),
                "--token-data-glob", str(tmp_path / "eval_*.npy"), "--metrics", "angular,lens,causal,perm,pruning",
                "--seed", "42", "--out", str(tmp_path / "d.json"), "--batch-size", "16")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "d.json").read_text())["meta"]
    assert {m: (v["num_samples"], v["seq_len"]) for m, v in meta["samples"].items()} == {
        "angular": (128, 512), "lens": (32, 512), "causal": (16, 256), "pruning": (16, 256), "perm": (12, 256)}
    assert "the release's rule, seed 42" in meta["samples"]["causal"]["calibration"]
    assert set(meta["timings_s"]) == {"128x512", "32x512", "16x256", "12x256"}
    with pytest.raises(SystemExit):
        dg.main(["--help"])
    want = ("angular, attnres, dense, erank, deadzone 128 x 512; causal, pruning 16 x 256; perm 12 x 256; lens 32 x 512; "
            "collapse 256 x 512")
    assert want in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as e:
        dg.main(["--init", "preln", "--layers", "2", "--width", "32", "--heads", "2", "--calib", "synthetic",
                 "--dtype", "bf16", "--device", "cpu", "--metrics", "angular"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--dtype bf16 runs on CUDA" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_cli_init_with_local_nll_fixtures(tmp_path):
    (tmp_path / "calib.txt").write_text("A short calibration text, tokenized as bytes. " * 3)
    r = run_cli("--init", "preln", "--layers", "2", "--width", "32", "--heads", "2", "--tokenizer", "bytes",
                "--calib", str(tmp_path / "calib.txt"), "--num-samples", "2", "--seq-len", "16",
                "--metrics", "nll,pruning", "--nll-data", "fixtures/nll", "--nll-max-len", "512", "--out", str(tmp_path / "d.json"))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "d.json").read_text())
    assert set(out["nll"]["tasks"]) == set(nll.TASKS) and set(out["nll"]["categories"]) == {"coding", "stem", "math"}
    gsm = out["nll"]["tasks"]["gsm8k"]
    assert gsm["num_examples"] == 4 and gsm["num_target_tokens"] == 71 and gsm["category"] == "math"
    math_cat = out["nll"]["categories"]["math"]
    assert math_cat["nll_sum"] == pytest.approx(gsm["nll_sum"] + out["nll"]["tasks"]["math500"]["nll_sum"])
    assert "angular_distance" not in out and len(out["layer_pruning"]["layers"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--init", "preln", "--metrics", "angular,bogus"], "unknown metric(s) bogus"),
    (["nowhere/run"], "no checkpoint"),
    ([], "give a checkpoint or --init"),
    (["--init", "preln", "--width", "30", "--heads", "4"], "multiple of --heads"),
])
def test_cli_errors_are_one_line(args, message):
    r = run_cli(*args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_unreachable_hub_fails_fast_in_one_line():
    t0 = time.time()
    r = run_cli("--init", "preln", "--layers", "2", "--width", "32", "--heads", "2", "--tokenizer", "bytes",
                "--calib", "synthetic", "--vocab", "257", "--metrics", "nll", env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert r.returncode == 2 and "cannot reach the HuggingFace hub" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and time.time() - t0 < 30


# ----------------------------------------------------------------------------- zero-shot tasks and token collapse

def zeroshot_argv(tmp_path, *extra):
    (tmp_path / "calib.txt").write_text("A short calibration text, tokenized as bytes. " * 3)
    return ["--init", "preln", "--layers", "2", "--width", "32", "--heads", "2", "--tokenizer", "bytes",
            "--calib", str(tmp_path / "calib.txt"), "--num-samples", "2", "--seq-len", "16", "--nll-max-len", "512",
            "--out", str(tmp_path / "d.json"), *extra]


@pytest.mark.slow
def test_cli_zeroshot_offline_gives_seven_accuracies_over_five_items_each(tmp_path, capsys):
    """--zeroshot-data fixtures/zeroshot: the release's seven tasks in its order, each scored by lm-eval on exactly
    its file's five items, acc everywhere and acc_norm where lm-eval reports it; token collapse beside it has a
    value per depth state. --tasks and --zeroshot-limit pick tasks and items."""
    pytest.importorskip("lm_eval")
    dg.main(zeroshot_argv(tmp_path, "--metrics", "zeroshot,collapse", "--zeroshot-data", str(ROOT / "fixtures/zeroshot")))
    out = json.loads((tmp_path / "d.json").read_text())
    tasks = out["zeroshot"]["tasks"]
    assert list(tasks) == ["openbookqa", "winogrande", "arc_challenge", "arc_easy", "hellaswag", "social_iqa", "piqa"]
    for name, got in tasks.items():
        assert got["num_examples"] == 5 and got["num_fewshot"] == 0, name
        assert round(5 * got["acc"], 9) in range(6), name                 # a share of five items
        assert ("acc_norm" in got) == (name not in ("winogrande", "social_iqa")), name
    assert out["zeroshot"]["max_len"] == 512 and out["zeroshot"]["definition"]
    collapse = out["token_collapse"]
    assert collapse["num_windows"] == 2 and out["meta"]["samples"]["collapse"]["num_samples"] == 2
    assert all(len(collapse[k]) == 3 and all(1 - 1e-6 <= v <= 16 for v in collapse[k])
               for k in ("stable_rank", "erank", "l1_l2_ratio"))
    dg.main(zeroshot_argv(tmp_path, "--metrics", "zeroshot", "--zeroshot-data", str(ROOT / "fixtures/zeroshot"),
                          "--tasks", "piqa,arc_easy", "--zeroshot-limit", "2"))
    tasks = json.loads((tmp_path / "d.json").read_text())["zeroshot"]["tasks"]
    assert list(tasks) == ["piqa", "arc_easy"] and [t["num_examples"] for t in tasks.values()] == [2, 2]


def test_zeroshot_without_lm_eval_or_its_data_is_one_line(tmp_path, capsys, monkeypatch):
    """A task file missing from --zeroshot-data, with --skip-missing-tasks: that task is skipped with the reason (said
    on the terminal), the others scored (without the flag: refused, tests/test_reliability.py). A tokenizer with
    more ids than the model's vocab, or lm-eval missing: one line, exit 2."""
    pytest.importorskip("lm_eval")
    data_dir = tmp_path / "z"
    data_dir.mkdir()
    (data_dir / "piqa.jsonl").write_text((ROOT / "fixtures/zeroshot/piqa.jsonl").read_text())
    argv = zeroshot_argv(tmp_path, "--metrics", "zeroshot", "--zeroshot-data", str(data_dir), "--tasks", "piqa,hellaswag",
                         "--skip-missing-tasks")
    dg.main(argv)
    tasks = json.loads((tmp_path / "d.json").read_text())["zeroshot"]["tasks"]
    assert tasks["piqa"]["num_examples"] == 5 and tasks["hellaswag"] == {"skipped": f"no hellaswag.jsonl in {data_dir}"}
    assert f"zeroshot: hellaswag skipped (no hellaswag.jsonl in {data_dir}; --skip-missing-tasks)" in capsys.readouterr().out
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:                                 # a model whose vocab the tokenizer exceeds
        dg.main(argv + ["--vocab", "64"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.endswith("the tokenizer bytes has 257 ids, the model's vocab 64")
    monkeypatch.setitem(sys.modules, "lm_eval", None)                    # as if it were not installed
    with pytest.raises(SystemExit) as e:
        dg.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "pip install lm-eval" in err


@pytest.mark.slow
def test_zeroshot_from_an_unreachable_hub_fails_fast_naming_the_offline_flag():
    pytest.importorskip("lm_eval")
    t0 = time.time()
    r = run_cli("--init", "preln", "--layers", "2", "--width", "32", "--heads", "2", "--tokenizer", "bytes",
                "--metrics", "zeroshot", env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert r.returncode == 2 and "cannot reach the HuggingFace hub" in r.stderr and "--zeroshot-data" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and time.time() - t0 < 30
