"""
depthbench's tests: properties that could be false, parametrised over the residual registry.

    python -m pytest -q test_all.py

CPU only, fp32, tiny shapes; the whole suite runs in a few minutes on 2 cores.
"""
import math
import subprocess
import sys
from unittest import mock

import pytest
import torch

from depthbench.kernels import cpu as kernels
from depthbench.evaluation import observe
import shapes
from model import GPT, GPTConfig
import ops
from ops import rope_cos_sin
from residuals import RESIDUALS

PY = sys.executable
ALL = list(RESIDUALS)


def tiny(residual="preln", **kw):
    """A tiny config: 3 blocks (so block 0, a middle block and the last block all exist)."""
    args = dict(vocab_size=64, n_layer=3, d_model=64, n_head=4, d_ff=176, residual=residual)
    args.update(kw)
    return GPTConfig(**args)


def build(residual="preln", seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(tiny(residual, **kw))


def batch(B=2, T=16, V=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g)


def perturb(model, scale, seed):
    """Move every parameter off its init by scale * N(0, 1) from its own generator, in parameter order, so that
    zero-initialised mixing weights (AttnRes' queries, HC's dynamic maps) do not hide a difference."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def kernels_of(fast):
    """The fast namespace (depthbench/kernels/cpu.py) or ops.py's (the reference)."""
    return ops.namespace("fast" if fast else "reference")


def recorded(model, x, skip=None):
    """The observed forward (depthbench/evaluation/observe.py) as {"states", "readouts", and the design's internals}."""
    rec = observe.record(model, x, skip=skip)
    return {"states": rec.states, "readouts": rec.readouts, **rec.internals}


def run(*args, **kw):
    return subprocess.run([PY, *args], capture_output=True, text=True, **kw)


# ----------------------------------------------------------------------------- every design

@pytest.mark.parametrize("residual", ALL)
def test_loss_at_init_near_uniform(residual):
    """At init the logits are small, so the loss is finite and within 0.3 nats of ln(V)."""
    x = batch()
    _, loss = build(residual)(x, x)
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(64)) < 0.3


@pytest.mark.parametrize("residual", ALL)
def test_every_parameter_gets_a_finite_gradient(residual):
    """One backward reaches every parameter (an unused one would break DDP) with finite values."""
    model = build(residual)
    x = batch()
    model(x, x)[1].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"


@pytest.mark.parametrize("n_kv_head", [None, 2])
@pytest.mark.parametrize("residual", ALL)
def test_causality(residual, n_kv_head):
    """Changing token t leaves the logits at positions < t unchanged (and does change position t),
    with multi-head and with grouped-query attention."""
    model = build(residual, n_kv_head=n_kv_head)
    x = batch(B=1, T=12)
    t = 7
    x2 = x.clone()
    x2[0, t] = (x[0, t] + 1) % 64
    with torch.no_grad():
        a, b = model(x)[0], model(x2)[0]
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t] - b[:, t]).abs().max() > 1e-6


@pytest.mark.parametrize("residual", ALL)
def test_same_seed_same_loss(residual):
    """Same seed and data -> bit-identical loss, before and after one AdamW step."""
    losses = []
    for _ in range(2):
        model = build(residual, seed=3)
        opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3)
        x = batch()
        loss0 = model(x, x)[1]
        loss0.backward()
        opt.step()
        losses.append((loss0.item(), model(x, x)[1].item()))
    assert losses[0] == losses[1]


