"""
telemetry.py: watch a run's depth as it trains (docs/training.md#telemetry).

At every eval (and every --stats-every steps if asked) `stats` measures, on the first validation micro-batch:
- per sublayer i: the RMS of the state it reads (the design's depth state before it, `res.depth_state`: Pre-LN's
  residual stream, HC/mHC's n streams, AttnRes' depth mix or running sum) and the RMS of its output F_i(h);
- per block: the gradient norm the last optimizer step applied (after clipping) and its update/weight ratio
  |W_new - W_old| / |W_old|; the same for the embedding, the head and the design's own parameters;
- what the design declares about itself: `telemetry(rec)` on its class in residuals.py, from the observed forward
  that diagnose.py reads too (HC/mHC transport effective rank, AttnRes depth-weight entropy, MoDA's depth share).
The forward runs under torch.no_grad on the plain model, with the RNG state forked and restored, so training's
losses are bit-identical with and without it. Records go into run.json under "telemetry" and, with --log-to, to
TensorBoard or W&B (depthbench/training/trackers.py) with the step log and the evals.

train.py calls three things (`Watch`): `Watch.start(...)` once a run is built and resumed, `watch.after_step(entry)`
after each optimizer step, `watch.at_eval(step, ev)` after each eval, and `watch.close()` when the run ends.
"""
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from depthbench.evaluation import observe
from depthbench.training import trackers
from depthbench.files.common import positive

SEQS = 8  # sequences of the eval micro-batch that telemetry reads: enough for RMS and means, cheap at any scale
DEFINITIONS = {
    "state_rms": "RMS over tokens and channels of the depth state sublayer i reads (res.depth_state before it); "
                 "the last entry: the state the head reads, before the final norm",
    "out_rms": "RMS of sublayer i's output F_i(h), before the design folds it in; out_rms / state_rms is its "
               "relative update",
    "grad_norm": "L2 norm of the gradient the last optimizer step applied (after clipping), per block and for the "
                 "embedding, head and design parameters",
    "update_ratio": "|W_after - W_before| / |W_before| over the same groups, of the last optimizer step",
    "design": "the design's own statistics (residuals.py, each class's `telemetry`)",
}


def add_flags(parser):
    """--stats-every and --log-to on train.py's parser."""
    add = parser.add_argument
    add("--stats-every", type=positive(int, zero=True), help="telemetry every this many steps as well as at each eval "
        "(docs/training.md#telemetry); 0: none at all (default: at each eval only)")
    add("--log-to", choices=list(trackers.TRACKERS), help="mirror the step log, evals and telemetry to TensorBoard "
        "(<run>/tb) or W&B (offline unless logged in); rank 0 only, an optional package each")


# ----------------------------------------------------------------------------- the statistics

@dataclass
class Probe:
    """What the last optimizer step did, per parameter group, captured by optimizer hooks when armed."""
    names: list                          # group names: "block.0" .. "block.L-1", "embed", "head", "design"
    params: list                         # the parameters of each group, in the order of names
    armed: bool = False                  # capture the next step (the step before a telemetry record)
    target: int = None                   # the step an armed probe captures
    before: list = None                  # the armed step's weights before it, one list per group
    step: int = None                     # the step captured (1-based, as run.json's steps)
    grad_norm: list = None               # per group
    update_ratio: list = None            # per group

    @classmethod
    def of(cls, model):
        groups = {f"block.{b}": list(block.parameters()) for b, block in enumerate(model.blocks)}
        groups.update(embed=list(model.wte.parameters()), head=list(model.lm_head.parameters()),
                      design=list(model.res.parameters()))
        groups = {k: v for k, v in groups.items() if v}
        return cls(list(groups), list(groups.values()))


def local(t):
    """A tensor's own shard under FSDP2 (a DTensor), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def group_norms(groups):
    """The L2 norm of each group of tensors (None entries skipped); under FSDP2 summed over the ranks' shards."""
    sq, sharded = [], False
    for tensors in groups:
        total = torch.zeros((), dtype=torch.float64)
        for t in tensors:
            if t is not None:
                sharded = sharded or hasattr(t, "to_local")
                total += local(t).detach().double().pow(2).sum().cpu()
        sq.append(total)
    sq = torch.stack(sq)
    if sharded and dist.is_initialized():
        dist.all_reduce(sq)
    return sq.sqrt().tolist()


def attach(probe, optimizer):
    """Hooks on the optimizer: before an armed step, the gradients' norms and a copy of the weights; after it, the
    update's norm over the weights'. Unarmed steps cost one flag test."""
    def pre(opt, args, kwargs):
        if probe.armed:
            probe.step, probe.update_ratio = probe.target, None
            probe.grad_norm = group_norms([[p.grad for p in ps] for ps in probe.params])
            probe.before = [[local(p).detach().clone() for p in ps] for ps in probe.params]

    def post(opt, args, kwargs):
        if probe.armed and probe.before is not None:
            deltas = [[local(p).detach() - b for p, b in zip(ps, bs)] for ps, bs in zip(probe.params, probe.before)]
            weights = group_norms(probe.before)
            probe.update_ratio = [u / w if w > 0 else None for u, w in zip(group_norms(deltas), weights)]
            probe.before, probe.armed = None, False
    return optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)


rms = observe.rms


def sublayer_rms(model, x):
    """An observed forward of x (observe.record): (state RMS per sublayer + the head's, output RMS per sublayer,
    the observe.Record)."""
    rec = observe.record(model, x, sublayers=True)
    return rec.state_rms + [rms(rec.states[-1])], rec.out_rms, rec


