"""
The ten residual / normalization designs of DepthBench, one class each, the release's three extra baselines
(Post-LN, Pre-LN under depth-muP and CompleteP) and five designs beyond the paper (MUDD, ResFormer, DenseFormer,
Mix-LN, a Pre-LN / cross-layer hybrid), in one registry, RESIDUALS.

Legend (shape comments): B batch, T time, D width (d_model), n streams (HC/mHC), L blocks, 2L sublayers,
i sublayer index (block b's attention is i = 2b, its MLP i = 2b + 1), N groups (Block AttnRes).
Indices, the one convention of the code and the docs: positions count from 0 (sublayers 0 .. 2L - 1, blocks, streams
h_0 .. h_(n-1), sources, slots; a paper's names, W_1 or ResFormer's v_1, stay names); s names an input stream, o an
output stream, and a matrix over streams is [o, s].

A design is the residual path around the sublayers F_i. GPT's trunk loop (model.py) is its whole contract:

    s = res.init_stream(x0)                  # (B, T, D) embedding -> the design's state
    for every sublayer i = 0 .. 2L-1:        # site = res.sites[i]: sublayer i as the design sees it (Site)
        h, ctx = res.read(s, site)           # (B, T, D) input of F_i, *including any pre-norm*
        y = F_i(h)                           # attention also reads ctx["attention"] (AttentionInputs), if given
        s = res.write(s, site, y, ctx)       # fold y back in, *including any post-norm or mixing*
    z = res.collapse(s)                      # (B, T, D) for the LM head, *including the final norm*

ctx carries what write needs from read (and what the sublayer reports: attention adds its pre-RoPE "k", "v"); the
diagnostics read what they need from it (HC's maps) or from the state (AttnRes' depth weights), never from the module.
A design reaches into attention only through ctx["attention"], an AttentionInputs. Pre-LN is the base class; each
design overrides only what differs, its forward contract first, then a marked section of what serves the scripts
(init, optimizer, cost, diagnostics). Shared maths is in ops.py, reached through `self.ops` (ops.py's bodies or
depthbench/kernels/cpu.py's, chosen once by --kernels). Every parameter a design creates is used on every forward.
"""
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

import ops
import depthbench.kernels  # noqa: F401  (registers the fast bodies with ops.namespace)
from ops import RMSNorm, dead_zone, erank, rms_norm


class Site(nn.Module):
    """Sublayer i as its design's read and write see it, built once per sublayer by the design's `site(i)`.

    Why it exists: a compiled block is one graph at every depth only if its read and write find sublayer i's parts in
    objects of one structure, never by the int i (docs/speed.md#compile). What it may hold, and nothing else:
        index         the int i, for eager code (the diagnostics)
        first, mlp    i == 0; i is an MLP sublayer (else attention, or AttnRes' head readout at i = 2L)
        norm          sublayer i's norm
        post_norm     a norm on its output (Sandwich-LN, KEEL), or None
        conn          HC/mHC's connector of sublayer i, or None (DenseFormer, MUDD: `DepthWeightsSite.dense`)
        kv_proj       MoDA's W_kv on an MLP sublayer that writes a depth slot, or None
        scale, alpha  per-sublayer numbers (LNS' 1/sqrt(b + 1), KEEL's skip weight), 0-dim buffers, if given
        row           (1,) index of sublayer i's row in a parameter stacked over sublayers (`pick`); row_index, the
                      same as an int, for eager code only (AttnRes' bank: a compiled block would guard on it)
        opens_group   Block AttnRes: i starts a new group of sources (its write closes the open one)
    Modules are held by reference, not registered: a site adds no parameter and no state_dict key. A design whose
    sublayers have other parts subclasses Site and declares them the same way."""

    def __init__(self, i, norm, *, post_norm=None, conn=None, kv_proj=None, scale=None, alpha=None, row=None,
                 opens_group=False):
        super().__init__()
        self.index, self.first, self.mlp, self.opens_group = i, i == 0, i % 2 == 1, opens_group
        for name, module in (("norm", norm), ("post_norm", post_norm), ("conn", conn), ("kv_proj", kv_proj)):
            object.__setattr__(self, name, module)     # a reference: nn.Module would register it as a submodule
        for name, value in (("scale", scale), ("alpha", alpha)):
            if value is not None:
                self.register_buffer(name, torch.tensor(float(value)), persistent=False)
        own_row = i if row is None else row
        self.register_buffer("row", torch.tensor([own_row]), persistent=False)
        self.row_index = own_row

    def pick(self, stacked):
        """Row `row` of a tensor stacked over sublayers, (S, ...) -> (...), by a tensor index (stacked[i] with the
        int i would compile one graph per i)."""
        return stacked.index_select(0, self.row).squeeze(0)


@dataclass(frozen=True)
class AttentionInputs:
    """The one door into attention (model.Attention): what a design hands attention besides its input x, every field
    optional (None: attention's own). A design's read puts it in ctx["attention"]; Block.forward and
    depthbench/evaluation/observe.py pass it through unchanged, so a design that needs another input adds a field here,
    never an argument to Attention.forward (docs/contributing.md#adding-a-design)."""
    key: torch.Tensor = None            # (B, T, D) input of W_k instead of x (MUDD's key stream, its own norm applied)
    value: torch.Tensor = None          # (B, T, D) input of W_v instead of x (MUDD's value stream)
    first_value: torch.Tensor = None    # (B, H_kv, T, hd) the first layer's values (ResFormer's value residual),
    value_weights: torch.Tensor = None  # (2,) mixed in before the softmax: v' = w[0] first_value + w[1] v
    attend: object = None               # the design's own attention in place of RoPE and the causal softmax:
                                        # (q, k, v, rope) pre-RoPE -> (o, depth share) (MoDA.attend)


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

    def __init__(self, cfg):
        super().__init__()
        self.n_layer, self.n_sub = cfg.n_layer, 2 * cfg.n_layer
        self.ops = ops.namespace(cfg.kernels)          # ops.py's maths, or its fast bodies (--kernels)
        self.norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(self.n_sub))  # pre-norm of i
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)

    def site(self, i):
        """Sublayer i's Site: what read and write index by i (Pre-LN: its norm). A design with more adds it here."""
        return Site(i, norm=self.norms[i])

    def init_stream(self, x0):
        return x0

    def read(self, s, site):
        return site.norm(s), {}

    def write(self, s, site, y, ctx):
        return s + y

    def collapse(self, s):
        return self.norm_f(s)

    # ------------------------------------------------------------------------- for the scripts
    # the 400m recipe (train.py's presets, --print-grid): the paper's Table 4 optimum, its LR sweep, and
    # {from depth L: micro-batch per GPU} that fit in the paper's runs
    paper_lr = 2e-3
    paper_lr_sweep = (5e-4, 1e-3, 2e-3, 5e-3)
    paper_micro_batch = {1: 16}
    options = {}             # constructor options -> defaults (GPTConfig.residual_args, --residual-args)

    # activation bytes autograd keeps per token beyond Pre-LN's, for costs.memory_plan (docs/training.md#memory): per
    # mode (costs.BLOCK_BYTES), (a, b, e, f) for L (a d + b) + e d + f bytes at L blocks of width d; measured on CPU by
    # scripts/calibrate_memory.py. input_bytes: the block input (per unit of d) a checkpointed block keeps
    act_bytes = {"compiled": (0, 0, 0, 0), "bf16": (0, 0, 0, 0), "fp32": (0, 0, 0, 0)}
    input_bytes = 4

    @classmethod
    def cost(cls, L, d, T, **options):
        """(extra forward FLOPs per sequence of T tokens, residual state per token in units of d) at L blocks and width
        d, for costs.analytic (profile_gpu.py's rows, train.py's MFU). Norms, scalings and adds are not counted (nor
        are they for Pre-LN's formula)."""
        return 0, 1

    @classmethod
    def most_micro_batch(cls, L, **options):
        """The micro-batch per GPU the 400m preset goes up to at L blocks (costs.default_micro_batch): the paper's."""
        return cls.paper_micro_batch[max(k for k in cls.paper_micro_batch if k <= L)]

    @classmethod
    def activation_bytes(cls, **options):
        """act_bytes of the design with these options (costs.memory_plan; Hybrid's follow its deep design)."""
        return cls.act_bytes

    @classmethod
    def build(cls, cfg, **options):
        """The design and its sites (`sites`, one per sublayer, made once all its modules exist)."""
        design = cls(cfg, **options)
        design.sites = nn.ModuleList(design.site(i) for i in range(design.n_sites))
        return design

    @property
    def n_sites(self):
        return self.n_sub

    def reset_parameters(self):
        """The design's own init (GPT.init_weights calls it last): every norm gain 1."""
        for norm in (m for m in self.modules() if isinstance(m, RMSNorm)):
            nn.init.ones_(norm.weight)

    def scale_sublayer_init(self, i, module):
        """Rescale sublayer i's freshly initialised weights (DeepNorm's beta, HC's 1/sqrt(n)); Pre-LN: none."""

    def no_decay_params(self):
        """The design's tensors that AdamW does not decay (HC's static maps...); Pre-LN: none."""
        return []

    def optim_rules(self):
        """{role: OptimRule} for the roles whose optimizer settings differ from the run's (GPT.param_groups names
        the roles: embedding, head (W_out and the final norm), block_matrix (attention/MLP weights), residual (the
        design's own tensors of the blocks)); Pre-LN: none."""
        return {}

    # what diagnose.py reads and does (docs/diagnostics.md#depth-states, #interventions) and telemetry.py records

    def depth_state(self, s, i, after_skip):
        """z before sublayer i (i = 2L: what the head reads, before its norm). after_skip: sublayer i follows a skipped
        block under the next-output rule (`skips_to_newest`)."""
        return s

    def readout(self, s, i, after_skip):
        """What the logit lens decodes before sublayer i: the head's own input."""
        return self.collapse(s)

    def skip(self, s, i):
        """The state when sublayer i is left out: its input, unchanged."""
        return s

    def skips_to_newest(self, i):
        """Whether consumer i (i = 2L: the head), first after a skipped block, reads its newest source instead of its
        usual input (the next-output rule: AttnRes); then `input_after_skip` gives what it reads."""
        return False

    def sublayer_params(self, i):
        """The design's own tensors of sublayer i, by a name shared across sublayers (diagnose.py's block swap exchanges
        tensors of equal name and shape); rows of a stacked parameter as views, so writing them writes the parameter."""
        return {"norm": self.norms[i].weight}

    def swap_blocks(self, i, j):
        """Exchange blocks i and j's per-block constants (their sites' buffers; parameters move via sublayer_params)."""

    def internals(self, s, site, ctx):
        """What the diagnostics keep of sublayer i ({name: tensor}, token-averaged; depthbench/evaluation/observe.py),
        from the state it read and its ctx after it ran: Pre-LN, nothing."""
        return {}

    def head_internals(self, s):
        """The same for the head's readout, from the final state."""
        return {}

    def telemetry(self, rec):
        """The design's own statistics for telemetry.py (docs/training.md#telemetry), from the internals a diagnostic
        forward kept, `rec` ({name: [tensor per sublayer]}): {name: a float, or a list of floats per sublayer or
        connector}. Pre-LN has none; the generic part (state and output RMS per sublayer, gradient and update per
        block) covers every design."""
        return {}


