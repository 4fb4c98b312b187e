"""
ops.py: the maths the designs share, each written the way its equation reads, in plain PyTorch.

The norm, RoPE and attention of the backbone; HC/mHC's map projection, width and depth connections and mHC's
Sinkhorn; AttnRes' softmax over depth (and the release's top-k of it), DenseFormer's and MUDD's weighted sums over
depth, and the bank of sources they read; MoDA's depth keys and values and its joint
sequence + depth softmax; and two measures of depth use (erank, dead_zone) that diagnose.py and the designs'
telemetry share. This file is the definition. depthbench/kernels/cpu.py has a second body for each name here (the same
maths, faster layouts); a model picks one of the two namespaces once, when it is built (`namespace`,
GPTConfig.kernels, --kernels), and test_all.py checks for every design that both give the same logits, loss and
gradients.

Precision, one rule for every design under bf16 autocast: the sublayers' matmuls run in bf16; the residual state,
its mixing and every softmax logit in fp32. The functions that mix residual state say so where they turn autocast
off (`fp32_maths`).
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


# the names with two bodies: ops.py's (the definition) and depthbench/kernels/cpu.py's (the same maths, faster; some
# with a third, a GPU body in depthbench/kernels)
TWO_BODIES = ("apply_rope", "causal_attention", "joint_attention", "lm_loss", "normed_projection", "width_connection",
              "depth_connection", "sinkhorn", "hc_read", "DepthBank", "DepthKV")


class Kernels:
    """One namespace's bodies of TWO_BODIES as attributes: what a design calls as `self.ops.sinkhorn(...)`. A plain
    object (a module could not be copied with the model that holds it). `replaced`: bodies that take the module's
    place (the "triton" namespace's GPU bodies, depthbench/kernels)."""

    def __init__(self, name, module, replaced=None):
        self.name = name
        for attr in TWO_BODIES:
            setattr(self, attr, (replaced or {}).get(attr, getattr(module, attr)))


_NAMESPACES = {}
FAST = {}  # depthbench/kernels' bodies: "cpu" (the module), "triton" and "available" (functions); see `register`


def register(cpu, triton_bodies, available):
    """Called by depthbench/kernels when it is imported (model.py and residuals.py import it): the module of the fast
    bodies, a function giving the GPU bodies ({name: body}) and one saying whether they can run (triton imports).
    ops.py imports none of them: they import this file."""
    FAST.update(cpu=cpu, triton=triton_bodies, available=available)


def namespace(kernels):
    """The bodies of this file ("reference"), of depthbench/kernels/cpu.py ("fast"), or cpu.py's with the GPU bodies
    of depthbench/kernels in place of those it has ("triton"; what "fast" is where CUDA is available and triton
    imports), chosen once when a model is built (GPTConfig.kernels, --kernels)."""
    if kernels not in _NAMESPACES:
        if kernels == "reference":
            _NAMESPACES[kernels] = Kernels(kernels, sys.modules[__name__])
        else:
            if not FAST:
                raise ValueError(f"kernels {kernels!r}: its bodies are depthbench/kernels', which registers them "
                                 f"when imported (model.py does): import depthbench.kernels first")
            _NAMESPACES[kernels] = Kernels(kernels, FAST["cpu"], replaced=gpu_bodies(kernels))
    return _NAMESPACES[kernels]


def gpu_bodies(kernels):
    """depthbench/kernels' GPU bodies for the namespace `kernels`: all of them for "triton", for "fast" only on a
    machine with CUDA where triton imports (triton is never imported on a machine without CUDA), none otherwise."""
    if kernels == "fast" and not torch.cuda.is_available():
        return {}
    if kernels == "triton" and not FAST["available"]():
        raise ValueError("kernels 'triton' needs the triton package (pip install triton)")
    return dict(FAST["triton"]()) if FAST["available"]() else {}


def fp32_maths(x):
    """A context with autocast off on x's device: what runs inside computes in the dtype of its arguments, which the
    residual maths casts to fp32 itself."""
    return torch.autocast(x.device.type, enabled=False)


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


# ----------------------------------------------------------------------------- RoPE, attention and the loss

def rope_cos_sin(T, head_dim, theta, device):
    """cos/sin tables (T, head_dim) in fp32, frequencies duplicated over the two halves."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq).repeat(1, 2)  # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on (B, H, T, hd) in fp32, returned in x's dtype:
    x cos + rotate_half(x) sin, rotate_half([x1, x2]) = [-x2, x1]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(hd), causal) v, q (B, H, T, hd), k, v (B, Hkv, T, hd): with Hkv < H (GQA) query
    head h reads kv head h // (H / Hkv). PyTorch's fused kernel (never holds the T x T logits)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) < q.size(1))


def cross_entropy(logits, targets):
    """Mean token cross-entropy in fp32, targets -1 ignored: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)


