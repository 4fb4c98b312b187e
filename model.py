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
both share is in ops.py; `kernels="fast"` runs its depthbench/kernels.py bodies (the same maths, faster).
"""
import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from depthbench import kernels
from ops import apply_rope, causal_attention, joint_attention, rope_cos_sin
from residuals import RESIDUALS, OptimRule

KERNELS = ("fast", "reference")


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
    kernels: str = "fast"       # "fast": ops' functions run their depthbench/kernels.py bodies; "reference": ops.py's own
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

    `depth_kv` is the one door into attention, used only by MoDA (residuals.py): (keys, values, valid), lists of
    S slots (B, n_kv_head, T, hd) that earlier sublayers left at the same token and the (S,) bool mask of the slots
    in use, which join the causal keys in one softmax (`ops.joint_attention`). Returns (y, aux): aux holds this
    layer's *pre-RoPE* k and v, (B, n_kv_head, T, hd) each, which MoDA caches for later layers, and MoDA's
    depth-attention share."""

    def __init__(self, cfg):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        assert cfg.n_head * hd == d, "d_model must equal n_head * head_dim"
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, hd
        self.fast = cfg.kernels == "fast"
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x, rope, depth_kv=None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)              # (B, H, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)           # (B, Hkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        qr, kr = (apply_rope(t, *rope, fast=self.fast) for t in (q, k))
        if depth_kv is None:
            o, share = causal_attention(qr, kr, v, fast=self.fast), None
        else:
            depth_k, depth_v, valid = depth_kv
            o, share = joint_attention(qr, kr, v, depth_k=depth_k, depth_v=depth_v, fast=self.fast, valid=valid)
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
        y, aux = self.attn(h, rope, ctx.get("depth_kv"))      # aux: its pre-RoPE k, v (MoDA caches them)
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
        self.res = RESIDUALS[cfg.residual](cfg, **cfg.residual_args)   # owns all norms and mixing
        self.res.sites = self.res.make_sites()                          # what each sublayer reads (residuals.Site)
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

    def forward(self, idx, targets=None, record=False, logits=True, skip=None):
        """idx (B, T) token ids -> (logits (B, T, V), loss or None[, rec]).

        loss: mean token cross-entropy in fp32; targets equal to -1 are ignored. logits=False (training, with
        targets) returns None for the logits, and the fast path computes the loss without holding them all.
        For diagnose.py: record=True also returns a dict, rec, with `states`, the depth states z_0..z_L (what
        block l reads, z_L what the head reads, before the final norm), `readouts`, what the logit lens decodes
        at each, and whatever internals the design logs (mixing maps, depth-softmax weights); skip=b leaves
        block b out, by the design's own rule (`res.skip`).
        """
        B, T = idx.shape
        rope = rope_cos_sin(T, self.cfg.head_dim, self.cfg.rope_theta, idx.device)
        rec = {"states": [], "readouts": []} if record else None
        s = self.res.init_stream(self.wte(idx))                    # the design's stream state
        sites = self.res.sites
        for b, block in enumerate(self.blocks):
            self.observe(s, 2 * b, rec)
            if b == skip:
                s = self.res.skip(self.res.skip(s, 2 * b), 2 * b + 1)
                continue
            pair = (sites[2 * b], sites[2 * b + 1])
            ckpt = self.cfg.checkpoint_blocks and torch.is_grad_enabled()  # keep s only; backward recomputes the block
            if ckpt:
                s = checkpoint(block, s, pair, res=self.res, rope=rope, use_reentrant=False)
            else:
                s = block(s, pair, self.res, rope)
        self.observe(s, 2 * self.cfg.n_layer, rec)
        z = self.res.collapse(s)                                   # (B, T, D), the final norm included
        self.res.recording = None
        if targets is not None and not logits and self.cfg.kernels == "fast":  # training: no (B, T, V) logits at once
            loss = kernels.chunked_cross_entropy(z.flatten(0, 1), self.lm_head.weight, targets.flatten())
            return (None, loss, rec) if record else (None, loss)
        out = self.lm_head(z)
        loss = None if targets is None else \
            F.cross_entropy(out.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
        out = out if logits else None
        return (out, loss, rec) if record else (out, loss)

    def observe(self, s, i, rec):
        """Record what diagnose.py reads before sublayer i (i = 2L: the head), with the design's own logging off
        (a readout may form a depth mix that is no part of the forward), then logging on for what follows."""
        self.res.recording = None
        if rec is not None:
            rec["states"].append(self.res.depth_state(s, i))
            rec["readouts"].append(self.res.readout(s, i))
        self.res.recording = rec

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


def compile_model(model, scope, backend="inductor"):
    """torch.compile by scope (docs/speed.md#compile) -> the module to call.

    "blocks": each block is compiled on its own, in place. A block reaches its design only through its two sites
    (residuals.Site) and a growing state is a fixed-length window, so every block reuses the first one's graph
    (1-4 graphs per design for training, as many again for evals) and compile time does not grow with depth; the
    embedding, the head and the loss run eager. "model": the whole forward as one graph, inductor fusing across
    blocks; its compile time grows with depth. backend: torch.compile's ("eager" traces without generating code:
    the tests count graphs). Compiled code runs as plain code inside `eager()`."""
    if scope == "model":
        return torch.compile(model, backend=backend)
    # every variant compiles, even one graph per block (a design reading site.index): none falls back to eager
    # because a limit was reached (dynamo's default allows 8 graphs per code object, and all blocks share one)
    limit = 4 * len(model.blocks) + 8
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name):              # the names changed across PyTorch versions
            setattr(config, name, max(getattr(config, name), limit))
    for block in model.blocks:
        block.compile(dynamic=False, backend=backend)
    return model


def eager():
    """A context in which compiled code runs eagerly (torch.compiler.set_stance, PyTorch 2.6+): a recording forward
    through blocks that compile_model compiled in place would otherwise compile variants of its own."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance else contextlib.nullcontext()
