"""
The ten residual / normalization designs of DepthBench, one small class each, one registry; then the three
extra baselines of the authors' release (Post-LN, Pre-LN under depth-muP and CompleteP), in the same registry.

Legend (shape comments): B batch, T time, D width (d_model), n streams (HC/mHC), L blocks,
2L sublayers, i sublayer index (attention of block b is i = 2b, its MLP is i = 2b + 1), N groups.

The interface between model.py and a design (GPT.forward's trunk loop is the whole contract):

    s = res.init_stream(x0)                  # (B, T, D) embedding -> design-specific stream state
    for every sublayer i = 0 .. 2L-1:
        site = res.sites[i]                  # sublayer i as the design sees it (a Site, below)
        h, ctx = res.read(s, site)           # (B, T, D) sublayer input, *including any pre-norm*
        y = F_i(h)                           # attention also gets ctx.get("depth_kv") (MoDA)
        s = res.write(s, site, y, ctx)       # fold y back in, *including any post-norm / mixing*
    z = res.collapse(s)                      # (B, T, D) for the LM head, *including the final norm*

ctx, a dict, is all that travels from read to the same sublayer's write (HC: the mixed streams and
H_post; MoDA: the MLP's input); for attention the trunk adds its pre-RoPE "k", "v" and MoDA's
"depth_share". A design keeps no tensor on the module between calls.

Also: scale_sublayer_init(i, module) and reset_parameters() (init), no_decay_params() and optim_rules() (the
optimizer's per-role LR, eps and weight-decay multipliers, which GPT.param_groups applies); for diagnose.py
depth_state(s, i) (the depth state z before sublayer i; i = 2L: the head's), skip(s, i) (the state with sublayer i
left out), readout(s, i) (what the logit lens decodes), sublayer_params(i) and swap_blocks(i, j) (what a block swap
moves), and `recording`, the dict that `log` fills in a recording forward. On the class, for the scripts: paper_lr,
paper_lr_sweep and paper_micro_batch (the 400m recipe), options (constructor options -> defaults, --residual-args)
and cost(L, d, T, **options) (costs.analytic's extra FLOPs per sequence, residual state per token in units of d).

Rules: every parameter a design creates is used on every forward (DDP needs no find_unused_parameters). Pre-LN is the
base class; each design overrides only what differs. Shared maths (norms, Sinkhorn, the depth mix) is in ops.py;
`self.fast` picks its depthbench/kernels.py bodies.

What torch.compile needs from a design (train.py compiles each block on its own, and every block should reuse the
first block's graph; docs/speed.md#compile): read and write reach sublayer i only through its site, built once by
`site(i)`: its modules (`site.norm`, `site.post_norm`, `site.conn`, `site.kv_proj`), its per-sublayer constants as
0-dim tensors (`site.constant`: a Python float would be baked into one graph per value), a row of a parameter
stacked over sublayers by `site.pick` (an int index is baked in the same way), and flags that take few values
(`site.first`, `site.mlp`, a design's own). `site.index`, the int i, is for eager code (the diagnostics); read/write
may use it, at the price of one compiled graph per block. A state that grows with depth keeps its structure from
block to block as a fixed-length window (`padded_window`: AttnRes' bank, MoDA's depth K/V); a list that grew would
give one graph per length.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ops import (RMSNorm, dead_zone, depth_connection, depth_mix, depth_slot, erank, normed_projection, rms_norm,
                 sinkhorn, width_connection)


class Site(nn.Module):
    """Sublayer i as its design's read and write see it: what its equations index by i, gathered once.

    `modules` are the design's own modules of sublayer i (its norm, post-norm, connector...), held by reference,
    not as submodules: the site adds no parameter and no state_dict key. `constant` adds a per-sublayer number as a
    0-dim buffer (not saved), `pick` takes row `row` (default i) of a parameter stacked over sublayers. The same
    class serves every sublayer, so a compiled block sees one structure wherever it sits in depth."""

    def __init__(self, i, row=None, **modules):
        super().__init__()
        self.index = i                   # the sublayer index, for eager code only (a compiled graph bakes it in)
        self.first = i == 0              # the first sublayer (block 0's attention)
        self.mlp = i % 2 == 1            # an MLP sublayer (else attention; i = 2L: AttnRes' head readout)
        own_row = i if row is None else row
        self.register_buffer("row", torch.tensor([own_row]), persistent=False)   # (1,) long: pick's index
        for name, module in modules.items():
            object.__setattr__(self, name, module)       # a reference: not registered as a submodule

    def constant(self, name, value):
        """Add a per-sublayer constant as a 0-dim fp32 buffer (e.g. LNS' scale); returns the site."""
        self.register_buffer(name, torch.tensor(float(value)), persistent=False)
        return self

    def pick(self, stacked):
        """Row `row` of a tensor stacked over sublayers, (S, ...) -> (...), by a tensor index: the same graph for
        every sublayer (stacked[i] with the int i would compile one per i)."""
        return stacked.index_select(0, self.row).squeeze(0)


def padded_window(zero, n, grad, last=None):
    """A fixed-length window of n entries, oldest first, that a growing state fills one push at a time: n zero tensors
    like `zero`, the last replaced by `last` if given; and its (n,) bool `valid` mask. The window keeps its length,
    so every block that reads it sees the same structure (torch.compile: one graph). The zeros require grad where
    the real entries will (`grad`), so that the pattern of flags does not shift from block to block either (a
    compiled block would recompile); inside a whole-model graph (torch.compile of the trunk) no flag is needed,
    nor may one be set."""
    flag = grad and not torch.compiler.is_compiling()
    window = [torch.zeros_like(zero).requires_grad_(flag) for _ in range(n)]
    valid = torch.zeros(n, dtype=torch.bool, device=zero.device)
    if last is not None:
        window[-1] = last
        valid[-1] = True
    return window, valid


def pushed(valid):
    """A window's valid mask after one push: the oldest entry leaves, a valid one joins at the end."""
    return torch.cat([valid[1:], valid.new_ones(1)])


@dataclass(frozen=True)
class OptimRule:
    """AdamW multipliers for the parameters of one role (GPT.param_groups; docs/designs.md#recipe)."""
    lr_scale: float = 1.0       # the group's LR = the schedule's LR x lr_scale
    eps_scale: float = 1.0      # the group's AdamW eps = the run's eps x eps_scale
    wd_scale: float = 1.0       # the group's weight decay = the run's x wd_scale (static tensors keep 0)


# ----------------------------------------------------------------------------- norm-placement designs

class PreLN(nn.Module):
    """Pre-LN, the baseline (docs/designs.md#pre-ln).

        h = x + F_i(RMSNorm_i(x))          for every sublayer i
        logits = W_out RMSNorm_f(x_2L)

    State: the residual stream x (B, T, D). Params: one RMSNorm per sublayer + the final norm
    (counted in the backbone, 2dL + d). Init: gains 1. Cost: nothing beyond the backbone.
    """
    paper_lr = 2e-3          # the paper's Table 4 optimum (train.py's 400m preset)
    paper_lr_sweep = (5e-4, 1e-3, 2e-3, 5e-3)   # the paper's LR sweep (train.py --print-grid)
    paper_micro_batch = {1: 16}   # {from depth L: micro-batch per GPU} that fit in memory in the paper's runs
    options = {}             # constructor options -> defaults (GPTConfig.residual_args, --residual-args)

    # activation bytes autograd keeps per token and block, in units of d, for costs.memory_plan
    # (docs/training.md#memory): (beyond Pre-LN's under bf16 autocast, beyond Pre-LN's in fp32, the block's input
    # kept when the block is checkpointed); measured on CPU like Pre-LN's own costs.BLOCK_BYTES
    act_bytes = (0, 0, 4)

    @classmethod
    def cost(cls, L, d, T, **options):
        """(extra forward FLOPs per sequence of T tokens, residual state per token in units of d) at L blocks and width
        d, for costs.analytic (profile_gpu.py's rows, train.py's MFU). Norms, scalings and adds are not counted (nor
        are they for Pre-LN's formula)."""
        return 0, 1

    def __init__(self, cfg):
        super().__init__()
        self.n_layer, self.n_sub, eps, self.fast = cfg.n_layer, 2 * cfg.n_layer, cfg.norm_eps, cfg.kernels == "fast"
        self.norms = nn.ModuleList(RMSNorm(cfg.d_model, eps) for _ in range(self.n_sub))  # pre-norm of sublayer i
        self.norm_f = RMSNorm(cfg.d_model, eps)
        self.recording = None

    def site(self, i):
        """Sublayer i's Site: what read and write index by i (Pre-LN: its norm). A design with more adds it here."""
        return Site(i, norm=self.norms[i])

    def make_sites(self):
        """The sites of sublayers 0 .. 2L-1, in order; GPT keeps them as `res.sites` and hands them to read/write."""
        return nn.ModuleList(self.site(i) for i in range(self.n_sub))

    def init_stream(self, x0):
        return x0

    def read(self, s, site):
        return site.norm(s), {}

    def write(self, s, site, y, ctx=None):
        return s + y

    def collapse(self, s):
        return self.norm_f(s)

    def depth_state(self, s, i):
        return s

    def scale_sublayer_init(self, i, module):
        pass

    def reset_parameters(self):
        for norm in (m for m in self.modules() if isinstance(m, RMSNorm)):  # every norm gain of the design: 1
            nn.init.ones_(norm.weight)

    def no_decay_params(self):
        return []

    def optim_rules(self):
        """{role: OptimRule} for the roles whose optimizer settings differ from the run's (GPT.param_groups names
        the roles: embedding, head (W_out and the final norm), block_matrix (attention/MLP weights), residual (the
        design's own tensors of the blocks)); Pre-LN: none."""
        return {}

    def sublayer_params(self, i):
        """The design's own tensors of sublayer i, by a name shared across sublayers (diagnose.py's block swap exchanges
        tensors of equal name and shape); rows of a stacked parameter as views, so writing them writes the parameter."""
        return {"norm": self.norms[i].weight}

    def swap_blocks(self, i, j):
        """Exchange blocks i and j's per-block constants (their sites' buffers; parameters move via sublayer_params)."""

    def skip(self, s, i):
        """The state when sublayer i is left out (docs/diagnostics.md#interventions): its input, unchanged."""
        return s

    def readout(self, s, i):
        """What the logit lens decodes before sublayer i (docs/diagnostics.md#lens): the head's own input."""
        return self.collapse(s)

    def log(self, key, value):
        """Append an internal tensor to the recording forward's dict (no-op when not recording)."""
        if self.recording is not None:
            self.recording.setdefault(key, []).append(value.detach())

    def telemetry(self, rec):
        """The design's own statistics for depthbench/telemetry.py (docs/training.md#telemetry), from a recording forward's dict
        `rec` (what `log` filled in): {name: a float, or a list of floats per sublayer or connector}. Pre-LN has none;
        the generic part (state and output RMS per sublayer, gradient and update per block) covers every design."""
        return {}


class SandwichLN(PreLN):
    """Sandwich-LN / Peri-LN (docs/designs.md#sandwich-ln): a second RMSNorm on the sublayer output.

        h = x + RMSNorm_post,i( F_i(RMSNorm_pre,i(x)) )

    Extra params: one gain per sublayer, 2dL, init 1, decayed. Cost: one more norm per sublayer.
    """
    act_bytes = (17, 17, 4)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.post_norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(self.n_sub))

    def site(self, i):
        return Site(i, norm=self.norms[i], post_norm=self.post_norms[i])

    def write(self, s, site, y, ctx=None):
        return s + site.post_norm(y)

    def sublayer_params(self, i):
        return {**super().sublayer_params(i), "post_norm": self.post_norms[i].weight}


