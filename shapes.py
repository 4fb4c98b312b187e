"""
The paper's model suites as data, exact parameter counts and a width/depth solver of DepthBench
(docs/training.md#shapes; the counts' formulas: docs/designs.md#backbone).

SUITES holds every shape the paper trains (its configs, not solved). The solver reproduces the 400M rule
for other budgets and depths; its shapes are not the paper's unless they appear in SUITES. Every design
runs at the shape solved from the Pre-LN count (the paper's convention); a design's own extra parameters
come on top and are counted exactly by building the model on the meta device.

    python shapes.py --params 405M --ar 9.1            # -> L=70, d=640, d_ff=1712, 409,229,440 params
    python shapes.py --params 405M --layers 24 --residual mhc
    python shapes.py --suite                           # the paper's suites: 400m, 302m-backbone, ladder, 1.6b
    python shapes.py --suite 1.6b --json               # one suite's rows (shape, KV heads, params, steps)
    python shapes.py --table                           # the solver at 13 depths (7 of them are the paper's 400m)
    python shapes.py --params 300M --fixed backbone --ar 9.1 --json
"""
import json
import math

from depthbench.files.common import ArgParser, positive

N_HEAD = 16
VOCAB = 50280
# depths of `--table`, the solver's family for a budget; only L16, 20, 24, 28, 32, 42, 70 are paper rows (SUITES)
TABLE_LAYERS = [16, 20, 24, 26, 28, 30, 32, 36, 42, 50, 56, 62, 70]
MAX_LAYERS = 1024  # the paper's deepest model has 84 blocks
MAX_PARAMS = 10**12  # the largest budget a count is read as: 1T parameters, 600 x the paper's largest model (1.6B)


def _rows(shapes, steps, label, n_kv_head=N_HEAD, lr=None, designs=None):
    """Suite rows; designs: the designs the authors released at these shapes (None: every design)."""
    return [{"n_layer": L, "d_model": d, "d_ff": f, "n_kv_head": n_kv_head, "steps": steps, "label": label, "lr": lr,
             "designs": designs} for L, d, f in shapes]


_400M = [(16, 1216, 3248), (20, 1120, 2992), (24, 1024, 2736), (28, 960, 2560), (32, 896, 2400), (42, 800, 2144),
         (70, 640, 1712)]
# name -> (what it is in the paper, rows). steps = the official launches' run length (tokens = steps x 512 x 2048);
# lr = one peak LR for every design where the paper used one (1.6b), else None: each design's own (residuals.py).
# Sources (docs/official.md#release): the paper's rows are the repository's configs/README.md tables; the rows with
# `designs` were released as checkpoints at shapes the paper's tables do not list (400M L36, configs/llama_400m_L36
# .json; 300M-backbone L56, the backbone rule at L56), appended so that the row numbers of the paper's rows stay.
# 302m-backbone's L24 and L32 are the 400m shapes (configs/README.md says so), L84 has its own config JSON.
SUITES = {
    "400m": ("Table 3: 405M total at seven aspect ratios, ~8B tokens (+ the released L36)",
             _rows(_400M, 7600, "400M") + _rows([(36, 864, 2304)], 7600, "400M", designs=("hc", "mhc", "attnres"))),
    "302m-backbone": ("Fig. 2 bottom right: a fixed ~300M backbone, embeddings on top (+ the released L56)", _rows(
        [(16, 1248, 3328), (24, 1024, 2736), (32, 896, 2400), (42, 768, 2048), (70, 608, 1632), (84, 544, 1456)],
        7600, "302M backbone") + _rows([(56, 672, 1792)], 7600, "302M backbone", designs=("hc", "mhc"))),
    "ladder": ("Fig. 3 left: 200M-500M, each at AR ~28 / 43 / 75, tokens in proportion",
               _rows([(24, 672, 1792), (18, 768, 2048), (12, 896, 2400)], 3800, "200M")
               + _rows([(28, 800, 2144), (21, 896, 2400), (14, 1056, 2816)], 5700, "300M")
               + _rows([_400M[4], _400M[2], _400M[0]], 7600, "400M")
               + _rows([(34, 992, 2656), (26, 1120, 2992), (17, 1344, 3584)], 9500, "500M")),
    "1.6b": ("Fig. 3 right: 1.6B with grouped-query attention (8 KV heads), d_ff = 3d, ~32B tokens, LR 5e-4",
             _rows([(28, 2048, 6144), (40, 1728, 5184), (54, 1504, 4512)], 30400, "1.6B", n_kv_head=8, lr=5e-4)),
}


