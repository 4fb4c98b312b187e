"""
One readable GPT for every residual design of DepthBench.

The backbone is LLaMA-like (docs/designs.md#backbone):
- token embedding and LM head, untied, no embedding scale
- RoPE (theta 10000, NeoX "rotate-half", computed in fp32) on q and k
- causal attention (16 query heads by default; `n_kv_head` < n_head gives grouped-query attention,
  GQA, where each key/value head serves n_head / n_kv_head query heads), no biases, no QK-norm
- SwiGLU MLP: W_2(silu(W_1 x) * W_3 x), no biases
- truncated-normal init, std 0.02, clipped at +-3 std

What is deliberately *not* here: norms, residual adds, the final norm. Attention and the MLP are
pure branch functions; every norm placement, residual add, stream mixing and the final collapse live
in residuals.py behind one small interface (see its module docstring). The trunk loop in
`GPT.forward` is the whole contract between the two files.
"""
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.utils.checkpoint import checkpoint

from ops import DepthAttention
from residuals import RESIDUALS

LOSS_CHUNK_BYTES = 2 ** 27  # fp32 logits per chunk of the logits-free loss: 128 MB, 667 tokens at V 50304
CPU_SDPA_MIN_HEAD_DIM = 16  # CPU attention pads narrower heads with zeros to this (see causal_attention)


@dataclass
class GPTConfig:
    vocab_size: int = 50280     # the paper's GPT-NeoX vocab; train.py pads GPT-2's 50257 to 50304
    n_layer: int = 24           # number of blocks (each block = attention sublayer + MLP sublayer)
    d_model: int = 1024         # width; the paper's shapes use d = 16 * head_dim
    n_head: int = 16            # query heads
    n_kv_head: int = None       # key/value heads; None = n_head (MHA). The paper's 1.6B suite uses 8 (GQA)
    d_ff: int = 2736            # SwiGLU hidden size, ceil16(8d/3) in the paper's shape rule
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6      # every RMSNorm of the backbone
    init_std: float = 0.02      # truncated normal, clipped at +-3 std
    residual: str = "preln"     # key of residuals.RESIDUALS
    residual_args: dict = field(default_factory=dict)  # constructor options of the design, e.g. {"n_groups": 8}

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} must be a multiple of n_kv_head {self.n_kv_head}")

    @property
    def head_dim(self):
        return self.d_model // self.n_head


def rope_cos_sin(T, head_dim, theta, device):
    """cos/sin tables (T, head_dim) in fp32, frequencies duplicated over the two halves."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)                                         # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on (B, H, T, hd) in fp32; returns x's dtype.

    rotate_half(x) * sin = roll(x, hd/2) * [-sin_1, sin_2]: one roll instead of a negation and a
    concatenation (bit-identical, about 2x faster forward + backward on CPU)."""
    xf, half = x.float(), x.size(-1) // 2
    return (xf * cos + xf.roll(half, -1) * torch.cat([-sin[..., :half], sin[..., half:]], -1)).to(x.dtype)


def causal_attention(q, k, v, scale):
    """Causal SDPA of q (B, H, T, hd) over k, v (B, Hkv, T, hd), Hkv dividing H (GQA).

    On CPU a head narrower than CPU_SDPA_MIN_HEAD_DIM is zero-padded to it and the output cut back: the
    same maths (the zeros add nothing to q.k, the padded value channels are dropped; the scale is passed
    explicitly), but PyTorch's CPU flash kernel runs hd 16 faster than hd 4 or 8 (measured fp32, 1 thread,
    B 8, H 16, T 256, forward + backward: hd 8 75 ms, the same heads padded to 16 48 ms)."""
    hd = q.size(-1)
    pad = CPU_SDPA_MIN_HEAD_DIM - hd if q.device.type == "cpu" else 0
    if pad > 0:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.size(1) < q.size(1))
    return o[..., :hd] if pad > 0 else o


