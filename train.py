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

What to run is decided in depthbench/training/: recipe.py (the command line -> one RunConfig per run), costs.py (what
it costs), distributed.py (the torchrun ranks and FSDP2 state); this file builds a run (Run), trains, evaluates, saves.
"""
import dataclasses
import itertools
import math
import resource
import shlex
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from depthbench.files import common  # first, before torch: its excepthook makes a Ctrl-C during the imports one line
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import profile_gpu
from depthbench.training import costs, progress, schedules, stopping, telemetry
from depthbench.files import checkpoints, runlog
from depthbench.files.common import format_lr, print0, versions, write_json
from depthbench.training.costs import GB, check_memory, memory_plan
from data import BatchLoader, DataError, padded_vocab_size
from depthbench.training.distributed import Ranks, full_state, init_distributed, load_full_state, on_rank0, shard
from depthbench.training.compiled import compile_model
from model import GPT, GPTConfig
from depthbench.training.recipe import RunConfig, fail, parse_args, print_grid, resolve, shapes_asked
from shapes import backbone_params, preln_params
from depthbench.evaluation.synthetic import SyntheticTask, answer_metrics, verdict

SCHEMA = runlog.SCHEMA  # run.json's: depthbench/files/runlog.py reads it back by type
FINAL = ("val_loss", "answer_loss", "answer_acc")  # run.json's "final": the last eval's; null before one, if diverged


# ----------------------------------------------------------------------------- one training step, one evaluation

def forward_backward(model, loader, autocast=nullcontext(), device="cpu", after_micro=None):
    """Gradients of one optimizer step: loader.accum_steps micro-batches of equal size, each loss the mean over
    its tokens, divided by their number, so the summed gradient is the mean over the whole batch (DDP then
    averages the ranks' equal shares). Under DDP only the last micro-step all-reduces (no_sync on the others).
    after_micro(done), called after each micro-batch and before the first (done 0: a signal pending then never
    starts the step, nor a first compile), says whether to stop there: the step is then cut short and None returned
    (its gradients partial: the caller drops them)."""
    accum = loader.accum_steps
    ddp = isinstance(model, DDP)
    total = torch.zeros((), device=device)
    if after_micro is not None and after_micro(0):
        return None
    for micro in range(accum):
        x, y, _ = loader.next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with model.no_sync() if ddp and micro < accum - 1 else nullcontext():
            with autocast:
                _, loss = model(x, y, logits=False)      # the loss without the full (B, T, V) logits
            (loss / accum).backward()
        total += loss.detach()
        if after_micro is not None and after_micro(micro + 1):
            return None
    return total / accum


@torch.no_grad()
def evaluate(model, loader, iters, *, autocast, device, max_gap, stop=None):
    """Mean token CE over `iters` fixed global batches of validation data, and for the synthetic task the
    answer-only loss/accuracy overall and per level. Sums are all-reduced, so every rank gets the same. stop(),
    asked before each micro-batch (a signal pending never starts one, nor the first eval's compile), cuts the
    evaluation short when true (every rank alike): None then."""
    model.eval()
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # summed CE, tokens (fp64: exact counts past 2^24)
    answers = torch.zeros(max_gap, 3, device=device)      # per level: summed CE, correct, count
    for it in range(iters):
        for micro in range(loader.accum_steps):
            if stop is not None and stop():
                model.train()
                return None
            x, y, level = loader.get_batch(it, micro)
            x, y = x.to(device), y.to(device)
            with autocast:
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
        total = answers.sum(0)
        out["answer_loss"], out["answer_acc"] = (total[0] / total[2]).item(), (total[1] / total[2]).item()
        per_level = {}
        for g, (loss_sum, correct, count) in enumerate(answers.tolist()):
            if count > 0:
                per_level[str(g + 1)] = {"loss": loss_sum / count, "acc": correct / count}
        out["per_level"] = per_level
    return out


def finite_or_none(x):
    return x if math.isfinite(x) else None  # JSON has no NaN; null marks a non-finite value


# ----------------------------------------------------------------------------- one run: its state, built in one place

@dataclass
class Run:
    """One run's live state, built complete by build(): what the loop and what it calls read and advance."""
    cfg: RunConfig              # what to run (recipe.resolve)
    ranks: Ranks                # this process among torchrun's
    folder: Path                # the run folder: run.json and ckpt.pt
    resume_cmd: str             # the command line that resumes this job, for the message after a signal
    task: SyntheticTask         # the synthetic task, None for real data
    train_loader: BatchLoader   # the train split, where the last step left it
    val_loader: BatchLoader     # the same validation batches at every eval
    model_config: GPTConfig     # what ckpt.pt records to rebuild the model
    model: GPT                  # the plain module: what ckpt.pt saves (no DDP/compile prefixes); FSDP2-sharded if fsdp
    param_shapes: dict          # FSDP2: each parameter's shape before sharding (ckpt.pt keeps those); None without
    optimizer: torch.optim.Optimizer  # AdamW over model.param_groups
    compiled: torch.nn.Module   # what compile_model returned, or model itself (--no-compile)
    trained: torch.nn.Module    # what the training step calls: DDP(compiled) under torchrun without FSDP, else compiled
    autocast: object            # bf16 autocast on CUDA; a null context on CPU (fp32)
    log: dict                   # run.json: config, params, steps, evals, final, flags, wall time, memory peak
    step: int                   # optimizer steps taken (a resumed run's included)
    saved_step: int             # the step ckpt.pt holds (here or on disk)
    stop: int                   # the step to stop at: total_steps, or --max-steps
    preln_params: int           # a Pre-LN model's parameters at this shape: the design's extra is the difference
    flops_per_token: float      # analytic training FLOPs per token (costs.analytic), for MFU
    peak_flops: float           # the device's peak FLOP/s (None: an unknown GPU)
    wall_before: float          # seconds trained in earlier sessions of the run (a resumed one)
    t_start: float              # time.time() when this session's run was built
    watch: telemetry.Watch      # depth telemetry at each eval (run.json "telemetry") and the --log-to tracker
    meter: progress.StepMeter = None  # the micro-batches of the step in progress, counted and shown (loop sets it)

    @property
    def json_path(self):
        return self.folder / "run.json"

    @property
    def ckpt_path(self):
        return self.folder / "ckpt.pt"

    @property
    def cuda(self):
        return self.ranks.device.startswith("cuda")

    @property
    def fsdp(self):
        return self.param_shapes is not None

    @property
    def span(self):
        """What the LR schedule reads (depthbench/training/schedules.py)."""
        cfg = self.cfg
        return schedules.Span(peak=cfg.lr, warmup=cfg.warmup_steps, total=cfg.total_steps,
                              final_frac=cfg.final_lr_frac)


def make_loaders(cfg, ranks):
    """(task or None, train loader, val loader): both cut each global batch the same way, whatever the number of
    ranks (data.py)."""
    task = None
    source = cfg.data_dir
    if cfg.data == "synthetic":
        task = SyntheticTask(cfg.max_gap, cfg.group, cfg.answers_only)
        source = task
    val_seed = common.VAL_SEED if task else cfg.seed
    shape = dict(batch_size=cfg.batch_size, seq_len=cfg.seq_len, global_batch=cfg.global_batch, rank=ranks.rank,
                 world_size=ranks.world_size)
    train_loader = BatchLoader(source, "train", **shape, seed=cfg.seed)
    val_loader = BatchLoader(source, "val", **shape, seed=val_seed)
    return task, train_loader, val_loader


def make_model(cfg, ranks):
    """(model config, model, its shapes before FSDP2 or None, AdamW), the model built and initialised on the
    run's device at the run's seed."""
    torch.manual_seed(cfg.seed)
    arch = ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "residual", "kernels")
    model_config = GPTConfig(**{k: getattr(cfg, k) for k in arch}, residual_args=dict(cfg.residual_args),
                             checkpoint_blocks=cfg.activation_checkpointing)
    with torch.device(ranks.device):  # built and initialised there: no CPU init and copy per rank (CUDA: its own RNG)
        model = GPT(model_config)
    fsdp = ranks.ddp and cfg.fsdp
    param_shapes = shard(model) if fsdp else None
    cuda = ranks.device.startswith("cuda")
    # each group may carry its own weight_decay, eps and lr_scale (a multiplier of the schedule's LR)
    groups = model.param_groups(cfg.weight_decay, eps=cfg.eps)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=cuda and not fsdp)
    return model_config, model, param_shapes, optimizer


