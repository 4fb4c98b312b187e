"""
shape_fit.py: where along the aspect-ratio axis a design is best at the suite's budget, in one number: its final val
loss at the measured shapes fitted by a quadratic in log AR, whose vertex is the best aspect ratio, with a seed
bootstrap for its 95% interval. The one definition that mini.py's summary.md (depthbench/reports/suite_tables.py) and
depthbench/reports/plot_suite.py's shape-fit figure share. numpy only: no torch, no matplotlib.

Why this model: Figure 2 draws loss against AR on a log axis, the suite's shapes are spaced about evenly there
(AR 92, 51, 32, 17, 9.8), and a U over log AR is what a best aspect ratio means; a quadratic is the lowest order
with a minimum, and over five shapes it leaves two degrees of freedom (a cubic would nearly interpolate the seed
noise). It is fitted to the shapes' seed means, each shape weighing the same (the deepest has 5 seeds, the rest 3).

Where the curvature is not positive, or the vertex falls outside the measured ARs, the fitted curve has no minimum
inside them: the best AR is then the measured edge where the fit is lowest, reported as an edge ('monotone', or
'concave' where the curve is a hump inside the range), never extrapolated.

The interval: resample each shape's seeds with replacement (B = 2000 times, a fixed RNG seed, so the same losses
give the same interval), refit, take the best AR of each refit (an edge where it has no interior vertex), and the
2.5 and 97.5 percentiles of those, in log AR. It measures seed noise only, and with three seeds a shape has ten
distinct resamples, so it is narrow: read it as "how far seed luck moves the vertex", not a confidence interval.
"""
from dataclasses import dataclass

import numpy as np

from depthbench.evaluation.compare import LEVEL

BOOTSTRAP = 2000  # resamples of the seeds
RNG_SEED = 0      # the bootstrap's generator seed: the interval is a function of the losses alone


def design_matrix(x):
    """[x², x, 1] per row: loss = a x² + b x + c, x = ln AR."""
    x = np.asarray(x, dtype=float)
    return np.stack([x ** 2, x, np.ones_like(x)], axis=1)


def fit_quadratics(x, y):
    """Least-squares (a, b, c) of y ≈ a x² + b x + c; y of shape (n,) or (n, k): k fits at once -> (3,) or (3, k)."""
    coef, *_ = np.linalg.lstsq(design_matrix(x), np.asarray(y, dtype=float), rcond=None)
    return coef


def best_x(coef, low, high):
    """(x, where) of the lowest fitted loss on [low, high]: the vertex -b / 2a where a > 0 and it lies inside
    ('vertex'); else the edge where the fit is lower, 'monotone' when the fit has no turning point inside, 'concave'
    when its turning point inside is a maximum."""
    a, b, _ = coef
    turn = -b / (2 * a) if a != 0 else np.inf
    if a > 0 and low <= turn <= high:
        return turn, "vertex"
    at_low, at_high = np.polyval(coef, low), np.polyval(coef, high)
    edge = low if at_low <= at_high else high
    return edge, "concave" if a < 0 and low < turn < high else "monotone"


def best_x_batch(coefs, low, high):
    """best_x of each column of a (3, k) coefficient array -> (x of shape (k,), bool array: an interior vertex)."""
    a, b, _ = coefs
    with np.errstate(divide="ignore", invalid="ignore"):
        turn = np.where(a != 0, -b / (2 * a), np.inf)
    inside = (a > 0) & (turn >= low) & (turn <= high)
    at_low = a * low ** 2 + b * low
    at_high = a * high ** 2 + b * high
    edge = np.where(at_low <= at_high, low, high)
    return np.where(inside, turn, edge), inside


@dataclass
class ShapeFit:
    """A design's loss against log AR over the measured shapes, and its best AR."""
    ars: list            # the measured aspect ratios, ascending (deepest first)
    means: list          # the seed mean of the final val loss at each, in ars' order
    coef: tuple          # (a, b, c): loss ≈ a (ln AR)² + b ln AR + c, fitted to the means
    best_ar: float       # where the fit is lowest on [min ars, max ars]
    where: str           # 'vertex' (interior minimum), 'monotone' or 'concave' (best_ar is an edge then)
    low: float           # the seed bootstrap's 2.5th percentile of the best AR
    high: float          # its 97.5th percentile
    vertex_share: float  # the share of resamples whose fit has an interior minimum
    rms: float           # root mean square of the fit's residuals at the means

    @property
    def curvature(self):
        """d² loss / d(ln AR)² = 2a: positive for a U, in loss units per (ln AR)²."""
        return 2 * self.coef[0]

    def best_text(self):
        """'17' for an interior vertex, '9.8 (edge: monotone)' for an edge: the table's and the figure's words."""
        text = f"{self.best_ar:.2g}"
        return text if self.where == "vertex" else f"{text} (edge: {self.where})"


def fit_design(losses, boot=BOOTSTRAP, seed=RNG_SEED):
    """ShapeFit of {AR: [a design's final val losses at that shape, one per finished seed, in seed order]}; None
    with fewer than three shapes (a quadratic needs three). A shape with no loss is left out."""
    ars = sorted(ar for ar, values in losses.items() if len(values))
    if len(ars) < 3:
        return None
    x = np.log(ars)
    values = [np.asarray(losses[ar], dtype=float) for ar in ars]
    means = np.array([v.mean() for v in values])
    coef = fit_quadratics(x, means)
    best, where = best_x(coef, x[0], x[-1])
    rng = np.random.default_rng(seed)
    resampled = np.stack([v[rng.integers(0, len(v), size=(boot, len(v)))].mean(axis=1) for v in values])  # (S, B)
    xs, inside = best_x_batch(fit_quadratics(x, resampled), x[0], x[-1])
    tail = 100 * (1 - LEVEL) / 2
    low, high = np.exp(np.percentile(xs, [tail, 100 - tail]))
    rms = float(np.sqrt(np.mean((design_matrix(x) @ coef - means) ** 2)))
    return ShapeFit(ars=list(ars), means=means.tolist(), coef=tuple(float(c) for c in coef),
                    best_ar=float(np.exp(best)), where=where, low=float(low), high=float(high),
                    vertex_share=float(inside.mean()), rms=rms)