def lm_loss(z, weight, targets):
    """The loss of the head's input z (B, T, D) through the head weight (V, D): cross_entropy(z W^T)."""
    return cross_entropy(F.linear(z, weight), targets)


# ----------------------------------------------------------------------------- HC and mHC

def normed_projection(x, W, eps):
    """(x / rms(x)) @ W, no gain, in fp32: what HC's and mHC's dynamic maps are made from. x (..., K),
    W (K, M) with few columns (n + 2 for HC, n^2 + 2n for mHC)."""
    with fp32_maths(x):
        return rms_norm(x.float(), eps=eps) @ W.float()


def width_connection(H, pre, res):
    """HC's width connection (Zhu et al., eq. 3-4): from the streams H (B, T, n, D), the branch input
    sum_s pre_s h_s (B, T, D) and the mixed residual sum_s res[o, s] h_s (B, T, n, D); pre (B, T, n),
    res (B, T, n, n) as [out, in]. In fp32."""
    with fp32_maths(H):
        H, pre, res = H.float(), pre.float(), res.float()
        return (pre[..., None] * H).sum(-2), res @ H


def depth_connection(mixed, post, y):
    """HC's depth connection: the branch output y (B, T, D) joins each mixed stream o with weight post_o:
    h'_o = mixed_o + post_o y -> (B, T, n, D). In fp32."""
    with fp32_maths(mixed):
        mixed, post, y = mixed.float(), post.float(), y.float()
        return mixed + post[..., None] * y[..., None, :]


def hc_read(design, H, site):
    """HC's and mHC's read (residuals.HC.read): design.connect (the maps, the width connection, the branch's norm:
    residuals.py's equations) on the streams H, under torch.utils.checkpoint when design.recompute and autograd
    records (it keeps H alone; the backward recomputes the rest) -> (h, H_pre, H_post, H_res, mixed). One name for
    all of read, so that a GPU body can run it as fused kernels whose backward needs no recompute
    (depthbench/kernels/triton_hc_read.py); here, and in cpu.py, it is this composition."""
    if design.recompute and torch.is_grad_enabled():
        return checkpoint(design.connect, H, site, use_reentrant=False, preserve_rng_state=False)
    return design.connect(H, site)


