"""
stopping.py: train.py's stop that keeps the work (docs/training.md#stopping). SIGINT or SIGTERM only sets a flag
(StopFlag.handler); the training loop reads it between optimizer steps and, during gradient accumulation, at every
micro-batch boundary. A step a signal cuts short is dropped: its gradients are discarded, the optimizer is not
stepped, and the data position and RNG go back to where the step began, i.e. to the end of the last completed step,
whose checkpoint --resume continues bit for bit. Under torchrun every rank stops at the same boundary: the ranks
agree by an all-reduce (MAX) of their flags there, the k-th agreement of one rank meeting the k-th of every other.
"""
import signal
import sys

import torch
import torch.distributed as dist

from depthbench.files.common import print0


class StopFlag:
    """The signals this process received, and the micro-batch counter of the step in progress that a signal's
    arrival is measured against (the loop sets `micro_done` after each micro-batch, 0 between steps)."""

    def __init__(self):
        self.signals = []          # the signals received (SIGINT/SIGTERM), in order
        self.micro_done = 0        # micro-batches of the step in progress done so far (0 between steps)
        self.at_signal = None      # micro_done when the first signal arrived
        self.drop = {}             # the step a signal cut short: run.json's "stopped" fields about it (dropped)
        self.group = None          # the CPU (gloo) group the ranks agree on; None: the default group is gloo
        self.group_of = None       # the default group that `group` was made in (a new process group: a new one)

    def clear(self):
        self.signals.clear()
        self.micro_done, self.at_signal, self.drop = 0, None, {}

    def handler(self, signum, frame):
        if not self.signals:
            self.at_signal = self.micro_done
        self.signals.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: KeyboardInterrupt at once

    def install(self):
        """This flag as the SIGINT and SIGTERM handler, cleared -> the handlers it replaced, to put back."""
        handlers = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        self.clear()
        return handlers

    def agreed(self, ranks):
        """The signal that asks the run to stop, else 0; under torchrun the largest over all ranks, so every rank
        stops at the same point and none is left waiting in a collective another left.

        The cost, accepted for a stop that keeps the work: one all-reduce of one integer per call, i.e. per
        micro-batch. It runs on a CPU tensor over gloo (the default group on CPU; under NCCL a gloo group of its own,
        made at the first call, which every rank reaches at the same point of the loop), so it never waits for the
        GPU: the CPU goes on queuing kernels while the GPU works through those queued before. Measured: ~1 ms a call
        with 2 ranks on localhost on a busy 2-core CPU; the card's micro-batches take 88-563 ms on an H200 (L70
        d640, micro-batch 2), so at most ~1% where the CPU is the bottleneck, nothing where the GPU is."""
        mine = 0
        if self.signals:
            mine = self.signals[0]
        if not ranks.ddp:
            return mine
        flag = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(flag, dist.ReduceOp.MAX, group=self.cpu_group())
        return int(flag)

    def cpu_group(self):
        """The process group for a CPU tensor: the default one when it is gloo, else a gloo group made once."""
        if dist.get_backend() == "gloo":
            return None
        if self.group_of is not dist.group.WORLD:
            self.group, self.group_of = dist.new_group(backend="gloo"), dist.group.WORLD
        return self.group

    def dropped(self, step, accum):
        """Step `step` is dropped after micro_done of its `accum` micro-batches: `drop` records it, how far it went
        and how many of those micro-batches ran after this process's signal (None: this rank stopped on another
        rank's signal); the counter goes back to 0."""
        after = None
        if self.at_signal is not None:
            after = self.micro_done - self.at_signal
        self.drop = {"dropped_step": step, "micro_batches_done": self.micro_done, "micro_batches": accum,
                     "after_signal": after}
        self.micro_done = 0

    def record(self, signum, step):
        """run.json's "stopped" (depthbench/files/runlog.py: Stopped): the signal, the last completed step (ckpt.pt's)
        and the step dropped, if one was."""
        return {"signal": signal.Signals(signum).name, "step": step, **self.drop}


STOP = StopFlag()  # train.py's: SIGINT/SIGTERM stop its loop at the next micro-batch boundary


def after_micro_batch(run, done):
    """After micro-batch `done` of a train.py step (0: before the first): the progress line, and whether a signal
    stops the step there, every rank agreeing (StopFlag.agreed). Asked before the first, so a signal that came
    during a save (after the loop's check between steps) never starts the step, nor its compile: a compile once
    begun is not cut (docs/training.md#stopping). Never after the step's last micro-batch: that step is complete,
    and the loop's check before the next step stops the run."""
    if done:
        run.meter.micro_batch(done)
    if done == run.train_loader.accum_steps:
        STOP.micro_done = 0  # the step is complete: a signal now comes between steps
        return False
    STOP.micro_done = done
    return STOP.agreed(run.ranks) != 0


def drop_step(run, begun):
    """A train.py step cut short: its gradients discarded, the optimizer not stepped, the data position and RNG back
    where the step began (begun: {"loader": the loader's state, "rng": the RNG states} then), so the last completed
    step's checkpoint resumes bit for bit. -> None."""
    run.optimizer.zero_grad(set_to_none=True)
    run.train_loader.load_state_dict(begun["loader"])
    torch.set_rng_state(begun["rng"]["cpu"])
    if "cuda" in begun["rng"]:
        torch.cuda.set_rng_state(begun["rng"]["cuda"], run.ranks.device)
    done, accum = STOP.micro_done, run.train_loader.accum_steps
    STOP.dropped(run.step + 1, accum)
    print0(f"step {run.step + 1} dropped after micro-batch {done} of {accum} (a signal): its gradients discarded, "
           f"the data position of step {run.step} kept")


def exit_after_save(run, signum):
    """The end of a stopped train.py run, its ckpt.pt and run.json written: one line on stderr, exit 128 + signum.
    No rank leaves (and makes torchrun stop the rest) before rank 0 has written them."""
    if run.ranks.ddp:
        dist.barrier()
    saved = "nothing trained yet"
    if run.step:
        saved = f"saved {run.ckpt_path.name}; resume with: {run.resume_cmd}"
    print0(f"interrupted at step {run.step}: {saved}", file=sys.stderr)
    sys.exit(128 + signum)
