"""
cpu.py: the fast namespace. Every name a design calls through `self.ops` (ops.namespace) has a body here with the
same maths as ops.py's, in other layouts; names with one body are imported from ops.py. Same maths, other layouts.

Nothing here is needed to understand a design: ops.py holds each definition, and `GPTConfig(kernels="reference")`
(`--kernels reference`) runs a model on those alone. test_all.py checks for every registered design that both give
the same logits, loss and gradients. What each trick buys, measured, is in docs/speed.md. The tricks, in short:
- AttnRes' sources and MoDA's depth keys and values in one preallocated, source-major bank each (`DepthBank`,
  `DepthKV`), written in place once per source: a consumer reads all it needs with a constant number of kernels,
  whatever its depth, and touches no slot that holds nothing yet; gradients accumulate into a gradient bank;
- hand-written autograd nodes where a loop of small ops kept many graph nodes and zero-filled gradients
  (Sinkhorn, the norm factor 1/rms, the banks);
- layouts that put the tokens last or as a matmul's wide side, where CPU BLAS and broadcasts are faster;
- MoDA's two halves merged by the fused CPU kernel's own log-sum-exp (no copy of q, k, v), or elsewhere its depth
  keys folded into the fused attention kernel as one extra "sink" key per query;
- CPU attention on heads padded to 16 wide; the loss over token chunks without the full logits.
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ops import fp32_maths, hc_read, rms_norm, topk_count, topk_sources  # noqa: F401  (one body: the same names here)

CPU_SDPA_MIN_HEAD_DIM = 16  # CPU attention pads narrower heads with zeros to this width
LOSS_CHUNK_BYTES = 2 ** 27  # fp32 logits per chunk of the logits-free loss: 128 MB, 667 tokens at V 50304


# ----------------------------------------------------------------------------- RoPE, attention, the loss

def apply_rope(x, cos, sin):
    """rotate_half(x) sin = roll(x, hd/2) [-sin_1, sin_2]: one roll instead of a negation and a concatenation."""
    xf, half = x.float(), x.size(-1) // 2
    return (xf * cos + xf.roll(half, -1) * torch.cat([-sin[..., :half], sin[..., half:]], -1)).to(x.dtype)


def head_pad(q):
    """How many zero channels CPU attention adds to q's heads: up to CPU_SDPA_MIN_HEAD_DIM wide (0 on other devices).
    The zeros add nothing to q.k; the padded value channels are cut from the output; the scale stays the unpadded one."""
    return max(0, CPU_SDPA_MIN_HEAD_DIM - q.size(-1)) if q.device.type == "cpu" else 0


def padded(tensors, pad):
    """The tensors, each with `pad` zero channels appended to its last dim (as they are for 0)."""
    return tuple(F.pad(t, (0, pad)) if pad else t for t in tensors)


def causal_attention(q, k, v):
    """On CPU a head narrower than CPU_SDPA_MIN_HEAD_DIM is zero-padded to it and the output cut back (`head_pad`)."""
    hd, pad = q.size(-1), head_pad(q)
    q, k, v = padded((q, k, v), pad)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd ** -0.5, enable_gqa=k.size(1) < q.size(1))
    return o[..., :hd]


def joint_attention(q, k, v, depth):
    """One softmax over the sequence and depth logits, o_t = (Z_seq o_seq + Z_depth o_depth) / (Z_seq + Z_depth).

    The depth half is `depth.attend` (the DepthKV bank, in fp32). On the CPU in fp32, with as many kv heads as query
    heads, the fused kernel's own log-sum-exp merges the halves (`MergeDepth`); otherwise the depth half enters the
    fused kernel as a sink key (`sink_attention`)."""
    scale = q.size(-1) ** -0.5
    o_depth, lse = depth.attend(q, scale)                                         # (B, H, T, hd), (B, H, T)
    if q.device.type == "cpu" and q.dtype == torch.float32 and k.size(1) == q.size(1):
        o, share = MergeDepth.apply(q, k, v, o_depth, lse)
        return o, share.detach()
    return sink_attention(q, k, v, o_depth=o_depth, lse=lse)


class MergeDepth(torch.autograd.Function):
    """The sequence half by the CPU's fused kernel, which returns its log-sum-exp lse_seq, merged with the depth half
    (o_depth, lse_depth): lse = logaddexp(lse_seq, lse_depth), share = exp(lse_depth - lse),
    o = o_seq + share (o_depth - o_seq). No copy of q, k or v (heads narrower than CPU_SDPA_MIN_HEAD_DIM are
    zero-padded to it, `head_pad`). Backward, as ring attention merges blocks: the fused backward given
    the joint o and lse is the sequence keys' part of the joint softmax's gradient (dq, dk, dv); the depth half gets
    do_depth = share do and dlse_depth = share <do, o_depth - o>, which its own backward turns into the depth keys'
    part. -> (o (B, H, T, hd), share (B, H, T))."""

    @staticmethod
    def forward(ctx, q, k, v, o_depth, lse_depth):
        hd, pad = q.size(-1), head_pad(q)
        scale = hd ** -0.5
        q, k, v, o_depth = padded((q, k, v, o_depth), pad)
        o_seq, lse_seq = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True, scale=scale)
        lse = torch.logaddexp(lse_seq, lse_depth)
        share = torch.exp(lse_depth - lse)
        o = o_seq + share[..., None] * (o_depth - o_seq)                   # the padded channels stay 0
        ctx.save_for_backward(q, k, v, o, lse, o_depth, share)
        ctx.scale, ctx.hd, ctx.pad = scale, hd, pad
        ctx.mark_non_differentiable(share)
        return o[..., :hd], share

    @staticmethod
    def backward(ctx, do, _):
        q, k, v, o, lse, o_depth, share = ctx.saved_tensors
        (do,) = padded((do,), ctx.pad)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out=o, logsumexp=lse, dropout_p=0.0, is_causal=True, scale=ctx.scale)
        dq, dk, dv = (g[..., :ctx.hd] for g in grads)
        d_lse_depth = share * (do * (o_depth - o)).sum(-1)
        d_o_depth = share[..., None] * do[..., :ctx.hd]
        return dq, dk, dv, d_o_depth, d_lse_depth


def sink_attention(q, k, v, o_depth, lse):
    """The sequence half through the fused SDPA kernel with one extra "sink" key per query that stands for all its
    depth keys: extra query coordinates holding lse_depth / scale against a sink key with 1s there give the sink
    exactly the logit log Z_depth, and a 1 in an extra value channel reads out its share Z_depth / (Z_seq + Z_depth).
    Under bf16 the logit rides in two coordinates, hi + lo (~16 mantissa bits; exact in fp32). A dummy first query
    lets SDPA's top-left causal mask show every query the sink (key 0) and the sequence keys up to itself."""
    B, H, T, hd = q.shape
    Hkv, scale = k.size(1), hd ** -0.5
    lse = lse / scale
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
    o = out[..., :hd] + share[..., None] * o_depth                                 # fp32: o_depth is
    return o.to(q.dtype), share.detach()


