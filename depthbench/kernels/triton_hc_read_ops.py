"""
depthbench/kernels/triton_hc_read_ops.py: HC's and mHC's fused read (triton_hc_read.py's kernels) as torch.library
ops (graph_ops.py), so that a compiled block holds its read in its graph: `mhc_read_forward` / `hc_read_forward` (the
maps, the width connection and the branch's norm: one launch, or two) and their backward ops (one launch where H_pre
and H_res feed nothing else, a model's case; else three), joined by graph_ops.autograd_op (`mhc_read_call`,
`hc_read_call`: autograd Functions calling the ops while dynamo traces, the host functions in eager; while dynamo
traces, H_pre's and H_res' gradients go through a second Function, `maps_gradient`). What the
backward needs beyond the inputs (the logits, m, r, rb) leaves the forward op as outputs, so no Python state spans
the two. `hc_read` is ops.hc_read's body (BODIES). The file's 700 lines were full: the kernels and their launch helpers
stay in triton_hc_read.py.
"""
import torch

import ops
from depthbench.kernels import triton_hc as hc
from depthbench.kernels import triton_hc_read as hcr
from depthbench.kernels.graph_ops import autograd_function, autograd_op, call, graph_op
from depthbench.kernels.triton_hc import BLOCK_K, BLOCK_ROWS, BLOCK_TOKENS, pow2
from depthbench.kernels.triton_hc_read import (EPS, HC_EPS, _hc_fwd, _hc_read_bwd, _hc_read_fwd, _mhc_fwd,
                                               _mhc_read_bwd, _mhc_read_fwd, fused, hc_backward, mhc_backward,
                                               projection_backward, weight_gradient, width_backward, width_forward)


def outputs(branch, pre, post, res, mixed, shape):
    """The Functions' outputs in the streams' shape (..., n, D): branch (..., D), H_pre, H_post, H_res, mixed."""
    lead, (n, D) = shape[:-2], shape[-2:]
    return (branch.view(*lead, D), pre.view(*lead, n), post.view(*lead, n), res.view(*lead, n, n), mixed.view(shape))


def read_outputs(H, rows, M, logits=True):
    """The read ops' outputs, empty: h, H_pre, H_post, H_res, mixed (`outputs`), then (mHC) the logits (N, n, n), m
    (rows, M), r (rows,) and rb (N,) for the backward; all fp32 but h and mixed (H's dtype). The ops' fake bodies,
    and what the forward bodies' kernels write into: allocated in the outputs' shapes, so no views follow (host
    time: issue 68)."""
    (n, D), lead = H.shape[-2:], H.shape[:-2]
    N, f32 = H.numel() // (n * D), dict(dtype=torch.float32)
    coefficients = (H.new_empty(*lead, n, **f32), H.new_empty(*lead, n, **f32), H.new_empty(*lead, n, n, **f32))
    kept = (H.new_empty(rows, M, **f32), H.new_empty(rows, **f32), H.new_empty(N, **f32))
    first = (H.new_empty(N, n, n, **f32),) if logits else ()
    return (H.new_empty(*lead, D), *coefficients, H.new_empty(H.shape), *first, *kept)


READ_OUT = "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor" # h, pre, post, res, mixed, kept


