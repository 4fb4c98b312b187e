"""
depthbench/files/official.py's tests: the authors' OLMo-core checkpoint layout, loaded into our GPT.

    python -m pytest -q tests/test_official.py

Each test writes a small checkpoint the way the released ones are laid out (a stepN/ folder with an
OLMo-core config.json and a torch DCP of {"model", "optim"} under the official tensor names), from
random weights of one of our models, and checks what loading it gives. CPU, fp32, tiny shapes.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from depthbench.files import official
from model import GPT, GPTConfig
from residuals import RESIDUALS

ROOT = Path(__file__).resolve().parents[1]  # the repository root
WIDE = {"scaling": "depth_width", "base_depth": 2, "base_width": 128}     # both axes away from 1: m_L 1.5, m_N 1/4
CASES = [(r, {}) for r in RESIDUALS if r in official.RELEASED and r != "block_attnres"] + [
    ("block_attnres", {"block_size": 2}), ("block_attnres", {"block_size": 3}),   # S divides 2L = 6
    ("block_attnres", {"block_size": 4}), ("block_attnres", {"block_size": 5}),   # S does not: the last group short
    ("preln_mup", {"base_depth": 2}), ("preln_completep", {"base_depth": 5}), ("preln_mup", WIDE),
    ("preln_completep", WIDE), ("moda", {"norm": "post"}),
    ("mhc", {"sinkhorn_iters": 7}), ("hc", {"collapse": "norm_each", "forward": "unmixed"}),  # the older HC code
    ("hc", {"collapse": "mean"}), ("mhc", {"collapse": "norm_each"}),
    ("lns", {"scale": "depth"}), ("attnres", {"topk_fraction": 0.25}), ("attnres", {"learn_logit_scale": True}),
    ("block_attnres", {"block_size": 2, "topk_fraction": 0.5, "learn_logit_scale": True})]   # the release's variants


def ours(residual, args=None, L=3, V=48, seed=0, n_kv_head=None):
    """One of our models with every tensor random (norm gains and AttnRes queries too, so nothing is 1 or 0)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=V, n_layer=L, d_model=32, n_head=2, d_ff=64, residual=residual,
                          residual_args=args or {}, n_kv_head=n_kv_head or 2))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def official_config(cfg, tokenizer_vocab=40):
    """Our GPTConfig in the official experiment-config schema (official.official_config), with the release's
    tokenizer section (GPT-NeoX-OLMo's fields at a small vocab)."""
    tok = {"vocab_size": tokenizer_vocab, "eos_token_id": tokenizer_vocab - 1, "pad_token_id": 1,
           "identifier": "allenai/gpt-neox-olmo-dolma-v1_5"}
    return official.official_config(cfg, tok, seq_len=16)


readings = official.open_readings   # official.load's `forced` (--residual-args): what config.json cannot tell
OPTIM = {"state": {"0": {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 1e-3}]}   # as the release saves it


def write_checkpoint(step_dir, model, tensors=None, config=None):
    """A step folder: config.json + model_and_optim/ (DCP, single process) with an optimizer entry."""
    tensors = official.to_official(model) if tensors is None else tensors
    return official.write_checkpoint(step_dir, tensors, config or official_config(model.cfg), optim=OPTIM)


def tokens(V=40, B=2, T=10):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("residual, args", CASES, ids=[f"{r}{a or ''}" for r, a in CASES])
def test_every_design_loads_with_the_same_logits(tmp_path, residual, args):
    src = ours(residual, args)
    step = write_checkpoint(tmp_path / "step100", src)
    loaded, info = official.load(str(step), forced=readings(src.cfg))
    assert loaded.cfg.residual == residual and loaded.cfg.residual_args == args and info["step"] == 100
    x = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(x)[0], src(x)[0])
    # the mapping carries information: a fresh model differs, and two same-shaped tensors swapped differ
    with torch.no_grad():
        assert not torch.allclose(ours(residual, args, seed=1)(x)[0], src(x)[0])
    sd = official.to_official(src)
    sd["blocks.1.attention_norm.weight"], sd["blocks.1.feed_forward_norm.weight"] = (
        sd["blocks.1.feed_forward_norm.weight"], sd["blocks.1.attention_norm.weight"])
    swapped, _ = official.load(str(write_checkpoint(tmp_path / "step101", src, sd)), forced=readings(src.cfg))
    with torch.no_grad():
        assert not torch.allclose(swapped(x)[0], src(x)[0])


@pytest.mark.parametrize("residual", ["preln", "moda"])
def test_gqa_checkpoint_loads_with_its_kv_heads(tmp_path, residual):
    """n_kv_heads < n_heads (the 1.6B suite's GQA) builds our model with those kv heads: the same logits."""
    src = ours(residual, n_kv_head=1)
    loaded, _ = official.load(str(write_checkpoint(tmp_path / "step5", src)))
    assert loaded.cfg.n_kv_head == 1
    x = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(x)[0], src(x)[0])


