"""
One readable GPT for every residual design of DepthBench.

The backbone is LLaMA-like (docs/designs.md#backbone):
- token embedding and LM head, untied, no embedding scale
- RoPE (theta 10000, NeoX "rotate-half", computed in fp32) on q and k
- causal attention (16 query heads by default; `n_kv_head` < n_head gives grouped-query attention,
  GQA, where each key/value head serves n_head / n_kv_head query heads), no biases, no QK-norm
- SwiGLU MLP: W_2(silu(W_1 x) * W_3 x), no biases
- truncated-normal init, std 0.02, clipped at +-3 std

What is deliberately *not* here: norms, residual adds, the final norm. Attention and the MLP are pure branch
functions; every norm placement, residual add, stream mixing and the final collapse live in residuals.py
behind one small interface (its module docstring). `GPT.forward`'s trunk loop is the whole contract. The maths
both share is in ops.py; `kernels="fast"` runs its depthbench/kernels/cpu.py bodies (the same maths, faster).
Diagnostics run the same loop from outside, with observation points (depthbench/evaluation/observe.py).
"""
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ops
import depthbench.kernels  # noqa: F401  (registers the fast bodies with ops.namespace)
from residuals import RESIDUALS, AttentionInputs, OptimRule

KERNELS = ("fast", "reference", "triton")


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
    kernels: str = "fast"       # "fast": depthbench/kernels/cpu.py's bodies of ops.py's maths; "reference": ops.py's;
    #                             "triton": fast with depthbench/kernels' Triton bodies (what fast is on CUDA + triton)
    checkpoint_blocks: bool = False  # activation checkpointing: backward recomputes each block from its input

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} must be a multiple of n_kv_head {self.n_kv_head}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")

    @property
    def head_dim(self):
        return self.d_model // self.n_head


class Attention(nn.Module):
    """Causal attention with RoPE, multi-head (n_kv_head = n_head) or grouped-query (n_kv_head < n_head: W_k, W_v
    map d -> n_kv_head * head_dim and query head h reads kv head h // (n_head / n_kv_head), the same maths as MHA
    whose k/v heads are copies). No norm inside.

    `inputs` (AttentionInputs) is the one door into attention, for the designs that reach into it (residuals.py):
    MUDD's separate key and value streams, ResFormer's first-layer values, MoDA's depth attention (`attend`, which
    takes q, k, v before RoPE and replaces RoPE and the causal softmax: residuals.MoDA.attend). Returns (y, aux):
    aux holds this layer's *pre-RoPE* k and its own v before any value residual, (B, n_kv_head, T, hd) each, which
    MoDA and ResFormer keep for later layers, and MoDA's depth-attention share."""

    def __init__(self, cfg):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        assert cfg.n_head * hd == d, "d_model must equal n_head * head_dim"
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, hd
        self.ops = ops.namespace(cfg.kernels)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x, rope, inputs=None):
        inputs = inputs or AttentionInputs()
        B, T, _ = x.shape
        x_k = x if inputs.key is None else inputs.key
        x_v = x if inputs.value is None else inputs.value
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)              # (B, H, T, hd)
        k = self.wk(x_k).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)         # (B, Hkv, T, hd)
        v = self.wv(x_v).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v_mixed = v
        if inputs.first_value is not None:                                                  # ResFormer's value residual
            w = inputs.value_weights
            v_mixed = (w[0] * inputs.first_value + w[1] * v).to(v.dtype)
        if inputs.attend is not None:                                                       # the design's own
            o, share = inputs.attend(q, k, v_mixed, rope)                                   # (MoDA's depth attention)
        else:
            qr, kr = (self.ops.apply_rope(t, *rope) for t in (q, k))
            o, share = self.ops.causal_attention(qr, kr, v_mixed), None
        y = self.wo(o.transpose(1, 2).reshape(B, T, -1))                                   # (B, T, d)
        return y, {"k": k, "v": v, "depth_share": share}


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
    """The two sublayers; the residual design `res` (GPT.res) wires them: the state s before block b -> after it.
    `sites` are the design's views of the block's two sublayers (res.sites[2b], res.sites[2b + 1]): the block never
    sees its index b, so that a compiled block is the same graph at every depth (docs/speed.md#compile)."""

    def __init__(self, cfg):
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, s, sites, res, rope):
        attn_site, mlp_site = sites
        h, ctx = res.read(s, attn_site)                       # attention input; ctx: what write needs
        y, aux = self.attn(h, rope, ctx.get("attention"))     # the design's AttentionInputs; aux: its pre-RoPE k, v
        s = res.write(s, attn_site, y, {**ctx, **aux})
        h, ctx = res.read(s, mlp_site)                        # MLP input
        return res.write(s, mlp_site, self.mlp(h), ctx)