def lm_loss(z, weight, targets):
    """The loss without the (B, T, V) logits at once (`chunked_cross_entropy`)."""
    return chunked_cross_entropy(z.flatten(0, 1), weight, targets.flatten())


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
    """(x @ W) / rms(x): no normalised copy of x, and the projection with the tokens as BLAS columns. In fp32."""
    with fp32_maths(x):
        x, W = x.float(), W.float()
        return skinny_matmul(x, W) * InvRms.apply(x, eps)[..., None]


def width_connection(H, pre, res):
    """Both mixes as one (n+1 x n) @ (n x D) matmul per token, split (a slice's backward zero-fills the product).
    In fp32."""
    with fp32_maths(H):
        maps = torch.cat([pre.float()[..., None, :], res.float()], dim=-2)     # (B, T, n+1, n)
        branch, mixed = (maps @ H.float()).split([1, H.size(-2)], dim=-2)
        return branch.squeeze(-2), mixed


def depth_connection(mixed, post, y):
    """mixed + post (x) y as one baddbmm over the tokens. In fp32."""
    with fp32_maths(mixed):
        mixed, post, y = mixed.float(), post.float(), y.float()
        return torch.baddbmm(mixed.flatten(0, 1), post.flatten(0, 1)[..., None], y.flatten(0, 1)[:, None]).view_as(mixed)


def sinkhorn(logits, iters=20, eps=1e-6):
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


