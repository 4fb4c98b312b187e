"""
depthbench/kernels/triton_hc.py: HC's and mHC's connection as Triton kernels, forward and backward, under the names of
the ops.py functions they replace (ops.TWO_BODIES: `normed_projection`, `width_connection`, `depth_connection`,
`sinkhorn`), so a namespace can take them in place of depthbench/kernels/cpu.py's. Every kernel loads its inputs in
their own dtype (bf16 or fp32), computes in fp32 in registers, and stores the residual streams in the dtype they came
in, but depth_connection, the write: in bf16 under bf16 autocast (`storage_dtype`: "bf16 in and out, fp32 inside"),
so that from the first write on the streams are bf16 on the GPU path (half the bytes); without autocast they stay
fp32 and every output is what ops.py's body returns. The coefficients are fp32.
Each body equals ops.py's in forward and every gradient (tests/test_triton_hc.py, under TRITON_INTERPRET=1), runs its
kernels on CUDA tensors (or CPU ones under the interpreter) and hands any other call to cpu.py's body (`runs_here`):
the CPU path does not change. `BODIES`: the "triton" namespace's (depthbench/kernels); triton is optional.

The kernels (N tokens, n streams of width D; one program per token or per block of tokens):

- `normed_projection(x, W, eps)` = (x / rms(x)) @ W, x (..., K), W (K, M), M = n^2 + 2n (mHC, K = nD) or n + 2
  (HC, K = D, per stream). `_proj_fwd`: one pass over x per block of rows, accumulating x @ W (tl.dot: `_dot`)
  and sum(x^2) together; out = r (x @ W), r = rsqrt(mean(x^2) + eps) -- the norm and the skinny GEMM fused, x read
  once. Backward, `_proj_bwd`: dx = r (g @ W^T) - x r^2 <g, out> / K, one pass over x (out and r kept: M + 1 floats a
  row); dW = x^T (r g), a GEMM over the tokens, is cuBLAS's in x's dtype. Test: test_normed_projection_equals_reference.
- `sinkhorn(logits, iters, eps)`: Liger's Sinkhorn-Knopp (ops.sinkhorn): P = softmax_row(logits), M = P + eps, then
  2 iters - 1 alternating normalisations, columns first, M <- M / (sum + eps). `_sinkhorn_fwd` holds each token's
  n x n matrix in registers for all of them; only the logits come in and H_res goes out. Backward, `_sinkhorn_bwd`
  (the mHC paper's selective recomputation: autograd keeps only the logits, not the reference's 39 iterates): it
  runs the forward again from the logits, writing each step's divisor d_k (n floats a token, 39 n at iters = 20) to
  a scratch buffer that the same program reads back, then goes back through the steps, last first: with out =
  M_k / d_k, dM_k = (dout - sums(dout out)) / d_k over step k's axis, and M_k = out d_k restores step k's input (a
  multiplication, so no cancellation); last the softmax's, dlogits = P (dP - <dP, P>_row). O(iters) work per token.
  Test: test_sinkhorn_equals_reference.
- `width_connection(H, pre, res)`: branch = sum_s pre[s] h_s and mixed_o = sum_s res[o, s] h_s (ops.width_connection,
  HC's eq. 3-4). `_width_fwd`: one program per token reads its n streams once and writes both. Backward,
  `_width_bwd`: dh_s = pre[s] dbranch + sum_o res[o, s] dmixed_o, dpre[s] = <h_s, dbranch>, dres[o, s] =
  <dmixed_o, h_s>, the reductions over D in the program's registers (no atomics). Test:
  test_width_connection_equals_reference.
- `depth_connection(mixed, post, y)`: h'_o = mixed_o + post[o] y (ops.depth_connection). `_depth_fwd` one pass;
  backward `_depth_bwd`: dy = sum_o post[o] dout_o, dpost[o] = <dout_o, y>; dmixed = dout, no kernel. Test:
  test_depth_connection_equals_reference.

A model with these bodies is kernels "reference"'s (test_model_with_triton_bodies); every kernel compiles for sm_90
without a GPU (test_every_kernel_compiles_for_the_h100_and_h200); `traffic`: bytes and launches (scripts/roofline.py).
Why the mixes stay split, not one fused write: docs/speed.md#kernels. depth_connection's launches are ops (graph_ops).
"""
from __future__ import annotations  # Triton reads `x: tl.constexpr` as text: this module imports without triton

import torch

from depthbench.kernels import cpu as cpu_bodies
from depthbench.kernels.graph_ops import autograd_op, call, graph_op, keep
from ops import fp32_maths

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # the CPU path never needs it (runs_here)
    triton = tl = None
    HAVE_TRITON = False

NAMES = ("normed_projection", "width_connection", "depth_connection", "sinkhorn")  # the ops.TWO_BODIES names here
BLOCK_D = 128        # channels a stream kernel handles per step of its loop over D
BLOCK_ROWS = 16      # rows of x per program of the projection (tl.dot needs >= 16; mHC at 4,096 tokens: 256 programs)
BLOCK_K = 64         # columns of x per step of the projection's loop over K
BLOCK_TOKENS = 32    # tokens per program of Sinkhorn (each an n x n matrix in registers)


def jit(fn):
    """triton.jit where triton imports; the plain function otherwise (never launched: see runs_here)."""
    return triton.jit(fn) if HAVE_TRITON else fn


def interpreted():
    """Whether this module's kernels were decorated for Triton's CPU interpreter (TRITON_INTERPRET=1 when it was
    imported): then they run on CPU tensors."""
    return type(_width_fwd).__name__ == "InterpretedFunction"


def runs_here(t):
    """Whether the kernels can run on t's device: triton imports, and t is on CUDA (or on the CPU under the
    interpreter). Elsewhere each body hands its arguments to cpu.py's, so the CPU path is unchanged."""
    if not HAVE_TRITON:
        return False
    return t.is_cuda or (t.device.type == "cpu" and interpreted())