def test_layout_covers_every_tensor_of_every_design_once():
    for residual, args in CASES:
        model = ours(residual, args)
        keys = [(k, row) for k, row, _ in official.layout(model.cfg)]
        offs = [off for _, _, off in official.layout(model.cfg)]
        assert len(set(keys)) == len(keys) and len(set(offs)) == len(offs)
        covered = {k for k, _ in keys}
        assert covered == set(model.state_dict()), residual
        for k in covered:             # a stacked tensor is covered row by row, every row once
            rows = sorted(r for kk, r in keys if kk == k and r is not None)
            assert rows == [] or rows == list(range(model.state_dict()[k].shape[0])), (residual, k)


def test_official_names_for_hc_and_attnres():
    hc = official.to_official(ours("hc"))
    assert hc["blocks.2.feed_forward_hyper_connection.dynamic_alpha_proj"].shape == (32, 5)
    assert hc["blocks.0.attention_hyper_connection.static_beta"].shape == (4,)
    ar = official.to_official(ours("attnres"))
    assert "blocks.0.attn_res_proj.weight" not in ar and ar["blocks.1.attn_res_proj.weight"].shape == (1, 32)
    assert ar["res_proj.weight"].shape == (1, 32) and ar["blocks.0.mlp_res_norm.weight"].shape == (32,)
    assert "blocks.2.feed_forward.kv_proj.weight" not in official.to_official(ours("moda"))


# ----------------------------------------------------------------------------- the release's names, written here

SUBLAYER = [("attn.wq", "w_q"), ("attn.wk", "w_k"), ("attn.wv", "w_v"), ("attn.wo", "w_out"), ("mlp.w1", "w1"),
            ("mlp.w2", "w2"), ("mlp.w3", "w3")]
HC_NAMES = [("static_alpha", "static_alpha"), ("dynamic_alpha", "dynamic_alpha_proj"),
            ("alpha_scale", "dynamic_alpha_scale"), ("static_beta", "static_beta"),
            ("dynamic_beta", "dynamic_beta_proj"), ("beta_scale", "dynamic_beta_scale")]


def release_names(residual, L):
    """{(our state-dict key, row or None): the release's name} for every tensor of our model, written from the
    release's code (docs/official.md#provenance), not from official.layout:
    - model.py: `embeddings`, `lm_head.w_out` and the final norm `lm_head.norm`; AttnRes' final `res_proj`/`res_norm`.
    - block.py: block b is `blocks.{b}`, its `attention` (w_q, w_k, w_v, w_out) and `feed_forward` (w1, w2, w3) with
      `attention_norm`/`feed_forward_norm` (DeepNorm's and Post-LN's post-norms carry these names too); Peri-LN adds
      `post_attention_norm`/`post_feed_forward_norm`, KEEL the same but no `post_attention_norm` in block 0; AttnRes
      `attn_res_proj`/`attn_res_norm` from block 1 and `mlp_res_proj`/`mlp_res_norm` in every block; HC/mHC a
      `{attention, feed_forward}_hyper_connection` per sublayer; MoDA wraps attention and feed-forward one level
      down (`attention.attention`, `feed_forward.feed_forward`) and adds `feed_forward.kv_proj` but in the last block.
    - hyper_connections.py: HC's static_alpha, dynamic_alpha_proj, dynamic_alpha_scale, static_beta,
      dynamic_beta_proj, dynamic_beta_scale; Liger mHC's phi, b, alpha_pre, alpha_post, alpha_res.
    Ours: sublayer i = 2b (attention) or 2b + 1 (MLP); norms[i] its pre-norm (DeepNorm, Post-LN: its post-norm);
    post_norms[i] Sandwich's post-norm, KEEL's is post_norms[i - 1]; conn[i] its connector; AttnRes' row i - 1 of
    queries/key_gains is consumer i's, row 2L - 1 the head's; kv_proj[b] MoDA's W_kv of block b."""
    moda = residual == "moda"
    wrap = {"attn": "attention.attention", "mlp": "feed_forward.feed_forward"} if moda else {
        "attn": "attention", "mlp": "feed_forward"}
    names = {("wte.weight", None): "embeddings.weight", ("lm_head.weight", None): "lm_head.w_out.weight",
             ("res.norm_f.weight", None): "lm_head.norm.weight"}
    for b in range(L):
        blk, att, ffn = f"blocks.{b}.", 2 * b, 2 * b + 1
        for ours, theirs in SUBLAYER:
            names[(f"{blk}{ours}.weight", None)] = f"{blk}{wrap[ours[:ours.index('.')]]}.{theirs}.weight"
        names[(f"res.norms.{att}.weight", None)] = f"{blk}attention_norm.weight"
        names[(f"res.norms.{ffn}.weight", None)] = f"{blk}feed_forward_norm.weight"
        if residual == "sandwich":
            names[(f"res.post_norms.{att}.weight", None)] = f"{blk}post_attention_norm.weight"
            names[(f"res.post_norms.{ffn}.weight", None)] = f"{blk}post_feed_forward_norm.weight"
        if residual == "keel":
            if b > 0:
                names[(f"res.post_norms.{att - 1}.weight", None)] = f"{blk}post_attention_norm.weight"
            names[(f"res.post_norms.{ffn - 1}.weight", None)] = f"{blk}post_feed_forward_norm.weight"
        for i, side in ((att, "attention"), (ffn, "feed_forward")):
            if residual == "hc":
                names.update({(f"res.conn.{i}.{a}", None): f"{blk}{side}_hyper_connection.{o}" for a, o in HC_NAMES})
            if residual == "mhc":
                names.update({(f"res.conn.{i}.{a}", None): f"{blk}{side}_hyper_connection.{a}"
                              for a in ("phi", "b", "alpha_pre", "alpha_post", "alpha_res")})
        if residual in ("attnres", "block_attnres"):
            if b > 0:
                names[("res.queries", att - 1)] = f"{blk}attn_res_proj.weight"
                names[("res.key_gains", att - 1)] = f"{blk}attn_res_norm.weight"
            names[("res.queries", ffn - 1)] = f"{blk}mlp_res_proj.weight"
            names[("res.key_gains", ffn - 1)] = f"{blk}mlp_res_norm.weight"
        if moda and b < L - 1:
            names[(f"res.kv_proj.{b}.weight", None)] = f"{blk}feed_forward.kv_proj.weight"
    if residual in ("attnres", "block_attnres"):
        names[("res.queries", 2 * L - 1)] = "res_proj.weight"
        names[("res.key_gains", 2 * L - 1)] = "res_norm.weight"
    return names