# ----------------------------------------------------------------------------- the depth banks (AttnRes, MoDA)
#
# A bank holds every source one forward pass writes, source-major (slot j is a contiguous (B, T, ...) block), and is
# shared by the states of that pass: a state is a view (the bank, how many slots it holds, its token). `push` writes
# the next slot in place and returns a view one longer; a consumer reads the slots its view holds, [0, n), with a
# constant number of kernels, and never a slot beyond them. Autograd does not see the in-place writes: each push is
# a node whose output, the token (a 0-dim tensor), every later push and read takes as an input, so backward runs a
# slot's push only after every consumer that read the slot; the consumers add their gradients into the bank's
# gradient slots, and the push hands its slot's total to the tensor it wrote. Reads and writes depend on how many
# slots a view holds, so they run eagerly under torch.compile (`torch.compiler.disable`; docs/speed.md#compile).


class Bank:
    """Storage of one forward pass: one tensor (n_max, *shape) per kind of slot (AttnRes: the sources; MoDA: keys
    and values), allocated by the first push (its dtype and device), their gradients (fp32) by the first backward that
    needs them, and per-slot extras (AttnRes: each source's 1/rms, fp32). With tokens_last_on_cpu (MoDA), a bank on
    the CPU stores each slot with its last two axes swapped, (..., hd, T): the tokens contiguous, for the depth
    contractions below."""

    def __init__(self, n_max, norm_eps=None, tokens_last_on_cpu=False):
        self.n_max, self.norm_eps = n_max, norm_eps      # norm_eps: AttnRes' key-norm eps (r_j); None for MoDA
        self.written = 0                                 # slots [0, written) hold what the pushes wrote
        self.slots = self.grads = None
        self.inv_rms = self.d_inv_rms = None        # AttnRes only: r_j, and the gradient that reached it
        self.tokens_last_on_cpu, self.tokens_last = tokens_last_on_cpu, False

    def write(self, j, tensors):
        if self.slots is None:
            self.tokens_last = self.tokens_last_on_cpu and tensors[0].device.type == "cpu"
            self.slots = [self.stored(t).new_empty((self.n_max, *self.stored(t).shape)) for t in tensors]
        if j >= self.n_max:
            raise ValueError(f"a bank of {self.n_max} slots cannot take slot {j}")
        for slot, t in zip(self.slots, tensors):
            slot[j].copy_(self.stored(t))
        self.written = j + 1

    def stored(self, t):
        """t (or a slot's gradient) as the bank stores it: a view, its last two axes swapped when tokens_last."""
        return t.transpose(-1, -2) if self.tokens_last else t

    def scratch(self, j, v):
        """Slot j holds v for one read (a group's open sum), its r_j with it, outside the history: `written` stays, and
        the next push or scratch overwrites it."""
        self.slots[0][j].copy_(v)
        self.inv_rms[j] = inv_rms(self.slots[0][j].float(), self.norm_eps)

    def fork(self, n):
        """A bank holding a copy of slots [0, n), for a state that pushes after another state of the same pass pushed
        past it: a diagnostic that tries two continuations (no gradients) leaves the other's slots as they are."""
        other = Bank(self.n_max, self.norm_eps, self.tokens_last_on_cpu)
        other.slots, other.tokens_last = [s.clone() for s in self.slots], self.tokens_last
        other.inv_rms = None if self.inv_rms is None else self.inv_rms.clone()
        other.written = n
        return other

    def gradients(self):
        """The fp32 gradient of every slot, zero until the consumers' backward adds to it."""
        if self.grads is None:
            self.grads = [torch.zeros(s.shape, dtype=torch.float32, device=s.device) for s in self.slots]
        return self.grads


def linear(bank, n):
    """Whether a push at slot n continues the bank's one history: the next slot, or (with gradients on) a slot that
    activation checkpointing's recompute writes again with the values it holds."""
    return bank.written == n or torch.is_grad_enabled()


