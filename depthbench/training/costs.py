"""
costs.py: what a run costs, in one place: the memory plan per GPU, the default micro-batch it allows and the
check of a grid's runs against a device (train.py, --dry-run); the analytic FLOPs and bytes of a design at a
shape (profile_gpu.py, train.py's MFU); the GPUs' peak FLOP/s. The formulas: docs/training.md#memory and
docs/diagnostics.md#cost.

Each design's own costs stay on its class in residuals.py: `cost(L, d, T, **options)` (its extra FLOPs and
residual state) and `act_bytes` (its activation bytes beyond Pre-LN's); this module adds the backbone's.
"""
import dataclasses
import gc
import math
import os

import torch

from depthbench.files.common import design_options, print0
from depthbench.kernels.cpu import LOSS_CHUNK_BYTES
from residuals import RESIDUALS
from shapes import backbone_params, count_params, ffn_dim

GB = 1e9
PLAN_BYTES = 80 * GB  # the 400m defaults fit an 80 GB GPU (--gpu-mem plans for another)

# Activation bytes autograd keeps per token (docs/training.md#memory), by mode: "compiled" (bf16 autocast, each block
# compiled: train.py on a GPU), "bf16" (eager, bf16 autocast), "fp32" (eager). Pre-LN's block: per unit of d, d_ff,
# d_kv and attention head, and bytes; the rest of the model (embedding, final norm, a one-chunk loss's logits): per
# unit of d and V, and bytes. A design adds its own (residuals.py, `act_bytes`). Measured on CPU at L2-4 d64-128,
# fast kernels, by scripts/calibrate_memory.py ("compiled": inductor's choice of what the forward saves).
BLOCK_BYTES = {"compiled": (14, 6, 4, 4, 8), "bf16": (30, 8, 4, 4, 8), "fp32": (32, 16, 8, 4, 8)}
EDGE_BYTES = {"compiled": (10, 4, 4), "bf16": (10, 4, 4), "fp32": (12, 4, 4)}
MARGIN = 1.1      # slack on activations and loss
RESERVE = 4 * GB  # CUDA context, NCCL buffers, allocator

# dense bf16 peak FLOP/s by device name, the first match wins: the H100's PCIe and NVL variants before the SXM's
GPU_BF16_PEAK = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "H100": 989e12, "A100": 312e12,
                 "L40S": 362e12, "A10": 125e12, "4090": 165e12}


# ----------------------------------------------------------------------------- the memory plan

def plan_mode(cfg, bf16):
    """The mode (BLOCK_BYTES) a plan assumes: fp32; bf16 eager (--no-compile on a GPU); or bf16 compiled (a GPU's
    default, also for a plan made off the GPU: the 400m preset's micro-batch, --dry-run --gpu-mem)."""
    if not bf16:
        return "fp32"
    if cfg.device.startswith("cuda") and not cfg.compile:
        return "bf16"
    return "compiled"


def one_chunk(cfg):
    """Whether the training loss runs as one chunk of logits (kept for the backward) or checkpointed chunks."""
    return cfg.batch_size * cfg.seq_len * 4 * cfg.vocab_size <= LOSS_CHUNK_BYTES


