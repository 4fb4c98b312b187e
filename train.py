"""
train.py: train one DepthBench model, or a grid of them, and log everything to run.json and ckpt.pt.

    python train.py                                  # CPU preset: 2 layers learn S3 compositions in minutes
    python train.py --max-steps 3 --out /tmp/runs    # the same run, stopped after 3 steps (a smoke test)
    python train.py --residual preln,hc --seed 0,1   # a grid: every combination in turn, finished runs skipped
    torchrun --standalone --nproc_per_node=8 train.py --suite 1.6b --layers 40 --residual attnres  # a paper run
    python train.py --suite 1.6b --layers 54 --residual attnres --dry-run --gpu-mem 80  # its memory plan per GPU
    python train.py --suite 400m --print-grid        # the suite's whole LR sweep as torchrun lines, for a cluster

The presets and suites, what a run writes, --resume, Ctrl-C and the memory plan: docs/training.md; every fault
and bad input: docs/reliability.md. Any flag overrides its preset value; every derived number is printed before
training. Exit codes: 0 ok, 1 a run diverged (NaN/inf loss), 2 bad input or an unwritable run folder (one line
on stderr, nothing half-written), 130/143 stopped by SIGINT/SIGTERM.
"""
import argparse
import dataclasses
import functools
import itertools
import math
import os
import re
import resource
import shlex
import signal
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import kernels
import profile_gpu
import telemetry
import trackers
from data import BatchLoader, DataError, SyntheticTask, answer_metrics, padded_vocab_size, verdict
from model import GPT, GPTConfig
import common
from common import (ArgParser, check_options, comma_list, design_options, format_lr, json_object, positive, print0,
                    versions, write_json)
from residuals import RESIDUALS
from shapes import SUITES, backbone_params, count_params, parse_count, preln_params, solve, suite_row, suite_rows

SCHEMA = "depthbench.train/1"
FINAL = ("val_loss", "answer_loss", "answer_acc")  # run.json's "final": the last eval's; null before one, if diverged
fail = functools.partial(common.fail, "train.py")  # bad input: one line on stderr (from rank 0) and exit code 2

# Values a flag left unset takes from its preset. The cpu preset fixes the *backbone* budget (blocks only)
# so that a real-text vocab (50k rows of embedding) does not eat the tiny budget; the paper fixes the total.
SMALL = dict(params="0.8M", fixed="backbone", n_head=4, data="synthetic", answers_only=True, group="s3", seq_len=128,
             global_batch=32, batch_size=None, lr=[3e-3], eval_every=200, eval_iters=8, ckpt_every=400, log_every=50)
PRESETS = {
    "cpu": dict(SMALL, layers=[2], steps=800),
    "mini": dict(SMALL, ar=[9.1], steps=1200),  # the cpu preset's budget and recipe at any AR (mini.py's suite)
    "400m": dict(params="405M", fixed="total", n_head=16, ar=[42.67], data="fineweb-edu", answers_only=False,
                 group="s4", seq_len=2048, global_batch=512, batch_size=None, steps=None, lr=None, eval_every=250,
                 eval_iters=8, ckpt_every=1000, log_every=10),
}


def get_lr(step, peak, warmup, total, final_frac=0.1):
    """LR of optimizer step `step` (0-based), docs/designs.md#recipe (OLMo's CosWithWarmup): linear from 0
    over `warmup` steps, then a cosine from peak down to final_frac * peak at step `total`."""
    if step < warmup:
        return peak * step / warmup
    if step >= total:
        return final_frac * peak
    progress = (step - warmup) / (total - warmup)
    return final_frac * peak + (1 - final_frac) * peak * 0.5 * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- command line

def build_parser():
    p = ArgParser(prog="train.py", description="Train DepthBench models: one run, or a grid of comma-separated values.")
    add, pint = p.add_argument, positive(int)
    # what to train (comma-separated values make a grid)
    add("--preset", choices=list(PRESETS), help="cpu (a lesson in minutes), mini (the one-machine suite's shapes: 4 "
        "heads, AR 100..4 at 0.8M) or 400m (the paper's recipe); default: 400m with CUDA, cpu without. Flags below "
        "marked (preset) default to the preset's value")
    add("--residual", type=comma_list(str), help=f"design(s): {', '.join(RESIDUALS)} (default preln; --print-grid: all)")
    add("--ar", type=comma_list(positive(float)), help="aspect ratio(s) d_model/n_layer (preset; 400m: 42.67 = L24 d1024)")
    add("--layers", type=comma_list(pint), help="depth(s) n_layer, instead of --ar (preset; cpu: 2)")
    add("--suite", choices=list(SUITES), help="the paper's shapes and step counts (shapes.py --suite); implies "
        "--preset 400m, which without --params means --suite 400m")
    add("--row", type=comma_list(int), help="--suite: row number(s) as `shapes.py --suite NAME` lists them")
    add("--print-grid", action="store_true", help="--suite: print every design x row x LR the paper ran (the design's "
        "paper_lr_sweep and paper_lr; 1.6b: the suite's one LR) as torchrun lines and exit; --residual, "
        "--row/--layers/--ar and --lr narrow it")
    add("--params", help="parameter budget the shape is solved for, instead of a suite (preset: 405M, cpu/mini 0.8M "
        "backbone)")
    add("--fixed", choices=["total", "backbone"], help="what --params counts (preset: total, cpu/mini backbone)")
    add("--lr", type=comma_list(positive(float)), help="peak LR(s) (preset: the paper's, each design's paper_lr in "
        "residuals.py, the suite's for 1.6b: 5e-4; cpu/mini 3e-3)")
    add("--seed", type=comma_list(common.seed_number), default=[42], help="seed(s) of the init and the train data order "
        "(the paper's 42)")
    add("--residual-args", type=json_object, default={}, help="design options as JSON (each design's `options` in "
        "residuals.py), e.g. '{\"n_streams\": 2, \"init\": \"uniform\", \"n_groups\": 4, \"norm\": \"post\"}'; "
        "each design of a grid takes the keys it declares; non-default values join the run name")
    # data
    add("--data", help="synthetic | fineweb-edu | a .txt/.jsonl/.parquet file, folder or quoted glob (preset)")
    add("--data-dir", help="token shards of real data (default data_cache/<source>-<tokenizer>)")
    add("--tokenizer", default="gpt2", choices=["gpt2", "bytes"], help="tokenizer of real data")
    add("--max-gap", type=pint, default=4, help="synthetic: the largest gap (compositions per answer)")
    add("--group", choices=["s3", "s4", "s5"], help="synthetic: the permutation group (preset: cpu/mini s3, else s4)")
    add("--answers-only", action=argparse.BooleanOptionalAction, help="synthetic: answers get their own ids and are "
        "the only targets (preset: on for cpu/mini); --no-answers-only trains on every token")
    add("--seq-len", type=pint, help="tokens per sequence (preset: 2048, cpu/mini 128)")
    # batch and schedule
    add("--global-batch", type=pint, help="sequences per optimizer step, all ranks together (preset: 512, cpu/mini 32)")
    add("--batch-size", type=pint, help="micro-batch per rank (preset: the largest power of two up to the design's "
        "paper_micro_batch whose memory plan fits an 80 GB GPU; cpu/mini: global batch / ranks)")
    add("--steps", type=pint, help="length of the LR schedule (preset: the suite's, 400m 7,600; with --params 20 "
        "tokens per budgeted param; cpu 800, mini 1200)")
    add("--max-steps", type=pint, help="stop after this many steps, schedule unchanged (--resume continues)")
    add("--weight-decay", type=positive(float, zero=True), default=0.1, help="AdamW weight decay (a design's static "
        "params get 0)")
    add("--grad-clip", type=positive(float, zero=True), default=1.0, help="clip the global grad norm to this (0: off)")
    # evaluation, logging, checkpoints
    add("--eval-every", type=pint, help="evaluate every this many steps and at the end (preset: 250, cpu/mini 200)")
    add("--eval-iters", type=pint, help="global batches of validation data per eval, the same ones each time (preset)")
    add("--ckpt-every", type=pint, help="write ckpt.pt every this many steps and at the end (preset)")
    add("--log-every", type=pint, help="print a training line every this many steps; run.json keeps all (preset)")
    add("--out", default="runs", help="root folder of the run folders")
    add("--resume", action="store_true", help="continue each run from its ckpt.pt (if it has one)")
    # system
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile the model (default: on with CUDA, "
        "off on CPU, where it pays only after thousands of steps: docs/speed.md)")
    add("--activation-checkpointing", action="store_true", help="keep only each block's input for the backward, "
        "which recomputes the block: about a third more compute for most of the activation memory")
    add("--fsdp", action="store_true", help="under torchrun: shard weights, gradients and AdamW state over the ranks "
        "(FSDP2: each block, then the root) instead of a DDP replica on each")
    add("--dry-run", action="store_true", help="print each run's memory plan per GPU and exit: 0 if it fits, 2 with "
        "one line naming the fix if not (for the ranks of torchrun, or of WORLD_SIZE if set)")
    add("--gpu-mem", type=positive(float), help="--dry-run: GB per GPU to plan for (default: this GPU's memory; "
        "without one, the host's, in fp32)")
    telemetry.add_flags(p)
    p.add_kernels()
    return p


