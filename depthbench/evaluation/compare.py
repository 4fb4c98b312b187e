"""
compare.py: one design against Pre-LN at the same shape, seed by seed: the one definition that mini.py's summary.md
and depthbench/reports/plot_suite.py's relative panel share, so the table and the figure give the same numbers. No
torch, no matplotlib.

The same seed sees the same data order and validation windows in every design (train.py seeds both from --seed), so
on one seed a design's final val loss minus Pre-LN's is a paired difference: the seed's luck in data cancels out.

A difference is claimed only where its 95% interval excludes 0: Student's t interval over the per-seed differences,
mean ± t(0.975, n-1) · sd / √n. Why t and not a bootstrap at the suite's 3-5 seeds: a percentile bootstrap of the
mean never leaves the range of the observed differences, and the true mean lies outside the range of n draws of a
symmetric distribution with probability 2^(1-n) (25% at n = 3, 6% at n = 5), so its "95%" covers at most 75% at
three seeds; with 3 seeds it has only 10 distinct resamples. The t interval is exact when the per-seed differences are
normal, and wide where n is small, as it should be (t(0.975, 2) = 4.30). The tables use t only.
"""
import math
from dataclasses import dataclass, field

LEVEL = 0.95  # the coverage of every interval the suite's tables and figures give


def t_cdf(t, df):
    """P(T <= t) for Student's t with an integer df >= 1, by its closed form as a finite series in cos(θ),
    θ = atan(|t| / √df) (Abramowitz & Stegun 26.7.3 and 26.7.4): no scipy needed."""
    theta = math.atan(abs(t) / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:  # odd df: (2/π)(θ + sin θ (cos θ + 2/3 cos³θ + ...)), the series empty for df = 1
        term, series = math.cos(theta), 0.0
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= cos2 * (2 * k) / (2 * k + 1)
        inside = 2 / math.pi * (theta + math.sin(theta) * series)
    else:  # even df: sin θ (1 + 1/2 cos²θ + (1·3)/(2·4) cos⁴θ + ...)
        term, series = 1.0, 0.0
        for k in range(1, df // 2 + 1):
            series += term
            term *= cos2 * (2 * k - 1) / (2 * k)
        inside = math.sin(theta) * series
    return 0.5 + math.copysign(inside / 2, t)  # inside = P(|T| < |t|)


def t_quantile(p, df):
    """The t with P(T <= t) = p (0 < p < 1) for Student's t with an integer df >= 1, by bisection on t_cdf."""
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def t_interval(values, level=LEVEL):
    """(low, high): the two-sided `level` t interval of the mean of `values`, mean ± t((1+level)/2, n-1) · sd / √n
    (sd with n-1); None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


def interval_verdict(interval):
    """'better' (the interval lies below 0), 'worse' (above 0) or 'unresolved' (it includes 0, or there is none)."""
    if interval is None or interval[0] <= 0 <= interval[1]:
        return "unresolved"
    return "better" if interval[1] < 0 else "worse"


@dataclass
class Paired:
    """A design's paired differences from a base design (Pre-LN) over the seeds both ran."""
    seeds: list                                   # the seeds both designs ran (finished or diverged), sorted
    deltas: dict = field(default_factory=dict)    # seed -> design's final val loss minus the base's (both finished)
    lower: int = 0       # seeds where the design's loss is below the base's (or only the base diverged)
    higher: int = 0      # seeds where it is above (or only the design diverged)
    diverged: list = field(default_factory=list)  # seeds where the design diverged and the base did not
    base_diverged: list = field(default_factory=list)  # seeds where the base diverged and the design did not

    @property
    def mean(self):
        return sum(self.deltas.values()) / len(self.deltas) if self.deltas else math.nan

    @property
    def low(self):
        return min(self.deltas.values(), default=math.nan)

    @property
    def high(self):
        return max(self.deltas.values(), default=math.nan)

    @property
    def interval(self):
        """The 95% t interval of the mean difference over the seeds both finished (t_interval); None below two."""
        return t_interval([self.deltas[seed] for seed in sorted(self.deltas)])

    def verdict(self):
        """'better' or 'worse' only where the 95% interval excludes 0 and no seed on which one design alone diverged
        says otherwise; a design that alone diverged on every common seed is 'worse' (the base alone: 'better');
        else 'unresolved', 'one seed' or '—' (no seed in common)."""
        n = len(self.seeds)
        if n == 0:
            return "—"
        if n == 1:
            return "one seed"
        if len(self.diverged) == n:
            return "worse"
        if len(self.base_diverged) == n:
            return "better"
        said = interval_verdict(self.interval)
        if (said == "better" and self.diverged) or (said == "worse" and self.base_diverged):
            return "unresolved"
        return said

    def interval_text(self, digits=4):
        """'-0.0370 [-0.0612, -0.0128]' (the mean, its 95% interval); '+0.1000 [one pair]' with one finished pair;
        '' with none."""
        if not self.deltas:
            return ""
        interval = self.interval
        if interval is None:
            return f"{self.mean:+.{digits}f} [one pair]"
        return f"{self.mean:+.{digits}f} [{interval[0]:+.{digits}f}, {interval[1]:+.{digits}f}]"

    def text(self):
        """'-0.0370 [-0.0612, -0.0128], lower on 3/3' (the mean of the per-seed differences, its 95% t interval, the
        count of seeds lower); '—' without a seed in common."""
        if not self.seeds:
            return "—"
        out = f"lower on {self.lower}/{len(self.seeds)}"
        if self.deltas:
            out = f"{self.interval_text()}, " + out
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
            out.base_diverged.append(seed)
        elif finite(theirs):
            out.higher += 1
            out.diverged.append(seed)
    return out
