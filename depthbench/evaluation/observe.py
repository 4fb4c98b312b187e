"""
observe.py: what the diagnostics see of a forward pass, from outside the model (docs/diagnostics.md#depth-states).

`record` runs GPT's trunk loop (model.py) itself, without gradients, with observation points between the design's
calls: the depth states z_0 .. z_L the metrics compare (`res.depth_state`), what the logit lens decodes at each
(`res.readout`), and what the design reports of each sublayer's ctx (`res.internals`: HC's maps, AttnRes' depth
weights, MoDA's depth share). Its logits are the forward's own, bit for bit (tests/test_diagnose.py). With
`skip=b` it leaves block b out by the design's rules (`res.skip`, and AttnRes' next-output rule,
`res.skips_to_newest`): the interventions of the causal score and layer pruning. With `sublayers=True` it also
keeps, per sublayer, the RMS of the state it reads and of its output (telemetry.py). diagnose.py and telemetry.py
read the design only through this; nothing in the model or the designs switches on for them.
"""
import contextlib
from dataclasses import dataclass, field

import torch

import ops


@dataclass
class Record:
    """What one observed forward pass saw."""
    logits: torch.Tensor = None        # (B, T, V): the forward's own logits
    states: list = field(default_factory=list)     # z_0 .. z_L: before each block, and what the head reads
    readouts: list = field(default_factory=list)   # what the logit lens decodes at each state
    internals: dict = field(default_factory=dict)  # {name: [tensor per sublayer or consumer]}: the design's
    state_rms: list = None             # sublayers=True: RMS of the state each sublayer reads (res.depth_state)
    out_rms: list = None               # sublayers=True: RMS of each sublayer's output F_i(h)


def rms(t):
    return t.detach().double().pow(2).mean().sqrt().item()


@torch.no_grad()
def record(model, idx, skip=None, sublayers=False):
    """idx (B, T) token ids -> Record of the plain model's forward (not a compiled or DDP wrapper), block `skip` left
    out if given."""
    res, L = model.res, model.cfg.n_layer
    rope = ops.rope_cos_sin(idx.size(1), model.cfg.head_dim, model.cfg.rope_theta, idx.device)
    rec = Record()
    if sublayers:
        rec.state_rms, rec.out_rms = [], []
    with gathered(model):
        s = res.init_stream(model.wte(idx))
        after_skip = False             # the next consumer follows a skipped block under the next-output rule
        for b, block in enumerate(model.blocks):
            boundary(rec, res, s, i=2 * b, after_skip=after_skip)
            if b == skip:
                s = res.skip(res.skip(s, 2 * b), 2 * b + 1)
                after_skip = res.skips_to_newest(2 * b + 2)
                continue
            with gathered(block):
                for i in (2 * b, 2 * b + 1):
                    s = sublayer(rec, model, s, i, rope=rope, after_skip=after_skip)
                    after_skip = False
        boundary(rec, res, s, i=2 * L, after_skip=after_skip)
        if after_skip:
            z = res.input_after_skip(s, 2 * L)
        else:
            z = res.collapse(s)
            keep(rec, res.head_internals(s))
        rec.logits = model.lm_head(z)
    return rec


@contextlib.contextmanager
def gathered(module):
    """A module sharded by FSDP2 (depthbench/training/distributed.py) with its own parameters gathered: the observed
    pass calls a block's parts directly, past the hooks that gather them in a forward. Collective: every rank calls it.
    A module that is not sharded: nothing to do."""
    sharded = hasattr(module, "unshard") and hasattr(module, "reshard")
    if sharded:
        module.unshard()
    try:
        yield
    finally:
        if sharded:
            module.reshard()


def boundary(rec, res, s, i, after_skip):
    """Before block i / 2 (i = 2L: the head): its depth state and what the logit lens decodes there."""
    rec.states.append(res.depth_state(s, i, after_skip))
    rec.readouts.append(res.readout(s, i, after_skip))


def sublayer(rec, model, s, i, rope, after_skip):
    """Sublayer i as Block.forward runs it (read, F_i, write), observed; -> the state after it."""
    res, site, block = model.res, model.res.sites[i], model.blocks[i // 2]
    if rec.state_rms is not None:
        rec.state_rms.append(rms(res.depth_state(s, i, after_skip)))
    if after_skip:
        h, ctx = res.input_after_skip(s, i), {"after_skip": True}
    else:
        h, ctx = res.read(s, site)
    if site.mlp:
        y = block.mlp(h)
    else:
        y, aux = block.attn(h, rope, ctx.get("attention"))
        ctx = {**ctx, **aux}
    keep(rec, res.internals(s, site, ctx))
    if rec.out_rms is not None:
        rec.out_rms.append(rms(y))
    return res.write(s, site, y, ctx)


def keep(rec, internals):
    for name, value in internals.items():
        rec.internals.setdefault(name, []).append(value.detach())
