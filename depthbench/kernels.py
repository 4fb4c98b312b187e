"""
kernels.py: the fast bodies of ops.py's functions, and the logits-free loss. Same maths, other layouts.

Nothing here is needed to understand a design: ops.py holds each function's definition, and
`GPTConfig(kernels="reference")` (`--kernels reference`) runs the model on those alone. test_all.py checks
for every registered design that both paths give the same logits, loss and gradients. What each trick
buys, measured, is in docs/speed.md. The tricks, in short:
- hand-written autograd nodes where a loop of small ops kept many graph nodes and zero-filled gradients
  (Sinkhorn, AttnRes' depth mix, MoDA's depth half, the norm factor 1/rms);
- loops over sources or slots that read each once, instead of stacking them (a copy per consumer);
- layouts that put the tokens last or as a matmul's wide side, where CPU BLAS and broadcasts are faster;
- MoDA's depth keys folded into the fused attention kernel as one extra "sink" key per query;
- CPU attention on heads padded to 16 wide; the loss over token chunks without the full logits.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CPU_SDPA_MIN_HEAD_DIM = 16  # CPU attention pads narrower heads with zeros to this width
LOSS_CHUNK_BYTES = 2 ** 27  # fp32 logits per chunk of the logits-free loss: 128 MB, 667 tokens at V 50304


# ----------------------------------------------------------------------------- RoPE, attention, the loss

def apply_rope(x, cos, sin):
    """rotate_half(x) sin = roll(x, hd/2) [-sin_1, sin_2]: one roll instead of a negation and a concatenation."""
    xf, half = x.float(), x.size(-1) // 2
    return (xf * cos + xf.roll(half, -1) * torch.cat([-sin[..., :half], sin[..., half:]], -1)).to(x.dtype)


def causal_attention(q, k, v):
    """On CPU a head narrower than CPU_SDPA_MIN_HEAD_DIM is zero-padded to it and the output cut back: the zeros
    add nothing to q.k, the padded value channels are dropped, the scale is the unpadded one."""
    hd = q.size(-1)
    pad = CPU_SDPA_MIN_HEAD_DIM - hd if q.device.type == "cpu" else 0
    if pad > 0:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd ** -0.5, enable_gqa=k.size(1) < q.size(1))
    return o[..., :hd] if pad > 0 else o


def joint_attention(q, k, v, depth_k, depth_v, valid=None):
    """One softmax over the sequence and depth logits, o_t = (Z_seq o_seq + Z_depth o_depth) / (Z_seq + Z_depth).

    The depth half (S keys per token) is `DepthAttention` or the custom op `depth_attention_node`, in fp32. The
    sequence half goes through the fused SDPA kernel with one extra "sink" key per query that stands for all its
    depth keys: extra query coordinates holding lse_depth / scale against a sink key with 1s there give the sink
    exactly the logit log Z_depth, and a 1 in an extra value channel reads out its share Z_depth / (Z_seq +
    Z_depth). Under bf16 the logit rides in two coordinates, hi + lo (~16 mantissa bits; exact in fp32). A dummy
    first query lets SDPA's top-left causal mask show every query the sink (key 0) and the sequence keys up to
    itself. valid (S,) bool or None: the depth slots that take part (at least one)."""
    B, H, T, hd = q.shape
    Hkv, scale = k.size(1), hd ** -0.5
    qg = q.unflatten(1, (Hkv, H // Hkv)).float()  # (B, Hkv, G, T, hd): query heads grouped by their kv head
    with torch.autocast(q.device.type, enabled=False):
        qt = qg.transpose(-1, -2).contiguous()                                      # (B, Hkv, G, hd, T)
        valid, depth_k, depth_v = in_use(valid, depth_k, depth_v)
        keys, values = ([t[:, :, None] for t in slots] for slots in (depth_k, depth_v))
        if len(keys) > UNROLL_SOURCES:
            ot, lse, _ = depth_attention_node(qt, scale, valid, keys + values)
        else:
            ot, lse = DepthAttention.apply(qt, scale, valid, *keys, *values)
    o_depth, lse = ot.transpose(-1, -2).flatten(1, 2), lse.flatten(1, 2) / scale    # (B, H, T, hd), (B, H, T)
    # extra coordinates: two are enough; 8 keeps CUDA's fused kernels (head_dim % 8); on CPU up to the padded width
    pad = 8 if q.is_cuda else max(2, CPU_SDPA_MIN_HEAD_DIM - hd)
    e0, e1 = F.one_hot(torch.arange(2, device=q.device), pad).to(q.dtype)          # (pad,) each: [1, 0, ..], [0, 1, ..]
    hi = lse.to(q.dtype)
    q_aug = torch.cat([q, hi[..., None] * e0 + (lse - hi.float()).to(q.dtype)[..., None] * e1], dim=-1)
    sink_k, sink_v = (torch.cat([q.new_zeros(hd), e]).expand(B, Hkv, 1, hd + pad) for e in (e0 + e1, e0))
    out = F.scaled_dot_product_attention(
        torch.cat([q_aug.new_zeros(B, H, 1, hd + pad), q_aug], dim=2),            # dummy query first
        torch.cat([sink_k.to(k.dtype), F.pad(k, (0, pad))], dim=2),
        torch.cat([sink_v.to(v.dtype), F.pad(v, (0, pad))], dim=2),
        is_causal=True, scale=scale, enable_gqa=Hkv < H)[:, :, 1:]                 # (B, H, T, hd + pad)
    share = out[..., hd]                                                          # Z_depth / (Z_seq + Z_depth)
    return out[..., :hd] + share[..., None] * o_depth, share.detach()


def _chunk_ce(z, weight, targets):
    return F.cross_entropy(F.linear(z, weight).float(), targets, ignore_index=-1, reduction="sum")


def chunked_cross_entropy(z, weight, targets, chunk=None):
    """Mean token cross-entropy of the logits z W^T in fp32 (targets -1 ignored), never holding all of them.

    z (N, D), weight (V, D), targets (N,). Tokens go through the head in chunks of `chunk` (default:
    LOSS_CHUNK_BYTES of fp32 logits); each chunk is checkpointed, so autograd keeps only z and the backward
    recomputes one chunk's logits at a time. Costs one extra head matmul (forward) per token."""
    chunk = chunk or max(1, LOSS_CHUNK_BYTES // (4 * weight.size(0)))
    if z.size(0) <= chunk:  # one chunk: the plain loss, nothing to recompute
        return _chunk_ce(z, weight, targets) / (targets != -1).sum()
    total = sum(checkpoint(_chunk_ce, z[s:s + chunk], weight, targets[s:s + chunk], use_reentrant=False)
                for s in range(0, z.size(0), chunk))
    return total / (targets != -1).sum()


# ----------------------------------------------------------------------------- HC and mHC

def skinny_matmul(x, w):
    """x (..., K) @ w (K, M) for a narrow w, computed as (w^T x^T)^T: CPU BLAS runs a product with few output
    columns, and its weight gradient x^T g, several times slower than with the many rows as columns. A
    row-major w^T keeps autograd's gradient of it in that layout too (it follows the factor's)."""
    out = w.t().contiguous() @ x.reshape(-1, x.size(-1)).t()                   # (M, N)
    return out.t().reshape(*x.shape[:-1], w.size(1))


def inv_rms(v, eps):
    """r = rsqrt(mean(v^2) + eps) over the last dim, (..., D) -> (...), without a squared copy of v."""
    return (torch.linalg.vector_norm(v, dim=-1).square() / v.size(-1) + eps).rsqrt()


class InvRms(torch.autograd.Function):
    """inv_rms with its exact gradient dv = v (-dr r^3 / D): one full-size multiply, where autograd through the
    norm made three passes."""

    @staticmethod
    def forward(ctx, v, eps):
        r = inv_rms(v, eps)
        ctx.save_for_backward(v, r)
        return r

    @staticmethod
    def backward(ctx, dr):
        v, r = ctx.saved_tensors
        return v * (dr * r.pow(3) / -v.size(-1))[..., None], None


def normed_projection(x, W, eps):
    """(x @ W) / rms(x): no normalised copy of x, and the projection with the tokens as BLAS columns."""
    return skinny_matmul(x, W) * InvRms.apply(x, eps)[..., None]


def width_connection(H, pre, res):
    """Both mixes as one (n+1 x n) @ (n x D) matmul per token, split (a slice's backward zero-fills the product)."""
    maps = torch.cat([pre[..., None, :], res], dim=-2)                          # (B, T, n+1, n)
    branch, mixed = (maps @ H).split([1, H.size(-2)], dim=-2)
    return branch.squeeze(-2), mixed


def depth_connection(mixed, post, y):
    """mixed + post (x) y as one baddbmm over the tokens."""
    return torch.baddbmm(mixed.flatten(0, 1), post.flatten(0, 1)[..., None], y.flatten(0, 1)[:, None]).view_as(mixed)


def sinkhorn(logits, iters, eps):
    """The normalisations as one node (`Sinkhorn`), tokens last: the softmax and sums run over contiguous token
    vectors, not over n = 4."""
    n = logits.size(-1)
    tl = logits.float().reshape(-1, n, n).permute(1, 2, 0).contiguous()        # (n, n, tokens)
    return Sinkhorn.apply(tl.softmax(dim=1), iters, eps).permute(2, 0, 1).reshape(logits.shape)


class Sinkhorn(torch.autograd.Function):
    """On P (n, n, tokens): M = P + eps, then M <- M / (M.sum(dim) + eps) over columns (dim 0) and rows (dim 1),
    alternately, columns first. Each step's exact gradient is dM_in = (dM_out - sum_dim(dM_out M_out)) / d."""

    @staticmethod
    def forward(ctx, P, iters, eps):
        M, outs, dens = P + eps, [], []
        ctx.dims = [0] + [1, 0] * (iters - 1)
        for dim in ctx.dims:
            d = M.sum(dim, keepdim=True) + eps
            M = M / d
            outs.append(M)
            dens.append(d)
        ctx.save_for_backward(*outs, *dens)
        return M

    @staticmethod
    def backward(ctx, g):
        saved, k = ctx.saved_tensors, len(ctx.dims)
        g = g.contiguous()
        for dim, M, d in zip(reversed(ctx.dims), reversed(saved[:k]), reversed(saved[k:])):
            g = (g - (g * M).sum(dim, keepdim=True)) / d
        return g, None, None


# ----------------------------------------------------------------------------- AttnRes

def depth_mix(query, key_gain, sources, eps, valid=None):
    """The mix as one node, each source's 1/rms formed inside it, in fp32 from sources kept as they are (fp32 copies
    saved per consumer would hold O(L^2) of them under bf16 autocast): `DepthMix` up to UNROLL_SOURCES sources,
    the custom op `depth_mix_node` beyond. Without grad (evals, diagnostics) the short loop runs outside any node:
    torch.compile (2.13) misreads an autograd.Function's arguments when none needs a gradient.
    valid (S,) bool or None: the sources that take part; the others get p_j = 0 (and a zero gradient)."""
    gq = key_gain.float() * query.float()
    mask, used = in_use(valid, sources)
    if len(used) > UNROLL_SOURCES:
        mix, p, _, _ = depth_mix_node(gq, eps, mask, list(used))
    elif torch.is_grad_enabled():
        mix, p = DepthMix.apply(gq, eps, mask, *used)
    else:
        mix, p = mix_forward(gq, eps, mask, used)[:2]
    if len(used) < len(sources):                  # the weights over every source of the window: 0 where unused
        p = p.new_zeros((len(sources), *p.shape[1:])).index_put((valid,), p)
    return mix.to(sources[0].dtype), p.movedim(0, -1)


def in_use(valid, *windows):
    """(mask, *windows) as the depth loops take them. Eager: only the entries `valid` marks, and no mask (the mask is
    read on the host), so the loops skip a window's padding and run as if it had none. Compiled: the whole window
    and its mask, as its fixed length is what keeps every block's graph the same."""
    if valid is None or torch.compiler.is_compiling():
        return (valid, *windows)
    keep = valid.tolist()
    return (None, *([t for t, k in zip(window, keep) if k] for window in windows))


def mix_forward(gq, eps, valid, sources):
    """(mix, p, r, s) from gq = key_gain * query, with r_j = rsqrt(mean(v_j^2) + eps):
        s_j = (v_j . gq) r_j,  p = softmax(s),  mix = sum_j p_j v_j
    A loop over the sources, each read a few times and never copied, source-major (S, B, T) vectors."""
    sources = [v.float() for v in sources]
    r = torch.stack([inv_rms(v, eps) for v in sources])
    s = torch.stack([v @ gq for v in sources]) * r                                        # (S, B, T)
    logits = s if valid is None else s.masked_fill(~valid[:, None, None], float("-inf"))
    p = logits.softmax(dim=0)                                 # s itself, unmasked, is what the norm's gradient reads
    mix = torch.zeros_like(sources[0])
    for pj, v in zip(p, sources):
        mix.addcmul_(pj[..., None], v)
    return mix, p, r, s


def mix_backward(dmix, dp, saved):
    """[dgq, dv_0, ...], the exact gradient of mix_forward from what it saved, [gq, p, r, s, v_0, ...], the norm's
    gradient joining dv_j in the same pass:
        ds = p (dp - <p, dp>),  dp_j = <dmix, v_j> (+ the gradient reaching p itself)
        dv_j = p_j dmix + (ds_j r_j) gq - (ds_j s_j r_j^2 / D) v_j,  dgq = sum_j (ds_j r_j) v_j
    In fp32; autograd casts each dv_j to its source's dtype."""
    gq, p, r, s, *sources = saved
    sources = [v.float() for v in sources]
    dp = torch.stack([torch.linalg.vecdot(v, dmix) for v in sources]) + dp                 # (S, B, T)
    ds = p * (dp - (p * dp).sum(0))
    a, c = ds * r, ds * s * r.square() / -sources[0].size(-1)
    grads, dgq = [], torch.zeros_like(gq)
    for v, pj, aj, cj in zip(sources, p, a, c):
        grads.append((pj[..., None] * dmix).addcmul_(aj[..., None], gq).addcmul_(cj[..., None], v))
        dgq += aj.flatten() @ v.flatten(0, -2)
    return [dgq, *grads]


# The depth mix and MoDA's depth attention loop over their sources (slots). Traced by torch.compile, a loop unrolls
# into the block's graph, where inductor fuses it: fast, but the graph grows with the number of sources. So a loop
# over at most UNROLL_SOURCES is an autograd.Function (traced: Block AttnRes' N + 1 sources, whatever the depth),
# and a longer one (Full AttnRes' 2L + 1, MoDA's 2L - 1: they grow with depth) a custom op, one opaque node in the
# graph whatever its length, so that compile time stays flat in depth; it runs the same loop unfused (slower
# compiled: docs/speed.md#compile). Each custom op has a fake (shapes only, for the compiler) and its backward,
# itself a custom op.
UNROLL_SOURCES = 16


class DepthMix(torch.autograd.Function):
    """mix_forward and mix_backward as an autograd node that torch.compile traces."""

    @staticmethod
    def forward(ctx, gq, eps, valid, *sources):
        mix, p, r, s = mix_forward(gq, eps, valid, sources)
        ctx.save_for_backward(gq, p, r, s, *sources)
        return mix, p

    @staticmethod
    def backward(ctx, dmix, dp):
        dgq, *grads = mix_backward(dmix, dp, ctx.saved_tensors)
        return dgq, None, None, *grads


@torch.library.custom_op("depthbench::depth_mix", mutates_args=())
def depth_mix_node(gq: torch.Tensor, eps: float, valid: Optional[torch.Tensor],
                   sources: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return mix_forward(gq, eps, valid, sources)


@depth_mix_node.register_fake
def _(gq, eps, valid, sources):
    v = sources[0]
    weights = v.new_empty((len(sources), *v.shape[:-1]), dtype=torch.float32)             # (S, B, T)
    return v.new_empty(v.shape, dtype=torch.float32), weights, torch.empty_like(weights), torch.empty_like(weights)


@torch.library.custom_op("depthbench::depth_mix_backward", mutates_args=())
def depth_mix_backward_node(dmix: torch.Tensor, dp: torch.Tensor, saved: List[torch.Tensor]) -> List[torch.Tensor]:
    return mix_backward(dmix, dp, saved)


@depth_mix_backward_node.register_fake
def _(dmix, dp, saved):
    gq, sources = saved[0], saved[4:]
    return [torch.empty_like(gq)] + [v.new_empty(v.shape, dtype=torch.float32) for v in sources]


def _mix_setup(ctx, inputs, output):
    gq, eps, valid, sources = inputs
    _, p, r, s = output
    ctx.save_for_backward(gq, p, r, s, *sources)


def _mix_grad(ctx, dmix, dp, dr, ds):
    dgq, *grads = depth_mix_backward_node(dmix, dp, list(ctx.saved_tensors))
    return dgq, None, None, grads


depth_mix_node.register_autograd(_mix_grad, setup_context=_mix_setup)


# ----------------------------------------------------------------------------- MoDA

def depth_slot(t):
    """t (..., T, hd) stored (..., hd, T), tokens last: how the depth attention (attention_forward) reads a slot
    fastest."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def attention_forward(qt, scale, valid, slots):
    """The depth half of joint_attention: o = sum_j p_j v_j and lse = log sum_j exp(s_j), s_j = scale <q, k_j>,
    p = softmax(s) over the S slots -> (o, lse, p). qt (B, Hkv, G, hd, T): the queries grouped by kv head, tokens
    last (a per-token weight broadcast over hd = 8-16 is slow); slots = [k_0, .., v_0, ..], each (B, Hkv, 1, T,
    hd), broadcast over the G query heads of their kv head. A loop over the slots, each read once, slot-major
    weights (S, B, Hkv, G, T) and in-place sums. It computes in qt's dtype (joint_attention gives it fp32): bf16
    slots are read as fp32. o is (B, Hkv, G, hd, T), like qt."""
    S = len(slots) // 2
    kts = [t.transpose(-1, -2).to(qt.dtype) for t in slots[:S]]
    vts = [t.transpose(-1, -2).to(qt.dtype) for t in slots[S:]]
    logits = torch.stack([torch.linalg.vecdot(qt, kt, dim=-2) for kt in kts]).float() * scale  # (S, B, Hkv, G, T)
    if valid is not None:                                                                # padding slots: p_j = 0
        logits = logits.masked_fill(~valid.view(S, 1, 1, 1, 1), float("-inf"))
    lse = logits.logsumexp(dim=0)
    p = torch.exp(logits - lse)
    ot = torch.zeros_like(qt)
    for pj, vt in zip(p.to(qt.dtype), vts):
        ot.addcmul_(pj[..., None, :], vt)
    return ot, lse, p


def attention_backward(dot, dlse, scale, saved):
    """[dq, dk_0, .., dv_0, ..], the exact gradient of attention_forward from what it saved, [qt, p, k_0, .., v_0,
    ..]: ds = p (dp - <p, dp>) + dlse p,
    dp_j = <do, v_j>, dq = scale sum_j ds_j k_j, dk_j = scale ds_j q, dv_j = p_j do; with G = 1 nothing is summed
    over the group. Every gradient contiguous, dq in qt's layout."""
    qt, p, *slots = saved
    S = len(slots) // 2
    kts = [t.transpose(-1, -2).to(qt.dtype) for t in slots[:S]]
    vts = [t.transpose(-1, -2).to(qt.dtype) for t in slots[S:]]
    dot = dot.contiguous()
    dp = torch.stack([torch.linalg.vecdot(dot, vt, dim=-2) for vt in vts]).float()      # (S, B, Hkv, G, T)
    ds = (p * (dp - (p * dp).sum(0) + dlse) * scale).to(qt.dtype)
    dqt = torch.zeros_like(qt)
    for dsj, kt in zip(ds, kts):
        dqt.addcmul_(dsj[..., None, :], kt)

    def per_kv_head(gt):  # a kv head's gradient sums over the G query heads that read it; back to (..., T, hd)
        return (gt if gt.size(2) == 1 else gt.sum(2, keepdim=True)).transpose(-1, -2).contiguous()
    dks = [per_kv_head(dsj[..., None, :] * qt) for dsj in ds]
    dvs = [per_kv_head(pj[..., None, :] * dot) for pj in p.to(qt.dtype)]
    return [dqt, *dks, *dvs]


class DepthAttention(torch.autograd.Function):
    """attention_forward and attention_backward as an autograd node that torch.compile traces."""

    @staticmethod
    def forward(ctx, qt, scale, valid, *slots):
        ot, lse, p = attention_forward(qt, scale, valid, slots)
        ctx.save_for_backward(qt, p, *slots)
        ctx.scale = scale
        return ot, lse

    @staticmethod
    def backward(ctx, dot, dlse):
        dqt, *dslots = attention_backward(dot, dlse, ctx.scale, ctx.saved_tensors)
        return dqt, None, None, *dslots


@torch.library.custom_op("depthbench::depth_attention", mutates_args=())
def depth_attention_node(qt: torch.Tensor, scale: float, valid: Optional[torch.Tensor],
                         slots: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_forward(qt, scale, valid, slots)


@depth_attention_node.register_fake
def _(qt, scale, valid, slots):
    B, Hkv, G, hd, T = qt.shape
    lse = qt.new_empty((B, Hkv, G, T), dtype=torch.float32)
    return torch.empty_like(qt), lse, qt.new_empty((len(slots) // 2, B, Hkv, G, T), dtype=torch.float32)


@torch.library.custom_op("depthbench::depth_attention_backward", mutates_args=())
def depth_attention_backward_node(dot: torch.Tensor, dlse: torch.Tensor, scale: float,
                                  saved: List[torch.Tensor]) -> List[torch.Tensor]:
    return attention_backward(dot, dlse, scale, saved)


@depth_attention_backward_node.register_fake
def _(dot, dlse, scale, saved):
    qt, slots = saved[0], saved[2:]
    return [torch.empty_like(qt)] + [t.new_empty(t.shape, dtype=qt.dtype) for t in slots]


def _attention_setup(ctx, inputs, output):
    qt, scale, valid, slots = inputs
    ctx.save_for_backward(qt, output[2], *slots)
    ctx.scale = scale


def _attention_grad(ctx, dot, dlse, dp):
    dqt, *dslots = depth_attention_backward_node(dot, dlse, ctx.scale, list(ctx.saved_tensors))
    return dqt, None, None, dslots


depth_attention_node.register_autograd(_attention_grad, setup_context=_attention_setup)
