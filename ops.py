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


# ----------------------------------------------------------------------------- autograd nodes

def sinkhorn(logits, iters=20, eps=1e-6):
    """Sinkhorn-Knopp as in Liger's mHC kernel: row softmax (+eps), a column step, then `iters - 1`
    rounds of row and column normalisation. logits (..., n, n) -> approximately doubly stochastic;
    the columns sum exactly to 1 after the last step. The 2 * iters - 1 normalisations run as one
    autograd node (`Sinkhorn`, below) whose backward is the unrolled loop's, written by hand."""
    return Sinkhorn.apply(logits.float().softmax(dim=-1), iters, eps)


class Sinkhorn(torch.autograd.Function):
    """M = P + eps, then alternately M <- M / (M.sum(dim) + eps) over rows (dim -1) and columns (-2),
    starting with columns (dims 0 / 1 in its tokens-last layout). Each step's exact gradient is dM_in = (dM_out - sum_dim(dM_out * M_out)) / d:
    4 small ops per step in backward instead of autograd's ~10 (the loop's node overhead dominated)."""

    @staticmethod
    def forward(ctx, P, iters, eps):
        # tokens last, (n, n, tokens): the row and column sums become adds of contiguous vectors
        M, outs, dens = P.reshape(-1, *P.shape[-2:]).permute(1, 2, 0).contiguous() + eps, [], []
        for dim in [0] + [1, 0] * (iters - 1):
            d = M.sum(dim, keepdim=True) + eps
            M = M / d
            outs.append(M)
            dens.append(d)
        ctx.save_for_backward(*outs, *dens)
        ctx.dims, ctx.shape = [0] + [1, 0] * (iters - 1), P.shape
        return M.permute(2, 0, 1).reshape(P.shape)

    @staticmethod
    def backward(ctx, g):
        saved, k = ctx.saved_tensors, len(ctx.dims)
        g = g.reshape(-1, *g.shape[-2:]).permute(1, 2, 0).contiguous()
        for dim, M, d in zip(reversed(ctx.dims), reversed(saved[:k]), reversed(saved[k:])):
            g = (g - (g * M).sum(dim, keepdim=True)) / d
        return g.permute(2, 0, 1).reshape(ctx.shape), None, None


def depth_softmax(query, key_gain, sources, eps=1e-5):
    """AttnRes' mix over depth for one consumer: softmax_j <query, key_gain * RMSNorm(v_j)> (scale 1),
    then sum_j p_j v_j over the *raw* sources. query, key_gain (D,); sources: list of (B, T, D).
    Returns the mix (B, T, D) and the weights (B, T, S). One autograd node (`DepthMix`).
    """
    mix, p = DepthMix.apply(eps, (key_gain.float() * query.float()), *(v.float() for v in sources))
    return mix.to(sources[0].dtype), p


class DepthMix(torch.autograd.Function):
    """(mix, p) of depth_softmax from gq = key_gain * query, with the exact gradient written by hand:
        s_j = (v_j . gq) r_j,  r_j = rsqrt(mean(v_j^2) + eps),  p = softmax(s),  mix = sum_j p_j v_j
        ds = p (dp - <p, dp>),  dp_j = <dmix, v_j>
        dv_j = p_j dmix + (ds_j r_j) gq - (ds_j (v_j . gq) r_j^3 / D) v_j,  dgq = sum (ds_j r_j) v_j
    A loop over the sources, each read a few times and never copied: stacking them would copy O(S)
    per consumer (O(L^2) in all), and the per-token contractions of a stack run as batched matmuls
    of B*T tiny matrices, slow on CPU. Autograd through the same loop kept ~10 full-size
    intermediates per source; this keeps only the sources and (B, T, S) vectors."""

    @staticmethod
    def forward(ctx, eps, gq, *sources):
        D = gq.numel()
        dot = torch.stack([v @ gq for v in sources], dim=-1)                              # (B, T, S)
        r = torch.stack([torch.linalg.vector_norm(v, dim=-1) for v in sources], dim=-1).pow(2).div(D).add(eps).rsqrt()
        p = (dot * r).softmax(dim=-1)
        mix = torch.zeros_like(sources[0])
        for j, v in enumerate(sources):
            mix.addcmul_(p[..., j, None], v)
        ctx.save_for_backward(gq, p, r, dot, *sources)
        return mix, p

    @staticmethod
    def backward(ctx, dmix, dp_out):
        gq, p, r, dot, *sources = ctx.saved_tensors
        dp = torch.stack([(v * dmix).sum(-1) for v in sources], dim=-1) + dp_out          # (B, T, S)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        a, c = ds * r, -ds * dot * r.pow(3) / gq.numel()
        grads, dgq = [], torch.zeros_like(gq)
        for j, v in enumerate(sources):
            dv = v * c[..., j, None]
            dv.addcmul_(p[..., j, None], dmix).addcmul_(a[..., j, None], gq)
            grads.append(dv)
            dgq += a[..., j].flatten() @ v.flatten(0, -2)
        return None, dgq, *grads


class DepthAttention(torch.autograd.Function):
    """The depth half of joint_attention: o = sum_j p_j v_j and lse = log sum_j exp(s_j), s_j = scale <q, k_j>,
    p = softmax(s), over the S slots (S small); q: (B, Hkv, G, T, hd) query heads grouped by kv head, k_j,
    v_j: (B, Hkv, 1, T, hd), broadcast over the G query heads of each kv head (GQA; G = 1 is MHA). A loop over the slots, each read
    once (stacking them would copy O(S) per layer, O(L^2) in all), as one autograd node whose exact
    backward is written by hand: ds = p (dp - <p, dp>) + dlse p, dp_j = <do, v_j>, dq = scale sum_j ds_j k_j,
    dk_j = scale ds_j q, dv_j = p_j do. Autograd through the loop cost ~2x more, mostly zero-filled
    (B, H, T, S) gradients of every p_j it selected."""

    @staticmethod
    def forward(ctx, scale, S, q, *kv):
        ks, vs = kv[:S], kv[S:]
        logits = torch.stack([(q * kj).sum(-1) for kj in ks], dim=-1).float() * scale     # (B, H, T, S)
        lse = logits.logsumexp(dim=-1)
        p = torch.exp(logits - lse[..., None])
        o = sum(p[..., j, None].to(q.dtype) * vj for j, vj in enumerate(vs))
        ctx.save_for_backward(q, p, *kv)
        ctx.scale, ctx.S = scale, S
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, p, *kv = ctx.saved_tensors
        ks, vs = kv[:ctx.S], kv[ctx.S:]
        dp = torch.stack([(do * vj).sum(-1) for vj in vs], dim=-1).float()               # (B, H, T, S)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True) + dlse[..., None]) * ctx.scale
        ds, pq = ds.to(q.dtype).unbind(-1), p.to(q.dtype).unbind(-1)
        dq = sum(ds[j][..., None] * kj for j, kj in enumerate(ks))
        # a kv head's gradient sums over the G query heads that read it
        return (None, None, dq, *((dsj[..., None] * q).sum(2, keepdim=True) for dsj in ds),
                *((pj[..., None] * do).sum(2, keepdim=True) for pj in pq))