@pytest.mark.parametrize("residual", ALL)
def test_param_groups_partition_the_parameters(residual):
    """AdamW groups hold every parameter exactly once; only design-declared ones skip decay."""
    model = build(residual)
    groups = model.param_groups(0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    static = {id(p) for p in model.res.no_decay_params()}
    for g in groups:
        assert all((id(p) in static) == (g["weight_decay"] == 0.0) for p in g["params"])


@pytest.mark.parametrize("residual", ALL)
def test_meta_count_equals_built_model(residual):
    """shapes.py's meta-device count equals sum(numel) of a real model, for every design."""
    cfg = tiny(residual)
    model = build(residual)
    assert shapes.count_params(cfg.n_layer, cfg.d_model, cfg.d_ff, residual, vocab=cfg.vocab_size,
                               n_head=cfg.n_head) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("residual", ALL)
def test_recording_forward_returns_depth_states(residual):
    """The observed forward (evaluation/observe.py) returns L+1 depth states and the plain forward's logits."""
    model = build(residual)
    x = batch()
    with torch.no_grad():
        logits, _ = model(x)
        rec = observe.record(model, x)
        logits_r = rec.logits
    torch.testing.assert_close(logits, logits_r, rtol=0, atol=0)
    assert len(rec.states) == model.cfg.n_layer + 1


@pytest.mark.parametrize("residual", ALL)
def test_the_last_readout_is_what_the_head_reads(residual):
    """With and without a skipped block (the last one, a middle one): the observed pass's logits are the LM head on
    its last readout (the lens' state 2L). The gains are perturbed, so a readout that drops one shows."""
    model = build(residual)
    perturb(model, 0.05, seed=3)
    x = batch()
    L = model.cfg.n_layer
    with torch.no_grad():
        for skip in (None, 1, L - 1):
            rec = observe.record(model, x, skip=skip)
            torch.testing.assert_close(model.lm_head(rec.readouts[-1]), rec.logits, rtol=1e-5, atol=1e-5,
                                       msg=f"skip {skip}")
            assert len(rec.readouts) == L + 1


# two shapes: MHA with 16-wide heads, and GQA with 8-wide heads (CPU attention pads those in the fast path)
KERNEL_SHAPES = {"mha": dict(d_model=64, n_head=4, d_ff=176), "gqa": dict(d_model=32, n_head=4, n_kv_head=2, d_ff=96)}


def cosine(a, b):
    """The cosine of two tensors as flat fp64 vectors."""
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def loss_and_grads(model, x, bf16=False):
    """One training step of model on x (its own targets), under bf16 autocast where bf16 -> (the loss, fp32 and
    detached; every parameter's gradient by name)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(x, x)[1]
    loss.backward()
    return loss.detach().float(), {n: p.grad for n, p in model.named_parameters()}


def assert_step_equal(got, want):
    """A body's (loss, gradients) is the reference's in fp32: the loss to 1e-6, the same parameters, each gradient
    (a real one on the reference path) to 1e-4 relative and 1e-5 of its largest entry."""
    (l1, g1), (l2, g2) = got, want
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6)
    assert g1.keys() == g2.keys()
    for n, g in g2.items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(g1[n], g, rtol=1e-4, atol=1e-5 * g.abs().max().item(), msg=n)


def assert_step_equal_to_bf16(got, want):
    """A body's (loss, gradients) under bf16 autocast is the reference's to bf16's rounding: the loss to 2e-2, every
    gradient in the parameters' dtype (fp32) and within 10% of the reference's norm (+1e-3)."""
    (l1, g1), (l2, g2) = got, want
    torch.testing.assert_close(l1, l2, rtol=2e-2, atol=2e-2)
    assert g1.keys() == g2.keys()
    for n, g in g2.items():
        assert g1[n].dtype == g.dtype == torch.float32, n
        assert (g1[n] - g).norm() <= 0.1 * g.norm() + 1e-3, n


def assert_kernels_agree(residual, shape, options=None):
    """GPTConfig(kernels="fast") computes what kernels="reference" (ops.py's plain PyTorch) computes, in fp32:
    logits, the loss (also the training path, logits=False), every parameter's gradient, and the recording
    forward diagnose.py uses (depth states, lens readouts, the design's internals), with and without a
    skipped block. The parameters are perturbed away from their init, so that zero-initialised mixing
    weights (AttnRes' queries, HC's dynamic maps) do not hide a difference."""
    x = batch()
    out = {}
    for kernels in ("fast", "reference"):
        model = build(residual, kernels=kernels, residual_args=options or {}, **KERNEL_SHAPES[shape])
        perturb(model, 0.05, seed=7)
        logits, loss = model(x, x)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        with torch.no_grad():
            recs = [recorded(model, x, skip) for skip in (None, 1)]
            train_loss = model(x, x, logits=False)[1]
        out[kernels] = logits, loss, train_loss, grads, recs
    (l1, s1, t1, g1, r1), (l2, s2, t2, g2, r2) = out["fast"], out["reference"]
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(t1, s2, rtol=1e-6, atol=1e-6)
    top = max(g.abs().max().item() for g in g2.values())
    for name, g in g2.items():
        assert g.abs().max() > 0, name                       # a real gradient on the reference path
        # atol: a gradient that is ~0 agrees to rounding, not in ratio: a saturated gate of mHC's gap-8 start, or
        # HC's first branch weights, whose identical streams meet a scale-free pre-norm (0 but for its eps)
        torch.testing.assert_close(g1[name], g, rtol=1e-4, atol=max(1e-5 * g.abs().max().item(), 1e-6 * top), msg=name)
    for a, b in zip(r1, r2):
        assert a.keys() == b.keys()
        for key in b:
            assert len(a[key]) == len(b[key]), key
            for u, v in zip(a[key], b[key]):
                torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("residual,options", [(r, None) for r in ALL] + [
    ("mhc", {"init": "uniform"}), ("moda", {"norm": "post"}), ("block_attnres", {"n_groups": 4}),
    ("hc", {"collapse": "norm_each", "forward": "unmixed"}), ("block_attnres", {"block_size": 4}),
    ("preln_mup", {"scaling": "depth_width", "base_width": 256}),
    ("attnres", {"topk_fraction": 0.5, "learn_logit_scale": True}),
    ("block_attnres", {"grouping": "doubling", "topk_fraction": 0.3}), ("block_attnres", {"topk_fraction": 0.6}),
    ("hybrid", {"deep": "mudd", "split": 0.5}), ("hybrid", {"deep": "hc"}), ("resformer", {"learn": False})])
def test_fast_kernels_equal_the_reference(residual, options, shape):
    """Every registered design (tests/test_extend.py adds one more) and the other readings of several, whose paths
    differ (mHC's transport away from the identity, MoDA post-norm, groups of several sublayers, the older
    official HC, the release's AttnRes top-k and logit scale, groups that grow with depth, a hybrid's other deep
    designs): depthbench/kernels/cpu.py's bodies == ops.py's (assert_kernels_agree)."""
    assert_kernels_agree(residual, shape, options)


@pytest.mark.parametrize("residual", ALL)
def test_fast_kernels_equal_the_reference_under_bf16_autocast(residual):
    """The GPU's precision (bf16 autocast, fp32 banks and depth maths) run on the CPU: the fast bodies take bf16
    inputs and hand back gradients of their inputs' dtypes (autograd refuses any other), and their loss and gradients
    are the reference's to bf16's rounding."""
    x = batch(T=8)
    out = {}
    for kernels in ("fast", "reference"):
        torch.manual_seed(0)
        model = GPT(tiny(residual, kernels=kernels, n_kv_head=2))
        perturb(model, 0.02, seed=7)
        out[kernels] = loss_and_grads(model, x, bf16=True)
    assert_step_equal_to_bf16(out["fast"], out["reference"])


@pytest.mark.parametrize("G", [1, 2])
def test_cuda_bodies_of_the_depth_contractions_equal_the_cpus(G):
    """cpu.py's batched-matmul bodies (what CUDA runs) compute the CPU's loops, on the CPU: MoDA's slot dots, slot
    sums and slot gradients (one query head per kv head, and GQA groups of 2; the CPU's slots tokens-last), and
    AttnRes' source dots (one body) equal a broadcast, on shapes where a transposed or swapped axis shows."""
    from depthbench.kernels import cpu as kernels
    g = torch.Generator().manual_seed(5)
    n, B, Hkv, T, c = 3, 2, 2, 5, 4
    x, S = torch.randn(B, Hkv, G, T, c, generator=g), torch.randn(n, B, Hkv, T, c, generator=g)
    w = torch.randn(n, B, Hkv, G, T, generator=g)
    St, xt = (t.transpose(-1, -2).contiguous() for t in (S, x))                  # the CPU's tokens-last layout
    torch.testing.assert_close(kernels.slot_dots_batched(x, S), kernels.slot_dots(xt, St))
    torch.testing.assert_close(kernels.slot_sum_batched(w, S), kernels.slot_sum(w, St))
    dS = torch.randn(n, B, Hkv, T, c, generator=g)
    dSt = dS.transpose(-1, -2).contiguous()
    kernels.add_outer_batched(dS, w, x)
    kernels.add_outer(dSt, w, xt)
    torch.testing.assert_close(dSt, dS.transpose(-1, -2))
    V, y = torch.randn(n, B, T, 6, generator=g), torch.randn(B, T, 6, generator=g)
    torch.testing.assert_close(kernels.source_dots(V, y), (V * y).sum(-1))                  # one body for both
    assert kernels.slot_dots(xt, St).shape == (n, B, Hkv, G, T) and kernels.source_dots(V, y).shape == (n, B, T)


def test_a_bank_forked_by_a_second_continuation_keeps_both():
    """Without gradients (a diagnostic trying two continuations of one pass), a state that pushes after another state
    of its bank pushed past it forks the bank: its mix reads its own history, [e, a, c], with every source's 1/rms,
    and the other state still reads [e, a, b]; both equal ops.py's list."""
    from depthbench.kernels import cpu as kernels
    g = torch.Generator().manual_seed(9)
    e, a, b, c = (3.0 * torch.randn(2, 3, 8, generator=g) for _ in range(4))
    query, gain = torch.randn(8, generator=g), 1.0 + torch.rand(8, generator=g)
    with torch.no_grad():
        s1 = kernels.DepthBank.start(e, n_max=4).push(a)
        s2 = s1.push(b)
        s3 = s1.push(c)
        for state, sources in ((s3, [e, a, c]), (s2, [e, a, b])):
            mix, p, _ = state.mix(query, gain, 1e-5)
            want, p_want, _ = ops.DepthBank(sources).mix(query, gain, 1e-5)
            torch.testing.assert_close(mix, want)
            torch.testing.assert_close(p, p_want)
        assert s3.bank is not s2.bank and s3.push(b).bank is s3.bank     # forked once, then its own history


def test_moda_depth_slots_forked_by_a_second_continuation_keep_both():
    """MoDA's bank forks as AttnRes' does (a bank without key norms): a state that pushes after another state of its
    bank pushed past it reads its own slots, and the other its own; both equal ops.py's lists. A bank refuses a slot
    past the n_max it was made for."""
    from depthbench.kernels import cpu as kernels
    g = torch.Generator().manual_seed(10)
    B, H, T, hd = 2, 2, 5, 4
    q = torch.randn(B, H, T, hd, generator=g)
    a, b, c = ((torch.randn(B, H, T, hd, generator=g), torch.randn(B, H, T, hd, generator=g)) for _ in range(3))
    seq = torch.zeros(B, H, T, hd)                                        # sequence half: zero keys and values
    with torch.no_grad():
        s1 = kernels.DepthKV.start(n_max=2).push(*a)
        s2 = s1.push(*b)
        s3 = s1.push(*c)
        for state, slots in ((s3, [a, c]), (s2, [a, b])):
            want = ops.DepthKV([k for k, _ in slots], [v for _, v in slots])
            o, share = kernels.joint_attention(q, seq, seq, state)
            o_want, share_want = ops.joint_attention(q, seq, seq, want)
            torch.testing.assert_close(o, o_want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(share, share_want, rtol=1e-5, atol=1e-6)
        assert s3.bank is not s2.bank
        with pytest.raises(ValueError, match="cannot take slot 2"):
            s3.push(*b)


@pytest.mark.parametrize("deep", ["attnres", "block_attnres", "hc", "mudd", "moda"])
@pytest.mark.parametrize("b", [0, 1, 2])
def test_a_skipped_pre_ln_block_of_a_hybrid_is_that_block_writing_zero(deep, b):
    """A hybrid's Pre-LN blocks (L6, split 0.5: blocks 0-2, block 2 hands over to the deep design): the diagnostics'
    pass with block b skipped gives the logits of the plain model whose block b writes nothing (W_o = W_2 = 0),
    the hand-over block included (its skip hands the unchanged stream over). Up to 1e-4 apart there for AttnRes: its
    next-output rule normalises the handed-over stream with AttnRes' eps 1e-5, the first deep consumer's own read with
    the backbone's 1e-6."""
    from depthbench.evaluation import observe
    torch.manual_seed(0)
    cfg = tiny("hybrid", n_layer=6, residual_args={"deep": deep, "split": 0.5})
    model = GPT(cfg).eval()
    perturb(model, 0.05, seed=4)
    x = batch(T=8)
    with torch.no_grad():
        skipped = observe.record(model, x, skip=b).logits
        model.blocks[b].attn.wo.weight.zero_()
        model.blocks[b].mlp.w2.weight.zero_()
        zeroed = model(x)[0]
    torch.testing.assert_close(skipped, zeroed, rtol=0, atol=3e-4)


@pytest.mark.parametrize("hd", [8, 16])
def test_moda_merge_by_log_sum_exp_equals_the_sink(hd):
    """kernels.joint_attention on the CPU in fp32 (heads 8 wide, padded to 16, and 16 wide) merges the halves by the
    fused kernel's log-sum-exp (`MergeDepth`); the sink body on the same values gives the same output, share and
    gradients of q, k, v and of every depth key and value (a wrong gradient through either log-sum-exp would show in
    all of them)."""
    from depthbench.kernels import cpu as kernels
    g = torch.Generator().manual_seed(8)
    B, H, T, S = 2, 4, 7, 3
    leaves = [2.0 * torch.randn(B, H, T, hd, generator=g) for _ in range(3 + 2 * S)]
    weights = torch.randn(B, H, T, hd, generator=g)
    out = {}
    for name in ("merge", "sink"):
        ts = [t.clone().requires_grad_() for t in leaves]
        depth = kernels.DepthKV.start(n_max=S)
        for j in range(S):
            depth = depth.push(ts[3 + 2 * j], ts[4 + 2 * j])
        if name == "merge":
            with mock.patch.object(kernels, "sink_attention", side_effect=AssertionError("not merged")):
                o, share = kernels.joint_attention(*ts[:3], depth)
        else:
            o_depth, lse = depth.attend(ts[0], hd ** -0.5)
            o, share = kernels.sink_attention(*ts[:3], o_depth=o_depth, lse=lse)
        (o * weights).sum().backward()
        out[name] = o, share, [t.grad for t in ts]
    (o1, s1, g1), (o2, s2, g2) = out["merge"], out["sink"]
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert 0.05 < s1.mean() < 0.95                                        # both halves carry weight


@pytest.mark.parametrize("hd, n_kv", [(8, 2), (16, 4)])
def test_moda_joint_attention_in_bf16(hd, n_kv):
    """kernels.joint_attention on bf16 q, k, v and bf16 depth slots, outside autocast (where nothing recasts a wrong
    dtype): its output and share are bf16, q's, k's and v's gradients bf16, and all equal ops.joint_attention in fp32
    on the same values to bf16's rounding. Large depth logits (lse ~ 10 over the scale) need the sink's two
    coordinates (hi + lo): its logit in one bf16 coordinate would be off by up to 0.03."""
    from depthbench.kernels import cpu as kernels
    g = torch.Generator().manual_seed(3)
    B, H, T, S = 2, 4, 6, 3

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).bfloat16()
    q, k, v = rand(B, H, T, hd, scale=2.0), rand(B, n_kv, T, hd), rand(B, n_kv, T, hd)
    slots = [(rand(B, n_kv, T, hd, scale=3.0), rand(B, n_kv, T, hd)) for _ in range(S)]
    out = {}
    for name, body, dtype in (("fast", kernels, torch.bfloat16), ("reference", ops, torch.float32)):
        leaves = [t.detach().clone().to(dtype).requires_grad_() for t in (q, k, v)]
        depth = body.DepthKV.start(n_max=S)
        for dk, dv in slots:
            depth = depth.push(dk.to(dtype), dv.to(dtype))
        o, share = body.joint_attention(*leaves, depth)
        o.float().pow(2).sum().backward()
        out[name] = o, share, [t.grad for t in leaves]
    (o1, s1, g1), (o2, s2, g2) = out["fast"], out["reference"]
    assert o1.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in g1)
    torch.testing.assert_close(o1.float(), o2, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s1.float(), s2, rtol=0, atol=4e-3)       # the share: bf16's own rounding, 2^-8
    for a, b in zip(g1, g2):
        assert (a.float() - b).norm() <= 0.03 * b.norm()


@pytest.mark.parametrize("n_layer", [9, pytest.param(20, marks=pytest.mark.slow)])  # L20: the slow tier (L9 stays quick)
@pytest.mark.parametrize("residual", ALL)
def test_fast_kernels_equal_the_reference_deep(residual, n_layer):
    """Deeper, where the depth banks hold many sources (Full AttnRes' 41 at L20, MoDA's 39 slots): the loss and every
    gradient, fast == reference, at a narrow shape (GQA, 8-wide heads). The weights move less off their init than at
    L3 (0.02, not 0.05): 20 blocks of MUDD's per-token weights perturbed by 0.05 make a chaotic model whose gradients
    (up to 9 on the embedding) amplify rounding to 6e-4."""
    x = batch(T=8)
    out = {}
    for kernels in ("fast", "reference"):
        model = build(residual, kernels=kernels, n_layer=n_layer, **KERNEL_SHAPES["gqa"])
        perturb(model, 0.02, seed=7)
        loss = model(x, x, logits=False)[1]
        loss.backward()
        out[kernels] = loss, {n: p.grad for n, p in model.named_parameters()}
    (fast_loss, fast), (ref_loss, ref) = out["fast"], out["reference"]
    torch.testing.assert_close(fast_loss, ref_loss, rtol=1e-6, atol=1e-6)
    top = max(g.abs().max().item() for g in ref.values())
    for name, g in ref.items():
        torch.testing.assert_close(fast[name], g, rtol=1e-4, atol=max(1e-5 * g.abs().max().item(), 1e-6 * top),
                                   msg=name)


# ----------------------------------------------------------------------------- parameter counts

@pytest.mark.parametrize("L,d,d_ff,backbone,total", [
    (24, 1024, 2736, 302_432_256, 405_406_720),
    (16, 1216, 3248, 284_252_160, 406_534_336),
    (70, 640, 1712, 344_870_400, 409_229_440),
])
def test_preln_counts_match_spec(L, d, d_ff, backbone, total):
    """docs/designs.md#backbone worked checks: analytic formula and the built model agree."""
    assert shapes.backbone_params(L, d, d_ff) == backbone
    assert shapes.preln_params(L, d, d_ff) == total
    assert shapes.count_params(L, d, d_ff, "preln") == total


@pytest.mark.parametrize("residual,extra_l24,extra_l70", [
    ("sandwich", 49_152, 89_600), ("lns", 0, 0), ("deepnorm", 0, 0), ("keel", 48_128, 88_960),
    ("postln", 0, 0), ("preln_mup", 0, 0), ("preln_completep", 0, 0),
])
def test_design_extra_params_match_spec(residual, extra_l24, extra_l70):
    """docs/designs.md#overhead: each design's own parameters on top of Pre-LN, at L24 and L70."""
    for (L, d, d_ff), extra in [((24, 1024, 2736), extra_l24), ((70, 640, 1712), extra_l70)]:
        assert shapes.count_params(L, d, d_ff, residual) - shapes.preln_params(L, d, d_ff) == extra


def test_ffn_rule():
    """d_ff = ceil16(8d/3) reproduces the paper's table."""
    assert [shapes.ffn_dim(d) for d in (1216, 1024, 992, 896, 640)] == [3248, 2736, 2656, 2400, 1712]


@pytest.mark.parametrize("ar,L,d,params", [
    (76, 16, 1216, 406_534_336), (56, 20, 1120, 414_087_520), (42.67, 24, 1024, 405_406_720),
    (38.15, 26, 992, 407_661_408), (34.29, 28, 960, 406_249_920), (30.93, 30, 928, 403_847_968),
    (28, 32, 896, 399_358_848), (9.1, 70, 640, 409_229_440),
])
def test_solver_reproduces_400m_family(ar, L, d, params):
    """shapes.solve at 405M lands on the paper's 400M table's rows to the parameter."""
    s = shapes.solve(405_000_000, ar=ar)
    assert (s["n_layer"], s["d_model"], s["params"]) == (L, d, params)
    assert s["d_ff"] == shapes.ffn_dim(d) and s["head_dim"] * 16 == d


@pytest.mark.slow
def test_shapes_cli_json():
    """The CLI's --json object has exactly the documented keys and the L70 numbers."""
    import json
    r = run("shapes.py", "--params", "405M", "--ar", "9.1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert list(out) == ["n_layer", "d_model", "d_ff", "n_head", "head_dim", "ar", "params", "backbone_params"]
    assert (out["n_layer"], out["d_model"], out["d_ff"], out["params"]) == (70, 640, 1712, 409_229_440)


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["--residual", "nosuch", "--ar", "9.1"], ["--params=-5M", "--ar", "9.1"], ["--params", "0", "--ar", "9.1"],
    ["--params", "lots", "--ar", "9.1"], ["--ar", "5000"], ["--ar", "9.1", "--layers", "3"], ["--ar"], ["--bogus"],
])
def test_shapes_cli_bad_input(args):
    """Bad input: exit code 2, one line on stderr, no traceback."""
    r = run("shapes.py", *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- the five norm designs

def test_deepnorm_constants_and_init():
    """alpha = (2L)^1/4, beta = (8L)^-1/4 (spec table); beta scales W_v/W_o/FFN, not W_q/W_k."""
    for L, alpha, beta in [(16, 2.378, 0.2973), (24, 2.632, 0.2686), (70, 3.440, 0.2056)]:
        with torch.device("meta"):
            res = GPT(GPTConfig(n_layer=L, d_model=64, n_head=4, d_ff=176, vocab_size=8, residual="deepnorm")).res
        assert abs(res.alpha - alpha) < 1e-3 and abs(res.beta - beta) < 1e-4
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=256, n_head=4, d_ff=688, vocab_size=64, residual="deepnorm"))
    beta, attn, mlp = model.res.beta, model.blocks[0].attn, model.blocks[0].mlp
    for w in (attn.wq.weight, attn.wk.weight):
        assert abs(w.std().item() / 0.02 - 0.987) < 0.03   # a +-3 sigma truncated normal has std 0.987 sigma
    for w in (attn.wv.weight, attn.wo.weight, mlp.w1.weight, mlp.w2.weight, mlp.w3.weight):
        assert abs(w.std().item() / (0.02 * beta) - 0.987) < 0.03
        assert w.abs().max().item() <= 3 * 0.02 * beta + 1e-7


def test_deepnorm_block_norm_is_mean_centred():
    """DeepNorm's block norm is a LayerNorm (zero mean per token); its final norm an RMSNorm (not)."""
    model = build("deepnorm")
    s = torch.randn(2, 5, 64) + 3.0
    out = model.res.write(s, model.res.sites[0], torch.zeros_like(s), {})
    assert out.mean(-1).abs().max() < 1e-5
    assert model.res.collapse(s).mean(-1).abs().min() > 0.1


def test_lns_scales_count_blocks():
    """LNS multiplies the pre-norm output of both sublayers of block b by 1/sqrt(b+1)."""
    res = build("lns").res
    scales = [site.scale.item() for site in res.sites]
    want = [1.0, 1.0, 1 / math.sqrt(2), 1 / math.sqrt(2), 1 / math.sqrt(3), 1 / math.sqrt(3)]
    assert scales == pytest.approx(want, rel=1e-7)


def test_lns_first_block_equals_preln():
    """On the same weights, LNS's block 0 output equals Pre-LN's; block 1's differs."""
    pre, lns = build("preln"), build("lns")
    lns.load_state_dict(pre.state_dict())
    x = batch()
    with torch.no_grad():
        zp, zl = observe.record(pre, x).states, observe.record(lns, x).states
    torch.testing.assert_close(zp[1], zl[1], rtol=0, atol=0)
    assert (zp[2] - zl[2]).abs().max() > 1e-4


def test_keel_structure():
    """KEEL: no post-norm after block 0's attention (that sublayer equals Pre-LN), alpha = 2L after block 0."""
    keel = build("keel")
    assert len(keel.res.post_norms) == 2 * 3 - 1
    assert [site.alpha.item() for site in keel.res.sites] == [1.0, 1.0] + [6.0] * 4
    pre = build("preln")
    pre.load_state_dict(keel.state_dict(), strict=False)
    s, y = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    first, first_pre = keel.res.sites[0], pre.res.sites[0]
    torch.testing.assert_close(keel.res.write(s, first, y, {}), pre.res.write(s, first_pre, y, {}))
    torch.testing.assert_close(keel.res.read(s, first)[0], pre.res.read(s, first_pre)[0])
    # later sublayers: RMSNorm(alpha * s + y) has unit RMS per token (gains are 1)
    out = keel.res.write(s, keel.res.sites[3], y, {})
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(2, 5), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(6.0 * s + y, (64,), eps=1e-6), rtol=1e-5, atol=1e-5)