class LNS(PreLN):
    """LayerNorm Scaling, "The Curse of Depth in LLMs" (arXiv 2502.05795; docs/designs.md#lns).

        h = x + F_i( RMSNorm_i(x) / sqrt(b + 1) )       b = i // 2, the 0-based *block* index

    Both sublayers of block b share the factor (it counts blocks, not sublayers, as the reference
    does); the final norm is not scaled. No extra params. Peak LR 1e-2 in the paper, its sweep up to 2e-2.
    """
    paper_lr = 1e-2
    paper_lr_sweep = PreLN.paper_lr_sweep + (1e-2, 2e-2)

    def site(self, i):
        block = i // 2
        return super().site(i).constant("scale", 1.0 / math.sqrt(block + 1))

    def read(self, s, site):
        return site.norm(s) * site.scale, {}

    @torch.no_grad()
    def swap_blocks(self, i, j):
        """The per-block scale travels with its block, as the reference intends."""
        for k in (0, 1):
            a, b = self.sites[2 * i + k].scale, self.sites[2 * j + k].scale
            kept = a.clone()
            a.copy_(b)
            b.copy_(kept)


class DeepNorm(PreLN):
    """DeepNorm, DeepNet (arXiv 2203.00555; docs/designs.md#deepnorm): Post-LN with an up-weighted skip.

        h = LN_i( alpha * x + F_i(x) )      alpha = (2L)^(1/4), L = blocks; F_i sees the raw x
        logits = W_out RMSNorm_f(x_2L)      (the final norm stays an RMSNorm)

    LN is a true (mean-centred) LayerNorm with a gain and no bias. Init: W_v, W_o and all three
    FFN matrices are scaled by beta = (8L)^(-1/4) (std 0.02 * beta); W_q, W_k stay at 0.02.
    No extra params (LN without bias has d params, like RMSNorm). Peak LR 1e-3 (paper).
    """
    paper_lr = 1e-3

    def __init__(self, cfg):
        super().__init__(cfg)
        self.norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps, center=True) for _ in range(self.n_sub))  # post
        self.alpha = (2 * cfg.n_layer) ** 0.25
        self.beta = (8 * cfg.n_layer) ** -0.25

    def read(self, s, site):
        return s, {}

    def write(self, s, site, y, ctx=None):
        return site.norm(self.alpha * s + y)

    @torch.no_grad()
    def scale_sublayer_init(self, i, module):
        for lin in (module.wv, module.wo) if i % 2 == 0 else (module.w1, module.w2, module.w3):
            lin.weight.mul_(self.beta)


