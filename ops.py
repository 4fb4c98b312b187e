"""
ops.py: the numerical building blocks the designs share. The norm (RMSNorm, or LayerNorm with center=True),
and three autograd nodes with their exact backward written by hand, which make the cross-layer designs
fast on any device: mHC's Sinkhorn, AttnRes' depth mix and MoDA's depth attention. Each docstring gives
the plain maths; test_all.py checks values and gradients against autograd through the plain loop. What
the nodes save: the graph nodes and zero-filled gradients of a loop of small ops, which dominated.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- the norm

def rms_norm(x, weight=None, eps=1e-6):
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32, returned in x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a gain (init 1), no bias, fp32 inside (docs/designs.md#backbone). center=True subtracts
    the mean first: a true LayerNorm with a gain and no bias (DeepNorm's block norm)."""

    def __init__(self, dim, eps=1e-6, center=False):
        super().__init__()
        self.eps, self.center = eps, center
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.center:
            return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), None, self.eps).to(x.dtype)
        return rms_norm(x, self.weight, self.eps)


def reset_norms(module):
    """Set every norm gain below `module` to 1."""
    for m in module.modules():
        if isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


def skinny_matmul(x, w):
    """x (..., K) @ w (K, M) for a narrow w (a few output columns: HC's and mHC's map projections).
    Computed as (w^T x^T)^T: CPU BLAS runs a product with few output columns, and its weight gradient
    x^T g, several times slower than the same product with the many rows as columns (measured fp32,
    1 thread: 8192 x 128 @ 128 x 6 forward 1.6 -> 0.4 ms, weight gradient 2.9 -> 0.3 ms). Same maths;
    on GPU the transposes are free views."""
    out = w.t().contiguous() @ x.reshape(-1, x.size(-1)).t()  # (M, N); a row-major w^T keeps autograd's
    # gradient of it in the fast layout too (it follows the layout of the factor)
    return out.t().reshape(*x.shape[:-1], w.size(1))


# ----------------------------------------------------------------------------- autograd nodes

def sinkhorn(logits, iters=20, eps=1e-6):
    """Sinkhorn-Knopp as in Liger's mHC kernel: row softmax (+eps), a column step, then `iters - 1`
    rounds of row and column normalisation. logits (..., n, n) -> approximately doubly stochastic;
    the columns sum exactly to 1 after the last step. The 2 * iters - 1 normalisations run as one
    autograd node (`Sinkhorn`, below) whose backward is the unrolled loop's, written by hand."""
    n = logits.size(-1)
    tl = logits.float().reshape(-1, n, n).permute(1, 2, 0).contiguous()  # tokens last, (n, n, tokens): the
    M = Sinkhorn.apply(tl.softmax(dim=1), iters, eps)                    # softmax and sums run over contiguous
    return M.permute(2, 0, 1).reshape(logits.shape)                      # token vectors, not over n = 4


class Sinkhorn(torch.autograd.Function):
    """On P (n, n, tokens), tokens last: M = P + eps, then alternately M <- M / (M.sum(dim) + eps) over
    columns (dim 0) and rows (dim 1), starting with columns. Each step's exact gradient is
    dM_in = (dM_out - sum_dim(dM_out * M_out)) / d: 4 small ops per step in backward instead of
    autograd's ~10 (the loop's node overhead dominated)."""

    @staticmethod
    def forward(ctx, P, iters, eps):
        M, outs, dens = P + eps, [], []
        for dim in [0] + [1, 0] * (iters - 1):
            d = M.sum(dim, keepdim=True) + eps
            M = M / d
            outs.append(M)
            dens.append(d)
        ctx.save_for_backward(*outs, *dens)
        ctx.dims = [0] + [1, 0] * (iters - 1)
        return M

    @staticmethod
    def backward(ctx, g):
        saved, k = ctx.saved_tensors, len(ctx.dims)
        g = g.contiguous()
        for dim, M, d in zip(reversed(ctx.dims), reversed(saved[:k]), reversed(saved[k:])):
            g = (g - (g * M).sum(dim, keepdim=True)) / d
        return g, None, None


