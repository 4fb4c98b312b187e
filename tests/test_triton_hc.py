"""
HC's and mHC's Triton bodies (depthbench/kernels/triton_hc.py) equal ops.py's, run by Triton's interpreter on CPU
tensors:

    python -m pytest -q tests/test_triton_hc.py

Each kernel against its reference body, forward and every gradient: fp32 to 1e-5 (relative to the largest entry),
bf16 inputs to cosine >= 0.999; odd token counts, n = 4 streams and n = 3 (a block padded to 4), widths that leave
a partial block; mHC's fused read (triton_hc_read.py) against ops.hc_read the same way; then a tiny GPT with residual
"hc" and "mhc" whose HC names are replaced by the Triton bodies (mHC's read fused) gives the loss and gradients of
kernels "reference", in fp32 and, to bf16's bounds, under bf16 autocast (the streams bf16). Also: every kernel
compiles to PTX for sm_90 (H100/H200) with no GPU present (slow: ~10 s with a cold Triton cache); off the GPU each
body is depthbench/kernels/cpu.py's; `traffic` counts the bytes of the tensors a forward touches, and every launch
one sublayer makes (kernels, torch glue, recompute); the GPU script's check (`compare_with_reference`) finds a wrong
body.
Skipped, with the reason, where triton does not import (`pip install triton`: the interpreter needs no GPU).

The interpreter is chosen when a kernel is decorated (TRITON_INTERPRET=1 at import time), so `interpreted_hc` sets
it only while importing depthbench.kernels.triton_hc (or reloading it, if another test imported it for the GPU first)
and restores it: other tests in the same process keep their Triton as it was.
"""
import copy
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ops
from depthbench.kernels import graph_ops
from model import GPT, GPTConfig
from test_all import assert_step_equal_to_bf16, cosine, loss_and_grads

pytest.importorskip("triton", reason="triton does not import: `pip install triton` runs these tests on the CPU "
                                     "(its interpreter, TRITON_INTERPRET=1)")

ROOT = Path(__file__).resolve().parents[1]


def interpreted_hc():
    """depthbench.kernels.triton_hc with its kernels decorated for the interpreter (TRITON_INTERPRET=1 only
    meanwhile)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module("depthbench.kernels.triton_hc")
        if type(module._width_fwd).__name__ != "InterpretedFunction":
            module = importlib.reload(module)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    assert module.interpreted(), "depthbench.kernels.triton_hc's kernels are not interpreted: the tests would test kernels.py"
    return module


hc = interpreted_hc()
hcr = importlib.import_module("depthbench.kernels.triton_hc_read")    # mHC's fused read, on hc's kernels
hcro = importlib.import_module("depthbench.kernels.triton_hc_read_ops")   # ... as ops, launching hcr's kernels


def rel_err(a, b):
    """max |a - b| over max |b| (b's scale at least 1e-6: a gradient that is numerically zero compares absolutely)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6)).item()


def both_ways(fn_ref, fn_new, inputs, seed=0):
    """Each body's outputs on copies of `inputs` (leaves), and every input's gradient from the same random upstream
    gradients: (reference outputs, new outputs, reference grads, new grads)."""
    results = []
    for fn in (fn_ref, fn_new):
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g = torch.Generator().manual_seed(seed)
        ups = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, [x for x in leaves if x.requires_grad], ups)
        results.append(([o.detach() for o in outs], list(grads)))
    (out_ref, grad_ref), (out_new, grad_new) = results
    return out_ref, out_new, grad_ref, grad_new


def assert_equal_bodies(fn_ref, fn_new, inputs, dtype):
    """fp32: every output and gradient within 1e-5 of the reference's (relative to its largest entry); bf16:
    cosine >= 0.999 each (the reference returns fp32 there, the Triton streams stay bf16:
    test_streams_keep_their_dtype_and_coefficients_are_fp32)."""
    out_ref, out_new, grad_ref, grad_new = both_ways(fn_ref, fn_new, [x.to(dtype) for x in inputs])
    assert [g.dtype for g in grad_new] == [g.dtype for g in grad_ref]
    for what, a, b in [("output", a, b) for a, b in zip(out_new, out_ref)] + \
                      [("gradient", a, b) for a, b in zip(grad_new, grad_ref)]:
        assert a.shape == b.shape, what
        if dtype == torch.float32:
            assert rel_err(a, b) <= 1e-5, (what, rel_err(a, b))
        else:
            assert cosine(a, b) >= 0.999, (what, cosine(a, b))