def new_log(cfg, model, ranks):
    """run.json of a run before its first step."""
    heads = (cfg.n_kv_head, cfg.n_head)
    total = model.num_params()
    preln = preln_params(cfg.n_layer, cfg.d_model, cfg.d_ff, cfg.vocab_size, *heads)
    params = {"total": total, "backbone": backbone_params(cfg.n_layer, cfg.d_model, cfg.d_ff, *heads),
              "residual_extra": total - preln}
    return {"schema": SCHEMA, "config": dataclasses.asdict(cfg), "params": params, "steps": [], "evals": [],
            "final": dict.fromkeys(FINAL), "diverged": False, "finished": False, "wall_s": 0.0, "peak_mem_bytes": 0,
            "device": ranks.device_name, "versions": versions()}


def wrapped(model, cfg, ranks):
    """(compiled, trained): torch.compile'd or not, then DDP under torchrun (not FSDP2: sharded already)."""
    compiled = compile_model(model, cfg.compile_scope) if cfg.compile else model
    if not ranks.ddp or cfg.fsdp:
        return compiled, compiled
    cuda = ranks.device.startswith("cuda")
    return compiled, DDP(compiled, device_ids=[ranks.local_rank] if cuda else None)


def build(cfg, ranks, resume, resume_cmd):
    """Loaders, model, optimizer, log and clocks of one run, from its ckpt.pt with --resume -> Run."""
    folder = Path(cfg.out) / cfg.name
    print0(f"building   the data loaders, the model and its optimizer on {ranks.device}")
    task, train_loader, val_loader = make_loaders(cfg, ranks)
    model_config, model, param_shapes, optimizer = make_model(cfg, ranks)
    log = new_log(cfg, model, ranks)
    # MFU: the analytic training FLOPs per token over the device's peak
    peak = profile_gpu.device_peak(torch.device(ranks.device))
    flops = costs.analytic(cfg.residual, n_layer=cfg.n_layer, d_model=cfg.d_model, d_ff=cfg.d_ff, seq=cfg.seq_len,
                           vocab=cfg.vocab_size, params=log["params"]["total"], batch=cfg.batch_size, elem_bytes=4,
                           options=cfg.residual_args, kv_ratio=cfg.n_kv_head / cfg.n_head)
    step = 0
    if resume and (folder / "ckpt.pt").exists():
        ckpt = read_checkpoint(folder / "ckpt.pt", cfg, model, param_shapes)
        step = restore(ckpt, model=model, optimizer=optimizer, sharded=param_shapes is not None, loader=train_loader,
                       log=log)
        print0(f"resumed from {folder / 'ckpt.pt'} at step {step}")
    else:
        if resume:
            print0("--resume, but no ckpt.pt in the run folder yet: starting from step 0")
        if ranks.master:
            (folder / "ckpt.pt").unlink(missing_ok=True)  # starting over: a stale checkpoint must not survive
    compiled, trained = wrapped(model, cfg, ranks)
    autocast = nullcontext()  # CPU stays fp32
    if ranks.device.startswith("cuda"):
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
        torch.cuda.reset_peak_memory_stats(ranks.device)
    watch = telemetry.Watch.start(model, optimizer, loader=val_loader, log=log, cfg=cfg, step=step)
    return Run(cfg=cfg, ranks=ranks, folder=folder, resume_cmd=resume_cmd, task=task, train_loader=train_loader,
               val_loader=val_loader, model_config=model_config, model=model, param_shapes=param_shapes,
               optimizer=optimizer, compiled=compiled, trained=trained, autocast=autocast, log=log, step=step,
               saved_step=step, stop=min(cfg.total_steps, cfg.max_steps or cfg.total_steps),
               preln_params=log["params"]["total"] - log["params"]["residual_extra"],
               flops_per_token=flops["train_flops_per_token"], peak_flops=peak, wall_before=log["wall_s"],
               t_start=time.time(), watch=watch)