def inv_rms(v, eps=1e-5):
    """rsqrt(mean(v^2) + eps) over the last dim, in fp32: (..., D) -> (...). A norm's factor without the
    normalised copy: HC's and mHC's maps multiply their projection by it, and AttnRes forms each source's
    once for all its consumers (its key norm depends only on the source). One autograd node (`InvRms`)."""
    return InvRms.apply(v.float(), eps)


class InvRms(torch.autograd.Function):
    """r = rsqrt(mean(v^2) + eps) with its exact gradient dv = v * (-dr r^3 / D): one full-size multiply,
    where autograd through vector_norm made three passes (a masked fill for zero norms, a divide, a multiply)."""

    @staticmethod
    def forward(ctx, v, eps):
        r = (torch.linalg.vector_norm(v, dim=-1).square() / v.size(-1) + eps).rsqrt()
        ctx.save_for_backward(v, r)
        return r

    @staticmethod
    def backward(ctx, dr):
        v, r = ctx.saved_tensors
        return v * (dr * r.pow(3) / -v.size(-1))[..., None], None


def depth_softmax(query, key_gain, sources, eps=1e-5, inv_rmss=None):
    """AttnRes' mix over depth for one consumer: softmax_j <query, key_gain * RMSNorm(v_j)> (scale 1),
    then sum_j p_j v_j over the *raw* sources. query, key_gain (D,); sources: list of (B, T, D);
    inv_rmss: each source's inv_rms(v_j, eps) if already formed (else formed here).
    Returns the mix (B, T, D) and the weights (B, T, S). One autograd node (`DepthMix`).
    """
    rs = inv_rmss if inv_rmss is not None else [inv_rms(v, eps) for v in sources]
    mix, p = DepthMix.apply((key_gain.float() * query.float()), *(v.float() for v in sources), *rs)
    return mix.to(sources[0].dtype), p