# ----------------------------------------------------------------------------- resolving a run's config

def resolve(args, residual, shape_key, shape_value, lr, seed, vocab_size, world_size):
    """Everything one run needs, as the flat dict that goes into run.json and ckpt.pt."""
    tokens_per_step = args.global_batch * args.seq_len
    if args.suite:  # named by suite and depth: the ladder has one AR at several sizes
        shape = suite_row(args.suite, shape_key, shape_value, vocab_size)
        budget = shape["backbone_params"] if args.suite.endswith("backbone") else shape["params"]
        shape_tag = f"_{args.suite}-L{shape['n_layer']}"
    else:  # the solver's shape for --params/--fixed (the cpu preset, or a budget that is no suite); ValueError: none
        budget = parse_count(args.params)
        shape = solve(budget, **{shape_key: shape_value}, fixed=args.fixed, vocab=vocab_size,
                      n_head=PRESETS[args.preset]["n_head"])
        shape["n_kv_head"] = shape["n_head"]
        # 20 tokens per budgeted parameter, the same tokens for every design and shape of the budget
        shape["steps"] = round(20 * budget / tokens_per_step)
        budget_tag = f"_{args.fixed}" if args.fixed != PRESETS[args.preset]["fixed"] else ""  # not the preset's
        shape_tag = f"{budget_tag}_ar{round(shape['d_model'] / shape['n_layer'], 2):g}"
    L, d, n_head = shape["n_layer"], shape["d_model"], shape["n_head"]
    lr = lr if lr is not None else shape.get("lr") or RESIDUALS[residual].paper_lr  # 1.6b: the suite's one LR
    steps = args.steps or shape["steps"]
    opts = design_options(residual, args.residual_args)  # the design's constructor options (GPTConfig.residual_args)
    opts_tag = "".join(f"_{k}-{v}" for k, v in opts.items() if v != RESIDUALS[residual].options[k])  # non-defaults
    # the design's own checks of its option values (a ValueError), on the meta device, before anything is written
    params = count_params(L, d, shape["d_ff"], residual, vocab_size, n_head, shape["n_kv_head"], **opts)
    cfg = {
        "name": f"{residual}{opts_tag}{shape_tag}_lr{format_lr(lr)}_s{seed}", "preset": args.preset,
        "suite": args.suite, "residual": residual, "residual_args": opts, "n_layer": L, "d_model": d,
        "d_ff": shape["d_ff"], "n_head": n_head, "n_kv_head": shape["n_kv_head"], "head_dim": d // n_head,
        "ar": d / L, "vocab_size": vocab_size, "params_budget": budget,
        "fixed": "backbone" if args.suite and args.suite.endswith("backbone") else args.fixed,
        "lr": lr, "final_lr_frac": 0.1, "warmup_steps": round(0.1 * steps), "total_steps": steps,
        "max_steps": args.max_steps, "weight_decay": args.weight_decay, "betas": [0.9, 0.95], "eps": 1e-8,
        "grad_clip": args.grad_clip, "seed": seed, "data": args.data, "data_dir": args.data_dir,
        "tokenizer": None if args.data == "synthetic" else args.tokenizer, "max_gap": args.max_gap,
        "group": args.group, "answers_only": bool(args.answers_only) and args.data == "synthetic",
        "seq_len": args.seq_len, "batch_size": args.batch_size, "global_batch": args.global_batch,
        "world_size": world_size, "fsdp": args.fsdp, "activation_checkpointing": args.activation_checkpointing,
        "tokens_per_step": tokens_per_step, "total_tokens": steps * tokens_per_step,
        "eval_every": args.eval_every, "eval_iters": args.eval_iters, "ckpt_every": args.ckpt_every,
        "log_every": args.log_every, "out": args.out, "device": args.device, "compile": args.compile,
        "kernels": args.kernels, "dtype": "bfloat16 autocast" if args.device.startswith("cuda") else "float32",
        "stats_every": args.stats_every, "log_to": args.log_to,      # telemetry.py, trackers.py
    }
    # 400m: the largest paper-like micro-batch that fits an 80 GB GPU; the small presets: the whole global batch at
    # once, split over the ranks. Gradient accumulation makes up the rest: the maths does not depend on it.
    B = cfg["batch_size"] = args.batch_size or ((default_micro_batch(cfg, params) or 1) if args.preset == "400m"
                                                else max(1, args.global_batch // world_size))
    if args.global_batch % (B * world_size):
        raise ValueError(f"--global-batch {args.global_batch} is not a multiple of micro-batch {B} x world size "
                         f"{world_size}")
    cfg["grad_accum"] = args.global_batch // (B * world_size)
    return cfg


# keys that define a run's maths: a checkpoint made with other values cannot be resumed
RESUME_KEYS = ["residual", "residual_args", "n_layer", "d_model", "d_ff", "n_head", "n_kv_head", "vocab_size", "lr",
               "warmup_steps", "total_steps", "weight_decay", "grad_clip", "seed", "data", "tokenizer", "max_gap",
               "group", "answers_only", "seq_len", "global_batch"]


# ----------------------------------------------------------------------------- the memory plan

GB = 1e9
PLAN_BYTES = 80 * GB  # the 400m defaults fit an 80 GB GPU (--gpu-mem plans for another)
# Activations autograd keeps per token and block, bytes per unit of d, d_ff and the K/V width d_kv, with bf16 autocast
# and in fp32: Pre-LN's, measured on CPU (eager; docs/training.md#memory). A design's own on top: its act_bytes.
BLOCK_BYTES = {True: (31, 8, 4), False: (33, 16, 8)}
MARGIN, RESERVE = 1.1, 4 * GB  # slack on activations and loss; CUDA context, NCCL buffers, allocator


def memory_plan(cfg, params, bf16=True):
    """An estimate of the bytes per GPU of a training step of the resolved run `cfg` with `params` parameters ->
    {fixed, activations, loss, eval, reserve, total, floor}, each part as docs/training.md#memory derives it. The
    floor is what no step of this shape does without: a run over it clearly cannot fit, whatever the estimate's
    errors."""
    L, d, d_ff, W, design = cfg["n_layer"], cfg["d_model"], cfg["d_ff"], cfg["world_size"], RESIDUALS[cfg["residual"]]
    d_kv, tokens = d * cfg["n_kv_head"] // cfg["n_head"], cfg["batch_size"] * cfg["seq_len"]
    block = sum(c * x for c, x in zip(BLOCK_BYTES[bf16], (d, d_ff, d_kv))) + design.act_bytes[not bf16] * d
    blocks, casts = backbone_params(L, d, d_ff, cfg["n_kv_head"], cfg["n_head"]), 2 * params if bf16 else 0
    if cfg["activation_checkpointing"]:  # each block's input; one block's set (and bf16 weights) at a time
        act, casts = L * design.act_bytes[2] * d + block, casts * (1 - blocks / params * (L - 1) / L)
    else:
        act = L * block
    plan = {"fixed": 16 * params / W + 8 * (params - blocks) + 16 * blocks / L if cfg["fsdp"] and W > 1
            else 20 * params, "activations": tokens * act + casts, "eval": tokens * cfg["vocab_size"] * 10,
            "loss": tokens * 4 * d + 4 * kernels.LOSS_CHUNK_BYTES, "reserve": RESERVE}
    plan["total"] = plan["fixed"] + max(MARGIN * (plan["activations"] + plan["loss"]), plan["eval"]) + RESERVE
    plan["floor"] = 8 * params + tokens * L * d * (design.act_bytes[2] if cfg["activation_checkpointing"] else 16)
    return plan


def default_micro_batch(cfg, params, limit=PLAN_BYTES, most=None, bf16=True):
    """The largest power of two up to `most` (default: the design's paper_micro_batch, what fit the paper's GPUs at
    400M, {from depth: micro-batch}) that divides the global batch over the ranks and whose memory
    plan fits `limit` bytes (an 80 GB GPU); None if none does."""
    mb, share = RESIDUALS[cfg["residual"]].paper_micro_batch, cfg["global_batch"] // cfg["world_size"]
    most = min(share, most or mb[max(k for k in mb if k <= cfg["n_layer"])])
    return next((B for B in (2 ** k for k in range(int(math.log2(max(most, 1))), -1, -1)) if share % B == 0
                 and memory_plan({**cfg, "batch_size": B}, params, bf16)["total"] <= limit), None)


def check_memory(runs, args, cuda):
    """Each run's memory plan against a device's memory, before anything is allocated: a run over its floor is
    refused in one line (exit 2). --dry-run instead prints each plan against --gpu-mem (default: this GPU's memory;
    without one, the host's, in fp32) and exits: 0 when all fit, else 2 with one line naming the fix."""
    gpu_mem = args.gpu_mem if args.dry_run else None
    bf16 = cuda or gpu_mem is not None
    limit = (gpu_mem * GB if gpu_mem else torch.cuda.get_device_properties(0).total_memory if cuda
             else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    over = []
    for cfg in runs:
        params = count_params(cfg["n_layer"], cfg["d_model"], cfg["d_ff"], cfg["residual"], cfg["vocab_size"],
                              cfg["n_head"], cfg["n_kv_head"], **cfg["residual_args"])
        plan, W = memory_plan(cfg, params, bf16), cfg["world_size"]
        if not args.dry_run:
            if plan["floor"] > limit:
                fail(f"{cfg['name']} needs at least {plan['floor'] / GB:,.1f} GB at micro-batch {cfg['batch_size']} "
                     f"x {cfg['seq_len']} tokens, the {cfg['device']} has {limit / GB:,.1f} GB: lower --seq-len or "
                     "--batch-size")
            continue
        over += [(cfg, params, plan)] if plan["total"] > limit else []
        print0(f"memory plan per GPU of {cfg['name']} (an estimate: docs/training.md#memory)\n  L{cfg['n_layer']} "
               f"d{cfg['d_model']}, {params:,} params, micro-batch {cfg['batch_size']} x {cfg['seq_len']}, "
               + (f"{'FSDP2' if cfg['fsdp'] else 'DDP'} over {W} ranks" if W > 1 else "1 process")
               + (", bf16 autocast" if bf16 else ", fp32")
               + (", activation checkpointing" if cfg["activation_checkpointing"] else ""))
        for key, what in [("fixed", "weights, gradients, AdamW"), ("activations", "kept for the backward"),
                          ("loss", f"(eval logits {plan['eval'] / GB:.1f} GB, after the step)"),
                          ("reserve", f"CUDA context, NCCL, allocator (and x{MARGIN} on the two above)"),
                          ("total", f"of {limit / GB:.1f} GB: " + ("fits" if plan["total"] <= limit else
                                                                   "does NOT fit"))]:
            print0(f"  {key:<12}{plan[key] / GB:8.1f} GB  {what}")
    if not args.dry_run:
        return
    if not over:
        sys.exit(0)
    cfg, params, plan = over[0]
    W, ckpt = max(8, cfg["world_size"]), {"activation_checkpointing": True}
    for flags in ({}, ckpt, {**ckpt, "fsdp": True, "world_size": W}):  # the cheapest way out first
        if B := default_micro_batch({**cfg, **flags}, params, limit, 2 ** 30, bf16):
            fix = f"use --batch-size {B}" + "".join(f" --{k.replace('_', '-')}" for k in flags if k != "world_size")
            break
    fail(f"{cfg['name']} needs {plan['total'] / GB:.1f} GB per GPU at micro-batch {cfg['batch_size']}, over "
         f"{limit / GB:.1f} GB: " + (fix + (f" under torchrun on {W} GPUs" if "fsdp" in flags else "") if B else
                                     "use more GPUs with --fsdp --activation-checkpointing, or a shorter --seq-len"))


# ----------------------------------------------------------------------------- one training run

def forward_backward(model, loader, accum, ctx, device, ddp):
    """Gradients of one optimizer step: `accum` micro-batches of equal size, each loss the mean over its
    tokens, divided by accum, so the summed gradient is the mean over the whole batch (DDP then averages
    the ranks' equal shares). Only the last micro-step all-reduces (no_sync on the others)."""
    total = torch.zeros((), device=device)
    for micro in range(accum):
        x, y, _ = loader.next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with model.no_sync() if ddp and micro < accum - 1 else nullcontext():
            with ctx:
                _, loss = model(x, y, logits=False)      # the loss without the full (B, T, V) logits
            (loss / accum).backward()
        total += loss.detach()
    return total / accum


@torch.no_grad()
def evaluate(model, loader, iters, ctx, device, max_gap):
    """Mean token CE over `iters` fixed global batches of validation data, and for the synthetic task the
    answer-only loss/accuracy overall and per level. Sums are all-reduced, so every rank gets the same."""
    model.eval()
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # summed CE, tokens (fp64: exact counts past 2^24)
    answers = torch.zeros(max_gap, 3, device=device)      # per level: summed CE, correct, count
    for it in range(iters):
        for micro in range(loader.accum_steps):
            x, y, level = loader.get_batch(it, micro)
            x, y = x.to(device), y.to(device)
            with ctx:
                logits, loss = model(x, y)
            n = (y >= 0).sum()  # targets the loss counts (answers_only ignores the rest)
            sums[0] += loss.double() * n
            sums[1] += n
            if level is not None:
                answers += answer_metrics(logits, y, level, max_gap)
    if dist.is_initialized():
        dist.all_reduce(sums)
        dist.all_reduce(answers)
    model.train()
    out = {"val_loss": (sums[0] / sums[1]).item(), "answer_loss": None, "answer_acc": None, "per_level": None}
    if level is not None:
        a = answers.tolist()
        total = answers.sum(0)
        out["answer_loss"], out["answer_acc"] = (total[0] / total[2]).item(), (total[1] / total[2]).item()
        out["per_level"] = {str(g + 1): {"loss": r[0] / r[2], "acc": r[1] / r[2]} for g, r in enumerate(a) if r[2] > 0}
    return out


def finite_or_none(x):
    return x if math.isfinite(x) else None  # JSON has no NaN; null marks a non-finite value


def build(cfg, env):
    """Loaders, model, optimizer and an empty log for one run -> the run's state `r`, one namespace that each step
    of the run (maybe_resume, describe, loop and what it calls) reads and extends."""
    r = SimpleNamespace(cfg=cfg, env=env, rank=env["rank"], world=env["world_size"], device=env["device"])
    r.master, r.ddp, r.cuda = r.rank == 0, r.world > 1, r.device.startswith("cuda")
    r.fsdp = r.ddp and cfg["fsdp"]
    r.run_dir = Path(cfg["out"]) / cfg["name"]
    r.json_path, r.ckpt_path = r.run_dir / "run.json", r.run_dir / "ckpt.pt"

    # data: both loaders cut each global batch the same way, whatever the number of ranks (data.py)
    r.synthetic = cfg["data"] == "synthetic"
    r.source = SyntheticTask(cfg["max_gap"], cfg["group"], cfg["answers_only"]) if r.synthetic else cfg["data_dir"]
    B, T, G = cfg["batch_size"], cfg["seq_len"], cfg["global_batch"]
    r.train_loader = BatchLoader(r.source, "train", B, T, G, r.rank, r.world, seed=cfg["seed"])
    r.val_loader = BatchLoader(r.source, "val", B, T, G, r.rank, r.world,
                               seed=common.VAL_SEED if r.synthetic else cfg["seed"])

    # model and optimizer; `raw` is what we save (no DDP/compile prefixes in the state dict)
    torch.manual_seed(cfg["seed"])
    arch = ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "residual", "kernels")
    r.model_config = GPTConfig(**{k: cfg[k] for k in arch}, residual_args=dict(cfg["residual_args"]),
                               checkpoint_blocks=cfg["activation_checkpointing"])
    with torch.device(r.device):  # built and initialised there: no CPU init and copy per rank (CUDA: its own RNG)
        r.raw = GPT(r.model_config)
    if r.fsdp:
        r.shapes = shard(r.raw)
    r.groups = r.raw.param_groups(cfg["weight_decay"])
    r.opt = torch.optim.AdamW(r.groups, lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"],
                              fused=r.cuda and not r.fsdp)
    total, heads = r.raw.num_params(), (cfg["n_kv_head"], cfg["n_head"])
    r.preln = preln_params(cfg["n_layer"], cfg["d_model"], cfg["d_ff"], cfg["vocab_size"], *heads)
    params = {"total": total, "backbone": backbone_params(cfg["n_layer"], cfg["d_model"], cfg["d_ff"], *heads),
              "residual_extra": total - r.preln}
    r.log = {"schema": SCHEMA, "config": cfg, "params": params, "steps": [], "evals": [], "final": dict.fromkeys(FINAL),
             "diverged": False, "finished": False, "wall_s": 0.0, "peak_mem_bytes": 0, "device": env["device_name"],
             "versions": versions()}
    r.step = 0
    r.stop = min(cfg["total_steps"], cfg["max_steps"] or cfg["total_steps"])
    # MFU: the analytic training FLOPs per token over the device's peak
    r.peak = profile_gpu.device_peak(torch.device(r.device))
    r.flops_tok = profile_gpu.analytic(cfg["residual"], cfg["n_layer"], cfg["d_model"], cfg["d_ff"], T, B,
                                       cfg["vocab_size"], total, 4, cfg["residual_args"],
                                       kv_ratio=cfg["n_kv_head"] / cfg["n_head"])["train_flops_per_token"]
    return r


def shard(model):
    """FSDP2, the engine of the official runs: each block a unit, then the root (embedding, head and `model.res`,
    which every block reads). FSDP2 shards dim 0: a 0-dim parameter (HC/mHC's scales) becomes a vector of one,
    which checkpoints turn back. -> the model's {name: shape}."""
    from torch.distributed.fsdp import fully_shard
    warnings.filterwarnings("ignore", "FSDP2-wrapped module .* view")  # no design writes in place into a block's output
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for m in model.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dim() == 0:
                setattr(m, name, torch.nn.Parameter(p.detach().reshape(1)))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return shapes


def reshaped(model, osd, shapes):
    """State dicts (the optimizer's keyed by name) with each parameter, and its AdamW moments, in shapes[name]."""
    state = {k: {m: v if m == "step" else v.reshape(shapes[k]) for m, v in st.items()}
             for k, st in osd.get("state", {}).items()}
    model = {k: v.reshape(shapes[k]) for k, v in model.items()}
    return model, {"state": state, "param_groups": osd.get("param_groups", [])}


def rekey(osd, key):
    """An optimizer state dict with its parameters renamed by key[...]: positions <-> names."""
    return {"state": {key[k]: v for k, v in osd.get("state", {}).items()},
            "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in osd.get("param_groups", [])]}


def full_state(r):
    """(model, optimizer) state dicts as one process saves them (whole tensors, plain names and shapes, the optimizer
    keyed by position); under FSDP gathered onto rank 0's CPU, a collective that every rank calls."""
    if not r.fsdp:
        return r.raw.state_dict(), r.opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, osd = reshaped(get_model_state_dict(r.raw, options=opts),  # optimizer by name; both empty off rank 0
                          get_optimizer_state_dict(r.raw, r.opt, options=opts), r.shapes)
    return model, rekey(osd, {n: k for k, n in enumerate(n for g in osd["param_groups"] for n in g["params"])})


def load_full_state(r, model, optimizer):
    """Load what full_state saved into either engine at any number of ranks (FSDP: each rank keeps its shard)."""
    if not r.fsdp:
        r.raw.load_state_dict(model)
        return r.opt.load_state_dict(optimizer)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    names, opts = {id(p): n for n, p in r.raw.named_parameters()}, StateDictOptions(full_state_dict=True)
    optimizer = rekey(optimizer, [names[id(p)] for g in r.opt.param_groups for p in g["params"]])
    model, optimizer = reshaped(model, optimizer, {n: p.shape for n, p in r.raw.named_parameters()})
    set_model_state_dict(r.raw, model, options=opts)
    set_optimizer_state_dict(r.raw, r.opt, optimizer, options=opts)


def maybe_resume(r, resume):
    """--resume and a ckpt.pt made with the same maths (RESUME_KEYS): weights, optimizer, loader, RNG and
    log from it. Otherwise step 0, and a stale checkpoint of an older run is deleted."""
    if resume and r.ckpt_path.exists():
        try:
            ckpt = common.load_checkpoint(r.ckpt_path, ["model", "config", "step", "optimizer", "rng", "loader", "log"])
        except common.CheckpointError as e:
            fail(f"cannot resume: {e}")
        old = {"n_kv_head": ckpt["config"].get("n_head"), **ckpt["config"]}  # checkpoints from before GQA: MHA
        # options added to a design since (HC's collapse, forward) take their defaults, which the older code computed
        old["residual_args"] = design_options(old["residual"], old.get("residual_args"))
        changed = [k for k in RESUME_KEYS if old.get(k) != r.cfg.get(k)]
        if changed:
            was = ", ".join(f"{k}={old.get(k)!r}" for k in changed)
            fail(f"cannot resume {r.ckpt_path}: it was made with other settings ({was}); use another --out")
        load_full_state(r, ckpt["model"], ckpt["optimizer"])
        r.train_loader.load_state_dict(ckpt["loader"])
        torch.set_rng_state(ckpt["rng"]["cpu"])
        if r.cuda and "cuda" in ckpt["rng"]:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], r.device)
        r.step, old = ckpt["step"], ckpt["log"]
        r.log.update(steps=old["steps"], evals=old["evals"], wall_s=old["wall_s"], peak_mem_bytes=old["peak_mem_bytes"])
        r.log["telemetry"] = old.get("telemetry")
        print0(f"resumed from {r.ckpt_path} at step {r.step}")
    else:
        if resume:
            print0("--resume, but no ckpt.pt in the run folder yet: starting from step 0")
        if r.master:
            r.ckpt_path.unlink(missing_ok=True)  # starting over: a stale checkpoint of an older run must not survive
    r.saved_step = r.step


def describe(r):
    """Every derived number, before the first step."""
    cfg, params, cuda = r.cfg, r.log["params"], r.cuda
    B, T, G = cfg["batch_size"], cfg["seq_len"], cfg["global_batch"]
    n_static = sum(p.numel() for g in r.groups if g["weight_decay"] == 0.0 for p in g["params"])
    print0(f"run        {cfg['name']}  ->  {r.run_dir}")
    print0(f"shape      L={cfg['n_layer']} d={cfg['d_model']} d_ff={cfg['d_ff']} heads={cfg['n_head']} "
           f"kv_heads={cfg['n_kv_head']} head_dim={cfg['head_dim']} AR={cfg['ar']:.2f}"
           + ("" if cfg["n_head"] == 16 else f"  ({cfg['n_head']} heads, not the paper's 16)"))
    print0(f"params     total {params['total']:,} = backbone {params['backbone']:,} + embedding/head/final norm "
           f"{r.preln - params['backbone']:,} + design extra {params['residual_extra']:,}  "
           f"(budget {cfg['params_budget']:,} {cfg['fixed']}; vocab {cfg['vocab_size']})")
    if r.synthetic:
        task = r.source
        floor = "answers are the only targets" if task.answers_only else \
            f"loss floor {task.loss_floor(T):.4f} nats/token at T={T} (answers alone: 0)"
        print0(f"data       synthetic {task.group.upper()} running products, max gap {cfg['max_gap']}, vocab "
               f"{task.vocab_size} (padded to {cfg['vocab_size']}); {floor}; chance answer accuracy {1 / task.eq:.1%}")
    else:
        print0(f"data       {cfg['data']} ({cfg['tokenizer']}) shards in {cfg['data_dir']}")
    print0(f"batch      {G} seqs x {T} tokens = {cfg['tokens_per_step']:,} tokens/step = micro-batch {B} "
           f"x world {r.world} x grad accum {r.train_loader.accum_steps}")
    print0(f"schedule   {cfg['total_steps']:,} steps = {cfg['total_tokens']:,} tokens "
           f"({cfg['total_tokens'] / params['total']:.1f} per param), warmup {cfg['warmup_steps']}, "
           f"peak lr {cfg['lr']:g} -> cosine to {cfg['lr'] * cfg['final_lr_frac']:g}"
           + (f"; stopping at step {r.stop} (--max-steps)" if r.stop < cfg["total_steps"] else ""))
    print0(f"optimizer  AdamW betas {tuple(cfg['betas'])} eps {cfg['eps']:g} wd {cfg['weight_decay']:g} "
           f"({n_static:,} design params without decay), clip {cfg['grad_clip']:g}")
    print0(f"eval       every {cfg['eval_every']} steps on {cfg['eval_iters']} global batches "
           f"({cfg['eval_iters'] * cfg['tokens_per_step']:,} val tokens); ckpt every {cfg['ckpt_every']} steps")
    threads = "" if cuda else f" (threads: {torch.get_num_threads()}; on busy cores OMP_NUM_THREADS=1 can be faster)"
    print0(f"device     {r.env['device_name']}{threads}, {cfg['dtype']}, compile {'on' if cfg['compile'] else 'off'}"
           f", {cfg['kernels']} kernels, world size {r.world}"
           + (" (FSDP2)" if r.fsdp else " (DDP)" if r.ddp else " (--fsdp: nothing to shard)" if cfg["fsdp"] else "")
           + (", activation checkpointing" if cfg["activation_checkpointing"] else "")
           + f"; MFU from {r.flops_tok:.3g} FLOPs/token and a peak of "
           + (f"{r.peak / 1e12:.3g} TFLOP/s ({'bf16 table' if cuda else 'measured fp32 matmul'})" if r.peak
              else "? (unknown GPU)"))
    plan = memory_plan(cfg, params["total"], cuda)["total"]
    print0(f"memory     planned {plan / GB:.1f} GB per {'GPU' if cuda else 'process'}"
           + (f" of {torch.cuda.get_device_properties(r.device).total_memory / GB:.1f} GB" if cuda else "")
           + " (an estimate; --dry-run shows its parts)")


def loop(r):
    """Evaluate, checkpoint and take optimizer steps until the stop step; False if the run diverged. Asked to stop
    (SIGINT/SIGTERM), it saves after the step it is in and exits with 128 + the signal's number."""
    cfg, log = r.cfg, r.log
    r.model = torch.compile(r.raw) if cfg["compile"] else r.raw
    r.train_model = (DDP(r.model, device_ids=[r.env["local_rank"]] if r.cuda else None) if r.ddp and not r.fsdp
                     else r.model)
    r.ctx = torch.autocast("cuda", dtype=torch.bfloat16) if r.cuda else nullcontext()  # CPU stays fp32
    if r.cuda:
        torch.cuda.reset_peak_memory_stats(r.device)
    r.wall_before, r.t_start, step_start = log["wall_s"], time.time(), r.step
    r.watch = telemetry.Watch.start(r.raw, r.opt, r.val_loader, log, cfg, r.step)
    while True:
        last, stop = r.step >= r.stop, interrupted(r)
        maybe_evaluate(r, last)
        maybe_save(r, last, stop)
        if stop:
            if r.ddp:
                dist.barrier()  # no rank leaves (and makes torchrun stop the rest) before rank 0 has saved
            print0(f"interrupted at step {r.step}: " + (f"saved {r.ckpt_path.name}; resume with: {r.env['resume']}"
                   if r.step else "nothing trained yet"), file=sys.stderr)
            r.watch.close()
            sys.exit(128 + stop)
        if last:
            break
        loss, grad_norm, lr, dt = optimizer_step(r)
        r.watch.after_step(log["steps"][-1])
        step = r.step
        if step == 1 or step % cfg["log_every"] == 0 or step == r.stop or log["diverged"]:
            mfu = f" | MFU {100 * r.flops_tok * cfg['tokens_per_step'] / dt / r.world / r.peak:.1f}%" if r.peak else ""
            eta = (time.time() - r.t_start) / (step - step_start) * (r.stop - step)  # evals included
            print0(f"step {step:>5}/{cfg['total_steps']} | loss {loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} "
                   f"| {dt * 1000:.0f} ms | {cfg['tokens_per_step'] / dt:,.0f} tok/s{mfu} | ETA {eta / 60:.1f} min")
        if log["diverged"]:
            log["final"] = dict.fromkeys(FINAL)
            save_json(r)
            # the one line of a diverged run, on stderr; the grid goes on with the next run
            print0(f"train.py: error: {cfg['name']} diverged at step {step} (loss {loss}, grad norm {grad_norm}); "
                   f"see {r.json_path}", file=sys.stderr)
            r.watch.close()
            return False
    r.watch.close()
    print0(f"done: {cfg['name']} at step {r.step} in {log['wall_s']:.1f} s" + ("" if log["finished"] else
           f" (stopped by --max-steps; --resume continues to step {cfg['total_steps']})"))
    if r.synthetic and log["evals"]:
        print0(verdict(log["evals"][-1]["per_level"], 1 / r.source.eq, cfg["n_layer"]))
    return True


def optimizer_step(r):
    """One optimizer step at the schedule's LR, logged; a non-finite loss or gradient norm marks the run
    diverged and skips the update. -> (loss, grad norm, lr, seconds)."""
    cfg, t0 = r.cfg, time.time()
    lr = get_lr(r.step, cfg["lr"], cfg["warmup_steps"], cfg["total_steps"], cfg["final_lr_frac"])
    for g in r.opt.param_groups:
        g["lr"] = lr
    loss = forward_backward(r.train_model, r.train_loader, r.train_loader.accum_steps, r.ctx, r.device,
                            isinstance(r.train_model, DDP))
    if r.ddp:
        dist.all_reduce(loss)  # for the log only (the gradients are already averaged); gloo has no AVG
        loss /= r.world
    clip = cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(r.raw.parameters(), clip)
    grad_norm = (grad_norm.full_tensor() if r.fsdp else grad_norm).item()  # FSDP: a DTensor
    loss = loss.item()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        r.log["diverged"] = True  # stop before this update makes the weights non-finite too
    else:
        r.opt.step()
    r.opt.zero_grad(set_to_none=True)
    dt = time.time() - t0
    r.step += 1
    r.log["steps"].append({"step": r.step, "tokens": r.step * cfg["tokens_per_step"], "loss": finite_or_none(loss),
                           "lr": lr, "grad_norm": finite_or_none(grad_norm), "tok_per_s": cfg["tokens_per_step"] / dt})
    return loss, grad_norm, lr, dt


def maybe_evaluate(r, last):
    """Evaluate at every eval_every-th step and the last one (once: a resumed run's last step may have been)."""
    cfg, log, step = r.cfg, r.log, r.step
    evaluated = log["evals"] and log["evals"][-1]["step"] == step
    if step > 0 and (step % cfg["eval_every"] == 0 or last) and not evaluated:
        ev = evaluate(r.model, r.val_loader, cfg["eval_iters"], r.ctx, r.device, cfg["max_gap"])
        log["evals"].append({"step": step, "tokens": step * cfg["tokens_per_step"], **ev})
        r.watch.at_eval(step, ev)
        log["final"] = {k: ev[k] for k in FINAL}
        levels = "" if ev["per_level"] is None else (
            f" | answers loss {ev['answer_loss']:.4f} acc {ev['answer_acc']:.1%} | by gap " +
            " ".join(f"{g}: {m['acc']:.0%}" for g, m in ev["per_level"].items()))
        print0(f"eval step {step} | val loss {ev['val_loss']:.4f}" + levels)
        save_json(r)


def maybe_save(r, last, force=False):
    """ckpt.pt at every ckpt_every-th step, the last one and when asked to stop, then run.json: run.json says
    finished only once the final ckpt.pt is on disk, so a kill between the two leaves a run that --resume ends.
    Both atomic, written by rank 0."""
    due = r.step > 0 and (r.step % r.cfg["ckpt_every"] == 0 or last or force) and r.step != r.saved_step
    if due:
        save_json(r, write=False)  # this step's wall time into the log the checkpoint carries
        model, optimizer = full_state(r)  # under FSDP a collective: every rank calls it
        if r.master:
            rng = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state(r.device)} if r.cuda else {})}
            common.save_checkpoint(r.ckpt_path, {
                "model": model, "model_config": dataclasses.asdict(r.model_config), "config": r.cfg,
                "step": r.step, "optimizer": optimizer, "rng": rng, "loader": r.train_loader.state_dict(),
                "log": r.log})
        r.saved_step = r.step
    if due or last:
        r.log["finished"] = last and r.step >= r.cfg["total_steps"]
        save_json(r)