class KEEL(PreLN):
    """KEEL, "Post-LayerNorm Is Back" (arXiv 2601.19895; docs/designs.md#keel).

        block 0:  h = x + Attn(RMSNorm_pre,0(x))                  plain Pre-LN, no post-norm
                  x = RMSNorm_post,1( h + FFN(RMSNorm_pre,1(h)) )   Post-LN, no alpha
        i >= 2:   h = RMSNorm_post,i( alpha * h + F_i(RMSNorm_pre,i(h)) ),  alpha = 2L (= #sublayers)
        logits = W_out RMSNorm_f(x_2L)                               (normalised twice at the end)

    Extra params: a post-norm gain on every sublayer but the first, (2L - 1) d, init 1, decayed.
    Init otherwise unchanged.
    """
    act_bytes = (17, 17, 4)

    def __init__(self, cfg):
        super().__init__(cfg)
        # post_norms[i - 1] belongs to sublayer i; sublayer 0 has none
        self.post_norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(self.n_sub - 1))

    def site(self, i):
        alpha = 1.0 if i < 2 else float(self.n_sub)          # block 0's MLP: Post-LN without alpha
        if i == 0:
            return super().site(i).constant("alpha", alpha)
        return Site(i, norm=self.norms[i], post_norm=self.post_norms[i - 1]).constant("alpha", alpha)

    def write(self, s, site, y, ctx=None):
        if site.first:
            return s + y
        return site.post_norm(site.alpha * s + y)

    def sublayer_params(self, i):
        own = super().sublayer_params(i)
        return own if i == 0 else {**own, "post_norm": self.post_norms[i - 1].weight}


# ----------------------------------------------------------------------------- cross-layer designs