def fill_distinct(model, names):
    """Our tensor (or row) of each entry of names set to its own constant 1, 2, 3, ... -> {official name: value}."""
    sd, value = model.state_dict(), {}
    with torch.no_grad():
        for k, ((key, row), off) in enumerate(sorted(names.items(), key=str)):
            (sd[key] if row is None else sd[key][row]).fill_(k + 1.0)
            value[off] = k + 1.0
    return value


@pytest.mark.parametrize("residual", [r for r in RESIDUALS if r in official.RELEASED])
def test_every_tensor_gets_the_release_name(residual):
    """Each of our tensors, filled with a constant of its own, is the release-named tensor that holds it; and back:
    an official state dict of distinct constants loads each into the tensor (or row) of ours it names. A swap of two
    same-shaped names that official.layout makes consistently (its own round trip hides it) fails here."""
    L = 3
    model, names = ours(residual, L=L), release_names(residual, L)
    covered = {(k, r) for k, r in names}
    stacked = {k for k, r in names if r is not None}
    assert {k for k, _ in covered} == set(model.state_dict()) and len(set(names.values())) == len(names)
    assert all({r for k, r in covered if k == key} == set(range(model.state_dict()[key].shape[0])) for key in stacked)
    value = fill_distinct(model, names)
    got = official.to_official(model)
    assert set(got) == set(names.values())
    assert {off: torch.unique(t).tolist() for off, t in got.items()} == {off: [v] for off, v in value.items()}
    back = GPT(model.cfg)
    official.from_official({off: torch.full_like(t, value[off]) for off, t in got.items()}, back)
    sd = back.state_dict()
    for (key, row), off in names.items():
        assert torch.unique(sd[key] if row is None else sd[key][row]).tolist() == [value[off]], (key, row, off)


def test_release_shapes_of_the_design_tensors():
    """The shapes the release's modules give (n = 4 streams, d = 32, n_kv * head_dim = 32): AttnRes' projections are
    nn.Linear(d, 1) weights, HC's are (d, n + 1) and (d,), Liger mHC's phi (n d, n^2 + 2n), MoDA's kv_proj
    nn.Linear(d, 2 n_kv head_dim)."""
    hc, mhc = official.to_official(ours("hc")), official.to_official(ours("mhc"))
    assert [tuple(hc[f"blocks.1.feed_forward_hyper_connection.{o}"].shape) for _, o in HC_NAMES] == [
        (4, 5), (32, 5), (), (4,), (32,), ()]
    assert [tuple(mhc[f"blocks.0.attention_hyper_connection.{a}"].shape) for a in (
        "phi", "b", "alpha_pre", "alpha_post", "alpha_res")] == [(128, 24), (24,), (), (), ()]
    ar = official.to_official(ours("attnres"))
    assert {tuple(ar[k].shape) for k in ("res_proj.weight", "blocks.1.attn_res_proj.weight",
                                         "blocks.0.mlp_res_proj.weight")} == {(1, 32)}
    assert tuple(official.to_official(ours("moda"))["blocks.0.feed_forward.kv_proj.weight"].shape) == (64, 32)


def test_hf_llama_names_hold_the_tensors_they_name():
    """Pre-LN -> HF Llama (the official converter's table), each tensor a distinct constant: input_layernorm is
    sublayer 2b's norm, post_attention_layernorm sublayer 2b + 1's, q/k/v/o_proj and gate/up/down_proj the
    attention's w_q/w_k/w_v/w_out and the MLP's w1/w3/w2; model.norm the final norm, lm_head the head."""
    L = 2
    model = ours("preln", L=L)
    hf_of = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
             "attn.wo": "self_attn.o_proj", "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj",
             "mlp.w2": "mlp.down_proj"}
    want = {"wte.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
            "res.norm_f.weight": "model.norm.weight"}
    for b in range(L):
        want.update({f"blocks.{b}.{o}.weight": f"model.layers.{b}.{h}.weight" for o, h in hf_of.items()})
        want[f"res.norms.{2 * b}.weight"] = f"model.layers.{b}.input_layernorm.weight"
        want[f"res.norms.{2 * b + 1}.weight"] = f"model.layers.{b}.post_attention_layernorm.weight"
    value = fill_distinct(model, {(k, None): h for k, h in want.items()})
    hf = official.hf_llama(official.to_official(model), L)
    assert {h: torch.unique(t).tolist() for h, t in hf.items()} == {h: [v] for h, v in value.items()}


