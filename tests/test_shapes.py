"""
shapes.py's solver against the paper's Table 3 and the release's own configs, row by row, with every expected number
written here (issue 44): a swapped rounding rule (width grid, SwiGLU rounding, which of two widths is nearer) fails.

    python -m pytest -q tests/test_shapes.py

Sources: Table 3 (the 400M family: docs/designs.md#backbone) and the release's configs/*.json (keyu-wang-2002/
DepthBench: llama_400m_L{16,26,28,32,36,42,50,56,62,70}.json, llama_350M_liger_mhc_linear_l{20,24,30}_*.json,
llama_300m_backbone_L{16,42,70,84}.json), each a LlamaConfig with hidden_size, intermediate_size and head_dim.
"""
import pytest

import shapes

# (L, d, d_ff, head_dim, Pre-LN total at vocab 50,280): Table 3's seven rows, then the release's extra 400M depths
TABLE_3 = [(16, 1216, 3248, 76, 406_534_336), (20, 1120, 2992, 70, 414_087_520), (24, 1024, 2736, 64, 405_406_720),
           (28, 960, 2560, 60, 406_249_920), (32, 896, 2400, 56, 399_358_848), (42, 800, 2144, 50, 404_151_200),
           (70, 640, 1712, 40, 409_229_440)]
RELEASE_400M = [(26, 992, 2656, 62, 407_661_408), (30, 928, 2480, 58, 403_847_968), (36, 864, 2304, 54, 409_433_184),
                (50, 736, 1968, 46, 399_692_896), (56, 704, 1888, 44, 405_189_312), (62, 672, 1792, 42, 403_638_816)]
# the fixed ~300M backbone (302,432,256: L24 d1024's blocks): (L, d, d_ff, backbone params); L56 is released
# (HC, mHC) at the backbone rule's shape, the others are configs/llama_300m_backbone_L*.json
BACKBONE = [(16, 1248, 3328, 299_080_704), (24, 1024, 2736, 302_432_256), (32, 896, 2400, 309_256_192),
            (42, 768, 2048, 297_335_808), (56, 672, 1792, 303_539_712), (70, 608, 1632, 311_964_800),
            (84, 544, 1456, 299_126_016)]


@pytest.mark.parametrize("L, d, d_ff, head_dim, total", TABLE_3 + RELEASE_400M, ids=[f"L{r[0]}" for r in
                                                                                     TABLE_3 + RELEASE_400M])
def test_solver_gives_each_400m_row_by_depth_and_by_aspect_ratio(L, d, d_ff, head_dim, total):
    """At 405M and depth L, the width is the multiple of 32 (16 heads of an even head_dim) whose Pre-LN count is
    nearest the budget, rounded up at L16 (406.5M) and down at L32 (399.4M): a rule that always rounds one way
    fails one of them; the same row comes back when asked by its aspect ratio d / L."""
    by_depth = shapes.solve(405_000_000, layers=L)
    assert (by_depth["d_model"], by_depth["d_ff"], by_depth["head_dim"], by_depth["params"]) == (d, d_ff, head_dim, total)
    by_ar = shapes.solve(405_000_000, ar=d / L)
    assert (by_ar["n_layer"], by_ar["d_model"]) == (L, d)
    for other in (d - 32, d + 32):   # each neighbour on the width grid is farther from the budget
        assert abs(shapes.preln_params(L, other, shapes.ffn_dim(other)) - 405_000_000) > abs(total - 405_000_000)


@pytest.mark.parametrize("L, d, d_ff, backbone", BACKBONE, ids=[f"L{r[0]}" for r in BACKBONE])
def test_solver_gives_each_backbone_row(L, d, d_ff, backbone):
    """The iso-backbone control: the blocks alone nearest 302,432,256 (embeddings on top) at each depth."""
    s = shapes.solve(302_432_256, layers=L, fixed="backbone")
    assert (s["d_model"], s["d_ff"], s["backbone_params"]) == (d, d_ff, backbone)