def sinkhorn(logits, iters=20, eps=1e-6):
    """Sinkhorn-Knopp as in Liger's mHC kernel, on (..., n, n) logits: a row softmax (+ eps), a column
    normalisation, then iters - 1 rounds of row and column normalisation. Close to doubly stochastic
    (rows ~1e-3 for peaked logits), columns exactly after the last step. In fp32."""
    M = logits.float().softmax(dim=-1) + eps
    M = M / (M.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        M = M / (M.sum(dim=-1, keepdim=True) + eps)
        M = M / (M.sum(dim=-2, keepdim=True) + eps)
    return M


# ----------------------------------------------------------------------------- AttnRes

def depth_mix(query, key_gain, sources, eps=1e-5, keep=None):
    """AttnRes' softmax over depth for one consumer, Kimi's eq. 2: keys are the RMS-normalised sources with the
    consumer's gain, the query is a learnt vector (scale 1), the values are the raw sources:

        p_j = softmax_j <query, key_gain * RMSNorm(v_j)>,   mix = sum_j p_j v_j

    keep: the release's top-k variant (`topk_sources`): only the `keep` largest logits of each token enter the
    softmax, the others get p_j = 0 (None or every source: all). sources: S tensors (B, T, D); logits, softmax and mix
    in fp32. Returns mix (B, T, D), p (B, T, S)."""
    with fp32_maths(sources[0]):
        V = torch.stack(sources).float()                             # (S, B, T, D)
        keys = rms_norm(V, key_gain.float(), eps)
        logits = keys @ query.float()                                # (S, B, T)
        if keep is not None and keep < len(sources):
            logits = logits.masked_fill(~topk_sources(logits, keep), float("-inf"))
        p = logits.softmax(dim=0)
        return (p[..., None] * V).sum(0), p.movedim(0, -1)


def topk_count(n, fraction):
    """How many of n sources the release's AttnRes top-k keeps: ceil(fraction n), at least 1 (fraction 1: all)."""
    return min(n, max(1, math.ceil(n * fraction)))


def topk_sources(logits, keep):
    """(S, ...) logits -> a bool mask of the `keep` largest along dim 0, per position; equal logits go to the lower
    source index first (the release's kernel takes the maximum, then the lowest index holding it, `keep` times)."""
    order = torch.sort(logits, dim=0, descending=True, stable=True).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(0, order[:keep], True)


def depth_sum(weights, sources):
    """DenseFormer's and MUDD's weighted sum over depth, sum_j w[..., j] v_j, in fp32: sources S tensors (B, T, D);
    weights (S,) static (DenseFormer: -> (B, T, D)) or (C, B, T, S) per token and stream (MUDD: -> (C, B, T, D))."""
    with fp32_maths(sources[0]):
        w = weights.float()
        return sum(w[..., j, None] * v.float() for j, v in enumerate(sources))


class DepthBank:
    """The sources an AttnRes consumer mixes: the embedding, then one source per push (a sublayer's output, or a
    completed group's sum); DenseFormer's and MUDD's block outputs, which their weighted sums read. A plain list;
    `push` returns a new bank, so every state keeps its own. Its methods run eagerly under torch.compile
    (`torch.compiler.disable`): the number of sources differs from block to block, and a graph would bake it in
    (docs/speed.md#compile)."""

    def __init__(self, sources):
        self.sources = list(sources)

    @classmethod
    def start(cls, first, n_max, eps=1e-5, queries=None, key_gains=None):
        """A bank holding `first` (the embedding), for at most n_max sources whose keys are normalised with eps (the
        fast body allocates its storage from these; the list needs neither). queries, key_gains: the design's (2L, D)
        parameters, for a body that serves several consumers at once (the Triton one); the list ignores them."""
        return cls([first])

    @torch.compiler.disable
    def push(self, v):
        return DepthBank(self.sources + [v])

    @torch.compiler.disable
    def mix(self, query, key_gain, eps, extra=None, topk_fraction=1.0, site=None):
        """depth_mix over the sources, and `extra` (a group's open partial sum) after them if given; topk_fraction < 1
        keeps the topk_count of them per token (the release's AttnRes top-k). site: the consumer's Site (its row of
        the queries given to `start`, for the Triton body); the list ignores it. -> (mix, weights, extra as the mix
        passes it on): the caller's later uses of the extra take the one passed on, so that a fast body can add their
        gradient to the mix's own where it computes that (the Triton chunked bank does, in one kernel); here it is
        `extra` itself (None without one) and autograd adds the two."""
        sources = self.sources if extra is None else self.sources + [extra]
        mix, weights = depth_mix(query, key_gain, sources, eps, keep=topk_count(len(sources), topk_fraction))
        return mix, weights, extra

    @torch.compiler.disable
    def weighted_sum(self, weights):
        """depth_sum over the sources (DenseFormer's static weights, MUDD's per-token ones)."""
        return depth_sum(weights, self.sources)

    def newest(self):
        """The last source pushed."""
        return self.sources[-1]

    def __len__(self):
        return len(self.sources)


# ----------------------------------------------------------------------------- MoDA

def joint_attention(q, k, v, depth):
    """MoDA's attention: one softmax per query over its causal sequence logits *and* the logits of the S
    depth keys that earlier sublayers left at the query's own token (`depth`, a DepthKV):

        a = softmax([ q_t k_s / sqrt(hd) for s <= t ; q_t dk_j,t / sqrt(hd) for j < S ])
        o_t = sum_s a_s v_s + sum_j a_j dv_j,t

    q (B, H, T, hd), k, v (B, Hkv, T, hd) the sequence part (GQA as causal_attention); the caller (MoDA.attend) hands
    q and k RoPE-rotated and the depth keys as stored, unrotated. Returns o (B, H, T, hd) and the depth share
    sum_j a_j (B, H, T), detached, for diagnostics."""
    T, G, scale = q.size(2), q.size(1) // k.size(1), q.size(-1) ** -0.5
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)          # (B, H, T, hd)
    dk, dv = (torch.stack(slots, dim=3).repeat_interleave(G, dim=1) for slots in (depth.keys, depth.values))
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)        # dk, dv: (B, H, T, S, hd)
    seq = (q @ k.transpose(-1, -2) * scale).masked_fill(future, float("-inf"))  # (B, H, T, T), as attention's
    depth_logits = (q.float()[..., None, :] * dk.float()).sum(-1) * scale      # (B, H, T, S), in fp32
    a = torch.cat([seq.float(), depth_logits], dim=-1).softmax(dim=-1)
    o = a[..., :T].to(v.dtype) @ v + (a[..., T:, None] * dv.float()).sum(-2)
    return o, a[..., T:].sum(-1).detach()


class DepthKV:
    """MoDA's depth keys and values: one (key, value) slot (B, Hkv, T, hd) per earlier sublayer, at the same token.
    Plain lists; `push` returns a new DepthKV. Eager under torch.compile, as DepthBank and for its reason."""

    def __init__(self, keys, values):
        self.keys, self.values = list(keys), list(values)

    @classmethod
    def start(cls, n_max):
        """An empty cache for at most n_max slots (the fast body preallocates its storage from the first push)."""
        return cls([], [])

    @torch.compiler.disable
    def push(self, key, value):
        return DepthKV(self.keys + [key], self.values + [value])

    def __len__(self):
        return len(self.keys)


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