def token_bytes(cfg, mode):
    """(per block, the rest of the model): the activation bytes autograd keeps per token of the run `cfg` (a
    RunConfig) in `mode`, Pre-LN's (BLOCK_BYTES, EDGE_BYTES) and the design's (act_bytes)."""
    d = cfg.d_model
    a, b, e, f = design_bytes(cfg)[mode]
    block = dot(BLOCK_BYTES[mode], (d, cfg.d_ff, d * cfg.n_kv_head // cfg.n_head, cfg.n_head, 1)) + a * d + b
    edge = dot(EDGE_BYTES[mode], (d, cfg.vocab_size * one_chunk(cfg), 1)) + e * d + f
    return block, edge


def dot(coefficients, features):
    return sum(c * x for c, x in zip(coefficients, features))


def design_bytes(cfg):
    """The design's act_bytes under the run's options (a hybrid's follow its deep design)."""
    return RESIDUALS[cfg.residual].activation_bytes(**cfg.residual_args)


def cast_bytes(cfg):
    """The bf16 copies of the weights autocast makes and the backward keeps: the blocks' matmuls, and the head's
    when the loss is one chunk."""
    d, blocks = cfg.d_model, backbone_params(cfg.n_layer, cfg.d_model, cfg.d_ff, n_kv_head=cfg.n_kv_head,
                                             n_head=cfg.n_head)
    return 2 * (blocks - 2 * d * cfg.n_layer) + 2 * d * cfg.vocab_size * one_chunk(cfg)


def fixed_bytes(cfg, params, blocks):
    """Weights, gradients and AdamW state per GPU: 20 bytes a parameter (fp32 weight, gradient, two moments, and
    the bf16 copy), or under FSDP2 16 per parameter shared by the ranks, plus the root's and one block's
    gathered weights."""
    W = cfg.world_size
    if cfg.fsdp and W > 1:
        return 16 * params / W + 8 * (params - blocks) + 16 * blocks / cfg.n_layer
    return 20 * params


def memory_plan(cfg, params, bf16=True, mode=None):
    """An estimate of the bytes per GPU of a training step of the resolved run `cfg` (a RunConfig) with `params`
    parameters -> {fixed, activations, loss, eval, reserve, total, floor, mode}, each part as
    docs/training.md#memory derives it; mode (BLOCK_BYTES) by default plan_mode's. The floor is what no step of this
    shape does without: a run over it clearly cannot fit, whatever the estimate's errors."""
    L, d, mode = cfg.n_layer, cfg.d_model, mode or plan_mode(cfg, bf16)
    tokens = cfg.batch_size * cfg.seq_len
    block, edge = token_bytes(cfg, mode)
    casts = cast_bytes(cfg) if bf16 else 0
    if cfg.activation_checkpointing:  # each block's input; one block's set (and its bf16 weights) at a time
        kept_per_block = RESIDUALS[cfg.residual].input_bytes
        act = L * kept_per_block * d + block + edge
        casts = casts / L
    else:
        act = L * block + edge
        kept_per_block = 16
    plan = {"fixed": fixed_bytes(cfg, params, backbone_params(L, d, cfg.d_ff, n_kv_head=cfg.n_kv_head,
                                                             n_head=cfg.n_head)),
            "activations": tokens * act + casts,
            "eval": tokens * cfg.vocab_size * 10,
            "loss": 4 * min(LOSS_CHUNK_BYTES, 4 * tokens * cfg.vocab_size),  # a chunk's logits in the backward
            "reserve": RESERVE, "mode": mode}
    plan["total"] = plan["fixed"] + max(MARGIN * (plan["activations"] + plan["loss"]), plan["eval"]) + RESERVE
    plan["floor"] = 8 * params + tokens * L * d * kept_per_block
    return plan


def step_peak(cfg, params, mode):
    """The plan's peak of one forward and backward alone (profile_gpu.py's step, no optimizer, gradients freed):
    fp32 weights, the activations, the loss's chunk and the head's gradient, without margin or reserve: what
    torch.cuda.max_memory_allocated measures (scripts/gpu_smoke.py's memory check)."""
    plan = memory_plan(cfg, params, mode != "fp32", mode)
    return 4 * params + plan["activations"] + plan["loss"] + 4 * cfg.vocab_size * cfg.d_model


def default_micro_batch(cfg, params, limit=PLAN_BYTES, most=None, bf16=True):
    """The largest power of two up to `most` (default: the design's most_micro_batch, what fit the paper's GPUs at
    400M; HC/mHC with recompute 8 at every depth) that divides the global batch over the ranks and whose memory plan fits
    `limit` bytes (an 80 GB GPU); None if none does."""
    share = cfg.global_batch // cfg.world_size
    if not most:
        most = RESIDUALS[cfg.residual].most_micro_batch(cfg.n_layer, **cfg.residual_args)
    most = min(share, most)
    for k in range(int(math.log2(max(most, 1))), -1, -1):
        B = 2 ** k
        if share % B == 0 and memory_plan(dataclasses.replace(cfg, batch_size=B), params, bf16)["total"] <= limit:
            return B
    return None


def needs_recompute(cfg, params, limit, bf16):
    """Whether HC/mHC's `recompute` (residuals.HyperConnections) is needed: the memory plan of the run `cfg` (a
    RunConfig, at its micro-batch) without it over `limit` bytes. Recompute changes no loss or gradient; it trades
    connector compute (10-17% of an mHC step at L9 on the CPU) for most of their activation memory, so it is worth
    it only where memory is short (the card's L70 d640 at micro-batch 8 on an 80 GB GPU), not on a CPU's mini run."""
    without = dataclasses.replace(cfg, residual_args={**cfg.residual_args, "recompute": False})
    return memory_plan(without, params, bf16)["total"] > limit


def memory_savers(cfg):
    """The header's words for what a run trades compute for memory with: ', activation checkpointing' and HC/mHC's
    ', recompute on' or ', recompute off' (train.py's device line, --dry-run's plan)."""
    text = ", activation checkpointing" if cfg.activation_checkpointing else ""
    if "recompute" in cfg.residual_args:
        text += f", recompute {'on' if cfg.residual_args['recompute'] else 'off'}"
    return text


# ----------------------------------------------------------------------------- the memory check (costs.memory_plan)

def host_bytes():
    """This machine's memory, what a CPU run's plan is checked against."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_bytes(args, cuda):
    """The memory a plan is checked against: --gpu-mem with --dry-run, else this GPU's, else the host's."""
    if args.dry_run and args.gpu_mem:
        return args.gpu_mem * GB
    if cuda:
        return torch.cuda.get_device_properties(0).total_memory
    return host_bytes()


def run_params(cfg):
    """The parameter count of the run's model, counted on the meta device."""
    return count_params(cfg.n_layer, cfg.d_model, cfg.d_ff, cfg.residual, vocab=cfg.vocab_size, n_head=cfg.n_head,
                        n_kv_head=cfg.n_kv_head, **cfg.residual_args)


def print_plan(cfg, params, plan, limit, bf16):
    """--dry-run: one run's memory plan per GPU, part by part."""
    engine = "1 process"
    if cfg.world_size > 1:
        engine = f"{'FSDP2' if cfg.fsdp else 'DDP'} over {cfg.world_size} ranks"
    precision = {"fp32": ", fp32", "bf16": ", bf16 autocast, eager", "compiled": ", bf16 autocast, compiled"}
    print0(f"memory plan per GPU of {cfg.name} (an estimate: docs/training.md#memory)\n  L{cfg.n_layer} "
           f"d{cfg.d_model}, {params:,} params, micro-batch {cfg.batch_size} x {cfg.seq_len}, "
           f"{engine}{precision[plan['mode']]}{memory_savers(cfg)}")
    verdict_text = "fits" if plan["total"] <= limit else "does NOT fit"
    for key, what in [("fixed", "weights, gradients, AdamW: 20 bytes a parameter (arithmetic)"),
                      ("activations", f"kept for the backward: measured on CPU ({plan['mode']}, L2-4 d64-128, "
                                      "scripts/calibrate_memory.py), scaled"),
                      ("loss", f"a chunk of logits in the backward (arithmetic; eval logits {plan['eval'] / GB:.1f} "
                               "GB, after the step)"),
                      ("reserve", f"CUDA context, NCCL, allocator, and x{MARGIN} on the two above (judgment)"),
                      ("total", f"of {limit / GB:.1f} GB: {verdict_text}")]:
        print0(f"  {key:<12}{plan[key] / GB:8.1f} GB  {what}")


def memory_fix(cfg, params, limit, bf16):
    """The cheapest flags that make a run fit `limit` bytes, as one line of advice."""
    W = max(8, cfg.world_size)
    ckpt = {"activation_checkpointing": True}
    for flags in ({}, ckpt, {**ckpt, "fsdp": True, "world_size": W}):  # the cheapest way out first
        B = default_micro_batch(dataclasses.replace(cfg, **flags), params, limit, most=2 ** 30, bf16=bf16)
        if B:
            fix = f"use --batch-size {B}" + "".join(f" --{k.replace('_', '-')}" for k in flags if k != "world_size")
            if "fsdp" in flags:
                fix += f" under torchrun on {W} GPUs"
            return fix
    return "use more GPUs with --fsdp --activation-checkpointing, or a shorter --seq-len"


def check_memory(runs, args, cuda):
    """Each run's memory plan against a device's memory, before anything is allocated: a run over its floor is
    a ValueError (train.py: one line, exit 2). --dry-run instead prints each plan against --gpu-mem (default: this
    GPU's memory; without one, the host's, in fp32); one that does not fit is a ValueError naming the fix."""
    bf16 = cuda or (args.dry_run and args.gpu_mem is not None)
    limit = device_bytes(args, cuda)
    over = []
    for cfg in runs:
        params = run_params(cfg)
        plan = memory_plan(cfg, params, bf16)
        if not args.dry_run:
            if plan["floor"] > limit:
                raise ValueError(f"{cfg.name} needs at least {plan['floor'] / GB:,.1f} GB at micro-batch "
                                 f"{cfg.batch_size} x {cfg.seq_len} tokens, the {cfg.device} has {limit / GB:,.1f} "
                                 "GB: lower --seq-len or --batch-size")
            continue
        if plan["total"] > limit:
            over.append((cfg, params, plan))
        print_plan(cfg, params, plan, limit=limit, bf16=bf16)
    if not over:
        return
    cfg, params, plan = over[0]
    raise ValueError(f"{cfg.name} needs {plan['total'] / GB:.1f} GB per GPU at micro-batch {cfg.batch_size}, over "
                     f"{limit / GB:.1f} GB: " + memory_fix(cfg, params, limit, bf16))


# ----------------------------------------------------------------------------- FLOPs and bytes

def analytic(residual, *, n_layer, d_model, seq, vocab, params, d_ff=None, batch=1, elem_bytes=2, options=None,
             kv_ratio=1.0):
    """The analytic fields of one row (docs/diagnostics.md#cost) of a design at n_layer x d_model (d_ff: the
    backbone's shapes.ffn_dim by default), `seq` tokens a sequence, `batch` sequences (kv_cache_bytes_batch),
    `params` parameters of `elem_bytes` each (bf16 by default); options: the design's (default: its defaults);
    kv_ratio = kv heads / query heads (GQA: W_k, W_v, the KV cache and MoDA's W_kv shrink by it)."""
    L, d, T = n_layer, d_model, seq
    d_ff = d_ff or ffn_dim(d)
    # formula A: the block matmuls, and QKᵀ, AV causally: 2 x 2 x d·T²/2 per block
    A = 2 * T * L * ((2 + 2 * kv_ratio) * d * d + 3 * d * d_ff) + 2 * L * d * T * T
    head = 2 * T * d * vocab
    over, state = RESIDUALS[residual].cost(L, d, T, kv_ratio=kv_ratio, **design_options(residual, options))
    kv = 2 * L * T * round(d * kv_ratio) * elem_bytes
    return {"prefill_flops": A, "prefill_flops_head": A + head, "residual_overhead_flops": over,
            "train_flops_per_token": 3 * (A + head + over) / T, "kv_cache_bytes": kv,
            "kv_cache_bytes_batch": kv * batch, "weight_bytes": params * elem_bytes,
            "residual_state_bytes": state * d * T * elem_bytes}


def gpu_peak(name):
    """Dense bf16 FLOP/s of a GPU by its device name (GPU_BF16_PEAK), None for one the table lacks."""
    for key, value in GPU_BF16_PEAK.items():
        if key in name:
            return value
    return None


# ----------------------------------------------------------------------------- measuring what a step keeps

def kept_bytes(model, idx, bf16=True):
    """Bytes a training forward of `model` on idx (B, T) leaves allocated on the CPU: what autograd keeps for the
    backward (the loss's graph held), weights excluded, with the bf16 copies of the weights autocast makes. Read
    from torch.profiler's allocation events (allocated minus freed during the forward), which sees compiled code
    too (a TorchDispatchMode, profile_gpu.TensorBytes, turns torch.compile off)."""
    from torch.profiler import ProfilerActivity, profile
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    gc.collect()  # no collection of earlier garbage inside the window
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, amp:
        loss = model(idx, idx, logits=False)[1]
    kept = sum(e.self_cpu_memory_usage for e in prof.events())
    del loss
    return kept