class Push(torch.autograd.Function):
    """Write `tensors` into slot j of the bank (forward); hand each its slot's accumulated gradient (backward). With
    the bank's norm_eps (AttnRes), also store r_j = rsqrt(mean(v_j^2) + eps) of the stored source, whose gradient dr_j the
    consumers accumulate, and add its part, dr_j dr/dv_j = -dr_j r_j^3 v_j / D, to dv_j."""

    @staticmethod
    def forward(ctx, bank, j, token, *tensors):
        bank.write(j, tensors)
        if bank.norm_eps is not None:
            if bank.inv_rms is None:
                bank.inv_rms = bank.slots[0].new_empty(bank.slots[0].shape[:-1], dtype=torch.float32)
            bank.inv_rms[j] = inv_rms(bank.slots[0][j].float(), bank.norm_eps)
        ctx.bank, ctx.j, ctx.norm = bank, j, bank.norm_eps is not None
        ctx.dtypes, ctx.had_token = [t.dtype for t in tensors], token is not None
        return tensors[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, dtoken):
        bank, j = ctx.bank, ctx.j
        grads = [bank.stored(g[j]) for g in bank.gradients()]              # stored() undoes its own swap
        if ctx.norm and bank.d_inv_rms is not None:
            v, r = bank.slots[0][j].float(), bank.inv_rms[j]
            grads[0] = grads[0] + (bank.d_inv_rms[j] * r.pow(3) / -v.size(-1))[..., None] * v
        dtoken_in = torch.zeros_like(dtoken) if ctx.had_token else None
        return (None, None, dtoken_in, *(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)))


def tokens_major(slots, n):
    """Slots [0, n) of a (n_max, B, T, D) bank as (B * T, n, D): a view (its rows are BT * D apart), which a batched
    matmul reads in place."""
    return slots[:n].flatten(1, -2).transpose(0, 1)


def source_dots(V, x):
    """<v_j, x> per token for every source j: (n, B, T), as one batched matmul over the tokens, x_t^T [v_1 .. v_n]:
    the source-major bank read in place as each token's D x n matrix. At 64 sources, BT 2048, D 128 (one thread)
    6.4 ms, against 34 ms for a broadcast multiply and sum (its full-size temporary) and 18 ms for [v_j]^T x_t (which
    copies the bank tokens-major first)."""
    n, B, T, D = V.shape
    return torch.bmm(x.reshape(B * T, 1, D), tokens_major(V, n).transpose(1, 2)).view(B, T, n).permute(2, 0, 1)


class Mix(torch.autograd.Function):
    """AttnRes' depth mix over the bank's first n sources and an optional extra one (a group's open partial sum):
    s_j = r_j <v_j, gq>, p = softmax_j(s), mix = sum_j p_j v_j, with gq = key_gain * query. -> (mix (B, T, D) fp32,
    p (n [+ 1], B, T), not differentiable). The extra source is written to the scratch slot n and read with the
    others (the same kernels as a bank that had pushed it: Block AttnRes in groups of one is Full AttnRes bit for
    bit); backward reads it from the tensor it was, as the slot is overwritten by then. keep < all: only the keep
    largest s_j of each token enter the softmax (ops.topk_sources), the others get p_j = 0, which the backward
    carries through unchanged. Backward, per consumer: ds = p (dp - <p, dp>), dp_j = <v_j, dmix>; dv_j += p_j dmix +
    ds_j r_j gq and dr_j += ds_j <v_j, gq> into the bank (the extra's straight to it); dgq = sum_j ds_j r_j v_j."""

    @staticmethod
    def forward(ctx, bank, sizes, gq, token, extra):
        n, keep = sizes                                                          # sources in the bank, to keep
        if extra is not None:
            bank.scratch(n, extra)
        m = n if extra is None else n + 1                                        # the sources read
        V = bank.slots[0][:m].float()                                            # (m, B, T, D): a view in fp32
        D = V.size(-1)
        u = (V.reshape(-1, D) @ gq).view(V.shape[:-1])                            # (m, B, T)
        r = bank.inv_rms[:m]                       # the bank's r_j, read again in backward (the scratch slot's is kept)
        s = u * r
        if keep < m:
            s = s.masked_fill(~topk_sources(s, keep), float("-inf"))
        p = s.softmax(dim=0)
        weights = p.flatten(1).t().contiguous().unsqueeze(1)                     # (BT, 1, m)
        mix = V.new_empty(V.shape[1:])                                           # (B, T, D): no view of another
        torch.bmm(weights, tokens_major(V, m), out=mix.view(-1, 1, D))
        if extra is not None:
            ctx.save_for_backward(gq, p, u, extra, r[n:].clone())
        else:
            ctx.save_for_backward(gq, p, u)
        ctx.bank, ctx.n = bank, n
        ctx.mark_non_differentiable(p)
        return mix, p

    @staticmethod
    def backward(ctx, dmix, _):
        bank, n = ctx.bank, ctx.n
        gq, p, u, *extra = ctx.saved_tensors
        V = bank.slots[0][:n].float()
        D = V.size(-1)
        dp = source_dots(V, dmix)                                                # (n, B, T)
        r = bank.inv_rms[:n]
        if extra:
            dp = torch.cat([dp, (extra[0].float() * dmix).sum(-1)[None]])
            r = torch.cat([r, extra[1]])
        ds = p * (dp - (p * dp).sum(0))
        a = ds * r                                                               # ds_j r_j
        dV = bank.gradients()[0][:n]
        dV.addcmul_(p[:n, ..., None], dmix).addcmul_(a[:n, ..., None], gq)
        if bank.d_inv_rms is None:
            bank.d_inv_rms = torch.zeros_like(bank.inv_rms)
        bank.d_inv_rms[:n] += ds[:n] * u[:n]
        dgq = (a[:n].reshape(1, -1) @ V.reshape(-1, D)).view(D)
        d_extra = None
        if extra:
            v = extra[0].float()
            dgq = dgq + (a[n].reshape(1, -1) @ v.reshape(-1, D)).view(D)
            norm = (ds[n] * u[n]) * r[n].pow(3) / -D                             # through r of the extra source
            d_extra = (p[n, ..., None] * dmix + a[n, ..., None] * gq + norm[..., None] * v).to(extra[0].dtype)
        return None, None, dgq, torch.zeros_like(gq[0]), d_extra