def read_checkpoint(path, cfg, model, param_shapes=None):
    """ckpt.pt if made with `cfg`'s identity settings (runlog.py; the precision may change), read by type
    (checkpoints.read_checkpoint), holding `model`'s weights (param_shapes: their shapes before FSDP2), at a step that
    --max-steps has not passed; else (a broken file, another run's or another design's checkpoint) one line, exit 2."""
    try:
        ckpt = checkpoints.read_checkpoint(path, ["model", "config", "step", "optimizer", "rng", "loader", "log"])
        old = RunConfig.from_dict(ckpt["config"], where=path)  # from any version of train.py, read by type
    except ValueError as e:  # a CheckpointError or a RunLogError: one line
        fail(f"cannot resume: {e}")
    changed = old.identity_changes(cfg, done=False)
    if changed:
        fail(f"cannot resume {path}: it was made with other settings ({old.describe_changes(cfg, changed)}); use "
             f"another --out")
    try:
        checkpoints.check_state_dict(ckpt["model"], model, path, shapes=param_shapes)  # the weights of its config's design
    except ValueError as e:
        fail(f"cannot resume: {e}")
    if cfg.max_steps is not None and cfg.max_steps < ckpt["step"]:
        fail(f"cannot resume {path} with --max-steps {cfg.max_steps}: the run is at step {ckpt['step']} already "
             f"(give --max-steps {ckpt['step']} or more, or leave it out)")
    switched = [k for k in old.identity_changes(cfg) if k not in changed]
    if switched:
        print0(f"resuming with another precision: {old.describe_changes(cfg, switched)}")
    return ckpt


