"""
depthbench/kernels/triton_hc_read.py: HC's and mHC's read as one body, `hc_read` (ops.hc_read: the design's maps
of the streams, the width connection and the branch's norm, which ops.hc_read runs under torch.utils.checkpoint),
as fused kernels with no checkpoint. triton_hc.py's bodies run each piece as its own kernel, with torch between
them (the maps' activations and affine maps: HC 8 launches forward and 17 backward, mHC 9 and 25), autograd's add
of the two dH (the projection's and the width connection's), and the checkpoint's recompute of all of it and of
the norm in the backward; here, per sublayer:

  forward   the maps: mHC per block of tokens, x (N, nD) read once: m = r (x phi) (the norm and the projection
            fused, as triton_hc._proj_fwd), then in registers H_pre = sigmoid(alpha_pre m[:n] + b[:n]), H_post =
            2 sigmoid(alpha_post m[n:2n] + b[n:2n]), the logits alpha_res m[2n:] + b[2n:] and Sinkhorn on them
            (triton_hc._sinkhorn_block, from the logits it stored); HC per block of rows of (N n, D) (token t's
            stream s), m = r (x W), z = static[s] + scale tanh(m), H_pre = z[0], H_res[o, s] = z[1 + o], H_post =
            z[n + 1] (W = [dynamic_alpha | dynamic_beta], read from the two parameters). Then per token, whole in
            registers, mixed, the branch and its RMSNorm with the gain: h = w branch rb (the branch never stored;
            rb kept). One launch, `_mhc_fwd` / `_hc_fwd` (HC where n divides 16), else `_mhc_read_fwd` /
            `_hc_read_fwd` and `_width_norm_fwd`
  backward  where H_pre and H_res feed nothing else (a model's case), one launch, `_mhc_bwd` / `_hc_bwd`, per block
            of 16 tokens: by tiles of channels the width connection's and the norm's sums (dpre, dres and the norm's
            <w dout, branch>), the maps' (and Sinkhorn's, recomputed from the logits) backward to dm, then dH by
            tiles of channels, written once (the width share, r dm W^T, the norm's); the maps' and the gain's sums
            in one row a program, laid out as the parameters (one torch sum); dW = x^T (r dm): mHC's by cuBLAS
            (`weight_gradient`), HC's in `_hc_bwd`'s tiles (each program's share of dW^T in its row of sums: x is
            read once). Otherwise (diagnostics read them) three: `_width_norm_bwd`, `_mhc_read_bwd` /
            `_hc_read_bwd`, triton_hc._proj_bwd with the width connection's dH added in (HAS_ACC). With
            ONE_LAUNCH_FORWARD / ONE_LAUNCH_BACKWARD off, always the split (scripts/kernel_bench.py times both)

Memory: autograd keeps the streams (as under the checkpoint) and a few floats per token and sublayer for the
backward (mHC: H_pre, H_post, the logits, H_res, m, r and rb, 66 floats at n = 4; HC: H_pre, H_res, m, r and rb,
49), 5% and 4% of bf16 streams at d640 (2,560 elements a token). Each output and every gradient (H, every
connector parameter and the norm's gain) equals ops.hc_read's with ops.py's bodies
(tests/test_triton_hc.py::test_hc_read_equals_reference, under the interpreter). `hc_read` takes this path for
residuals.MHC and residuals.HC with its transport mixed (by class name: a subclass could change the maps), with an
RMSNorm on the branch, on tensors the kernels run on; for any other design or tensor it is ops.hc_read, which
reaches the design's own bodies (triton_hc.py's on the Triton path).
"""
from __future__ import annotations  # Triton reads `x: tl.constexpr` as text: this module imports without triton

import torch

from depthbench.kernels import triton_hc as hc
from depthbench.kernels.triton_hc import (BLOCK_K, BLOCK_ROWS, _dot, _normed_rows, _sinkhorn_block,
                                          _sinkhorn_block_bwd, _sum, _w_tile, jit, pow2, runs_here, stream_sizes, tl)
from depthbench.kernels.triton_attnres_chunk import UPCAST_DOTS   # one definition of the interpreter's workaround
from ops import fp32_maths

EPS = 1e-6      # residuals.MHC.maps' norm eps and ops.sinkhorn's default, the ones its reference uses
HC_EPS = 1e-8   # residuals.HC.maps' norm eps


@jit
def _mhc_read_fwd(X, W, B, Ap, Aq, Ar, Pre, Post, Logits, Res, Mo, R, N, K, M, iters, eps,
                  n: tl.constexpr, NP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr):
    """Tokens [pid BN, +BN): m = r (x @ W), r = rsqrt(mean(x^2) + eps); the maps' columns (pre | post | res
    logits) stored to Pre, Post (N, n) and Logits (N, n, n); m and r kept for the backward; Sinkhorn of the logits
    into Res (N, n, n)."""
    _mhc_maps_fwd(X, W, B, Ap, Aq=Aq, Ar=Ar, Pre=Pre, Post=Post, Logits=Logits, Res=Res, Mo=Mo, R=R, N=N, K=K, M=M,
                  iters=iters, eps=eps, n=n, NP=NP, BN=BN, BK=BK, MP=MP)