def test_hc_branch_aliases_are_accepted_only_when_equal(tmp_path):
    src = ours("hc")
    sd = official.to_official(src)
    for b in range(3):   # the connectors' branch modules list the block's norm and sublayer a second time
        sd[f"blocks.{b}.attention_hyper_connection.branch.norm.weight"] = sd[f"blocks.{b}.attention_norm.weight"]
        sd[f"blocks.{b}.feed_forward_hyper_connection.branch.feed_forward.w2.weight"] = (
            sd[f"blocks.{b}.feed_forward.w2.weight"])
    loaded, _ = official.load(str(write_checkpoint(tmp_path / "step1", src, sd)), forced=readings(src.cfg))
    x = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(x)[0], src(x)[0])
    sd["blocks.1.attention_hyper_connection.branch.norm.weight"] = sd["blocks.1.attention_norm.weight"] + 1
    with pytest.raises(official.CheckpointError, match="differs from blocks.1.attention_norm.weight"):
        official.load(str(write_checkpoint(tmp_path / "step2", src, sd)), forced=readings(src.cfg))


def test_lns_ln_scale_buffers_load_when_they_hold_the_rule(tmp_path):
    """A release version saves LNS's 1/sqrt(b + 1) as a buffer per block: such a checkpoint loads to the same
    logits; a buffer with another value (which our LNS would not compute) is refused naming it."""
    src = ours("lns")
    sd = {**official.to_official(src), **{f"blocks.{b}.ln_scale": torch.tensor((b + 1) ** -0.5) for b in range(3)}}
    loaded, _ = official.load(str(write_checkpoint(tmp_path / "step1", src, sd)))
    with torch.no_grad():
        assert torch.equal(loaded(tokens())[0], src(tokens())[0])
    sd["blocks.2.ln_scale"] = torch.tensor(1.0)
    with pytest.raises(official.CheckpointError, match=r"blocks.2.ln_scale = 1, not LNS's 1/sqrt\(b \+ 1\) = 0.57735"):
        official.load(str(write_checkpoint(tmp_path / "step2", src, sd)))


def test_moda_last_block_kv_proj_is_ignored_when_not_skipped(tmp_path):
    src = ours("moda")
    sd = official.to_official(src)
    sd["blocks.2.feed_forward.kv_proj.weight"] = torch.randn(64, 32)   # built, never used (slot 2L - 1)
    loaded, _ = official.load(str(write_checkpoint(tmp_path / "step1", src, sd)))
    with torch.no_grad():
        assert torch.equal(loaded(tokens())[0], src(tokens())[0])


# ----------------------------------------------------------------------------- the release's variants (issue 43)

def test_default_depth_scaled_is_lns_with_one_scale(tmp_path):
    """The release's `default_depth_scaled` block (block.py @b2141085: LNS's subclass whose ln_scale is 1/sqrt(L) in
    every block) loads as LNS with scale "depth", its ln_scale buffers accepted when they hold 1/sqrt(L): the same
    logits, every site's factor 1/sqrt(3); per-block buffers (LNS' own rule) are refused naming one."""
    src = ours("lns", {"scale": "depth"})
    cfg = official_config(src.cfg)
    assert cfg["model"]["block"]["name"] == "default_depth_scaled"
    sd = {**official.to_official(src), **{f"blocks.{b}.ln_scale": torch.tensor(3 ** -0.5) for b in range(3)}}
    loaded, info = official.load(str(write_checkpoint(tmp_path / "step1", src, sd)))
    assert (loaded.cfg.residual, loaded.cfg.residual_args, info["block"]) == ("lns", {"scale": "depth"},
                                                                             "default_depth_scaled")
    assert [float(site.scale) for site in loaded.res.sites] == pytest.approx([3 ** -0.5] * 6)
    with torch.no_grad():
        assert torch.equal(loaded(tokens())[0], src(tokens())[0])
        assert not torch.allclose(ours("lns")(tokens())[0], src(tokens())[0])       # 1/sqrt(b + 1) differs
    sd.update({f"blocks.{b}.ln_scale": torch.tensor((b + 1) ** -0.5) for b in range(3)})
    with pytest.raises(official.CheckpointError, match=r"blocks.0.ln_scale = 1, not LNS's 1/sqrt\(L\) = 0.57735"):
        official.load(str(write_checkpoint(tmp_path / "step2", src, sd)))


@pytest.mark.parametrize("fields, args", [({"attnres_topk_fraction": 0.25}, {"topk_fraction": 0.25}),
                                          ({"attnres_learn_logit_scale": True}, {"learn_logit_scale": True})])