def pow2(n, least=1):
    """The smallest power of two >= max(n, least): a Triton block's side."""
    return max(least, 1 << (int(n) - 1).bit_length())


# Sums and maxima as tl.reduce (a core builtin) with triton.language's own combine functions, zeros as tl.full:
# tl.sum, tl.max and tl.zeros are @jit functions of triton's, decorated when triton is first imported, so in a
# process that imported triton before setting TRITON_INTERPRET (a test suite) they stay compiled and the interpreter
# cannot call them; the interpreter runs a reduce with these two combine functions as numpy's sum and max. On the
# GPU this is exactly what tl.sum and tl.max compile to.

@jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@jit
def _dot(a, b, X, acc=None):
    """tl.dot to fp32 (added to acc): exact ("ieee") on fp32 streams at X; tf32 (tensor cores) on bf16/fp16 ones."""
    return tl.dot(a, b, acc, input_precision="ieee" if X.dtype.element_ty == tl.float32 else "tf32")


# ----------------------------------------------------------------------------- normed_projection

@jit
def _w_tile(W, Wlast, ks, cols, K, M, SPLIT: tl.constexpr):
    """Rows ks of W (K, M), columns cols (fp32, zero outside); SPLIT: W is two tensors, its first M - 1 columns
    (K, M - 1) at W and its last (K,) at Wlast (HC's dynamic_alpha and dynamic_beta, never concatenated)."""
    at = W + ks[:, None] * M + cols[None, :]
    if SPLIT:                                           # one load (a pointer a column): the tile stays a plain load
        at = tl.where((cols == M - 1)[None, :], Wlast + ks[:, None] + 0 * cols[None, :],
                      W + ks[:, None] * (M - 1) + cols[None, :])
    return tl.load(at, mask=(ks < K)[:, None] & (cols < M)[None, :], other=0.0).to(tl.float32)