class HC(PreLN):
    """Hyper-Connections, Zhu et al. (arXiv 2409.19606; docs/designs.md#hc), n = 4 streams.

    State: n streams H (B, T, n, D), each a copy of the embedding at the start. Per sublayer i, with
    H_bar = H / rms(H) per stream (no gain, eps 1e-8) and the connector's parameters:
        A    = A_static + s_a * tanh(H_bar W_a)       (B, T, n, n+1): row = input stream s,
                                                      column 0 = branch input, 1..n = output stream t
        beta = beta_static + s_b * tanh(H_bar w_b)    (B, T, n)
        y    = F_i(RMSNorm_i(sum_s A[s, 0] h_s))
        h'_t = sum_s A[s, t] h_s + beta_t y           (the width-mixed residual, the paper's form)
    Collapse (`collapse`): "sum" of the streams, then the final RMSNorm; "mean", then the norm (mHC's);
    "norm_each": the final norm on each stream, then the sum. `forward="unmixed"`: h'_t = h_t + beta_t y
    (A_r unused: = I). The older official code ran norm_each and unmixed (docs/designs.md#hc).
    Init: A_static column 0 = one-hot at i mod n, columns 1..n = I; beta_static = 1; W_a, w_b = 0;
    s_a = s_b = 0.01; W_o and W_2 of every block divided by sqrt(n). At init the model equals Pre-LN
    with an n-times residual, which the final norm cancels.
    Params: 6d + 26 per connector (n = 4), 2L connectors; A_static, beta_static are not decayed.
    Cost: n x wider residual activations; ~100 d extra FLOPs per token per sublayer.
    read forms the maps and both mixes; the mixed streams and H_post go to write in ctx; mHC overrides `_maps`.
    """
    paper_micro_batch = {1: 8, 26: 4}             # the official shape script: 8 at L16-24, 4 from L26
    options = {"n_streams": 4, "collapse": "sum", "forward": "mixed"}
    act_bytes = (66, 77, 16)

    @classmethod
    def cost(cls, L, d, T, n_streams=4, **options):
        """2L connectors of ~96d FLOPs per token (n = 4): dynamic alpha/beta projections, width mix, write-back."""
        return 192 * L * d * T, n_streams

    def __init__(self, cfg, n_streams=4, collapse="sum", forward="mixed"):
        super().__init__(cfg)
        if collapse not in ("sum", "mean", "norm_each") or forward not in ("mixed", "unmixed"):
            raise ValueError(f"HC collapse: sum, mean or norm_each; forward: mixed or unmixed; "
                             f"got {collapse}, {forward}")
        self.n, self.collapse_mode, self.mixed = n_streams, collapse, forward == "mixed"
        self.conn = nn.ModuleList(self.make_connector(cfg.d_model, i) for i in range(self.n_sub))

    def make_connector(self, d, i):
        n, c = self.n, nn.Module()
        c.static_alpha = nn.Parameter(torch.zeros(n, n + 1))
        c.dynamic_alpha = nn.Parameter(torch.zeros(d, n + 1))
        c.alpha_scale = nn.Parameter(torch.zeros(()))
        c.static_beta = nn.Parameter(torch.zeros(n))
        c.dynamic_beta = nn.Parameter(torch.zeros(d))
        c.beta_scale = nn.Parameter(torch.zeros(()))
        return c

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        for i, c in enumerate(self.conn):
            c.static_alpha.zero_()
            c.static_alpha[i % self.n, 0] = 1.0
            c.static_alpha[:, 1:] = torch.eye(self.n)
            c.static_beta.fill_(1.0)
            c.dynamic_alpha.zero_()
            c.dynamic_beta.zero_()
            c.alpha_scale.fill_(0.01)
            c.beta_scale.fill_(0.01)

    def no_decay_params(self):
        return [p for c in self.conn for p in (c.static_alpha, c.static_beta)]

    def sublayer_params(self, i):
        conn = {f"conn.{name}": p for name, p in self.conn[i].named_parameters()}
        return {**super().sublayer_params(i), **conn}

    def site(self, i):
        return Site(i, norm=self.norms[i], conn=self.conn[i])

    def _maps(self, H, site):
        """-> H_pre (B, T, n), H_post (B, T, n), H_res (B, T, n_out, n_in) of the site's sublayer."""
        c, n = site.conn, self.n
        W = torch.cat([c.dynamic_alpha, c.dynamic_beta[:, None]], 1)                      # (D, n+2)
        dyn = torch.tanh(normed_projection(H, W, 1e-8, fast=self.fast))                   # (B, T, n, n+2)
        A = c.static_alpha + c.alpha_scale * dyn[..., :n + 1]                             # (B, T, n, n+1)
        beta = c.static_beta + c.beta_scale * dyn[..., n + 1]                             # (B, T, n)
        res = A[..., 1:].transpose(-1, -2) if self.mixed else torch.eye(n, dtype=A.dtype, device=A.device)
        return A[..., 0], beta, res.expand(*A.shape[:-1], n)

    def init_stream(self, x0):
        return x0.unsqueeze(2).repeat(1, 1, self.n, 1)                                    # (B, T, n, D)

    def read(self, s, site):
        pre, post, res = self._maps(s, site)
        if self.recording is not None:
            for key, m in (("H_pre", pre), ("H_post", post), ("H_res", res)):
                self.log(key, m.mean((0, 1)))                                            # token-averaged
        branch, mixed = width_connection(s, pre, res, fast=self.fast)
        return site.norm(branch), {"post": post, "mixed": mixed}

    def write(self, s, site, y, ctx=None):
        """h'_o = sum_s H_res[o, s] h_s + H_post[o] y, from what read(s, site) passed on in ctx."""
        return depth_connection(ctx["mixed"], ctx["post"], y, fast=self.fast)

    def collapse(self, s):
        if self.collapse_mode == "norm_each":
            return self.norm_f(s).sum(2)
        return self.norm_f(s.sum(2) if self.collapse_mode == "sum" else s.mean(2))

    def depth_state(self, s, i):
        return s.flatten(2)                                                               # (B, T, n*D), stream-major

    @torch.no_grad()
    def scale_sublayer_init(self, i, module):
        (module.wo if i % 2 == 0 else module.w2).weight.div_(math.sqrt(self.n))

    def telemetry(self, rec):
        """Per connector, of its token-averaged stream transport (HC: A_r; mHC: H_res) as [out, in]: the effective
        rank (ops.erank: n for the identity or a permutation, 1 when every stream takes the same mix) and the
        Frobenius distance from the identity (0: the transport never left its init, for gap-8 mHC)."""
        transports = [M.double().cpu() for M in rec.get("H_res", [])]
        eye = torch.eye(self.n, dtype=torch.float64)
        ranks = [erank(M) for M in transports]
        return {"erank": ranks, "erank_mean": sum(ranks) / max(len(ranks), 1),
                "res_from_identity": [float((M - eye).norm()) for M in transports]}