class GPT(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.residual not in RESIDUALS:
            raise ValueError(f"unknown residual {cfg.residual!r}; choose from {', '.join(RESIDUALS)}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.res = RESIDUALS[cfg.residual].build(cfg, **cfg.residual_args)   # owns all norms and mixing
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Every init of the model, in one place.

        - embedding, W_q, W_k, W_v, W_o, W_1, W_2, W_3, LM head: truncated normal(0, 0.02) at +-3 std
        - then the design may rescale a sublayer (`res.scale_sublayer_init`: DeepNorm's beta on
          v/o/FFN, HC/mHC's 1/sqrt(n) on W_o and W_2, depth-muP's width axis m_N^(-1/2) on all seven);
          scaling a +-3 std truncated normal by c gives exactly the +-3 (c std) truncated normal
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

    def forward(self, idx, targets=None, logits=True):
        """idx (B, T) token ids -> (logits (B, T, V), loss or None).

        loss: mean token cross-entropy in fp32; targets equal to -1 are ignored. logits=False (training, with
        targets) returns None for the logits, and the fast kernels compute the loss without holding them all."""
        B, T = idx.shape
        rope = ops.rope_cos_sin(T, self.cfg.head_dim, self.cfg.rope_theta, idx.device)
        s = self.res.init_stream(self.wte(idx))                    # the design's stream state
        sites = self.res.sites
        for b, block in enumerate(self.blocks):
            pair = (sites[2 * b], sites[2 * b + 1])
            if self.cfg.checkpoint_blocks and torch.is_grad_enabled():   # keep s only; backward recomputes the block
                s = checkpoint(block, s, pair, res=self.res, rope=rope, use_reentrant=False)
            else:
                s = block(s, pair, self.res, rope)
        z = self.res.collapse(s)                                   # (B, T, D), the final norm included
        if targets is not None and not logits:                     # training: the loss alone
            return None, self.res.ops.lm_loss(z, self.lm_head.weight, targets)
        out = self.lm_head(z)
        loss = None if targets is None else ops.cross_entropy(out, targets)
        return out, loss

    def param_roles(self):
        """{parameter name: role} for the design's optimizer rules (`res.optim_rules`): "embedding", "head" (W_out
        and the final norm), "block_matrix" (attention and MLP weights) or "residual" (the design's own tensors
        of the blocks: norm gains, connectors, queries, MoDA's W_kv)."""
        roles = {}
        for name, _ in self.named_parameters():
            if name == "wte.weight":
                roles[name] = "embedding"
            elif name in ("lm_head.weight", "res.norm_f.weight"):
                roles[name] = "head"
            elif name.startswith("blocks."):
                roles[name] = "block_matrix"
            else:
                roles[name] = "residual"
        return roles

    def param_groups(self, weight_decay, eps=1e-8):
        """AdamW groups (docs/designs.md#recipe): decay everything except what the design marks static, each role
        with the design's optimizer rule (`res.optim_rules`). A group carries "lr_scale" (the trainer sets its LR to
        the schedule's x lr_scale), its "weight_decay", and its own "eps" where the rule scales the run's eps."""
        static = {id(p) for p in self.res.no_decay_params()}
        rules, roles = self.res.optim_rules(), self.param_roles()
        by_key = {}
        for name, p in self.named_parameters():
            rule = rules.get(roles[name], OptimRule())
            by_key.setdefault((rule, id(p) in static), []).append(p)
        groups = []
        for (rule, is_static), params in by_key.items():
            group = {"params": params, "lr_scale": rule.lr_scale}
            group["weight_decay"] = 0.0 if is_static else weight_decay * rule.wd_scale
            if rule.eps_scale != 1.0:
                group["eps"] = eps * rule.eps_scale
            groups.append(group)
        return groups

    def num_params(self):
        return sum(p.numel() for p in self.parameters())
