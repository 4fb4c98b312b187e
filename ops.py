"""
ops.py: the maths the designs share, each written the way its equation reads, in plain PyTorch.

The norm, RoPE and attention of the backbone; HC/mHC's map projection, width and depth connections and mHC's
Sinkhorn; AttnRes' softmax over depth; MoDA's joint sequence + depth softmax; and two measures of depth use
(erank, dead_zone) that diagnose.py and the designs' telemetry share. A function with a `fast` argument
has a second body in depthbench/kernels.py: the same maths in the layouts, fused nodes and hand-written backward passes that
make it fast (GPTConfig.kernels, --kernels). The body here is the definition; test_all.py checks, for every
design, that both give the same logits, loss and gradients. Precision, one rule for all designs under bf16
autocast: the sublayers' matmuls in bf16; the residual state, its mixing and every depth-softmax logit in fp32.
"""
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from depthbench import kernels


# ----------------------------------------------------------------------------- the norm

def rms_norm(x, weight=None, eps=1e-6):
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, computed in fp32, returned in x's dtype."""
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
            normed = F.layer_norm(x.float(), x.shape[-1:], weight=self.weight.float(), bias=None, eps=self.eps)
            return normed.to(x.dtype)
        return rms_norm(x, self.weight, self.eps)


def fp32(fn):
    """Run fn with autocast off and its tensor arguments in fp32: residual arithmetic, whatever autocast does."""
    @functools.wraps(fn)
    def run(*args, **kw):
        with torch.autocast(next(a for a in args if torch.is_tensor(a)).device.type, enabled=False):
            return fn(*(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args), **kw)
    return run


# ----------------------------------------------------------------------------- RoPE and attention

def rope_cos_sin(T, head_dim, theta, device):
    """cos/sin tables (T, head_dim) in fp32, frequencies duplicated over the two halves."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq).repeat(1, 2)  # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin, fast=False):
    """Rotate-half RoPE on (B, H, T, hd) in fp32, returned in x's dtype:
    x cos + rotate_half(x) sin, rotate_half([x1, x2]) = [-x2, x1]."""
    if fast:
        return kernels.apply_rope(x, cos, sin)
    x1, x2 = (xf := x.float()).chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def causal_attention(q, k, v, fast=False):
    """softmax(q k^T / sqrt(hd), causal) v, q (B, H, T, hd), k, v (B, Hkv, T, hd): with Hkv < H (GQA) query
    head h reads kv head h // (H / Hkv). PyTorch's fused kernel (never holds the T x T logits)."""
    return kernels.causal_attention(q, k, v) if fast else \
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) < q.size(1))


def depth_slot(t, fast=False):
    """A key or value (B, Hkv, T, hd) as MoDA keeps it for later layers: itself (fast: the same values, stored in
    the layout the fast depth attention reads without a copy)."""
    return kernels.depth_slot(t) if fast else t


def joint_attention(q, k, v, depth_k, depth_v, fast=False, valid=None):
    """MoDA's attention: one softmax per query over its causal sequence logits *and* the logits of the S
    depth keys that earlier sublayers left at the query's own token:

        a = softmax([ q_t k_s / sqrt(hd) for s <= t ; q_t dk_j,t / sqrt(hd) for j < S ])
        o_t = sum_s a_s v_s + sum_j a_j dv_j,t

    q (B, H, T, hd), k, v (B, Hkv, T, hd) the sequence part (GQA as causal_attention); depth_k, depth_v:
    lists of S tensors (B, Hkv, T, hd); valid: None, or (S,) bool marking the slots that take part (the others,
    padding of a fixed-length window, get a_j = 0; at least one must be valid). Returns o (B, H, T, hd) and the
    depth share sum_j a_j (B, H, T), detached, for diagnostics."""
    if fast:
        return kernels.joint_attention(q, k, v, depth_k=depth_k, depth_v=depth_v, valid=valid)
    T, G, scale = q.size(2), q.size(1) // k.size(1), q.size(-1) ** -0.5
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)          # (B, H, T, hd)
    dk, dv = (torch.stack(ts, dim=3).repeat_interleave(G, dim=1) for ts in (depth_k, depth_v))  # (B, H, T, S, hd)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    seq = (q @ k.transpose(-1, -2) * scale).masked_fill(future, float("-inf"))  # (B, H, T, T), as attention's
    depth = (q.float()[..., None, :] * dk.float()).sum(-1) * scale             # (B, H, T, S), in fp32
    if valid is not None:
        depth = depth.masked_fill(~valid, float("-inf"))
    a = torch.cat([seq.float(), depth], dim=-1).softmax(dim=-1)
    o = a[..., :T].to(v.dtype) @ v + (a[..., T:, None] * dv.float()).sum(-2)
    return o, a[..., T:].sum(-1).detach()