class MHC(HC):
    """Manifold-constrained HC, DeepSeek (arXiv 2512.24880; docs/designs.md#mhc), Liger form, n = 4.

    Per sublayer, with x = [h_1; ...; h_n] (nD, stream-major) and r = 1/sqrt(mean(x^2) + 1e-6):
        m = r * (x Phi) in R^(n^2 + 2n), split [pre n | post n | res n*n (row o = output, col = input)]
        H_pre  = sigmoid(a_pre  m_pre  + b_pre)
        H_post = 2 sigmoid(a_post m_post + b_post)
        H_res  = Sinkhorn(a_res mat(m_res) + b_res)        doubly stochastic, 20 iterations
        y = F_i(RMSNorm_i(sum_s H_pre[s] h_s));  h'_o = sum_i H_res[o, i] h_i + H_post[o] y
    Collapse: the *mean* of the streams, then the final RMSNorm (`collapse`: as HC). W_o, W_2 / sqrt(n) as HC.
    Params: Phi (nD x 24), b (24), a_pre, a_post, a_res: 96d + 27 per connector (n = 4);
    b and the three a's are not decayed, Phi is.
    Cost: HC's plus the (nD x 24) projection and Sinkhorn's 39 normalisations of (n x n) per token.

    Init (`init=`; the other option, `sinkhorn_iters` = 20, is Sinkhorn's iteration count):
    - "gap8" (default, as the official 400M runs): Phi = 0, b_pre = -8 with +8 at stream i mod n,
      b_post = 0, b_res = 0 on the diagonal and -8 off it, a = 0.01: H_res ~ I (diagonal 0.998995),
      H_pre ~ one-hot, so the transport starts at the identity (effective rank n).
    - "uniform": Phi ~ N(0, 0.02^2), b = 0, a = 0.01, so H_pre ~ 1/2, H_post ~ 1 and H_res ~ 11^T / n,
      the transport starts at the uniform matrix (the Liger kernel's init; effective rank ~1).
    """
    options = {"n_streams": 4, "collapse": "mean", "init": "gap8", "sinkhorn_iters": 20}
    act_bytes = (116, 127, 16)

    @classmethod
    def cost(cls, L, d, T, n_streams=4, **options):
        """2L connectors of ~244d FLOPs per token (n = 4): the (4d x 24) phi projection (192d), the pre/res/post
        mixes (~48d)."""
        return 488 * L * d * T, n_streams

    def __init__(self, cfg, n_streams=4, collapse="mean", init="gap8", sinkhorn_iters=20):
        if init not in ("uniform", "gap8"):
            raise ValueError(f"mHC init must be 'uniform' or 'gap8', got {init!r}")
        self.init, self.sinkhorn_iters = init, sinkhorn_iters
        super().__init__(cfg, n_streams, collapse)

    def make_connector(self, d, i):
        n, c = self.n, nn.Module()
        c.phi = nn.Parameter(torch.zeros(n * d, n * n + 2 * n))
        c.b = nn.Parameter(torch.zeros(n * n + 2 * n))
        c.alpha_pre, c.alpha_post, c.alpha_res = (nn.Parameter(torch.zeros(())) for _ in range(3))
        return c

    @torch.no_grad()
    def reset_parameters(self):
        PreLN.reset_parameters(self)
        n = self.n
        for i, c in enumerate(self.conn):
            for a in (c.alpha_pre, c.alpha_post, c.alpha_res):
                a.fill_(0.01)
            c.b.zero_()
            if self.init == "uniform":
                c.phi.normal_(0.0, 0.02)
            else:
                c.phi.zero_()
                c.b[:n] = -8.0
                c.b[i % n] = 8.0
                c.b[2 * n:] = (-8.0 * (1 - torch.eye(n))).flatten()

    def no_decay_params(self):
        return [p for c in self.conn for p in (c.b, c.alpha_pre, c.alpha_post, c.alpha_res)]

    def _maps(self, H, site):
        c, n = site.conn, self.n
        m = normed_projection(H.flatten(2), c.phi, 1e-6, fast=self.fast)                  # (B, T, n^2 + 2n)
        pre = torch.sigmoid(c.alpha_pre * m[..., :n] + c.b[:n])
        post = 2 * torch.sigmoid(c.alpha_post * m[..., n:2 * n] + c.b[n:2 * n])
        res_logits = c.alpha_res * m[..., 2 * n:] + c.b[2 * n:]
        res = sinkhorn(res_logits.unflatten(-1, (n, n)), self.sinkhorn_iters, fast=self.fast)
        if self.recording is not None:                                # telemetry: the worst row/column sum, any token
            self.log("ds_error", torch.maximum((res.sum(-1) - 1).abs().amax(), (res.sum(-2) - 1).abs().amax()))
        return pre, post, res

    def telemetry(self, rec):
        """HC's, and the doubly-stochastic error of H_res: the largest |row or column sum - 1| over tokens, per
        connector (Sinkhorn's iterations leave it near 0; growth means they no longer converge)."""
        return {**super().telemetry(rec), "ds_error": [float(e) for e in rec.get("ds_error", [])]}


