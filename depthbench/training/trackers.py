"""
trackers.py: train.py's --log-to, the step log, evals and telemetry mirrored to TensorBoard or W&B (rank 0 only).

    Tracker          the interface, and the no-op default: log(step, {tag: float}), flush(), close()
    TensorBoard      torch.utils.tensorboard into <run folder>/tb; needs `pip install tensorboard`
    WandB            a W&B run in <run folder>/wandb, offline unless logged in; needs `pip install wandb`

Neither package is in requirements.txt: `missing(kind)` names the pip install before training (train.py exits 2).
A resumed run continues the same TensorBoard folder or W&B run (its id is kept in run.json's "telemetry") and never
writes a step twice: steps up to the one it resumed from are skipped, and TensorBoard purges any events after that
step that a killed run left behind (purge_step).
"""
import dataclasses
import importlib.util
import netrc
import os
import uuid

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # --log-to -> the package it needs (pip install NAME)


def missing(kind):
    """One line naming the pip install when --log-to `kind` needs a package that is absent, else None."""
    if kind is None or importlib.util.find_spec(TRACKERS[kind]) is not None:
        return None
    return f"--log-to {kind} needs the {TRACKERS[kind]} package: pip install {TRACKERS[kind]}"


class Tracker:
    """No tracker: every call does nothing. A tracker logs {tag: float} at an optimizer step; steps up to `floor`
    (the step a resumed run started from, whose events the earlier run wrote) are skipped."""

    def __init__(self, floor=0):
        self.floor = floor

    def log(self, step, scalars):
        if step > self.floor and scalars:
            self.write(step, scalars)

    def write(self, step, scalars):
        pass

    def flush(self):
        pass

    def close(self):
        pass


class TensorBoard(Tracker):
    """Scalars into <run folder>/tb, one event file per process start; events after the step it starts from (a killed
    run's, or a run started over's) are purged."""

    def __init__(self, run_dir, floor=0):
        super().__init__(floor)
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=floor + 1)

    def write(self, step, scalars):
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()


def wandb_logged_in():
    """A W&B key in the environment or in ~/.netrc (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandB(Tracker):
    """One W&B run per run folder, its id kept in `state` (run.json's "telemetry") so that --resume continues it;
    offline (files in <run folder>/wandb, `wandb sync` uploads them) unless logged in or WANDB_MODE says otherwise."""

    def __init__(self, run_dir, cfg, state, floor=0):
        super().__init__(floor)
        import wandb
        state.setdefault("wandb_id", uuid.uuid4().hex[:12])     # os.urandom: no RNG of training's
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_logged_in() else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "depthbench"), name=cfg.name,
                              id=state["wandb_id"], resume="allow", dir=str(run_dir),
                              config=dataclasses.asdict(cfg), mode=mode)

    def write(self, step, scalars):
        self.run.log(scalars, step=step)

    def close(self):
        self.run.finish()


def open_tracker(kind, run_dir, cfg, step, state):
    """The tracker of --log-to `kind` (None: the no-op) for the run in run_dir resumed at `step` (0: new)."""
    if kind is None:
        return Tracker(step)
    run_dir.mkdir(parents=True, exist_ok=True)
    if kind == "tensorboard":
        return TensorBoard(run_dir, step)
    return WandB(run_dir, cfg, state, step)