def test_swiglu_rounding_of_every_release_width():
    """d_ff = 16 * ceil(ceil(8d/3) / 16): up to the next multiple of 16 (992 -> 2645.3 -> 2656, where rounding to
    nearest gives 2640; 1248 -> 3328 exactly, where 8d/3 is whole), for every width above, and the ladder's."""
    widths = {r[1]: r[2] for r in TABLE_3 + RELEASE_400M + BACKBONE}
    widths.update({672: 1792, 768: 2048, 1056: 2816, 1344: 3584})   # the ladder's 200M-500M widths (configs/)
    assert {d: shapes.ffn_dim(d) for d in widths} == widths
    assert shapes.ffn_dim(992) == 2656 and round(8 * 992 / 3 / 16) * 16 == 2640


def test_suite_rows_are_the_rows_above():
    """shapes.SUITES holds Table 3 in its order, then the released L36; the backbone suite its six rows, then L56."""
    assert [(r["n_layer"], r["d_model"], r["d_ff"], r["params"]) for r in shapes.suite_rows("400m")] == [
        (L, d, f, total) for L, d, f, _, total in TABLE_3 + [RELEASE_400M[2]]]
    assert [(r["n_layer"], r["d_model"], r["d_ff"], r["backbone_params"]) for r in shapes.suite_rows(
        "302m-backbone")] == [BACKBONE[i] for i in (0, 1, 2, 3, 5, 6, 4)]


def brute_force(budget, ar, vocab, n_head, max_layers):
    """The solver's rule written as two plain searches: per depth the width (a multiple of 2 n_head, up to 4096)
    whose Pre-LN count is closest to the budget (the narrower of two equally close; up to twice the budget), then the depth whose d/L is
    nearest the AR (ties: the count nearest the budget, then the shallower)."""
    best = None
    for L in range(1, max_layers + 1):
        widths = []
        for d in range(2 * n_head, 4097, 2 * n_head):
            size = shapes.preln_params(L, d, shapes.ffn_dim(d), vocab)
            widths.append((abs(size - budget), d))
            if size > 2 * budget:              # the count grows with d: nothing wider comes closer
                break
        d = min(widths)[1]
        size = shapes.preln_params(L, d, shapes.ffn_dim(d), vocab)
        key = (abs(d / L - ar), abs(size - budget), L)
        if best is None or key < best[0]:
            best = (key, L, d)
    return best[1], best[2]


@pytest.mark.parametrize("budget, ar, vocab, max_layers", [
    (40_000, 30, 64, 256), (40_000, 3, 64, 256), (40_000, 3, 64, 3), (40_000, 80, 500, 256), (40_000, 30, 64, 1),
    (250_000, 9, 256, 256), (20_000, 24, 64, 256)])
def test_solver_is_the_nearest_aspect_ratio_of_the_closest_widths(budget, ar, vocab, max_layers):
    """Small budgets, where every rule shows: the vocab enters the count (500 ids make a narrower model than 64),
    max_layers bounds the depth (L1 and L3 when the AR asks for deeper), a tie in AR goes to the count nearer the
    budget (20k at AR 24: L1 d36, AR 36, 20,268 params, before L2 d24, AR 12, 17,016), and the shape is the brute
    force's."""
    got = shapes.solve(budget, ar=ar, vocab=vocab, n_head=2, max_layers=max_layers, tolerance=None)
    assert (got["n_layer"], got["d_model"]) == brute_force(budget, ar, vocab, 2, max_layers)
    assert got["params"] == shapes.preln_params(got["n_layer"], got["d_model"], got["d_ff"], vocab)


def test_solver_refuses_what_it_cannot_reach_within_its_tolerance():
    """The default tolerance is 10%: AR 60 at 40k params (nearest: L1 d52, AR 52, 13% off) and 10k params at depth 2
    (closest 8,784, 12% off) are refused in one line; tolerance None returns the nearest; `fixed` is checked."""
    with pytest.raises(ValueError, match="comes near AR 60"):
        shapes.solve(40_000, ar=60, vocab=64, n_head=2)
    assert shapes.solve(40_000, ar=60, vocab=64, n_head=2, tolerance=0.2)["n_layer"] == 1
    with pytest.raises(ValueError, match="within 10% of 10,000 total params"):
        shapes.solve(10_000, layers=2, vocab=64, n_head=2)
    assert shapes.solve(10_000, layers=2, vocab=64, n_head=2, tolerance=None)["params"] == 8_784
    with pytest.raises(ValueError, match="fixed must be"):
        shapes.solve(40_000, ar=30, fixed="embeddings")