def restore(ckpt, *, model, optimizer, sharded, loader, log):
    """Weights, optimizer, loader, RNG and log (steps, evals, clocks) from a checkpoint -> its step."""
    load_full_state(model, optimizer, (ckpt["model"], ckpt["optimizer"]), sharded)
    loader.load_state_dict(ckpt["loader"])
    torch.set_rng_state(ckpt["rng"]["cpu"])
    device = next(model.parameters()).device
    if device.type == "cuda" and "cuda" in ckpt["rng"]:
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
    saved = ckpt["log"]
    log.update(steps=saved["steps"], evals=saved["evals"], wall_s=saved["wall_s"],
               peak_mem_bytes=saved["peak_mem_bytes"])
    if saved.get("telemetry"):
        log["telemetry"] = saved["telemetry"]  # earlier records; the tracker continues after this step
    return ckpt["step"]


# ----------------------------------------------------------------------------- describing a run

def describe(run):
    """Every derived number, before the first step."""
    cfg, params = run.cfg, run.log["params"]
    B, T, G = cfg.batch_size, cfg.seq_len, cfg.global_batch
    print0(f"run        {cfg.name}  ->  {run.folder}")
    heads_note = ""
    if cfg.n_head != 16:
        heads_note = f"  ({cfg.n_head} heads, not the paper's 16)"
    print0(f"shape      L={cfg.n_layer} d={cfg.d_model} d_ff={cfg.d_ff} heads={cfg.n_head} "
           f"kv_heads={cfg.n_kv_head} head_dim={cfg.head_dim} AR={cfg.ar:.2f}{heads_note}")
    print0(f"params     total {params['total']:,} = backbone {params['backbone']:,} + embedding/head/final norm "
           f"{run.preln_params - params['backbone']:,} + design extra {params['residual_extra']:,}  "
           f"(budget {cfg.params_budget:,} {cfg.fixed}; vocab {cfg.vocab_size})")
    describe_data(run)
    print0(f"batch      {G} seqs x {T} tokens = {cfg.tokens_per_step:,} tokens/step = micro-batch {B} "
           f"x world {run.ranks.world_size} x grad accum {run.train_loader.accum_steps}")
    stopping = ""
    if run.stop < cfg.total_steps:
        stopping = f"; stopping at step {run.stop} (--max-steps)"
    print0(f"schedule   {cfg.total_steps:,} steps = {cfg.total_tokens:,} tokens "
           f"({cfg.total_tokens / params['total']:.1f} per param), warmup {cfg.warmup_steps}, "
           f"peak lr {cfg.lr:g} -> {cfg.lr * cfg.final_lr_frac:g}, {cfg.schedule}: {schedules.summary(cfg.schedule)}"
           f"{stopping}")
    groups = run.optimizer.param_groups
    n_static = sum(p.numel() for g in groups if g["weight_decay"] == 0.0 for p in g["params"])
    print0(f"optimizer  AdamW betas {tuple(cfg.betas)} eps {cfg.eps:g} wd {cfg.weight_decay:g} "
           f"({n_static:,} design params without decay), clip {cfg.grad_clip:g}")
    print0(f"eval       every {cfg.eval_every} steps on {cfg.eval_iters} global batches "
           f"({cfg.eval_iters * cfg.tokens_per_step:,} val tokens); ckpt every {cfg.ckpt_every} steps")
    describe_device(run)