# ----------------------------------------------------------------------------- HC and mHC

@fp32
def normed_projection(x, W, eps, fast=False):
    """(x / rms(x)) @ W, no gain, in fp32: what HC's and mHC's dynamic maps are made from. x (..., K),
    W (K, M) with few columns (n + 2 for HC, n^2 + 2n for mHC)."""
    return kernels.normed_projection(x, W, eps) if fast else rms_norm(x, eps=eps) @ W


@fp32
def width_connection(H, pre, res, fast=False):
    """HC's width connection (Zhu et al., eq. 3-4): from the streams H (B, T, n, D), the branch input
    sum_s pre_s h_s (B, T, D) and the mixed residual sum_s res[o, s] h_s (B, T, n, D); pre (B, T, n),
    res (B, T, n, n) as [out, in]."""
    if fast:
        return kernels.width_connection(H, pre, res)
    return (pre[..., None] * H).sum(-2), res @ H


@fp32
def depth_connection(mixed, post, y, fast=False):
    """HC's depth connection: the branch output y (B, T, D) joins each mixed stream o with weight post_o:
    h'_o = mixed_o + post_o y -> (B, T, n, D)."""
    return kernels.depth_connection(mixed, post, y) if fast else mixed + post[..., None] * y[..., None, :]


def sinkhorn(logits, iters=20, eps=1e-6, fast=False):
    """Sinkhorn-Knopp as in Liger's mHC kernel, on (..., n, n) logits: a row softmax (+ eps), a column
    normalisation, then iters - 1 rounds of row and column normalisation. Close to doubly stochastic
    (rows ~1e-3 for peaked logits), columns exactly after the last step. In fp32."""
    if fast:
        return kernels.sinkhorn(logits, iters, eps)
    M = logits.float().softmax(dim=-1) + eps
    M = M / (M.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        M = M / (M.sum(dim=-1, keepdim=True) + eps)
        M = M / (M.sum(dim=-2, keepdim=True) + eps)
    return M


# ----------------------------------------------------------------------------- AttnRes

@fp32
def depth_mix(query, key_gain, sources, eps=1e-5, fast=False, valid=None):
    """AttnRes' softmax over depth for one consumer, Kimi's eq. 2: keys are the RMS-normalised sources with the
    consumer's gain, the query is a learnt vector (scale 1), the values are the raw sources:

        p_j = softmax_j <query, key_gain * RMSNorm(v_j)>,   mix = sum_j p_j v_j

    sources: S tensors (B, T, D); logits and softmax in fp32. valid: None, or (S,) bool marking the sources that
    take part (the others, padding of a fixed-length bank, get p_j = 0). Returns mix (B, T, D), p (B, T, S)."""
    if fast:
        return kernels.depth_mix(query, key_gain, sources, eps, valid=valid)
    V = torch.stack(sources).float()                             # (S, B, T, D)
    keys = rms_norm(V, key_gain, eps)
    logits = keys @ query                                        # (S, B, T)
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, None], float("-inf"))
    p = logits.softmax(dim=0)
    return (p[..., None] * V).sum(0), p.movedim(0, -1)


# ------------------------------------------------------------------- measures of depth use (diagnose, telemetry)

def erank(M, squared=False):
    """Effective rank exp(H(p)) of a matrix, p = sigma / sum(sigma) (Roy & Vetterli), or sigma^2-normalised."""
    sv = torch.linalg.svdvals(M.double())
    sv = sv ** 2 if squared else sv
    p = sv / sv.sum()
    p = p[p > 0]
    return math.exp(-(p * p.log()).sum().item())


def dead_zone(weights, L, tau):
    """weights: the token-averaged depth-softmax weights of consumers 0..2L (index 0 = the embedding).
    A sublayer is dead when its mix puts < tau on non-embedding sources; a block when both of its are."""
    schedule = [1.0 - w[0] for w in weights[:2 * L]]
    dead = [v < tau for v in schedule]
    return {"tau": tau, "schedule": schedule, "dead": dead, "head": 1.0 - weights[2 * L][0],
            "count_sublayers": sum(dead), "count_blocks": sum(dead[2 * b] and dead[2 * b + 1] for b in range(L))}