class DepthBank:
    """AttnRes' sources in a bank (see above): the same interface as ops.DepthBank. A view: the bank, the number of
    sources it holds, and the token of its last push."""

    def __init__(self, bank, n, token):
        self.bank, self.n, self.token = bank, n, token

    @classmethod
    def start(cls, first, n_max, eps=1e-5, queries=None, key_gains=None):
        return cls(Bank(n_max, norm_eps=eps), 0, None).push(first)          # queries, key_gains: unused here

    @torch.compiler.disable
    def push(self, v):
        bank = self.bank if linear(self.bank, self.n) else self.bank.fork(self.n)
        token = Push.apply(bank, self.n, self.token, v)
        return DepthBank(bank, self.n + 1, token)

    @torch.compiler.disable
    def mix(self, query, key_gain, eps, extra=None, topk_fraction=1.0, site=None):      # site: unused here
        if eps != self.bank.norm_eps:
            raise ValueError(f"the bank's key norm uses eps {self.bank.norm_eps}, not {eps}")
        keep = topk_count(self.n + (extra is not None), topk_fraction)
        with fp32_maths(query):
            gq = key_gain.float() * query.float()
            mix, p = Mix.apply(self.bank, (self.n, keep), gq, self.token, extra)
        return mix, p.movedim(0, -1), extra                                     # ops.DepthBank.mix's triple

    @torch.compiler.disable
    def weighted_sum(self, weights):
        with fp32_maths(weights):
            return WeightedSum.apply(self.bank, self.n, self.token, weights)

    @torch.compiler.disable
    def newest(self):
        """The last source pushed, as a tensor that autograd connects to it (a copy of its slot)."""
        return Read.apply(self.bank, self.n - 1, self.token)

    def __len__(self):
        return self.n