def describe_data(run):
    """The data line: the synthetic task's facts, or the shards of real data."""
    cfg, task = run.cfg, run.task
    if task is None:
        print0(f"data       {cfg.data} ({cfg.tokenizer}) shards in {cfg.data_dir}")
        return
    floor = "answers are the only targets"
    if not task.answers_only:
        floor = f"loss floor {task.loss_floor(cfg.seq_len):.4f} nats/token at T={cfg.seq_len} (answers alone: 0)"
    print0(f"data       synthetic {task.group.upper()} running products, max gap {cfg.max_gap}, vocab "
           f"{task.vocab_size} (padded to {cfg.vocab_size}); {floor}; chance answer accuracy {1 / task.eq:.1%}")


def engine_name(run):
    """How the ranks share the work, for the device line."""
    if run.fsdp:
        return " (FSDP2)"
    if run.ranks.ddp:
        return " (DDP)"
    if run.cfg.fsdp:
        return " (--fsdp: nothing to shard)"
    return ""


def describe_device(run):
    """The device and memory lines: threads, precision, compile, kernels, the engine, MFU's peak, the plan."""
    cfg, cuda = run.cfg, run.cuda
    threads = ""
    if not cuda:
        threads = f" (threads: {torch.get_num_threads()}; on busy cores OMP_NUM_THREADS=1 can be faster)"
    recompute = costs.memory_savers(cfg)  # checkpointing, HC/mHC's recompute (on where the memory plan needs it)
    peak = "? (unknown GPU)"
    if run.peak_flops:
        source = "bf16 table" if cuda else "measured fp32 matmul"
        peak = f"{run.peak_flops / 1e12:.3g} TFLOP/s ({source})"
    compiled = f"on ({cfg.compile_scope or 'blocks'})" if cfg.compile else "off"
    print0(f"device     {run.ranks.device_name}{threads}, {cfg.dtype}, compile {compiled}"
           f", {cfg.kernels} kernels, world size {run.ranks.world_size}{engine_name(run)}{recompute}"
           f"; MFU from {run.flops_per_token:.3g} FLOPs/token and a peak of {peak}")
    plan = memory_plan(cfg, run.log["params"]["total"], cuda)["total"]
    where = "process"
    if cuda:
        where = f"GPU of {torch.cuda.get_device_properties(run.ranks.device).total_memory / GB:.1f} GB"
    print0(f"memory     planned {plan / GB:.1f} GB per {where} (an estimate; --dry-run shows its parts)")


# ----------------------------------------------------------------------------- the loop

def loop(run):
    """Evaluate, checkpoint and take optimizer steps until the stop step; False if the run diverged. Asked to stop
    (SIGINT/SIGTERM), it stops at the next micro-batch boundary (depthbench/training/stopping.py): a step cut short is
    dropped, the last completed step's ckpt.pt is on disk (saved then if it was not), run.json says stopped and why, and
    it exits with 128 + the signal's number. The telemetry watch (its optimizer hooks, its tracker) and the progress
    line are closed however the loop ends."""
    run.meter = progress.StepMeter(accum=run.train_loader.accum_steps, master=run.ranks.master,
                                   compile_scope=run.cfg.compile and run.cfg.compile_scope)
    try:
        return train_until_stop(run)
    finally:
        run.meter.end()
        run.watch.close()