@graph_op("mhc_read", f"(Tensor H, Tensor[] params, float eps, int iters) -> {READ_OUT}, Tensor)",
          lambda H, params, *_: read_outputs(H, H.numel() // params[0].size(0), params[0].size(1)))
def mhc_read_forward(H, params, eps, iters):
    """ops.hc_read for mHC: H (..., n, D), params = [phi (nD, M), b (M,), the three alphas (0-dim), the norm's gain],
    the norm's eps, Sinkhorn's iters -> (branch (..., D) and mixed (..., n, D) in H's dtype, H_pre, H_post (..., n),
    H_res (..., n, n) in fp32) and what the backward keeps: the logits, m, r and rb."""
    phi, b, a_pre, a_post, a_res, gain = params
    n = H.size(-2)
    K, M = phi.shape
    x = H.reshape(-1, K).contiguous()
    N = x.size(0)
    h, pre, post, res, mixed, logits, m, r, rb = read_outputs(H, N, M)       # in the outputs' shapes: no views after
    sizes = dict(n=n, NP=pow2(n), MP=pow2(M, 16))
    maps = dict(X=x, W=phi, B=b, Ap=a_pre, Aq=a_post, Ar=a_res, Pre=pre, Post=post, Logits=logits, Res=res, Mo=m,
                R=r, N=N, K=K, M=M, iters=iters, eps=EPS, BN=BLOCK_ROWS, BK=BLOCK_K, **sizes)
    if hcr.ONE_LAUNCH_FORWARD:                                  # the maps, then the width connection and the norm
        _mhc_fwd[(hc.triton.cdiv(N, BLOCK_ROWS),)](Wn=gain, Out=h, Mixed=mixed, Rb=rb, D=K // n, eps_norm=eps,
                                                   BD=pow2(K // n), **maps)
        return h, pre, post, res, mixed, logits, m, r, rb
    _mhc_read_fwd[(hc.triton.cdiv(N, BLOCK_ROWS),)](**maps)
    h, mixed, rb = width_forward(x, pre.view(N, n), res.view(N, n, n), (gain, eps))
    return (*outputs(h, pre, post, res, mixed=mixed, shape=H.shape), logits, m, r, rb)


@graph_op("mhc_read_bwd", "(Tensor H, Tensor[] params, Tensor[] kept, Tensor?[] grads, int iters) -> (Tensor, "
          "Tensor, Tensor)", lambda H, params, *_: (H.new_empty(H.shape), params[0].new_empty(params[0].shape),
                                                    H.new_empty(2 * pow2(params[0].size(1), 16) + H.size(-1))))
def mhc_read_backward(H, params, kept, grads, iters):
    """The gradients (dh, dpre, dpost, dres, dmixed: None where an output fed nothing) of mhc_read_forward's outputs,
    kept = [pre, post, res, logits, m, r, rb] -> (dH, dphi, the sums [b's M, padded to MP | a_pre, a_post, a_res,
    padded to MP | the gain's D]): one launch where H_pre and H_res feed nothing else (a model's case), else three."""
    (phi, b, a_pre, a_post, a_res, gain), (pre, post, res, logits, m, r, rb) = params, kept
    (_, dpre, dpost, dres, _), (K, M), n = grads, phi.shape, H.size(-2)
    x = H.reshape(-1, K).contiguous()
    N, MP = x.size(0), pow2(M, 16)
    sizes = dict(n=n, NP=pow2(n), MP=MP)
    pre, post, res = pre.reshape(N, n), post.reshape(N, n), res.reshape(N, n, n)
    if hcr.ONE_LAUNCH_BACKWARD and dpre is None and dres is None:   # H_pre, H_res feed nothing else: one launch
        saved = (x, phi, b, a_pre, a_post, a_res, pre, post, logits, res, m, r, gain, rb)
        dH, sums, rg = mhc_backward(x, saved, grads, iters=iters, sizes=sizes)
        return dH.view(H.shape), weight_gradient(x, rg, phi), sums
    dH, dpre, dpost, dres, dgain = width_backward(x, (pre, res, gain, rb), grads)
    blocks = hc.triton.cdiv(N, BLOCK_TOKENS)
    g, dl, rg = torch.empty_like(m), torch.empty_like(logits), torch.empty(m.shape, device=x.device, dtype=x.dtype)
    part = torch.empty(blocks, 2 * MP, device=x.device, dtype=torch.float32)
    scratch = torch.empty(N, 2 * iters - 1, sizes["NP"], device=x.device, dtype=torch.float32)
    _mhc_read_bwd[(blocks,)](Logits=logits, DRes=dres, DL=dl, Scratch=scratch, Pre=pre, Post=post, DPre=dpre,
                             DPost=dpost, Mo=m, R=r, Ap=a_pre, Aq=a_post, Ar=a_res, G=g, RG=rg, Part=part, N=N,
                             M=M,
                             iters=iters, eps=EPS, BT=BLOCK_TOKENS, **sizes)
    projection_backward(x, phi, g, m, r=r, dH=dH)
    return dH.view(H.shape), weight_gradient(x, rg, phi), torch.cat([part.sum(0), dgain.float()])


def _mhc_save(ctx, H, params, maps, kept, iters):
    """What mHC's read backward needs, saved by both of its Functions (the read's and maps_gradient's): H, the six
    params, H_pre, H_post, H_res, then the logits, m, r and rb (kept: H_post and those four), and Sinkhorn's iters."""
    (pre, res), (post, *rest) = maps, kept
    ctx.save_for_backward(H, *params, pre, post, res, *rest)
    ctx.iters = iters


def _mhc_backward(ctx, grads):
    """mhc_read_backward on what _mhc_save kept, for grads (dh, dpre, dpost, dres, dmixed) -> (dH, params' grads)."""
    H, *saved = ctx.saved_tensors
    params, kept = saved[:6], saved[6:]
    dH, dphi, sums = call(mhc_read_backward, H, params, kept, grads=grads, iters=ctx.iters)
    return dH, _mhc_parameter_gradients(dphi, sums, params[5])


def _mhc_setup(ctx, inputs, output):
    H, params, _, iters = inputs
    _, pre, post, res, _, logits, m, r, rb = output
    _mhc_save(ctx, H, params, (pre, res), kept=(post, logits, m, r, rb), iters=iters)
    split_maps(ctx, (pre, res), kept=(logits, m, r, rb))


def _mhc_gradients(ctx, dh, dpre, dpost, dres, dmixed, *_kept):
    grads = [dh, None, dpost, None, dmixed] if ctx.split else [dh, dpre, dpost, dres, dmixed]
    return (*_mhc_backward(ctx, grads), None, None)


def _mhc_parameter_gradients(dphi, sums, gain):
    """mhc_read_backward's (dphi, sums) -> the gradients of params = [phi, b, the three alphas, the gain]."""
    M = dphi.size(1)
    MP = pow2(M, 16)
    return [dphi, sums[:M], sums[MP], sums[MP + 1], sums[MP + 2], sums[2 * MP:].to(gain.dtype)]


def _mhc_maps_setup(ctx, inputs, output):
    maps, H, params, kept, iters = inputs
    _mhc_save(ctx, H, params, maps, kept=kept, iters=iters)


def _mhc_maps_gradients(ctx, dpre, dres):
    dH, params_grads = _mhc_backward(ctx, [None, dpre, None, dres, None])
    return [None, None], dH, params_grads, [None] * 5, None


mhc_read_call = autograd_op(mhc_read_forward, _mhc_gradients, _mhc_setup)   # compiled: the op; eager: its body
mhc_maps_call = autograd_function("mhc_maps", lambda maps, *_: (maps[0].clone(), maps[1].clone()),
                                  backward=_mhc_maps_gradients, setup_context=_mhc_maps_setup)   # maps_gradient


@graph_op("hc_read", f"(Tensor H, Tensor[] params, float eps) -> {READ_OUT})",
          lambda H, params, eps: read_outputs(H, H.numel() // H.size(-1), params[0].size(1) + 1, logits=False))
def hc_read_forward(H, params, eps):
    """ops.hc_read for HC (forward="mixed"): H (..., n, D), params = [dynamic_alpha (D, n + 1), dynamic_beta (D,),
    the static maps static_alpha (n, n + 1), static_beta (n), the two scales (0-dim), the norm's gain], the norm's
    eps -> as mhc_read_forward's, without logits. The projection is per stream (rows N n, K = D) with W = [dynamic_alpha |
    dynamic_beta] (D, n + 2), residuals.HC.maps' W, which the kernels read from the two parameters."""
    dynamic_alpha, dynamic_beta, static_alpha, static_beta, alpha_scale, beta_scale, gain = params
    n, D = H.shape[-2:]
    A, B, M = dynamic_alpha.contiguous(), dynamic_beta.contiguous(), dynamic_alpha.size(1) + 1
    x = H.reshape(-1, D).contiguous()                                   # (N n, D): row t n + s
    rows = x.size(0)
    h, pre, post, res, mixed, m, r, rb = read_outputs(H, rows, M, logits=False)   # the outputs' shapes: no views after
    maps = dict(X=x, A=A, B=B, Sa=static_alpha, Sb=static_beta, Asc=alpha_scale, Bsc=beta_scale, Pre=pre,
                Post=post, Res=res, Mo=m, R=r, NR=rows, K=D, M=M, eps=HC_EPS, n=n, BN=BLOCK_ROWS, BK=BLOCK_K,
                MP=pow2(M, 16))
    if hcr.ONE_LAUNCH_FORWARD and BLOCK_ROWS % n == 0:          # a program's rows are whole tokens
        _hc_fwd[(hc.triton.cdiv(rows, BLOCK_ROWS),)](Wn=gain, Out=h, Mixed=mixed, Rb=rb, eps_norm=eps, NP=pow2(n),
                                                     BD=pow2(D), **maps)
        return h, pre, post, res, mixed, m, r, rb
    _hc_read_fwd[(hc.triton.cdiv(rows, BLOCK_ROWS),)](**maps)
    h, mixed, rb = width_forward(x.view(rows // n, n * D), pre.view(-1, n), res.view(-1, n, n), (gain, eps))
    return (*outputs(h, pre, post, res, mixed=mixed, shape=H.shape), m, r, rb)


@graph_op("hc_read_bwd", "(Tensor H, Tensor[] params, Tensor[] kept, Tensor?[] grads) -> (Tensor, Tensor)",
          lambda H, params, *_: (H.new_empty(H.shape), H.new_empty(hc_sums_size(H.size(-2), H.size(-1)))))
def hc_read_backward(H, params, kept, grads):
    """The gradients (dh, dpre, dpost, dres, dmixed: None where an output fed nothing) of hc_read_forward's outputs;
    params = [dynamic_alpha, dynamic_beta, the two scales, the gain], kept = [pre, res, m, r, rb] -> (dH, the sums
    [static_alpha | static_beta | the scales | the gain's D | dW^T (n + 2, D), row-major: its last row dynamic_beta's
    gradient, the rest transposed dynamic_alpha's]): one launch where H_pre and H_res feed nothing else (dW^T summed
    in it with the rest: x read once), else three and a GEMM."""
    (A, B, alpha_scale, beta_scale, gain), (pre, res, m, r, rb) = [p.contiguous() for p in params], kept
    (_, dpre, _, dres, _), (n, D) = grads, H.shape[-2:]
    x = H.reshape(-1, D).contiguous()
    pre, res = pre.reshape(-1, n), res.reshape(-1, n, n)
    saved = (x, A, B, alpha_scale, beta_scale, pre, res, m, r, gain, rb)
    if hcr.ONE_LAUNCH_BACKWARD and dpre is None and dres is None:   # H_pre, H_res feed nothing else: one launch
        dH, sums = hc_backward(x, saved, grads)
        return dH.view(H.shape), sums
    dH, sums, rg, dgain = three_kernels(saved, grads)
    dWt = weight_gradient(x, rg, A, transposed=True)
    return dH.view(H.shape), torch.cat([sums, dgain.float(), dWt.view(-1)])


def hc_sums_size(n, D):
    """hc_read_backward's sums: the static maps' n^2 + n, the two scales, the gain's D and dW^T's (n + 2) D."""
    return n * (n + 2) + 2 + D + (n + 2) * D


def three_kernels(saved, grads):
    """HC's read backward where H_pre or H_res has another use (diagnostics): _width_norm_bwd (and the other uses'
    gradients added), _hc_read_bwd, _proj_bwd -> (dH, the maps' sums, r dm, the gain's gradient)."""
    x, A, B, alpha_scale, beta_scale, pre, res, m, r, gain, rb = saved
    W = torch.cat([A, B[:, None]], 1)                     # _proj_bwd's one W (D, n + 2): this path alone
    (rows, D), M, n = x.shape, W.size(1), pre.size(1)
    dH, dpre, dpost, dres, dgain = width_backward(x.view(rows // n, n * D), (pre, res, gain, rb), grads)
    blocks = hc.triton.cdiv(rows, BLOCK_ROWS)
    g, rg = torch.empty_like(m), torch.empty(m.shape, device=x.device, dtype=x.dtype)
    part = torch.empty(blocks, n * n + 2 * n + 2, device=x.device, dtype=torch.float32)
    _hc_read_bwd[(blocks,)](DPre=dpre, DPost=dpost, DRes=dres, Mo=m, R=r, Asc=alpha_scale, Bsc=beta_scale, G=g,
                            RG=rg, Part=part, NR=rows, M=M, n=n, BN=BLOCK_ROWS, MP=pow2(M, 16))
    sums = part.sum(0)                                   # [static_alpha | static_beta | the scales], contiguous
    projection_backward(x, W, g, m, r=r, dH=dH.view(rows, D))
    return dH.view(rows, D), sums, rg, dgain


def _hc_save(ctx, H, params, maps, kept):
    """What HC's read backward needs, saved by both of its Functions (the read's and maps_gradient's): H, the
    dynamic_alpha, dynamic_beta, the two scales and the gain of params (the static maps are not read), H_pre and
    H_res (maps), then m, r and rb (kept)."""
    A, B, _, _, alpha_scale, beta_scale, gain = params
    ctx.save_for_backward(H, A, B, alpha_scale, beta_scale, gain, *maps, *kept)


def _hc_backward(ctx, grads):
    """hc_read_backward on what _hc_save kept, for grads (dh, dpre, dpost, dres, dmixed) -> (dH, params' grads)."""
    H, *saved = ctx.saved_tensors
    dH, sums = call(hc_read_backward, H, params=saved[:5], kept=saved[5:], grads=grads)
    return dH, _hc_parameter_gradients(sums, H.shape[-2:], gain=saved[4])


def _hc_setup(ctx, inputs, output):
    H, params, _ = inputs
    _, pre, _, res, _, m, r, rb = output
    _hc_save(ctx, H, params, (pre, res), kept=(m, r, rb))
    split_maps(ctx, (pre, res), kept=(m, r, rb))


def _hc_gradients(ctx, dh, dpre, dpost, dres, dmixed, *_kept):
    grads = [dh, None, dpost, None, dmixed] if ctx.split else [dh, dpre, dpost, dres, dmixed]
    return (*_hc_backward(ctx, grads), None)


def _hc_parameter_gradients(sums, shape, gain):
    """hc_read_backward's sums, for streams of shape (n, D) -> the gradients of params = [dynamic_alpha,
    dynamic_beta, static_alpha, static_beta, alpha_scale, beta_scale, the gain]."""
    n, D = shape
    at = n * (n + 2) + 2                                   # the gain's first, then dW^T's
    dWt = sums[at + D:].view(n + 2, D)
    return [dWt[:n + 1].t(), dWt[n + 1], sums[:n * (n + 1)].view(n, n + 1), sums[n * (n + 1):n * (n + 2)],
            sums[n * (n + 2)], sums[n * (n + 2) + 1], sums[at:at + D].to(gain.dtype)]


def _hc_maps_setup(ctx, inputs, output):
    maps, H, params, kept = inputs
    _hc_save(ctx, H, params, maps, kept=kept)


def _hc_maps_gradients(ctx, dpre, dres):
    dH, params_grads = _hc_backward(ctx, [None, dpre, None, dres, None])
    return [None, None], dH, params_grads, [None] * 3


hc_read_call = autograd_op(hc_read_forward, _hc_gradients, _hc_setup)   # compiled: the op; eager: its body
hc_maps_call = autograd_function("hc_maps", lambda maps, *_: (maps[0].clone(), maps[1].clone()),
                                 backward=_hc_maps_gradients, setup_context=_hc_maps_setup)   # maps_gradient


def split_maps(ctx, maps, kept):
    """A read Function's setup: its outputs `kept` (for the backward only) are not differentiable; while dynamo traces,
    nor are H_pre and H_res (`maps`: their gradients go through `maps_gradient`'s Function), and ctx.split says so.
    Eager, None arrives for an output that fed nothing (no materialised zeros), so the backward sees which did."""
    ctx.split = torch.compiler.is_compiling()
    if ctx.split:
        ctx.mark_non_differentiable(*maps, *kept)
    else:
        ctx.mark_non_differentiable(*kept)
    ctx.set_materialize_grads(False)


def maps_gradient(maps_call, outputs, inputs):
    """The read's outputs (h, H_pre, H_post, H_res, mixed); while dynamo traces, H_pre's and H_res' gradients go
    through `maps_call` (called with the two, then `inputs`: H, params, the tensors the backward keeps and, mHC,
    Sinkhorn's iters), a second Function (copies of the two whose backward is the read's backward op for dpre and
    dres alone), and the read's Function, which marks the two non-differentiable there (`split_maps`), gets dh, dpost
    and dmixed only and runs the one-launch backward: a backward is linear in the output gradients, so the two
    Functions' sum is the read's gradient. Why: dynamo traces a Function's backward before it knows which outputs
    are used, with a gradient for each, so one Function for all five would run the three-launch backward on zeros
    in every training step; where nothing uses H_pre and H_res the copies are dead and the compiled graph drops
    them. Eager, one Function sees None for an unused output and no copies are made."""
    if not torch.compiler.is_compiling():
        return outputs
    h, pre, post, res, mixed = outputs
    pre, res = maps_call([pre, res], *inputs)
    return h, pre, post, res, mixed


def hc_read(design, H, site):
    """ops.hc_read: mHC's and HC's read (maps, width connection, the branch's norm) as two kernels forward and three
    backward, one in a model (mhc_read_forward, hc_read_forward: ops), with no checkpoint: autograd keeps the
    streams and a few floats per token (the maps, the norms' rsqrt), and the backward recomputes the branch from the
    streams. Any other design's
    (or off the kernels' devices) is ops.hc_read, through the design's bodies."""
    if not fused(design, H, site):
        return ops.hc_read(design, H, site)
    c, gain, eps = site.conn, site.norm.weight, site.norm.eps
    if type(design).__name__ == "MHC":
        params = [c.phi, c.b, c.alpha_pre, c.alpha_post, c.alpha_res, gain]
        h, pre, post, res, mixed, logits, m, r, rb = mhc_read_call(H, params, eps, design.sinkhorn_iters)
        inputs = (H, params, [post, logits, m, r, rb], design.sinkhorn_iters)
        return maps_gradient(mhc_maps_call, (h, pre, post, res, mixed), inputs)
    params = [c.dynamic_alpha, c.dynamic_beta, c.static_alpha, c.static_beta, c.alpha_scale, c.beta_scale, gain]
    h, pre, post, res, mixed, m, r, rb = hc_read_call(H, params, eps)
    return maps_gradient(hc_maps_call, (h, pre, post, res, mixed), (H, params, [m, r, rb]))


BODIES = {"hc_read": hc_read}   # ops.TWO_BODIES names -> their GPU body (kernels.triton_bodies)