def joint_attention(q, k, v, depth_k, depth_v, scale):
    """Causal attention whose softmax also spans each query token's own depth keys (MoDA).

    q: (B, H, T, hd), k, v: (B, Hkv, T, hd) sequence part (q, k after RoPE; Hkv divides H, GQA);
    depth_k, depth_v: lists of S tensors (B, Hkv, T, hd), the keys/values of S earlier sublayers at
    the *same* token. The result is exactly one softmax per query over its causal sequence logits and
    its S depth logits:

        o_t = (Z_seq * o_seq + Z_depth * o_depth) / (Z_seq + Z_depth)

    The depth half is small (S keys per token) and done by hand. The sequence half goes through
    the fused SDPA kernel (no T x T logits kept), with one extra "sink" key per query that stands
    for all its depth keys: an extra query coordinate lse_depth / scale against a sink key with a 1
    in that coordinate gives the sink exactly the logit lse_depth = log Z_depth, and a 1 in an extra
    value channel reads out its share Z_depth / (Z_seq + Z_depth). A dummy first query lets SDPA's
    top-left causal mask show every query the sink (key 0) and the sequence keys up to itself.
    Returns the output (B, H, T, hd) and the depth share (B, H, T), detached, for diagnostics.
    """
    B, H, T, hd = q.shape
    Hkv = k.size(1)                      # GQA: query heads h * G .. h * G + G - 1 share kv head h
    qg = q.unflatten(1, (Hkv, H // Hkv))  # (B, Hkv, G, T, hd), a view: no copy of the kv heads
    o_depth, lse_depth = DepthAttention.apply(scale, len(depth_k), qg, *(kv[:, :, None] for kv in depth_k + depth_v))
    o_depth, lse_depth = o_depth.flatten(1, 2), lse_depth.flatten(1, 2)  # (B, H, T, hd), (B, H, T)
    # extra coordinates: one is enough; 8 keeps CUDA's fused kernels (head_dim % 8); on CPU at least up to
    # CPU_SDPA_MIN_HEAD_DIM, where its kernel runs faster (causal_attention)
    pad = 8 if q.is_cuda else max(1, CPU_SDPA_MIN_HEAD_DIM - hd)
    e0 = F.one_hot(torch.tensor(0, device=q.device), pad).to(q.dtype)               # (pad,) = [1, 0, ...]
    q_aug = torch.cat([q, (lse_depth / scale).to(q.dtype)[..., None] * e0], dim=-1)  # (B, H, T, hd + pad)
    k_aug = F.pad(k, (0, pad))
    v_aug = F.pad(v, (0, pad))
    sink = torch.cat([q.new_zeros(hd), e0]).expand(B, Hkv, 1, hd + pad)            # the sink's key and value
    out = F.scaled_dot_product_attention(
        torch.cat([q_aug.new_zeros(B, H, 1, hd + pad), q_aug], dim=2),            # dummy query first
        torch.cat([sink, k_aug], dim=2), torch.cat([sink.to(v.dtype), v_aug], dim=2),
        is_causal=True, scale=scale, enable_gqa=Hkv < H)[:, :, 1:]                 # (B, H, T, hd + pad)
    share = out[..., hd]                                                          # Z_depth / (Z_seq + Z_depth)
    return out[..., :hd] + share[..., None] * o_depth, share.detach()


def _chunk_ce(z, weight, targets):
    return F.cross_entropy(F.linear(z, weight).float(), targets, ignore_index=-1, reduction="sum")


def chunked_cross_entropy(z, weight, targets, chunk=None):
    """Mean token cross-entropy of logits z W^T in fp32 (targets -1 ignored), without the full logits.

    z (N, D), weight (V, D), targets (N,). Tokens go through the head in chunks of `chunk` (default:
    LOSS_CHUNK_BYTES of fp32 logits); each chunk is checkpointed, so autograd keeps only z, and the
    backward recomputes one chunk's logits at a time. Peak: one chunk's logits, their fp32 copy and
    gradient, instead of the whole (N, V) of each. Costs one extra head matmul (forward) per token.
    """
    chunk = chunk or max(1, LOSS_CHUNK_BYTES // (4 * weight.size(0)))
    if z.size(0) <= chunk:  # one chunk: the plain loss, nothing to recompute
        return _chunk_ce(z, weight, targets) / (targets != -1).sum()
    total = sum(checkpoint(_chunk_ce, z[s:s + chunk], weight, targets[s:s + chunk], use_reentrant=False)
                for s in range(0, z.size(0), chunk))
    return total / (targets != -1).sum()


class Attention(nn.Module):
    """Causal attention with RoPE, multi-head (n_kv_head = n_head) or grouped-query (n_kv_head < n_head:
    W_k, W_v map d -> n_kv_head * head_dim and query head h reads kv head h // (n_head / n_kv_head), the
    same maths as MHA whose k/v heads are copies). No norm inside.

    `depth_kv` is the one door into attention, used only by MoDA (residuals.py): a pair of lists
    (keys, values), each (B, n_kv_head, T, hd), of earlier sublayers at the same token, which join the
    causal keys in one softmax (`joint_attention`). The forward returns (y, aux): aux holds this layer's
    *pre-RoPE* k and v, (B, T, n_kv_head, hd) each, which MoDA caches for later layers, and MoDA's
    depth-attention mass.
    """

    def __init__(self, cfg):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        assert cfg.n_head * hd == d, "d_model must equal n_head * head_dim"
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, hd
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x, rope, depth_kv=None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim)                              # (B, T, H, hd)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim)                           # (B, T, Hkv, hd)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = rope
        qr = apply_rope(q.transpose(1, 2), cos, sin)                                       # (B, H, T, hd)
        kr = apply_rope(k.transpose(1, 2), cos, sin)
        vt = v.transpose(1, 2)
        mass = None
        if depth_kv is None:
            o = causal_attention(qr, kr, vt, self.head_dim ** -0.5)
        else:
            o, mass = joint_attention(qr, kr, vt, *depth_kv, self.head_dim ** -0.5)
        y = self.wo(o.transpose(1, 2).reshape(B, T, -1))
        return y, {"k": k, "v": v, "depth_mass": mass}


class MLP(nn.Module):
    """SwiGLU: W_2(silu(W_1 x) * W_3 x). No norm inside."""

    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Just a container of the two sublayers; the residual design decides how they are wired."""

    def __init__(self, cfg):
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)


class GPT(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.residual not in RESIDUALS:
            raise ValueError(f"unknown residual {cfg.residual!r}; choose from {', '.join(RESIDUALS)}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.res = RESIDUALS[cfg.residual](cfg, **cfg.residual_args)   # owns all norms and mixing
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Every init of the model, in one place.

        - embedding, W_q, W_k, W_v, W_o, W_1, W_2, W_3, LM head: truncated normal(0, 0.02) at +-3 std
        - then the design may rescale a sublayer (`res.scale_sublayer_init`: DeepNorm's beta on
          v/o/FFN, HC/mHC's 1/sqrt(n) on W_o and W_2); scaling a +-3 std truncated normal by c gives
          exactly the +-3 (c std) truncated normal
        - then the design initialises its own parameters (`res.reset_parameters`: norm gains 1,
          mixing weights, pseudo-queries, MoDA's W_kv)
        """
        std = self.cfg.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(m.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        for b, block in enumerate(self.blocks):
            self.res.scale_sublayer_init(2 * b, block.attn)
            self.res.scale_sublayer_init(2 * b + 1, block.mlp)
        self.res.reset_parameters()

    def forward(self, idx, targets=None, record=False, logits=True):
        """idx (B, T) token ids -> (logits (B, T, V), loss or None[, record]).

        loss: mean token cross-entropy in fp32; targets equal to -1 are ignored.
        logits=False (with targets; training): returns None for the logits and computes the same loss
        in token chunks (`chunked_cross_entropy`), never holding all (B, T, V) logits or their fp32 copy.
        record=True also returns a dict for diagnose.py: `states`, the depth states z_0..z_L
        (z_l = what block l reads, z_L = what the head reads, before the final norm), and whatever
        internals the design logs (mixing maps, depth-softmax weights).
        """
        B, T = idx.shape
        rope = rope_cos_sin(T, self.cfg.head_dim, self.cfg.rope_theta, idx.device)
        rec = {"states": []} if record else None
        self.res.recording = rec
        s = self.res.init_stream(self.wte(idx))                   # design-specific stream state
        for b, block in enumerate(self.blocks):
            if rec is not None:
                rec["states"].append(self.res.depth_state(s, 2 * b))
            h, kw = self.res.read(s, 2 * b)                       # attention input (+ MoDA's depth K/V)
            y, aux = block.attn(h, rope, **kw)                    # aux: its pre-RoPE k, v (MoDA caches them)
            s = self.res.write(s, 2 * b, y, aux)
            h, kw = self.res.read(s, 2 * b + 1)                   # MLP input
            s = self.res.write(s, 2 * b + 1, block.mlp(h, **kw))
        if rec is not None:
            rec["states"].append(self.res.depth_state(s, 2 * self.cfg.n_layer))
        z = self.res.collapse(s)
        self.res.recording = None
        if not logits and targets is not None:
            loss = chunked_cross_entropy(z.flatten(0, 1), self.lm_head.weight, targets.reshape(-1))
            return (None, loss, rec) if record else (None, loss)
        logits = self.lm_head(z)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return (logits, loss, rec) if record else (logits, loss)

    def param_groups(self, weight_decay):
        """AdamW groups (docs/designs.md#recipe): decay everything except what the design marks static."""
        no_decay = {id(p) for p in self.res.no_decay_params()}
        decay = [p for p in self.parameters() if id(p) not in no_decay]
        static = [p for p in self.parameters() if id(p) in no_decay]
        groups = [{"params": decay, "weight_decay": weight_decay}]
        if static:
            groups.append({"params": static, "weight_decay": 0.0})
        return groups

    def num_params(self):
        return sum(p.numel() for p in self.parameters())