def train_until_stop(run):
    """The loop itself (loop's docstring)."""
    cfg, log = run.cfg, run.log
    step_start = run.step
    while True:
        last = run.step >= run.stop
        evaluated = maybe_evaluate(run, last)  # False: a signal cut it short, so the run is not finished
        stop = STOP.agreed(run.ranks)
        maybe_save(run, last and evaluated, stop)
        if stop:
            run.log["stopped"] = STOP.record(stop, run.step)  # why and where (depthbench/training/stopping.py)
            save_json(run)
            stopping.exit_after_save(run, stop)
        if last:
            break
        stats = optimizer_step(run)
        if stats is None:  # a signal cut the step short: dropped; the loop's next turn saves and stops
            continue
        loss, grad_norm, lr, dt = stats
        run.watch.after_step(log["steps"][-1])
        step = run.step
        if step in (1, step_start + 1) or step % cfg.log_every == 0 or step == run.stop or log["diverged"]:
            progress.print_step(run, (loss, grad_norm, lr, dt), step_start)
        if log["diverged"]:
            log["final"] = dict.fromkeys(FINAL)
            save_json(run)
            # the one line of a diverged run, on stderr; the grid goes on with the next run
            print0(f"train.py: error: {cfg.name} diverged at step {step} (loss {loss}, grad norm {grad_norm}); "
                   f"see {run.json_path}", file=sys.stderr)
            return False
    stopped = ""
    if not log["finished"]:
        stopped = f" (stopped by --max-steps; --resume continues to step {cfg.total_steps})"
    print0(f"done: {cfg.name} at step {run.step} in {log['wall_s']:.1f} s{stopped}")
    if run.task and log["evals"]:
        print0(verdict(log["evals"][-1]["per_level"], 1 / run.task.eq, cfg.n_layer))
    return True


def optimizer_step(run):
    """One optimizer step at the schedule's LR (times each param group's lr_scale, 1 when it has none), logged;
    a non-finite loss or gradient norm marks the run diverged and skips the update. -> (loss, grad norm, lr,
    seconds), or None when a signal cut the step short (dropped: stopping.drop_step)."""
    cfg, t0 = run.cfg, time.time()
    lr = schedules.lr_at(cfg.schedule, run.step, run.span)
    for g in run.optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    begun = {"loader": run.train_loader.state_dict(), "rng": rng_state(run)}  # where a dropped step goes back to
    run.meter.begin(run.step + 1)
    loss = forward_backward(run.trained, run.train_loader, run.autocast, run.ranks.device,
                            after_micro=lambda done: stopping.after_micro_batch(run, done))
    run.meter.end()
    if loss is None:
        return stopping.drop_step(run, begun)
    if run.ranks.ddp:
        dist.all_reduce(loss)  # for the log only (the gradients are already averaged); gloo has no AVG
        loss /= run.ranks.world_size
    clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
    if run.fsdp:
        grad_norm = grad_norm.full_tensor()  # a DTensor
    grad_norm = grad_norm.item()
    loss = loss.item()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        run.log["diverged"] = True  # stop before this update makes the weights non-finite too
    else:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    dt = time.time() - t0
    run.step += 1
    run.log["steps"].append({"step": run.step, "tokens": run.step * cfg.tokens_per_step,
                             "loss": finite_or_none(loss), "lr": lr, "grad_norm": finite_or_none(grad_norm),
                             "tok_per_s": cfg.tokens_per_step / dt})
    return loss, grad_norm, lr, dt


def maybe_evaluate(run, last):
    """Evaluate at every eval_every-th step and the last one (once: a resumed run's last step may have been). False
    when a signal cut the evaluation short (at a micro-batch, like a step): the step's eval is left to --resume."""
    cfg, log, step = run.cfg, run.log, run.step
    evaluated = log["evals"] and log["evals"][-1]["step"] == step
    if step > 0 and (step % cfg.eval_every == 0 or last) and not evaluated:
        ev = evaluate(run.compiled, run.val_loader, cfg.eval_iters, autocast=run.autocast, device=run.ranks.device,
                      max_gap=cfg.max_gap, stop=lambda: STOP.agreed(run.ranks) != 0)
        if ev is None:
            print0(f"eval step {step} cut short by a signal: --resume evaluates it")
            return False
        log["evals"].append({"step": step, "tokens": step * cfg.tokens_per_step, **ev})
        run.watch.at_eval(step, ev)
        log["final"] = {k: ev[k] for k in FINAL}
        levels = ""
        if ev["per_level"] is not None:
            by_gap = " ".join(f"{g}: {m['acc']:.0%}" for g, m in ev["per_level"].items())
            levels = f" | answers loss {ev['answer_loss']:.4f} acc {ev['answer_acc']:.1%} | by gap {by_gap}"
        print0(f"eval step {step} | val loss {ev['val_loss']:.4f}" + levels)
        save_json(run)
    return True