def randn(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


DTYPES = [torch.float32, torch.bfloat16]


# ----------------------------------------------------------------------------- each kernel against ops.py's body

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("design,n", [("mhc", 4), ("mhc", 3), ("hc", 4)])
def test_normed_projection_equals_reference(design, n, dtype):
    """(x / rms(x)) @ W: mHC's (the n streams flattened, K = nD, M = n^2 + 2n) and HC's (per stream, M = n + 2);
    3 x 13 tokens (row blocks of 16, the last partial), K not a multiple of the K block."""
    D = 24
    H = randn(3, 13, n, D, seed=1)
    x, K, M = (H.flatten(2), n * D, n * n + 2 * n) if design == "mhc" else (H, D, n + 2)
    W = randn(K, M, seed=2, scale=0.1)
    eps = 1e-6 if design == "mhc" else 1e-8
    assert_equal_bodies(lambda a, b: ops.normed_projection(a, b, eps), lambda a, b: hc.normed_projection(a, b, eps),
                        [x, W], dtype)


def tf32(t):
    """t (fp32) cut to tf32's 10 mantissa bits (truncated, the worse of truncation and rounding)."""
    return (t.detach().contiguous().view(torch.int32) & -(1 << 13)).view(torch.float32)


@pytest.mark.parametrize("design,n", [("mhc", 4), ("hc", 4)])
def test_the_projection_in_tf32_meets_the_bf16_bound(design, n):
    """On bf16 streams the kernels' projection runs in tf32 (triton_hc._dot: x @ W forward, g @ W^T backward, on
    tensor cores), which the interpreter runs in fp32: its error emulated on the CPU, ops.normed_projection at d640
    with W and the upstream gradient cut to tf32 (x, bf16, is exact in tf32) is within 2^-9 (bf16's own rounding)
    of the largest entry of the fp32 result, output and dx, and at cosine >= 0.99999 (the bf16 tests ask 0.999)."""
    D = 640
    H = randn(4, 16, n, D, seed=3).bfloat16().float()
    x, K, M = (H.flatten(2), n * D, n * n + 2 * n) if design == "mhc" else (H, D, n + 2)
    W = randn(K, M, seed=4, scale=K ** -0.5)
    up = randn(*x.shape[:-1], M, seed=5)
    results = []
    for cut in (False, True):
        leaf = x.clone().requires_grad_()
        out = ops.normed_projection(leaf, tf32(W) if cut else W, 1e-6)
        if cut:
            out.register_hook(tf32)                      # the backward's g @ W^T reads g in tf32
        results.append((out.detach(), torch.autograd.grad(out, leaf, up)[0]))
    for a, b in zip(results[1], results[0]):
        assert (a - b).abs().max() <= 2 ** -9 * b.abs().max() and cosine(a, b) >= 0.99999, cosine(a, b)
    assert not torch.equal(results[1][0], results[0][0])         # the cut changed something


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,iters", [pytest.param(4, 20, marks=pytest.mark.slow), (3, 20), (4, 1)])
def test_sinkhorn_equals_reference(n, iters, dtype):
    """Sinkhorn's 2 iters - 1 normalisations and its backward through all of them (recomputed from the logits), on 71
    tokens (three blocks of 32, the last partial), logits from near-uniform to peaked (scale 4), gap-8-like ones (the
    init's -8 off the diagonal) among them."""
    logits = randn(1, 71, n, n, seed=3, scale=4.0)
    logits[0, :5] += -8.0 * (1 - torch.eye(n))
    assert_equal_bodies(lambda a: ops.sinkhorn(a, iters), lambda a: hc.sinkhorn(a, iters), [logits], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [4, 3])
def test_width_connection_equals_reference(n, dtype):
    """branch = sum_s pre[s] h_s, mixed_o = sum_s res[o, s] h_s and their gradients (dH, dpre, dres), 2 x 5 tokens,
    D = 130 (a full block of 128 and a partial one); res not symmetric, so a transposed mix would differ."""
    H, pre, res = randn(2, 5, n, 130, seed=4), randn(2, 5, n, seed=5), randn(2, 5, n, n, seed=6)
    assert_equal_bodies(ops.width_connection, hc.width_connection, [H, pre, res], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [4, 3])
def test_depth_connection_equals_reference(n, dtype):
    """h'_o = mixed_o + post[o] y and its gradients (dmixed, dpost, dy), 2 x 5 tokens, D = 130."""
    mixed, post, y = randn(2, 5, n, 130, seed=7), randn(2, 5, n, seed=8), randn(2, 5, 130, seed=9)
    assert_equal_bodies(ops.depth_connection, hc.depth_connection, [mixed, post, y], dtype)


def test_streams_keep_their_dtype_and_coefficients_are_fp32():
    """The residual streams come out in the dtype they came in (bf16 streams stay bf16: half the bytes); the
    coefficients (projection, Sinkhorn) are fp32 whatever their input."""
    H = randn(1, 3, 4, 16, seed=10).bfloat16()
    branch, mixed = hc.width_connection(H, randn(1, 3, 4).bfloat16(), randn(1, 3, 4, 4).bfloat16())
    out = hc.depth_connection(mixed, randn(1, 3, 4), randn(1, 3, 16).bfloat16())
    assert (branch.dtype, mixed.dtype, out.dtype) == (torch.bfloat16,) * 3
    assert hc.normed_projection(H.flatten(2), randn(64, 24), 1e-6).dtype == torch.float32
    assert hc.sinkhorn(randn(1, 3, 4, 4).bfloat16()).dtype == torch.float32


# ----------------------------------------------------------------------------- a whole model

def with_triton_bodies(model):
    """The model's residual design calling depthbench/kernels/triton_hc.py's bodies for hc.NAMES, triton_hc_read.py's
    hc_read (mHC's fused read) and its own namespace's for the rest: a copy of its ops.Kernels with those attributes replaced (what an ops.namespace("triton") will
    hold)."""
    bodies = copy.copy(model.res.ops)
    bodies.name = f"{bodies.name}+triton-hc"
    for name in hc.NAMES:
        setattr(bodies, name, getattr(hc, name))
    bodies.hc_read = hcro.hc_read
    model.res.ops = bodies
    return model


def tiny_model(residual, d_model=16, **options):
    """L1 d16 by default (4 heads; two sublayers, so two connections in a row), vocab 32, every parameter moved off its init
    (zero-initialised maps would hide a wrong gradient), on ops.py's reference bodies."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, n_layer=1, d_model=d_model, n_head=4, d_ff=40, residual=residual,
                          residual_args=options, kernels="reference"))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("residual,options", [("hc", {}), pytest.param("hc", {"forward": "unmixed", "collapse":
                                                                                "norm_each"}, marks=pytest.mark.slow),
                                              ("mhc", {}), pytest.param("mhc", {"init": "uniform", "n_streams": 3},
                                                                        marks=pytest.mark.slow)],
                         ids=["hc", "hc-unmixed", "mhc", "mhc-uniform-n3"])
def test_model_with_triton_bodies(residual, options):
    """A tiny GPT (L1, fp32, B2 T7) with the Triton bodies gives kernels "reference"'s loss (to 1e-5 relative), and
    every parameter's gradient within test_all.py's tolerance for the fast bodies: 1e-4 relative, plus 1e-5 of that
    gradient's largest entry or 1e-6 of the largest gradient anywhere (a gradient that is ~0 by cancellation, as a
    saturated gate's, agrees to rounding, not in ratio)."""
    idx = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(4))
    ref, new = tiny_model(residual, **options), with_triton_bodies(tiny_model(residual, **options))
    assert new.res.ops.sinkhorn is hc.sinkhorn and ref.res.ops.sinkhorn is ops.sinkhorn
    losses = []
    for model in (ref, new):
        _, loss = model(idx, targets)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0])
    top = max(p.grad.abs().max().item() for p in ref.parameters())
    for (name, p), q in zip(ref.named_parameters(), new.parameters()):
        atol = max(1e-5 * p.grad.abs().max().item(), 1e-6 * top)
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=atol, msg=name)