class WeightedSum(torch.autograd.Function):
    """DenseFormer's and MUDD's weighted sum over the bank's first n sources, out = sum_j w[..., j] v_j in fp32, as
    one batched matmul per token: w (n,) static -> (B, T, D), or (C, B, T, n) per token and stream -> (C, B, T, D).
    Backward: dv_j += sum_c w[c, j] dout_c into the bank; dw[c, j] = <v_j, dout_c> (summed over the tokens for a
    static w)."""

    @staticmethod
    def forward(ctx, bank, n, token, w):
        V = bank.slots[0][:n].float()                                            # (n, B, T, D): a view in fp32
        B, T, D = V.shape[1:]
        per_token = w.float() if w.dim() > 1 else w.float().expand(1, B, T, n)   # (C, B, T, n)
        wt = per_token.reshape(per_token.size(0), B * T, n).transpose(0, 1)      # (BT, C, n)
        out = torch.bmm(wt, tokens_major(V, n)).transpose(0, 1).reshape(-1, B, T, D)   # (C, B, T, D)
        ctx.save_for_backward(wt)
        ctx.bank, ctx.n, ctx.static, ctx.w_dtype = bank, n, w.dim() == 1, w.dtype
        return out[0] if ctx.static else out

    @staticmethod
    def backward(ctx, dout):
        bank, n, (wt,) = ctx.bank, ctx.n, ctx.saved_tensors
        V = bank.slots[0][:n].float()
        B, T, D = V.shape[1:]
        dout_t = dout.float().reshape(-1, B * T, D).transpose(0, 1)              # (BT, C, D)
        tokens_major(bank.gradients()[0], n).add_(torch.bmm(wt.transpose(1, 2), dout_t))
        dw = torch.bmm(dout_t, tokens_major(V, n).transpose(1, 2))               # (BT, C, n)
        dw = dw.sum((0, 1)) if ctx.static else dw.transpose(0, 1).reshape(-1, B, T, n)
        return None, None, torch.zeros((), dtype=torch.float32, device=dout.device), dw.to(ctx.w_dtype)


class Read(torch.autograd.Function):
    """A copy of slot j (forward); its gradient joins the slot's (backward)."""

    @staticmethod
    def forward(ctx, bank, j, token):
        ctx.bank, ctx.j = bank, j
        return bank.slots[0][j].clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.bank.gradients()[0][ctx.j].add_(grad)
        return None, None, torch.zeros((), dtype=torch.float32, device=grad.device)


