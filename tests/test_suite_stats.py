"""
Tests of the suite's statistics: the paired 95% t interval that decides every "better"/"worse" of summary.md and the
suite figure (depthbench/evaluation/compare.py), the best aspect ratio of a quadratic in log AR with its seed bootstrap
(depthbench/reports/shape_fit.py), the tables that carry them (depthbench/reports/suite_tables.py), and the
recomputation of an older summary's intervals (scripts/paired_intervals.py).

    python -m pytest -q tests/test_suite_stats.py
"""
import math

import numpy as np
import pytest

from depthbench.evaluation import compare
from depthbench.reports import shape_fit, suite_tables
from scripts import paired_intervals

# Student's t, the 97.5th percentile, by degrees of freedom (any printed table)
T975 = {1: 12.7062047, 2: 4.3026527, 3: 3.1824463, 4: 2.7764451, 10: 2.2281389, 30: 2.0422725}
ARS = [92.0, 50.67, 32.0, 17.33, 9.78]  # the suite's five shapes


def test_the_t_quantile_is_the_tables():
    """t_quantile(0.975, df) matches the printed table to 7 digits; the cdf is symmetric, 1/2 at 0, and for df = 1
    (Cauchy) 1/2 + atan(t)/π."""
    for df, want in T975.items():
        assert compare.t_quantile(0.975, df) == pytest.approx(want, abs=1e-6), df
        assert compare.t_quantile(0.025, df) == pytest.approx(-want, abs=1e-6), df
    assert compare.t_cdf(0.0, 5) == 0.5 and compare.t_cdf(-1.3, 4) == pytest.approx(1 - compare.t_cdf(1.3, 4))
    assert compare.t_cdf(2.0, 1) == pytest.approx(0.5 + math.atan(2.0) / math.pi)


def test_the_interval_is_the_hand_computed_t_interval():
    """Differences -0.05, -0.06, -0.04: mean -0.05, sd 0.01, so mean ± 4.3026527 · 0.01 / √3 = [-0.07484, -0.02516];
    five values 1..5: mean 3, sd √2.5, ± 2.7764451 · √2.5 / √5 = [1.03676, 4.96324]; one value has none."""
    low, high = compare.t_interval([-0.05, -0.06, -0.04])
    assert (low, high) == pytest.approx((-0.05 - T975[2] * 0.01 / math.sqrt(3), -0.05 + T975[2] * 0.01 / math.sqrt(3)),
                                        abs=1e-8)
    assert (low, high) == pytest.approx((-0.074841, -0.025159), abs=1e-6)
    assert compare.t_interval([1, 2, 3, 4, 5]) == pytest.approx((1.036757, 4.963243), abs=1e-6)
    assert compare.t_interval([0.3]) is None


def test_ranges_that_overlap_with_a_paired_interval_that_excludes_0():
    """Pre-LN 2.00, 2.10, 1.90 and the design 0.05, 0.06, 0.04 below on the same seeds: the two ranges overlap
    ([1.86, 2.04] and [1.90, 2.10], the older 'within seed spread'), yet the paired interval lies below 0: better."""
    base = {0: 2.00, 1: 2.10, 2: 1.90}
    design = {0: 1.95, 1: 2.04, 2: 1.86}
    assert max(design.values()) > min(base.values())  # the ranges overlap
    pair = compare.paired(design, base)
    assert pair.interval == pytest.approx((-0.074841, -0.025159), abs=1e-6)
    assert pair.verdict() == "better" and pair.text() == "-0.0500 [-0.0748, -0.0252], lower on 3/3"


def test_lower_on_every_seed_with_an_interval_that_includes_0():
    """The design below Pre-LN on all three seeds, its range apart from Pre-LN's (the older 'beyond seed spread'),
    but the differences -0.01, -0.02, -0.09 vary too much: mean -0.04, interval [-0.148, +0.068], unresolved."""
    base = {0: 3.00, 1: 3.01, 2: 3.02}
    design = {0: 2.99, 1: 2.99, 2: 2.93}
    assert max(design.values()) < min(base.values())  # the ranges do not overlap
    pair = compare.paired(design, base)
    sd = math.sqrt((0.03 ** 2 + 0.02 ** 2 + 0.05 ** 2) / 2)
    assert pair.interval == pytest.approx((-0.04 - T975[2] * sd / math.sqrt(3), -0.04 + T975[2] * sd / math.sqrt(3)),
                                          abs=1e-8)
    assert (pair.lower, pair.verdict()) == (3, "unresolved")
    assert compare.paired({0: 2.9, 1: 2.95}, {0: 3.0, 1: 3.0}).verdict() == "unresolved"  # two seeds: t(0.975, 1) = 12.7


