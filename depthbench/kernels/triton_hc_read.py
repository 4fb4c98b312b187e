"""
depthbench/kernels/triton_hc_read.py: mHC's read as one body, `hc_read` (ops.hc_read: the design's maps of the
streams, then the width connection), its maps fused into the projection's kernel. triton_hc.py's bodies run each
piece as its own kernel, with torch between them (the maps' sigmoids and affine maps, 9 launches forward and 25
backward) and autograd's add of the two dH (the projection's and the width connection's); here, per sublayer:

  forward   `_mhc_read_fwd`: per block of tokens, x (N, nD) read once: m = r (x phi) (the norm and the projection
            fused, as triton_hc._proj_fwd), then the maps in registers: H_pre = sigmoid(alpha_pre m[:n] + b[:n]),
            H_post = 2 sigmoid(alpha_post m[n:2n] + b[n:2n]), the logits alpha_res m[2n:] + b[2n:] and Sinkhorn on
            them (triton_hc._sinkhorn_block: the program's tokens again, read back from the logits it stored);
            then triton_hc._width_fwd (branch and mixed, one read of the streams)
  backward  triton_hc._width_bwd (its share of dH, dH_pre, dH_res); `_mhc_read_bwd`: per block of tokens,
            Sinkhorn's backward (recomputed from the logits), the maps' backward to dm = dL/dm, and per block
            partial sums of the gradients of b and the three alphas (one torch sum over the blocks); then
            triton_hc._proj_bwd with the width connection's dH added in the same pass (HAS_ACC: no autograd add);
            dphi = x^T (r dm) by cuBLAS in x's dtype, as triton_hc.NormedProjection's

Each output and every gradient (H, phi, b, the alphas) equals ops.hc_read's with ops.py's bodies
(tests/test_triton_hc.py::test_hc_read_equals_reference, under the interpreter). `hc_read` takes this path for mHC
(residuals.MHC, by its class name: a subclass could change the maps) on tensors the kernels run on; for any other
design or tensor it is ops.hc_read, which reaches the design's own bodies (triton_hc.py's on the Triton path).
"""
from __future__ import annotations  # Triton reads `x: tl.constexpr` as text: this module imports without triton

import torch

import ops
from depthbench.kernels import triton_hc as hc
from depthbench.kernels.triton_hc import (BLOCK_K, BLOCK_ROWS, BLOCK_TOKENS, _sinkhorn_block, _sinkhorn_block_bwd, _sum,
                                          jit, pow2, runs_here, stream_sizes, tl)
from ops import fp32_maths

EPS = 1e-6   # residuals.MHC.maps' norm eps and ops.sinkhorn's default, the ones its reference uses