def test_the_release_attnres_variant_configs_load(tmp_path, fields, args):
    """The fields of the release's configs/llama_400m_L24_attnres_topk025.json and ..._attnres_logit_scale.json, set on
    a plain attnres block (block size 1), build Full AttnRes with that option: the same logits as our model with it,
    which differ from the plain model's on the same weights (the variant is not ignored)."""
    src = ours("attnres", args)
    cfg = official_config(ours("attnres").cfg)
    cfg["model"]["block"].update(fields)
    sd = official.to_official(src)
    loaded, _ = official.load(str(write_checkpoint(tmp_path / "step1", src, sd, config=cfg)))
    assert (loaded.cfg.residual, loaded.cfg.residual_args) == ("attnres", args)
    plain = GPT(ours("attnres").cfg).eval()
    plain.load_state_dict({k: v for k, v in src.state_dict().items() if k in plain.state_dict()})
    with torch.no_grad():
        assert torch.equal(loaded(tokens())[0], src(tokens())[0])
        assert not torch.allclose(plain(tokens())[0], src(tokens())[0], atol=1e-3)


def test_logit_scales_get_the_release_names():
    """Written from block.py and model.py @b2141085: a 0-dim `attnres_logit_scale` on block b > 0 (its attention-side
    consumer 2b, our row 2b - 1), `mlp_attnres_logit_scale` on every block (consumer 2b + 1, row 2b), and the model's
    `final_attnres_logit_scale` (the head, row 2L - 1); each distinct value lands back in its own row."""
    L = 3
    model = ours("attnres", {"learn_logit_scale": True}, L=L)
    names = {("res.logit_scales", 2 * L - 1): "final_attnres_logit_scale"}
    for b in range(L):
        names[("res.logit_scales", 2 * b)] = f"blocks.{b}.mlp_attnres_logit_scale"
        if b > 0:
            names[("res.logit_scales", 2 * b - 1)] = f"blocks.{b}.attnres_logit_scale"
    value = fill_distinct(model, names)
    got = official.to_official(model)
    assert {off: (tuple(got[off].shape), got[off].item()) for off in value} == {off: ((), v) for off, v in value.items()}
    back = official.from_official(got, GPT(model.cfg))
    assert back.res.logit_scales.tolist() == [value[names[("res.logit_scales", k)]] for k in range(2 * L)]


@pytest.mark.slow
def test_an_extra_buffer_loads_with_one_line_naming_it(tmp_path):
    """Tensors that are no parameter (a buffer some release version saves, which the official loader ignores when its
    model has none) load with one warning line naming them, and the same logits; a parameter's name stays an error
    (test_missing_or_extra_tensor_is_one_line_naming_it)."""
    src = ours("preln")
    sd = {**official.to_official(src), "blocks.1.attention.rope.inv_freq": torch.arange(8.0), "step_count": torch.tensor(3)}
    write_checkpoint(tmp_path / "step1", src, sd)
    r = run_cli("depthbench.files.official", "info", tmp_path / "step1")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("\n") == 1 and "warning: ignored 2 non-parameter tensor(s)" in r.stderr
    assert "blocks.1.attention.rope.inv_freq" in r.stderr and "step_count" in r.stderr
    loaded, _ = official.load(str(tmp_path / "step1"))
    with torch.no_grad():
        assert torch.equal(loaded(tokens())[0], src(tokens())[0])


def run_cli(script, *args, env=None):
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    command = [str(ROOT / script)] if script.endswith(".py") else ["-m", script]   # a package module: python -m
    return subprocess.run([sys.executable, *command, *map(str, args)], capture_output=True, text=True,
                          env=e, cwd=ROOT, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    (lambda sd: sd.pop("blocks.1.feed_forward.w3.weight"), "missing blocks.1.feed_forward.w3.weight"),
    (lambda sd: sd.update({"blocks.0.attention.w_q.bias": torch.zeros(32)}), "unexpected blocks.0.attention.w_q.bias"),
    (lambda sd: sd.pop("res_proj.weight"), "missing res_proj.weight"),
])
def test_missing_or_extra_tensor_is_one_line_naming_it(tmp_path, change, message):
    src = ours("attnres")
    sd = official.to_official(src)
    change(sd)
    write_checkpoint(tmp_path / "repo" / "step7", src, sd)
    r = run_cli("depthbench.files.official", "info", tmp_path / "repo")
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_wrong_shape_is_one_line(tmp_path):
    src = ours("preln")
    sd = official.to_official(src)
    sd["embeddings.weight"] = torch.zeros(50, 32)
    with pytest.raises(official.CheckpointError, match=r"embeddings.weight: shape \(50, 32\)"):
        official.load(str(write_checkpoint(tmp_path / "step1", src, sd)))


def set_key(path, value):
    def change(cfg):
        d = cfg
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return change


A = ("model", "block", "sequence_mixer")
REFUSALS = [
    ("preln", set_key(A + ("n_kv_heads",), 3), "n_kv_heads 3 does not divide"),
    ("preln", set_key(A + ("qk_norm",), {"name": "rms"}), "qk_norm"),
    ("preln", set_key(A + ("name",), "fused"), "name = 'fused'"),
    ("preln", set_key(A + ("rope",), {"name": "complex", "theta": 10000}), "RoPE"),
    ("preln", set_key(("model", "block", "name"), "normalized"), "block type 'normalized'"),
    ("preln", set_key(("model", "block", "layer_norm", "name"), "default"), "block norm"),
    ("preln", set_key(("model", "lm_head", "layer_norm", "eps"), 1e-5), "final norm eps"),
    ("mhc", set_key(("model", "block", "hyper_connections", "kind"), "mhc"), "mHC kind 'mhc'"),
    ("mhc", set_key(("model", "block", "hyper_connections", "collapse"), "max"), "collapse 'max'"),
    ("hc", set_key(("model", "block", "hyper_connections", "tanh"), False), "HC kind/tanh"),
    ("attnres", set_key(("model", "block", "attnres_block_size"), -1), "AttnRes block size -1"),
    ("preln_mup", set_key(("model", "block", "residual_scaling_alpha"), 1.0), "depth_mup residual_scaling_alpha"),
    ("moda", set_key(("model", "block", "moda", "extra_ffn_kv_proj"), False), "MoDA K/V"),
    ("preln", set_key(("dataset", "tokenizer", "vocab_size"), 60), "tokenizer vocab 60"),
]