def test_a_one_sided_divergence_overrules_the_interval():
    """A claim never goes against a seed on which one design alone diverged: 'better' by the interval of three seeds,
    but diverged on a fourth -> unresolved; diverged on every seed -> worse; Pre-LN diverged on every one -> better."""
    base = {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0}
    assert compare.paired({0: 2.00, 1: 2.01, 2: 2.02}, base).verdict() == "better"
    assert compare.paired({0: 2.00, 1: 2.01, 2: 2.02, 3: None}, base).verdict() == "unresolved"
    assert compare.paired({0: None, 1: None}, base).verdict() == "worse"
    assert compare.paired({0: 2.0, 1: 2.1}, {0: None, 1: None}).verdict() == "better"


def quadratic(vertex_ar, curvature=0.05, floor=1.9):
    """A loss curve in ln AR with its minimum at vertex_ar: floor + curvature / 2 · (ln AR - ln vertex_ar)²."""
    return lambda ar: floor + curvature / 2 * (math.log(ar) - math.log(vertex_ar)) ** 2


def test_the_fit_recovers_a_known_vertex():
    """Noise-free seeds on a quadratic in ln AR with its minimum at AR 25: best AR 25, curvature 0.05, rms 0, and
    every resample the same (identical seeds): the interval is the point."""
    curve = quadratic(25.0)
    fit = shape_fit.fit_design({ar: [curve(ar)] * 3 for ar in ARS})
    assert (fit.best_ar, fit.where, fit.curvature) == (pytest.approx(25.0, rel=1e-9), "vertex", pytest.approx(0.05))
    assert (fit.low, fit.high, fit.vertex_share) == (pytest.approx(25.0, rel=1e-9), pytest.approx(25.0, rel=1e-9), 1.0)
    assert fit.rms == pytest.approx(0, abs=1e-12) and fit.best_text() == "25"


def test_a_trend_without_a_minimum_gives_the_edge_and_says_monotone():
    """Linear in ln AR: loss falling with depth -> the deepest measured AR, 'monotone'; rising -> the widest. A U
    whose vertex (AR 300) lies beyond the measured range -> its nearer edge, 'monotone'; a hump -> the lower edge,
    'concave'. Never extrapolated."""
    deeper_better = shape_fit.fit_design({ar: [2.0 + 0.01 * math.log(ar)] * 3 for ar in ARS})
    assert (deeper_better.best_ar, deeper_better.where) == (pytest.approx(9.78), "monotone")
    assert deeper_better.best_text() == "9.8 (edge: monotone)"
    wider_better = shape_fit.fit_design({ar: [2.0 - 0.01 * math.log(ar)] * 3 for ar in ARS})
    assert (wider_better.best_ar, wider_better.where) == (pytest.approx(92.0), "monotone")
    beyond = shape_fit.fit_design({ar: [quadratic(300.0)(ar)] for ar in ARS})
    assert (beyond.best_ar, beyond.where) == (pytest.approx(92.0), "monotone") and beyond.curvature > 0
    hump = shape_fit.fit_design({ar: [2.0 - 0.02 * (math.log(ar) - math.log(30)) ** 2] for ar in ARS})
    assert hump.where == "concave" and hump.best_ar in (pytest.approx(9.78), pytest.approx(92.0))
    assert shape_fit.fit_design({92.0: [2.0], 9.78: [1.9], 32.0: []}) is None  # two shapes with a loss: no fit


def test_the_seed_bootstrap_is_deterministic_and_inside_the_range():
    """The same losses give the same interval (a fixed RNG seed), within the measured ARs, around a best AR that seed
    noise moves: three noisy seeds a shape on a U with its minimum at AR 25."""
    rng = np.random.default_rng(7)
    curve = quadratic(25.0, curvature=0.2)
    losses = {ar: [curve(ar) + e for e in rng.normal(0, 0.01, size=5 if ar < 10 else 3)] for ar in ARS}
    first, again = shape_fit.fit_design(losses), shape_fit.fit_design(losses)
    assert (first.low, first.high, first.vertex_share) == (again.low, again.high, again.vertex_share)
    assert min(ARS) <= first.low < first.best_ar < first.high <= max(ARS)
    other = shape_fit.fit_design(losses, seed=1)
    assert (other.best_ar, other.coef) == (first.best_ar, first.coef)  # the point estimate does not resample
    assert 15 < first.best_ar < 40


def result(by_seed, steps=None):
    """A suite_tables.Result as collect() builds it: by_seed, the finished losses, the diverged seeds' steps."""
    r = suite_tables.Result(by_seed=dict(by_seed))
    r.loss = [v for v in by_seed.values() if v is not None]
    r.diverged = [(seed, (steps or {}).get(seed, "?")) for seed, v in by_seed.items() if v is None]
    return r