@jit
def _mhc_read_fwd(X, W, B, Ap, Aq, Ar, Pre, Post, Logits, Res, Mo, R, N, K, M, iters, eps,
                  n: tl.constexpr, NP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr):
    """Tokens [pid BN, +BN): m = r (x @ W), r = rsqrt(mean(x^2) + eps); the maps' columns (pre | post | res
    logits) stored to Pre, Post (N, n) and Logits (N, n, n); m and r kept for the backward; Sinkhorn of the logits
    into Res (N, n, n)."""
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    cols = tl.arange(0, MP)
    acc = tl.full([BN, MP], 0.0, tl.float32)
    ss = tl.full([BN], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(X + rows[:, None] * K + ks[None, :], mask=(rows < N)[:, None] & (ks < K)[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(W + ks[:, None] * M + cols[None, :], mask=(ks < K)[:, None] & (cols < M)[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.dot(x, w, input_precision="ieee")
        ss += _sum(x * x, 1)
    r = 1.0 / tl.sqrt(ss / K + eps)
    m = acc * r[:, None]
    live = (rows < N)[:, None]
    tl.store(Mo + rows[:, None] * M + cols[None, :], m, mask=live & (cols < M)[None, :])
    tl.store(R + rows, r, mask=rows < N)
    is_pre, is_post, is_res = cols < n, (cols >= n) & (cols < 2 * n), (cols >= 2 * n) & (cols < M)
    alpha = tl.where(is_pre, tl.load(Ap), tl.where(is_post, tl.load(Aq), tl.load(Ar)))
    z = alpha[None, :] * m + tl.load(B + cols, mask=cols < M, other=0.0)[None, :]
    sig = 1.0 / (1.0 + tl.exp(-z))
    tl.store(Pre + rows[:, None] * n + tl.where(is_pre, cols, 0)[None, :], sig, mask=live & is_pre[None, :])
    tl.store(Post + rows[:, None] * n + tl.where(is_post, cols - n, 0)[None, :], 2.0 * sig,
             mask=live & is_post[None, :])
    tl.store(Logits + rows[:, None] * n * n + tl.where(is_res, cols - 2 * n, 0)[None, :], z,
             mask=live & is_res[None, :])
    tl.debug_barrier()                         # the logits are read back below by other threads of this program
    _sinkhorn_block(L=Logits, Out=Res, N=N, iters=iters, eps=eps, n=n, NP=NP, BT=BN)


@jit
def _mhc_read_bwd(Logits, DRes, DL, Scratch, Pre, Post, DPre, DPost, Mo, Ap, Aq, Ar, G, Part, N, M, iters, eps,
                  n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, MP: tl.constexpr):
    """Tokens [pid BT, +BT): dlogits from dH_res (Sinkhorn's backward, into DL), then dz per column (the
    sigmoids' derivatives: pre (1 - pre), post (1 - post / 2) for post = 2 sigmoid), dm = alpha dz into G (N, M),
    and this block's sums: Part[pid, :M] = sum dz (b's gradient), Part[pid, MP + 0, 1, 2] = sum dz m over the pre,
    post and res columns (the alphas')."""
    _sinkhorn_block_bwd(L=Logits, G=DRes, DL=DL, Scratch=Scratch, N=N, iters=iters, eps=eps, n=n, NP=NP, BT=BT)
    tl.debug_barrier()                         # dlogits are read back in another layout
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.arange(0, MP)
    live = (rows < N)[:, None]
    is_pre, is_post, is_res = cols < n, (cols >= n) & (cols < 2 * n), (cols >= 2 * n) & (cols < M)
    at_pre = rows[:, None] * n + tl.where(is_pre, cols, 0)[None, :]
    at_post = rows[:, None] * n + tl.where(is_post, cols - n, 0)[None, :]
    pre_mask, post_mask = live & is_pre[None, :], live & is_post[None, :]
    gate = tl.load(Pre + at_pre, mask=pre_mask, other=0.0) + tl.load(Post + at_post, mask=post_mask, other=0.0)
    dgate = tl.load(DPre + at_pre, mask=pre_mask, other=0.0) + tl.load(DPost + at_post, mask=post_mask, other=0.0)
    slope = tl.where(is_pre, gate * (1.0 - gate), gate * (1.0 - 0.5 * gate))
    dl = tl.load(DL + rows[:, None] * n * n + tl.where(is_res, cols - 2 * n, 0)[None, :], mask=live & is_res[None, :],
                 other=0.0)
    dz = tl.where(is_res[None, :], dl, dgate * slope)
    alpha = tl.where(is_pre, tl.load(Ap), tl.where(is_post, tl.load(Aq), tl.load(Ar)))
    tl.store(G + rows[:, None] * M + cols[None, :], alpha[None, :] * dz, mask=live & (cols < M)[None, :])
    m = tl.load(Mo + rows[:, None] * M + cols[None, :], mask=live & (cols < M)[None, :], other=0.0)
    dzm = _sum(dz * m, 0)                                                    # (MP,)
    dalpha = tl.where(cols == 0, _sum(tl.where(is_pre, dzm, 0.0), 0),
                      tl.where(cols == 1, _sum(tl.where(is_post, dzm, 0.0), 0),
                               _sum(tl.where(is_res, dzm, 0.0), 0)))
    part = Part + tl.program_id(0).to(tl.int64) * 2 * MP
    tl.store(part + cols, _sum(dz, 0), mask=cols < M)
    tl.store(part + MP + cols, dalpha, mask=cols < 3)


class MHCRead(torch.autograd.Function):
    """ops.hc_read for mHC: H (..., n, D), phi (nD, M), b (M,), the three alphas (0-dim), Sinkhorn's iters ->
    (branch (..., D) and mixed (..., n, D) in H's dtype, H_pre, H_post (..., n), H_res (..., n, n) in fp32)."""

    @staticmethod
    def forward(ctx, H, phi, b, a_pre, a_post, a_res, iters):
        n, D = H.shape[-2:]
        K, M = phi.shape
        x = H.reshape(-1, K).contiguous()
        N = x.size(0)
        f32 = dict(device=H.device, dtype=torch.float32)
        pre, post, logits, res = (torch.empty(N, *shape, **f32) for shape in ((n,), (n,), (n, n), (n, n)))
        m, r = torch.empty(N, M, **f32), torch.empty(N, **f32)
        sizes = dict(n=n, NP=pow2(n), MP=pow2(M, 16))
        _mhc_read_fwd[(hc.triton.cdiv(N, BLOCK_ROWS),)](
            X=x, W=phi, B=b, Ap=a_pre, Aq=a_post, Ar=a_res, Pre=pre, Post=post, Logits=logits, Res=res, Mo=m, R=r,
            N=N, K=K, M=M, iters=iters, eps=EPS, BN=BLOCK_ROWS, BK=BLOCK_K, **sizes)
        branch, mixed = torch.empty(N, D, device=H.device, dtype=H.dtype), torch.empty_like(x)
        hc._width_fwd[(N,)](H=x, Pre=pre, Res=res, Branch=branch, Mixed=mixed, **stream_sizes(H)[1])
        ctx.save_for_backward(x, phi, b, a_pre, a_post, a_res, pre, post, logits, res, m, r)
        ctx.iters, ctx.sizes, ctx.shape = iters, sizes, H.shape
        ctx.set_materialize_grads(False)          # H_pre and H_res feed nothing but the diagnostics: None, not zeros
        lead = H.shape[:-2]
        return (branch.view(*lead, D), pre.view(*lead, n), post.view(*lead, n), res.view(*lead, n, n),
                mixed.view(H.shape))

    @staticmethod
    def backward(ctx, dbranch, dpre_out, dpost_out, dres_out, dmixed):
        x, phi, b, a_pre, a_post, a_res, pre, post, logits, res, m, r = ctx.saved_tensors
        (N, K), M, n = x.shape, phi.size(1), pre.size(1)
        dbranch = x.new_zeros(N, K // n) if dbranch is None else dbranch.reshape(N, -1).contiguous()
        dmixed = torch.zeros_like(x) if dmixed is None else dmixed.reshape(N, K).contiguous()
        dH, dpre, dres = torch.empty_like(x), torch.empty_like(pre), torch.empty_like(res)
        hc._width_bwd[(N,)](H=x, Pre=pre, Res=res, DBranch=dbranch, DMixed=dmixed, DH=dH, DPre=dpre, DRes=dres,
                            **stream_sizes(x.view(N, n, -1))[1])
        dpre = dpre if dpre_out is None else dpre + dpre_out.reshape(N, n)        # H_pre, H_res used elsewhere too
        dres = dres if dres_out is None else dres + dres_out.reshape(N, n, n)
        dpost = torch.zeros_like(post) if dpost_out is None else dpost_out.reshape(N, n).contiguous().float()
        blocks = hc.triton.cdiv(N, BLOCK_TOKENS)
        g, dl = torch.empty_like(m), torch.empty_like(logits)
        part = torch.empty(blocks, 2 * ctx.sizes["MP"], device=x.device, dtype=torch.float32)
        scratch = torch.empty(N, 2 * ctx.iters - 1, ctx.sizes["NP"], device=x.device, dtype=torch.float32)
        _mhc_read_bwd[(blocks,)](Logits=logits, DRes=dres, DL=dl, Scratch=scratch, Pre=pre, Post=post, DPre=dpre,
                                 DPost=dpost, Mo=m, Ap=a_pre, Aq=a_post, Ar=a_res, G=g, Part=part, N=N, M=M,
                                 iters=ctx.iters, eps=EPS, BT=BLOCK_TOKENS, **ctx.sizes)
        sums = part.sum(0)
        hc._proj_bwd[(hc.triton.cdiv(N, BLOCK_ROWS),)](X=x, W=phi, G=g, Out=m, R=r, DX=dH, Acc=dH, HAS_ACC=True,
                                                       N=N, K=K, M=M, BN=BLOCK_ROWS, BK=BLOCK_K,
                                                       MP=ctx.sizes["MP"])
        with fp32_maths(g):               # sum over the tokens of (r x)^T dm: cuBLAS, in x's dtype (fp32 accumulation)
            dphi = x.t() @ (g * r[:, None]).to(x.dtype)
        MP = ctx.sizes["MP"]
        return (dH.view(ctx.shape), dphi.to(phi.dtype), sums[:M], sums[MP], sums[MP + 1], sums[MP + 2], None)


def fused(design, H):
    """Whether hc_read runs MHCRead: residuals.MHC itself (its maps are the kernels'), on tensors the kernels run on."""
    return type(design).__name__ == "MHC" and runs_here(H)


def hc_read(design, H, site):
    """ops.hc_read: mHC's maps and width connection as two kernels forward (MHCRead), any other design's (or off
    the kernels' devices) as ops.hc_read composes them, through the design's bodies."""
    if not fused(design, H):
        return ops.hc_read(design, H, site)
    c = site.conn
    return MHCRead.apply(H, c.phi, c.b, c.alpha_pre, c.alpha_post, c.alpha_res, design.sinkhorn_iters)


BODIES = {"hc_read": hc_read}   # ops.TWO_BODIES names -> their GPU body (kernels.triton_bodies)