@pytest.mark.parametrize("residual, change, message", REFUSALS, ids=[m for _, _, m in REFUSALS])
def test_unsupported_settings_are_refused_in_one_line(tmp_path, residual, change, message):
    src = ours(residual)
    cfg = official_config(src.cfg)
    change(cfg)
    write_checkpoint(tmp_path / "step1", src, config=cfg)
    with pytest.raises(official.CheckpointError) as e:
        official.load(str(tmp_path / "step1"))
    assert message in str(e.value) and "\n" not in str(e.value)


def rename(name, drop=()):
    """A config change: the block type renamed (None: no name at all), keys `drop` removed from the block."""
    def change(cfg):
        blk = cfg["model"]["block"]
        if name:
            blk["name"] = name
        else:
            del blk["name"]
        for key in drop:
            blk.pop(key)
    return change


B, HCK = ("model", "block"), ("model", "block", "hyper_connections")
SPELLINGS = [  # older config.json spellings (renamed as the official loaders do) and what they build
    ("attnres", {}, rename("default")), ("attnres", {}, rename(None)),      # attnres_block_size with either name
    ("attnres", {}, rename("attn_res", drop=["attnres_block_size"])), ("block_attnres", {"block_size": 2}, rename(None)),
    ("hc", {}, rename("default")), ("mhc", {}, rename("default")),         # default + a hyper_connections section
]


@pytest.mark.parametrize("residual, args, change", SPELLINGS, ids=[f"{r}{k}" for k, (r, _, _) in enumerate(SPELLINGS)])
def test_older_spellings_load_as_the_official_loaders_read_them(tmp_path, residual, args, change):
    src = ours(residual, args)
    cfg = official_config(src.cfg)
    change(cfg)
    loaded, _ = official.load(str(write_checkpoint(tmp_path / "step1", src, config=cfg)), forced=readings(src.cfg))
    assert (loaded.cfg.residual, loaded.cfg.residual_args) == (residual, args)
    with torch.no_grad():
        assert torch.equal(loaded(tokens())[0], src(tokens())[0])


def test_an_hc_checkpoint_loads_with_the_readings_the_user_names(tmp_path):
    """config.json cannot tell the older HC code (norm each stream, then sum; un-mixed forward) from the newer:
    each reading of the same files gives its own model's logits, and --residual-args names only those two."""
    old = ours("hc", {"collapse": "norm_each", "forward": "unmixed"})
    step, x = write_checkpoint(tmp_path / "step1", old), tokens()
    as_old, _ = official.load(str(step), forced={"collapse": "norm_each", "forward": "unmixed"})
    as_new, _ = official.load(str(step), forced={"collapse": "sum", "forward": "mixed"})
    with torch.no_grad():
        assert torch.equal(as_old(x)[0], old(x)[0]) and not torch.allclose(as_new(x)[0], old(x)[0])
    with pytest.raises(official.CheckpointError, match='choose with --residual-args .*"forward": "mixed" or "unmixed"'):
        official.load(str(step), forced={"collapse": "sum"})
    with pytest.raises(official.CheckpointError, match=r"--residual-args \['n_streams'\]: config.json says it"):
        official.load(str(step), forced={"collapse": "sum", "forward": "mixed", "n_streams": 4})


CANNOT = [  # what we would compute differently, or cannot know, in the CLI's one line and exit code 2
    ("attnres", set_key(B + ("attnres_topk_fraction",), 1.5), "attnres_topk_fraction = 1.5"),
    ("attnres", set_key(B + ("attnres_use_bias",), True), "attnres_use_bias = True"),
    ("preln", set_key(B + ("attnres_learn_logit_scale",), True), "attnres_learn_logit_scale on a default block"),
    ("hc", lambda cfg: None, '\'{"collapse": "sum" or "norm_each", "forward": "mixed" or "unmixed"}\''),
    ("mhc", set_key(HCK + ("collapse",), "sum"), '\'{"collapse": "sum" or "norm_each"}\''),
]