def save_json(r, write=True):
    """run.json with the wall time and memory peak so far (rank 0); write=False updates them in the log only."""
    log = r.log
    log["wall_s"] = r.wall_before + time.time() - r.t_start
    log["peak_mem_bytes"] = max(log["peak_mem_bytes"], torch.cuda.max_memory_allocated(r.device) if r.cuda
                                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
    if r.master and write:
        write_json(r.json_path, log)


STOP = []  # the signals received (SIGINT/SIGTERM): the loop saves and exits after the step it is in


def on_signal(signum, frame):
    STOP.append(signum)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: KeyboardInterrupt at once


def interrupted(r):
    """The signal that asks this run to stop, else 0; under torchrun all ranks agree: none waits in a collective."""
    if not r.ddp:
        return STOP[0] if STOP else 0
    flag = torch.tensor(STOP[:1] or [0], device=r.device)
    dist.all_reduce(flag, dist.ReduceOp.MAX)
    return int(flag)


# ----------------------------------------------------------------------------- setup and the grid

def init_distributed(cuda):
    """torchrun sets RANK/LOCAL_RANK/WORLD_SIZE: one process per GPU (nccl), or per CPU worker (gloo)."""
    env = {"rank": 0, "local_rank": 0, "world_size": 1, "device": "cuda" if cuda else "cpu"}
    if "RANK" in os.environ:
        env.update(rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
                   world_size=int(os.environ["WORLD_SIZE"]))
        if cuda:
            env["device"] = f"cuda:{env['local_rank']}"
            torch.cuda.set_device(env["device"])
        dist.init_process_group("nccl" if cuda else "gloo")
    env["device_name"] = torch.cuda.get_device_name(env["device"]) if cuda else "cpu"
    return env


def on_rank0(fn, env):
    """Run fn on rank 0 only and hand every rank its result, or its ValueError (a DataError, a folder in use or
    not writable), so all ranks stop together."""
    out = [None, None]
    if env["rank"] == 0:
        try:
            out[0] = fn()
        except ValueError as e:
            out[1] = str(e)
    if env["world_size"] > 1:
        dist.broadcast_object_list(out, src=0)
    if out[1] is not None:
        fail(out[1])
    return out[0]


def prepare_data(args, cfg):
    """Token shards of a real source, written by rank 0. data.py reuses shards whose settings match; for
    fineweb-edu, shards made earlier (say by data.py) with the same tokenizer are used as they are. Make
    fineweb-edu's shards before a torchrun job: tokenizing 8B tokens takes hours, and the other ranks wait
    for rank 0 in a collective whose timeout (10 min for NCCL) is much shorter."""
    if args.data != "fineweb-edu":
        return data.prepare(args.data, args.data_dir, args.tokenizer)
    meta, need = data.load_meta(args.data_dir), cfg["total_tokens"] + 1
    if meta and (meta["config"]["source"], meta["config"]["tokenizer"]) == ("fineweb-edu", args.tokenizer):
        have = meta["n_tokens"] - sum(s["tokens"] for s in meta["shards"]["val"])
        print(f"using the fineweb-edu shards in {args.data_dir}: {have:,} train tokens, the schedule reads {need:,}"
              + (" (so some data repeats)" if have < need else ""))
    else:  # what the schedule reads, plus 10M validation tokens (data.py's default for fineweb-edu)
        data.prepare("fineweb-edu", args.data_dir, args.tokenizer, max_tokens=need + 10_000_000)


def claim(path, held):
    """Rank 0, before a run: lock its folder (into `held`; one writer at a time) and check it can be written, remove
    temp files of a writer killed mid-save -> run_state. A problem is a ValueError (one line)."""
    held.append(common.lock_folder(path))
    for p in (path / "run.json", path / "ckpt.pt"):
        if p.exists() and not p.is_file():
            raise ValueError(f"{p} is not a file; move it away to train this run")
    for tmp in [*path.glob("ckpt.pt.*.tmp"), *path.glob("run.json.*.tmp")]:
        tmp.unlink()
    return common.run_state(path)


def shapes_asked(args):
    """(key, value) of each shape that --row, --layers and --ar ask for (only --print-grid takes more than one)."""
    return [(key, value) for key in ("row", "layers", "ar") for value in getattr(args, key) or []]


def print_grid(args):
    """--print-grid: the suite's runs at the paper's LRs (its sweep; 1.6b: one LR), one torchrun line each."""
    designs = args.residual or list(RESIDUALS)
    rows = list(enumerate(suite_rows(args.suite)))
    try:
        picked = [suite_row(args.suite, key, value) for key, value in shapes_asked(args)]
    except ValueError as e:
        fail(str(e))
    rows = [(k, r) for k, r in rows if not picked or r in picked]
    suite_lr = rows[0][1]["lr"]                 # one LR for every design (1.6b), else each design's sweep
    lines = [f"torchrun --standalone --nproc_per_node=8 train.py --suite {args.suite} --row {k} --residual {res} "
             f"--lr {format_lr(lr)}" for res in designs for k, _ in rows for lr in args.lr or
             ([suite_lr] if suite_lr else sorted({*RESIDUALS[res].paper_lr_sweep, RESIDUALS[res].paper_lr}))]
    lrs = "--lr" if args.lr else f"the suite's LR {format_lr(suite_lr)}" if suite_lr else "the LR sweep"
    print(f"# suite {args.suite}: {len(designs)} design(s) x {len(rows)} row(s) x {lrs} = {len(lines)} runs")
    print("\n".join(lines))


def parse_args(argv=None):
    """The command line with every preset and suite default filled in -> (args, cuda); bad input exits 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cuda = common.pick_device(args.device) == "cuda"
    except ValueError as e:
        parser.error(str(e))
    if args.suite and args.preset in ("cpu", "mini"):
        parser.error(f"--suite runs the paper's recipe: it cannot be combined with --preset {args.preset}")
    if args.suite and (args.params or args.fixed):
        parser.error("--suite fixes the shapes: give --params/--fixed without --suite")
    args.preset = args.preset or ("400m" if cuda or args.suite else "cpu")
    if args.preset == "400m" and not (args.params or args.fixed):
        args.suite = args.suite or "400m"
    bad = [r for r in args.residual or [] if r not in RESIDUALS]
    if bad:
        parser.error(f"unknown residual {bad[0]!r}; choose from {', '.join(RESIDUALS)}")
    if args.print_grid:
        if not args.suite:
            parser.error("--print-grid needs --suite (or --preset 400m)")
        return args, cuda
    args.residual = args.residual or ["preln"]
    if sum(x is not None for x in (args.ar, args.layers, args.row)) > 1:
        parser.error("give one of --ar, --layers and --row")
    if args.row is not None and not args.suite:
        parser.error("--row picks a row of a --suite")
    if args.ar is None and args.layers is None and args.row is None:
        if args.suite and args.suite != "400m":
            parser.error(f"--suite {args.suite}: pick rows with --row, --layers or --ar "
                         f"(shapes.py --suite {args.suite})")
        args.ar, args.layers = PRESETS[args.preset].get("ar"), PRESETS[args.preset].get("layers")
    for key, value in PRESETS[args.preset].items():
        if key not in ("ar", "layers") and getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.data == "synthetic" and args.max_gap + 3 > args.seq_len:
        parser.error(f"--max-gap {args.max_gap} with --seq-len {args.seq_len}: a sequence could hold no answer (the "
                     f"first one comes after up to max gap + 3 tokens); lower --max-gap or raise --seq-len")
    if args.compile is None:
        args.compile = cuda  # on CPU compile pays only after thousands of steps (docs/speed.md)
    args.device = "cuda" if cuda else "cpu"
    if args.data == "synthetic":
        args.data_dir = None
    elif args.data_dir is None:
        slug = re.sub(r"[^A-Za-z0-9-]+", "_", args.data).strip("_")[-40:]  # data/austen -> data_austen
        args.data_dir = f"data_cache/{slug}-{args.tokenizer}"
    try:
        check_options(args.residual, args.residual_args)
    except ValueError as e:
        parser.error(f"--residual-args: {e}")
    if trackers.missing(args.log_to):
        parser.error(trackers.missing(args.log_to))
    try:
        if not parse_count(args.params) > 0:
            raise ValueError(args.params)
    except ValueError:  # not an assert: python -O would skip it
        parser.error(f"--params {args.params!r} is not a count like 405M")
    return args, cuda


def grid_run(args, cfg, env, counter):
    """One run of the grid, in its locked folder: skipped when finished, else trained; False if it diverged."""
    path, held = Path(cfg["out"]) / cfg["name"], []
    print0(f"\n{counter} {cfg['residual']} ar={cfg['ar']:.4g} lr={format_lr(cfg['lr'])} seed={cfg['seed']}  ({path})")
    try:
        state = on_rank0(lambda: claim(path, held), env)
        if state in ("finished", "diverged"):
            print0(f"{state} already (run.json says so): skipping; move the folder away to train it again")
            return state == "finished"
        if state == "partial" and not args.resume:
            print0("this run folder holds an unfinished run: starting over (--resume continues it)")
        if args.compile:
            torch._dynamo.reset()  # a fresh compile cache per shape
        r = build(cfg, env)
        maybe_resume(r, args.resume)
        describe(r)
        return loop(r)  # to the end or --max-steps; False if it diverged
    except DataError as e:  # e.g. a shard that was truncated since it was made
        fail(str(e))
    except OSError as e:  # a full disk, a folder gone read-only: the files keep their last good version
        fail(f"{cfg['name']} stopped at a failed write ({e}); the run folder keeps its last good files")
    finally:
        for f in held:
            f.close()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, cuda = parse_args(argv)
    if args.print_grid:
        return print_grid(args)

    # every run of the grid is resolved (and so checked) before anything is written
    env = {"world_size": int(os.environ.get("WORLD_SIZE", 1))} if args.dry_run else init_distributed(cuda)
    tokenizer = {"gpt2": data.GPT2Tokenizer, "bytes": data.ByteTokenizer}[args.tokenizer]  # the class: no download
    task = SyntheticTask(args.max_gap, args.group, answers_only=bool(args.answers_only))
    vocab = padded_vocab_size((task if args.data == "synthetic" else tokenizer).vocab_size)
    runs = {}
    grid = itertools.product(args.residual, shapes_asked(args), args.lr or [None], args.seed)
    for residual, (key, value), lr, seed in grid:
        try:
            cfg = resolve(args, residual, key, value, lr, seed, vocab, env["world_size"])
        except ValueError as e:
            fail(str(e))
        runs.setdefault(cfg["name"], cfg)  # two ARs can solve to the same shape
    runs = list(runs.values())
    check_memory(runs, args, cuda)
    if args.data != "synthetic":
        on_rank0(lambda: prepare_data(args, runs[0]), env)

    env["resume"] = ("torchrun ... " if env["world_size"] > 1 else "python ") + shlex.join(
        ["train.py", *argv] + ([] if args.resume else ["--resume"]))
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    STOP.clear()
    try:
        diverged = [cfg["name"] for k, cfg in enumerate(runs) if not grid_run(args, cfg, env, f"[{k + 1}/{len(runs)}]")]
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    if len(runs) > 1:
        print0(f"\ngrid done: {len(runs)} runs, {len(diverged)} diverged {' '.join(diverged)}")
    if dist.is_initialized():
        dist.barrier()  # no rank tears gloo down while another still talks to it (that aborted rank 1 at exit)
        dist.destroy_process_group()
    sys.exit(1 if diverged else 0)


if __name__ == "__main__":
    main()