def test_the_seed_table_lists_every_seed_and_the_fit_table_is_shape_fits():
    """seed_table: every cell, every seed's loss to 4 digits, 'diverged (step N)' or '—' (not run); fit_table: per
    design shape_fit.fit_design of its shapes' finished seeds, or why there is none."""
    curve = quadratic(25.0, curvature=0.2)
    table = {}
    for ar, (L, d) in zip(ARS, [(2, 184), (3, 152), (4, 128), (6, 104), (9, 88)]):
        seeds = range(5) if L == 9 else range(3)
        table[("preln", L, d, 3e-3)] = result({s: curve(d / L) + 0.001 * s for s in seeds})
    table[("hc", 2, 184, 3e-3)] = result({0: 1.8, 1: None}, steps={1: 7})
    seeds = suite_tables.seed_table(table, ["preln", "hc"])
    assert seeds[0] == "| design | L | d | LR | seed 0 | seed 1 | seed 2 | seed 3 | seed 4 |"
    assert seeds[2] == f"| preln | 2 | 184 | 3e-3 | {curve(92):.4f} | {curve(92) + 0.001:.4f} | " \
                       f"{curve(92) + 0.002:.4f} | — | — |"
    assert seeds[3] == "| hc | 2 | 184 | 3e-3 | 1.8000 | diverged (step 7) | — | — | — |"
    fit = shape_fit.fit_design({d / L: [curve(d / L) + 0.001 * s for s in (range(5) if L == 9 else range(3))]
                                for L, d in [(2, 184), (3, 152), (4, 128), (6, 104), (9, 88)]})
    rows = suite_tables.fit_table(table, ["preln", "hc"])
    assert rows[2] == (f"| preln | {fit.best_text()} | [{fit.low:.2g}, {fit.high:.2g}] | {fit.curvature:+.4f} | "
                       f"{fit.vertex_share:.0%} of resamples | {fit.rms:.4f} |")
    assert rows[3] == "| hc | — (needs three shapes with a finished seed) | — | — | — | — |"


OLD = """# Mini-DepthBench summary

## text

| design | L | d | AR | LR | seeds | final val loss (mean ± half-range) | vs Pre-LN (unpaired) | \
Δ vs Pre-LN paired: mean [range], lower on | paired verdict | R_causal |
|---|---|---|---|---|---|---|---|---|---|---|
| preln | 2 | 184 | 92.0 | 1e-3 | 3 | 1.9063 ± 0.0268 | — | — | — | — |
| hc | 2 | 184 | 92.0 | 3e-3 | 3 | 1.8690 ± 0.0144 | -0.0374 (beyond seed spread) | \
-0.0374 [-0.0550, -0.0269], lower on 3/3 | better | — |
| mhc | 2 | 184 | 92.0 | 3e-3 | 3 | 1.8398 ± 0.0218 | -0.0666 (beyond seed spread) | \
-0.0666 [-0.0740, -0.0617], lower on 3/3 | better | — |
| hc | 9 | 88 | 9.8 | 1e-2 | 5 | 1.8193 ± 0.0278 | -0.1188 (beyond seed spread) | \
-0.1188 [-0.1654, -0.0656], lower on 5/5 | better | — |
| keel | 9 | 88 | 9.8 | 1e-2 | 5 | 1.9141 ± 0.0359 | -0.0240 (within seed spread) | \
-0.0240 [-0.0756, +0.0081], lower on 4/5 | mixed | — |
"""


def test_an_older_summary_is_recomputed_where_its_numbers_determine_it(tmp_path, capsys):
    """Three pairs: the middle difference is 3 · mean - min - max (HC at L2: -0.0303), their t interval compare's;
    HC's 'beyond' claim there loses its support (the interval reaches +0.001), mHC's keeps it. Five pairs: bounds over
    every completion the summary allows; HC at L9 is better whatever the unseen values, KEEL unresolved."""
    cells = {(c.design, c.L): c for c in paired_intervals.old_cells(OLD)}
    assert set(cells) == {("hc", 2), ("mhc", 2), ("hc", 9), ("keel", 9)}
    hc = cells[("hc", 2)]
    assert paired_intervals.determined(hc) == pytest.approx([-0.0550, -0.0303, -0.0269])
    assert (hc.verdict, hc.unpaired) == ("better", "beyond")
    interval = compare.t_interval([-0.0550, -0.0303, -0.0269])
    assert interval[0] < 0 < interval[1] and interval[1] == pytest.approx(0.0007, abs=1e-4)
    narrow, wide = paired_intervals.bounds(cells[("hc", 9)])
    assert narrow[1] - narrow[0] < wide[1] - wide[0] and wide[1] < 0
    unknowns = paired_intervals.widest_unknowns(cells[("hc", 9)])
    assert sum(unknowns) == pytest.approx(5 * -0.1188 + 0.1654 + 0.0656)
    assert all(-0.1654 - 1e-9 <= v <= -0.0656 + 1e-9 for v in unknowns)
    (tmp_path / "summary.md").write_text(OLD, encoding="utf-8")
    assert paired_intervals.main([str(tmp_path / "summary.md")]) == 0
    out = capsys.readouterr().out
    assert "- hc at AR 92 (L2): unresolved [-0.075, +0.001], was better, beyond" in out
    assert "mhc at AR 92" not in out.split("## Changed claims")[1].split("## Not recomputed")[0]
    assert "- hc at AR 9.8 (L9) (5 pairs): -0.119, interval between [-0.163, -0.075] and [-0.181, -0.056]: better" in out
    assert "- keel at AR 9.8 (L9) (5 pairs):" in out and out.rstrip().endswith("unresolved (was: mixed, within)")