def test_sandwich_normalises_the_branch_output():
    """Sandwich-LN adds RMSNorm(y), so scaling the branch output by 100 changes nothing."""
    res = build("sandwich").res
    s, y = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    site = res.sites[2]
    torch.testing.assert_close(res.write(s, site, y, {}), res.write(s, site, 100 * y, {}), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the five cross-layer designs

@pytest.mark.parametrize("residual,extra_l24,extra_l70", [
    ("hc", 296_160, 541_240), ("mhc", 4_719_888, 8_605_380), ("attnres", 98_304, 179_200),
    ("block_attnres", 98_304, 179_200), ("moda", 48_234_496, 56_524_800),
])
def test_cross_layer_extra_params_match_spec(residual, extra_l24, extra_l70):
    """docs/designs.md#overhead: HC 2L(6d+26), mHC 2L(96d+27), AttnRes 4dL, MoDA 2d^2(L-1)."""
    for (L, d, d_ff), extra in [((24, 1024, 2736), extra_l24), ((70, 640, 1712), extra_l70)]:
        assert shapes.count_params(L, d, d_ff, residual) - shapes.preln_params(L, d, d_ff) == extra


def mudd_extra(L, d):
    """MUDD's own parameters, from docs/designs.md#mudd: key and value gains 2d(L - 1); per block b, W_1 (H_b x d), W_2
    (C n x H_b) and a_b (C n), n = b + 2, C = 4 (1 in the last block), H_b = 64 (floor(C n e / 64) + 1), e = 4 in the
    last block, else 1."""
    total = 2 * d * (L - 1)
    for b in range(L):
        C, e = (1, 4) if b == L - 1 else (4, 1)
        n = b + 2
        H = 64 * (C * n * e // 64 + 1)
        total += H * d + C * n * H + C * n
    return total


@pytest.mark.parametrize("residual,options,extra_l24,extra_l70", [
    ("mudd", {}, 2_402_373, 10_449_111), ("resformer", {}, 46, 138), ("denseformer", {}, 324, 2_555),
    ("mixln", {}, 0, 0), ("hybrid", {}, 73_728, 135_680), ("hybrid", {"deep": "mudd"}, 1_536_315, 6_101_902),
    ("attnres", {"learn_logit_scale": True}, 98_352, 179_340), ("block_attnres", {"topk_fraction": 0.25}, 98_304, 179_200)])
def test_beyond_the_paper_extra_params_match_spec(residual, options, extra_l24, extra_l70):
    """docs/designs.md#overhead, the designs beyond the paper and the release's AttnRes variants: MUDD mudd_extra(L,
    d); ResFormer 2(L - 1); DenseFormer L(L + 3)/2; Mix-LN 0; Hybrid the deep design's at L - floor(L/4) (Block
    AttnRes 4d(L - S): 18 and 53 blocks; MUDD at 18 and 53); the logit scale 2L, top-k nothing."""
    for (L, d, d_ff), extra in [((24, 1024, 2736), extra_l24), ((70, 640, 1712), extra_l70)]:
        assert shapes.count_params(L, d, d_ff, residual, **options) - shapes.preln_params(L, d, d_ff) == extra
    assert (mudd_extra(24, 1024), mudd_extra(70, 640), mudd_extra(18, 1024), mudd_extra(53, 640)) == (
        2_402_373, 10_449_111, 1_536_315, 6_101_902)
    assert [2 * (L - 1) for L in (24, 70)] == [46, 138] and [L * (L + 3) // 2 for L in (24, 70)] == [324, 2_555]
    assert [4 * 1024 * 18, 4 * 640 * 53, 98_304 + 48, 179_200 + 140] == [73_728, 135_680, 98_352, 179_340]


def test_hc_with_one_stream_equals_preln():
    """HC with n = 1 (zero dynamic terms at init, 1/sqrt(1) output scale) is Pre-LN on the same weights."""
    pre, hc = build("preln"), build("hc", residual_args={"n_streams": 1})
    hc.load_state_dict(pre.state_dict(), strict=False)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(hc(x)[0], pre(x)[0], rtol=1e-5, atol=1e-5)


def test_block_attnres_with_one_sublayer_per_group_equals_full():
    """Block AttnRes with N = 2L groups is Full AttnRes, on the same (trained-looking) weights."""
    full = build("attnres")
    with torch.no_grad():
        full.res.queries.normal_(0, 0.5)          # non-uniform depth weights, so the test has teeth
    block = build("block_attnres", residual_args={"n_groups": 6})
    block.load_state_dict(full.state_dict())
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(block(x)[0], full(x)[0], rtol=0, atol=0)
        coarse = build("block_attnres", residual_args={"n_groups": 2})
        coarse.load_state_dict(full.state_dict())
        assert (coarse(x)[0] - full(x)[0]).abs().max() > 1e-4


def test_block_attnres_groups_spread_evenly():
    """N = 8 groups over 2L sublayers: consecutive, sizes differ by at most one, for every 400M depth."""
    for L in shapes.TABLE_LAYERS:
        with torch.device("meta"):
            res = GPT(GPTConfig(n_layer=L, d_model=32, n_head=2, d_ff=96, vocab_size=8, residual="block_attnres")).res
        sizes = [res.group.count(g) for g in range(8)]
        assert res.group == sorted(res.group) and max(sizes) - min(sizes) <= 1 and sum(sizes) == 2 * L


def test_block_attnres_block_size_is_the_official_boundary_rule():
    """block_size S: a boundary where k % S == 0 (the official block's rule), the last group short when S does not
    divide 2L; where S divides 2L it is the n_groups reading with N = 2L / S, on the same weights."""
    for L, S in [(3, 4), (3, 5), (7, 8), (3, 2)]:
        with torch.device("meta"):
            res = GPT(tiny("block_attnres", n_layer=L, residual_args={"block_size": S})).res
        starts = [k for k in range(2 * L) if k == 0 or res.group[k] != res.group[k - 1]]
        assert starts == [k for k in range(2 * L) if k % S == 0] and res.n_groups == -(-2 * L // S)
    full = build("attnres")
    with torch.no_grad():
        full.res.queries.normal_(0, 0.5)
    x = batch()
    for S, N in [(2, 3), (3, 2), (1, 6)]:
        by_size, by_count = build("block_attnres", residual_args={"block_size": S}), \
            build("block_attnres", residual_args={"n_groups": N})
        by_size.load_state_dict(full.state_dict())
        by_count.load_state_dict(full.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(by_size(x)[0], by_count(x)[0], rtol=0, atol=0)


def test_postln_is_the_post_norm_formula():
    """h = RMSNorm_i(x + F_i(x)) per sublayer, then the final norm and the head, written out by hand."""
    model = build("postln")
    with torch.no_grad():
        for norm in model.res.norms:
            norm.weight.normal_(1.0, 0.3)
        x = batch()
        h = model.wte(x)
        rope = rope_cos_sin(x.shape[1], model.cfg.head_dim, model.cfg.rope_theta, x.device)
        for b, blk in enumerate(model.blocks):
            h = model.res.norms[2 * b](h + blk.attn(h, rope)[0])
            h = model.res.norms[2 * b + 1](h + blk.mlp(h))
        torch.testing.assert_close(model(x)[0], model.lm_head(model.res.norm_f(h)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("residual, alpha", [("preln_mup", 0.5), ("preln_completep", 1.0)])
def test_depth_scaled_preln_branch_multiplier_and_base_depth(residual, alpha):
    """h = x + (L / L_base)^(-alpha) F(RMSNorm(x)); at L = L_base (and d = base_width) it is Pre-LN, model and
    optimizer groups alike."""
    pre = build("preln")
    same = build(residual, residual_args={"base_depth": 3, "scaling": "depth_width", "base_width": 64})
    same.load_state_dict(pre.state_dict())
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(same(x)[0], pre(x)[0], rtol=0, atol=0)
    assert [(g["lr_scale"], g["weight_decay"], "eps" in g) for g in same.param_groups(0.1)] == [(1.0, 0.1, False)]
    deep = build(residual, residual_args={"base_depth": 12})        # m_L = 1/4
    assert deep.res.branch_scale == pytest.approx(4 ** alpha)
    states = observe.record(deep, x).states
    with torch.no_grad():                                           # the first block's update, by hand
        rope = rope_cos_sin(x.shape[1], deep.cfg.head_dim, deep.cfg.rope_theta, x.device)
        h = states[0] + 4 ** alpha * deep.blocks[0].attn(deep.res.norms[0](states[0]), rope)[0]
        h = h + 4 ** alpha * deep.blocks[0].mlp(deep.res.norms[1](h))
        torch.testing.assert_close(states[1], h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("residual, alpha", [("preln_mup", 0.5), ("preln_completep", 1.0)])
def test_depth_scaled_preln_optimizer_rules_are_the_releases(residual, alpha):
    """m_L = L / base_depth, m_N = d / base_width. depth_only: every block tensor LR x m_L^(alpha-1), eps x
    m_L^-alpha. depth_width: matrices LR x m_N^-1 m_L^(alpha-1), eps x m_N^-1 m_L^-alpha, WD x m_N; block norms
    LR x m_L^(alpha-1), eps x m_N^-1 m_L^-alpha; embedding and head eps x m_N^-1; init and head scale."""
    m_L, m_N, eps = 3 / 12, 64 / 256, 1e-8
    only = build(residual, residual_args={"base_depth": 12})
    wide = build(residual, residual_args={"base_depth": 12, "scaling": "depth_width", "base_width": 256})
    for model, want in [(only, {"embedding": (1, 1, 1), "head": (1, 1, 1),
                                "block_matrix": (m_L ** (alpha - 1), m_L ** -alpha, 1),
                                "residual": (m_L ** (alpha - 1), m_L ** -alpha, 1)}),
                        (wide, {"embedding": (1, 1 / m_N, 1), "head": (1, 1 / m_N, 1),
                                "block_matrix": (m_L ** (alpha - 1) / m_N, m_L ** -alpha / m_N, m_N),
                                "residual": (m_L ** (alpha - 1), m_L ** -alpha / m_N, 1)})]:
        roles = model.param_roles()
        role_of = {id(p): roles[n] for n, p in model.named_parameters()}
        for g in model.param_groups(0.1, eps=eps):
            for p in g["params"]:
                lr, e, wd = want[role_of[id(p)]]
                assert g["lr_scale"] == pytest.approx(lr) and g.get("eps", eps) == pytest.approx(eps * e)
                assert g["weight_decay"] == pytest.approx(0.1 * wd)
    assert roles["res.norm_f.weight"] == "head" and roles["res.norms.0.weight"] == "residual"
    ref = build("preln")                                  # same seed: the init differs only by the width rules
    for name, p in wide.named_parameters():
        scale = m_N ** -0.5 if name.startswith("blocks.") else 1.0
        torch.testing.assert_close(p, ref.state_dict()[name] * scale, msg=name)
    z = torch.randn(2, 64)
    torch.testing.assert_close(wide.res.collapse(z), wide.res.norm_f(z) / m_N)     # logits x m_N^-1


def test_attnres_weights_uniform_at_init_and_sum_to_one():
    """Zero queries: consumer k spreads weight 1/(k+1) over its k+1 sources; always sums to 1."""
    model = build("attnres")
    x = batch()
    with torch.no_grad():
        weights = observe.record(model, x).internals["attnres_weights"]
    assert [len(w) for w in weights] == list(range(2, 2 * 3 + 2))   # consumers 1..2L (2L = the head)
    for w in weights:
        torch.testing.assert_close(w, torch.full_like(w, 1 / len(w)))
    with torch.no_grad():
        model.res.queries.normal_(0, 1.0)
        for w in observe.record(model, x).internals["attnres_weights"]:
            assert abs(w.sum().item() - 1) < 1e-5 and w.std() > 1e-3


@pytest.mark.parametrize("fast", [False, True])
def test_rope_is_rotate_half_and_keeps_relative_positions(fast):
    """apply_rope rotates each pair (x_j, x_j+hd/2) by its angle, and q.k after RoPE depends only on the offset."""
    apply_rope = kernels_of(fast).apply_rope
    torch.manual_seed(0)
    cos, sin = rope_cos_sin(12, 8, 10000.0, "cpu")
    x = torch.randn(2, 3, 12, 8)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, :4], sin[:, :4]
    rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)
    torch.testing.assert_close(apply_rope(x, cos, sin), rotated, rtol=0, atol=1e-6)
    q, k = torch.randn(8), torch.randn(8)
    qr, kr = (apply_rope(v.expand(1, 1, 12, 8), cos, sin)[0, 0] for v in (q, k))
    torch.testing.assert_close(qr[5] @ kr[2], qr[9] @ kr[6], rtol=1e-5, atol=1e-5)
    assert abs(qr[5] @ kr[2] - qr[5] @ kr[4]) > 1e-3


@pytest.mark.parametrize("residual", ["preln", "hc", "attnres", "block_attnres", "moda", "mudd", "resformer"])
def test_checkpointed_blocks_equal_the_plain_forward(residual):
    """checkpoint_blocks: backward recomputes each block from its input (the depth banks write their slots again);
    loss and every gradient equal the plain run's, fast kernels."""
    x = batch(T=8)
    out = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = GPT(tiny(residual, n_kv_head=2, checkpoint_blocks=ckpt))
        perturb(model, 0.05, seed=5)
        loss = model(x, x, logits=False)[1]
        loss.backward()
        out.append((loss, [p.grad for p in model.parameters()]))
    (l1, g1), (l2, g2) = out
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-6)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 2, 5])
def test_causal_attention_with_gqa_at_any_length(T):
    """GQA (4 query heads on 2 kv heads, 8-wide: the CPU pads them) at sequences shorter than the head count: both
    bodies equal attention over kv heads copied to every query head."""
    from depthbench.kernels import cpu as kernels
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(2, 4, T, 8, generator=g), torch.randn(2, 2, T, 8, generator=g), torch.randn(2, 2, T, 8, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    for body in (ops, kernels):
        torch.testing.assert_close(body.causal_attention(q, k, v), want, rtol=1e-5, atol=1e-6)


def test_chunked_loss_equals_plain_loss_and_gradients():
    """The logits-free loss (token chunks, checkpointed) equals the plain fp32 cross-entropy and its
    gradients, with ignored targets spread over the chunks (the model's tiny shapes use one chunk)."""
    from depthbench.kernels.cpu import chunked_cross_entropy
    torch.manual_seed(0)
    z, w = torch.randn(37, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    t[[1, 5, 20, 36]] = -1
    plain = torch.nn.functional.cross_entropy(z @ w.T, t, ignore_index=-1)
    plain_grads = torch.autograd.grad(plain, [z, w])
    for chunk in [None, 7, 36]:                   # one chunk, many with a short last one, a last of one token
        loss = chunked_cross_entropy(z, w, t, chunk)
        torch.testing.assert_close(loss, plain, rtol=1e-6, atol=1e-6)
        for a, b in zip(torch.autograd.grad(loss, [z, w]), plain_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    model, x = build("preln"), batch()
    model_loss = model(x, x, logits=False)
    assert model_loss[0] is None and model_loss[1].item() == pytest.approx(model(x, x)[1].item(), rel=1e-6)


@pytest.mark.parametrize("fast", [False, True])
def test_sinkhorn_doubly_stochastic(fast):
    """The shared sinkhorn makes logits of mHC's scale doubly stochastic (columns exact, rows ~1e-3;
    20 iterations do not converge for strongly peaked logits, as in the reference)."""
    M = kernels_of(fast).sinkhorn(torch.randn(5, 4, 4))
    torch.testing.assert_close(M.sum(-2), torch.ones(5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(M.sum(-1), torch.ones(5, 4), atol=1e-3, rtol=0)


def _mhc_maps(model, x):
    with torch.no_grad():
        rec = observe.record(model, x).internals
    return torch.stack(rec["H_res"]), torch.stack(rec["H_pre"]), torch.stack(rec["H_post"])


def test_mhc_transport_doubly_stochastic_uniform_init_and_after_training():
    """init='uniform': H_res ~ 11^T/4, H_pre ~ 1/2, H_post ~ 1; still doubly stochastic after AdamW steps."""
    model = build("mhc", residual_args={"init": "uniform"})
    x = batch()
    res, pre, post = _mhc_maps(model, x)
    torch.testing.assert_close(res, torch.full_like(res, 0.25), atol=0.02, rtol=0)
    torch.testing.assert_close(pre, torch.full_like(pre, 0.5), atol=0.02, rtol=0)
    torch.testing.assert_close(post, torch.ones_like(post), atol=0.05, rtol=0)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=3e-2)
    for _ in range(5):
        opt.zero_grad()
        model(x, x)[1].backward()
        opt.step()
    res2 = _mhc_maps(model, x)[0]
    assert (res2 - res).abs().max() > 1e-3                      # the transport did move
    # token-averaged maps of doubly stochastic matrices are doubly stochastic too
    torch.testing.assert_close(res2.sum(-1), torch.ones(6, 4), atol=1e-3, rtol=0)
    torch.testing.assert_close(res2.sum(-2), torch.ones(6, 4), atol=1e-4, rtol=0)


def test_mhc_gap8_init():
    """The default init is gap-8: H_res diagonal 1/(1+3e^-8) = 0.998995, H_pre ~ one-hot(k mod 4), H_post = 1."""
    model = build("mhc")
    assert model.res.init == "gap8"
    res, pre, post = _mhc_maps(model, batch())
    diag = 1 / (1 + 3 * math.exp(-8))
    torch.testing.assert_close(torch.diagonal(res, dim1=-2, dim2=-1), torch.full((6, 4), diag), atol=1e-5, rtol=0)
    onehot = torch.nn.functional.one_hot(torch.arange(6) % 4, 4).float()
    torch.testing.assert_close(pre, onehot * (2 * torch.sigmoid(torch.tensor(8.0)) - 1) + torch.sigmoid(torch.tensor(-8.0)), atol=1e-5, rtol=0)
    torch.testing.assert_close(post, torch.ones_like(post), atol=1e-6, rtol=0)


@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_residual_mixing_reaches_the_output(residual):
    """Perturbing the residual-transport of a middle connector changes the loss (a shipped HC bug
    computed the mixing but added the branch to the un-mixed streams)."""
    model = build(residual)
    x = batch()
    with torch.no_grad():
        # make the streams differ and their read-out non-uniform first: a doubly stochastic mix of
        # identical streams is the identity, and it keeps the stream sum, which uniform H_pre reads
        if residual == "hc":
            model.res.conn[0].dynamic_alpha.normal_()
        else:
            for c in model.res.conn:
                c.b[:8].copy_(torch.randn(8))
        loss0 = model(x, x)[1].item()
        c = model.res.conn[1]
        if residual == "hc":
            c.static_alpha[:, 1:] += 0.5 * torch.randn(4, 4)
        else:
            c.b[8:] = 2.0 * torch.randn(16)              # away from gap-8's near-identity, which saturates
        assert abs(model(x, x)[1].item() - loss0) > 1e-4


def test_hc_streams_and_collapse():
    """HC at init, on Pre-LN's weights: the 4 streams stay identical copies of Pre-LN's stream, and the
    summed (4x) collapse gives Pre-LN's logits after the final norm."""
    pre, hc = build("preln"), build("hc")
    hc.load_state_dict(pre.state_dict(), strict=False)   # also replaces the 1/sqrt(n)-scaled W_o, W_2
    x = batch()
    with torch.no_grad():
        rec = observe.record(hc, x)
        logits = rec.logits
        # not bit-exact: the final norm's eps (1e-6) weighs less against the 4x larger sum
        torch.testing.assert_close(logits, pre(x)[0], rtol=5e-3, atol=1e-3)
    z = rec.states[-1].unflatten(-1, (4, 64))
    torch.testing.assert_close(z, z[:, :, :1].expand_as(z), rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(z[:, :, 0], observe.record(pre, x).states[-1], rtol=1e-4, atol=1e-5)


def test_hc_older_readings_equal_their_definitions_on_hand_made_streams():
    """On four different streams H: collapse "sum" = N_f(sum_s h_s), "mean" = N_f(mean_s h_s), "norm_each" (the
    older official code) = sum_s N_f(h_s); forward "unmixed" (the older code) writes h_t + beta_t y."""
    g = torch.Generator().manual_seed(0)
    H, gain = torch.randn(2, 3, 4, 64, generator=g), 0.5 + torch.rand(64, generator=g)
    norm = lambda z: gain * z / (z.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731
    want = {"sum": norm(H.sum(2)), "mean": norm(H.mean(2)), "norm_each": norm(H).sum(2)}
    for collapse, z in want.items():
        res = build("hc", residual_args={"collapse": collapse}).res
        with torch.no_grad():
            res.norm_f.weight.copy_(gain)
            torch.testing.assert_close(res.collapse(H), z, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want["sum"], want["norm_each"])    # (sum and mean differ only by the norm's eps)
    res = build("hc", residual_args={"forward": "unmixed"}).res
    y = torch.randn(2, 3, 64, generator=g)
    with torch.no_grad():
        for c in res.conn:                                       # a residual transport far from the identity
            c.static_alpha.add_(torch.randn(c.static_alpha.shape, generator=g))
        _, ctx = res.read(H, res.sites[1])
        torch.testing.assert_close(res.write(H, res.sites[1], y, ctx), H + ctx["H_post"][..., None] * y[..., None, :])


def test_moda_depth_path_sends_gradient_to_earlier_layers():
    """With T = 1 a token's sequence softmax has one key, so Pre-LN's block-0 W_k gets no gradient;
    MoDA's later blocks read block 0's keys through depth attention, so its W_k does."""
    x = batch(B=2, T=1)
    for residual, expect_grad in [("preln", False), ("moda", True)]:
        model = build(residual)
        model(x, x)[1].backward()
        g = model.blocks[0].attn.wk.weight.grad.abs().max().item()
        assert (g > 1e-8) == expect_grad, (residual, g)


def test_moda_records_depth_mass():
    """MoDA's depth keys take a share of the softmax mass in (0, 1) in blocks 1 and 2 (block 0 has none)."""
    model = build("moda")
    with torch.no_grad():
        rec = observe.record(model, batch()).internals
    mass = torch.stack(rec["moda_depth_mass"])
    assert len(mass) == 2 and ((mass > 0) & (mass < 1)).all()


@pytest.mark.parametrize("fast", [False, True])
def test_joint_attention_gqa_equals_copied_kv_heads(fast):
    """With 2 kv heads for 4 query heads, joint_attention equals the MHA call on k/v heads copied to each query
    head, in values and gradients (a kv head's gradient is the sum over the copies that read it)."""
    ops = kernels_of(fast)
    torch.manual_seed(1)
    B, H, Hkv, T, hd, S = 2, 4, 2, 7, 8, 3
    q = torch.randn(B, H, T, hd, requires_grad=True)
    kv = [torch.randn(B, Hkv, T, hd, requires_grad=True) for _ in range(2 + 2 * S)]
    rep = lambda t: t.repeat_interleave(H // Hkv, dim=1)  # noqa: E731

    def depth(keys, values):                                   # a DepthKV holding the S slots
        slots = ops.DepthKV.start(S)
        for key, value in zip(keys, values):
            slots = slots.push(key, value)
        return slots
    o, share = ops.joint_attention(q, kv[0], kv[1], depth(kv[2:2 + S], kv[2 + S:]))
    o_ref, share_ref = ops.joint_attention(q, *map(rep, kv[:2]), depth([rep(t) for t in kv[2:2 + S]],
                                                                        [rep(t) for t in kv[2 + S:]]))
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(share, share_ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad((o * g).sum(), [q, *kv]), torch.autograd.grad((o_ref * g).sum(), [q, *kv])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_moda_post_norm_variant():
    """MoDA norm='post' runs, is causal, and differs from the pre-norm variant on the same weights."""
    pre = build("moda")
    post = build("moda", residual_args={"norm": "post"})
    post.load_state_dict(pre.state_dict())
    x = batch()
    with torch.no_grad():
        a, b = pre(x)[0], post(x)[0]
        assert (a - b).abs().max() > 1e-3
        x2 = x.clone(); x2[:, 9] = (x2[:, 9] + 1) % 64
        torch.testing.assert_close(post(x2)[0][:, :9], b[:, :9], rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["hc", "attnres", "moda"])
def test_compiles_and_equals_eager(residual):
    """torch.compile traces the trunk loop and the design's state (tensors, tuples) as one graph (fullgraph=True),
    except that a depth bank (AttnRes, MoDA) is read and written eagerly at its graph breaks; the compiled loss and
    gradients equal eager ones. Uses the cheap aot_eager backend; train.py uses inductor on CUDA."""
    torch._dynamo.reset()
    model = build(residual)
    x = batch()
    loss = model(x, x)[1]
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=residual == "hc")
    loss_c = compiled(x, x)[1]
    loss_c.backward()
    assert loss_c.item() == loss.item()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def test_readme_quick_start_matches_ci():
    """The README opens with two commands: install + train, and the tests; .ci/run installs the same
    requirements and runs the same test command (tests/test_train.py runs the train command itself)."""
    readme = open("README.md").read()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["pip install -r requirements.txt && python train.py", "python -m pytest -q"]
    ci = [line.strip() for line in open(".ci/run").read().splitlines()]
    assert ci[-1] == commands[1]
    assert "python -m pip install -q -r requirements.txt" in ci


# ----------------------------------------------------------------------------- grouped-query attention

def test_mha_attention_is_the_plain_multi_head_formula():
    """n_kv_head = n_head: Attention equals textbook MHA (d -> d projections, RoPE, causal SDPA) bit
    for bit, with the d x d W_k, W_v of every earlier checkpoint."""
    from model import Attention
    from ops import apply_rope, rope_cos_sin
    cfg = tiny(n_kv_head=4)
    torch.manual_seed(0)
    attn = Attention(cfg)
    assert attn.wk.weight.shape == attn.wv.weight.shape == (64, 64)
    x = torch.randn(2, 10, 64)
    rope = rope_cos_sin(10, cfg.head_dim, cfg.rope_theta, x.device)
    heads = [lin(x).view(2, 10, 4, 16).transpose(1, 2) for lin in (attn.wq, attn.wk, attn.wv)]
    q, k = (apply_rope(t, *rope) for t in heads[:2])
    o = torch.nn.functional.scaled_dot_product_attention(q, k, heads[2], is_causal=True)
    with torch.no_grad():
        assert torch.equal(attn(x, rope)[0], attn.wo(o.transpose(1, 2).reshape(2, 10, 64)))


def mha_copy_of(gqa):
    """An MHA model whose k/v heads (and MoDA's depth k/v heads) are copies of a GQA model's."""
    cfg = gqa.cfg
    group = cfg.n_head // cfg.n_kv_head
    mha = GPT(tiny(cfg.residual, n_kv_head=cfg.n_head))
    state = {}
    for name, t in gqa.state_dict().items():
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):
            t = t.view(cfg.n_kv_head, -1, cfg.d_model).repeat_interleave(group, 0).flatten(0, 1)
        elif ".kv_proj." in name:                                       # (2, Hkv, hd) output rows
            t = t.view(2, cfg.n_kv_head, -1, cfg.d_model).repeat_interleave(group, 1).flatten(0, 2)
        state[name] = t
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("residual", ALL)
def test_gqa_equals_mha_with_copied_kv_heads(residual):
    """n_kv_head = 2 of 4 heads: the same logits as MHA whose k/v heads are pairwise copies; fewer
    parameters by exactly what the formula says; and not the same as MHA with its own k/v heads."""
    gqa = build(residual, n_kv_head=2)
    mha = mha_copy_of(gqa)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(gqa(x)[0], mha(x)[0], rtol=1e-5, atol=1e-5)
        assert (build(residual)(x)[0] - gqa(x)[0]).abs().max() > 1e-4
    cfg = gqa.cfg
    saved = 2 * cfg.n_layer * cfg.d_model * cfg.d_model // 2              # W_k, W_v lose half their rows
    if residual == "moda":
        saved += (cfg.n_layer - 1) * cfg.d_model * cfg.d_model             # and W_kv half of its 2d outputs
    assert mha.num_params() - gqa.num_params() == saved
    assert shapes.count_params(3, 64, 176, residual, vocab=64, n_head=4, n_kv_head=2) == gqa.num_params()


# ----------------------------------------------------------------------------- the paper's suites

@pytest.mark.parametrize("suite,L,total", [
    ("400m", 42, 404_151_200), ("302m-backbone", 84, 353_831_200), ("ladder", 12, 206_073_728),
    ("ladder", 34, 502_401_376), ("1.6b", 28, 1_615_349_760), ("1.6b", 40, 1_607_179_968),
    ("1.6b", 54, 1_617_192_544), ("400m", 36, 409_433_184), ("302m-backbone", 56, 371_116_704),
])
def test_suite_totals(suite, L, total):
    """The official configs' exact Pre-LN totals: the formula and the model built on the meta device."""
    row = next(r for r in shapes.suite_rows(suite) if r["n_layer"] == L)
    assert row["params"] == total
    assert shapes.count_params(L, row["d_model"], row["d_ff"], n_kv_head=row["n_kv_head"]) == total


def test_suites_match_the_paper_configs():
    """Every suite row: 16 heads, d = 16 x head_dim; 1.6b uses 8 KV heads and d_ff = 3d, the others
    MHA and ceil16(8d/3); the 400M rows are what the solver finds at 405M; steps as launched."""
    steps = {"400m": {7600}, "302m-backbone": {7600}, "ladder": {3800, 5700, 7600, 9500}, "1.6b": {30400}}
    assert shapes.suite_rows("302m-backbone")[5]["backbone_params"] == 299_126_016
    for name in shapes.SUITES:
        for r in shapes.suite_rows(name):
            assert r["n_head"] * r["head_dim"] == r["d_model"] and r["head_dim"] % 2 == 0
            gqa = name == "1.6b"
            assert r["n_kv_head"] == (8 if gqa else 16)
            assert r["d_ff"] == (3 * r["d_model"] if gqa else shapes.ffn_dim(r["d_model"]))
            assert r["steps"] in steps[name]
    for r in shapes.suite_rows("400m"):
        s = shapes.solve(405_000_000, layers=r["n_layer"])
        assert (s["d_model"], s["d_ff"], s["params"]) == (r["d_model"], r["d_ff"], r["params"])
    assert [len(shapes.suite_rows(n)) for n in shapes.SUITES] == [8, 7, 12, 3]


def test_released_shapes_follow_the_paper_rows_with_their_designs():
    """The release's extra shapes come after the paper's rows (whose row numbers stay), each naming the designs
    released there; the L56 backbone is what the solver finds for the 302M backbone at L56."""
    released = {name: [(r["n_layer"], r["d_model"], r["designs"]) for r in shapes.suite_rows(name) if r["designs"]]
                for name in shapes.SUITES}
    assert released == {"400m": [(36, 864, ("hc", "mhc", "attnres"))], "302m-backbone": [(56, 672, ("hc", "mhc"))],
                        "ladder": [], "1.6b": []}
    assert [r["n_layer"] for r in shapes.suite_rows("400m")][:7] == [16, 20, 24, 28, 32, 42, 70]
    s = shapes.solve(302_432_256, layers=56, fixed="backbone")
    assert (s["d_model"], s["d_ff"]) == (672, 1792)


@pytest.mark.slow
def test_shapes_cli_suite_json(capsys):
    """`shapes.py --suite 1.6b --json`, a process as typed: three rows, 8 KV heads, the exact totals. The same main in
    this process (a process more is ~4 s of imports, nothing they test): no name lists suites; an unknown name is
    one line, exit 2, nothing on stdout."""
    import json
    r = run("shapes.py", "--suite", "1.6b", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["d_ff"], x["n_kv_head"], x["params"], x["steps"]) for x in rows] == [
        (6144, 8, 1_615_349_760, 30400), (5184, 8, 1_607_179_968, 30400), (4512, 8, 1_617_192_544, 30400)]
    shapes.main(["--suite"])
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == list(shapes.SUITES)
    with pytest.raises(SystemExit) as bad:
        shapes.main(["--suite", "nosuch"])
    out, err = capsys.readouterr()
    assert bad.value.code == 2 and err.count("\n") == 1 and not out, err


# ----------------------------------------------------------------------------- precision under bf16 autocast

def tensors_of(state):
    if torch.is_tensor(state):
        return [state]
    if isinstance(state, ops.DepthBank):                      # AttnRes' sources: a list, or one preallocated buffer
        return state.sources
    if isinstance(state, kernels.DepthBank):
        return [state.bank.slots[0][:len(state)]]
    return [t for part in state for t in tensors_of(part)] if isinstance(state, (list, tuple)) else []


class SoftmaxInputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dtype of every softmax / log-softmax / logsumexp input."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("_softmax", "_log_softmax", "logsumexp"):
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("residual", ALL)
def test_one_precision_rule_under_bf16_autocast(residual, kernels):
    """Under bf16 autocast (CPU's here; CUDA's in training) the sublayers compute in bf16, while every design's
    residual state after every write (HC's streams, AttnRes' bank and group sums; MoDA's and ResFormer's stream, their
    depth K/V and first-layer values being attention's own) and every softmax input stays fp32; the loss stays near
    fp32's."""
    model, x = build(residual, kernels=kernels, **KERNEL_SHAPES["gqa"]), batch()
    states, write = [], model.res.write
    model.res.write = lambda s, site, y, ctx=None: states.append(write(s, site, y, ctx)) or states[-1]
    with torch.autocast("cpu", dtype=torch.bfloat16), SoftmaxInputs() as soft:
        loss = model(x, x)[1]
    loss.backward()
    assert len(states) == 2 * model.cfg.n_layer
    for s in states:
        stream = s[:1] if residual in ("moda", "resformer") else s             # not attention's own K/V
        values = [t for t in tensors_of(stream) if t.is_floating_point()]  # not masks
        assert {t.dtype for t in values} == {torch.float32}
    assert soft.dtypes == {torch.float32}
    del model.res.write
    assert abs(loss.item() - model(x, x)[1].item()) < 0.05


@pytest.mark.parametrize("fast", [False, True])
def test_attnres_depth_logits_are_fp32_under_autocast(fast):
    """AttnRes' depth weights under bf16 autocast equal fp32's on the same fp32 sources: no logit is rounded to
    bf16 (autocast would run the key-query product as a bf16 matmul)."""
    torch.manual_seed(0)
    q, g, src = torch.randn(32), 1 + 0.1 * torch.randn(32), [torch.randn(2, 5, 32) * (j + 1) for j in range(6)]

    def depth_mix():
        bank = kernels_of(fast).DepthBank.start(src[0], n_max=len(src))
        for v in src[1:]:
            bank = bank.push(v)
        return bank.mix(q, g, 1e-5)
    mix, p, _ = depth_mix()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mix_a, p_a, _ = depth_mix()
    assert p_a.dtype == mix_a.dtype == torch.float32
    torch.testing.assert_close(p_a, p, rtol=0, atol=1e-6)


def test_attnres_memory_is_linear_in_depth_under_autocast():
    """Full AttnRes under bf16 autocast, eager: the forward's peak tensor bytes per token and layer are the same
    at L4 and L16 (each source is stored once, in fp32, and read by every consumer in place; a depth mix that
    made fp32 copies of its bf16 sources for backward grew ~1.7x from L4 to L16)."""
    from profile_gpu import TensorBytes
    per_layer = []
    for L in (4, 16):
        model, x = build("attnres", n_layer=L), batch(T=32)
        with torch.autocast("cpu", dtype=torch.bfloat16), TensorBytes() as tb:
            model(x, x)
        per_layer.append(tb.peak / L)
    assert per_layer[1] < 1.1 * per_layer[0]


@pytest.mark.slow
def test_every_design_traces_under_compile_for_training_and_eval():
    """torch.compile's tracer (dynamo, backend "eager": no inductor) takes every design through a training step and
    a no-grad eval, as train.py runs them on a GPU; an autograd node's arguments were once misread in the eval."""
    for residual in ALL:
        torch._dynamo.reset()
        model = build(residual)
        compiled, idx = torch.compile(model, backend="eager"), batch()
        compiled(idx, idx, logits=False)[1].backward()
        with torch.no_grad():
            torch.testing.assert_close(compiled(idx, idx)[1], model(idx, idx)[1])
