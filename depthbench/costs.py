"""
costs.py: what a run costs, in one place: the memory plan per GPU, the default micro-batch it allows and the
check of a grid's runs against a device (train.py, --dry-run); the analytic FLOPs and bytes of a design at a
shape (profile_gpu.py, train.py's MFU); the GPUs' peak FLOP/s. The formulas: docs/training.md#memory and
docs/diagnostics.md#cost.

Each design's own costs stay on its class in residuals.py: `cost(L, d, T, **options)` (its extra FLOPs and
residual state) and `act_bytes` (its activation bytes beyond Pre-LN's); this module adds the backbone's.
"""
import dataclasses
import math
import os

import torch

from depthbench.common import design_options, print0
from depthbench.kernels import LOSS_CHUNK_BYTES
from residuals import RESIDUALS
from shapes import backbone_params, count_params, ffn_dim

GB = 1e9
PLAN_BYTES = 80 * GB  # the 400m defaults fit an 80 GB GPU (--gpu-mem plans for another)

# Activations autograd keeps per token and block, bytes per unit of d, d_ff and the K/V width d_kv, with bf16 autocast
# (key True) and in fp32 (key False): Pre-LN's, measured on CPU (eager; docs/training.md#memory). A design's own on
# top: its act_bytes.
BLOCK_BYTES = {True: (31, 8, 4), False: (33, 16, 8)}
MARGIN = 1.1      # slack on activations and loss
RESERVE = 4 * GB  # CUDA context, NCCL buffers, allocator

# dense bf16 peak FLOP/s by device name, the first match wins: the H100's PCIe and NVL variants before the SXM's
GPU_BF16_PEAK = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "H100": 989e12, "A100": 312e12,
                 "L40S": 362e12, "A10": 125e12, "4090": 165e12}


# ----------------------------------------------------------------------------- the memory plan

def block_bytes(cfg, bf16):
    """Activation bytes autograd keeps per token for one block of the run `cfg` (a RunConfig)."""
    d = cfg.d_model
    d_kv = d * cfg.n_kv_head // cfg.n_head
    backbone = sum(c * x for c, x in zip(BLOCK_BYTES[bf16], (d, cfg.d_ff, d_kv)))
    design_index = 0 if bf16 else 1
    return backbone + design_bytes(cfg)[design_index] * d


def design_bytes(cfg):
    """The design's act_bytes under the run's options (a hybrid's follow its deep design)."""
    return RESIDUALS[cfg.residual].activation_bytes(**cfg.residual_args)


def fixed_bytes(cfg, params, blocks):
    """Weights, gradients and AdamW state per GPU: 20 bytes a parameter (fp32 weight, gradient, two moments, and
    the bf16 copy), or under FSDP2 16 per parameter shared by the ranks, plus the root's and one block's
    gathered weights."""
    W = cfg.world_size
    if cfg.fsdp and W > 1:
        return 16 * params / W + 8 * (params - blocks) + 16 * blocks / cfg.n_layer
    return 20 * params


def memory_plan(cfg, params, bf16=True):
    """An estimate of the bytes per GPU of a training step of the resolved run `cfg` (a RunConfig) with `params`
    parameters -> {fixed, activations, loss, eval, reserve, total, floor}, each part as docs/training.md#memory
    derives it. The floor is what no step of this shape does without: a run over it clearly cannot fit, whatever
    the estimate's errors."""
    L, d = cfg.n_layer, cfg.d_model
    tokens = cfg.batch_size * cfg.seq_len
    block = block_bytes(cfg, bf16)
    blocks = backbone_params(L, d, cfg.d_ff, n_kv_head=cfg.n_kv_head, n_head=cfg.n_head)
    casts = 2 * params if bf16 else 0  # the bf16 copies of the weights autocast makes
    if cfg.activation_checkpointing:  # each block's input; one block's set (and bf16 weights) at a time
        act = L * design_bytes(cfg)[2] * d + block
        casts = casts * (1 - blocks / params * (L - 1) / L)
        kept_per_block = design_bytes(cfg)[2]
    else:
        act = L * block
        kept_per_block = 16
    plan = {"fixed": fixed_bytes(cfg, params, blocks),
            "activations": tokens * act + casts,
            "eval": tokens * cfg.vocab_size * 10,
            "loss": tokens * 4 * d + 4 * LOSS_CHUNK_BYTES,
            "reserve": RESERVE}
    plan["total"] = plan["fixed"] + max(MARGIN * (plan["activations"] + plan["loss"]), plan["eval"]) + RESERVE
    plan["floor"] = 8 * params + tokens * L * d * kept_per_block
    return plan


def default_micro_batch(cfg, params, limit=PLAN_BYTES, most=None, bf16=True):
    """The largest power of two up to `most` (default: the design's paper_micro_batch, what fit the paper's GPUs at
    400M, {from depth: micro-batch}) that divides the global batch over the ranks and whose memory plan fits
    `limit` bytes (an 80 GB GPU); None if none does."""
    paper = RESIDUALS[cfg.residual].paper_micro_batch
    share = cfg.global_batch // cfg.world_size
    if not most:
        most = paper[max(k for k in paper if k <= cfg.n_layer)]
    most = min(share, most)
    for k in range(int(math.log2(max(most, 1))), -1, -1):
        B = 2 ** k
        if share % B == 0 and memory_plan(dataclasses.replace(cfg, batch_size=B), params, bf16)["total"] <= limit:
            return B
    return None


# ----------------------------------------------------------------------------- the memory check (costs.memory_plan)

def device_bytes(args, cuda):
    """The memory a plan is checked against: --gpu-mem with --dry-run, else this GPU's, else the host's."""
    if args.dry_run and args.gpu_mem:
        return args.gpu_mem * GB
    if cuda:
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_params(cfg):
    """The parameter count of the run's model, counted on the meta device."""
    return count_params(cfg.n_layer, cfg.d_model, cfg.d_ff, cfg.residual, vocab=cfg.vocab_size, n_head=cfg.n_head,
                        n_kv_head=cfg.n_kv_head, **cfg.residual_args)


def print_plan(cfg, params, plan, limit, bf16):
    """--dry-run: one run's memory plan per GPU, part by part."""
    engine = "1 process"
    if cfg.world_size > 1:
        engine = f"{'FSDP2' if cfg.fsdp else 'DDP'} over {cfg.world_size} ranks"
    precision = ", fp32"
    if bf16:
        precision = ", bf16 autocast"
    recompute = ", activation checkpointing" if cfg.activation_checkpointing else ""
    print0(f"memory plan per GPU of {cfg.name} (an estimate: docs/training.md#memory)\n  L{cfg.n_layer} "
           f"d{cfg.d_model}, {params:,} params, micro-batch {cfg.batch_size} x {cfg.seq_len}, "
           f"{engine}{precision}{recompute}")
    verdict_text = "fits" if plan["total"] <= limit else "does NOT fit"
    for key, what in [("fixed", "weights, gradients, AdamW"), ("activations", "kept for the backward"),
                      ("loss", f"(eval logits {plan['eval'] / GB:.1f} GB, after the step)"),
                      ("reserve", f"CUDA context, NCCL, allocator (and x{MARGIN} on the two above)"),
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