class SandwichLN(PreLN):
    """Sandwich-LN / Peri-LN (docs/designs.md#sandwich-ln): a second RMSNorm on the sublayer output.

        h = x + RMSNorm_post,i( F_i(RMSNorm_pre,i(x)) )

    Extra params: one gain per sublayer, 2dL, init 1, decayed. Cost: one more norm per sublayer.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.post_norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(self.n_sub))

    def site(self, i):
        return Site(i, norm=self.norms[i], post_norm=self.post_norms[i])

    def write(self, s, site, y, ctx):
        return s + site.post_norm(y)

    # ------------------------------------------------------------------------- for the scripts
    act_bytes = {"compiled": (2, 8, 0, 0), "bf16": (16, 8, 0, 0), "fp32": (16, 8, 0, 0)}

    def sublayer_params(self, i):
        return {**super().sublayer_params(i), "post_norm": self.post_norms[i].weight}


class LNS(PreLN):
    """LayerNorm Scaling, "The Curse of Depth in LLMs" (arXiv 2502.05795; docs/designs.md#lns).

        h = x + F_i( RMSNorm_i(x) / sqrt(b + 1) )       b = i // 2, the 0-based *block* index

    Both sublayers of block b share the factor (it counts blocks, not sublayers, as the reference
    does); the final norm is not scaled. No extra params. Peak LR 1e-2 in the paper, its sweep up to 2e-2.
    `scale="depth"`: the release's `default_depth_scaled` block, one constant 1/sqrt(L) in every block instead.
    """

    def __init__(self, cfg, scale="block"):
        super().__init__(cfg)
        if scale not in ("block", "depth"):
            raise ValueError(f"LNS scale must be 'block' (1/sqrt(b + 1)) or 'depth' (1/sqrt(L)), got {scale!r}")
        self.by_depth = scale == "depth"

    def site(self, i):
        count = self.n_layer if self.by_depth else i // 2 + 1      # 1/sqrt(L) everywhere, or 1/sqrt(b + 1)
        return Site(i, norm=self.norms[i], scale=1.0 / math.sqrt(count))

    def read(self, s, site):
        return site.norm(s) * site.scale, {}

    # ------------------------------------------------------------------------- for the scripts
    paper_lr = 1e-2
    paper_lr_sweep = PreLN.paper_lr_sweep + (1e-2, 2e-2)
    options = {"scale": "block"}

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

    def __init__(self, cfg):
        super().__init__(cfg)
        self.norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps, center=True) for _ in range(self.n_sub))  # post
        self.alpha = (2 * cfg.n_layer) ** 0.25
        self.beta = (8 * cfg.n_layer) ** -0.25

    def read(self, s, site):
        return s, {}

    def write(self, s, site, y, ctx):
        return site.norm(self.alpha * s + y)

    # ------------------------------------------------------------------------- for the scripts
    act_bytes = {"compiled": (4, 4, 0, 0), "bf16": (-8, 8, 0, 0), "fp32": (-8, 8, 0, 0)}
    paper_lr = 1e-3

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

    def __init__(self, cfg):
        super().__init__(cfg)
        # post_norms[i - 1] belongs to sublayer i; sublayer 0 has none
        self.post_norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(self.n_sub - 1))

    def site(self, i):
        alpha = 1.0 if i < 2 else float(self.n_sub)          # block 0's MLP: Post-LN without alpha
        post_norm = self.post_norms[i - 1] if i > 0 else None
        return Site(i, norm=self.norms[i], post_norm=post_norm, alpha=alpha)

    def write(self, s, site, y, ctx):
        if site.first:
            return s + y
        return site.post_norm(site.alpha * s + y)

    # ------------------------------------------------------------------------- for the scripts
    act_bytes = {"compiled": (4, 8, 0, -4), "bf16": (16, 8, -8, -4), "fp32": (16, 8, -8, -4)}

    def sublayer_params(self, i):
        own = super().sublayer_params(i)
        return own if i == 0 else {**own, "post_norm": self.post_norms[i - 1].weight}


# ----------------------------------------------------------------------------- cross-layer designs

class HC(PreLN):
    """Hyper-Connections, Zhu et al. (arXiv 2409.19606; docs/designs.md#hc: the decisions and the older official code).

    State: n = 4 streams H (B, T, n, D), stream s is h_s = H[:, :, s], s = 0 .. n - 1; each starts as a copy of the
    embedding e. Sublayer i (one connector per sublayer, 2L in all) reads and writes them through three maps per
    token. Their names are mHC's, one convention for both designs (the module docstring's: [o, s], from 0), and the
    tensors read (ctx, the diagnostics) are laid out as named:
        H_pre  (B, T, n)       H_pre[s]: the weight of input stream s in the branch input
        H_res  (B, T, n, n)    H_res[o, s]: the weight of input stream s in output stream o (the transport)
        H_post (B, T, n)       H_post[o]: the weight of the branch output in output stream o
        y    = F_i(RMSNorm_i(sum_s H_pre[s] h_s))            read
        h'_o = sum_s H_res[o, s] h_s + H_post[o] y           write
    read is `connect` (ops.hc_read only runs it under a checkpoint, below): `maps`, then ops.width_connection's two
    sums in fp32, branch = sum_s H_pre[s] h_s (B, T, D) and mixed_o = sum_s H_res[o, s] h_s (B, T, n, D), the
    matmul H_res @ H; then the pre-norm of branch. write is ops.depth_connection: h'_o = mixed_o + H_post[o] y, fp32.
    The maps (`maps`), from the connector's tensors, which keep the release's layout (official checkpoints load as
    they are): with H_bar = H / rms(H) per stream (no gain, eps 1e-8; ops.normed_projection),
        A    = static_alpha + alpha_scale tanh(H_bar dynamic_alpha)    (B, T, n, n + 1): row s = input stream s
        beta = static_beta + beta_scale tanh(H_bar dynamic_beta)        (B, T, n)
        H_pre[s] = A[s, 0],    H_res[o, s] = A[s, 1 + o],    H_post[o] = beta[o]
    so column 1 + o of A is output stream o's transport row; `maps` turns it once, where it names H_res. The HC
    paper's A_m, A_r, B are A[:, 0], A[:, 1:] and beta. `forward="unmixed"` (the older official code): H_res = I.
    Head (`collapse`): "sum" of the streams, then the final RMSNorm (the default); "mean", then the norm (mHC's);
    "norm_each": the final norm on each stream, then the sum (the older official code). `recompute` (default on):
    read's maths (`connect`: the maps, both mixes, the norm) runs under torch.utils.checkpoint (ops.hc_read), so
    that autograd keeps the streams alone and the backward recomputes the rest, as the mHC paper does: the same
    losses and gradients, at most a third of the memory (docs/training.md#memory); the Triton path runs it as fused
    kernels whose backward recomputes from the streams without the checkpoint.
    Init (`reset_parameters`): static_alpha[s, 0] = [s = i mod n] (sublayer i reads stream i mod n) and
    static_alpha[s, 1 + o] = [s = o] (H_res = I); static_beta = 1; dynamic_alpha = dynamic_beta = 0; alpha_scale =
    beta_scale = 0.01; W_o and W_2 of every block divided by sqrt(n) (`scale_sublayer_init`). At init the model is
    Pre-LN with an n-times residual, which the final norm cancels.
    Params per connector: static_alpha n(n + 1), dynamic_alpha D(n + 1), static_beta n, dynamic_beta D, the two
    scales: 6d + 26 at n = 4, `params(d, L) = 2L(6d + 26)` in all (tests/test_equations.py checks it against the
    model). static_alpha and static_beta are not decayed. Cost: n x wider residual activations; ~96d extra FLOPs per
    token and connector.
    Fast bodies: depthbench/kernels/cpu.py's normed_projection, width_connection and depth_connection (chosen once,
    `self.ops`); equal to ops.py's by test_all.py::test_fast_kernels_equal_the_reference, and the model to the
    equations above by tests/test_equations.py::test_logits_equal_the_equations (both bodies).
    """

    def __init__(self, cfg, n_streams=4, collapse="sum", forward="mixed", recompute=True):
        super().__init__(cfg)
        if collapse not in ("sum", "mean", "norm_each") or forward not in ("mixed", "unmixed"):
            raise ValueError(f"HC collapse: sum, mean or norm_each; forward: mixed or unmixed; "
                             f"got {collapse}, {forward}")
        self.n, self.collapse_mode, self.mixed = n_streams, collapse, forward == "mixed"
        self.recompute = recompute
        self.conn = nn.ModuleList(self.make_connector(cfg.d_model) for _ in range(self.n_sub))

    def make_connector(self, d):
        n, c = self.n, nn.Module()
        c.static_alpha = nn.Parameter(torch.zeros(n, n + 1))     # [input stream s, 0: H_pre | 1 + o: output o]
        c.dynamic_alpha = nn.Parameter(torch.zeros(d, n + 1))    # its per-token part, columns as static_alpha's
        c.alpha_scale = nn.Parameter(torch.zeros(()))
        c.static_beta = nn.Parameter(torch.zeros(n))             # [output stream o]: H_post
        c.dynamic_beta = nn.Parameter(torch.zeros(d))
        c.beta_scale = nn.Parameter(torch.zeros(()))
        return c

    def site(self, i):
        return Site(i, norm=self.norms[i], conn=self.conn[i])

    def maps(self, H, site):
        """-> H_pre (B, T, n) [s], H_post (B, T, n) [o], H_res (B, T, n, n) [o, s] of the site's sublayer."""
        c, n = site.conn, self.n
        W = torch.cat([c.dynamic_alpha, c.dynamic_beta[:, None]], 1)                      # (D, n+2)
        dynamic = torch.tanh(self.ops.normed_projection(H, W, 1e-8))                      # (B, T, n, n+2)
        A = c.static_alpha + c.alpha_scale * dynamic[..., :n + 1]                         # (B, T, n, n+1) [s, col]
        beta = c.static_beta + c.beta_scale * dynamic[..., n + 1]                         # (B, T, n) [o]
        if self.mixed:
            H_res = A[..., 1:].transpose(-1, -2)                      # H_res[o, s] = A[s, 1 + o]: the one turn
        else:
            H_res = torch.eye(n, dtype=A.dtype, device=A.device)
        return A[..., 0], beta, H_res.expand(*A.shape[:-1], n)

    def init_stream(self, x0):
        return x0.unsqueeze(2).repeat(1, 1, self.n, 1)                                    # (B, T, n, D)

    def read(self, s, site):
        h, *maps, mixed = self.ops.hc_read(self, s, site)   # connect, under checkpoint when recompute (ops.hc_read)
        return h, {**dict(zip(("H_pre", "H_post", "H_res"), maps)), "mixed": mixed}

    def connect(self, s, site):
        """read's maths -> (h, H_pre, H_post, H_res, mixed): the branch input and what write needs."""
        H_pre, H_post, H_res = self.maps(s, site)
        branch, mixed = self.ops.width_connection(s, H_pre, H_res)   # sum_s H_pre[s] h_s; sum_s H_res[o, s] h_s
        return site.norm(branch), H_pre, H_post, H_res, mixed

    def write(self, s, site, y, ctx):
        """h'_o = sum_s H_res[o, s] h_s + H_post[o] y, from what read(s, site) passed on in ctx."""
        return self.ops.depth_connection(ctx["mixed"], ctx["H_post"], y)

    def collapse(self, s):
        if self.collapse_mode == "norm_each":
            return self.norm_f(s).sum(2)
        if self.collapse_mode == "sum":
            return self.norm_f(s.sum(2))
        return self.norm_f(s.mean(2))

    # ------------------------------------------------------------------------- for the scripts
    paper_micro_batch = {1: 8, 26: 4}             # the official shape script: 8 at L16-24, 4 from L26
    options = {"n_streams": 4, "collapse": "sum", "forward": "mixed", "recompute": True}
    act_bytes = {"compiled": (30, -8, 0, 0), "bf16": (24, 24, 0, 0), "fp32": (24, 24, 0, 0)}  # the streams alone
    kept_act_bytes = {"compiled": (70, 304, 0, 0), "bf16": (72, 608, 0, 0), "fp32": (72, 608, 0, 0)}  # recompute off
    input_bytes = 16

    @classmethod
    def activation_bytes(cls, recompute=True, **options):
        """With recompute, autograd keeps the streams (and the sublayer's output) alone; without, also the maps, the
        (n + 1) x D mix and the normed branch input of every sublayer (mHC: Sinkhorn's iterates too)."""
        return cls.act_bytes if recompute else cls.kept_act_bytes

    @classmethod
    def most_micro_batch(cls, L, recompute=True, **options):
        """The paper's micro-batch: 8, and 4 from L26, what its GPUs held keeping the connections' intermediates;
        with recompute, 8 at every depth (where the memory plan allows it)."""
        if recompute:
            return cls.paper_micro_batch[1]
        return super().most_micro_batch(L)

    @classmethod
    def cost(cls, L, d, T, n_streams=4, **options):
        """2L connectors of ~96d FLOPs per token (n = 4): dynamic alpha/beta projections, width mix, write-back."""
        return 192 * L * d * T, n_streams

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        for i, c in enumerate(self.conn):
            c.static_alpha.zero_()
            c.static_alpha[i % self.n, 0] = 1.0                       # H_pre: one-hot at stream i mod n
            c.static_alpha[:, 1:] = torch.eye(self.n)                 # H_res = I
            c.static_beta.fill_(1.0)
            c.dynamic_alpha.zero_()
            c.dynamic_beta.zero_()
            c.alpha_scale.fill_(0.01)
            c.beta_scale.fill_(0.01)

    @torch.no_grad()
    def scale_sublayer_init(self, i, module):
        (module.wo if i % 2 == 0 else module.w2).weight.div_(math.sqrt(self.n))

    def no_decay_params(self):
        return [p for c in self.conn for p in (c.static_alpha, c.static_beta)]

    def sublayer_params(self, i):
        conn = {f"conn.{name}": p for name, p in self.conn[i].named_parameters()}
        return {**super().sublayer_params(i), **conn}

    def depth_state(self, s, i, after_skip):
        return s.flatten(2)                                                               # (B, T, n*D), stream-major

    def internals(self, s, site, ctx):
        """The three maps, token-averaged (telemetry, diagnose.py's erank)."""
        return {name: ctx[name].mean((0, 1)) for name in ("H_pre", "H_post", "H_res")}

    def telemetry(self, rec):
        """Per connector, of its token-averaged transport H_res as [out, in]: the effective rank (ops.erank: n for the
        identity or a permutation, 1 when every stream takes the same mix) and the Frobenius distance from the
        identity (0: the transport never left its init, for gap-8 mHC)."""
        transports = [M.double().cpu() for M in rec.get("H_res", [])]
        eye = torch.eye(self.n, dtype=torch.float64)
        ranks = [erank(M) for M in transports]
        return {"erank": ranks, "erank_mean": sum(ranks) / max(len(ranks), 1),
                "res_from_identity": [float((M - eye).norm()) for M in transports]}


class MHC(HC):
    """Manifold-constrained HC, DeepSeek (arXiv 2512.24880; docs/designs.md#mhc), Liger's form, n = 4 streams.

    HC's state, read and write (above), in the same names: n streams H (B, T, n, D), each a copy of e at the start;
        y    = F_i(RMSNorm_i(sum_s H_pre[s] h_s)),    h'_o = sum_s H_res[o, s] h_s + H_post[o] y
    with the three maps made from one projection of all streams. Per token and sublayer, with x = [h_0; ...; h_(n-1)]
    the streams flattened stream-major (B, T, nD) and r = 1/sqrt(mean(x^2) + 1e-6) (no gain; ops.normed_projection,
    in fp32), and b laid out as m's columns, flat [pre: n | post: n | res: n^2, row-major]:
        m = r (x phi)                             (B, T, n^2 + 2n), split [pre: n | post: n | res: n^2]
        H_pre[s]  = sigmoid(alpha_pre m[s] + b[s])                       (B, T, n)
        H_post[o] = 2 sigmoid(alpha_post m[n + o] + b[n + o])            (B, T, n)
        R[o, s]   = alpha_res m[2n + n o + s] + b[2n + n o + s]         (B, T, n, n): row o = output, column s = input
        H_res     = Sinkhorn(R), 20 iterations (ops.sinkhorn; `sinkhorn_iters`)
    Sinkhorn's axes (Liger's kernel): a softmax along each row, over the input streams s of output o (dim -1), plus
    eps 1e-6; one column normalisation, each input stream's weights over the outputs o summed to 1 (dim -2); then
    19 rounds of the row, then the column normalisation (eps 1e-6 in each denominator). The columns sum to 1
    exactly at the end, the rows to about 1 (1e-3 for peaked logits): H_res is near doubly stochastic.
    Head: the *mean* of the streams, then the final RMSNorm (`collapse`, as HC's options).
    Init (`init=`, `reset_parameters`, which replaces HC's: this connector has no static_alpha), in every case
    alpha_pre = alpha_post = alpha_res = 0.01 and W_o, W_2 divided by sqrt(n) (HC's `scale_sublayer_init`):
    - "gap8" (default, as the official 400M runs): phi = 0; b_pre[s] = +8 at s = i mod n, else -8; b_post = 0;
      R's bias 0 at o = s, else -8. So H_pre ~ one-hot, H_post = 1 and H_res ~ I: diagonal 0.998995 after the row
      softmax (1 / (1 + 3 e^-8), already doubly stochastic), 0.998991 after Sinkhorn (its eps takes 4e-6 off), off
      the diagonal 3.36e-4: the transport starts at the identity (effective rank n).
    - "uniform": phi ~ N(0, 0.02^2), b = 0: H_pre ~ 1/2, H_post ~ 1, H_res ~ 11^T / n (Liger's init; erank ~1).
    Params per connector: phi (nD, n^2 + 2n), b (n^2 + 2n), the three alphas: 96d + 27 at n = 4,
    `params(d, L) = 2L(96d + 27)` in all. b and the alphas are not decayed, phi is.
    Cost: HC's plus the (nD x 24) projection and Sinkhorn's 39 normalisations of (n x n) per token.
    Fast bodies: depthbench/kernels/cpu.py's normed_projection, sinkhorn (one autograd node), width_connection and
    depth_connection; equal to ops.py's by test_all.py::test_fast_kernels_equal_the_reference and
    test_sinkhorn_doubly_stochastic, the model to these equations by tests/test_equations.py's
    test_logits_equal_the_equations and test_mhc_transport_by_hand (both bodies).
    """

    def __init__(self, cfg, n_streams=4, collapse="mean", init="gap8", sinkhorn_iters=20, recompute=True):
        if init not in ("uniform", "gap8"):
            raise ValueError(f"mHC init must be 'uniform' or 'gap8', got {init!r}")
        self.init, self.sinkhorn_iters = init, sinkhorn_iters
        super().__init__(cfg, n_streams, collapse, recompute=recompute)

    def make_connector(self, d):
        n, c = self.n, nn.Module()
        c.phi = nn.Parameter(torch.zeros(n * d, n * n + 2 * n))
        c.b = nn.Parameter(torch.zeros(n * n + 2 * n))
        c.alpha_pre, c.alpha_post, c.alpha_res = (nn.Parameter(torch.zeros(())) for _ in range(3))
        return c

    def maps(self, H, site):
        """HC's three maps [s], [o], [o, s], made from one projection of the flattened streams (the docstring's)."""
        c, n = site.conn, self.n
        m = self.ops.normed_projection(H.flatten(2), c.phi, 1e-6)                         # (B, T, n^2 + 2n)
        H_pre = torch.sigmoid(c.alpha_pre * m[..., :n] + c.b[:n])                          # [s]
        H_post = 2 * torch.sigmoid(c.alpha_post * m[..., n:2 * n] + c.b[n:2 * n])          # [o]
        R = (c.alpha_res * m[..., 2 * n:] + c.b[2 * n:]).unflatten(-1, (n, n))            # [o, s]: entry n o + s
        H_res = self.ops.sinkhorn(R, self.sinkhorn_iters)     # rows: softmax over s (dim -1); columns: over o (dim -2)
        return H_pre, H_post, H_res

    # ------------------------------------------------------------------------- for the scripts
    options = {"n_streams": 4, "collapse": "mean", "init": "gap8", "sinkhorn_iters": 20, "recompute": True}
    act_bytes = {"compiled": (30, -8, 0, 0), "bf16": (24, 24, 0, 0), "fp32": (24, 24, 0, 0)}  # the streams alone
    kept_act_bytes = {"compiled": (70, 280, 0, 0), "bf16": (72, 7016, 0, 0), "fp32": (72, 7016, 0, 0)}  # recompute off

    @classmethod
    def cost(cls, L, d, T, n_streams=4, **options):
        """2L connectors of ~244d FLOPs per token (n = 4): the (4d x 24) phi projection (192d), the pre/res/post
        mixes (~48d)."""
        return 488 * L * d * T, n_streams

    @torch.no_grad()
    def reset_parameters(self):
        PreLN.reset_parameters(self)                  # the norms' gains; HC's reset would look for static_alpha
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
                c.b[2 * n:] = (-8.0 * (1 - torch.eye(n))).flatten()     # R's bias [o, s]: 0 at o = s, else -8

    def no_decay_params(self):
        return [p for c in self.conn for p in (c.b, c.alpha_pre, c.alpha_post, c.alpha_res)]

    def internals(self, s, site, ctx):
        """HC's, and the doubly-stochastic error of H_res: the largest |row or column sum - 1| over the tokens."""
        H_res = ctx["H_res"]
        error = torch.maximum((H_res.sum(-1) - 1).abs().amax(), (H_res.sum(-2) - 1).abs().amax())
        return {**super().internals(s, site, ctx), "ds_error": error}

    def telemetry(self, rec):
        """HC's, and the doubly-stochastic error of H_res per connector (Sinkhorn's iterations leave it near 0;
        growth means they no longer converge)."""
        return {**super().telemetry(rec), "ds_error": [float(e) for e in rec.get("ds_error", [])]}


class FullAttnRes(PreLN):
    """Full Attention Residuals, Kimi (arXiv 2603.15031; docs/designs.md#full-attnres). Block AttnRes (below) builds
    on this class: it subclasses it and changes the sources.

    No residual stream. State: the sources so far, a DepthBank of (B, T, D) tensors, v = [e, f_0, f_1, ...]: the
    embedding e, then each sublayer's raw output f_j, which its `write` pushes (in fp32). Consumer k = 0 .. 2L reads
    (sublayer k for k < 2L; consumer 2L is the head), per token:
        k = 0:     u_0 = RMSNorm_0(e)                              sublayer 0's own pre-norm, eps 1e-6 (cfg.norm_eps)
        k >= 1:    p_j = softmax_j <q_k, g_k * rms(v_j)>           j = 0 .. k: the sources [e, f_0, .., f_(k-1)]
                   u_k = rms(sum_j p_j v_j) * gain_k               (B, T, D); p (B, T, k + 1)
    rms(v) = v / sqrt(mean(v^2) + 1e-5): every norm of a mix (the keys and u_k) has eps 1e-5 (`self.eps`, the
    reference's), not the backbone's 1e-6. q_k, g_k (D): consumer k's pseudo-query and key gain, logits at scale 1
    (no 1/sqrt(D)); gain_k: the gain of consumer k's pre-norm RMSNorm_k (its eps unused).
    Where the special cases happen: q_k and g_k are row k - 1 of `queries` and `key_gains` (2L, D) (`site(k)` sets
    the row; sublayer 0 has none and reads none); `read` gives sublayer 0 its norm, every other consumer the mix
    (`mix`, ops.depth_mix over the bank); the head (`collapse`) is consumer 2L: the mix over all 2L + 1 sources, with
    the final norm's gain (norm_f) as gain_2L, in place of the usual final norm.
    Init: queries 0 (every mix starts as the plain average of its sources), key gains 1, norm gains 1.
    Params: q_k, g_k for k = 1 .. 2L: `params(d, L) = 4dL`, all decayed. Cost: 4d FLOPs per source and token of
    each mix, 2L^2 + 3L sources in all (~8 L^2 d); all 2L + 1 sources kept alive, O(L^2 d) traffic.
    Fast body: depthbench/kernels/cpu.py's DepthBank (one preallocated buffer, a hand-written backward for the mix);
    equal to ops.py's DepthBank and depth_mix by test_all.py::test_fast_kernels_equal_the_reference, the model to
    these equations by tests/test_equations.py's test_logits_equal_the_equations and test_full_attnres_reads_by_hand.

    The release's two variants (its block.py and kernels/attnres.py at b2141085), both off by default:
    - `topk_fraction` f < 1: each consumer keeps, per token, only the k = min(n, max(1, ceil(f n))) largest of its n
      logits (the open partial sum counts as a source, the embedding gets no exemption; equal logits: the lower
      source first) and the others get weight 0 (ops.topk_sources); f = 1 keeps all.
    - `learn_logit_scale`: a learnt scalar s_k per consumer multiplies the query, q_k exp(s_k), init 0 (exp 0 = 1):
      +2L params, decayed.
    """

    def __init__(self, cfg, topk_fraction=1.0, learn_logit_scale=False):
        super().__init__(cfg)
        if not 0.0 < topk_fraction <= 1.0:
            raise ValueError(f"AttnRes topk_fraction must be in (0, 1], got {topk_fraction}")
        # row k - 1 belongs to consumer k = 1 .. 2L, where consumer 2L is the head's final readout
        self.queries = nn.Parameter(torch.zeros(self.n_sub, cfg.d_model))
        self.key_gains = nn.Parameter(torch.ones(self.n_sub, cfg.d_model))
        self.logit_scales = nn.Parameter(torch.zeros(self.n_sub)) if learn_logit_scale else None   # s_k, row k - 1
        self.topk_fraction = topk_fraction
        self.eps = 1e-5  # the reference's AttnRes norms (key and fused output norm) use 1e-5
        self.n_groups = self.n_sub                        # every sublayer is its own group (Block AttnRes: N)

    def site(self, k):
        """Consumer k = 0 .. 2L (2L: the head's readout, normalised with the final norm's gain); its query and key
        gain are row k - 1."""
        norm = self.norms[k] if k < self.n_sub else self.norm_f      # the head: the final norm's gain
        return Site(k, norm=norm, row=max(k - 1, 0))                  # q_k, g_k: row k - 1 (sublayer 0: unused)

    def init_stream(self, x0):
        return self.ops.DepthBank.start(x0, n_max=self.n_sub + 1, eps=self.eps, **self.stacked())   # the sources: [e]

    def stacked(self):
        """The (2L, D) queries and key gains for a bank that serves several consumers at once from them (the Triton
        body's two phases); none for the release's variants, whose queries are not these rows."""
        if self.logit_scales is not None or self.topk_fraction < 1:
            return {}
        return {"queries": self.queries, "key_gains": self.key_gains}

    def mix(self, sources, site, extra=None):
        """The raw depth mix (B, T, D) that the site's consumer normalises, its weights (B, T, sources), and the extra
        source as the mix passes it on (ops.DepthBank.mix: Block AttnRes' open sum, None without one)."""
        query = site.pick(self.queries)
        if self.logit_scales is not None:                 # the release's learnt logit scale: q_k exp(s_k)
            query = query * site.pick(self.logit_scales).exp()
        return sources.mix(query, site.pick(self.key_gains), self.eps, extra=extra, topk_fraction=self.topk_fraction,
                           site=site)

    def read(self, s, site):
        if site.first:
            return site.norm(s.newest()), {}                              # RMSNorm_0(e): the norm's own eps, 1e-6
        return rms_norm(self.mix(s, site)[0], site.norm.weight, self.eps), {}     # u_k: gain_k, eps 1e-5

    def write(self, s, site, y, ctx):
        return s.push(y.float())                          # a source is residual state: fp32 (ops.py's precision rule)

    def collapse(self, s):
        head = self.sites[self.n_sub]                     # consumer 2L: all 2L + 1 sources, norm_f's gain, eps 1e-5
        return rms_norm(self.mix(s, head)[0], head.norm.weight, self.eps)

    # ------------------------------------------------------------------------- for the scripts
    options = {"topk_fraction": 1.0, "learn_logit_scale": False}   # the release's variants, off
    act_bytes = {"compiled": (10, 128, 4, -124), "bf16": (8, 128, 4, -124), "fp32": (8, 128, 4, -124)}
    input_bytes = 9   # checkpointed: the bank is all a block input adds
    dead_tau = 0.05   # telemetry: a consumer is near-dead below this non-embedding weight (diagnose.py --dead-tau)

    @staticmethod
    def groups(n_sub, n_groups=None, block_size=None, grouping="even"):
        """The group of each sublayer: every sublayer is its own (Block AttnRes groups several)."""
        return list(range(n_sub))

    @classmethod
    def cost(cls, L, d, T, n_groups=None, block_size=None, grouping="even", **options):
        """4 FLOPs per source and channel of every depth mix (score dot 2, weighted sum 2), over all its sources:
        sublayer k >= 1 reads the embedding and every group touched so far, g(k-1) + 2, and the head the embedding
        and all N groups (Full AttnRes, N = 2L: 2L^2 + 3L in all); the state: N + 1 sources. The top-k variant
        scores every source too: the same count."""
        g = cls.groups(2 * L, n_groups, block_size, grouping)
        N = g[-1] + 1
        return 4 * d * (sum(g[k - 1] + 2 for k in range(1, 2 * L)) + N + 1) * T, N + 1

    @property
    def n_sites(self):
        return self.n_sub + 1                             # and the head's readout

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        self.queries.zero_()
        self.key_gains.fill_(1.0)
        if self.logit_scales is not None:
            self.logit_scales.zero_()

    def sublayer_params(self, i):
        # row i: consumer i + 1, the first mix to read sublayer i's output. Block b owns its MLP-side mixer (row 2b)
        # and the one reading its output (2b + 1; the head's for the last block): docs/diagnostics.md#interventions
        own = {**super().sublayer_params(i), "query": self.queries[i], "key_gain": self.key_gains[i]}
        if self.logit_scales is not None:
            own["logit_scale"] = self.logit_scales[i]
        return own

    def newest(self, s):
        """The newest source: the last output pushed (at first the embedding)."""
        return s.newest()

    def source(self, s, i, after_skip):
        """What consumer i (i = 2L: the head) normalises: its raw depth mix; the embedding for i = 0, and under the
        next-output rule (after_skip) its newest source."""
        if i == 0 or after_skip:
            return self.newest(s)
        return self.mix(s, self.sites[i])[0]

    def depth_state(self, s, i, after_skip):
        """z for diagnostics: what consumer i normalises (docs/diagnostics.md#depth-states)."""
        return self.source(s, i, after_skip)

    def readout(self, s, i, after_skip):
        """What consumer i normalises, with the final norm's gain, as the model's own readout does."""
        return rms_norm(self.source(s, i, after_skip), self.norm_f.weight, self.eps)

    def skips_to_newest(self, i):
        """A skipped block returns its inputs unchanged, as the reference's skip_block: nothing joins the sources.
        The first consumer after it reads its newest source instead of mixing (the "next-output" rule)."""
        return True

    def input_after_skip(self, s, i):
        """Consumer i's input under the next-output rule (i = 2L: the head's): its newest source, normalised."""
        return rms_norm(self.newest(s), self.sites[i].norm.weight, self.eps)

    def weights(self, s, i):
        """Consumer i's depth-softmax weights over its sources (B, T, sources) (i = 2L: the head's)."""
        return self.mix(s, self.sites[i])[1]

    def internals(self, s, site, ctx):
        """The consumer's depth weights, token-averaged (diagnose.py's attnres and deadzone, telemetry); none for
        sublayer 0 (it reads the embedding alone) or under the next-output rule (it mixes nothing)."""
        if site.first or ctx.get("after_skip"):
            return {}
        return {"attnres_weights": self.weights(s, site.index).mean((0, 1))}

    def head_internals(self, s):
        return {"attnres_weights": self.weights(s, self.n_sub).mean((0, 1))}

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


class BlockAttnRes(FullAttnRes):
    """Block Attention Residuals, Kimi (arXiv 2603.15031; docs/designs.md#block-attnres): Full AttnRes over N groups of
    consecutive sublayers instead of single outputs.

    Groups, read one of three ways: `n_groups` N (group of j = floor(j N / 2L), sizes differ by at most one when
    2L/N is not an integer), or the official `block_size` S (group of j = j // S, N = ceil(2L/S), the last group
    short when S does not divide 2L; official checkpoints carry S), or `grouping="doubling"`, boundaries that grow
    with depth: group g starts at sublayer 2^(g-1), sizes 1, 1, 2, 4, 8, ... (the last one cut at 2L), so
    N = bitlength(2L - 1) + 1 follows the depth (7 at L24, 9 at L70) and n_groups is not used. Consumer k >= 1
    mixes, as Full AttnRes, over the embedding, the sums of the completed groups and its own group's partial sum so
    far (if non-empty); the head over the embedding and all N group sums.
    State: (the completed sources [e, G_0, ...] as a DepthBank, the open group's partial sum; None before sublayer 0
    writes). As in the reference, a group closes when the next one opens: the consumer that opens it reads the
    completed group as its last source, and its write moves it to the bank. Params: Full AttnRes',
    `params(d, L) = 4dL`. Cost: N + 1 sources per consumer. Fast body: Full AttnRes' (the open partial sum in a
    scratch slot of the same bank), equal to ops.py's by test_all.py::test_fast_kernels_equal_the_reference (four
    groupings), the model to the equations by tests/test_equations.py::test_logits_equal_the_equations.
    """

    def __init__(self, cfg, n_groups=8, block_size=None, grouping="even", topk_fraction=1.0,
                 learn_logit_scale=False):
        super().__init__(cfg, topk_fraction, learn_logit_scale)
        self.group = self.groups(self.n_sub, n_groups, block_size, grouping)          # group of sublayer k
        self.n_groups = self.group[-1] + 1

    def site(self, k):
        """FullAttnRes' consumer k; opens_group: k starts a new group (or is the head), so the open sum joins the bank."""
        norm = self.norms[k] if k < self.n_sub else self.norm_f
        opens = k == 0 or k == self.n_sub or self.group[k] != self.group[k - 1]
        return Site(k, norm=norm, row=max(k - 1, 0), opens_group=opens)

    def init_stream(self, x0):
        bank = self.ops.DepthBank.start(x0, n_max=self.n_groups + 1, eps=self.eps, **self.stacked())   # [e], N groups
        return bank, None

    def read(self, s, site):
        bank, partial = s
        if site.first:
            return site.norm(bank.newest()), {}                                        # RMSNorm_0(e)
        mix, _, partial = self.mix(bank, site, extra=partial)                        # the open (or just closed) group
        return rms_norm(mix, site.norm.weight, self.eps), {"partial": partial}

    def write(self, s, site, y, ctx):
        # the open sum as the read's mix passed it on: the same values; the fast bank then adds the gradient of this
        # use to the mix's own in its backward kernel, where autograd would add the two in a launch of its own
        bank, partial = s[0], ctx.get("partial", s[1])
        y = y.float()                                     # a source is residual state: fp32 (ops.py's precision rule)
        if partial is None:                               # the first sublayer: y opens group 0
            return bank, y
        if site.opens_group:                              # the open group is complete: it joins the sources
            return bank.push(partial), y
        return bank, partial + y                          # y joins the open group

    def collapse(self, s):
        bank, partial = s
        head = self.sites[self.n_sub]
        return rms_norm(self.mix(bank, head, extra=partial)[0], head.norm.weight, self.eps)

    # ------------------------------------------------------------------------- for the scripts
    # block_size None: the n_groups reading; grouping "doubling": boundaries that grow with depth
    options = {"n_groups": 8, "block_size": None, "grouping": "even", **FullAttnRes.options}
    act_bytes = {"compiled": (18, 136, 4, -124), "bf16": (16, 136, 4, -124), "fp32": (16, 136, 4, -124)}

    @staticmethod
    def groups(n_sub, n_groups=8, block_size=None, grouping="even"):
        """The group of each sublayer 0 .. n_sub-1: by block size S (j // S); by doubling sizes (the bit length of j:
        1, 1, 2, 4, ...); or by the count N, spread evenly."""
        if grouping not in ("even", "doubling"):
            raise ValueError(f"Block AttnRes grouping must be 'even' or 'doubling', got {grouping!r}")
        if block_size is not None:
            if block_size < 1 or grouping != "even":
                raise ValueError(f"block_size must be >= 1 and takes the even grouping, got {block_size}, {grouping}")
            return [k // block_size for k in range(n_sub)]
        if grouping == "doubling":
            return [k.bit_length() for k in range(n_sub)]   # group g >= 1 starts at sublayer 2^(g-1)
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        n_groups = min(n_groups, n_sub)              # more groups than sublayers is Full AttnRes
        return [k * n_groups // n_sub for k in range(n_sub)]

    @classmethod
    def cost(cls, L, d, T, n_groups=8, block_size=None, grouping="even", **options):
        return super().cost(L, d, T, n_groups=n_groups, block_size=block_size, grouping=grouping)

    def newest(self, s):
        """The open group's partial sum, else the last completed source (at first the embedding)."""
        bank, partial = s
        return bank.newest() if partial is None else partial

    def source(self, s, i, after_skip):
        """The raw mix at a group boundary and for the head; inside a group, the running partial sum (the "block
        output"); the newest source for i = 0, under the next-output rule, and where no partial sum began yet."""
        if i == 0 or after_skip or not self.sites[i].opens_group:
            return self.newest(s)
        return self.mix(s[0], self.sites[i], extra=s[1])[0]

    def readout(self, s, i, after_skip):
        """The mix of consumer i (block i/2's attention-side query; the final query at i = 2L), normalised with the
        final norm's gain as the model's own readout does."""
        if i == 0 or after_skip:
            return rms_norm(self.newest(s), self.norm_f.weight, self.eps)
        return rms_norm(self.mix(s[0], self.sites[i], extra=s[1])[0], self.norm_f.weight, self.eps)

    def skips_to_newest(self, i):
        """A skipped block adds nothing to the sources, and a group boundary inside it does not close the open group
        (its sum carries on). The first consumer after it reads its newest source if it opens a group (or is the head)."""
        return self.sites[i].opens_group

    def weights(self, s, i):
        return self.mix(s[0], self.sites[i], extra=s[1])[1]


class MoDA(PreLN):
    """Mixture-of-Depths Attention (arXiv 2603.15619; docs/designs.md#moda), pre-norm by default.

    State: (x (B, T, D), Pre-LN's stream; the depth slots so far, a DepthKV: one key and one value (B, H_kv, T, hd)
    per earlier sublayer, at the same token). Block b, with h_i = RMSNorm_i(x) the input of sublayer i:
        attention (i = 2b):     q, k, v = W_q h_i, W_k h_i, W_v h_i               (B, H, T, hd), (B, H_kv, T, hd)
                                y = W_o attend(q, k, v, slots 0 .. 2b - 1)         `attend`, below; block 0: no slot
                                its own k (pre-RoPE) and v become slot 2b           `write`
        MLP (i = 2b + 1):       y = FFN(h_i);  [k'; v'] = W_kv,b h_i (B, T, 2 H_kv hd) -> slot 2b + 1   (b < L - 1)
        x <- x + y                                                                  Pre-LN's add
    `attend`, the depth attention (its whole maths; model.Attention only projects q, k, v and calls it through
    AttentionInputs.attend): for each head and token t, one softmax over the causal sequence logits and the depth
    logits of token t's own slots j, all at scale 1/sqrt(hd) (GQA: query head h reads kv head h // (H / H_kv)):
        a = softmax([ rope(q_t) . rope(k_s) for s <= t ;  rope(q_t) . dk_j,t for slots j < 2b ])
        o_t = sum_s a_s v_s + sum_j a_j dv_j,t                                     ops.joint_attention
    RoPE: the query and the sequence keys are rotated; the depth keys are not (attention's k is stored pre-RoPE,
    W_kv's key never meets RoPE), as the authors' release does. A depth key sits at its query's own position t, so
    rotating both would cancel; the query's rotation alone turns the depth logits by t (tests/test_equations.py::
    test_moda_rotates_the_query_not_the_depth_keys). `norm="post"`: attention and W_kv read the raw x, and each
    sublayer ends with x <- RMSNorm_i(x + y).
    Head: the final RMSNorm of x, as Pre-LN's. Init: W_kv truncated normal, std 0.02 (`reset_parameters`).
    Params: W_kv (D -> 2 H_kv hd, no bias, decayed) on blocks 0 .. L - 2, 2 D H_kv hd (L - 1): with as many kv heads
    as heads `params(d, L) = 2d^2(L - 1)`, +12-14% at 400M.
    Slots: attention b writes slot 2b, block b's MLP slot 2b + 1 (b < L - 1): `slots(L) = 2L - 1` in all (DepthKV's
    n_max). Block b's attention reads slots 0 .. 2b - 1, at most `depth_keys(L) = 2L - 2` (block L - 1's); the last
    attention's slot 2L - 2 is written, never read. Cost: the slots keep `depth_values(d, L) = 2d(2L - 1)` values per
    token (as many kv heads as heads; `cost` rounds the state up to 4Ld), O(L^2 d) traffic per token.
    Fast bodies: depthbench/kernels/cpu.py's apply_rope, joint_attention (the depth part by hand, the sequence part in
    fused attention with one "sink" key whose logit is the depth part's log-sum-exp: the one softmax, split in two
    and merged exactly) and DepthKV; equal to ops.py's by test_all.py::
    test_fast_kernels_equal_the_reference and test_moda_merge_by_log_sum_exp_equals_the_sink, the model to these
    equations by tests/test_equations.py::test_logits_equal_the_equations (both bodies).
    """

    def __init__(self, cfg, norm="pre"):
        super().__init__(cfg)
        if norm not in ("pre", "post"):
            raise ValueError(f"MoDA norm must be 'pre' or 'post', got {norm!r}")
        self.post = norm == "post"
        self.n_kv_head, self.head_dim = cfg.n_kv_head, cfg.head_dim    # depth K/V use the KV heads (GQA)
        kv_dim = 2 * self.n_kv_head * self.head_dim
        self.kv_proj = nn.ModuleList(nn.Linear(cfg.d_model, kv_dim, bias=False) for _ in range(cfg.n_layer - 1))
        self.init_std = cfg.init_std

    def site(self, i):
        """Sublayer i's norm, and for an MLP sublayer with a slot its W_kv (None elsewhere: the last block's MLP
        writes no slot, attention writes its own k, v)."""
        block = i // 2
        has_slot = i % 2 == 1 and block < len(self.kv_proj)
        return Site(i, norm=self.norms[i], kv_proj=self.kv_proj[block] if has_slot else None)

    def init_stream(self, x0):
        return x0, self.ops.DepthKV.start(n_max=self.n_sub - 1)

    def read(self, s, site):
        x, depth = s
        h = x if self.post else site.norm(x)
        if site.mlp:
            return h, {"h": h}                                        # the MLP's input: W_kv reads it too
        if site.first:
            return h, {}                                              # block 0: no depth slot yet
        return h, {"attention": AttentionInputs(attend=functools.partial(self.attend, depth))}

    def attend(self, depth, q, k, v, rope):
        """Block b >= 1's attention over the sequence and the depth slots (the docstring's `attend`): q (B, H, T, hd),
        k, v (B, H_kv, T, hd) as W_q, W_k, W_v made them (pre-RoPE), rope the (cos, sin) tables -> o (B, H, T, hd),
        and the depth share sum_j a_j (B, H, T) for the diagnostics."""
        q, k = (self.ops.apply_rope(t, *rope) for t in (q, k))       # the query and the sequence keys: rotated
        return self.ops.joint_attention(q, k, v, depth)             # the depth keys (depth's slots): not rotated

    def write(self, s, site, y, ctx):
        x, depth = s
        x_new = site.norm(x + y) if self.post else x + y
        # what a bank takes is a tensor of its own, not a view of one made in this block: under torch.compile the
        # block's graph ends at the push, and PyTorch 2.13 can mis-replay such views (a crash with two models)
        if not site.mlp:                                              # attention: its own k, v join the slots
            return x_new, depth.push(ctx["k"].contiguous(), ctx["v"].contiguous())
        if site.kv_proj is None:                                      # last block: no W_kv
            return x_new, depth
        kv = site.kv_proj(ctx["h"]).unflatten(-1, (2, self.n_kv_head, self.head_dim))      # (B, T, 2, Hkv, hd)
        kv = kv.permute((2, 0, 3, 1, 4))                                                    # (2, B, Hkv, T, hd)
        return x_new, depth.push(kv[0].contiguous(), kv[1].contiguous())

    def collapse(self, s):
        return self.norm_f(s[0])

    # ------------------------------------------------------------------------- for the scripts
    paper_micro_batch = {1: 4}
    options = {"norm": "pre"}
    act_bytes = {"compiled": (22.54, 0, -17.29, 0), "bf16": (22.54, 0, -19.29, 0), "fp32": (25.5, 0, -18.25, 0)}
    input_bytes = 20

    @classmethod
    def cost(cls, L, d, T, kv_ratio=1.0, **options):
        """W_kv (d x 2d kv_ratio; kv_ratio = kv heads / heads) on blocks 0..L-2; block b's queries see 2b depth
        keys of 2d + 2d FLOPs each; the state: the stream and the depth K/V, its 2L - 1 slots counted as 2L."""
        return 4 * kv_ratio * d * d * (L - 1) * T + 4 * d * L * (L - 1) * T, 1 + 4 * L * kv_ratio

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        for lin in self.kv_proj:
            nn.init.trunc_normal_(lin.weight, std=self.init_std, a=-3 * self.init_std, b=3 * self.init_std)

    def sublayer_params(self, i):
        own = super().sublayer_params(i)
        kv_proj = self.sites[i].kv_proj                                # the MLP slot's W_kv (none: the last block)
        if kv_proj is not None:
            own["kv_proj"] = kv_proj.weight
        return own

    def skip(self, s, i):
        """The reference's depth-KV slots of a skipped sublayer stay zero: later attention still sees the slot
        (a zero key takes softmax mass exp(0) and brings back nothing). The last MLP writes no slot anyway."""
        x, depth = s
        if self.sites[i].mlp and self.sites[i].kv_proj is None:
            return s
        zero = x.new_zeros(x.shape[0], self.n_kv_head, x.shape[1], self.head_dim)
        return x, depth.push(zero, zero)

    def depth_state(self, s, i, after_skip):
        return s[0]

    def internals(self, s, site, ctx):
        """The depth-attention share of an attention sublayer (its softmax mass on depth keys), averaged."""
        share = ctx.get("depth_share")
        return {} if share is None else {"moda_depth_mass": share.mean()}

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

    act_bytes = {"compiled": (4, 0, 0, 0), "bf16": (0, 0, 0, 0), "fp32": (0, 0, 0, 0)}

    def read(self, s, site):
        return s, {}

    def write(self, s, site, y, ctx):
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

    def write(self, s, site, y, ctx):
        return s + self.branch_scale * y

    def collapse(self, s):
        return self.norm_f(s) * self.head_scale

    # ------------------------------------------------------------------------- for the scripts
    options = {"scaling": "depth_only", "base_depth": 24, "base_width": 1024}

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


# ----------------------------------------------------------------------------- beyond the paper (issue 43)

class DepthWeightsSite(Site):
    """A Site of DenseFormer and MUDD: besides Site's parts, `dense`, the depth weights that the site's write applies
    when it closes its block (DenseFormer: the static vector a_b; MUDD: the module that makes the per-token weights),
    and MUDD's `key_norm` and `value_norm` on an attention sublayer; held by reference, as Site holds its modules.
    Their shapes grow with the block, so they are read only inside an eager weighted sum (docs/speed.md#compile)."""

    def __init__(self, i, norm, *, dense=None, key_norm=None, value_norm=None, **parts):
        super().__init__(i, norm, **parts)
        for name, part in (("dense", dense), ("key_norm", key_norm), ("value_norm", value_norm)):
            object.__setattr__(self, name, part)


class ResFormer(PreLN):
    """Value residual learning, ResFormer (Zhou et al., arXiv 2410.17897, official code Zcchill/Value-Residual-Learning;
    docs/designs.md#resformer): Pre-LN, and every attention after the first mixes its values with the first one's,
    before the softmax:

        v_1  = W_v,0 RMSNorm_0(x)                          block 0's values (B, H_kv, T, hd); its attention is plain
        v'_b = lambda_1,b v_1 + lambda_2,b v_b             block b >= 1 attends with its own q, k and the values v'_b
        h = x + F_i(RMSNorm_i(x))                          the residual adds are Pre-LN's

    lambda: a learnt pair per block b >= 1, init 0.5 and 0.5, the official code's fixed mix (`learn=False` keeps it
    fixed, as that code does). v_1 keeps its gradient (the official code does not detach it).
    State: (x, v_1; None before block 0's attention writes). Params: 2(L - 1) scalars, not decayed (static routing,
    as HC's static maps). Cost: 3 d_kv FLOPs per token and block b >= 1; v_1 stays alive (d_kv per token).
    """

    def __init__(self, cfg, learn=True):
        super().__init__(cfg)
        self.n_kv_head, self.head_dim = cfg.n_kv_head, cfg.head_dim
        pairs = torch.full((max(self.n_layer - 1, 0), 2), 0.5)          # row b - 1: block b's (lambda_1, lambda_2)
        if learn and self.n_layer > 1:
            self.lambdas = nn.Parameter(pairs)
        else:
            self.register_buffer("lambdas", pairs, persistent=False)

    def site(self, i):
        return Site(i, norm=self.norms[i], row=max(i // 2 - 1, 0))

    def init_stream(self, x0):
        return x0, None

    def read(self, s, site):
        x, v1 = s
        h = site.norm(x)
        if site.mlp or site.first:
            return h, {}
        return h, {"attention": AttentionInputs(first_value=v1, value_weights=site.pick(self.lambdas))}

    def write(self, s, site, y, ctx):
        x, v1 = s
        if site.first:
            v1 = ctx["v"]                                  # block 0's own values (attention's aux): v_1
        return x + y, v1

    def collapse(self, s):
        return self.norm_f(s[0])

    # ------------------------------------------------------------------------- for the scripts
    options = {"learn": True}
    act_bytes = {"compiled": (2, 0, -2, 0), "bf16": (2, 0, -2, 0), "fp32": (4, 0, -4, 0)}

    @classmethod
    def cost(cls, L, d, T, kv_ratio=1.0, **options):
        """v'_b = l1 v_1 + l2 v_b: 3 FLOPs per value channel, blocks 1 .. L-1; the state: the stream and v_1."""
        return round(3 * kv_ratio * d) * (L - 1) * T, 1 + kv_ratio

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        self.lambdas.fill_(0.5)

    def no_decay_params(self):
        return [self.lambdas] if isinstance(self.lambdas, nn.Parameter) else []

    def sublayer_params(self, i):
        own = super().sublayer_params(i)
        if i % 2 == 0 and i > 0:
            own["lambdas"] = self.lambdas[i // 2 - 1]
        return own

    def depth_state(self, s, i, after_skip):
        return s[0]

    def skip(self, s, i):
        """A skipped first attention leaves zero values (as MoDA's skipped slots): later blocks mix nothing in."""
        x, v1 = s
        if i != 0:
            return s
        return x, x.new_zeros(x.shape[0], self.n_kv_head, x.shape[1], self.head_dim)

    def internals(self, s, site, ctx):
        """Block b >= 1's (lambda_1, lambda_2)."""
        if site.mlp or site.first:
            return {}
        return {"value_lambdas": site.pick(self.lambdas)}

    def telemetry(self, rec):
        """Per block b >= 1: lambda_1 (the first layer's values) and lambda_2 (its own)."""
        pairs = [v.double().cpu().tolist() for v in rec.get("value_lambdas", [])]
        return {"lambda_first": [p[0] for p in pairs], "lambda_own": [p[1] for p in pairs]}


class MixLN(PreLN):
    """Mix-LN (Li et al., arXiv 2412.13795; docs/designs.md#mix-ln): Post-LN in the first floor(alpha L) blocks, Pre-LN
    after them.

        b < floor(alpha L):   h = RMSNorm_i(x + F_i(x))       Post-LN: F_i sees the raw stream
        b >= floor(alpha L):  h = x + F_i(RMSNorm_i(x))       Pre-LN
        logits = W_out RMSNorm_f(x_2L)

    alpha = `post_fraction`, 0.25 by default (the paper's). Each sublayer has one norm either way: the params and
    init are Pre-LN's (no extra), and so is the cost. The Post-LN sites carry their norm as `post_norm`.
    """

    def __init__(self, cfg, post_fraction=0.25):
        super().__init__(cfg)
        if not 0.0 <= post_fraction <= 1.0:
            raise ValueError(f"Mix-LN post_fraction must be in [0, 1], got {post_fraction}")
        self.n_post = int(post_fraction * self.n_layer)                   # floor(alpha L) Post-LN blocks

    def site(self, i):
        if i // 2 < self.n_post:
            return Site(i, norm=None, post_norm=self.norms[i])
        return Site(i, norm=self.norms[i])

    def read(self, s, site):
        if site.post_norm is not None:                                    # Post-LN: the raw stream
            return s, {}
        return site.norm(s), {}

    def write(self, s, site, y, ctx):
        if site.post_norm is not None:
            return site.post_norm(s + y)
        return s + y

    # ------------------------------------------------------------------------- for the scripts
    act_bytes = {"compiled": (2, 0, -4, 0), "bf16": (0, 0, 0, 0), "fp32": (0, 0, 0, 0)}
    options = {"post_fraction": 0.25}


class DenseFormer(PreLN):
    """DenseFormer, Pagliardini et al. (arXiv 2402.02622; epfml/DenseFormer, DWAModules; docs/designs.md#denseformer):
    Pre-LN blocks, and after each block b a depth-weighted average (DWA) of the embedding and every block output so
    far, with learnt *static* weights, feeds the next block:

        X_0 = e,  X_(b+1) = block b's output (Pre-LN's two sublayers, run on x_b)
        x_(b+1) = sum_(j = 0 .. b+1) a_(b, j) X_j           a_b: b + 2 weights per block, the same for every token
        logits = W_out RMSNorm_f(x_L)

    Init a_(b, b+1) = 1, the others 0 (the release's `_init_weights`): at init the model is Pre-LN. This is the
    paper's 1x1 DenseFormer (dilation 1, a DWA after every block). State: (x, the block outputs X_0 .. X_b in a
    DepthBank, read by the bank's weighted sum). Params: sum_b (b + 2) = L(L + 3)/2 (324 at L24), not decayed
    (the release decays them, at its weight decay 1e-3; static routing here, as HC's). Cost: 2(b + 2) d FLOPs per
    token after block b; all L + 1 outputs stay alive.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.dwa = nn.ParameterList(nn.Parameter(torch.zeros(b + 2)) for b in range(self.n_layer))   # a_b

    def site(self, i):
        return DepthWeightsSite(i, norm=self.norms[i], dense=self.dwa[i // 2] if i % 2 else None)

    def init_stream(self, x0):
        return x0, self.ops.DepthBank.start(x0, n_max=self.n_layer + 1, eps=None)

    def read(self, s, site):
        return site.norm(s[0]), {}

    def write(self, s, site, y, ctx):
        x, bank = s
        if not site.mlp:
            return x + y, bank
        bank = bank.push((x + y).float())                # X_(b+1): residual state, fp32 (ops.py's precision rule)
        return bank.weighted_sum(site.dense), bank       # x_(b+1) = sum_j a_(b, j) X_j

    def collapse(self, s):
        return self.norm_f(s[0])

    # ------------------------------------------------------------------------- for the scripts
    options = {}
    act_bytes = {"compiled": (4, 0, 4, 0), "bf16": (4, 0, 4, 0), "fp32": (4, 0, 4, 0)}
    input_bytes = 8   # each block output in the bank (fp32), which a checkpointed block keeps too

    @classmethod
    def cost(cls, L, d, T, **options):
        """The DWA after block b: 2(b + 2) d FLOPs per token, d(L^2 + 3L) in all; the state: x and L + 1 outputs."""
        return d * (L * L + 3 * L) * T, L + 2

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        for a in self.dwa:
            a.zero_()
            a[-1] = 1.0

    def no_decay_params(self):
        return list(self.dwa)

    def depth_state(self, s, i, after_skip):
        return s[0]

    def skip(self, s, i):
        """A skipped block outputs its input, X_(b+1) = x_b, and its DWA is skipped with it: the state is unchanged but
        for the output the bank receives, so that later weights find their sources where they expect them."""
        x, bank = s
        return (x, bank.push(x.float())) if i % 2 else s

    def internals(self, s, site, ctx):
        """The weights that made block b >= 1's input, a_(b-1) (one stream); diagnose.py's dense metric."""
        if site.mlp or site.first:
            return {}
        return {"dense_weights": self.dwa[site.index // 2 - 1].detach()[None]}

    def head_internals(self, s):
        return {"dense_weights": self.dwa[-1].detach()[None]}

    def telemetry(self, rec):
        """Per consumer (blocks 1 .. L-1, then the head): the weight on the embedding and on the newest output."""
        return dense_telemetry(rec)


def dense_telemetry(rec):
    """DenseFormer's and MUDD's telemetry: per consumer, the residual stream's weight on the embedding (source 0) and
    on the newest block output (its last source, 1 at init)."""
    rows = [w.double().cpu()[-1] for w in rec.get("dense_weights", [])]
    return {"embedding_weight": [float(r[0]) for r in rows], "newest_weight": [float(r[-1]) for r in rows]}


class MUDD(PreLN):
    """Multiway dynamic dense connections, MUDDFormer (Xiao et al., arXiv 2502.12170; Caiyun-AI/MUDDFormer;
    docs/designs.md#mudd). After each block b, four streams, query, key, value and residual (C = 4), are each a sum
    over the embedding and every block output so far, with per-token weights from a small MLP of the newest output:

        X_0 = e,  X_(b+1) = block b's output
        A_b = W_2,b GELU(W_1,b RMSNorm(X_(b+1))) + a_b         (C, b + 2) per token; RMSNorm without a gain
        X^c_(b+1) = sum_(j = 0 .. b+1) A_b[c, j] X_j             c = Q, K, V, R
        block b + 1:  h = X^R + Attn(q from N^Q(X^Q), k from N^K(X^K), v from N^V(X^V));  out = h + FFN(N(h))
        logits = W_out RMSNorm_f(X^R_L)                          the last block makes the residual stream alone

    Block 0 is Pre-LN (its attention reads the embedding through one norm); blocks b >= 1 have separate pre-norms for
    the query, key and value streams (the release's `sepln`). W_1,b: d -> H_b, H_b = 64 (floor(C (b + 2) e / 64) +
    1) (its `round64`), e = 1, or 4 for the last block (`expand_last`); W_2,b: H_b -> C (b + 2).
    Init (the release's JAX trainer): W_1 ~ N(0, 1/d), W_2 = 0, a_b = 1 on the newest output and 0 elsewhere, so at
    init every stream is X_(b+1) and the model is Pre-LN. State: (the streams (Q, K, V, R), the block outputs in a
    DepthBank); the weights are made and applied eagerly (their shapes grow with b). Params: 2d(L - 1) key and value
    gains, and per block d H_b + H_b C (b + 2) + C (b + 2); W_1, W_2 decayed, a_b not. Cost: the MLP and 2 C (b + 2)
    d FLOPs per token after block b; all L + 1 outputs and the four streams stay alive.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        L, d = self.n_layer, cfg.d_model
        self.eps = cfg.norm_eps
        self.key_norms = nn.ModuleList(RMSNorm(d, cfg.norm_eps) for _ in range(L - 1))     # block b >= 1: b - 1
        self.value_norms = nn.ModuleList(RMSNorm(d, cfg.norm_eps) for _ in range(L - 1))
        self.dense = nn.ModuleList(self.dense_module(d, b) for b in range(L))

    def dense_module(self, d, b):
        """Block b's weight MLP: W_1 (H_b, d), W_2 (C (b + 2), H_b) and the static a_b (C, b + 2)."""
        hidden, C, n = self.hidden(self.n_layer, b)
        m = nn.Module()
        m.w1 = nn.Parameter(torch.zeros(hidden, d))
        m.w2 = nn.Parameter(torch.zeros(C * n, hidden))
        m.bias = nn.Parameter(torch.zeros(C, n))
        return m

    def site(self, i):
        b = i // 2
        if i % 2:
            return DepthWeightsSite(i, norm=self.norms[i], dense=self.dense[b])
        if b == 0:
            return DepthWeightsSite(i, norm=self.norms[i])
        key_norm, value_norm = self.key_norms[b - 1], self.value_norms[b - 1]     # block b >= 1's own stream norms
        return DepthWeightsSite(i, norm=self.norms[i], key_norm=key_norm, value_norm=value_norm)

    def init_stream(self, x0):
        return (x0, x0, x0, x0), self.ops.DepthBank.start(x0, n_max=self.n_layer + 1, eps=None)

    def read(self, s, site):
        (q, k, v, r), bank = s
        if site.mlp or site.key_norm is None:             # the MLP, or block 0's attention: one stream, one norm
            return site.norm(r), {}
        inputs = AttentionInputs(key=site.key_norm(k), value=site.value_norm(v))
        return site.norm(q), {"attention": inputs}

    def write(self, s, site, y, ctx):
        (q, k, v, r), bank = s
        if not site.mlp:
            return (q, k, v, r + y), bank
        out = r + y                                       # X_(b+1)
        bank = bank.push(out)
        return self.dense_streams(bank, out, site.dense), bank

    @torch.compiler.disable    # the weights' shapes grow with the block: eager, so compiled blocks share one graph
    def dense_streams(self, bank, x, dense):
        """(X^Q, X^K, X^V, X^R) from the bank's sources, weighted per token by `dense` on the newest output x (the
        last block makes X^R alone; it stands in for all four)."""
        streams = bank.weighted_sum(self.dense_weights(x, dense)).unbind(0)             # C of (B, T, D)
        return tuple(streams) if len(streams) == 4 else streams * 4

    def dense_weights(self, x, dense):
        """A (C, B, T, n) = W_2 GELU(W_1 RMSNorm(x)) + a, in fp32 (the weights mix residual state)."""
        with ops.fp32_maths(x):
            hidden = torch.nn.functional.gelu(rms_norm(x.float(), eps=self.eps) @ dense.w1.float().t())
            A = hidden @ dense.w2.float().t() + dense.bias.float().flatten()
            return A.unflatten(-1, dense.bias.shape).movedim(-2, 0)

    def collapse(self, s):
        return self.norm_f(s[0][3])

    # ------------------------------------------------------------------------- for the scripts
    paper_micro_batch = {1: 8}
    options = {}
    act_bytes = {"compiled": (28, 584, -12, -84), "bf16": (32, 584, -16, -84), "fp32": (40, 584, -24, -84)}
    input_bytes = 20

    @staticmethod
    def hidden(L, b):
        """(H_b, C, n) of block b's weight MLP: n = b + 2 sources, C = 4 streams (the last block: 1), and the
        release's round64 of C n e (e = 4 for the last block, else 1)."""
        n = b + 2
        if b == L - 1:
            return 64 * (4 * n // 64 + 1), 1, n
        return 64 * (4 * n // 64 + 1), 4, n

    @classmethod
    def cost(cls, L, d, T, **options):
        """Per block b: the weight MLP 2 d H_b + 2 H_b C n and the weighted sums 2 C n d FLOPs per token (n = b + 2);
        the state: the four streams and the L + 1 outputs."""
        total = 0
        for b in range(L):
            H, C, n = cls.hidden(L, b)
            total += 2 * d * H + 2 * H * C * n + 2 * C * n * d
        return total * T, L + 5

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        for m in self.dense:
            m.w1.normal_(0.0, m.w1.size(1) ** -0.5)       # fan-in normal, std 1/sqrt(d)
            m.w2.zero_()
            m.bias.zero_()
            m.bias[:, -1] = 1.0

    def no_decay_params(self):
        return [m.bias for m in self.dense]

    def sublayer_params(self, i):
        """The norms of sublayer i (block b >= 1's attention: the query, key and value norms). The weight MLPs stay at
        their place in a swap: their shapes follow the number of sources (docs/diagnostics.md#interventions)."""
        own = super().sublayer_params(i)
        b = i // 2
        if i % 2 == 0 and b > 0:
            own.update(key_norm=self.key_norms[b - 1].weight, value_norm=self.value_norms[b - 1].weight)
        return own

    def depth_state(self, s, i, after_skip):
        return s[0][3]                                    # X^R: the residual stream block i/2 reads

    def skip(self, s, i):
        """A skipped block outputs its residual input, X_(b+1) = X^R_b, and its dense connection is skipped with it:
        the streams stay (and the bank receives that output, so later weights find their sources)."""
        streams, bank = s
        return (streams, bank.push(streams[3])) if i % 2 else s

    def internals(self, s, site, ctx):
        """The weights that made block b >= 1's four streams, token-averaged (C, b + 1); diagnose.py's dense metric."""
        b = site.index // 2
        if site.mlp or b == 0:
            return {}
        bank = s[1]
        return {"dense_weights": self.dense_weights(bank.newest(), self.dense[b - 1]).mean((1, 2))}

    def head_internals(self, s):
        return {"dense_weights": self.dense_weights(s[1].newest(), self.dense[-1]).mean((1, 2))}

    def telemetry(self, rec):
        """Per consumer (blocks 1 .. L-1, then the head), of the residual stream's weights: on the embedding and on the
        newest block output."""
        return dense_telemetry(rec)


class HybridSite(Site):
    """A Site of Hybrid's Pre-LN part: `hands_over`, the last of its sublayers, whose write turns the stream into the
    deep design's state."""

    def __init__(self, i, norm, *, hands_over=False):
        super().__init__(i, norm)
        self.hands_over = hands_over


class Hybrid(PreLN):
    """A hybrid, the paper's future direction (docs/designs.md#hybrid): plain Pre-LN in the first S blocks, a
    cross-layer design (`deep`) in the L - S blocks after them, which sees the Pre-LN stream as its embedding:

        b < S:   h = x + F_i(RMSNorm_i(x))                   Pre-LN
        b >= S:  the deep design's read and write, its block b - S, started from init_stream(x_S)
        logits:  the deep design's collapse (its final norm or readout)

    S = min(floor(split L), L - 1): `split` 0.25 by default, the share of Block AttnRes blocks the paper finds dead at
    L32 (8 of 32), and Mix-LN's alpha; `deep` "block_attnres" by default, the design the paper measured the dead zone
    on. The deep design runs with its default options and is built at depth L - S. Params: the deep design's at
    L - S, beyond Pre-LN's. Any of CROSS_LAYER may be the deep design.
    """
    CROSS_LAYER = ("hc", "mhc", "attnres", "block_attnres", "moda", "mudd", "denseformer", "resformer")

    def __init__(self, cfg, deep="block_attnres", split=0.25):
        super().__init__(cfg)
        if deep not in self.CROSS_LAYER or not 0.0 <= split <= 1.0:
            raise ValueError(f"hybrid deep must be one of {', '.join(self.CROSS_LAYER)} and split in [0, 1]; "
                             f"got {deep!r}, {split}")
        self.n_shallow = self.shallow_blocks(self.n_layer, split)
        del self.norm_f                                   # the head is the deep design's
        self.norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(2 * self.n_shallow))
        deep_cfg = dataclasses.replace(cfg, n_layer=self.n_layer - self.n_shallow, residual=deep, residual_args={})
        self.deep = RESIDUALS[deep].build(deep_cfg)
        self.offset = 2 * self.n_shallow                  # sublayer i >= offset is the deep design's i - offset

    @staticmethod
    def shallow_blocks(L, split):
        return min(int(split * L), L - 1)

    def site(self, i):
        if i < self.offset:
            return HybridSite(i, norm=self.norms[i], hands_over=i == self.offset - 1)
        return self.deep.sites[i - self.offset]

    def init_stream(self, x0):
        return x0 if self.n_shallow else self.deep.init_stream(x0)

    def read(self, s, site):
        if isinstance(site, HybridSite):
            return site.norm(s), {}
        return self.deep.read(s, site)

    def write(self, s, site, y, ctx):
        if not isinstance(site, HybridSite):
            return self.deep.write(s, site, y, ctx)
        if site.hands_over:
            return self.deep.init_stream(s + y)
        return s + y

    def collapse(self, s):
        return self.deep.collapse(s)

    # ------------------------------------------------------------------------- for the scripts
    options = {"deep": "block_attnres", "split": 0.25}
    act_bytes = {"compiled": (9, 60, 22, 28), "bf16": (8, 60, 20, 28), "fp32": (8, 60, 20, 28)}
    input_bytes = BlockAttnRes.input_bytes

    @classmethod
    def activation_bytes(cls, deep="block_attnres", **options):
        return cls.act_bytes if deep == "block_attnres" else RESIDUALS[deep].act_bytes   # another deep's: its own

    @classmethod
    def cost(cls, L, d, T, deep="block_attnres", split=0.25, kv_ratio=1.0, **options):
        """The deep design's at its L - S blocks (Pre-LN's blocks add nothing)."""
        return RESIDUALS[deep].cost(L - cls.shallow_blocks(L, split), d, T, kv_ratio=kv_ratio)

    @property
    def n_sites(self):
        return self.offset + self.deep.n_sites

    @torch.no_grad()
    def reset_parameters(self):
        super().reset_parameters()
        self.deep.reset_parameters()

    def scale_sublayer_init(self, i, module):
        if i >= self.offset:
            self.deep.scale_sublayer_init(i - self.offset, module)

    def no_decay_params(self):
        return self.deep.no_decay_params()

    def deep_view(self, s, i):
        """(the deep design's state, its sublayer index) for sublayer i (2L: the head); the Pre-LN stream before the
        deep part is the deep design's start (so every depth state has the deep design's form)."""
        if i < self.offset:
            return self.deep.init_stream(s), 0
        return s, i - self.offset

    def depth_state(self, s, i, after_skip):
        state, k = self.deep_view(s, i)
        return self.deep.depth_state(state, k, after_skip)

    def readout(self, s, i, after_skip):
        state, k = self.deep_view(s, i)
        return self.deep.readout(state, k, after_skip)

    def skip(self, s, i):
        if i >= self.offset:
            return self.deep.skip(s, i - self.offset)
        return self.deep.init_stream(s) if i == self.offset - 1 else s

    def skips_to_newest(self, i):
        return i >= self.offset and self.deep.skips_to_newest(i - self.offset)

    def input_after_skip(self, s, i):
        return self.deep.input_after_skip(s, i - self.offset)

    def sublayer_params(self, i):
        if i < self.offset:
            return super().sublayer_params(i)
        return self.deep.sublayer_params(i - self.offset)

    def swap_blocks(self, i, j):
        S = self.n_shallow
        if i >= S and j >= S:
            self.deep.swap_blocks(i - S, j - S)

    def internals(self, s, site, ctx):
        return {} if isinstance(site, HybridSite) else self.deep.internals(s, site, ctx)

    def head_internals(self, s):
        return self.deep.head_internals(s)

    def telemetry(self, rec):
        return self.deep.telemetry(rec)


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
    # beyond the paper (issue 43): the designs the field asks about and the paper's own next steps
    "mudd": MUDD,
    "resformer": ResFormer,
    "denseformer": DenseFormer,
    "mixln": MixLN,
    "hybrid": Hybrid,
}
PAPER_DESIGNS = list(RESIDUALS)[:10]   # the paper's ten, in its order (the mini suite, the README's design table)
NEW_DESIGNS = list(RESIDUALS)[13:]     # the five beyond the paper (the README's third table, the mini suite's new rows)