class BlockAttnRes(PreLN):
    """Block Attention Residuals, Kimi (arXiv 2603.15031; docs/designs.md#block-attnres), N groups.

    No residual stream. Sublayer outputs f_j are summed into N groups of consecutive sublayers, read one of
    two ways: `n_groups` N (group of j = floor(j N / 2L), sizes differ by at most one when 2L/N is not an
    integer), or the official `block_size` S (a boundary where j % S == 0: group of j = j // S, N = ceil(2L/S),
    the last group short when S does not divide 2L; official checkpoints carry S).
    Sublayer k >= 1 reads a softmax over depth of its sources: the embedding, the completed groups,
    and its own group's partial sum (if non-empty):
        p_j = softmax_j <q_k, g_k * RMSNorm(v_j)>    (zero-init pseudo-query q_k, key gain g_k, scale 1)
        u_k = RMSNorm_k( sum_j p_j v_j )            (the sublayer's pre-norm gain, eps 1e-5)
    Sublayer 0 reads RMSNorm_0(e). The head reads the same mix with a final query over all groups,
    normalised with the final norm's gain (eps 1e-5); it replaces the usual final norm.
    State: (bank, valid, partial): the completed sources [e, G_0, ...] in a bank of N slots, oldest first, padded
    at the front with zero slots that `valid` (N,) marks unused and the mix leaves out (p_j = 0), and the partial
    sum of the current group (None before sublayer 0 writes). The fixed length keeps every block's structure the
    same for torch.compile; the price is that every mix runs over N + 1 slots.
    Params: q_k, g_k for k >= 1 and the final pair: 4dL, all decayed. Zero queries = uniform
    weights at init. Cost: N + 1 sources per sublayer.
    """
    options = {"n_groups": 8, "block_size": None}   # block_size None: the n_groups reading
    act_bytes = (6, 10, 11)   # checkpointed: the block inputs keep the bank's zero slots alive too

    @staticmethod
    def groups(n_sub, n_groups=8, block_size=None):
        """The group of each sublayer 0 .. n_sub-1, by block size S (j // S) or, without one, by the count N."""
        if block_size is not None:
            if block_size < 1:
                raise ValueError(f"block_size must be >= 1, got {block_size}")
            return [k // block_size for k in range(n_sub)]
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        n_groups = min(n_groups, n_sub)              # more groups than sublayers is Full AttnRes
        return [k * n_groups // n_sub for k in range(n_sub)]

    @classmethod
    def cost(cls, L, d, T, n_groups=8, block_size=None, **options):
        """4 FLOPs per source and channel of every depth mix (score dot 2, weighted sum 2), over all its sources:
        sublayer k >= 1 reads the embedding and every group touched so far, g(k-1) + 2, and the head the embedding
        and all N groups (Full AttnRes, N = 2L: 2L^2 + 3L in all); the state: N + 1 sources. The design's work: the
        bank's unused slots, which the mix also runs over (up to ~2x at Full AttnRes), are not counted."""
        g = cls.groups(2 * L, n_groups, block_size)
        N = g[-1] + 1
        return 4 * d * (sum(g[k - 1] + 2 for k in range(1, 2 * L)) + N + 1) * T, N + 1

    def __init__(self, cfg, n_groups=8, block_size=None):
        super().__init__(cfg)
        self.group = self.groups(self.n_sub, n_groups, block_size)                    # group of sublayer k
        self.n_groups = self.group[-1] + 1
        # row k - 1 belongs to consumer k = 1 .. 2L, where consumer 2L is the head's final readout
        self.queries = nn.Parameter(torch.zeros(self.n_sub, cfg.d_model))
        self.key_gains = nn.Parameter(torch.ones(self.n_sub, cfg.d_model))
        self.eps = 1e-5  # the reference's AttnRes norms (key and fused output norm) use 1e-5

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        self.queries.zero_()
        self.key_gains.fill_(1.0)

    def site(self, k):
        """Consumer k = 0 .. 2L (2L: the head's readout, normalised with the final norm's gain): its query and key
        gain are row k - 1; opens_group: k starts a new group (or is the head), so the open sum joins the bank."""
        norm = self.norms[k] if k < self.n_sub else self.norm_f
        site = Site(k, row=max(k - 1, 0), norm=norm)
        site.opens_group = k == 0 or k == self.n_sub or self.group[k] != self.group[k - 1]
        return site

    def make_sites(self):
        return nn.ModuleList(self.site(k) for k in range(self.n_sub + 1))

    def init_stream(self, x0):
        bank, valid = padded_window(x0, self.n_groups, x0.requires_grad, last=x0)   # e, N - 1 slots for groups
        return bank, valid, None

    def sublayer_params(self, i):
        # row i: consumer i + 1, the first mix to read sublayer i's output. Block b owns its MLP-side mixer (row 2b)
        # and the one reading its output (2b + 1; the head's for the last block): docs/diagnostics.md#interventions
        return {**super().sublayer_params(i), "query": self.queries[i], "key_gain": self.key_gains[i]}

    class AfterSkip(tuple):
        """A state (bank, valid, partial) marked by `skip`: its next consumer reads the newest source, not a mix."""

    @staticmethod
    def newest(s):
        """The newest source: the current group's partial sum, else the last completed one (at first the embedding)."""
        bank, valid, partial = s
        return bank[-1] if partial is None else partial

    def skip(self, s, i):
        """A skipped block returns its inputs unchanged, as the reference's skip_block: nothing joins the bank,
        and a group boundary inside the block does not close the open group (its sum carries on). When the
        first consumer after the block (i = its MLP) is a group boundary (always for Full AttnRes; the head),
        it reads its newest source instead of mixing, the "next-output" rule, and that is its depth state."""
        if i % 2 == 1 and self.sites[i + 1].opens_group:
            return self.AfterSkip(s)
        return s

    def _source(self, s, site):
        """What the site's consumer normalises: its depth mix, or after a skipped block (`skip`) the newest source."""
        return self.newest(s) if isinstance(s, self.AfterSkip) else self._mix(s, site)

    def readout(self, s, i):
        """The mix of consumer i (block i/2's attention-side query; the final query at i = 2L), normalised with
        the final norm's gain as the model's own readout does."""
        return rms_norm(self.newest(s) if i == 0 else self._source(s, self.sites[i]), self.norm_f.weight, self.eps)

    def _mix(self, s, site):
        """Raw (pre-norm) depth mix read by the site's consumer k >= 1, and its weights over the sources."""
        sources, valid, partial = s
        if partial is not None:                                    # (None only where block 0 was skipped)
            sources, valid = sources + [partial], torch.cat([valid, valid.new_ones(1)])
        query, key_gain = site.pick(self.queries), site.pick(self.key_gains)
        mix, p = depth_mix(query, key_gain, sources, self.eps, fast=self.fast, valid=valid)
        if self.recording is not None:                             # (S,) per consumer, over the sources in use
            self.log("attnres_weights", p.mean((0, 1))[valid])
        return mix

    def read(self, s, site):
        if site.first:
            return site.norm(self.newest(s)), {}                   # the embedding
        return rms_norm(self._source(s, site), site.norm.weight, self.eps), {}

    def write(self, s, site, y, ctx=None):
        bank, valid, partial = s
        y = y.float()                                              # the bank is residual state: fp32 (ops.py)
        if partial is None:                                        # the first sublayer: y opens group 0
            return bank, valid, y
        if site.opens_group:                                       # the open group is complete: it joins the bank
            return bank[1:] + [partial], pushed(valid), y
        return bank, valid, partial + y                            # y joins the open group

    def collapse(self, s):
        head = self.sites[self.n_sub]
        return rms_norm(self._source(s, head), head.norm.weight, self.eps)

    dead_tau = 0.05   # telemetry: a consumer is near-dead below this non-embedding weight (diagnose.py --dead-tau)

    def telemetry(self, rec):
        """Per consumer k = 1 .. 2L (2L: the head's readout), of its token-averaged depth-softmax weights: the entropy
        in nats (log of the number of sources when uniform, as at init; 0 when one source takes all) and the weight
        on the embedding; and the near-dead sublayers, whose mix puts < dead_tau on non-embedding sources
        (ops.dead_zone, Fig. 9; sublayer 0 reads only the embedding, so it always counts)."""
        weights = [w.double().cpu() for w in rec.get("attnres_weights", [])]
        entropy = [float(-(p[p > 0] * p[p > 0].log()).sum()) for p in weights]
        zone = dead_zone([[1.0]] + [w.tolist() for w in weights], self.n_layer, self.dead_tau)
        return {"depth_entropy": entropy, "depth_entropy_mean": sum(entropy) / max(len(entropy), 1),
                "embedding_weight": [float(w[0]) for w in weights], "dead_sublayers": zone["count_sublayers"]}

    def depth_state(self, s, i):
        """z for diagnostics: the embedding (i = 0), the raw mix at a group boundary (and for the head),
        else the running partial sum, the "block output" inside a group (docs/diagnostics.md#depth-states);
        after a skipped block (`skip`), or where no partial sum began yet, the newest source."""
        if i == 0:
            return self.newest(s)                                  # the embedding
        if isinstance(s, self.AfterSkip):
            return self.newest(s)
        if self.sites[i].opens_group:
            return self._mix(s, self.sites[i])                     # (the trunk turns logging off for this)
        return self.newest(s)


class FullAttnRes(BlockAttnRes):
    """Full Attention Residuals (arXiv 2603.15031; docs/designs.md#full-attnres): every sublayer is its own
    group, so sublayer k mixes [e, f_0, ..., f_(k-1)] (k + 1 sources) and the head mixes all 2L + 1.
    Cost grows with depth: ~12 L^2 d FLOPs per token and all 2L + 1 sources kept alive, O(L^2 d) traffic."""
    options = {}
    act_bytes = (6, 10, 17)   # checkpointed: the block inputs keep the bank's 2L zero slots alive too

    @classmethod
    def cost(cls, L, d, T, **options):
        return super().cost(L, d, T, n_groups=2 * L)

    def __init__(self, cfg):
        super().__init__(cfg, n_groups=2 * cfg.n_layer)


class MoDA(PreLN):
    """Mixture-of-Depths Attention (arXiv 2603.15619; docs/designs.md#moda), pre-norm by default.

    Block b's attention takes one softmax per token over the causal sequence keys *and* the depth
    keys/values that all earlier sublayers left at the same token (ops.joint_attention):
        attention sublayer 2b writes its own pre-RoPE (k, v) into slot 2b;
        MLP sublayer 2b+1 writes [k'; v'] = W_kv RMSNorm_(2b+1)(h) into slot 2b+1 (no RoPE),
        for every block but the last (nothing would read it).
    The residual adds are Pre-LN's. `norm="post"` gives the post-norm variant: attention and W_kv see
    the raw stream and each sublayer ends with h = RMSNorm_i(h + F_i(h)).
    State: (x (B, T, D), depth keys, depth values, valid): the keys and values in a window of 2L - 1 slots
    (B, H_kv, T, hd), oldest first, padded at the front with zero slots that `valid` (2L - 1,) marks unused and the
    softmax leaves out. The fixed length keeps every block's structure the same for torch.compile; the price is
    that every attention but block 0's runs over 2L - 1 depth slots.
    Params: W_kv (d -> 2 H_kv hd, std 0.02, decayed) on blocks 0 .. L-2: 2 d H_kv hd (L - 1), +12-14% at 400M.
    Cost: the depth K/V, 4 L d values per token; up to 2L extra keys per query, O(L^2 d) traffic per token.
    This is the only design that reaches into attention, through `depth_kv` in its signature.
    """
    paper_micro_batch = {1: 4}
    options = {"norm": "pre"}
    act_bytes = (19, 32, 37)  # checkpointed: the block inputs keep the window's zero slots alive too

    @classmethod
    def cost(cls, L, d, T, kv_ratio=1.0, **options):
        """W_kv (d x 2d kv_ratio; kv_ratio = kv heads / heads) on blocks 0..L-2; block b's queries see 2b depth
        keys of 2d + 2d FLOPs each; the state: the stream and the depth K/V."""
        return 4 * kv_ratio * d * d * (L - 1) * T + 4 * d * L * (L - 1) * T, 1 + 4 * L * kv_ratio

    def __init__(self, cfg, norm="pre"):
        super().__init__(cfg)
        if norm not in ("pre", "post"):
            raise ValueError(f"MoDA norm must be 'pre' or 'post', got {norm!r}")
        self.post = norm == "post"
        self.n_kv_head, self.head_dim = cfg.n_kv_head, cfg.head_dim    # depth K/V use the KV heads (GQA)
        kv_dim = 2 * self.n_kv_head * self.head_dim
        self.kv_proj = nn.ModuleList(nn.Linear(cfg.d_model, kv_dim, bias=False) for _ in range(cfg.n_layer - 1))
        self.init_std = cfg.init_std

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        for lin in self.kv_proj:
            nn.init.trunc_normal_(lin.weight, std=self.init_std, a=-3 * self.init_std, b=3 * self.init_std)

    def site(self, i):
        """Sublayer i's norm, and for an MLP sublayer with a slot its W_kv (None elsewhere: the last block's MLP
        writes no slot, attention writes its own k, v)."""
        block = i // 2
        kv_proj = self.kv_proj[block] if i % 2 == 1 and block < len(self.kv_proj) else None
        return Site(i, norm=self.norms[i], kv_proj=kv_proj)

    def init_stream(self, x0):
        B, T = x0.shape[:2]
        empty = depth_slot(x0.new_zeros(B, self.n_kv_head, T, self.head_dim), self.fast)
        n_slots = self.n_sub - 1
        keys, valid = padded_window(empty, n_slots, x0.requires_grad)
        values, _ = padded_window(empty, n_slots, x0.requires_grad)
        return x0, keys, values, valid

    def with_slot(self, s, x_new, k, v):
        """The state with the stream x_new and the slot (k, v) pushed onto the depth window (its oldest slot leaves)."""
        _, ks, vs, valid = s
        return x_new, ks[1:] + [depth_slot(k, self.fast)], vs[1:] + [depth_slot(v, self.fast)], pushed(valid)

    def sublayer_params(self, i):
        own = super().sublayer_params(i)
        kv_proj = self.sites[i].kv_proj                                # the MLP slot's W_kv (none: the last block)
        if kv_proj is not None:
            own["kv_proj"] = kv_proj.weight
        return own

    def read(self, s, site):
        x, ks, vs, valid = s
        h = x if self.post else site.norm(x)
        if site.mlp:
            return h, {"h": h}                                        # the MLP's input: W_kv reads it too
        if site.first:
            return h, {}                                              # block 0: no depth slot yet
        return h, {"depth_kv": (ks, vs, valid)}

    def write(self, s, site, y, ctx=None):
        x = s[0]
        x_new = site.norm(x + y) if self.post else x + y
        if not site.mlp:                                              # attention: cache its own k, v
            if self.recording is not None and ctx["depth_share"] is not None:
                self.log("moda_depth_mass", ctx["depth_share"].mean())
            return self.with_slot(s, x_new, ctx["k"], ctx["v"])
        if site.kv_proj is None:                                      # last block: no W_kv
            return x_new, *s[1:]
        kv = site.kv_proj(ctx["h"]).unflatten(-1, (2, self.n_kv_head, self.head_dim))      # (B, T, 2, Hkv, hd)
        kv = kv.permute((2, 0, 3, 1, 4))                                                    # (2, B, Hkv, T, hd)
        return self.with_slot(s, x_new, kv[0], kv[1])

    def collapse(self, s):
        return self.norm_f(s[0])

    def skip(self, s, i):
        """The reference's depth-KV slots of a skipped sublayer stay zero: later attention still sees the slot
        (a zero key takes softmax mass exp(0) and brings back nothing). The last MLP writes no slot anyway."""
        x, site = s[0], self.sites[i]
        if site.mlp and site.kv_proj is None:
            return s
        zero = x.new_zeros(x.shape[0], self.n_kv_head, x.shape[1], self.head_dim)
        return self.with_slot(s, x, zero, zero)

    def depth_state(self, s, i):
        return s[0]

    def telemetry(self, rec):
        """The depth-attention share of each block b >= 1's attention: the softmax mass on the depth keys (earlier
        sublayers at the same token) against the sequence keys, mean over heads and tokens; and its mean."""
        shares = [float(v) for v in rec.get("moda_depth_mass", [])]
        return {"depth_share": shares, "depth_share_mean": sum(shares) / max(len(shares), 1)}


# ----------------------------------------------------------------------------- the release's extra baselines

class PostLN(PreLN):
    """Post-LN, the original Transformer's placement (Vaswani et al., arXiv 1706.03762; docs/designs.md#post-ln);
    the release's dense post-norm baseline (its `post_norm` block). Not one of the paper's ten.

        h = RMSNorm_i( x + F_i(x) )        F_i sees the raw stream; no up-weighted skip (DeepNorm with alpha = 1)
        logits = W_out RMSNorm_f(x_2L)     (the head keeps its final norm, as the release's LM head)

    Params: one RMSNorm gain per sublayer + the final norm, as Pre-LN (2dL + d), init 1. Init otherwise Pre-LN's.
    LR: Pre-LN's rule. Cost: nothing beyond the backbone.
    """

    def read(self, s, site):
        return s, {}

    def write(self, s, site, y, ctx=None):
        return site.norm(s + y)


class PreLNDepthMuP(PreLN):
    """Pre-LN under depth-muP (arXiv 2310.02244, 2309.16620; docs/designs.md#depth-mup), the release's `depth_mup`
    block: the residual branch is scaled by m_L^(-alpha), alpha = 1/2.

        h = x + m_L^(-alpha) F_i(RMSNorm_i(x))      m_L = L / base_depth (24, the release's), per block count L

    Optimizer rules (`optim_rules`, the release's two scaling axes; m_N = d / base_width, 1024):
    - "depth_only": every block tensor (attention/MLP weights and the pre-norms) gets LR x m_L^(alpha - 1) and
      AdamW eps x m_L^(-alpha); the embedding, the head and the final norm keep the run's.
    - "depth_width": attention/MLP weights LR x m_N^-1 m_L^(alpha - 1), eps x m_N^-1 m_L^(-alpha), weight decay
      x m_N, init std x m_N^(-1/2); pre-norms LR x m_L^(alpha - 1), eps x m_N^-1 m_L^(-alpha); embedding and head
      (W_out and the final norm) eps x m_N^-1; the logits are scaled by m_N^-1 (here: the head's input), and W_out's
      init stays std 0.02 (the release scales it by m_N^(-1/2), then back by m_N^(1/2)).
    Params: Pre-LN's. At L = base_depth (and d = base_width) the model and its optimizer are exactly Pre-LN's.
    """
    alpha = 0.5
    options = {"scaling": "depth_only", "base_depth": 24, "base_width": 1024}

    def __init__(self, cfg, scaling="depth_only", base_depth=24, base_width=1024):
        super().__init__(cfg)
        if scaling not in ("depth_only", "depth_width") or base_depth < 1 or base_width < 1:
            raise ValueError(f"scaling: depth_only or depth_width, base_depth and base_width >= 1; "
                             f"got {scaling}, {base_depth}, {base_width}")
        self.scaling = scaling
        self.m_L = cfg.n_layer / base_depth                    # depth multiplier
        self.m_N = cfg.d_model / base_width                     # width multiplier (depth_width only)
        self.branch_scale = self.m_L ** -self.alpha
        self.head_scale = 1.0 / self.m_N if scaling == "depth_width" else 1.0

    def write(self, s, site, y, ctx=None):
        return s + self.branch_scale * y

    def collapse(self, s):
        return self.norm_f(s) * self.head_scale

    @torch.no_grad()
    def scale_sublayer_init(self, i, module):
        if self.scaling == "depth_width":
            for lin in (m for m in module.modules() if isinstance(m, nn.Linear)):
                lin.weight.mul_(self.m_N ** -0.5)

    def optim_rules(self):
        lr_depth = self.m_L ** (self.alpha - 1.0)
        eps_depth = self.m_L ** -self.alpha
        if self.scaling == "depth_only":
            block = OptimRule(lr_scale=lr_depth, eps_scale=eps_depth)
            return {"block_matrix": block, "residual": block}
        width = 1.0 / self.m_N
        return {"block_matrix": OptimRule(lr_scale=width * lr_depth, eps_scale=width * eps_depth, wd_scale=self.m_N),
                "residual": OptimRule(lr_scale=lr_depth, eps_scale=width * eps_depth),
                "embedding": OptimRule(eps_scale=width), "head": OptimRule(eps_scale=width)}


class PreLNCompleteP(PreLNDepthMuP):
    """Pre-LN under CompleteP (Dey et al., arXiv 2505.01618; docs/designs.md#depth-mup), the release's `completep`
    block: depth-muP's update, init and optimizer rules with alpha = 1, so the branch is scaled by m_L^-1 and the
    block LR is not scaled with depth (m_L^0); the block eps is x m_L^-1."""
    alpha = 1.0


# ----------------------------------------------------------------------------- registry

RESIDUALS = {
    "preln": PreLN,
    "sandwich": SandwichLN,
    "lns": LNS,
    "deepnorm": DeepNorm,
    "keel": KEEL,
    "hc": HC,
    "mhc": MHC,
    "attnres": FullAttnRes,
    "block_attnres": BlockAttnRes,
    "moda": MoDA,
    # the release's extra baselines, not among the paper's ten (the README's second design table)
    "postln": PostLN,
    "preln_mup": PreLNDepthMuP,
    "preln_completep": PreLNCompleteP,
}
PAPER_DESIGNS = list(RESIDUALS)[:10]   # the paper's ten, in its order (the mini suite, the README's design table)