def suite_rows(name, vocab=VOCAB):
    """The rows of a suite with every derived number: shape, heads, AR, exact Pre-LN counts, steps, LR."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    rows = []
    for r in SUITES[name][1]:
        L, d, f, kv = r["n_layer"], r["d_model"], r["d_ff"], r["n_kv_head"]
        rows.append({**r, "n_head": N_HEAD, "head_dim": d // N_HEAD, "ar": d / L,
                     "params": preln_params(L, d, f, vocab=vocab, n_kv_head=kv),
                     "backbone_params": backbone_params(L, d, f, n_kv_head=kv)})
    return rows


def suite_row(suite, key, value, vocab=VOCAB):
    """The row of a suite picked by `row` (its number), `layers` (its depth) or `ar` (nearest, within 10%)."""
    rows = suite_rows(suite, vocab)
    listing = ", ".join(f"{k}: L{r['n_layer']} d{r['d_model']}" for k, r in enumerate(rows))
    if key == "row":
        if not 0 <= value < len(rows):
            raise ValueError(f"suite {suite} has rows 0..{len(rows) - 1} ({listing})")
        return rows[value]
    if key == "layers":
        hits = [r for r in rows if r["n_layer"] == value]
    else:  # the nearest AR, within 10%
        gap = min(abs(r["ar"] - value) for r in rows)
        hits = [r for r in rows if abs(r["ar"] - value) < gap + 1e-9 and gap <= 0.1 * value]
    if not hits:
        raise ValueError(f"suite {suite} has no row with {key} {value:g} ({listing})")
    if len(hits) > 1:  # the ladder repeats a depth, and an AR, at several sizes
        raise ValueError(f"suite {suite} has {len(hits)} rows with {key} {value:g}: give --row ({listing})")
    return hits[0]


def ffn_dim(d):
    """SwiGLU hidden size: ceil(8d/3), rounded up to a multiple of 16."""
    return 16 * math.ceil(math.ceil(8 * d / 3) / 16)


def backbone_params(L, d, d_ff, n_kv_head=N_HEAD, n_head=N_HEAD):
    """Blocks only: L * (attention + 3 d d_ff SwiGLU + 2d pre-norm gains). Attention is 2d^2 (W_q, W_o)
    + 2 d d_kv (W_k, W_v), d_kv = d n_kv_head / n_head: 4d^2 for MHA, less with GQA."""
    d_kv = d * n_kv_head // n_head
    return L * (2 * d * d + 2 * d * d_kv + 3 * d * d_ff + 2 * d)


def preln_params(L, d, d_ff, vocab=VOCAB, n_kv_head=N_HEAD, n_head=N_HEAD):
    """Pre-LN total: backbone + embedding + LM head (untied) + final norm."""
    return backbone_params(L, d, d_ff, n_kv_head=n_kv_head, n_head=n_head) + 2 * vocab * d + d


def count_params(L, d, d_ff, residual="preln", vocab=VOCAB, n_head=N_HEAD, n_kv_head=None, **residual_args):
    """Exact total of the built model (meta device: no memory, no init), any registered design; a ValueError past
    MAX_LAYERS blocks, whose modules alone would take minutes to build."""
    import torch
    from model import GPT, GPTConfig
    if L > MAX_LAYERS:
        raise ValueError(f"{L:,} layers: more than the {MAX_LAYERS} blocks this code builds a model of")
    cfg = GPTConfig(vocab_size=vocab, n_layer=L, d_model=d, n_head=n_head, n_kv_head=n_kv_head, d_ff=d_ff,
                    residual=residual, residual_args=residual_args)
    with torch.device("meta"):
        return GPT(cfg).num_params()


def solve(budget, ar=None, layers=None, fixed="total", vocab=VOCAB, max_layers=256, n_head=N_HEAD, tolerance=0.1):
    """The valid shape for a parameter budget and an aspect ratio (or a depth). For every depth L, the
    width is the valid d (a multiple of 2 * n_head: n_head heads of an even head_dim, as RoPE needs; 16
    heads in the paper, 4 in the mini preset: docs/training.md#presets) whose Pre-LN count is closest to
    the budget; then the depth is `layers`, or the L whose d/L is nearest to `ar`. `fixed` is "total"
    (embeddings included, the paper's fixed-total family) or "backbone" (blocks only, the iso-backbone
    control). Returns a dict of the shape; a ValueError (one line) when its AR, or the count that `fixed`
    names, is off by more than `tolerance` (a share; None: return the nearest anyway)."""
    if fixed not in ("total", "backbone"):
        raise ValueError(f"fixed must be 'total' or 'backbone', not {fixed!r}")

    def count(L, d):
        return backbone_params(L, d, ffn_dim(d)) if fixed == "backbone" else preln_params(L, d, ffn_dim(d), vocab)

    def best_width(L):
        # the count grows monotonically in d = k * step: bisect for the first k whose count passes the budget (a
        # scan took 10^5 steps per depth at 10^13 params), then the closer of it and the one before (the smaller
        # of equally close ones)
        step, high = 2 * n_head, 1
        while count(L, high * step) <= budget:
            high *= 2
        low = high // 2  # count(L, low * step) <= budget, or low = 0
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if count(L, mid * step) <= budget else (low, mid)
        widths = [(k * step, count(L, k * step)) for k in (low, high) if k > 0]
        return min(widths, key=lambda w: abs(w[1] - budget))

    depths = [layers] if layers is not None else range(1, max_layers + 1)
    candidates = [(L, *best_width(L)) for L in depths]
    if layers is None:
        # nearest aspect ratio; ties go to the count closest to the budget
        candidates.sort(key=lambda c: (abs(c[1] / c[0] - ar), abs(c[2] - budget)))
    L, d, size = candidates[0]
    if tolerance is not None and layers is None and abs(d / L - ar) > tolerance * ar:
        raise ValueError(f"no valid shape of {budget:,} params comes near AR {ar:g} (nearest: L={L} d={d}, "
                         f"AR {d / L:.2f})")
    if tolerance is not None and abs(size - budget) > tolerance * budget:
        raise ValueError(f"no valid shape at depth {L} comes within {tolerance:.0%} of {budget:,} {fixed} params "
                         f"(closest: d={d}, {size:,})")
    d_ff = ffn_dim(d)
    return {"n_layer": L, "d_model": d, "d_ff": d_ff, "n_head": n_head, "head_dim": d // n_head,
            "ar": d / L, "params": preln_params(L, d, d_ff, vocab), "backbone_params": backbone_params(L, d, d_ff)}


def parse_count(text, flag="--params"):
    """'405M' -> 405_000_000; '1.6B', '300k', '1T', '12345' also work. A ValueError naming `flag` (one line) for text that
    is no count, a count below 1 or one above MAX_PARAMS: every --params of the project is read here."""
    units = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    t = text.strip().lower().replace("_", "").replace(",", "")
    mult = units.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in units else t) * mult
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{flag} {text!r} is not a count like 405M")
    if not 1 <= value <= MAX_PARAMS:
        raise ValueError(f"{flag} {text!r}: a budget from 1 to {MAX_PARAMS:,} parameters (1T; the paper's largest "
                         f"model has 1.6B)")
    return int(round(value))


def describe(shape, residual="preln", vocab=VOCAB):
    """A few lines with every derived number of a shape."""
    L, d, d_ff, total = shape["n_layer"], shape["d_model"], shape["d_ff"], shape["params"]
    preln = preln_params(L, d, d_ff, vocab)
    lines = [f"shape      L={L}  d={d}  d_ff={d_ff}  heads={shape['n_head']}  head_dim={shape['head_dim']}  "
             f"AR=d/L={shape['ar']:.2f}",
             f"backbone   {shape['backbone_params']:,}  ({L} x {backbone_params(1, d, d_ff):,} per block)",
             f"embed+head {2 * vocab * d:,}  (vocab {vocab}, untied) + final norm {d}",
             f"Pre-LN     {preln:,} total"]
    if residual != "preln":
        extra = total - preln
        lines.append(f"{residual:<10} {total:,} total  (+{extra:,} = +{100 * extra / preln:.2f}% design params)")
    return "\n".join(lines)


def print_suite(args, fail):
    """--suite: the list of suites, or one suite's rows (params: the exact total of --residual)."""
    if not args.suite:
        for name, (about, rows) in SUITES.items():
            print(f"{name:<14} {len(rows):>2} rows  {about}")
        return
    if args.suite not in SUITES:
        fail(f"unknown suite {args.suite!r}; choose from {', '.join(SUITES)}")
    rows = suite_rows(args.suite, args.vocab)
    for r in rows:
        r["params"] = count_params(r["n_layer"], r["d_model"], r["d_ff"], args.residual, vocab=args.vocab,
                                   n_kv_head=r["n_kv_head"])
    if args.json:
        keys = ["n_layer", "d_model", "d_ff", "n_head", "n_kv_head", "params", "backbone_params", "steps", "lr",
                "designs"]
        print(json.dumps([{k: r[k] for k in keys} for r in rows]))
        return
    print(f"{args.suite}: {SUITES[args.suite][0]}")
    print(f"{'row':>3} {'size':>13} {'L':>4} {'d':>6} {'d_ff':>6} {'kv':>3} {'d/L':>6} {'backbone':>14} "
          f"{'total':>14} {'steps':>7}  designs ({args.residual})")
    for k, r in enumerate(rows):
        released = ",".join(r["designs"] or ["all"])
        print(f"{k:>3} {r['label']:>13} {r['n_layer']:>4} {r['d_model']:>6} {r['d_ff']:>6} {r['n_kv_head']:>3} "
              f"{r['ar']:>6.1f} {r['backbone_params']:>14,} {r['params']:>14,} {r['steps']:>7,}  {released}")


def main(argv=None):
    from residuals import RESIDUALS
    p = ArgParser(prog="shapes.py", description="Parameter counts and the width/depth solver of DepthBench.")
    p.add_argument("--params", default="405M", help="parameter budget, e.g. 405M, 1.6B (default 405M)")
    p.add_argument("--fixed", choices=["total", "backbone"], default="total",
                   help="what the budget counts: total (embeddings included) or backbone (blocks only)")
    p.add_argument("--ar", type=positive(float), help="target aspect ratio d_model / n_layer (e.g. 42.67, 9.1)")
    p.add_argument("--layers", type=positive(), help="target depth (instead of --ar)")
    p.add_argument("--residual", default="preln", help=f"design whose exact total to report: {', '.join(RESIDUALS)}")
    p.add_argument("--vocab", type=positive(), default=VOCAB, help="vocabulary size (default 50280, the paper's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--table", action="store_true", help="print the solver's shapes at 13 depths for this budget")
    p.add_argument("--suite", nargs="?", const="", help="print a suite of the paper's shapes (no name: list them)")
    args = p.parse_args(argv)
    fail = p.error
    try:
        budget = parse_count(args.params)
    except ValueError as e:
        fail(str(e))
    if args.residual not in RESIDUALS:
        fail(f"unknown residual {args.residual!r}; choose from {', '.join(RESIDUALS)}")

    if args.suite is not None:
        return print_suite(args, fail)
    if args.table:
        rows = []
        for L in TABLE_LAYERS:
            s = solve(budget, layers=L, fixed=args.fixed, vocab=args.vocab, tolerance=None)
            s["params"] = count_params(L, s["d_model"], s["d_ff"], args.residual, vocab=args.vocab)
            rows.append(s)
        if args.json:
            print(json.dumps(rows))
            return
        print(f"{'L':>4} {'d':>6} {'d_ff':>6} {'hd':>4} {'d/L':>6} {'backbone':>14} {'total':>14}  ({args.residual})")
        for s in rows:
            print(f"{s['n_layer']:>4} {s['d_model']:>6} {s['d_ff']:>6} {s['head_dim']:>4} {s['ar']:>6.1f} "
                  f"{s['backbone_params']:>14,} {s['params']:>14,}")
        return

    if (args.ar is None) == (args.layers is None):
        fail("give exactly one of --ar and --layers (or --table)")
    try:
        shape = solve(budget, ar=args.ar, layers=args.layers, fixed=args.fixed, vocab=args.vocab)
        shape["params"] = count_params(shape["n_layer"], shape["d_model"], shape["d_ff"], args.residual,
                                       vocab=args.vocab)
    except ValueError as e:
        fail(str(e))
    keys = ["n_layer", "d_model", "d_ff", "n_head", "head_dim", "ar", "params", "backbone_params"]
    if args.json:
        print(json.dumps({k: shape[k] for k in keys}))
    else:
        print(describe(shape, args.residual, args.vocab))


if __name__ == "__main__":
    main()