@jit
def _mhc_fwd(X, W, B, Ap, Aq, Ar, Pre, Post, Logits, Res, Mo, R, Wn, Out, Mixed, Rb, N, K, M, D, iters, eps,
             eps_norm, n: tl.constexpr, NP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr,
             BD: tl.constexpr):
    """mHC's whole read forward on tokens [pid BN, +BN), one launch (in place of _mhc_read_fwd and
    _width_norm_fwd): the maps and Sinkhorn, then each token's width connection and branch norm
    (`_width_token_fwd`, its streams read again: this program's, just read, mostly from L2)."""
    _mhc_maps_fwd(X, W, B, Ap, Aq=Aq, Ar=Ar, Pre=Pre, Post=Post, Logits=Logits, Res=Res, Mo=Mo, R=R, N=N, K=K, M=M,
                  iters=iters, eps=eps, n=n, NP=NP, BN=BN, BK=BK, MP=MP)
    tl.debug_barrier()                         # pre and res are read back below by other threads
    w = tl.load(Wn + tl.arange(0, BD), mask=tl.arange(0, BD) < D, other=0.0).to(tl.float32)
    for i in range(0, BN):
        _width_token_fwd(X, Pre, Res, Out, Mixed=Mixed, Rb=Rb, t=tl.program_id(0).to(tl.int64) * BN + i, w=w, N=N,
                         D=D, eps=eps_norm, n=n, NP=NP, BD=BD)


@jit
def _mhc_maps_fwd(X, W, B, Ap, Aq, Ar, Pre, Post, Logits, Res, Mo, R, N, K, M, iters, eps,
                  n: tl.constexpr, NP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr):
    """_mhc_read_fwd's work."""
    rows, cols, m = _normed_rows(X, W, Mo, R, N=N, K=K, M=M, eps=eps, BN=BN, BK=BK, MP=MP)   # m and r kept
    live = (rows < N)[:, None]
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
def _mhc_maps_bwd(Logits, DRes, DL, Scratch, Pre, Post, DPre, DPost, Mo, R, Ap, Aq, Ar, RG, Part, part_stride, N, M,
                  iters, eps, n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, MP: tl.constexpr):
    """Tokens [pid BT, +BT): dlogits from dH_res (Sinkhorn's backward, into DL), then dz per column (the
    sigmoids' derivatives: pre (1 - pre), post (1 - post / 2) for post = 2 sigmoid), dm = alpha dz, r dm into RG
    (x's dtype: dphi's GEMM input), and this block's sums into row pid of Part (part_stride floats a row): [:M] =
    sum dz (b's gradient), [MP + 0, 1, 2] = sum dz m over the pre, post and res columns (the alphas') -> (the
    block's rows, dm (BT, MP))."""
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
    g = alpha[None, :] * dz
    r = tl.load(R + rows, mask=rows < N, other=0.0)
    tl.store(RG + rows[:, None] * M + cols[None, :], (g * r[:, None]).to(RG.dtype.element_ty),
             mask=live & (cols < M)[None, :])
    m = tl.load(Mo + rows[:, None] * M + cols[None, :], mask=live & (cols < M)[None, :], other=0.0)
    dzm = _sum(dz * m, 0)                                                    # (MP,)
    dalpha = tl.where(cols == 0, _sum(tl.where(is_pre, dzm, 0.0), 0),
                      tl.where(cols == 1, _sum(tl.where(is_post, dzm, 0.0), 0),
                               _sum(tl.where(is_res, dzm, 0.0), 0)))
    part = Part + tl.program_id(0).to(tl.int64) * part_stride
    tl.store(part + cols, _sum(dz, 0), mask=cols < M)
    tl.store(part + MP + cols, dalpha, mask=cols < 3)
    return rows, g


@jit
def _mhc_read_bwd(Logits, DRes, DL, Scratch, Pre, Post, DPre, DPost, Mo, R, Ap, Aq, Ar, G, RG, Part, N, M, iters,
                  eps, n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, MP: tl.constexpr):
    """_mhc_maps_bwd on tokens [pid BT, +BT) (Part's rows 2 MP floats), dm stored into G (N, M)."""
    rows, g = _mhc_maps_bwd(Logits, DRes, DL, Scratch, Pre=Pre, Post=Post, DPre=DPre, DPost=DPost, Mo=Mo, R=R, Ap=Ap,
                            Aq=Aq, Ar=Ar, RG=RG, Part=Part, part_stride=2 * MP, N=N, M=M, iters=iters, eps=eps, n=n,
                            NP=NP, BT=BT, MP=MP)
    cols = tl.arange(0, MP)
    tl.store(G + rows[:, None] * M + cols[None, :], g, mask=(rows < N)[:, None] & (cols < M)[None, :])


@jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both ends (exp's overflow gives 1; its underflow -1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@jit
def _hc_read_fwd(X, A, B, Sa, Sb, Asc, Bsc, Pre, Post, Res, Mo, R, NR, K, M, eps,
                 n: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr):
    """Rows [pid BN, +BN) of HC's (N n, D) streams (row t n + s: token t's stream s): m = r (x @ W), W = [A | B] =
    [dynamic_alpha | dynamic_beta] (D, n + 2), read from both (no concatenation);
    z = static[s] + scale tanh(m) (static = [static_alpha | static_beta], scale alpha_scale on the n + 1 alpha
    columns, beta_scale on the last); H_pre[t, s] = z[0], H_post[t, s] = z[n + 1], H_res[t, o, s] = z[1 + o]."""
    _hc_maps_fwd(X, A, B, Sa, Sb=Sb, Asc=Asc, Bsc=Bsc, Pre=Pre, Post=Post, Res=Res, Mo=Mo, R=R, NR=NR, K=K, M=M,
                 eps=eps, n=n, BN=BN, BK=BK, MP=MP)


@jit
def _hc_fwd(X, A, B, Sa, Sb, Asc, Bsc, Pre, Post, Res, Mo, R, Wn, Out, Mixed, Rb, NR, K, M, eps, eps_norm,
            n: tl.constexpr, NP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr,
            BD: tl.constexpr):
    """HC's whole read forward on rows [pid BN, +BN), BN / n whole tokens (n divides BN), one launch (in place of
    _hc_read_fwd and _width_norm_fwd): the maps, then each token's width connection and branch norm
    (`_width_token_fwd`, its streams read again: this program's, just read, mostly from L2)."""
    _hc_maps_fwd(X, A, B, Sa, Sb=Sb, Asc=Asc, Bsc=Bsc, Pre=Pre, Post=Post, Res=Res, Mo=Mo, R=R, NR=NR, K=K, M=M,
                 eps=eps, n=n, BN=BN, BK=BK, MP=MP)
    tl.debug_barrier()                         # pre and res are read back below by other threads
    w = tl.load(Wn + tl.arange(0, BD), mask=tl.arange(0, BD) < K, other=0.0).to(tl.float32)
    for i in range(0, BN // n):
        _width_token_fwd(X, Pre, Res, Out, Mixed=Mixed, Rb=Rb, t=tl.program_id(0).to(tl.int64) * (BN // n) + i, w=w,
                         N=NR // n, D=K, eps=eps_norm, n=n, NP=NP, BD=BD)


@jit
def _hc_maps_fwd(X, A, B, Sa, Sb, Asc, Bsc, Pre, Post, Res, Mo, R, NR, K, M, eps,
                 n: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr):
    """_hc_read_fwd's work."""
    rows, cols, m = _normed_rows(X, A, Mo, R, N=NR, K=K, M=M, eps=eps, BN=BN, BK=BK, MP=MP, Wlast=B,
                                 SPLIT=True)                                                 # m and r kept
    live = (rows < NR)[:, None]
    s, alpha = rows % n, cols < n + 1
    static = tl.load(Sa + s[:, None] * (n + 1) + tl.where(alpha, cols, 0)[None, :], mask=live & alpha[None, :],
                     other=0.0) + tl.load(Sb + s[:, None] + 0 * cols[None, :], mask=live & (cols == n + 1)[None, :],
                                          other=0.0)
    z = static + tl.where(alpha, tl.load(Asc), tl.load(Bsc))[None, :] * _tanh(m)
    tl.store(Pre + rows, _sum(tl.where((cols == 0)[None, :], z, 0.0), 1), mask=rows < NR)
    tl.store(Post + rows, _sum(tl.where((cols == n + 1)[None, :], z, 0.0), 1), mask=rows < NR)
    is_res = (cols >= 1) & alpha
    at = (rows // n)[:, None] * n * n + tl.where(is_res, cols - 1, 0)[None, :] * n + s[:, None]
    tl.store(Res + at, z, mask=live & is_res[None, :])


@jit
def _hc_maps_bwd(DPre, DPost, DRes, Mo, Asc, Bsc, G, part, row0, count, NR, M,
                 n: tl.constexpr, BN: tl.constexpr, MP: tl.constexpr):
    """_hc_read_bwd's work on rows [row0, row0 + count) (count <= BN) but r dm, this block's sums at `part` -> (the
    rows, which are live, dm (BN, MP))."""
    rows = row0 + tl.arange(0, BN)
    ok = (tl.arange(0, BN) < count) & (rows < NR)
    live = ok[:, None]
    cols = tl.arange(0, MP)
    s, alpha = rows % n, cols < n + 1
    is_res = (cols >= 1) & alpha
    at = (rows // n)[:, None] * n * n + tl.where(is_res, cols - 1, 0)[None, :] * n + s[:, None]
    dz = (tl.load(DRes + at, mask=live & is_res[None, :], other=0.0)
          + tl.where((cols == 0)[None, :], tl.load(DPre + rows, mask=ok, other=0.0)[:, None], 0.0)
          + tl.where((cols == n + 1)[None, :], tl.load(DPost + rows, mask=ok, other=0.0)[:, None], 0.0))
    th = _tanh(tl.load(Mo + rows[:, None] * M + cols[None, :], mask=live & (cols < M)[None, :], other=0.0))
    scale = tl.where(alpha, tl.load(Asc), tl.load(Bsc))
    g = dz * scale[None, :] * (1.0 - th * th)
    tl.store(G + rows[:, None] * M + cols[None, :], g, mask=live & (cols < M)[None, :])
    for stream in tl.static_range(n):
        sums = _sum(tl.where((s == stream)[:, None], dz, 0.0), 0)                         # (MP,) over its rows
        tl.store(part + stream * (n + 1) + cols, sums, mask=alpha)
        tl.store(part + n * (n + 1) + stream + 0 * cols, sums, mask=cols == n + 1)
    dzt = _sum(dz * th, 0)
    scales = tl.where(cols == 0, _sum(tl.where(alpha, dzt, 0.0), 0), _sum(tl.where(cols == n + 1, dzt, 0.0), 0))
    tl.store(part + n * (n + 2) + cols, scales, mask=cols < 2)
    return rows, ok, g


@jit
def _hc_read_bwd(DPre, DPost, DRes, Mo, R, Asc, Bsc, G, RG, Part, NR, M,
                 n: tl.constexpr, BN: tl.constexpr, MP: tl.constexpr):
    """Rows [pid BN, +BN): dz from dH_pre, dH_post, dH_res (the forward's layout), dm = dz scale (1 - tanh(m)^2)
    into G and r dm into RG (x's dtype: dW's GEMM input), and this block's sums into Part[pid] (n^2 + 2n + 2
    floats, laid out as the parameters: static_alpha (n, n + 1), static_beta (n), alpha_scale, beta_scale): per
    stream s, the sum over its rows of dz; then sum dz tanh(m) over the alpha columns and over the last."""
    pid = tl.program_id(0).to(tl.int64)
    rows, ok, g = _hc_maps_bwd(DPre, DPost, DRes, Mo, Asc=Asc, Bsc=Bsc, G=G, part=Part + pid * (n * n + 2 * n + 2),
                               row0=pid * BN, count=BN, NR=NR, M=M, n=n, BN=BN, MP=MP)
    cols, r = tl.arange(0, MP), tl.load(R + rows, mask=ok, other=0.0)
    tl.store(RG + rows[:, None] * M + cols[None, :], (g * r[:, None]).to(RG.dtype.element_ty),
             mask=ok[:, None] & (cols < M)[None, :])


@jit
def _width_norm_fwd(H, Pre, Res, Wn, Out, Mixed, Rb, N, D, eps,
                    n: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, TPP: tl.constexpr):
    """Tokens [pid TPP, +TPP), each whole in registers (BD >= D): branch = sum_s pre[s] h_s and mixed_o =
    sum_s res[o, s] h_s (triton_hc._width_fwd's), then the branch's RMSNorm with its gain w (ops.rms_norm): out =
    w branch rb, rb = rsqrt(mean(branch^2) + eps), kept for the backward. The branch itself is never stored."""
    w = tl.load(Wn + tl.arange(0, BD), mask=tl.arange(0, BD) < D, other=0.0).to(tl.float32)
    for i in range(0, TPP):
        _width_token_fwd(H, Pre, Res, Out, Mixed=Mixed, Rb=Rb, t=tl.program_id(0).to(tl.int64) * TPP + i, w=w, N=N,
                         D=D, eps=eps, n=n, NP=NP, BD=BD)


@jit
def _width_token_fwd(H, Pre, Res, Out, Mixed, Rb, t, w, N, D, eps, n: tl.constexpr, NP: tl.constexpr,
                     BD: tl.constexpr):
    """_width_norm_fwd's work on token t (nothing where t >= N), the gain w (BD,) already loaded."""
    s, d = tl.arange(0, NP), tl.arange(0, BD)
    ms, md = (s < n) & (t + 0 * s < N), (d < D) & (t + 0 * d < N)        # masks as vectors (no scalar mask)
    pre = tl.load(Pre + t * n + s, mask=ms, other=0.0)
    h = tl.load(H + t * n * D + s[:, None] * D + d[None, :], mask=ms[:, None] & md[None, :],
                other=0.0).to(tl.float32)                                                              # (s, D)
    for o in tl.static_range(n):
        res_o = tl.load(Res + t * n * n + o * n + s, mask=ms, other=0.0)                              # (s,)
        tl.store(Mixed + t * n * D + o * D + d, _sum(res_o[:, None] * h, 0).to(Mixed.dtype.element_ty), mask=md)
    branch = _sum(pre[:, None] * h, 0)
    rb = 1.0 / tl.sqrt(_sum(branch * branch, 0) / D + eps)
    tl.store(Out + t * D + d, (w * branch * rb).to(Out.dtype.element_ty), mask=md)
    tl.store(Rb + t + 0 * s, rb + 0.0 * s, mask=ms & (s == 0))


@jit
def _width_block_bwd(H, Pre, Rb, DOut, DMixed, DPre, DRes, Dw, t0, Wn, N, D, n: tl.constexpr, NP: tl.constexpr,
                     BK: tl.constexpr, BT: tl.constexpr):
    """The one-launch backwards' first stage on tokens [t0, t0 + BT), by tiles of BK channels, each token's sums over
    D in lanes (no barrier): <w dout, branch>, <h_s, w dout>, <h_s, branch>, dres[o, s] = <dmixed_o, h_s> into DRes;
    dpre[s] = <h_s, dbranch> = rb <h_s, w dout> - c <h_s, branch> into DPre; each tile's share of the gain's
    gradient (sum over the tokens of dout branch rb) into Dw at its channels -> c = rb^3 <w dout, branch> / D."""
    tokens = t0 + tl.arange(0, BT)
    live, s, cell = tokens < N, tl.arange(0, NP), tl.arange(0, NP * NP)                # cell = o NP + s
    rb = tl.load(Rb + tokens, mask=live, other=0.0)
    gb, hg, hb = tl.full([BT], 0.0, tl.float32), tl.full([BT, NP], 0.0, tl.float32), tl.full([BT, NP], 0.0, tl.float32)
    mh = tl.full([BT, NP * NP], 0.0, tl.float32)
    for d0 in tl.range(0, D, BK, num_stages=2):
        dd = d0 + tl.arange(0, BK)
        tile, at, branch, dout, w = _branch_tile(H, Pre, Wn, DOut, tokens=tokens, live=live, dd=dd, D=D, n=n)
        gw = dout * w[None, :]
        gb += _sum(gw * branch, 1)
        for j in tl.static_range(n):
            h = tl.load(H + at + j * D, mask=tile, other=0.0).to(tl.float32)
            hg += tl.where((s == j)[None, :], _sum(h * gw, 1)[:, None], 0.0)
            hb += tl.where((s == j)[None, :], _sum(h * branch, 1)[:, None], 0.0)
            for o in tl.static_range(n):
                dm = tl.load(DMixed + at + o * D, mask=tile, other=0.0).to(tl.float32)
                mh += tl.where((cell == o * NP + j)[None, :], _sum(dm * h, 1)[:, None], 0.0)
        tl.store(Dw + dd, _sum(dout * branch * rb[:, None], 0), mask=dd < D)
    c = rb * rb * rb * gb / D
    tl.store(DPre + tokens[:, None] * n + s[None, :], rb[:, None] * hg - c[:, None] * hb,
             mask=live[:, None] & (s < n)[None, :])
    o, si = cell // NP, cell % NP
    tl.store(DRes + tokens[:, None] * n * n + (o * n + si)[None, :], mh,
             mask=live[:, None] & ((o < n) & (si < n))[None, :])
    return c


@jit
def _branch_tile(H, Pre, Wn, DOut, tokens, live, dd, D, n: tl.constexpr):
    """The tile (tokens, channels dd) of the branch again from the streams -> (the tile's mask, the offsets of
    stream 0's channels dd, the branch, dout, the gain w (dd,))."""
    tile = live[:, None] & (dd < D)[None, :]
    at = tokens[:, None] * n * D + dd[None, :]
    dout = tl.load(DOut + tokens[:, None] * D + dd[None, :], mask=tile, other=0.0).to(tl.float32)
    branch = tl.zeros_like(dout)
    for j in tl.static_range(n):
        pre_j = tl.load(Pre + tokens * n + j, mask=live, other=0.0)
        branch += pre_j[:, None] * tl.load(H + at + j * D, mask=tile, other=0.0).to(tl.float32)
    return tile, at, branch, dout, tl.load(Wn + dd, mask=dd < D, other=0.0).to(tl.float32)


@jit
def _dbranch_tile(H, Pre, Wn, DOut, rb, cb, tokens, live, dd, D, n: tl.constexpr):
    """The one-launch backwards' tile (tokens, channels dd): dbranch = rb w dout - branch c (`_branch_tile`) ->
    (the tile's mask, the offsets of stream 0's channels dd, dbranch)."""
    tile, at, branch, dout, w = _branch_tile(H, Pre, Wn, DOut, tokens=tokens, live=live, dd=dd, D=D, n=n)
    return tile, at, rb[:, None] * w[None, :] * dout - branch * cb[:, None]


@jit
def _width_share(Pre, Res, DMixed, db, tokens, live, at, tile, D, j, n: tl.constexpr):
    """Stream j's share of dH from the width connection on the tile: pre[j] dbranch + sum_o res[o, j] dmixed_o."""
    dx = tl.load(Pre + tokens * n + j, mask=live, other=0.0)[:, None] * db
    for o in tl.static_range(n):
        res_oj = tl.load(Res + tokens * n * n + o * n + j, mask=live, other=0.0)
        dx += res_oj[:, None] * tl.load(DMixed + at + o * D, mask=tile, other=0.0).to(tl.float32)
    return dx


@jit
def _width_norm_bwd(H, Pre, Res, Wn, Rb, DOut, DMixed, DH, DPre, DRes, DWp, N, D,
                    n: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, TPP: tl.constexpr):
    """Tokens [pid TPP, +TPP): `_width_block_bwd` (dpre, dres; this program's share of the gain's gradient into
    DWp[pid]), then by tiles of BD channels triton_hc._width_bwd's dh_s = pre[s] dbranch + sum_o res[o, s] dmixed_o
    into DH."""
    pid = tl.program_id(0).to(tl.int64)
    tokens = pid * TPP + tl.arange(0, TPP)
    live = tokens < N
    c = _width_block_bwd(H, Pre, Rb, DOut, DMixed=DMixed, DPre=DPre, DRes=DRes, Dw=DWp + pid * D, t0=pid * TPP, Wn=Wn,
                         N=N, D=D, n=n, NP=NP, BK=BD, BT=TPP)
    rb = tl.load(Rb + tokens, mask=live, other=0.0)
    for d0 in tl.range(0, D, BD, num_stages=2):
        dd = d0 + tl.arange(0, BD)
        tile, at, db = _dbranch_tile(H, Pre, Wn, DOut, rb=rb, cb=c, tokens=tokens, live=live, dd=dd, D=D, n=n)
        for j in tl.static_range(n):
            dx = _width_share(Pre, Res, DMixed, db, tokens=tokens, live=live, at=at, tile=tile, D=D, j=j, n=n)
            tl.store(DH + at + j * D, dx.to(DH.dtype.element_ty), mask=tile)


@jit
def _mhc_bwd(H, W, Pre, Post, Res, Logits, Mo, R, Rb, Wn, DOut, DMixed, DPost, DH, DPre, DRes, DL, Scratch, Cb, RG,
             Sums, Ap, Aq, Ar, N, D, M, iters, eps, n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
             BK: tl.constexpr, MP: tl.constexpr):
    """mHC's whole read backward on tokens [pid BT, +BT), one launch (in place of _width_norm_bwd, _mhc_read_bwd
    and _proj_bwd): (1) by tiles of BK channels (`_width_block_bwd`): dpre, dres, c into Cb, the gain's; (2) the
    maps' and Sinkhorn's backward (`_mhc_maps_bwd`), dm kept in registers; (3) by tiles of BK channels of every
    stream, the branch and dbranch again (rb w dout - branch c) and dH written once: pre[s] dbranch + sum_o
    res[o, s] dmixed_o (the width connection) + r (dm phi^T) - x r^2 <dm, m> / K (the projection through the
    norm, K = n D). Row pid of Sums: the maps' sums (2 MP floats), then the gain's (D)."""
    pid = tl.program_id(0).to(tl.int64)
    c = _width_block_bwd(H, Pre, Rb, DOut, DMixed=DMixed, DPre=DPre, DRes=DRes, Dw=Sums + pid * (2 * MP + D)
                         + 2 * MP, t0=pid * BT, Wn=Wn, N=N, D=D, n=n, NP=NP, BK=BK, BT=BT)
    tl.store(Cb + pid * BT + tl.arange(0, BT), c, mask=pid * BT + tl.arange(0, BT) < N)
    tl.debug_barrier()                         # dpre, dres and c are read back below by other threads
    rows, g = _mhc_maps_bwd(Logits, DRes, DL, Scratch, Pre=Pre, Post=Post, DPre=DPre, DPost=DPost, Mo=Mo, R=R, Ap=Ap,
                            Aq=Aq, Ar=Ar, RG=RG, Part=Sums, part_stride=2 * MP + D, N=N, M=M, iters=iters, eps=eps,
                            n=n, NP=NP, BT=BT, MP=MP)
    live, cols, K = rows < N, tl.arange(0, MP), n * D
    r = tl.load(R + rows, mask=live, other=0.0)
    m = tl.load(Mo + rows[:, None] * M + cols[None, :], mask=live[:, None] & (cols < M)[None, :], other=0.0)
    coef = r * r * _sum(g * m, 1) / K                  # <g, m> = r <g, x phi>: the gradient through r
    rb, cb = tl.load(Rb + rows, mask=live, other=0.0), tl.load(Cb + rows, mask=live, other=0.0)
    for d0 in tl.range(0, D, BK, num_stages=2):      # every tile's loads by cp.async, 1 ahead
        dd = d0 + tl.arange(0, BK)
        tile, at, db = _dbranch_tile(H, Pre, Wn, DOut, rb=rb, cb=cb, tokens=rows, live=live, dd=dd, D=D, n=n)
        for j in tl.static_range(n):
            dx = _width_share(Pre, Res, DMixed, db, tokens=rows, live=live, at=at, tile=tile, D=D, j=j, n=n)
            phi = tl.load(W + (j * D + dd)[:, None] * M + cols[None, :], mask=(dd < D)[:, None] & (cols < M)[None, :],
                          other=0.0).to(tl.float32)
            x = tl.load(H + at + j * D, mask=tile, other=0.0).to(tl.float32)
            dx += r[:, None] * _dot(g, tl.trans(phi), H) - x * coef[:, None]
            tl.store(DH + at + j * D, dx.to(DH.dtype.element_ty), mask=tile)


TOKENS_PER_PROGRAM = 8   # tokens a width-and-norm program holds in turn (its share of the gain's gradient is one row)


def width_outputs(x, n):
    """The width connection's outputs for x (N, n D), unwritten: h (N, D) and mixed (N, n D) in x's dtype, rb (N,)."""
    N, D = x.size(0), x.size(1) // n
    return (torch.empty(N, D, device=x.device, dtype=x.dtype), torch.empty_like(x),
            torch.empty(N, device=x.device, dtype=torch.float32))


def width_forward(x, pre, res, norm):
    """_width_norm_fwd on x (N, n D): (h = norm(branch) (N, D), mixed (N, n D)) in x's dtype, and rb (N,) fp32;
    norm = (gain, eps)."""
    (N, n), (w, eps) = pre.shape, norm
    D = x.size(1) // n
    out, mixed, rb = width_outputs(x, n)
    _width_norm_fwd[(hc.triton.cdiv(N, TOKENS_PER_PROGRAM),)](
        H=x, Pre=pre, Res=res, Wn=w, Out=out, Mixed=mixed, Rb=rb, N=N, D=D, eps=eps, n=n, NP=pow2(n), BD=pow2(D),
        TPP=TOKENS_PER_PROGRAM)
    return out, mixed, rb


def width_backward(x, saved, grads):
    """_width_norm_bwd, and the maps' incoming gradients: saved = (pre, res, gain, rb); grads = (dh, dpre, dpost,
    dres, dmixed) as the Function's backward gets them (None where an output fed nothing) -> (dH (x's layout),
    dpre, dpost, dres, the gain's gradient)."""
    pre, res, w, rb = saved
    (N, n), (_, dpre_out, _, dres_out, _) = pre.shape, grads
    D = x.size(1) // n
    dout, dpost, dmixed = upstream(x, pre, grads)
    dH, dpre, dres = torch.empty_like(x), torch.empty_like(pre), torch.empty_like(res)
    programs = hc.triton.cdiv(N, TOKENS_PER_PROGRAM)
    dwp = torch.empty(programs, D, device=x.device, dtype=torch.float32)
    _width_norm_bwd[(programs,)](H=x, Pre=pre, Res=res, Wn=w, Rb=rb, DOut=dout, DMixed=dmixed, DH=dH, DPre=dpre,
                                 DRes=dres, DWp=dwp, N=N, D=D, n=n, NP=pow2(n), BD=min(BLOCK_K, pow2(D)),
                                 TPP=TOKENS_PER_PROGRAM)
    dpre = dpre if dpre_out is None else dpre + dpre_out.reshape(N, n)        # H_pre, H_res used elsewhere too
    dres = dres if dres_out is None else dres + dres_out.reshape(N, n, n)
    return dH, dpre, dpost, dres, dwp.sum(0).to(w.dtype)


def upstream(x, pre, grads):
    """grads' dh, dpost and dmixed made whole (zeros where an output fed nothing), in the kernels' layouts."""
    (N, n), (dout, _, dpost, _, dmixed) = pre.shape, grads
    dout = x.new_zeros(N, x.numel() // (N * n)) if dout is None else dout.reshape(N, -1).contiguous()
    dpost = torch.zeros_like(pre) if dpost is None else dpost.reshape(N, n).contiguous().float()
    dmixed = torch.zeros_like(x) if dmixed is None else dmixed.reshape(x.shape).contiguous()
    return dout, dpost, dmixed


@jit
def _hc_bwd(H, A, B, Pre, Res, Mo, R, Rb, Wn, DOut, DMixed, DPost, DH, DPre, DRes, G, Cb, Sums, Asc, Bsc, N, D, M,
            n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
            MP: tl.constexpr, DW_BF16: tl.constexpr):
    """HC's whole read backward on tokens [pid BT, +BT), one launch (in place of _width_norm_bwd, _hc_read_bwd and
    _proj_bwd), _mhc_bwd's three stages: (1) `_width_block_bwd`; (2) the maps' backward on the block's
    BT n rows (`_hc_maps_bwd`, BR >= BT n; dm into G, read back by tiles below); (3) by tiles of BK channels, dH of
    each stream j written once: pre[j] dbranch + sum_o res[o, j] dmixed_o + r_j (dm_j W^T) - x_j r_j^2 <dm_j, m_j>
    / D (the projection is per stream row, K = D), and the block's share of dW^T = (r dm)^T x from the same x, r and
    dm (no GEMM after: x read once). Row pid of Sums: the maps' sums (n^2 + 2n + 2), the gain's (D), then the
    block's dW^T (M, D), so one torch sum over the programs gives all three."""
    pid = tl.program_id(0).to(tl.int64)
    maps_sums = n * n + 2 * n + 2
    part = Sums + pid * (maps_sums + D + M * D)             # this program's row
    c = _width_block_bwd(H, Pre, Rb, DOut, DMixed=DMixed, DPre=DPre, DRes=DRes, Dw=part + maps_sums, t0=pid * BT,
                         Wn=Wn, N=N, D=D, n=n, NP=NP, BK=BK, BT=BT)
    tl.store(Cb + pid * BT + tl.arange(0, BT), c, mask=pid * BT + tl.arange(0, BT) < N)
    tl.debug_barrier()                         # dpre, dres and c are read back below by other threads
    _hc_maps_bwd(DPre, DPost, DRes, Mo, Asc=Asc, Bsc=Bsc, G=G, part=part, row0=pid * BT * n, count=BT * n, NR=N * n,
                 M=M, n=n, BN=BR, MP=MP)
    tl.debug_barrier()                         # dm is read back below by other threads
    tokens = pid * BT + tl.arange(0, BT)
    live, cols = tokens < N, tl.arange(0, MP)
    rb, cb = tl.load(Rb + tokens, mask=live, other=0.0), tl.load(Cb + tokens, mask=live, other=0.0)
    for d0 in tl.range(0, D, BK, num_stages=2):
        dd = d0 + tl.arange(0, BK)
        tile, at, db = _dbranch_tile(H, Pre, Wn, DOut, rb=rb, cb=cb, tokens=tokens, live=live, dd=dd, D=D, n=n)
        wt = _w_tile(A, B, dd, cols=cols, K=D, M=M, SPLIT=True)                # W = [A | B], (BK, MP)
        dwt = tl.full([BK, MP], 0.0, tl.float32)                               # the block's dW^T on channels dd
        for j in tl.static_range(n):
            dx = _width_share(Pre, Res, DMixed, db, tokens=tokens, live=live, at=at, tile=tile, D=D, j=j, n=n)
            row = tokens * n + j
            g = tl.load(G + row[:, None] * M + cols[None, :], mask=live[:, None] & (cols < M)[None, :], other=0.0)
            m = tl.load(Mo + row[:, None] * M + cols[None, :], mask=live[:, None] & (cols < M)[None, :], other=0.0)
            r = tl.load(R + row, mask=live, other=0.0)
            x = tl.load(H + at + j * D, mask=tile, other=0.0).to(tl.float32)
            coef = r * r * _sum(g * m, 1) / D
            dx += r[:, None] * _dot(g, tl.trans(wt), H) - x * coef[:, None]
            tl.store(DH + at + j * D, dx.to(DH.dtype.element_ty), mask=tile)
            if DW_BF16:                 # x exact in bf16; r dm rounded to it, as the cuBLAS GEMM's operand was
                xb, rgb = x.to(tl.bfloat16), (g * r[:, None]).to(tl.bfloat16)
                if UPCAST_DOTS:         # the interpreter's bf16 tl.dot is wrong: the rounded values in fp32
                    xb, rgb = xb.to(tl.float32), rgb.to(tl.float32)
                dwt = tl.dot(tl.trans(xb), rgb, dwt)
            else:
                dwt = _dot(tl.trans(x), g * r[:, None], H, dwt)
        tl.store(part + maps_sums + D + cols[None, :] * D + dd[:, None], dwt,
                 mask=(cols < M)[None, :] & (dd < D)[:, None])


# Triton's (major, minor), read once at import, not at each backward ((0, 0) where it does not import: no kernel runs)
TRITON_VERSION = (0, 0) if hc.triton is None else tuple(int(part) for part in hc.triton.__version__.split(".")[:2])


def dw_bf16(x):
    """`_hc_bwd`'s dW tile from bf16 operands (r dm rounded, as the cuBLAS GEMM had it) instead of tf32: for bf16 or
    fp16 streams under a Triton before 3.9 (the GPU image's 3.6), whose tf32 form spills 80 bytes in the tile loop
    at the register cap; Triton 3.9's is clean in tf32 and spills in bf16 (ptxas sm90, docs/speed.md)."""
    return x.dtype != torch.float32 and TRITON_VERSION < (3, 9)


def bwd_launch(x):
    """_mhc_bwd's and _hc_bwd's warps and registers a thread: at the card's shape (d640, BK 64, bf16 streams, the
    projection in tf32: `_dot`) capped at 128 x 8 warps, 2 CTAs an SM, the 256 programs in one wave, no spill (ptxas
    for sm90, Triton 3.9 and 3.6; uncapped 142 / 136: 1 CTA; `_hc_bwd` with its dW tile: 158 uncapped, no spill at
    the cap under 3.9, 80 bytes of stack under 3.6: docs/speed.md); on fp32 streams (ieee) the cap would spill: none."""
    return dict(num_warps=8, maxnreg=None if x.dtype == torch.float32 else 128)


# The read in one launch each way where it can be (False: the split kernels), so that scripts/kernel_bench.py times
ONE_LAUNCH_BACKWARD = ONE_LAUNCH_FORWARD = True    # both on the device (a kernel is kept where it measures faster)


def mhc_backward(x, saved, grads, iters, sizes):
    """_mhc_bwd: mHC's read backward in one launch where H_pre and H_res have no other use (grads: dh, None, dpost,
    None, dmixed) -> (dH in x's layout; the column sums of the per-program rows, [the maps' 2 MP | the gain's D];
    r dm in x's dtype, dphi's GEMM input)."""
    _, phi, _, a_pre, a_post, a_res, pre, post, logits, res, m, r, gain, rb = saved
    (N, K), n, (M, MP) = x.shape, pre.size(1), (phi.size(1), sizes["MP"])
    D = K // n
    dout, dpost, dmixed = upstream(x, pre, grads)
    programs = hc.triton.cdiv(N, BLOCK_ROWS)
    f32 = dict(device=x.device, dtype=torch.float32)
    dH, dpre, dres, dl = torch.empty_like(x), torch.empty_like(pre), torch.empty_like(res), torch.empty_like(logits)
    scratch = torch.empty(N, 2 * iters - 1, sizes["NP"], **f32)
    rows = torch.empty(programs, 2 * MP + D, **f32)
    rg, cb = torch.empty(N, M, device=x.device, dtype=x.dtype), torch.empty(N, **f32)
    _mhc_bwd[(programs,)](H=x, W=phi, Pre=pre, Post=post, Res=res, Logits=logits, Mo=m, R=r, Rb=rb, Wn=gain,
                          DOut=dout, DMixed=dmixed, DPost=dpost, DH=dH, DPre=dpre, DRes=dres, DL=dl, Scratch=scratch,
                          Cb=cb, RG=rg, Sums=rows, Ap=a_pre, Aq=a_post, Ar=a_res, N=N, D=D, M=M, iters=iters,
                          eps=EPS, BT=BLOCK_ROWS, BK=min(BLOCK_K, pow2(D, 16)), **bwd_launch(x),
                          **sizes)
    return dH, rows.sum(0), rg


def hc_backward(x, saved, grads):
    """_hc_bwd: HC's read backward in one launch where H_pre and H_res have no other use (grads: dh, None, dpost,
    None, dmixed) -> (dH in x's (N n, D) layout; the column sums of the per-program rows, [the maps' n^2 + 2n + 2 |
    the gain's D | dW^T (n + 2, D), row-major]: dW = x^T (r dm) summed in the kernel, no GEMM)."""
    _, A, B, alpha_scale, beta_scale, pre, res, m, r, gain, rb = saved
    (rows, D), (N, n), M = x.shape, pre.shape, A.size(1) + 1
    dout, dpost, dmixed = upstream(x, pre, grads)
    programs = hc.triton.cdiv(N, BLOCK_ROWS)
    f32 = dict(device=x.device, dtype=torch.float32)
    dH, dpre, dres, g = torch.empty_like(x), torch.empty_like(pre), torch.empty_like(res), torch.empty_like(m)
    sums, cb = torch.empty(programs, n * n + 2 * n + 2 + D + M * D, **f32), torch.empty(N, **f32)
    _hc_bwd[(programs,)](H=x, A=A, B=B, Pre=pre, Res=res, Mo=m, R=r, Rb=rb, Wn=gain, DOut=dout, DMixed=dmixed,
                         DPost=dpost, DH=dH, DPre=dpre, DRes=dres, G=g, Cb=cb, Sums=sums, Asc=alpha_scale,
                         Bsc=beta_scale, N=N, D=D, M=M, n=n, NP=pow2(n), BT=BLOCK_ROWS, BR=pow2(BLOCK_ROWS * n),
                         BK=min(BLOCK_K, pow2(D, 16)), MP=pow2(M, 16), DW_BF16=dw_bf16(x), **bwd_launch(x))
    return dH, sums.sum(0)


def projection_backward(x, W, g, m, r, dH):
    """triton_hc._proj_bwd for the rows of x (rows, K) with dH (x's layout) added in place: no autograd add."""
    (rows, K), M = x.shape, W.size(1)
    hc._proj_bwd[(hc.triton.cdiv(rows, BLOCK_ROWS),)](X=x, W=W, G=g, Out=m, R=r, DX=dH, Acc=dH, HAS_ACC=True, N=rows,
                                                      K=K, M=M, BN=BLOCK_ROWS, BK=BLOCK_K, MP=pow2(M, 16))


GEMM_FP32_OUT = {"cuda"}   # devices where torch.mm takes out_dtype=float32 for bf16/fp16 inputs (cuBLAS, torch >= 2.8)


def weight_gradient(x, rg, W, transposed=False):
    """x^T (r dm) = dW (K, M'): cuBLAS over the tokens in x's dtype with fp32 accumulation (rg, the kernels' r dm, is
    in x's dtype), in W's dtype (fp32). Where torch.mm writes fp32 from bf16 itself (GEMM_FP32_OUT) that is one
    launch and dW is never rounded to bf16; elsewhere the product in x's dtype and a cast. transposed: dW^T (M', K)
    instead, contiguous, so that a row of it (HC's dynamic_beta's gradient) is a contiguous (K,) its parameter takes
    as it is."""
    a, b = (rg.t(), x) if transposed else (x.t(), rg)
    if x.device.type in GEMM_FP32_OUT and x.dtype != W.dtype:
        return torch.mm(a, b, out_dtype=W.dtype)
    with fp32_maths(rg):
        return (a @ b).to(W.dtype)


def fused(design, H, site):
    """Whether hc_read runs a fused Function: residuals.MHC or residuals.HC itself with its transport mixed (their
    maps are the kernels'; a subclass could change them) and the branch's norm an RMSNorm (ops.RMSNorm, not centred),
    on tensors the kernels run on."""
    kind, norm = type(design).__name__, site.norm
    rms = type(norm).__name__ == "RMSNorm" and not norm.center
    return (kind == "MHC" or kind == "HC" and design.mixed) and rms and runs_here(H)
