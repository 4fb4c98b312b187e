"""
compare.py: one design against Pre-LN at the same shape, seed by seed: the one definition that mini.py's summary.md
and depthbench/plot_suite.py's relative panel share, so the table and the figure give the same numbers. No torch, no matplotlib.

The same seed sees the same data order and validation windows in every design (train.py seeds both from --seed), so
on one seed a design's final val loss minus Pre-LN's is a paired difference: the seed's luck in data cancels out.
"""
import math
from dataclasses import dataclass, field


@dataclass
class Paired:
    """A design's paired differences from a base design (Pre-LN) over the seeds both ran."""
    seeds: list                                   # the seeds both designs ran (finished or diverged), sorted
    deltas: dict = field(default_factory=dict)    # seed -> design's final val loss minus the base's (both finished)
    lower: int = 0       # seeds where the design's loss is below the base's (or only the base diverged)
    higher: int = 0      # seeds where it is above (or only the design diverged)
    diverged: list = field(default_factory=list)  # seeds where the design diverged and the base did not

    @property
    def mean(self):
        return sum(self.deltas.values()) / len(self.deltas) if self.deltas else math.nan

    @property
    def low(self):
        return min(self.deltas.values(), default=math.nan)

    @property
    def high(self):
        return max(self.deltas.values(), default=math.nan)

    def verdict(self):
        """'better' or 'worse' only where every paired seed agrees (two seeds at least); else 'mixed', 'one seed'
        or '—' (no seed in common)."""
        n = len(self.seeds)
        if n == 0:
            return "—"
        if n == 1:
            return "one seed"
        if self.lower == n:
            return "better"
        if self.higher == n:
            return "worse"
        return "mixed"

    def text(self):
        """'-0.0370 [-0.0500, -0.0200], lower on 3/3' (the mean of the per-seed differences, their range, the count);
        '—' without a seed in common."""
        if not self.seeds:
            return "—"
        out = f"lower on {self.lower}/{len(self.seeds)}"
        if self.deltas:
            out = f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}], " + out
        if self.diverged:
            out += f" (diverged on seed {', '.join(map(str, self.diverged))})"
        return out


def finite(value):
    return value is not None and math.isfinite(value)


def paired(losses, base):
    """Paired of {seed: a design's final val loss, None where that seed diverged} against the same for the base
    design. A seed on which both diverged counts neither way."""
    out = Paired(seeds=sorted(set(losses) & set(base)))
    for seed in out.seeds:
        mine, theirs = losses[seed], base[seed]
        if finite(mine) and finite(theirs):
            delta = mine - theirs
            out.deltas[seed] = delta
            out.lower += delta < 0
            out.higher += delta > 0
        elif finite(mine):
            out.lower += 1
        elif finite(theirs):
            out.higher += 1
            out.diverged.append(seed)
    return out