@jit
def _normed_rows(X, W, Out, R, N, K, M, eps, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr,
                 Wlast=None, SPLIT: tl.constexpr = False):
    """Rows [pid BN, +BN) of x (N, K): out = r (x @ W) (N, M) stored to Out, r = rsqrt(mean(x^2) + eps) (N,) to R,
    one pass over x, fp32 inside; W (K, M) (or, SPLIT, its first M - 1 columns with the last at Wlast: `_w_tile`),
    its columns padded to MP -> (rows, cols, out (BN, MP)), for the fused reads (triton_hc_read.py) to go on from."""
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    cols = tl.arange(0, MP)
    acc = tl.full([BN, MP], 0.0, tl.float32)
    ss = tl.full([BN], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(X + rows[:, None] * K + ks[None, :], mask=(rows < N)[:, None] & (ks < K)[None, :],
                    other=0.0).to(tl.float32)
        w = _w_tile(W, Wlast, ks, cols=cols, K=K, M=M, SPLIT=SPLIT)
        acc += _dot(x, w, X)
        ss += _sum(x * x, 1)
    r = 1.0 / tl.sqrt(ss / K + eps)
    out = acc * r[:, None]
    tl.store(Out + rows[:, None] * M + cols[None, :], out, mask=(rows < N)[:, None] & (cols < M)[None, :])
    tl.store(R + rows, r, mask=rows < N)
    return rows, cols, out


@jit
def _proj_fwd(X, W, Out, R, N, K, M, eps, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr):
    """Rows [pid BN, +BN) of x (N, K): out = r (x @ W) (N, M), r = rsqrt(mean(x^2) + eps) (N,), one pass over x."""
    _normed_rows(X, W, Out, R, N=N, K=K, M=M, eps=eps, BN=BN, BK=BK, MP=MP)


@jit
def _proj_bwd(X, W, G, Out, R, DX, Acc, N, K, M, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr,
              HAS_ACC: tl.constexpr):
    """dx = r (g @ W^T) - x r^2 <g, out> / K for rows [pid BN, +BN): the gradient through x @ W and through r; with
    HAS_ACC, plus Acc (x's layout: the fused read's other share of dH, added here instead of by autograd)."""
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    cols = tl.arange(0, MP)
    gmask = (rows < N)[:, None] & (cols < M)[None, :]
    g = tl.load(G + rows[:, None] * M + cols[None, :], mask=gmask, other=0.0).to(tl.float32)
    out = tl.load(Out + rows[:, None] * M + cols[None, :], mask=gmask, other=0.0)
    r = tl.load(R + rows, mask=rows < N, other=0.0)
    coef = r * r * _sum(g * out, 1) / K                  # <g, out> = r <g, x W>: the gradient through r
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        xmask = (rows < N)[:, None] & (ks < K)[None, :]
        x = tl.load(X + rows[:, None] * K + ks[None, :], mask=xmask, other=0.0).to(tl.float32)
        w = tl.load(W + ks[:, None] * M + cols[None, :], mask=(ks < K)[:, None] & (cols < M)[None, :],
                    other=0.0).to(tl.float32)
        gw = _dot(g, tl.trans(w), X)                             # (BN, BK): g @ W^T
        dx = r[:, None] * gw - x * coef[:, None]
        if HAS_ACC:
            dx += tl.load(Acc + rows[:, None] * K + ks[None, :], mask=xmask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * K + ks[None, :], dx.to(DX.dtype.element_ty), mask=xmask)


class NormedProjection(torch.autograd.Function):
    """ops.normed_projection: x (..., K), W (K, M) -> (x / rms(x)) @ W (..., M) in fp32 (`_proj_fwd`, `_proj_bwd`)."""

    @staticmethod
    def forward(ctx, x, W, eps):
        K, M = W.shape
        x2, Wc = x.reshape(-1, K).contiguous(), W.contiguous()
        N = x2.size(0)
        out = torch.empty(N, M, device=x.device, dtype=torch.float32)
        r = torch.empty(N, device=x.device, dtype=torch.float32)
        sizes = dict(N=N, K=K, M=M, BN=BLOCK_ROWS, BK=BLOCK_K, MP=pow2(M, 16))
        _proj_fwd[(triton.cdiv(N, BLOCK_ROWS),)](X=x2, W=Wc, Out=out, R=r, eps=eps, **sizes)
        ctx.save_for_backward(x2, Wc, out, r)
        ctx.sizes, ctx.x_shape, ctx.w_dtype = sizes, x.shape, W.dtype
        return out.view(*x.shape[:-1], M)

    @staticmethod
    def backward(ctx, g):
        x2, Wc, out, r = ctx.saved_tensors
        g2 = g.reshape(out.shape).contiguous().float()
        dx = torch.empty_like(x2)
        _proj_bwd[(triton.cdiv(out.size(0), BLOCK_ROWS),)](X=x2, W=Wc, G=g2, Out=out, R=r, DX=dx, Acc=dx,
                                                           HAS_ACC=False, **ctx.sizes)
        with fp32_maths(g2):              # sum over the tokens of (r x)^T g: cuBLAS, in x's dtype (fp32 accumulation)
            dW = x2.t() @ (g2 * r[:, None]).to(x2.dtype)
        return dx.view(ctx.x_shape), dW.to(ctx.w_dtype), None


def normed_projection(x, W, eps):
    """(x / rms(x)) @ W, no gain, in fp32: ops.normed_projection as one Triton pass over x (NormedProjection)."""
    if not runs_here(x):
        return cpu_bodies.normed_projection(x, W, eps)
    return NormedProjection.apply(x, W, eps)


# ----------------------------------------------------------------------------- sinkhorn

@jit
def _load_softmax(L, N, n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    """Tokens [pid BT, +BT) of the (N, n, n) logits -> row softmax P (BT, NP, NP; 0 where padded), offsets, mask."""
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    i = tl.arange(0, NP)
    cell = (i < n)[None, :, None] & (i < n)[None, None, :]                          # (1, NP, NP)
    idx = t[:, None, None] * n * n + i[None, :, None] * n + i[None, None, :]
    mask = (t < N)[:, None, None] & cell
    x = tl.load(L + idx, mask=mask, other=0.0).to(tl.float32)
    x = tl.where((i < n)[None, None, :], x, float("-inf"))                          # padded columns: no weight
    e = tl.exp(x - _max(x, 2)[:, :, None])
    return e / _sum(e, 2)[:, :, None], idx, mask, cell


@jit
def _axis_sums(M, k):
    """(BT, NP) sums of M (BT, NP, NP) over step k's axis: per column (over the rows i) for even k, else per row."""
    return tl.where(k % 2 == 0, _sum(M, 1), _sum(M, 2))


@jit
def _spread(v, k):
    """v (BT, NP) of step k's axis sums back over (BT, NP, NP): column j's value down column j, or row i's along it."""
    return tl.where(k % 2 == 0, v[:, None, :], v[:, :, None])


@jit
def _sinkhorn_fwd(L, Out, N, iters, eps, n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    """ops.sinkhorn on BT tokens: P = softmax_row(logits), M = P + eps, then 2 iters - 1 normalisations
    M <- M / (sums + eps), columns first, in registers (`_sinkhorn_block`)."""
    _sinkhorn_block(L=L, Out=Out, N=N, iters=iters, eps=eps, n=n, NP=NP, BT=BT)


@jit
def _sinkhorn_block(L, Out, N, iters, eps, n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    """_sinkhorn_fwd's work on the program's BT tokens: also the fused read's (`_mhc_read_fwd`)."""
    P, idx, mask, cell = _load_softmax(L, N, n=n, NP=NP, BT=BT)
    M = tl.where(cell, P + eps, 0.0)
    for k in range(0, 2 * iters - 1):
        M = M / _spread(_axis_sums(M, k) + eps, k)
    tl.store(Out + idx, M, mask=mask)


@jit
def _sinkhorn_bwd(L, G, DL, Scratch, N, iters, eps, n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    """dlogits from dH_res on BT tokens, as the module's docstring says (`sinkhorn`): the forward again, each step's
    divisor to Scratch, then back through the steps; padded entries (n < NP) stay 0 (`_sinkhorn_block_bwd`)."""
    _sinkhorn_block_bwd(L=L, G=G, DL=DL, Scratch=Scratch, N=N, iters=iters, eps=eps, n=n, NP=NP, BT=BT)


@jit
def _sinkhorn_block_bwd(L, G, DL, Scratch, N, iters, eps, n: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    """_sinkhorn_bwd's work on the program's BT tokens: also the fused read's backward (`_mhc_read_bwd`)."""
    P, idx, mask, cell = _load_softmax(L, N, n=n, NP=NP, BT=BT)
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    i = tl.arange(0, NP)
    steps = 2 * iters - 1
    at = t[:, None] * steps * NP + i[None, :]                   # (BT, NP): step 0's divisor in Scratch (N, steps, NP)
    M = tl.where(cell, P + eps, 0.0)
    for k in range(0, steps):
        d = _axis_sums(M, k) + eps
        tl.store(Scratch + at + k * NP, d, mask=(t < N)[:, None])
        M = M / _spread(d, k)
    # read back below in the loads' layout, maybe by other threads: a barrier makes the loop's stores visible
    tl.debug_barrier()
    dM = tl.load(G + idx, mask=mask, other=0.0).to(tl.float32)
    for back in range(0, steps):
        k = steps - 1 - back
        d = _spread(tl.load(Scratch + at + k * NP, mask=(t < N)[:, None], other=1.0), k)
        dM = tl.where(cell, (dM - _spread(_axis_sums(dM * M, k), k)) / d, 0.0)
        M = M * d
    dL = P * (dM - _sum(dM * P, 2)[:, :, None])
    tl.store(DL + idx, dL.to(DL.dtype.element_ty), mask=mask)


class Sinkhorn(torch.autograd.Function):
    """ops.sinkhorn on (..., n, n) logits -> fp32 (`_sinkhorn_fwd`); backward keeps only the logits
    (`_sinkhorn_bwd`)."""

    @staticmethod
    def forward(ctx, logits, iters, eps):
        n = logits.size(-1)
        L = logits.reshape(-1, n, n).contiguous()
        out = torch.empty(L.shape, device=L.device, dtype=torch.float32)
        ctx.sizes = dict(N=L.size(0), iters=iters, eps=eps, n=n, NP=pow2(n), BT=BLOCK_TOKENS)
        _sinkhorn_fwd[(triton.cdiv(L.size(0), BLOCK_TOKENS),)](L=L, Out=out, **ctx.sizes)
        ctx.save_for_backward(L)
        return out.view(logits.shape)

    @staticmethod
    def backward(ctx, g):
        (L,) = ctx.saved_tensors
        dL = torch.empty_like(L)
        sizes = ctx.sizes
        scratch = torch.empty(sizes["N"], 2 * sizes["iters"] - 1, sizes["NP"], device=L.device, dtype=torch.float32)
        grid = (triton.cdiv(sizes["N"], BLOCK_TOKENS),)
        _sinkhorn_bwd[grid](L=L, G=g.reshape(L.shape).contiguous(), DL=dL, Scratch=scratch, **sizes)
        return dL.view(g.shape), None, None


def sinkhorn(logits, iters=20, eps=1e-6):
    """ops.sinkhorn with each token's n x n matrix in registers for all 2 iters - 1 steps (Sinkhorn)."""
    if not runs_here(logits):
        return cpu_bodies.sinkhorn(logits, iters, eps)
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least 1 iteration, got {iters}")
    return Sinkhorn.apply(logits, iters, eps)


# ----------------------------------------------------------------------------- width_connection

@jit
def _width_fwd(H, Pre, Res, Branch, Mixed, D, n: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr):
    """Token pid: branch = sum_s pre[s] h_s (D,), mixed_o = sum_s res[o, s] h_s (n, D); the streams read once."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, NP)
    pre = tl.load(Pre + t * n + s, mask=s < n, other=0.0).to(tl.float32)                        # (s,)
    res = tl.load(Res + t * n * n + s[:, None] * n + s[None, :], mask=(s < n)[:, None] & (s < n)[None, :],
                  other=0.0).to(tl.float32)                                                     # (o, s)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = (s < n)[:, None] & (d < D)[None, :]
        h = tl.load(H + t * n * D + s[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)  # (s, BD)
        branch = _sum(pre[:, None] * h, 0)
        mixed = _sum(res[:, :, None] * h[None, :, :], 1)                                # (o, BD)
        tl.store(Branch + t * D + d, branch.to(Branch.dtype.element_ty), mask=d < D)
        tl.store(Mixed + t * n * D + s[:, None] * D + d[None, :], mixed.to(Mixed.dtype.element_ty), mask=m)


@jit
def _width_bwd(H, Pre, Res, DBranch, DMixed, DH, DPre, DRes, D, n: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr):
    """Token pid: dh_s = pre[s] dbranch + sum_o res[o, s] dmixed_o; dpre[s] = <h_s, dbranch>, dres[o, s] =
    <dmixed_o, h_s>, summed over D in registers."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, NP)
    nn = (s < n)[:, None] & (s < n)[None, :]
    pre = tl.load(Pre + t * n + s, mask=s < n, other=0.0).to(tl.float32)
    res = tl.load(Res + t * n * n + s[:, None] * n + s[None, :], mask=nn, other=0.0).to(tl.float32)   # (o, s)
    dpre = tl.full([NP], 0.0, tl.float32)
    dres = tl.full([NP, NP], 0.0, tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = (s < n)[:, None] & (d < D)[None, :]
        rows = t * n * D + s[:, None] * D + d[None, :]
        h = tl.load(H + rows, mask=m, other=0.0).to(tl.float32)                                # (s, BD)
        db = tl.load(DBranch + t * D + d, mask=d < D, other=0.0).to(tl.float32)                # (BD,)
        dm = tl.load(DMixed + rows, mask=m, other=0.0).to(tl.float32)                          # (o, BD)
        dh = pre[:, None] * db[None, :] + _sum(res[:, :, None] * dm[:, None, :], 0)     # (s, BD)
        tl.store(DH + rows, dh.to(DH.dtype.element_ty), mask=m)
        dpre += _sum(h * db[None, :], 1)
        dres += _sum(dm[:, None, :] * h[None, :, :], 2)
    tl.store(DPre + t * n + s, dpre, mask=s < n)
    tl.store(DRes + t * n * n + s[:, None] * n + s[None, :], dres, mask=nn)


def stream_sizes(H):
    """(tokens, n, D) of streams (..., n, D), and the launch's constants."""
    n, D = H.shape[-2:]
    return H.numel() // (n * D), dict(D=D, n=n, NP=pow2(n), BD=min(BLOCK_D, pow2(D)))


class WidthConnection(torch.autograd.Function):
    """ops.width_connection: H (..., n, D), pre (..., n), res (..., n, n) -> (branch (..., D), mixed (..., n, D)),
    both in H's dtype (`_width_fwd`, `_width_bwd`)."""

    @staticmethod
    def forward(ctx, H, pre, res):
        N, sizes = stream_sizes(H)
        Hc, prec, resc = H.contiguous(), pre.contiguous(), res.contiguous()
        branch = torch.empty(H.shape[:-2] + H.shape[-1:], device=H.device, dtype=H.dtype)
        mixed = torch.empty_like(Hc)
        _width_fwd[(N,)](H=Hc, Pre=prec, Res=resc, Branch=branch, Mixed=mixed, **sizes)
        ctx.save_for_backward(Hc, prec, resc)
        ctx.N, ctx.sizes, ctx.dtypes = N, sizes, (pre.dtype, res.dtype)
        return branch, mixed

    @staticmethod
    def backward(ctx, dbranch, dmixed):
        Hc, prec, resc = ctx.saved_tensors
        branch_shape = Hc.shape[:-2] + Hc.shape[-1:]
        dbranch = Hc.new_zeros(branch_shape) if dbranch is None else dbranch.contiguous()   # None: output unused
        dmixed = torch.zeros_like(Hc) if dmixed is None else dmixed.contiguous()
        dH = torch.empty_like(Hc)
        dpre = torch.empty(prec.shape, device=Hc.device, dtype=torch.float32)
        dres = torch.empty(resc.shape, device=Hc.device, dtype=torch.float32)
        _width_bwd[(ctx.N,)](H=Hc, Pre=prec, Res=resc, DBranch=dbranch, DMixed=dmixed, DH=dH, DPre=dpre, DRes=dres,
                             **ctx.sizes)
        return dH, dpre.to(ctx.dtypes[0]), dres.to(ctx.dtypes[1])


def width_connection(H, pre, res):
    """HC's width connection, ops.width_connection, as one read of the streams per token (WidthConnection)."""
    if not runs_here(H):
        return cpu_bodies.width_connection(H, pre, res)
    return WidthConnection.apply(H, pre, res)


# ----------------------------------------------------------------------------- depth_connection

@jit
def _depth_fwd(Mixed, Post, Y, Out, D, n: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr):
    """Token pid: h'_o = mixed_o + post[o] y."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, NP)
    post = tl.load(Post + t * n + s, mask=s < n, other=0.0).to(tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = (s < n)[:, None] & (d < D)[None, :]
        rows = t * n * D + s[:, None] * D + d[None, :]
        mixed = tl.load(Mixed + rows, mask=m, other=0.0).to(tl.float32)
        y = tl.load(Y + t * D + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(Out + rows, (mixed + post[:, None] * y[None, :]).to(Out.dtype.element_ty), mask=m)


@jit
def _depth_bwd(DOut, Post, Y, DPost, DY, D, n: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr):
    """Token pid: dy = sum_o post[o] dout_o, dpost[o] = <dout_o, y> (summed over D in registers)."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, NP)
    post = tl.load(Post + t * n + s, mask=s < n, other=0.0).to(tl.float32)
    dpost = tl.full([NP], 0.0, tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = (s < n)[:, None] & (d < D)[None, :]
        dout = tl.load(DOut + t * n * D + s[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.load(Y + t * D + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(DY + t * D + d, _sum(post[:, None] * dout, 0).to(DY.dtype.element_ty), mask=d < D)
        dpost += _sum(dout * y[None, :], 1)
    tl.store(DPost + t * n + s, dpost, mask=s < n)


def storage_dtype(streams):
    """The dtype the streams are written in: autocast's (bf16) when autocast is on for their device (the issue's "bf16
    in and out, fp32 inside"; triton_attnres.storage_dtype's rule for its bank), else their own. The model starts
    the streams in fp32 (residuals.HC.init_stream); from the first write on they are bf16 under autocast."""
    if torch.is_autocast_enabled(streams.device.type):
        return torch.get_autocast_dtype(streams.device.type)
    return streams.dtype


@graph_op("hc_depth", "(Tensor mixed, Tensor post, Tensor y, ScalarType dtype) -> Tensor",
          lambda mixed, post, y, dtype: mixed.new_empty(mixed.shape, dtype=dtype))
def depth_forward(mixed, post, y, dtype):
    """ops.depth_connection: mixed (..., n, D), post (..., n), y (..., D) -> mixed + post (x) y in dtype."""
    N, sizes = stream_sizes(mixed)
    postc, yc = post.contiguous(), y.contiguous()
    out = torch.empty(mixed.shape, device=mixed.device, dtype=dtype)
    _depth_fwd[(N,)](Mixed=mixed.contiguous(), Post=postc, Y=yc, Out=out, **sizes)
    return out


@graph_op("hc_depth_bwd", "(Tensor dout, Tensor post, Tensor y) -> (Tensor, Tensor)",
          lambda dout, post, y: (post.new_empty(post.shape, dtype=torch.float32), y.new_empty(y.shape)))
def depth_backward(dout, post, y):                       # `_depth_bwd` -> (dpost fp32, dy); dmixed = dout, no kernel
    (N, sizes), postc, yc, dout = stream_sizes(dout), post.contiguous(), y.contiguous(), dout.contiguous()
    dpost, dy = torch.empty(postc.shape, device=dout.device, dtype=torch.float32), torch.empty_like(yc)
    _depth_bwd[(N,)](DOut=dout, Post=postc, Y=yc, DPost=dpost, DY=dy, **sizes)
    return dpost, dy


def _depth_gradients(ctx, dout):
    dpost, dy = call(depth_backward, dout, *ctx.saved_tensors)
    return dout.to(ctx.dtypes[0]), dpost.to(ctx.dtypes[1]), dy, None


depth_call = autograd_op(depth_forward, _depth_gradients, lambda ctx, inputs, output: keep(
    ctx, inputs[1:3], dtypes=(inputs[0].dtype, inputs[1].dtype)))          # post and y; mixed's and post's dtypes


def depth_connection(mixed, post, y):
    """HC's depth connection, ops.depth_connection, as one pass over the streams (`depth_forward`, in storage_dtype)."""
    if not runs_here(mixed):
        return cpu_bodies.depth_connection(mixed, post, y)
    return depth_call(mixed, post, y, storage_dtype(mixed))


# ----------------------------------------------------------------------------- traffic, for the roofline estimate

def traffic(design, tokens, d_model, n=4, stream_bytes=2, y_bytes=2, iters=20, recompute=True, fused=True,
            gemm_fp32_out=True):
    """HBM bytes each launch of one sublayer's connection reads and writes, and its launches, forward and backward:
    a list of dicts {kernel, pass, launches, read, written, launch} (`row`; launch: the Triton kernel, by function
    name, or the torch op that moves the row's bytes; below in brackets where it is not the name beside the row),
    for scripts/roofline.py. design "hc" or "mhc"; tokens N = B T; stream_bytes: the streams' element size (2, the
    GPU path's default: bf16 under bf16 autocast, `storage_dtype`; 4 without autocast); y_bytes: the branch output's
    (2 under bf16 autocast); recompute: residuals.HC's (its default, on): read's maths runs again in the backward;
    gemm_fp32_out: the fused read's dW GEMM writes fp32 from bf16 itself (torch.mm's out_dtype, on CUDA:
    triton_hc_read.GEMM_FP32_OUT), else it writes the streams' dtype and a cast follows (the CPU).
    Coefficients are fp32 (4 bytes), W an fp32 parameter. Every tensor a launch touches is counted once per launch
    (a kernel reads each input once), the scratch of Sinkhorn's backward too (an upper bound: it is read back by the
    program that wrote it, mostly from L2). What the path runs, residuals.HC's read and write with these bodies:

        S = N n D stream_bytes (the n streams), c = N n 4 (pre or post), R = N n^2 4 (res or its logits)
        normed_projection, rows x K, M columns (mHC: N x nD, M = n^2 + 2n; HC: Nn x D, M = n + 2), X = rows K sb:
          forward   _proj_fwd  read X + 4 K M           write 4 rows M + 4 rows            (out, r)
          backward  _proj_bwd  read X + 4 K M + 8 rows M + 4 rows   write X                (dx)
                    dW ["r g, dW GEMM (and casts)": torch, r g, then x^T (r g) in x's dtype)  read 4 rows M +
                    4 rows + X + sb rows M, write 4 rows M + sb K M, 2 launches; when the streams are not fp32, +2:
                    r g cast to x's dtype (read 4 rows M, write sb rows M) and dW to fp32 (read sb K M, write 4 K M)
        sinkhorn:  _sinkhorn_fwd read R, write R; _sinkhorn_bwd read 2R, write R, scratch 4 N (2 iters - 1) n both
          ways (mHC runs it inside the fused read: below)
        width_connection:  _width_fwd read S + c + R, write S + N D sb (mixed, branch)
                           _width_bwd read 2S + N D sb + c + R, write S + c + R
        depth_connection:  _depth_fwd read S + c + N D y_bytes, write S
                           _depth_bwd read S + c + N D y_bytes, write c + N D y_bytes (dmixed is dout: no kernel)
        maps ["maps' elementwise ops"; HC: torch glue between the kernels, `glue`): the tanh and affine maps, the
          copies that make pre and res contiguous for the width kernel; their backward (autograd's select/slice
          backward, the sums of the scales' gradients, the parameters' gradients)
        dH ["add"] (HC): H feeds normed_projection and width_connection: autograd adds their dH, read 2S, write S
        fused (the default): the read through triton_hc_read.py (ops.hc_read) in place of the projection, the glue,
          Sinkhorn, the width connection, the branch's norm, the dH add and the recompute (`fused_read`)
        recompute (pieces only: ops.hc_read's torch.utils.checkpoint): the backward runs read's forward rows again
          first (each on its kernel: _proj_fwd, mHC's _sinkhorn_fwd, the maps' glue, _width_fwd) and the branch's
          RMSNorm but its gain ["RMSNorm's ops (and cast)": 5 launches, +1 cast when the branch is not fp32], which
          Pre-LN runs once"""
    if design not in ("hc", "mhc"):
        raise ValueError(f"traffic: design is 'hc' or 'mhc', got {design!r}")
    N, D, sb = tokens, d_model, stream_bytes
    S, c = N * n * D * sb, N * n * 4
    depth = [row("depth_connection", "forward", S + c + N * D * y_bytes, S, launch="_depth_fwd"),
             row("depth_connection", "backward", S + c + N * D * y_bytes, c + N * D * y_bytes, launch="_depth_bwd")]
    if fused:                                # triton_hc_read.py: the fused read, no checkpoint (nothing recomputed)
        fwd, bwd = fused_read(design, N=N, n=n, D=D, sb=sb, iters=iters, gemm_fp32_out=gemm_fp32_out)
        return fwd + depth + bwd
    fwd, bwd = pieces(design, N=N, n=n, D=D, sb=sb, iters=iters)
    again = [dict(r, **{"pass": "backward (recompute)"}) for r in fwd] + [norm_recompute(N, D, sb)]
    return fwd + depth + (again if recompute else []) + bwd


def pieces(design, N, n, D, sb, iters):
    """The read's rows of `traffic` through triton_hc.py's pieces (ops.hc_read on them): the projection, (mHC:
    Sinkhorn,) the maps' glue, the width connection, dW, autograd's add of the two dH -> (forward, backward rows)."""
    S, c, R = N * n * D * sb, N * n * 4, N * n * n * 4
    rows, K, M = (N, n * D, n * n + 2 * n) if design == "mhc" else (N * n, D, n + 2)
    X, cast = rows * K * sb, sb != 4                          # cast: dW's, r g to x's dtype and dW back to fp32
    dW = row("normed_projection.dW", "backward", 4 * rows * M + 4 * rows + cast * 4 * rows * M + X + rows * M * sb
             + cast * K * M * sb, 4 * rows * M + cast * sb * rows * M + K * M * sb + cast * 4 * K * M,
             launches=2 + 2 * cast, launch="r g, dW GEMM (and casts)")
    glue_fwd, glue_bwd = glue(design, N, n, M)
    sinkhorn = ([], [])
    if design == "mhc":
        scratch = 4 * N * (2 * iters - 1) * pow2(n)                 # Sinkhorn's divisors, n padded to a power of 2
        sinkhorn = ([row("sinkhorn", "forward", R, R, launch="_sinkhorn_fwd")],
                    [row("sinkhorn", "backward", 2 * R + scratch, R + scratch, launch="_sinkhorn_bwd")])
    proj_bwd = row("normed_projection", "backward", X + 4 * K * M + 8 * rows * M + 4 * rows, X, launch="_proj_bwd")
    fwd = [row("normed_projection", "forward", X + 4 * K * M, 4 * rows * M + 4 * rows, launch="_proj_fwd")] + \
        sinkhorn[0] + [glue_fwd, row("width_connection", "forward", S + c + R, S + N * D * sb, launch="_width_fwd")]
    bwd = [row("width_connection", "backward", 2 * S + N * D * sb + c + R, S + c + R, launch="_width_bwd"),
           glue_bwd] + sinkhorn[1] + [proj_bwd, dW, row("dH (autograd's add)", "backward", 2 * S, S, launch="add")]
    return fwd, bwd


def fused_read(design, N, n, D, sb, iters, gemm_fp32_out=True):
    """The fused read's rows of `traffic`, S = N n D sb, c = N n 4, R = N n^2 4, the projection's rows x K and
    X = rows K sb (mHC: N x nD; HC: N n x D), M its columns (the backward in one launch: where H_pre and H_res have
    no other use, a model's). Forward, one launch (`_mhc_fwd`, `_hc_fwd`; HC where n does not divide BLOCK_ROWS:
    `_hc_read_fwd`, then `_width_norm_fwd` for the second part): the maps, then per token the width connection and
    the branch's norm (the branch never stored; the gain D floats): read S + c + R + 4 D, write S (mixed) + N D sb
    (h) + 4 N (rb) (the streams read twice, counted twice: an upper bound, they are mostly in L2). The maps:
      mHC forward   read X + 4 K M + R (the logits back, for Sinkhorn), write pre, post, logits, res, m and r
                    (2c + 2R + 4 N M + 4 N)
          backward  _mhc_bwd  per token: read H, dmixed (2S), dout, pre, rb, the gain; write dpre, dres, c; the
                    maps: read logits, dres, dlogits back (3R), pre, post, their gradients (4c), m, r, Sinkhorn's
                    scratch (4 N (2 iters - 1) pow2(n)), write dlogits, r dm (sb N M), the scratch; by tiles, the
                    per-token reads again (from HBM: an upper bound, they are mostly in L2), res, m, r, phi (4 K M),
                    write dH (S); rows of the maps' and gain's sums (4 ceil(N / 16) (2 MP + D)), one torch "sum";
                    dphi: "dW GEMM (and cast)" (read X + sb N M, write 4 K M; without gemm_fp32_out sb K M, a cast)
      HC  forward   read X + 4 K M (W from dynamic_alpha and dynamic_beta, no concatenation), write pre, post, res,
                    m and r (2c + R + 4 rows M + 4 rows)
          backward  _hc_bwd  as _mhc_bwd, with HC's maps (read dpre, dpost, dres, m and r; write dm, read back by the
                    tiles) and its sums in the parameters' layout (n^2 + 2n + 2 and D a row), then each program's dW^T
                    (4 M D a row; no GEMM, no r dm); dW^T's first n + 1 rows "copy"-ed into dynamic_alpha's layout
    -> (forward rows, backward rows)."""
    S, c, R = N * n * D * sb, N * n * 4, N * n * n * 4
    rows, K, M = (N, n * D, n * n + 2 * n) if design == "mhc" else (N * n, D, n + 2)
    X, MP, cast = rows * K * sb, pow2(M, 16), sb != 4 and not gemm_fp32_out
    out = 4 if gemm_fp32_out else sb                                   # the GEMM's output element
    dW = row("dW (torch GEMM)", "backward", X + rows * M * sb + cast * K * M * sb, K * M * out + cast * 4 * K * M,
             launches=1 + cast, launch="dW GEMM (and cast)")
    width = 2 * S + c + 4 * N + N * D * sb + 4 * D              # H, dmixed, pre, rb or c, dout and the gain, once
    wr, ww = S + c + R + 4 * D, S + N * D * sb + 4 * N             # the width connection's and norm's, forward
    programs = -(-N // BLOCK_ROWS)
    if design == "mhc":
        scratch = 4 * N * (2 * iters - 1) * pow2(n)
        sums = 4 * programs * (2 * MP + D)
        fwd = [row("mhc_fwd", "forward", X + 4 * K * M + R + wr, 2 * c + 2 * R + 4 * N * M + 4 * N + ww,
                   launch="_mhc_fwd")]
        maps = 3 * R + scratch + 4 * c + 4 * N * M + 4 * N
        return fwd, [row("mhc_bwd", "backward", 2 * width + maps + R + 4 * N * M + 8 * N + 4 * K * M,
                         c + R + 4 * N + R + scratch + sb * N * M + sums + S, launch="_mhc_bwd"),
                     row("mhc_bwd.sums (torch)", "backward", sums, 4 * (2 * MP + D), launch="sum"), dW]
    sums = 4 * programs * (n * n + 2 * n + 2 + D + M * D)                  # a program's dW^T (M, D) in its row
    read = X + 4 * K * M, 2 * c + R + 4 * rows * M + 4 * rows
    fwd = [row("hc_fwd", "forward", read[0] + wr, read[1] + ww, launch="_hc_fwd")] if BLOCK_ROWS % n == 0 else [
        row("hc_read", "forward", *read, launch="_hc_read_fwd"),
        row("width_norm", "forward", wr, ww, launch="_width_norm_fwd")]
    maps = 2 * c + R + 4 * rows * M + 4 * rows                             # dpre, dpost, dres, m and r
    return fwd, [row("hc_bwd", "backward", 2 * width + maps + R + 8 * rows * M + 4 * rows + 4 * K * M,
                     c + R + 4 * N + 4 * rows * M + sums + S, launch="_hc_bwd"),
                 row("hc_bwd.sums (torch)", "backward", sums, 4 * (n * n + 2 * n + 2 + D + M * D), launch="sum"),
                 row("dW^T's rows into dynamic_alpha's gradient (a torch copy)", "backward", 4 * K * (n + 1),
                     4 * K * (n + 1), launch="copy")]


def row(kernel, pass_, read, written, launches=1, *, launch):
    """One line of `traffic`; launch: what moves its bytes, a Triton kernel by its function name (`_hc_bwd`, as
    scripts/kernel_probe.py names it: the roofline's time model books the row on it) or a torch op ("sum")."""
    return {"kernel": kernel, "pass": pass_, "launches": launches, "read": read, "written": written, "launch": launch}


def glue(design, N, n, M):
    """The torch launches between the pieces' kernels in `maps` (residuals.HC's and MHC's), forward and backward, as
    rows of `traffic` ("read" holds both ways): per token, the fp32 elements of every (N, ...) tensor each launch
    reads or writes, counted from the launches the path makes (tests/test_triton_hc.py::
    test_traffic_counts_every_launch records them); the parameter-sized ones (HC's W cat, its gradient's copies)
    are launches with no per-token bytes. HC, a = n (n + 1) (A), b = n (n + 2) (the projection), c = n^2 (res):
        forward  8: tanh 2b, scale and shift of A 4a, of beta 4n, pre's and res' copies 2n + 2c (and W's cat)
        backward 17: 9n + 13a + 8b + c (select/slice backward, the sums of the scales' and static maps' gradients,
                 tanh's backward) and W's gradient copied into dynamic_alpha's and dynamic_beta's
    mHC: forward 9: two sigmoids with their scale and shift 12n, H_post's factor 2 2n, R's scale and shift 4n^2;
         backward 25: 24n + 8n^2 + 9M. (The fused read runs no glue.)"""
    a, b, c = n * (n + 1), n * (n + 2), n * n
    if design == "hc":
        fwd, bwd = (8, 2 * b + 4 * a + 6 * n + 2 * c), (17, 9 * n + 13 * a + 8 * b + c)
    else:
        fwd, bwd = (9, 14 * n + 4 * c), (25, 24 * n + 8 * c + 9 * M)
    return (row("maps (torch)", "forward", 4 * N * fwd[1], 0, launches=fwd[0], launch="maps' elementwise ops"),
            row("maps (torch)", "backward", 4 * N * bwd[1], 0, launches=bwd[0], launch="maps' elementwise ops"))


def norm_recompute(N, D, sb):
    """The branch's RMSNorm again in the backward (ops.rms_norm): its pow, mean, add, rsqrt and x r over (N, D) in
    fp32, and the cast to fp32 first when the branch is not (sb != 4); the gain's multiplication is not run again
    (checkpoint's recompute stops once the last saved tensor is back: that op's inputs)."""
    cast = sb != 4
    return row("RMSNorm (torch, recompute)", "backward (recompute)", 12 * N * D + 12 * N + cast * N * D * sb,
               8 * N * D + 12 * N + cast * 4 * N * D, launches=5 + cast, launch="RMSNorm's ops (and cast)")


# ----------------------------------------------------------------------------- the same check on a device

def agreement(fn_ref, fn_new, inputs, seed=0):
    """The worst disagreement of fn_new with fn_ref over their outputs and every input's gradient (from the same
    random upstream gradients): (largest |new - ref| / max |ref| over them, smallest cosine over them)."""
    results = []
    for fn in (fn_ref, fn_new):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g = torch.Generator(device=outs[0].device).manual_seed(seed)
        ups = [torch.randn(o.shape, generator=g, device=o.device).to(o.dtype) for o in outs]
        results.append([o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, ups)))
    worst_rel, worst_cos = 0.0, 1.0
    for new, ref in zip(*results):
        new, ref = new.double().flatten(), ref.double().flatten()
        worst_rel = max(worst_rel, ((new - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())
        worst_cos = min(worst_cos, torch.nn.functional.cosine_similarity(new, ref, dim=0).item())
    return worst_rel, worst_cos


def compare_with_reference(device="cuda", dtype=torch.float32, shape=(2, 33, 4, 64), seed=0):
    """Each body of NAMES against ops.py's on `device`, inputs in `dtype` at streams of `shape` (B, T, n, D): {name:
    (worst relative error, lowest cosine)} over outputs and gradients, as `agreement` measures them. For the GPU
    script: fp32 should agree to ~1e-5, bf16 to cosine >= 0.999 (tests/test_triton_hc.py holds the interpreter to
    the same)."""
    import ops
    B, T, n, D = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=1.0):
        return (scale * torch.randn(*size, generator=gen, device=device)).to(dtype)

    H = randn(B, T, n, D)
    return {
        "normed_projection": agreement(lambda x, w: ops.normed_projection(x, w, 1e-6),
                                       lambda x, w: normed_projection(x, w, 1e-6),
                                       [H.flatten(2), randn(n * D, n * n + 2 * n, scale=0.1)], seed),
        "sinkhorn": agreement(ops.sinkhorn, sinkhorn, [randn(B, T, n, n, scale=4.0)], seed),
        "width_connection": agreement(ops.width_connection, width_connection, [H, randn(B, T, n), randn(B, T, n, n)],
                                      seed),
        "depth_connection": agreement(ops.depth_connection, depth_connection, [H, randn(B, T, n), randn(B, T, D)],
                                      seed)}


BODIES = {name: globals()[name] for name in NAMES}   # ops.TWO_BODIES names -> their GPU body (kernels.triton_bodies)
