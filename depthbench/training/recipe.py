"""
recipe.py: what train.py runs. The command line, the presets and suites it names, and the RunConfig each run of
the grid resolves to (every number of the run, as run.json and ckpt.pt record it: depthbench/files/runlog.py's
RunConfig); --print-grid.
docs/training.md describes the presets and suites.
"""
import argparse
import dataclasses
import functools
import re
from pathlib import Path

from depthbench.files import common
from depthbench.files.common import (ArgParser, check_options, comma_list, design_options, format_lr, json_object, positive)
from depthbench.training import schedules, telemetry, trackers
from depthbench.files.runlog import RunConfig  # what resolve makes, defined beside run.json's reader (no torch there)
from depthbench.training.costs import PLAN_BYTES, default_micro_batch, host_bytes, needs_recompute
from residuals import PAPER_DESIGNS, RESIDUALS
from shapes import SUITES, count_params, parse_count, solve, suite_row, suite_rows

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

# ----------------------------------------------------------------------------- resolving a run

def solve_shape(args, shape, vocab_size):
    """The model shape of (key, value) = shape (a suite row, or the solver's shape for --params/--fixed) ->
    (shape dict with its steps, the parameter budget, the run name's shape tag). ValueError: none."""
    key, value = shape
    tokens_per_step = args.global_batch * args.seq_len
    if args.suite:  # named by suite and depth: the ladder has one AR at several sizes
        row = suite_row(args.suite, key, value, vocab_size)
        budget = row["params"]
        if args.suite.endswith("backbone"):
            budget = row["backbone_params"]
        return row, budget, f"_{args.suite}-L{row['n_layer']}"
    preset = PRESETS[args.preset]
    budget = parse_count(args.params)
    row = solve(budget, **{key: value}, fixed=args.fixed, vocab=vocab_size, n_head=preset["n_head"])
    row["n_kv_head"] = row["n_head"]
    # 20 tokens per budgeted parameter, the same tokens for every design and shape of the budget
    row["steps"] = round(20 * budget / tokens_per_step)
    budget_tag = ""
    if args.fixed != preset["fixed"]:  # not the preset's
        budget_tag = f"_{args.fixed}"
    return row, budget, f"{budget_tag}_ar{round(row['d_model'] / row['n_layer'], 2):g}"