@pytest.mark.parametrize("residual, change, message", CANNOT, ids=[f"{r}{k}" for k, (r, _, _) in enumerate(CANNOT)])
def test_what_we_cannot_reproduce_exactly_is_one_line_and_exit_2(tmp_path, capsys, residual, change, message):
    src = ours(residual)
    cfg = official_config(src.cfg)
    change(cfg)
    write_checkpoint(tmp_path / "step1", src, config=cfg)
    with pytest.raises(SystemExit) as e:
        official.main(["info", str(tmp_path / "step1")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_settings_that_differ_from_our_defaults_build_the_matching_model():
    L = 4
    for size, want in [(1, ("attnres", {})), (2, ("block_attnres", {"block_size": 2})),
                       (3, ("block_attnres", {"block_size": 3})), (8, ("block_attnres", {"block_size": 8}))]:
        cfg = official_config(ours("attnres", L=L).cfg)
        cfg["model"]["block"]["attnres_block_size"] = size
        got, _ = official_read(cfg)
        assert (got.residual, got.residual_args) == want
    cfg = official_config(ours("preln", V=50304).cfg, tokenizer_vocab=50280)   # a padded vocab stays padded
    got, notes = official_read(cfg)
    assert got.vocab_size == 50304 and notes["tokenizer_vocab"] == 50280 and notes["eos_token_id"] == 50279


def official_read(cfg, folder=[0]):
    import tempfile
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(cfg))
    return official.read_config(d)


def test_repository_folder_picks_the_step(tmp_path):
    a, b = ours("preln", seed=0), ours("preln", seed=1)
    write_checkpoint(tmp_path / "step0", a)
    write_checkpoint(tmp_path / "step30", b)
    x = tokens()
    with torch.no_grad():
        assert torch.equal(official.load(str(tmp_path))[0](x)[0], b(x)[0])       # default: the highest step
        assert torch.equal(official.load(str(tmp_path), 0)[0](x)[0], a(x)[0])
    with pytest.raises(official.CheckpointError, match="no step5 .steps: 0, 30"):
        official.load(str(tmp_path), 5)


@pytest.mark.slow
def test_offline_hub_id_is_one_line_and_fast():
    t0 = time.time()
    r = run_cli("depthbench.files.official", "info", "aspect-ratio-scaling/preln-lr2e-3-llama-400M-L24-pretrain",
                env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert r.returncode == 2 and "cannot be reached" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert time.time() - t0 < 60


def test_preln_hf_llama_names_round_trip():
    src = ours("preln")
    off = official.to_official(src)
    hf = official.hf_llama(off, 3)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.2.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.1.post_attention_layernorm.weight"} <= set(hf)
    assert torch.equal(hf["model.layers.1.input_layernorm.weight"], src.res.norms[2].weight.detach())
    assert torch.equal(hf["model.layers.1.post_attention_layernorm.weight"], src.res.norms[3].weight.detach())
    back = official.hf_llama(hf, 3, reverse=True)
    assert set(back) == set(off) and all(torch.equal(back[k], off[k]) for k in off)
    model = official.from_official(back, GPT(src.cfg)).eval()
    with torch.no_grad():
        assert torch.equal(model(tokens())[0], src(tokens())[0])
    with pytest.raises(official.CheckpointError):
        official.hf_llama(official.to_official(ours("sandwich")), 3)


def test_preln_equals_hf_llama_when_transformers_is_installed():
    transformers = pytest.importorskip("transformers")
    src = ours("preln")
    c = src.cfg
    hf_cfg = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
                                      num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                                      num_key_value_heads=c.n_head, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
                                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict(official.hf_llama(official.to_official(src), c.n_layer), strict=False)
    with torch.no_grad():
        assert torch.allclose(hf(tokens()).logits, src(tokens())[0], atol=1e-5)


def make_tokenizer(folder):
    """A tiny BPE tokenizer.json with <|endoftext|>, trained on a few sentences (vocab <= 40)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=40, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz ."))
    tok.train_from_iterator(["the cat sat on the mat.", "a dog ate the hat."] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_json_tokenizer_adds_nothing_but_eos_per_document(tmp_path):
    import data
    path = make_tokenizer(tmp_path)
    tok = data.get_tokenizer(str(path))
    assert tok.eot == tok.tok.token_to_id("<|endoftext|>") and tok.vocab_size <= 40
    ids = tok.encode_batch(["the cat sat."])[0]
    assert tok.decode(ids) == "the cat sat." and tok.eot not in ids
    docs = list(data.tokenize_documents(["the cat.", "a dog."], tok))
    assert [d[-1] for d in docs] == [tok.eot, tok.eot] and docs[0][:-1] == tok.encode_batch(["the cat."])[0]
    with pytest.raises(data.DataError, match="choose gpt2, bytes or the path"):
        data.get_tokenizer(str(tmp_path / "nothing.json"))


@pytest.mark.slow
def test_evaluate_is_the_models_own_loss_on_the_windows(tmp_path):
    src = ours("preln", V=40)
    cfg = official_config(src.cfg)
    write_checkpoint(tmp_path / "repo" / "step9", src, config=cfg)
    path = make_tokenizer(tmp_path / "repo" / "tokenizer")
    (tmp_path / "val.txt").write_text("the cat sat on the mat. a dog ate the hat. " * 8)
    r = run_cli("depthbench.files.official", "evaluate", tmp_path / "repo", "--text", tmp_path / "val.txt", "--seq-len", 16,
                "--device", "cpu")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    import data
    tok = data.get_tokenizer(str(path), 39)          # the config's eos_token_id
    ids = next(data.tokenize_documents([(tmp_path / "val.txt").read_text()], tok))
    n = (len(ids) - 1) // 16
    w = torch.tensor(ids[:16 * n + 1])
    with torch.no_grad():
        _, loss = src(w[:-1].view(n, 16), w[1:].view(n, 16))
    assert got["windows"] == n and got["tokens"] == 16 * n and got["step"] == 9
    assert got["val_loss"] == pytest.approx(loss.item(), rel=1e-5)


RELEASE = [("preln", {}, "root"), ("postln", {}, "steps"), ("postln", {}, "root"), ("preln_mup", WIDE, "steps"),
           ("preln_completep", {"base_depth": 2}, "root"), ("block_attnres", {"block_size": 4}, "steps"),
           ("block_attnres", {"block_size": 5}, "root")]


@pytest.mark.parametrize("residual, args, where", RELEASE, ids=[f"{r}{a or ''}-{w}" for r, a, w in RELEASE])
def test_release_layouts_and_blocks_load_and_evaluate(tmp_path, residual, args, where):
    """Both hub layouts (stepN/ folders; one checkpoint at the repository root) and the release's extra blocks
    (post_norm, depth_mup, completep; AttnRes with a block size that does not divide 2L): the loaded model gives
    our model's logits, and `evaluate` gives its own loss on the windows."""
    src = ours(residual, args, V=40)
    repo = tmp_path / "repo"
    write_checkpoint(repo / "step7" if where == "steps" else repo, src)
    path = make_tokenizer(repo / "tokenizer")
    loaded, info = official.load(str(repo))
    assert (loaded.cfg.residual, loaded.cfg.residual_args) == (residual, args)
    assert info["tokenizer"] == str(path) and info["step"] == (7 if where == "steps" else None)
    x = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(x)[0], src(x)[0])
    (tmp_path / "val.txt").write_text("the cat sat on the mat. a dog ate the hat. " * 4)
    import data
    tok = data.get_tokenizer(str(path), 39)
    got = official.evaluate(loaded, tok, str(tmp_path / "val.txt"), seq_len=8)
    ids = next(data.tokenize_documents([(tmp_path / "val.txt").read_text()], tok))
    n = (len(ids) - 1) // 8
    w = torch.tensor(ids[:8 * n + 1])
    with torch.no_grad():
        _, loss = src(w[:-1].view(n, 8), w[1:].view(n, 8))
    assert got["windows"] == n and got["val_loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_hub_layout_reads_step_folders_or_the_root():
    steps = ["step10/config.json", "step10/model_and_optim/.metadata", "step30/config.json", "tokenizer/tokenizer.json"]
    root = ["config.json", "model_and_optim/.metadata", "model_and_optim/__0_0.distcp", "tokenizer/tokenizer.json"]
    assert official.hub_layout(steps, None, "a/b") == (["step30/*", "tokenizer/*"], "step30")
    assert official.hub_layout(steps, 10, "a/b") == (["step10/*", "tokenizer/*"], "step10")
    assert official.hub_layout(root, None, "a/b") == (["config.json", "model_and_optim/*", "tokenizer/*"], "")
    with pytest.raises(official.CheckpointError, match="at the repository root, no step5 folder"):
        official.hub_layout(root, 5, "a/b")
    with pytest.raises(official.CheckpointError, match="no stepN folders"):
        official.hub_layout(["README.md"], None, "a/b")


def test_a_root_layout_hub_repo_downloads_and_loads(tmp_path, monkeypatch):
    """download() with the hub's answers stubbed: a repository with the checkpoint at its root loads from there."""
    import huggingface_hub
    src = ours("postln")
    write_checkpoint(tmp_path / "snap", src)
    asked = []

    class Api:
        def list_repo_files(self, repo_id):
            return ["config.json", "model_and_optim/.metadata", "README.md"]

    def snapshot(repo_id, allow_patterns):
        asked.append(allow_patterns)
        return str(tmp_path / "snap")
    monkeypatch.setattr(official, "hub_unreachable", lambda timeout=5.0: None)
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    loaded, info = official.load("owner/postln-root")
    assert asked == [["config.json", "model_and_optim/*", "tokenizer/*"]] and info["step_dir"] == str(tmp_path / "snap")
    with torch.no_grad():
        assert torch.equal(loaded(tokens())[0], src(tokens())[0])


@pytest.mark.slow
def test_diagnose_runs_on_an_official_checkpoint_with_its_tokenizer(tmp_path):
    src = ours("hc", V=40)
    write_checkpoint(tmp_path / "repo" / "step3", src)
    make_tokenizer(tmp_path / "repo" / "tokenizer")
    (tmp_path / "val.txt").write_text("the cat sat on the mat. a dog ate the hat. " * 8)
    r = run_cli("diagnose.py", tmp_path / "repo", "--step", 3, "--metrics", "angular", "--calib", tmp_path / "val.txt",
                "--num-samples", 2, "--seq-len", 12, "--out", tmp_path / "d.json",
                "--residual-args", json.dumps(readings(src.cfg)))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "d.json").read_text())
    assert out["meta"]["residual"] == "hc" and out["meta"]["step"] == 3 and out["meta"]["n_layer"] == 3
    assert "tokenizer.json" in out["meta"]["samples"]["angular"]["calibration"]
    r = run_cli("diagnose.py", tmp_path / "repo", "--step", 4, "--metrics", "angular")
    assert r.returncode == 2 and "no step4" in r.stderr and len(r.stderr.strip().splitlines()) == 1