class Attend(torch.autograd.Function):
    """MoDA's depth half over the first n slots: per query token t and head, s_j = scale <q_t, k_j,t>, lse = log sum_j
    exp(s_j), o = sum_j softmax(s)_j v_j,t, in fp32. q (B, H, T, hd) -> (o (B, H, T, hd), lse (B, H, T)). Query head
    h reads kv head h // G (GQA). Backward: dlogit = p (dp - <p, dp> + dlse), dp_j = <do, v_j>; dq = scale sum_j
    dlogit_j k_j; dk_j += scale sum_g dlogit_gj q_g and dv_j += sum_g p_gj do_g into the bank. Weights are slot-major,
    (n, B, Hkv, G, T)."""

    @staticmethod
    def forward(ctx, bank, n, scale, token, q):
        B, H, T, hd = q.shape
        K, V = (s[:n].float() for s in bank.slots)                    # (n, B, Hkv, T, hd); CPU: (n, B, Hkv, hd, T)
        qg = q.float().reshape(B, K.size(2), H // K.size(2), T, hd)               # (B, Hkv, G, T, hd)
        qs = bank.stored(qg).contiguous()                                        # as the slots: once, for both passes
        logits = slot_dots(qs, K) * scale                                        # (n, B, Hkv, G, T)
        lse = logits.logsumexp(0)
        p = torch.exp(logits - lse)
        o = slot_sum(p, V)                                                       # (B, Hkv, G, T, hd)
        ctx.save_for_backward(qs, p)
        ctx.bank, ctx.n, ctx.scale, ctx.dtype = bank, n, scale, q.dtype
        return o.reshape(B, H, T, hd), lse.reshape(B, H, T)

    @staticmethod
    def backward(ctx, do, dlse):
        bank, n, scale = ctx.bank, ctx.n, ctx.scale
        qs, p = ctx.saved_tensors
        K, V = (s[:n].float() for s in bank.slots)
        dog = do.float().reshape(*p.shape[1:-1], *do.shape[-2:])                 # (B, Hkv, G, T, hd)
        dos = bank.stored(dog).contiguous()                                      # as the slots, as qs
        dp = slot_dots(dos, V)                                                   # (n, B, Hkv, G, T)
        dlogit = p * (dp - (p * dp).sum(0) + dlse.float().reshape(p.shape[1:])) * scale
        dq = slot_sum(dlogit, K)
        dK, dV = (g[:n] for g in bank.gradients())                               # as K and V
        add_outer(dK, dlogit, qs)
        add_outer(dV, p, dos)
        return None, None, None, None, dq.reshape(do.shape).to(ctx.dtype)


# The three contractions of the depth half between per-token vectors x and the bank's slots S, both in the bank's
# layout (Bank.stored), with weights w (n, B, Hkv, G, T). On CUDA the slots are (n, B, Hkv, T, c), x (B, Hkv, G, T, c),
# and each contraction is one batched matmul over the tokens. On the CPU the slots are stored tokens-last,
# (n, B, Hkv, c, T), x (B, Hkv, G, c, T): a caller that reads x twice (forward and backward) turns it once. Each is a
# short loop over the head's c channels (or the G query heads of a kv head) of in-place broadcasts along the
# contiguous tokens: a number of kernels set by the head width, not by the depth, and no temporary larger than the
# weights (n, B, Hkv, G, T). A single broadcast and sum made an (n, B, Hkv, G, T, c) temporary per contraction:
# above glibc's mmap threshold it is fresh pages every time (at L32 d128 the eager MoDA step was 2.4x Pre-LN's with
# it, 1.9x with the threshold raised).

def slot_dots(x, S):
    """w_j = <x, S_j> per token and head: (n, B, Hkv, G, T)."""
    if x.is_cuda:
        return slot_dots_batched(x, S)
    S = S.unsqueeze(3)                                                           # (n, B, Hkv, 1, c, T)
    w = S[..., 0, :] * x[..., 0, :]
    for c in range(1, x.size(-2)):
        w.addcmul_(S[..., c, :], x[..., c, :])
    return w


def slot_sum(w, S):
    """sum_j w_j S_j: (B, Hkv, G, T, c)."""
    if w.is_cuda:
        return slot_sum_batched(w, S)
    return torch.stack([(w * S[:, :, :, None, c]).sum(0) for c in range(S.size(-2))], dim=-1)


def add_outer(dS, w, x):
    """dS_j += sum_g w_gj x_g: the slots' gradient from per-token vectors x, in place."""
    if x.is_cuda:
        return add_outer_batched(dS, w, x)
    for g in range(x.size(2)):
        dS.addcmul_(w[:, :, :, g, None, :], x[:, :, g])


def slot_dots_batched(x, S):
    """slot_dots as one batched matmul over the tokens (CUDA's body; tested against the CPU's on the CPU)."""
    B, Hkv, G, T, c = x.shape
    xt = x.transpose(2, 3).reshape(-1, G, c)                                     # (B Hkv T, G, c)
    w = torch.bmm(xt, tokens_major(S, S.size(0)).transpose(1, 2))                # (B Hkv T, G, n)
    return w.view(B, Hkv, T, G, -1).permute(4, 0, 1, 3, 2)


def slot_sum_batched(w, S):
    """slot_sum as one batched matmul over the tokens (CUDA's body)."""
    n, B, Hkv, G, T = w.shape
    wt = w.permute(1, 2, 4, 3, 0).reshape(-1, G, n)                              # (B Hkv T, G, n)
    out = torch.bmm(wt, tokens_major(S, n))                                      # (B Hkv T, G, c)
    return out.view(B, Hkv, T, G, -1).transpose(2, 3)


def add_outer_batched(dS, w, x):
    """add_outer on (n, B, Hkv, T, c) slots (CUDA's body)."""
    if x.size(2) == 1:
        dS.addcmul_(w.squeeze(3).unsqueeze(-1), x.squeeze(2))
    else:
        dS.add_((w.unsqueeze(-1) * x.unsqueeze(0)).sum(3))


class DepthKV:
    """MoDA's depth keys and values in a bank (see above): the same interface as ops.DepthKV."""

    def __init__(self, bank, n, token):
        self.bank, self.n, self.token = bank, n, token

    @classmethod
    def start(cls, n_max):
        return cls(Bank(n_max, tokens_last_on_cpu=True), 0, None)

    @torch.compiler.disable
    def push(self, key, value):
        bank = self.bank if linear(self.bank, self.n) else self.bank.fork(self.n)
        token = Push.apply(bank, self.n, self.token, key, value)
        return DepthKV(bank, self.n + 1, token)

    @torch.compiler.disable
    def attend(self, q, scale):
        with fp32_maths(q):
            return Attend.apply(self.bank, self.n, scale, self.token, q)

    def __len__(self):
        return self.n
