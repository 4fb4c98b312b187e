"""
schedules.py: the LR schedules of train.py. A schedule is one function lr(step, span) of the optimizer step
(0-based) and the run's numbers (Span), and one entry in SCHEDULES; train.py's --schedule picks it by name, the run
records the name in its config (part of the run's identity: docs/reliability.md#run-identity), and a schedule other
than the default joins the run's folder name. The batches (data.py) and the LR are pure functions of the step,
which is what makes --resume bit-exact.

Adding a schedule: write its function here (docstring first line: what it does, in words; train.py prints it and
--help lists it) and add it to SCHEDULES. Nothing else names a schedule.
"""
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """The numbers of a run every schedule reads (RunConfig's lr, warmup_steps, total_steps, final_lr_frac)."""
    peak: float          # the peak LR
    warmup: int          # steps of the linear warmup from 0
    total: int           # the schedule's length: it ends at step `total`
    final_frac: float    # the LR at the end, as a fraction of the peak


def cosine(step, span):
    """linear warmup, then a cosine from the peak down to final_frac x peak at the last step (the paper's: OLMo's
    CosWithWarmup, docs/designs.md#recipe)"""
    peak, warmup, total, final_frac = span.peak, span.warmup, span.total, span.final_frac
    if step < warmup:
        return peak * step / warmup
    if step >= total:
        return final_frac * peak
    progress = (step - warmup) / (total - warmup)
    return final_frac * peak + (1 - final_frac) * peak * 0.5 * (1 + math.cos(math.pi * progress))


WSD_DECAY = 0.2  # the share of the steps wsd spends decaying


def wsd(step, span):
    """linear warmup, the peak held, then a linear decay to final_frac x peak over the last 20% of the steps
    (warmup-stable-decay)"""
    peak, warmup, total, final_frac = span.peak, span.warmup, span.total, span.final_frac
    if step < warmup:
        return peak * step / warmup
    decay_start = max(warmup, total - round(WSD_DECAY * total))
    if step < decay_start:
        return peak
    if step >= total:
        return final_frac * peak
    progress = (step - decay_start) / (total - decay_start)
    return peak - (1 - final_frac) * peak * progress


SCHEDULES = {"cosine": cosine, "wsd": wsd}   # name -> lr(step, span); the first is the default
DEFAULT = next(iter(SCHEDULES))


def summary(name):
    """A schedule's description, from its docstring's first sentence: what train.py prints and --help lists."""
    return " ".join(SCHEDULES[name].__doc__.split()).split(" (")[0]


def lr_at(name, step, span):
    """The LR of optimizer step `step` (0-based) under schedule `name`."""
    return SCHEDULES[name](step, span)