def maybe_save(run, last, force=False):
    """ckpt.pt at every ckpt_every-th step, the last one and when asked to stop, then run.json: run.json says
    finished only once the final ckpt.pt is on disk, so a kill between the two leaves a run that --resume ends.
    Both atomic, written by rank 0."""
    step = run.step
    due = step > 0 and (step % run.cfg.ckpt_every == 0 or last or force) and step != run.saved_step
    if due:
        save_json(run, write=False)  # this step's wall time into the log the checkpoint carries
        model, optimizer = full_state(run.model, run.optimizer, run.param_shapes)  # FSDP: every rank calls it
        if run.ranks.master:
            common.save_checkpoint(run.ckpt_path, {
                "model": model, "model_config": dataclasses.asdict(run.model_config),
                "config": dataclasses.asdict(run.cfg), "step": step, "optimizer": optimizer, "rng": rng_state(run),
                "loader": run.train_loader.state_dict(), "log": run.log})
        run.saved_step = step
    if due or last:
        run.log["finished"] = last and step >= run.cfg.total_steps
        save_json(run)


def save_json(run, write=True):
    """run.json with the wall time and memory peak so far (rank 0); write=False updates them in the log only."""
    log = run.log
    log["wall_s"] = run.wall_before + time.time() - run.t_start
    if run.cuda:
        peak = torch.cuda.max_memory_allocated(run.ranks.device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    log["peak_mem_bytes"] = max(log["peak_mem_bytes"], peak)
    if run.ranks.master and write:
        write_json(run.json_path, log)


STOP = stopping.STOP  # SIGINT/SIGTERM: the loop stops at the next micro-batch boundary (depthbench/training/stopping.py)


def rng_state(run):
    """The RNG states a checkpoint keeps (restore sets them back)."""
    rng = {"cpu": torch.get_rng_state()}
    if run.cuda:
        rng["cuda"] = torch.cuda.get_rng_state(run.ranks.device)
    return rng


# ----------------------------------------------------------------------------- setup and the grid

def prepare_data(args, cfg):
    """Token shards of a real source, written by rank 0. data.py reuses shards whose settings match; for
    fineweb-edu, shards made earlier (say by data.py) with the same tokenizer are used as they are. Make
    fineweb-edu's shards before a torchrun job: tokenizing 8B tokens takes hours, and the other ranks wait
    for rank 0 in a collective whose timeout (10 min for NCCL) is much shorter."""
    if args.data != "fineweb-edu":
        return data.prepare(args.data, args.data_dir, args.tokenizer, val_tokens=args.val_tokens)
    meta, need = data.load_meta(args.data_dir), cfg.total_tokens + 1
    if meta and (meta["config"]["source"], meta["config"]["tokenizer"]) == ("fineweb-edu", args.tokenizer):
        have = meta["n_tokens"] - sum(s["tokens"] for s in meta["shards"]["val"])
        print(f"using the fineweb-edu shards in {args.data_dir}: {have:,} train tokens, the schedule reads {need:,}"
              + (" (so some data repeats)" if have < need else ""))
    else:  # what the schedule reads, plus the validation tokens (data.py's default for fineweb-edu: 10M)
        val = args.val_tokens or 10_000_000
        data.prepare("fineweb-edu", args.data_dir, args.tokenizer, val_tokens=args.val_tokens, max_tokens=need + val)


def claim(path, held, resume, cfg):
    """Rank 0, before a run: lock its folder (into `held`; one writer at a time) and check it can be written, remove
    temp files of a writer killed mid-save; with --resume, a damaged run.json beside a whole ckpt.pt is written again
    from the log the checkpoint carries. A run there made with other settings than `cfg` is refused -> run_state. A
    problem is a ValueError (one line)."""
    held.append(common.lock_folder(path))
    for p in (path / "run.json", path / "ckpt.pt"):
        if p.exists() and not p.is_file():
            raise ValueError(f"{p} is not a file; move it away to train this run")
    for tmp in [*path.glob("ckpt.pt.*.tmp"), *path.glob("run.json.*.tmp")]:
        tmp.unlink()
    if resume:
        runlog.rebuild_run_log(path)  # says so when it does
    try:
        state = runlog.run_state(path)
    except runlog.RunLogError as e:
        rebuild = ""
        if (path / "ckpt.pt").is_file():
            rebuild = " (--resume writes it again from ckpt.pt)"
        raise ValueError(f"{e}; move it away to train this run{rebuild}") from None
    runlog.check_same_run(path, cfg, done=state in ("finished", "diverged"))
    return state


def check_folders(runs):
    """Before anything of the grid trains: each run folder that holds a run holds one made with the run's settings
    (runlog.check_same_run; a ValueError names the first that does not). A damaged run.json is left to claim."""
    for cfg in runs:
        try:
            runlog.check_same_run(Path(cfg.out) / cfg.name, cfg)
        except runlog.RunLogError:
            continue


def grid_run(args, cfg, ranks, resume_cmd):
    """One run of the grid, in its locked folder: skipped when finished, else trained; False if it diverged."""
    path, held = Path(cfg.out) / cfg.name, []
    try:
        state = on_rank0(lambda: claim(path, held, args.resume, cfg), ranks)
        if state in ("finished", "diverged"):
            print0(f"{state} already (run.json says so): skipping; move the folder away to train it again")
            return state == "finished"
        if state == "partial" and not args.resume:
            print0("this run folder holds an unfinished run: starting over (--resume continues it)")
        if args.compile:
            torch._dynamo.reset()  # a fresh compile cache per shape
        run = build(cfg, ranks, args.resume, resume_cmd)
        describe(run)
        return loop(run)  # to the end or --max-steps; False if it diverged
    except DataError as e:  # e.g. a shard that was truncated since it was made
        fail(str(e))
    except OSError as e:  # a full disk, a folder gone read-only: the files keep their last good version
        fail(f"{cfg.name} stopped at a failed write ({e}); the run folder keeps its last good files")
    finally:
        for f in held:
            f.close()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def resolve_grid(args, world_size):
    """Every run of the command line's grid, resolved (and so checked) before anything is written -> [RunConfig]."""
    tokenizer = {"gpt2": data.GPT2Tokenizer, "bytes": data.ByteTokenizer}[args.tokenizer]  # the class: no download
    task = SyntheticTask(args.max_gap, args.group, answers_only=bool(args.answers_only))
    vocab = padded_vocab_size(task.vocab_size)
    if args.data != "synthetic":
        vocab = padded_vocab_size(tokenizer.vocab_size)
    runs = {}
    for residual, shape, lr, seed in itertools.product(args.residual, shapes_asked(args), args.lr or [None], args.seed):
        try:
            cfg = resolve(args, residual, shape, lr=lr, seed=seed, vocab_size=vocab, world_size=world_size)
        except ValueError as e:
            fail(str(e))
        runs.setdefault(cfg.name, cfg)  # two ARs can solve to the same shape
    return list(runs.values())


def resume_command(argv, ranks, resume):
    """The command line that resumes this job: the same, with --resume."""
    launcher = "python "
    if ranks.world_size > 1:
        launcher = "torchrun ... "
    extra = [] if resume else ["--resume"]
    return launcher + shlex.join(["train.py", *argv, *extra])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, cuda = parse_args(argv)
    if args.print_grid:
        return print_grid(args)

    ranks = init_distributed(cuda, plan_only=args.dry_run)  # --dry-run: the ranks it plans for, no process group
    runs = resolve_grid(args, ranks.world_size)
    try:
        check_memory(runs, args, cuda)
    except ValueError as e:
        fail(str(e))
    if args.dry_run:
        sys.exit(0)  # every plan fits
    on_rank0(lambda: check_folders(runs), ranks)  # a folder's run answers only for its own settings
    if args.data != "synthetic":
        on_rank0(lambda: prepare_data(args, runs[0]), ranks)

    resume_cmd = resume_command(argv, ranks, args.resume)
    handlers = STOP.install()
    diverged = []
    try:
        for k, cfg in enumerate(runs):
            path = Path(cfg.out) / cfg.name
            print0(f"\n[{k + 1}/{len(runs)}] {cfg.residual} ar={cfg.ar:.4g} lr={format_lr(cfg.lr)} seed={cfg.seed}"
                   f"  ({path})")
            if not grid_run(args, cfg, ranks, resume_cmd):
                diverged.append(cfg.name)
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
    with common.one_line_faults("train.py"):  # Ctrl-C outside the loop (data preparation), a failed write: one line
        main()