def micro_batch(args, cfg, params):
    """--batch-size; else for 400m the largest paper-like micro-batch that fits an 80 GB GPU, and for the small
    presets the whole global batch at once, split over the ranks. Gradient accumulation makes up the rest: the
    maths does not depend on it."""
    if args.batch_size:
        return args.batch_size
    if args.preset == "400m":
        return default_micro_batch(cfg, params) or 1
    return max(1, args.global_batch // cfg.world_size)


def resolve(args, residual, shape, lr=None, seed=42, *, vocab_size, world_size):
    """Everything one run of the grid needs -> RunConfig. shape = (key, value) as shapes_asked gives it; lr None:
    the suite's (1.6b) or the design's paper_lr. ValueError: a shape or option that cannot be."""
    row, budget, shape_tag = solve_shape(args, shape, vocab_size)
    L, d, n_head = row["n_layer"], row["d_model"], row["n_head"]
    if lr is None:
        lr = row.get("lr") or RESIDUALS[residual].paper_lr  # 1.6b: the suite's one LR
    steps = args.steps or row["steps"]
    opts = design_options(residual, args.residual_args)  # the design's constructor options (GPTConfig.residual_args)
    defaults = RESIDUALS[residual].options
    opts_tag = "".join(f"_{k}-{v}" for k, v in opts.items() if v != defaults[k])  # non-default options name the run
    # the design's own checks of its option values (a ValueError), on the meta device, before anything is written
    params = count_params(L, d, row["d_ff"], residual, vocab=vocab_size, n_head=n_head, n_kv_head=row["n_kv_head"],
                          **opts)
    tokens_per_step = args.global_batch * args.seq_len
    tokenizer = None if args.data == "synthetic" else args.tokenizer  # synthetic: none
    dtype = "bfloat16 autocast" if args.device.startswith("cuda") else "float32"
    asked = None  # the AR asked (--ar 9.1), beside the shape's own (9.78) in the figures
    if shape[0] == "ar":
        asked = shape[1]
    schedule_tag = ""
    if args.schedule != schedules.DEFAULT:  # another schedule: a run folder of its own
        schedule_tag = f"_{args.schedule}"
    cfg = RunConfig(
        name=f"{residual}{opts_tag}{shape_tag}{schedule_tag}_lr{format_lr(lr)}_s{seed}", preset=args.preset,
        suite=args.suite, residual=residual, residual_args=opts, n_layer=L, d_model=d, d_ff=row["d_ff"],
        n_head=n_head, n_kv_head=row["n_kv_head"], head_dim=d // n_head, ar=d / L, vocab_size=vocab_size,
        params_budget=budget, fixed=budget_counts(args), lr=lr, schedule=args.schedule, final_lr_frac=0.1,
        warmup_steps=round(0.1 * steps), total_steps=steps, max_steps=args.max_steps,
        weight_decay=args.weight_decay, betas=[0.9, 0.95], eps=1e-8, grad_clip=args.grad_clip, seed=seed,
        data=args.data, data_dir=args.data_dir, val_tokens=args.val_tokens, tokenizer=tokenizer,
        max_gap=args.max_gap, group=args.group,
        answers_only=bool(args.answers_only) and args.data == "synthetic", seq_len=args.seq_len,
        batch_size=args.batch_size, global_batch=args.global_batch, world_size=world_size, fsdp=args.fsdp,
        activation_checkpointing=args.activation_checkpointing, tokens_per_step=tokens_per_step,
        total_tokens=steps * tokens_per_step, eval_every=args.eval_every, eval_iters=args.eval_iters,
        ckpt_every=args.ckpt_every, log_every=args.log_every, out=args.out, device=args.device,
        compile=args.compile, compile_scope=args.compile_scope, kernels=args.kernels, dtype=dtype,
        stats_every=args.stats_every,
        log_to=args.log_to, ar_asked=asked)
    B = micro_batch(args, cfg, params)
    if args.global_batch % (B * world_size):
        raise ValueError(f"--global-batch {args.global_batch} is not a multiple of micro-batch {B} x world size "
                         f"{world_size}")
    cfg = dataclasses.replace(cfg, batch_size=B, grad_accum=args.global_batch // (B * world_size))
    return dataclasses.replace(cfg, residual_args=recompute_choice(args, cfg, params))


def recompute_choice(args, cfg, params):
    """The run's design options with HC/mHC's `recompute` (when it has one and --residual-args does not set it)
    following the memory plan: for the 400m preset's own micro-batch, on where it buys a larger one (the card's L70
    d640: 8 with it, 4 without; HC at L24: 8 either way, off); else on where the plan without it does not fit
    (costs.needs_recompute) the memory the run is planned for: an 80 GB GPU in bf16 (400m, a CUDA run), the host's in
    fp32 (a small preset on the CPU: a mini run fits, off). It names no run folder and is no part of a run's identity
    (runlog.MEMORY_OPTIONS): the losses are the same."""
    opts = cfg.residual_args
    if "recompute" not in opts or "recompute" in args.residual_args:
        return opts
    if args.preset == "400m" and not args.batch_size:
        without = dataclasses.replace(cfg, residual_args={**opts, "recompute": False})
        return {**opts, "recompute": micro_batch(args, without, params) < cfg.batch_size}
    on_gpu = args.preset == "400m" or cfg.device.startswith("cuda")
    limit = PLAN_BYTES if on_gpu else host_bytes()
    return {**opts, "recompute": needs_recompute(cfg, params, limit, bf16=on_gpu)}


def budget_counts(args):
    """What the run's params_budget counts: a *-backbone suite's the blocks, else --fixed."""
    if args.suite and args.suite.endswith("backbone"):
        return "backbone"
    return args.fixed


def shapes_asked(args):
    """(key, value) of each shape that --row, --layers and --ar ask for (only --print-grid takes more than one)."""
    return [(key, value) for key in ("row", "layers", "ar") for value in getattr(args, key) or []]


# ----------------------------------------------------------------------------- --print-grid

def grid_lrs(args, residual, suite_lr):
    """The LRs --print-grid lists for a design: --lr, else the suite's one LR (1.6b), else the design's sweep."""
    if args.lr:
        return args.lr
    if suite_lr:
        return [suite_lr]
    design = RESIDUALS[residual]
    return sorted({*design.paper_lr_sweep, design.paper_lr})


def print_grid(args):
    """--print-grid: the suite's runs at the paper's LRs (its sweep; 1.6b: one LR), one torchrun line each."""
    designs = args.residual or PAPER_DESIGNS    # the paper's ten unless named: the release's baselines on request
    rows = list(enumerate(suite_rows(args.suite)))
    try:
        picked = [suite_row(args.suite, key, value) for key, value in shapes_asked(args)]
    except ValueError as e:
        fail(str(e))
    rows = [(k, r) for k, r in rows if not picked or r in picked]
    suite_lr = rows[0][1]["lr"]                 # one LR for every design (1.6b), else each design's sweep
    lines = []
    for res in designs:
        for k, row in rows:
            if row["designs"] and res not in row["designs"]:
                continue  # a released-only shape (shapes.SUITES): only the designs the authors trained there
            for lr in grid_lrs(args, res, suite_lr):
                lines.append(f"torchrun --standalone --nproc_per_node=8 train.py --suite {args.suite} --row {k} "
                             f"--residual {res} --lr {format_lr(lr)}")
    lrs = "the LR sweep"
    if args.lr:
        lrs = "--lr"
    elif suite_lr:
        lrs = f"the suite's LR {format_lr(suite_lr)}"
    print(f"# suite {args.suite}: {len(designs)} design(s) x {len(rows)} row(s) x {lrs} = {len(lines)} runs")
    print("\n".join(lines))


# ----------------------------------------------------------------------------- command line

GRID_OPTIONS = ("--suite", "--preset", "--residual", "--row", "--layers", "--ar", "--lr")  # what --print-grid reads


MAX_COUNT = 10**9   # every count train.py takes (steps, batch, tokens, ...): 10^9, 30,000 x the paper's longest run
MAX_GPU_GB = 1024   # --gpu-mem: a terabyte, 5 x the largest GPU memory sold (192 GB)


def build_parser():
    p = ArgParser(prog="train.py", description="Train DepthBench models: one run, or a grid of comma-separated values.")
    add, pint = p.add_argument, positive(int, below=MAX_COUNT + 1, name="count from 1 to 10^9")
    # what to train (comma-separated values make a grid)
    add("--preset", choices=list(PRESETS), help="cpu (a lesson in minutes), mini (the one-machine suite's shapes: 4 "
        "heads, AR 100..4 at 0.8M) or 400m (the paper's recipe); default: 400m with CUDA, cpu without. Flags below "
        "marked (preset) default to the preset's value")
    add("--residual", type=comma_list(str),
        help=f"design(s): {', '.join(RESIDUALS)} (default preln; --print-grid: all)")
    add("--ar", type=comma_list(positive(float)),
        help="aspect ratio(s) d_model/n_layer (preset; 400m: 42.67 = L24 d1024)")
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
    add("--seed", type=comma_list(common.seed_number), default=[42],
        help="seed(s) of the init and the train data order (the paper's 42)")
    add("--residual-args", type=json_object, default={}, help="design options as JSON (each design's `options` in "
        "residuals.py), e.g. '{\"n_streams\": 2, \"init\": \"uniform\", \"n_groups\": 4, \"norm\": \"post\"}'; "
        "each design of a grid takes the keys it declares; non-default values join the run name")
    # data
    add("--data", help="synthetic | fineweb-edu | a .txt/.jsonl/.parquet file, folder or quoted glob (preset)")
    add("--data-dir", help="token shards of real data (default data_cache/<source>-<tokenizer>)")
    add("--tokenizer", choices=["gpt2", "bytes"], help="tokenizer of real data (default gpt2)")
    add("--val-tokens", type=pint, help="validation tokens of real data: whole documents first; a source with too "
        "few documents (one .txt file) gives its last N tokens (default: data.py's, printed)")
    add("--max-gap", type=pint, help="synthetic: the largest gap (compositions per answer; default 4)")
    add("--group", choices=["s3", "s4", "s5"], help="synthetic: the permutation group (preset: cpu/mini s3, else s4)")
    add("--answers-only", action=argparse.BooleanOptionalAction, help="synthetic: answers get their own ids and are "
        "the only targets (preset: on for cpu/mini); --no-answers-only trains on every token")
    add("--seq-len", type=pint, help="tokens per sequence (preset: 2048, cpu/mini 128)")
    # batch and schedule
    add("--global-batch", type=pint, help="sequences per optimizer step, all ranks together (preset: 512, cpu/mini 32)")
    add("--batch-size", type=pint, help="micro-batch per rank (preset: the largest power of two up to the design's "
        "most_micro_batch whose memory plan fits an 80 GB GPU; cpu/mini: global batch / ranks)")
    add("--steps", type=pint, help="length of the LR schedule (preset: the suite's, 400m 7,600; with --params 20 "
        "tokens per budgeted param; cpu 800, mini 1200)")
    add("--schedule", default=schedules.DEFAULT, choices=list(schedules.SCHEDULES), help="the LR schedule, "
        "depthbench/training/schedules.py: " + "; ".join(f"{k}: {schedules.summary(k)}" for k in schedules.SCHEDULES)
        + f" (default {schedules.DEFAULT}; another one joins the run name)")
    add("--max-steps", type=pint, help="stop after this many steps, schedule unchanged (--resume continues)")
    add("--weight-decay", type=positive(float, zero=True), default=0.1, help="AdamW weight decay (a design's static "
        "params get 0)")
    add("--grad-clip", type=positive(float, zero=True), default=1.0, help="clip the global grad norm to this (0: off)")
    # evaluation, logging, checkpoints
    add("--eval-every", type=pint, help="evaluate every this many steps and at the end (preset: 250, cpu/mini 200)")
    add("--eval-iters", type=pint, help="global batches of validation data per eval, the same ones each time (preset)")
    add("--ckpt-every", type=pint, help="write ckpt.pt every this many steps and at the end (preset)")
    add("--log-every", type=pint, help="print a training line every this many steps; run.json keeps all (preset)")
    add("--out", default="runs", help="root folder of the run folders (not a run folder itself: refused)")
    add("--resume", action="store_true", help="continue each run from its ckpt.pt (if it has one)")
    # system
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile the model (default: on with CUDA, "
        "off on CPU, where it pays only after thousands of steps: docs/speed.md)")
    add("--compile-scope", choices=["blocks", "model"], default="blocks", help="blocks: compile each block on its "
        "own, every block reusing one graph, so compile time stays flat in depth; model: the whole forward as one "
        "graph, compile time growing with depth (docs/speed.md#compile)")
    add("--activation-checkpointing", action="store_true", help="keep only each block's input for the backward, "
        "which recomputes the block: about a third more compute for most of the activation memory")
    add("--fsdp", action="store_true", help="under torchrun: shard weights, gradients and AdamW state over the ranks "
        "(FSDP2: each block, then the root) instead of a DDP replica on each")
    add("--dry-run", action="store_true", help="print each run's memory plan per GPU and exit: 0 if it fits, 2 with "
        "one line naming the fix if not (for the ranks of torchrun, or of WORLD_SIZE if set)")
    add("--gpu-mem", type=positive(float, below=MAX_GPU_GB + 1, name=f"GB per GPU, at most {MAX_GPU_GB:,},"), help="--dry-run: GB per GPU to plan for (default: this GPU's memory; "
        "without one, the host's, in fp32)")
    telemetry.add_flags(p)
    p.add_kernels()
    return p


def parse_args(argv=None):
    """The command line with every preset and suite default filled in -> (args, cuda); bad input exits 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = parser.given(args)  # the options the command line set, before presets fill the rest in
    try:
        cuda = common.pick_device(args.device) == "cuda"
    except ValueError as e:
        parser.error(str(e))
    if args.suite and args.preset in ("cpu", "mini"):
        parser.error(f"--suite runs the paper's recipe: it cannot be combined with --preset {args.preset}")
    if args.suite and (args.params or args.fixed):
        parser.error("--suite fixes the shapes: give --params/--fixed without --suite")
    if not args.preset:
        args.preset = "cpu"
        if cuda or args.suite:
            args.preset = "400m"
    if args.preset == "400m" and not (args.params or args.fixed):
        args.suite = args.suite or "400m"
    bad = [r for r in args.residual or [] if r not in RESIDUALS]
    if bad:
        parser.error(f"unknown residual {bad[0]!r}; choose from {', '.join(RESIDUALS)}")
    if args.print_grid:
        if not args.suite:
            parser.error("--print-grid needs --suite (or --preset 400m)")
        parser.refuse_beside(given, "--print-grid", GRID_OPTIONS)
        return args, cuda
    args.residual = args.residual or ["preln"]
    fill_shape(parser, args)
    for key, value in PRESETS[args.preset].items():
        if key not in ("ar", "layers") and getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.compile is None:
        args.compile = cuda  # on CPU compile pays only after thousands of steps (docs/speed.md)
    args.device = "cpu"
    if cuda:
        args.device = "cuda"
    check_applies(parser, args, given)
    check_run_args(parser, args)
    return args, cuda


def fill_shape(parser, args):
    """One of --ar, --layers and --row, else the preset's shape."""
    if sum(x is not None for x in (args.ar, args.layers, args.row)) > 1:
        parser.error("give one of --ar, --layers and --row")
    if args.row is not None and not args.suite:
        parser.error("--row picks a row of a --suite")
    if args.ar is None and args.layers is None and args.row is None:
        if args.suite and args.suite != "400m":
            parser.error(f"--suite {args.suite}: pick rows with --row, --layers or --ar "
                         f"(shapes.py --suite {args.suite})")
        args.ar, args.layers = PRESETS[args.preset].get("ar"), PRESETS[args.preset].get("layers")


def check_applies(parser, args, given):
    """Every option the command line set applies to the run, or one line and exit 2: the synthetic task's options
    with real data, real data's with the synthetic task, --gpu-mem without --dry-run, --compile-scope without
    compiling. Then the defaults that depend on the data: --max-gap 4, --tokenizer gpt2."""
    synthetic = args.data == "synthetic"
    if synthetic:
        unused = [o for o in ("--tokenizer", "--data-dir", "--val-tokens") if o in given]
        why = "the synthetic task"
    else:
        unused = [o for o in ("--max-gap", "--group", "--answers-only") if o in given]
        why = f"real data (--data {args.data})"
    if unused:
        parser.error(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to {why}")
    if "--gpu-mem" in given and not args.dry_run:
        parser.error("--gpu-mem is what --dry-run plans for: give it with --dry-run")
    if "--compile-scope" in given and not args.compile:
        parser.error("--compile-scope applies to a compiled run: give it with --compile (off by default on CPU)")
    if args.max_gap is None:
        args.max_gap = 4
    if args.tokenizer is None:
        args.tokenizer = "gpt2"


def check_run_args(parser, args):
    """The data settings, design options and budget of a run (not --print-grid), checked; --data-dir filled in."""
    if args.data == "synthetic" and args.max_gap + 3 > args.seq_len:
        parser.error(f"--max-gap {args.max_gap} with --seq-len {args.seq_len}: a sequence could hold no answer (the "
                     f"first one comes after up to max gap + 3 tokens); lower --max-gap or raise --seq-len")
    if args.data == "synthetic":
        args.data_dir = None
    elif args.data_dir is None:
        slug = re.sub(r"[^A-Za-z0-9-]+", "_", args.data).strip("_")[-40:]  # data/austen -> data_austen
        args.data_dir = f"data_cache/{slug}-{args.tokenizer}"
    try:
        check_options(args.residual, args.residual_args)
    except ValueError as e:
        parser.error(f"--residual-args: {e}")
    missing = trackers.missing(args.log_to)  # an optional package (--log-to): one line before training
    if missing:
        parser.error(missing)
    try:
        parse_count(args.params)  # a count from 1 to shapes.MAX_PARAMS
    except ValueError as e:  # not an assert: python -O would skip it
        parser.error(str(e))
    held = [name for name in ("run.json", "ckpt.pt") if (Path(args.out) / name).exists()]
    if held:  # the runs would nest inside another run's folder
        parser.error(f"--out {args.out} is a run folder (it holds {held[0]}); --out is the folder the run folders go "
                     f"in: give its parent, {Path(args.out).parent}")
