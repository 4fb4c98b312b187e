"""
progress.py: what a user sees of train.py's steps while they run (rank 0 only). In a session's first step: a line as
its first micro-batch starts (saying what it does first: compile), one when that micro-batch is done (its seconds),
and, with more micro-batches, the time a step is expected to take, read from those after the first (which pays for
compile and warm-up). During a step expected to last over LONG_STEP_S: a progress line, a tqdm bar on a terminal
(cleared when the step's log line comes), else, into a log file, a plain line every PLAIN_EVERY_S seconds (a bar
redrawn with carriage returns does not read in a file). A step of one micro-batch has nothing to show inside it.
"""
import sys
import time

from tqdm import tqdm

from depthbench.files.common import duration, print0

LONG_STEP_S = 5.0      # a step expected to take longer shows its micro-batches as they go
PLAIN_EVERY_S = 60.0   # off a terminal: a progress line at most this often


def on_terminal():
    return sys.stdout.isatty()


class StepMeter:
    """The micro-batches of the step in progress: counted, timed and shown (the module docstring).

    steady_s: the expected seconds of a step from the micro-batches of the last step after its first (None when
    it had one micro-batch): the pace train.py's first log line reads tokens/s, MFU and the ETA from."""

    def __init__(self, *, accum, master, compile_scope=None):
        self.accum, self.master, self.compile_scope = accum, master, compile_scope
        self.first = True            # the session's first step: its first micro-batch compiles and warms up
        self.step, self.done = 0, 0  # the step in progress, its micro-batches done
        self.t0 = self.t1 = self.t_last = 0.0  # when the step began, its first and its last micro-batch ended
        self.shown_at = 0.0          # when the last plain progress line was printed (the step's start before one)
        self.bar = None
        self.steady_s = None

    def begin(self, step):
        """Step `step` (counted from 1) starts."""
        self.step, self.done, self.t0 = step, 0, time.time()
        self.shown_at = self.t0
        if self.first:
            what = ""
            if self.compile_scope:
                what = {"blocks": ": torch.compile compiles each block first (every block reuses one's graphs)",
                        "model": ": torch.compile compiles the whole forward first"}[self.compile_scope]
            print0(f"step {step}: micro-batch 1 of {self.accum} starts{what}")

    def micro_batch(self, done):
        """Micro-batch `done` of the step (counted from 1) is done."""
        now = time.time()
        self.done, self.t_last = done, now
        if done == 1:
            self.t1 = now
            if self.first:
                print0(f"step {self.step}: micro-batch 1 done in {now - self.t0:.1f} s")
        expected = self.expected(now)
        if self.first and done == 2:
            print0(f"step {self.step}: {(now - self.t1) * 1000:.0f} ms a micro-batch after the first: this step "
                   f"takes ~{duration(expected)}, the next ones ~{duration(self.pace(now) * self.accum)}")
        if self.master and done < self.accum and expected is not None and expected > LONG_STEP_S:
            self.show(now, expected)

    def pace(self, now):
        """Seconds per micro-batch: those after the first, else the first's (None in the session's first step)."""
        if self.done >= 2:
            return (now - self.t1) / (self.done - 1)
        if self.first:
            return None
        return now - self.t0

    def expected(self, now):
        """The expected seconds of the step in progress: its first micro-batch as it went, the rest at the pace."""
        pace = self.pace(now)
        if pace is None:
            return None
        return self.t1 - self.t0 + pace * (self.accum - 1)

    def show(self, now, expected):
        """The progress line of a long step: the bar on a terminal, else a plain line now and then."""
        left = f"{duration(now - self.t0)} of ~{duration(expected)}"
        if not on_terminal():
            if now - self.shown_at >= PLAIN_EVERY_S:
                print0(f"step {self.step}: micro-batch {self.done}/{self.accum}, {left}")
                self.shown_at = now
            return
        if self.bar is None:
            self.bar = tqdm(total=self.accum, initial=self.done, desc=f"step {self.step}", leave=False, file=sys.stdout,
                            dynamic_ncols=True, bar_format="{desc}: {n}/{total} micro-batches |{bar}| {postfix}")
        self.bar.set_postfix_str(left, refresh=False)
        self.bar.update(self.done - self.bar.n)  # redrawn at most every 0.1 s (tqdm's mininterval)

    def end(self):
        """The step is over, done or dropped: the bar goes, the pace of its micro-batches is kept (steady_s)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.steady_s = None
        if self.done >= 2:
            self.steady_s = self.pace(self.t_last) * self.accum
        self.first = False


def print_step(run, stats, step_start):
    """train.py's line of a step: stats = (loss, grad norm, lr, seconds), tokens/s, MFU and the ETA. A session's
    first line reads them from the pace of its micro-batches after the first (the first pays for compile and
    warm-up; with one micro-batch a step there is no other pace, and it says so), and adds the whole run's ETA when
    --max-steps ends the session before the run's last step."""
    loss, grad_norm, lr, dt = stats
    cfg, step = run.cfg, run.step
    first, pace, note, whole = step == step_start + 1, dt, "", ""
    eta = (time.time() - run.t_start) / (step - step_start) * (run.stop - step)  # evals included
    if first and run.meter.steady_s:
        pace = run.meter.steady_s
        eta, note = pace * (run.stop - step), f" (steady {pace * 1000:.0f} ms)"
    elif first and cfg.compile:
        note = " (compile included)"
    if first and run.stop < cfg.total_steps:
        whole = f" (to step {run.stop}; the whole run: {duration(pace * (cfg.total_steps - step))})"
    mfu = ""
    if run.peak_flops:
        flops_per_s = run.flops_per_token * cfg.tokens_per_step / pace / run.ranks.world_size
        mfu = f" | MFU {100 * flops_per_s / run.peak_flops:.1f}%"
    print0(f"step {step:>5}/{cfg.total_steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} "
           f"| {dt * 1000:.0f} ms{note} | {cfg.tokens_per_step / pace:,.0f} tok/s{mfu} | ETA {duration(eta)}{whole}")