def finite(v):
    """JSON has no NaN: a non-finite float becomes None (lists element-wise)."""
    if isinstance(v, list):
        return [finite(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def stats(model, x, probe=None, step=None):
    """The telemetry record of the plain (not compiled, not DDP) model on token ids x (B, T), with what the probe
    caught of optimizer step `step` (None where it caught another step or nothing). The forward runs under no_grad
    in eval mode with every RNG state forked and restored: training cannot tell it ran."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        states, outs, rec = sublayer_rms(model, x[:SEQS].to(device))
        design = model.res.telemetry(rec.internals)
    model.train(was_training)
    caught = probe is not None and probe.step == step and probe.grad_norm is not None
    out = {"step": step, "state_rms": states, "out_rms": outs, "grad_norm": None, "update_ratio": None,
           "design": {k: finite(v) for k, v in design.items()}}
    if caught:
        for key in ("grad_norm", "update_ratio"):
            values = dict(zip(probe.names, getattr(probe, key) or [None] * len(probe.names)))
            blocks = [values.pop(f"block.{b}") for b in range(len(model.blocks))]
            out[key] = {"blocks": finite(blocks), **finite(values)}
    return {k: finite(v) if isinstance(v, list) else v for k, v in out.items()}


def scalars(record):
    """A telemetry record -> flat {tag: float} for a tracker: telemetry/state_rms/03, telemetry/design/erank/05, ..."""
    flat = {}

    def put(tag, v):
        if isinstance(v, dict):
            for k, x in v.items():
                put(f"{tag}/{k}", x)
        elif isinstance(v, list):
            width = len(str(len(v) - 1))
            for k, x in enumerate(v):
                put(f"{tag}/{k:0{width}d}", x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            flat[tag] = float(v)
    for key, value in record.items():
        if key != "step":
            put(f"telemetry/{key}", value)
    return flat


# ----------------------------------------------------------------------------- what train.py calls

@dataclass
class Watch:
    """One run's telemetry and tracker (`Watch.start`); train.py calls after_step, at_eval and close."""
    model: object                        # the plain model (not compiled, not DDP): telemetry's forward runs it
    loader: object                       # the validation loader: telemetry reads its first micro-batch
    log: dict                            # the run's log (run.json): records join log["telemetry"]["records"]
    tracker: trackers.Tracker            # a no-op without --log-to and off rank 0
    probe: Probe = None                  # None when telemetry is off (--stats-every 0)
    eval_every: int = 1                  # the run's eval cadence: evals at its multiples and at the stop step
    every: int = None                    # --stats-every: records between evals too
    stop: int = 0                        # the run's last step (--max-steps or the schedule's end)
    hooks: list = field(default_factory=list)   # the optimizer hooks' handles

    @classmethod
    def start(cls, model, optimizer, loader, log, cfg, step):
        """After the run is built and resumed (at `step`): run.json's "telemetry" entry (kept from a resumed log),
        the probe on the optimizer, and on rank 0 the tracker (a resumed run continues its TensorBoard folder or
        W&B run after `step`)."""
        every = cfg.stats_every
        state = log.get("telemetry") or {"stats_every": every, "definitions": DEFINITIONS, "records": []}
        log["telemetry"] = state
        master = not dist.is_initialized() or dist.get_rank() == 0
        run_dir = Path(cfg.out) / cfg.name
        tracker = trackers.Tracker()  # off rank 0: a no-op
        if master:
            tracker = trackers.open_tracker(cfg.log_to, run_dir, cfg=cfg, step=step, state=state)
        stop = min(cfg.total_steps, cfg.max_steps or cfg.total_steps)
        probe = None
        if every != 0:
            probe = Probe.of(model)
        watch = cls(model=model, loader=loader, log=log, tracker=tracker, probe=probe, eval_every=cfg.eval_every,
                    every=every, stop=stop)
        if watch.probe is not None:
            watch.hooks = list(attach(watch.probe, optimizer))
            watch.arm(step)
        return watch

    def evaluates(self, step):
        return step % self.eval_every == 0 or step == self.stop

    def due(self, step):
        """Whether a telemetry record is taken at `step`: each eval, and every --stats-every steps."""
        return self.evaluates(step) or bool(self.every) and step % self.every == 0

    def arm(self, step):
        """Before the step after `step`: capture it if a record follows it."""
        self.probe.armed, self.probe.target = self.due(step + 1), step + 1

    def record(self, step):
        x = self.loader.get_batch(0, 0)[0]
        rec = stats(self.model, x, self.probe, step)
        self.log["telemetry"]["records"].append(rec)
        self.tracker.log(step, scalars(rec))

    def after_step(self, entry):
        """After optimizer step entry["step"] (run.json's step entry): to the tracker; a --stats-every record
        between evals; the probe armed for the next step."""
        step = entry["step"]
        self.tracker.log(step, {f"train/{k}": entry[k] for k in ("loss", "lr", "grad_norm", "tok_per_s")
                                if entry.get(k) is not None})
        if self.probe is None:
            return
        if self.due(step) and not self.evaluates(step):
            self.record(step)
        self.arm(step)

    def at_eval(self, step, ev):
        """After the eval at `step` (train.py's evaluate dict): to the tracker, then the telemetry record."""
        values = {f"eval/{k}": ev[k] for k in ("val_loss", "answer_loss", "answer_acc") if ev.get(k) is not None}
        for gap, m in (ev.get("per_level") or {}).items():
            values[f"eval/acc_gap{gap}"] = m["acc"]
        self.tracker.log(step, values)
        if self.probe is not None:
            self.record(step)
        self.tracker.flush()

    def close(self):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.tracker.close()
