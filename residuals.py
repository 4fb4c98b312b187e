"""
The ten residual / normalization designs of DepthBench, one small class each, one registry.

Legend (shape comments): B batch, T time, D width (d_model), n streams (HC/mHC), L blocks,
2L sublayers, i sublayer index (attention of block b is i = 2b, its MLP is i = 2b + 1), N groups.

The interface between model.py and a design (model.py's trunk loop is the whole contract):

    s = res.init_stream(x0)                  # (B, T, D) embedding -> design-specific stream state
    for every sublayer i = 0 .. 2L-1:
        h, kw = res.read(s, i)               # (B, T, D) sublayer input, *including any pre-norm*;
                                             # kw is {} except MoDA's {"depth_kv": (K, V)}
        s = res.write(s, i, y, kv)           # fold the sublayer output y (B, T, D) back in, *including
                                             # any post-norm / scaling / mixing*; kv = the attention's
                                             # pre-RoPE (k, v) (None for MLPs; only MoDA uses it)
    z = res.collapse(s)                      # (B, T, D) for the LM head, *including the final norm*

plus
    res.scale_sublayer_init(i, module)       # optional init hook (DeepNorm's beta, HC's 1/sqrt(n))
    res.reset_parameters()                   # init of the design's own parameters
    res.no_decay_params()                    # parameters excluded from weight decay
    res.depth_state(s, i)                    # diagnostics: the depth state z read by sublayer i
                                             # (i = 2L: what the head reads), before any norm
    res.recording                            # None, or a dict the design logs internals into

Rules: every parameter a design creates is used on every forward (DDP needs no
find_unused_parameters); per-layer constants are Python floats computed in __init__ from i and L.
The Pre-LN class is the base class: each design overrides only what differs from it.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- helpers

def rms_norm(x, weight=None, eps=1e-6):
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32, returned in x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a gain (init 1), no bias, fp32 inside (architectures.md §1.1)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """True LayerNorm (mean-centred) with a gain and no bias, fp32 inside (DeepNorm's block norm)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), None, self.eps).to(x.dtype)


def reset_norms(module):
    """Set every norm gain below `module` to 1."""
    for m in module.modules():
        if isinstance(m, (RMSNorm, LayerNorm)):
            nn.init.ones_(m.weight)


# ----------------------------------------------------------------------------- norm-placement designs

class PreLN(nn.Module):
    """Pre-LN, the baseline (architectures.md §1.2, §3.1).

        h = x + F_i(RMSNorm_i(x))          for every sublayer i
        logits = W_out RMSNorm_f(x_2L)

    State: the residual stream x (B, T, D). Params: one RMSNorm per sublayer + the final norm
    (counted in the backbone, 2dL + d). Init: gains 1. Cost: nothing beyond the backbone.
    """

    def __init__(self, cfg):
        super().__init__()
        self.n_layer, self.n_sub, eps = cfg.n_layer, 2 * cfg.n_layer, cfg.norm_eps
        self.norms = nn.ModuleList(RMSNorm(cfg.d_model, eps) for _ in range(self.n_sub))  # pre-norm of sublayer i
        self.norm_f = RMSNorm(cfg.d_model, eps)
        self.recording = None

    def init_stream(self, x0):
        return x0

    def read(self, s, i):
        return self.norms[i](s), {}

    def write(self, s, i, y, kv=None):
        return s + y

    def collapse(self, s):
        return self.norm_f(s)

    def depth_state(self, s, i):
        return s

    def scale_sublayer_init(self, i, module):
        pass

    def reset_parameters(self):
        reset_norms(self)

    def no_decay_params(self):
        return []

    def log(self, key, value):
        """Append an internal tensor to the recording forward's dict (no-op when not recording)."""
        if self.recording is not None:
            self.recording.setdefault(key, []).append(value.detach())


class SandwichLN(PreLN):
    """Sandwich-LN / Peri-LN (architectures.md §3.2): a second RMSNorm on the sublayer output.

        h = x + RMSNorm_post,i( F_i(RMSNorm_pre,i(x)) )

    Extra params: one gain per sublayer, 2dL, init 1, decayed. Cost: one more norm per sublayer.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.post_norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(self.n_sub))

    def write(self, s, i, y, kv=None):
        return s + self.post_norms[i](y)


class LNS(PreLN):
    """LayerNorm Scaling, "The Curse of Depth in LLMs" (arXiv 2502.05795; architectures.md §3.3).

        h = x + F_i( RMSNorm_i(x) / sqrt(b + 1) )       b = i // 2, the 0-based *block* index

    Both sublayers of block b share the factor (it counts blocks, not sublayers, as the reference
    does); the final norm is not scaled. No extra params. Peak LR 1e-2 in the paper.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.scales = [1.0 / math.sqrt(i // 2 + 1) for i in range(self.n_sub)]

    def read(self, s, i):
        return self.norms[i](s) * self.scales[i], {}


class DeepNorm(PreLN):
    """DeepNorm, DeepNet (arXiv 2203.00555; architectures.md §4): Post-LN with an up-weighted skip.

        h = LN_i( alpha * x + F_i(x) )      alpha = (2L)^(1/4), L = blocks; F_i sees the raw x
        logits = W_out RMSNorm_f(x_2L)      (the final norm stays an RMSNorm)

    LN is a true (mean-centred) LayerNorm with a gain and no bias. Init: W_v, W_o and all three
    FFN matrices are scaled by beta = (8L)^(-1/4) (std 0.02 * beta); W_q, W_k stay at 0.02.
    No extra params (LN without bias has d params, like RMSNorm). Peak LR 1e-3 (paper).
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.norms = nn.ModuleList(LayerNorm(cfg.d_model, cfg.norm_eps) for _ in range(self.n_sub))  # post-norms here
        self.alpha = (2 * cfg.n_layer) ** 0.25
        self.beta = (8 * cfg.n_layer) ** -0.25

    def read(self, s, i):
        return s, {}

    def write(self, s, i, y, kv=None):
        return self.norms[i](self.alpha * s + y)

    @torch.no_grad()
    def scale_sublayer_init(self, i, module):
        weights = [module.wv.weight, module.wo.weight] if i % 2 == 0 else [module.w1.weight, module.w2.weight, module.w3.weight]
        for w in weights:
            w.mul_(self.beta)


class KEEL(PreLN):
    """KEEL, "Post-LayerNorm Is Back" (arXiv 2601.19895; architectures.md §5).

        block 0:  h = x + Attn(RMSNorm_pre,0(x))                  plain Pre-LN, no post-norm
                  x = RMSNorm_post,1( h + FFN(RMSNorm_pre,1(h)) )   Post-LN, no alpha
        i >= 2:   h = RMSNorm_post,i( alpha * h + F_i(RMSNorm_pre,i(h)) ),  alpha = 2L (= #sublayers)
        logits = W_out RMSNorm_f(x_2L)                               (normalised twice at the end)

    Extra params: a post-norm gain on every sublayer but the first, (2L - 1) d, init 1, decayed.
    Init otherwise unchanged.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        # post_norms[i - 1] belongs to sublayer i; sublayer 0 has none
        self.post_norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(self.n_sub - 1))
        self.alphas = [1.0, 1.0] + [float(self.n_sub)] * (self.n_sub - 2)

    def write(self, s, i, y, kv=None):
        if i == 0:
            return s + y
        return self.post_norms[i - 1](self.alphas[i] * s + y)


# ----------------------------------------------------------------------------- registry

RESIDUALS = {
    "preln": PreLN,
    "sandwich": SandwichLN,
    "lns": LNS,
    "deepnorm": DeepNorm,
    "keel": KEEL,
}