class DepthMix(torch.autograd.Function):
    """(mix, p) of depth_softmax from gq = key_gain * query and each source's r_j = inv_rms(v_j), with the
    exact gradient written by hand:
        s_j = (v_j . gq) r_j,  p = softmax(s),  mix = sum_j p_j v_j
        ds = p (dp - <p, dp>),  dp_j = <dmix, v_j>
        dv_j = p_j dmix + (ds_j r_j) gq,  dr_j = ds_j (v_j . gq),  dgq = sum (ds_j r_j) v_j
    (dr_j flows on to the source through its own inv_rms, once per source, not once per consumer).
    A loop over the sources, each read a few times and never copied: stacking them would copy O(S)
    per consumer (O(L^2) in all), and the per-token contractions of a stack run as batched matmuls
    of B*T tiny matrices, slow on CPU. Autograd through the same loop kept ~10 full-size
    intermediates per source; this keeps only the sources and (B, T, S) vectors. The per-source vectors
    are kept source-major, (S, B, T), so each one is contiguous: broadcasting a strided p_j over D made
    every per-source multiply several times slower on CPU."""

    @staticmethod
    def forward(ctx, gq, *sources_and_rs):
        sources, r = sources_and_rs[:len(sources_and_rs) // 2], torch.stack(sources_and_rs[len(sources_and_rs) // 2:])
        dot = torch.stack([v @ gq for v in sources])                                      # (S, B, T)
        p = (dot * r).softmax(dim=0)
        mix = torch.zeros_like(sources[0])
        for pj, v in zip(p, sources):
            mix.addcmul_(pj[..., None], v)
        ctx.save_for_backward(gq, p, r, dot, *sources)
        return mix, p.movedim(0, -1)

    @staticmethod
    def backward(ctx, dmix, dp_out):
        gq, p, r, dot, *sources = ctx.saved_tensors
        dp = torch.stack([torch.linalg.vecdot(v, dmix) for v in sources]) + dp_out.movedim(-1, 0)  # (S, B, T)
        ds = p * (dp - (p * dp).sum(0))
        a = ds * r
        grads, dgq = [], torch.zeros_like(gq)
        for v, pj, aj in zip(sources, p, a):
            dv = pj[..., None] * dmix
            grads.append(dv.addcmul_(aj[..., None], gq))
            dgq += aj.flatten() @ v.flatten(0, -2)
        return dgq, *grads, *(ds * dot)


class DepthAttention(torch.autograd.Function):
    """The depth half of joint_attention: o = sum_j p_j v_j and lse = log sum_j exp(s_j), s_j = scale <q, k_j>,
    p = softmax(s), over the S slots (S small); q: (B, Hkv, G, T, hd) query heads grouped by kv head, k_j,
    v_j: (B, Hkv, 1, T, hd), broadcast over the G query heads of each kv head (GQA; G = 1 is MHA). A loop
    over the slots, each read once (stacking them would copy O(S) per layer, O(L^2) in all), as one autograd
    node whose exact backward is written by hand: ds = p (dp - <p, dp>) + dlse p, dp_j = <do, v_j>,
    dq = scale sum_j ds_j k_j, dk_j = scale ds_j q, dv_j = p_j do. Autograd through the loop cost ~2x more,
    mostly zero-filled (B, H, T, S) gradients of every p_j it selected.
    Measured on CPU (fp32, 1 thread), what the loop's speed hangs on:
    - it runs tokens-last, (..., hd, T): broadcasting a per-token weight over a last dim of hd (8-16)
      ran ~3x slower (hd 8) than over T. q and do are transposed once per call; a slot stored
      tokens-last (`tokens_last`, as MoDA keeps its slots) is read in place, any other is read strided;
    - the per-slot weights are slot-major, (S, B, Hkv, G, T), so each p_j is contiguous, and sums over
      slots accumulate in place (addcmul_);
    - with G = 1 nothing reduces over the query-head group (a sum over a size-1 dim is a fill and a copy)."""

    @staticmethod
    def forward(ctx, scale, S, q, *kv):
        qt = q.transpose(-1, -2).contiguous()                                            # (B, Hkv, G, hd, T)
        kts, vts = [t.transpose(-1, -2) for t in kv[:S]], [t.transpose(-1, -2) for t in kv[S:]]
        logits = torch.stack([torch.linalg.vecdot(qt, kt, dim=-2) for kt in kts]).float() * scale  # (S, B, Hkv, G, T)
        lse = logits.logsumexp(dim=0)
        p = torch.exp(logits - lse)
        ot = torch.zeros_like(qt)
        for pj, vt in zip(p.to(q.dtype), vts):
            ot.addcmul_(pj[..., None, :], vt)
        ctx.save_for_backward(qt, p, *kv)
        ctx.scale, ctx.S = scale, S
        return ot.transpose(-1, -2), lse

    @staticmethod
    def backward(ctx, do, dlse):
        qt, p, *kv = ctx.saved_tensors
        kts, vts = [t.transpose(-1, -2) for t in kv[:ctx.S]], [t.transpose(-1, -2) for t in kv[ctx.S:]]
        dot = do.transpose(-1, -2).contiguous()
        dp = torch.stack([torch.linalg.vecdot(dot, vt, dim=-2) for vt in vts]).float()  # (S, B, Hkv, G, T)
        ds = (p * (dp - (p * dp).sum(0) + dlse) * ctx.scale).to(qt.dtype)
        dqt = torch.zeros_like(qt)
        for dsj, kt in zip(ds, kts):
            dqt.addcmul_(dsj[..., None, :], kt)

        def per_kv_head(gt):  # a kv head's gradient sums over the G query heads that read it; back to (..., T, hd)
            return (gt if gt.size(2) == 1 else gt.sum(2, keepdim=True)).transpose(-1, -2)
        return (None, None, dqt.transpose(-1, -2), *(per_kv_head(dsj[..., None, :] * qt) for dsj in ds),
                *(per_kv_head(pj[..., None, :] * dot) for pj in p.to(qt.dtype)))


def tokens_last(x):
    """x (..., T, hd) as the same tensor stored (..., hd, T), the layout DepthAttention reads fastest."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)