def test_streams_are_bf16_under_bf16_autocast():
    """Under bf16 autocast the write stores the streams in bf16 (the GPU path's "bf16 in and out"), whatever the
    dtype of the mixed streams it adds to (the model's first write gets them in fp32); without autocast they keep
    theirs. The gradient it hands back is in the dtype of its input."""
    mixed, post, y = randn(1, 3, 4, 16).requires_grad_(), randn(1, 3, 4), randn(1, 3, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hc.depth_connection(mixed, post, y)
    assert out.dtype == torch.bfloat16 and hc.depth_connection(mixed, post, y).dtype == torch.float32
    out.float().sum().backward()
    assert mixed.grad.dtype == torch.float32
    want = ops.depth_connection(mixed.detach(), post, y)             # fp32: the kernel's sum, rounded once to bf16
    torch.testing.assert_close(out.detach().float(), want, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_model_under_bf16_autocast_is_the_reference_to_bf16(residual):
    """The GPU's precision on the CPU: under bf16 autocast (the Triton path's streams in bf16 after the first write,
    fp32 inside the kernels) the tiny GPT's loss is kernels "reference"'s (fp32 streams) under the same autocast to
    2e-2, every gradient within 10% of its norm (test_all.py's bf16 bounds) and at cosine >= 0.999 (but a gradient
    that is ~0, a saturated gate's)."""
    idx = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    out = {}
    for name, model in (("triton", with_triton_bodies(tiny_model(residual))), ("reference", tiny_model(residual))):
        out[name] = loss_and_grads(model, idx, bf16=True)
    assert_step_equal_to_bf16(out["triton"], out["reference"])
    (_, g1), (_, g2) = out["triton"], out["reference"]
    for n, g in g2.items():
        assert g.norm() <= 1e-6 or cosine(g1[n], g) >= 0.999, (n, cosine(g1[n], g))   # ~0: a saturated gate's


@pytest.mark.parametrize("bf16_tile", [False, True])
def test_hc_weight_gradient_tile_under_bf16_autocast_either_way(bf16_tile, monkeypatch):
    """`_hc_bwd`'s dW tile in either form (`dw_bf16`: bf16 operands under the GPU image's Triton 3.6, tf32 under 3.9;
    each version runs only one of them by itself): HC's tiny GPT under bf16 autocast against the reference, every
    gradient at cosine >= 0.999 (but a ~0 one) and within 10% of its norm."""
    monkeypatch.setattr(hcr, "dw_bf16", lambda x: bf16_tile and x.dtype != torch.float32)
    idx = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    got = loss_and_grads(with_triton_bodies(tiny_model("hc")), idx, bf16=True)
    want = loss_and_grads(tiny_model("hc"), idx, bf16=True)
    assert_step_equal_to_bf16(got, want)
    for n, g in want[1].items():
        assert g.norm() <= 1e-6 or cosine(got[1][n], g) >= 0.999, (n, cosine(got[1][n], g))


# ----------------------------------------------------------------------------- the fused read (triton_hc_read.py)

def read_both_ways(model, H, dtype, seed=0, used=(0, 1, 2, 3, 4)):
    """ops.hc_read (ops.py's bodies) and triton_hc_read.hc_read on the same design, site 1 and streams H in dtype:
    [(outputs, gradients of H and the connector's parameters)] for each, from the same random upstream gradients of
    the outputs `used` (h, H_pre, H_post, H_res, mixed: all; a model uses h, H_post and mixed alone)."""
    res, site = model.res, model.res.site(1)
    results = []
    for read in (ops.hc_read, hcro.hc_read):
        leaf = H.to(dtype).requires_grad_()
        params = list(site.conn.parameters()) + [site.norm.weight]
        outs = read(res, leaf, site)
        g = torch.Generator().manual_seed(seed)
        live = [o for i, o in enumerate(outs) if o.requires_grad and i in used]  # HC's unmixed H_res has none
        ups = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in live]
        results.append(([o.detach() for o in outs], torch.autograd.grad(live, [leaf] + params, ups)))
    return results


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("design,n,options", [pytest.param("mhc", 4, {"init": "uniform"}, marks=pytest.mark.slow),
                                              ("mhc", 3, {}), pytest.param("mhc", 4, {}, marks=pytest.mark.slow),
                                              ("hc", 4, {}), pytest.param("hc", 3, {}, marks=pytest.mark.slow)])
def test_hc_read_equals_reference(design, n, options, dtype):
    """mHC's and HC's fused reads (MHCRead, HCRead: the projection with the maps (and Sinkhorn) in one kernel, the
    width connection with the branch's norm in another, their backwards, the projection's with dH added in) against
    ops.hc_read with ops.py's bodies (under its checkpoint): h, H_pre, H_post, H_res, mixed and the gradients of H,
    every connector parameter (mHC: phi, b, the alphas; HC: the static and dynamic maps, the scales) and the norm's
    gain, on 3 x 13 tokens (a partial block), D = 24, n = 4 and 3 (padded; HC's row blocks then straddle tokens);
    fp32 to 1e-5 (a gradient summed over the tokens with cancellation, to 1e-6 of the largest gradient:
    test_model_with_triton_bodies' bound), bf16 streams to cosine >= 0.999."""
    model = tiny_model(design, d_model=24, n_streams=n, **options)
    assert hcr.fused(model.res, torch.zeros(1), model.res.site(1))
    H = randn(3, 13, n, 24, seed=19)
    (out_ref, grad_ref), (out_new, grad_new) = read_both_ways(model, H, dtype)
    top = max(g.abs().max().item() for g in grad_ref)
    for what, a, b in [("output", a, b) for a, b in zip(out_new, out_ref)] + \
                      [("gradient", a, b) for a, b in zip(grad_new, grad_ref)]:
        assert a.shape == b.shape and a.dtype == b.dtype or what == "output", what
        if dtype == torch.float32:       # or, a sum with cancellation (alpha_res' at gap-8), to 1e-6 of the largest
            assert rel_err(a, b) <= 1e-5 or (a - b).abs().max() <= 1e-6 * top, (what, rel_err(a, b))
        else:
            assert cosine(a, b) >= 0.999, (what, cosine(a, b))


class Poisoned:
    """torch, but empty and empty_like give tensors filled with NaN (floating dtypes) instead of whatever memory
    held."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kwargs):
        return torch.empty(*size, **kwargs).fill_(float("nan"))

    @staticmethod
    def empty_like(t, **kwargs):
        return torch.empty_like(t, **kwargs).fill_(float("nan"))


@pytest.mark.parametrize("design,n,kernels", [("mhc", 4, ["_mhc_fwd"]),
                                               pytest.param("mhc", 3, ["_mhc_fwd"], marks=pytest.mark.slow),
                                               ("hc", 4, ["_hc_fwd"]),
                                               pytest.param("hc", 3, ["_hc_read_fwd", "_width_norm_fwd"],
                                                            marks=pytest.mark.slow)])
def test_read_forward_in_one_launch_equals_two(design, n, kernels, monkeypatch):
    """The read's forward in one launch (_mhc_fwd, _hc_fwd: the maps, then each token's width connection and branch
    norm) gives exactly what the two kernels give (the same maths in the same order: every output bitwise equal),
    on 39 tokens (a partial block), D = 80 (two tiles of 64), bf16 streams; HC with n = 3, whose 16-row blocks
    straddle tokens, keeps the two; the outputs' buffers NaN-filled so that nothing unwritten is read; the branch
    norm's eps made large, so that the maps' eps in its place shows."""
    model = tiny_model(design, d_model=80, n_streams=n)
    H, site = randn(3, 13, n, 80, seed=29).bfloat16(), model.res.site(1)
    site.norm.eps = 0.25                                     # the branch norm's eps, unlike the maps' (1e-6, 1e-8)
    runs, launched = {}, []
    for name in ("_mhc_fwd", "_hc_fwd", "_mhc_read_fwd", "_hc_read_fwd", "_width_norm_fwd"):
        launch = type("Launch", (), {"__getitem__": lambda self, grid, k=getattr(hcr, name), nm=name:
                                     (launched.append(nm), k[grid])[1]})()
        for module in (hcr, hcro):                         # the ops' module launches the kernels it imported
            if hasattr(module, name):
                monkeypatch.setattr(module, name, launch)
    for one in (True, False):
        monkeypatch.setattr(hcr, "ONE_LAUNCH_FORWARD", one)
        with monkeypatch.context() as patch:
            patch.setattr(hcr, "torch", Poisoned())
            patch.setattr(hcro, "torch", Poisoned())
            runs[one] = ([o.detach() for o in hcro.hc_read(model.res, H, site)], list(launched))
        launched.clear()
    assert runs[True][1] == kernels and runs[False][1] == [f"_{design}_read_fwd", "_width_norm_fwd"]
    assert all(torch.equal(a, b) and not a.isnan().any() for a, b in zip(runs[True][0], runs[False][0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,D", [(4, 80), pytest.param(3, 24, marks=pytest.mark.slow)])  # slow: the padded streams
@pytest.mark.parametrize("design,kernel", [("mhc", "_mhc_bwd"), ("hc", "_hc_bwd")])
def test_read_backward_in_one_launch_equals_reference(design, kernel, n, D, dtype, monkeypatch):
    """Where H_pre and H_res feed nothing but the read (a model's case: upstream gradients of h, H_post and mixed
    alone), mHC's and HC's read backward is one kernel, _mhc_bwd / _hc_bwd (the width connection and the branch
    norm per token, the maps (and Sinkhorn), then dH by tiles of channels with the projection's share), equal to
    ops.hc_read's: the gradients of H, every connector parameter and the norm's gain, fp32 to
    test_hc_read_equals_reference's bounds, bf16 to cosine >= 0.999; on 39 tokens (a partial block of 16),
    D = 80 (two tiles of 64 channels, the second partial) and 24 with n = 3 (padded streams; HC's 48 rows a block
    in a tile of 64), the buffers the backward allocates filled with NaN (so no program reads what another, or
    none, writes: the interpreter runs the programs one after another)."""
    launches = []
    body = getattr(hcr, kernel)
    monkeypatch.setattr(hcr, kernel, type("Launch", (), {"__getitem__": lambda self, grid: (
        launches.append(grid), body[grid])[1]})())
    monkeypatch.setattr(hcr, "torch", Poisoned())          # a read of memory no program wrote gives NaN
    model = tiny_model(design, d_model=D, n_streams=n)
    (_, grad_ref), (_, grad_new) = read_both_ways(model, randn(3, 13, n, D, seed=23), dtype, used=(0, 2, 4))
    assert launches == [(3,)]
    top = max(g.abs().max().item() for g in grad_ref)
    for a, b in zip(grad_new, grad_ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        if dtype == torch.float32:
            assert rel_err(a, b) <= 1e-5 or (a - b).abs().max() <= 1e-6 * top, rel_err(a, b)
        else:
            assert cosine(a, b) >= 0.999, cosine(a, b)


def test_hc_read_is_the_composition_for_other_designs(monkeypatch):
    """HC with H_res = I (forward "unmixed") and an mHC subclass (whose maps could differ) go through ops.hc_read, on
    the design's own bodies; so does mHC on a tensor the kernels cannot run on."""
    hc_model, mhc_model = tiny_model("hc", forward="unmixed"), tiny_model("mhc")
    site = mhc_model.res.site(1)
    assert not hcr.fused(hc_model.res, torch.zeros(1), site) and hcr.fused(tiny_model("hc").res, torch.zeros(1), site)
    monkeypatch.setattr(hc, "interpreted", lambda: False)
    assert not hcr.fused(mhc_model.res, torch.zeros(1), site)
    monkeypatch.undo()
    sub = type("MHCVariant", (type(mhc_model.res),), {})
    assert not hcr.fused(sub.__new__(sub), torch.zeros(1), site)
    H = randn(1, 3, 4, 16, seed=20)
    (out_ref, _), (out_new, _) = read_both_ways(hc_model, H, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(out_new, out_ref))


@pytest.mark.parametrize("design,floats", [("mhc", 66), ("hc", 49)])
def test_fused_read_keeps_the_streams_and_a_few_floats(design, floats):
    """The fused read runs without ops.hc_read's checkpoint, yet autograd keeps, beyond the streams (its input) and
    parameter-sized tensors, `floats` fp32 per token and sublayer (triton_hc_read.py's docstring: mHC 66, HC 49 at
    n = 4), measured as the difference between 32 and 16 tokens of what its saved-tensor hook sees (each storage
    once: the read's Function and maps_gradient's save the same tensors)."""
    model = with_triton_bodies(tiny_model(design, d_model=32))
    site, kept = model.res.site(1), {}
    for N in (16, 32):
        H = randn(1, N, 4, 32, seed=21).requires_grad_()
        sizes = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() != H.untyped_storage().data_ptr():
                sizes[storage.data_ptr()] = storage.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.res.read(H, site)
        kept[N] = sum(sizes.values())
    assert kept[32] - kept[16] == 16 * 4 * floats


# ----------------------------------------------------------------------------- compiled for the GPU, without one

def compiled_module():
    """A second copy of depthbench/kernels/triton_hc.py whose kernels are decorated for the compiler (TRITON_INTERPRET
    unset while it loads), as on a GPU."""
    before = os.environ.pop("TRITON_INTERPRET", None)
    try:
        module = load_copy("hc_compiled")
    finally:
        if before is not None:
            os.environ["TRITON_INTERPRET"] = before
    return module


def compiled_read_module(compiled_hc):
    """A copy of depthbench/kernels/triton_hc_read.py built on `compiled_hc` (compiled_module's triton_hc: its
    kernels call that module's helpers), decorated for the compiler."""
    import depthbench.kernels as package
    name = "depthbench.kernels.triton_hc"
    saved, saved_attr = sys.modules[name], package.triton_hc
    before = os.environ.pop("TRITON_INTERPRET", None)
    sys.modules[name], package.triton_hc = compiled_hc, compiled_hc
    try:
        spec = importlib.util.spec_from_file_location("hc_read_compiled",
                                                      ROOT / "depthbench" / "kernels" / "triton_hc_read.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.modules[name], package.triton_hc = saved, saved_attr
        if before is not None:
            os.environ["TRITON_INTERPRET"] = before
    return module


def kernel_signatures(stream, module):
    """(kernel name, pointer and scalar types, constexprs) of every kernel (triton_hc_read.py's too), as the bodies
    launch them at n = 4 on streams of dtype `stream` ("fp32" or "bf16"; y and the logits in that dtype too, the
    coefficients fp32)."""
    s, f = "*" + stream, "*fp32"
    streams, projection = dict(n=4, NP=4, BD=module.BLOCK_D), dict(BN=module.BLOCK_ROWS, BK=module.BLOCK_K, MP=32)
    sinkhorn = dict(n=4, NP=4, BT=module.BLOCK_TOKENS)
    return [
        ("_proj_fwd", dict(X=s, W=f, Out=f, R=f, N="i32", K="i32", M="i32", eps="fp32"), projection),
        ("_proj_bwd", dict(X=s, W=f, G=f, Out=f, R=f, DX=s, Acc=s, N="i32", K="i32", M="i32"),
         dict(projection, HAS_ACC=True)),
        ("_sinkhorn_fwd", dict(L=s, Out=f, N="i32", iters="i32", eps="fp32"), sinkhorn),
        ("_sinkhorn_bwd", dict(L=s, G=f, DL=s, Scratch=f, N="i32", iters="i32", eps="fp32"), sinkhorn),
        ("_width_fwd", dict(H=s, Pre=f, Res=f, Branch=s, Mixed=s, D="i32"), streams),
        ("_width_bwd", dict(H=s, Pre=f, Res=f, DBranch=s, DMixed=s, DH=s, DPre=f, DRes=f, D="i32"), streams),
        ("_depth_fwd", dict(Mixed=s, Post=f, Y=s, Out=s, D="i32"), streams),
        ("_depth_bwd", dict(DOut=s, Post=f, Y=s, DPost=f, DY=s, D="i32"), streams),
        ("_mhc_read_fwd", dict(X=s, W=f, B=f, Ap=f, Aq=f, Ar=f, Pre=f, Post=f, Logits=f, Res=f, Mo=f, R=f, N="i32",
                               K="i32", M="i32", iters="i32", eps="fp32"), dict(n=4, NP=4, BN=module.BLOCK_ROWS,
                                                                                BK=module.BLOCK_K, MP=32)),
        ("_mhc_read_bwd", dict(Logits=f, DRes=f, DL=f, Scratch=f, Pre=f, Post=f, DPre=f, DPost=f, Mo=f, R=f, Ap=f,
                               Aq=f, Ar=f, G=f, RG=s, Part=f, N="i32", M="i32", iters="i32", eps="fp32"),
         dict(sinkhorn, MP=32)),
        ("_hc_read_fwd", dict(X=s, A=f, B=f, Sa=f, Sb=f, Asc=f, Bsc=f, Pre=f, Post=f, Res=f, Mo=f, R=f, NR="i32", K="i32",
                              M="i32", eps="fp32"), dict(n=4, BN=module.BLOCK_ROWS, BK=module.BLOCK_K, MP=16)),
        ("_hc_read_bwd", dict(DPre=f, DPost=f, DRes=f, Mo=f, R=f, Asc=f, Bsc=f, G=f, RG=s, Part=f, NR="i32",
                              M="i32"),
         dict(n=4, BN=module.BLOCK_ROWS, MP=16)),
        ("_width_norm_fwd", dict(H=s, Pre=f, Res=f, Wn=f, Out=s, Mixed=s, Rb=f, N="i32", D="i32", eps="fp32"),
         dict(n=4, NP=4, BD=1024, TPP=8)),                                                  # the card's d640, whole
        ("_width_norm_bwd", dict(H=s, Pre=f, Res=f, Wn=f, Rb=f, DOut=s, DMixed=s, DH=s, DPre=f, DRes=f, DWp=f,
                                 N="i32", D="i32"), dict(n=4, NP=4, BD=64, TPP=8)),                # tiles of 64
        ("_mhc_bwd", dict(H=s, W=f, Pre=f, Post=f, Res=f, Logits=f, Mo=f, R=f, Rb=f, Wn=f, DOut=s, DMixed=s, DPost=f,
                          DH=s, DPre=f, DRes=f, DL=f, Scratch=f, Cb=f, RG=s, Sums=f, Ap=f, Aq=f, Ar=f, N="i32",
                          D="i32", M="i32", iters="i32", eps="fp32"),
         dict(n=4, NP=4, BT=module.BLOCK_ROWS, BK=module.BLOCK_K, MP=32)),                         # the card's
        ("_mhc_fwd", dict(X=s, W=f, B=f, Ap=f, Aq=f, Ar=f, Pre=f, Post=f, Logits=f, Res=f, Mo=f, R=f, Wn=f, Out=s,
                          Mixed=s, Rb=f, N="i32", K="i32", M="i32", D="i32", iters="i32", eps="fp32",
                          eps_norm="fp32"),
         dict(n=4, NP=4, BN=module.BLOCK_ROWS, BK=module.BLOCK_K, MP=32, BD=1024)),
        ("_hc_fwd", dict(X=s, A=f, B=f, Sa=f, Sb=f, Asc=f, Bsc=f, Pre=f, Post=f, Res=f, Mo=f, R=f, Wn=f, Out=s, Mixed=s,
                         Rb=f, NR="i32", K="i32", M="i32", eps="fp32", eps_norm="fp32"),
         dict(n=4, NP=4, BN=module.BLOCK_ROWS, BK=module.BLOCK_K, MP=16, BD=1024)),
        *[("_hc_bwd", dict(H=s, A=f, B=f, Pre=f, Res=f, Mo=f, R=f, Rb=f, Wn=f, DOut=s, DMixed=s, DPost=f, DH=s,
                           DPre=f, DRes=f, G=f, Cb=f, Sums=f, Asc=f, Bsc=f, N="i32", D="i32", M="i32"),
           dict(n=4, NP=4, BT=module.BLOCK_ROWS, BR=4 * module.BLOCK_ROWS, BK=module.BLOCK_K, MP=16, DW_BF16=bf16))
          for bf16 in ((False, True) if s == "*bf16" else (False,))]]     # its dW tile's two forms (`dw_bf16`)


@pytest.mark.slow
@pytest.mark.parametrize("stream", ["fp32", "bf16"])
def test_every_kernel_compiles_for_the_h100_and_h200(stream):
    """Each kernel goes through Triton's CUDA compiler to PTX for sm_90 (H100, H200) with no GPU present: the
    interpreter above runs Python, so an op it accepts but the compiler rejects (a reduction over a padded axis, a
    dtype mix, tl.dot's shapes) shows here, not on the first GPU. Skipped where Triton has no CUDA backend."""
    import triton
    from triton.compiler import ASTSource
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401  (the backend must be installed)
    except ImportError as e:
        pytest.skip(f"triton without its CUDA backend: {e}")
    if type(triton.language.standard._sum_combine).__name__ == "InterpretedFunction":
        # triton itself was first imported under TRITON_INTERPRET=1 in this process (another test file set it), so
        # its library cannot compile: the same test in a fresh process without the flag
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                              f"compiles and {stream}"], cwd=ROOT, env=env, capture_output=True, text=True)
        assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
        return
    module = compiled_module()
    read_module = compiled_read_module(module)
    for name, types, constants in kernel_signatures(stream, module):
        kernel = getattr(module, name, None) or getattr(read_module, name)
        params = list(inspect.signature(kernel.fn).parameters)
        assert sorted(params) == sorted([*types, *constants]), name
        source = ASTSource(fn=kernel, signature={p: types.get(p, "constexpr") for p in params}, constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert ".target sm_90" in compiled.asm["ptx"], name
        for precision in re.findall(r"inputPrecision = (\w+)", compiled.asm["ttir"]):   # tf32 on bf16 streams
            assert precision == ("ieee" if stream == "fp32" else "tf32"), (name, precision)


# ----------------------------------------------------------------------------- traffic and the import guard

def test_traffic_counts_the_bytes_of_the_tensors_each_forward_touches():
    """traffic's forward bytes for width_connection and depth_connection equal the bytes of the tensors a real call
    reads and writes (fp32 streams, bf16 y); HC's projection reads the streams and W, as does its fused read; mHC's
    fused read reads the streams, phi and the logits it wrote (Sinkhorn's input); both then the streams again, the
    maps and the gain for the width connection, in the same launch (HC with n = 3: a second); neither runs a
    separate projection or Sinkhorn."""
    N, n, D = 6, 4, 16
    H, pre, res = randn(1, N, n, D), randn(1, N, n), randn(1, N, n, n)
    branch, mixed = hc.width_connection(H, pre, res)
    y = randn(1, N, D).bfloat16()
    rows = {(r["kernel"], r["pass"]): r for r in hc.traffic("hc", tokens=N, d_model=D, n=n, stream_bytes=4,
                                                                   y_bytes=2, fused=False)}
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert rows["width_connection", "forward"]["read"] == nbytes(H, pre, res)
    assert rows["width_connection", "forward"]["written"] == nbytes(branch, mixed)
    out = hc.depth_connection(mixed, pre, y)
    assert rows["depth_connection", "forward"]["read"] == nbytes(mixed, pre, y)
    assert rows["depth_connection", "forward"]["written"] == nbytes(out)
    assert rows["normed_projection", "forward"]["read"] == nbytes(H) + 4 * D * (n + 2)      # HC's W: (D, n + 2)
    width = nbytes(H, pre, res) + 4 * D         # the fused forward's second stage: the streams again, the maps, gain
    hc_fused = {(r["kernel"], r["pass"]): r for r in hc.traffic("hc", tokens=N, d_model=D, n=n, stream_bytes=4)}
    assert hc_fused["hc_fwd", "forward"]["read"] == nbytes(H) + 4 * D * (n + 2) + width
    three = {(r["kernel"], r["pass"]): r for r in hc.traffic("hc", tokens=N, d_model=D, n=3, stream_bytes=4)}
    H3 = H[:, :, :3]                             # n = 3 does not divide a program's 16 rows: two kernels
    assert three["hc_read", "forward"]["read"] == nbytes(H3) + 4 * D * 5
    assert three["width_norm", "forward"]["read"] == nbytes(H3, pre[..., :3], res[..., :3, :3]) + 4 * D
    fused = {(r["kernel"], r["pass"]): r for r in hc.traffic("mhc", tokens=N, d_model=D, n=n, stream_bytes=4)}
    logits = randn(1, N, n, n)
    assert fused["mhc_fwd", "forward"]["read"] == nbytes(H, logits) + 4 * n * D * (n * n + 2 * n) + width
    assert not {"sinkhorn", "normed_projection"} & {kernel for kernel, pass_ in {**fused, **hc_fused}
                                                    if pass_ == "forward"}


class Launches(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every torch op that launches a kernel ((name, shapes, bytes of its tensors in and out)) and every Triton kernel
    launched (its name), in `ops` and `kernels`; the interpreter's own torch calls inside a kernel are not ops."""
    FREE = {"empty", "empty_like", "empty_strided", "new_empty_strided", "view", "_unsafe_view", "t", "transpose",
            "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "unflatten",
            "permute", "reshape", "zeros_like", "new_zeros", "new_empty"}      # metadata or allocation: no launch

    def __init__(self):
        super().__init__()
        self.ops, self.kernels, self.inside = [], [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "depthbench":     # a Triton body as an op (graph_ops.py): record what runs inside it
            with self:
                return graph_ops.host_function(func)(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        free = name in self.FREE or name == "to" and out is args[0]      # a `.to` that is no copy: no launch
        if not self.inside and not free:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.ops.append((name, [tuple(t.shape) for t in tensors],
                             sum(t.numel() * t.element_size() for t in tensors)))
        return out

    def launcher(self, name, launch):
        def run(*args, **kwargs):
            self.kernels.append(name)
            self.inside = True
            try:
                return launch(*args, **kwargs)
            finally:
                self.inside = False
        return run


def path_launches(design, N, recompute, monkeypatch, n=4, D=32, dtype=torch.float32, fused=True):
    """One sublayer's read and write of a tiny `design` model with the Triton bodies (fused: the read through
    triton_hc_read.py, else ops.hc_read on triton_hc.py's pieces), forward and backward on N tokens, streams of
    `dtype` (bf16: under bf16 autocast, as on the GPU path): {pass: (torch ops as (name, shapes, bytes), Triton kernel
    names in launch order)}."""
    model = with_triton_bodies(tiny_model(design, d_model=D, recompute=recompute, n_streams=n))
    if not fused:
        model.res.ops.hc_read = ops.hc_read
    res, site, H = model.res, model.res.site(1), randn(1, N, n, D, seed=17).to(dtype).requires_grad_()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    rec, seen = Launches(), {}
    with monkeypatch.context() as patch:
        patch.setattr(hc, "interpreted", lambda: True)        # it looks at a kernel's type, wrapped below
        for name in KERNEL_OF.values():
            module = hcr if name.startswith(("_mhc_", "_hc_", "_width_norm")) else hc
            launch = type("Launch", (), {"__getitem__": lambda self, grid, k=getattr(module, name),
                                         nm=name: rec.launcher(nm, k[grid])})()
            for where in [module] + [hcro] * hasattr(hcro, name):    # the ops' module launches what it imported
                patch.setattr(where, name, launch)
        with rec, autocast:
            h, ctx = res.read(H, site)
            out = res.write(H, site, h, ctx)                         # the branch output y = h: no sublayer between
        seen["forward"] = (rec.ops, rec.kernels)
        rec.ops, rec.kernels = [], []
        g = randn(*out.shape, seed=18).to(out.dtype)
        with rec, autocast:
            out.backward(g)
        seen["backward"] = (rec.ops, rec.kernels)
    return seen


KERNEL_OF = {("normed_projection", "forward"): "_proj_fwd", ("normed_projection", "backward"): "_proj_bwd",
             ("sinkhorn", "forward"): "_sinkhorn_fwd", ("sinkhorn", "backward"): "_sinkhorn_bwd",
             ("width_connection", "forward"): "_width_fwd", ("width_connection", "backward"): "_width_bwd",
             ("depth_connection", "forward"): "_depth_fwd", ("depth_connection", "backward"): "_depth_bwd",
             ("mhc_read", "forward"): "_mhc_read_fwd", ("mhc_read", "backward"): "_mhc_read_bwd",
             ("mhc_bwd", "backward"): "_mhc_bwd", ("hc_bwd", "backward"): "_hc_bwd",
             ("mhc_fwd", "forward"): "_mhc_fwd", ("hc_fwd", "forward"): "_hc_fwd",
             ("hc_read", "forward"): "_hc_read_fwd", ("hc_read", "backward"): "_hc_read_bwd",
             ("width_norm", "forward"): "_width_norm_fwd", ("width_norm", "backward"): "_width_norm_bwd"}


def is_norm(name, shapes, N, D):
    """An op of the branch's RMSNorm (Pre-LN has it too): not a copy (dynamic_beta's gradient, (D,), is one), every
    tensor (1, N, D), (1, N, 1), (D,), (1, 1, D) or 0-dim."""
    return name != "copy_" and all(s in {(1, N, D), (1, N, 1), (D,), (1, 1, D), ()} for s in shapes)


@pytest.mark.parametrize("transposed", [False, True], ids=["dW", "dW^T"])
def test_weight_gradient_on_the_gpu_is_one_fp32_gemm(transposed, monkeypatch):
    """The fused read's dW where torch.mm writes fp32 from bf16 (CUDA; here the meta device stands in for it): one
    launch, aten mm's out_dtype overload, fp32 out in dW's (or dW^T's) shape, as traffic(gemm_fp32_out=True)
    counts it; on the CPU, the product in bf16 and a cast, the same numbers to bf16's rounding of dW."""
    rows, K, M = 12, 8, 6
    monkeypatch.setattr(hcr, "GEMM_FP32_OUT", {"meta"})
    x, rg = torch.empty(rows, K, device="meta", dtype=torch.bfloat16), torch.empty(rows, M, device="meta",
                                                                                    dtype=torch.bfloat16)
    with Launches() as rec:
        dW = hcr.weight_gradient(x, rg, torch.empty(K, M), transposed=transposed)
    assert [name for name, _, _ in rec.ops] == ["mm"] and dW.dtype == torch.float32
    assert dW.shape == ((M, K) if transposed else (K, M))
    x, rg = randn(rows, K, seed=3).bfloat16(), randn(rows, M, seed=4).bfloat16()
    exact = x.float().t() @ rg.float()
    got = hcr.weight_gradient(x, rg, torch.empty(K, M), transposed=transposed)
    torch.testing.assert_close(got.t() if transposed else got, exact, rtol=2 ** -7, atol=1e-6)
    assert got.dtype == torch.float32 and got.is_contiguous()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16],
                         ids=["fp32", "bf16"])                                     # bf16: the GPU path's streams
@pytest.mark.parametrize("design,fused", [("hc", True), ("mhc", True), pytest.param("hc", False, marks=pytest.mark.slow),
                                          pytest.param("mhc", False, marks=pytest.mark.slow)],
                         ids=["hc", "mhc", "hc-pieces", "mhc-pieces"])
def test_traffic_counts_every_launch(design, fused, dtype, monkeypatch):
    """traffic's rows are the launches one sublayer really makes with these bodies, fp32 streams, and bf16 ones
    under bf16 autocast (the GPU path: stream_bytes 2, the dW and norm casts), through the fused read and through
    the pieces (fused=False: the numbers before it): the Triton kernels by name, and the torch ops between them (the
    maps' glue, dW, the sums of per-block gradients, autograd's add of the two dH, and the pieces' recompute under
    ops.hc_read's checkpoint: the forward kernels, glue and the branch's RMSNorm again; the fused read recomputes
    nothing), launch for launch, and their bytes per token (measured at 8 and 16 tokens: the difference). Only the
    branch norm's forward and backward on the pieces' path, Pre-LN's too, are left out."""
    n, D = 4, 32
    runs = {(N, rc): path_launches(design, N, rc, monkeypatch, n, D, dtype, fused) for N in (8, 16)
            for rc in (False, True)}
    sb = torch.finfo(dtype).bits // 8

    def kernel_of(r):
        return KERNEL_OF.get((r["kernel"], "forward" if "recompute" in r["pass"] else r["pass"]))

    def measured(N, rc, pass_, with_norm=False):
        """(torch launches, their bytes) of a pass; on the pieces' path the branch norm's left out unless with_norm."""
        ops_ = [b for name, shapes, b in runs[N, rc][pass_][0]
                if fused or with_norm or not is_norm(name, shapes, N, D)]          # the fused read has no torch norm
        return len(ops_), sum(ops_)

    def counted(N, rc, passes):
        """(torch launches, their bytes) of traffic's rows of those passes: every row that is not a Triton kernel."""
        kept = [r for r in hc.traffic(design, N, D, n=n, stream_bytes=sb, recompute=rc, fused=fused,
                                      gemm_fp32_out=False) if r["pass"] in passes and not kernel_of(r)]
        return sum(r["launches"] for r in kept), sum(r["read"] + r["written"] for r in kept)

    for rc in (False, True):
        rows = hc.traffic(design, 8, D, n=n, stream_bytes=sb, recompute=rc, fused=fused, gemm_fp32_out=False)
        assert runs[8, rc]["forward"][1] == [kernel_of(r) for r in rows if r["pass"] == "forward" and kernel_of(r)]
        assert sorted(runs[8, rc]["backward"][1]) == sorted(kernel_of(r) for r in rows
                                                             if r["pass"] != "forward" and kernel_of(r))
    for pass_ in ("forward", "backward"):
        assert measured(8, False, pass_)[0] == counted(8, False, {pass_})[0], pass_
        per_token = measured(16, False, pass_)[1] - measured(8, False, pass_)[1]
        assert per_token == counted(16, False, {pass_})[1] - counted(8, False, {pass_})[1], pass_
    # the recompute: what the backward launches with it beyond what it launches without (the norm's too)
    extra = {N: [a - b for a, b in zip(measured(N, True, "backward", True), measured(N, False, "backward", True))]
             for N in (8, 16)}
    again = {N: counted(N, True, {"backward (recompute)"}) for N in (8, 16)}
    assert extra[8][0] == again[8][0] and extra[16][1] - extra[8][1] == again[16][1] - again[8][1]


def load_copy(name):
    """A fresh copy of depthbench/kernels/triton_hc.py as module `name`, decorated as the environment says now."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "depthbench" / "kernels" / "triton_hc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def connection_calls(module):
    """Every body of `module` on the same CPU inputs: {name: its outputs}."""
    H, pre, res, y = randn(1, 3, 4, 8, seed=12), randn(1, 3, 4, seed=13), randn(1, 3, 4, 4, seed=14), randn(1, 3, 8)
    return {"normed_projection": module.normed_projection(H.flatten(2), randn(32, 24, seed=15), 1e-6),
            "sinkhorn": module.sinkhorn(randn(1, 3, 4, 4, seed=16)),
            "width_connection": module.width_connection(H, pre, res),
            "depth_connection": module.depth_connection(H, pre, y)}


def test_off_the_gpu_each_body_is_kernels_py(monkeypatch):
    """Where the kernels cannot run, each body is depthbench/kernels/cpu.py's, bit for bit: with triton absent (the
    module still imports), and with triton compiled for the GPU on CPU tensors (no interpreter). So the CPU path
    does not change when the namespace holds these bodies."""
    from depthbench.kernels import cpu as kernels
    expected = connection_calls(kernels)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name, absent in (("hc_compiled_on_cpu", False), ("hc_without_triton", True)):
        if absent:
            monkeypatch.setitem(sys.modules, "triton", None)      # `import triton` raises ImportError
            monkeypatch.setitem(sys.modules, "triton.language", None)
        module = load_copy(name)
        assert module.HAVE_TRITON is not absent and not module.runs_here(torch.zeros(1))
        for body, out in connection_calls(module).items():
            for a, b in zip(out if isinstance(out, tuple) else (out,), expected[body]
                            if isinstance(expected[body], tuple) else (expected[body],)):
                assert torch.equal(a, b), (name, body)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_compare_with_reference_reports_agreement_and_finds_a_wrong_body(dtype, monkeypatch):
    """The GPU script's check (hc.compare_with_reference) run here on CPU tensors: every body within fp32's 1e-5 or
    bf16's cosine 0.999; and a body that mixes the transposed res is reported, not passed."""
    report = hc.compare_with_reference(device="cpu", dtype=dtype, shape=(1, 3, 4, 20))
    assert sorted(report) == sorted(hc.NAMES)
    for name, (rel, cos) in report.items():
        assert (rel <= 1e-5) if dtype == torch.float32 else (cos >= 0.999), (name, rel, cos)
    wrong = hc.width_connection
    monkeypatch.setattr(hc, "width_connection", lambda H, pre, res: wrong(H, pre, res.transpose(-1, -2)))
    rel, cos = hc.compare_with_reference(device="cpu", dtype=dtype, shape=(1, 3, 4, 20))["width_connection"]
    assert rel > 1e-2 and cos < 0.999


@pytest.mark.parametrize("argv,words", [(["--designs", "preln"], "--designs: preln"), (["--tokens", "0"], "--tokens"),
                                        (["--designs", ","], "none given")])
def test_kernel_bench_rejects_bad_arguments(argv, words, capsys):
    """scripts/kernel_bench.py: a design without these kernels, no tokens, no design: one line, exit 2, nothing run."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import kernel_bench
    with pytest.raises(SystemExit) as e:
        kernel_bench.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and words in err[-1] and "Traceback" not in "".join(err)


def kernel_bench_tiny(request, tmp_path):
    """scripts/kernel_bench.py --tiny's JSON, from a process that exited 0: where this session runs the tiny GPU
    smoke's test, the kernels.json of the smoke's kernels stage (that same command, its status "ok" only when it
    exited 0; conftest.py's tiny_smoke runs the smoke once for both), else a run of its own."""
    from conftest import runs_the_smoke
    if runs_the_smoke(request):
        _, smoke_out = request.getfixturevalue("tiny_smoke")
        summary = json.loads((smoke_out / "summary.json").read_text())
        (status,) = [c["status"] for c in summary["checks"] if c["check"] == "kernels"]
        assert status == "ok", (smoke_out / "smoke.log").read_text()[-4000:]
        return json.loads((smoke_out / "kernels.json").read_text())
    out = tmp_path / "k.json"
    run = subprocess.run([sys.executable, "scripts/kernel_bench.py", "--tiny", "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_kernel_bench_rehearses_every_pass(request, tmp_path):
    """scripts/kernel_bench.py --tiny (the interpreter, 39 tokens, d80): for HC and mHC, each pass launches the
    Triton kernels whose rows triton_hc.traffic counts for it (the estimate beside each time is of those launches),
    the read's backward is one kernel one way and three the other (its forward one and two), and the two backwards'
    gradients agree."""
    doc = kernel_bench_tiny(request, tmp_path)
    assert set(doc["designs"]) == {"hc", "mhc"} and doc["tokens"] == 39 and doc["d_model"] == 80
    for design, passes in doc["designs"].items():
        for name in ("read_forward", "read_backward", "depth_forward", "depth_backward"):
            row = passes[name]
            counted = [KERNEL_OF[(kernel, name.split("_")[1])] for kernel in row["model_rows"] if "torch" not in kernel]
            assert row["kernels"] == counted and row["launches"] >= len(counted) and row["bytes"] > 0, (design, name)
            assert row["eta"] is None                                 # no HBM peak for the CPU
        assert passes["read_backward"]["kernels"] == [f"_{design}_bwd"]
        assert passes["read_backward_three_kernels"]["kernels"] == ["_width_norm_bwd", f"_{design}_read_bwd",
                                                                      "_proj_bwd"]
        assert passes["read_forward_two_kernels"]["kernels"] == [f"_{design}_read_fwd", "_width_norm_fwd"]
        assert passes["paths_min_cosine"] >= 0.999 and passes["one_launch_over_three"] > 0
        assert passes["forward_one_launch_over_two"] > 0
