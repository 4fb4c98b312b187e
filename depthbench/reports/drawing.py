"""
drawing.py: what every figure of plot.py, plot_eval.py, plot_suite.py and plot_telemetry.py shares: the JSON they read
(SCHEMAS and the field types, load_folder), the look (each design's name and colour, line styles, colour maps), the
panel helpers (grid, save, heatmap, the aspect-ratio axis, per_model and overlay frames) and the command line that
draws a list of figures from a folder (main). A new figure is a fig_xxx(data, out_path, svg=False) in one of those
files, drawn with these. No torch here: plotting works on any machine that has the JSON, numpy and matplotlib.
"""
import math
import os
from pathlib import Path

import numpy as np
import matplotlib
matplotlib.use("Agg")  # files only, never a window: works headless, in tests and over ssh
import matplotlib.pyplot as plt
from matplotlib import colors, ticker

from depthbench.files import common, runlog
from depthbench.files.common import ArgParser, JsonError, first_line, load_json

# ----------------------------------------------------------------------------- the contract and the look

# schema name -> the versions this file can draw. Another version is skipped loudly, never guessed at.
# diagnose/1 said R_perm for all pairs and R_perm_last34 for the last three quarters; load_folder reads it as /2.
SCHEMAS = {"depthbench.train": (1,), "depthbench.diagnose": (1, 2), "depthbench.profile": (1,)}
# Fig. 6 of the paper (400M, L32, 8B tokens), pairs in the last three quarters, in %
PAPER_FIG6 = {"R_causal": {"preln": 1, "hc": 7, "attnres": 16}, "R_perm": {"preln": 8, "hc": 35, "attnres": 46}}

# registry key -> (display name, colour). One colour per design in every figure, so a reader learns it once.
# Hues loosely follow families, one a line: norm placement (grey/brown/olive/purple/pink), HC (blues), AttnRes
# (red/orange), MoDA (green).
DESIGNS = {"preln": ("Pre-LN", "#4d4d4d"), "sandwich": ("Sandwich-LN", "#8c564b"), "lns": ("LNS", "#bcbd22"),
           "deepnorm": ("DeepNorm", "#9467bd"), "keel": ("KEEL", "#e377c2"),
           "hc": ("HC", "#1f77b4"), "mhc": ("mHC", "#17becf"),
           "attnres": ("Full AttnRes", "#d62728"), "block_attnres": ("Block AttnRes", "#ff7f0e"),
           "moda": ("MoDA", "#2ca02c")}
STYLES = ["-", "--", ":", "-."]  # line styles tell depths or LRs apart where colour already means design
# seeds of one design, told apart within its colour: seed k in shade SEED_SHADES[k] (< 0 towards black, > 0 towards
# white; seed 0 the design's own colour) with marker SEED_MARKERS[k], the same in every figure (seed_look)
SEED_SHADES = (0.0, -0.45, 0.45, -0.7, 0.7)
SEED_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
FLOP_UNITS = [(1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1, "FLOP")]
BYTE_UNITS = [(1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B")]
# the reference heatmaps' colour maps: causal white -> blues, permutation navy -> cream -> dark red
CAUSAL_CMAP = colors.LinearSegmentedColormap.from_list("causal", ["white", "#9bd4e5", "#0072b2", "#08306b"])
PERM_CMAP = colors.LinearSegmentedColormap.from_list("perm", ["#0b3c78", "#f7f3ec", "#7b001c"])


def display(res):
    return DESIGNS.get(res, (str(res), None))[0]


def colour(res):
    return DESIGNS.get(res, (None, "#7f7f7f"))[1]  # an unregistered design still draws, in grey


def design_order(res):
    return list(DESIGNS).index(res) if res in DESIGNS else len(DESIGNS)


def seed_of(meta):
    """The training seed of a train config or a diagnose meta (load_folder's run_seed: the run.json's beside it; else
    its own seed, the run's unless diagnose.py was given --seed), or None."""
    seed = meta.get("run_seed", meta.get("seed"))
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def seed_look(res, seed):
    """{color, marker} of a design's seed: its colour in the seed's shade, the seed's marker (SEED_SHADES,
    SEED_MARKERS); a run of no known seed in the design's colour, marker 'o'."""
    if seed is None:
        return {"color": colour(res), "marker": "o"}
    rgb, shade = np.array(colors.to_rgb(colour(res))), SEED_SHADES[seed % len(SEED_SHADES)]
    target = np.ones(3) if shade > 0 else np.zeros(3)
    return {"color": tuple(rgb + abs(shade) * (target - rgb)), "marker": SEED_MARKERS[seed % len(SEED_MARKERS)]}


# ----------------------------------------------------------------------------- loading

# The fields the figures read whose JSON type matters, per kind (a train JSON's: depthbench/files/runlog.py, the reader
# train.py and mini.py use): a file where one holds another type is skipped with one line naming it, so it costs
# itself, not a figure. A null field counts as missing (each figure handles that); a null item of a list or object
# does not. "a.b" is field b of object a, "a.[]" each item of list a, "a.*" each value of object a. Numbers are not
# listed: num() reads junk as nan. Parents come before their fields: the message names the outermost odd field.
FIELD_TYPES = {
    "diagnose": [("meta", dict), ("angular_distance", dict), ("causal_score", dict), ("permutation_score", dict),
                 ("logit_lens", dict), ("logit_lens.states", list), ("layer_pruning", dict),
                 ("layer_pruning.layers", list), ("attnres_weights", dict), ("transport_erank", dict),
                 ("transport_erank.per_connector", list), ("dead_zone", dict), ("dead_zone.schedule", list),
                 ("dead_zone.dead", list), ("nll", dict), ("nll.categories", dict), ("nll.categories.*", dict)],
    "profile": [("rows", list)],
}


def odd_field(value, parts, want, where=""):
    """(path, value) of the first field along `parts` (["evals", "[]", "per_level"]) under `value` that is not a
    `want`, else None. A named field may be null (missing); an item of a list or object may not. A container of the
    wrong type on the way is left to its own entry."""
    if not parts:
        return None if isinstance(value, want) else (where, value)
    head, rest = parts[0], parts[1:]
    if head == "[]" and isinstance(value, list):
        children = [(f"{where}[{i}]", item) for i, item in enumerate(value)]
    elif head == "*" and isinstance(value, dict):
        children = [(f"{where}.{key}", item) for key, item in value.items()]
    elif head not in ("[]", "*") and isinstance(value, dict) and value.get(head) is not None:
        children = [(f"{where}.{head}".lstrip("."), value[head])]
    else:
        return None
    for path, child in children:
        found = odd_field(child, rest, want, path)
        if found:
            return found
    return None


def check_schema(obj):
    """Return (kind, None) for a JSON this file can draw, else (None, reason to print)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("schema"), str):
        return None, "no 'schema' field (not a depthbench JSON)"
    name, _, version = obj["schema"].rpartition("/")
    if name not in SCHEMAS:
        return None, f"unknown schema {obj['schema']!r}"
    if version not in map(str, SCHEMAS[name]):
        return None, f"schema {obj['schema']}, this plot.py reads version {', '.join(map(str, SCHEMAS[name]))}"
    kind = name.split(".")[1]
    if kind == "train" and (why := runlog.problem(obj)):  # the one reader of run.json
        return None, f"schema {obj['schema']} but {why}"
    for field, want in FIELD_TYPES.get(kind, []):
        found = odd_field(obj, field.split("."), want)
        if found:
            path, value = found
            got, wanted = common.json_name(value), common.JSON_NAMES[want]
            return None, f"schema {obj['schema']} but field {path!r} is {got}, not {wanted}"
    # only what every figure of this kind needs; all other fields are optional and checked per figure
    key = {"train": "config", "diagnose": "meta", "profile": "rows"}[kind]
    value = obj.get(key)
    if kind == "profile":
        usable = isinstance(value, list)
    else:
        usable = isinstance(value, dict) and isinstance(value.get("residual"), str)
    return (kind, None) if usable else (None, f"schema {obj['schema']} but no usable {key!r}")


def load_folder(folder):
    """Read folder/**/*.json -> (data by kind, [(path, reason) for every file skipped]). Linked run folders are
    followed (mini.py links a cell's first seed in from its LR sweep)."""
    folder = Path(folder)
    data, skipped = {"train": [], "diagnose": [], "profile": []}, []
    walk, seen = os.walk(folder, followlinks=True), set()
    for path in sorted(Path(root) / f for root, _, files in walk for f in files if f.endswith(".json")):
        if path.resolve() in seen:  # a linked run is also under its sweep folder: read it once
            continue
        seen.add(path.resolve())
        rel = str(path.relative_to(folder))
        try:
            obj = load_json(path)  # the project's one JSON reader: every fault one line, deep nesting included
        except (OSError, JsonError) as e:
            skipped.append((rel, f"not valid JSON ({first_line(e)})"))
            continue
        kind, reason = check_schema(obj)
        if kind is None:
            skipped.append((rel, reason))
            continue
        obj["_path"], perm = rel, obj.get("permutation_score")
        if obj["schema"] == "depthbench.diagnose/1" and isinstance(perm, dict) and "R_perm" in perm:
            # /1 -> /2 names: the headline R_perm is the last three quarters' share, all pairs move to R_perm_all
            # (a /1 file without R_perm_last34 has no headline: it draws as missing)
            perm["R_perm_all"], perm["R_perm"] = perm["R_perm"], perm.get("R_perm_last34")
        data[kind].append(obj)
    link_run_seeds(data)
    return data, skipped


def link_run_seeds(data):
    """Each diagnose JSON's meta gets "run_seed", the seed of the train JSON in its folder (the run it diagnosed), for
    its title (label): its own "seed" seeds the windows, the run's only by default."""
    seeds = {Path(r["_path"]).parent: r["config"].get("seed") for r in data["train"]}
    for g in data["diagnose"]:
        seed = seeds.get(Path(g["_path"]).parent)
        if seed is not None:
            g["meta"]["run_seed"] = seed


# ----------------------------------------------------------------------------- small helpers

def num(x):
    """JSON value -> float, with null / missing / junk -> nan, so it drops out of nanmin/nanmean."""
    try:
        return math.nan if x is None or isinstance(x, bool) else float(x)
    except (TypeError, ValueError):
        return math.nan


def matrix(rows):
    """(Possibly ragged) list of lists with nulls -> float array with nulls masked (drawn blank)."""
    if not isinstance(rows, list):
        rows = []
    rows = [r if isinstance(r, list) else [] for r in rows]
    a = np.full((len(rows), max((len(r) for r in rows), default=0)), np.nan)
    for i, r in enumerate(rows):
        a[i, :len(r)] = [num(v) for v in r]
    return np.ma.masked_invalid(a)


def finite(m):
    v = np.ma.compressed(m)
    return v[np.isfinite(v)]


def metric(doc, key):
    """A diagnose JSON's metric object, or None when it is absent or {"skipped": reason}."""
    m = doc.get(key)
    return m if isinstance(m, dict) and "skipped" not in m else None


def with_metric(data, *paths):
    """Diagnose JSONs having any of the metrics "key" or "key.field" (not null or empty), by design then depth."""
    def has(g, path):  # a field of 0 counts (R_causal 0%), an empty list or null does not
        key, _, field = path.partition(".")
        value = (metric(g, key) or {}).get(field) if field else metric(g, key)
        return value is not None and value != [] and value != {}
    docs = [g for g in data.get("diagnose", []) if any(has(g, p) for p in paths)]
    return sorted(docs, key=lambda g: (design_order(g["meta"]["residual"]), shape(g["meta"])[1]))


def shape(cfg):
    """(residual, n_layer, d_model, ar) from a train config, diagnose meta or profile row."""
    L, d, ar = num(cfg.get("n_layer")), num(cfg.get("d_model")), num(cfg.get("ar"))
    L = int(L) if math.isfinite(L) else 0
    if math.isnan(ar) and L:
        ar = d / L
    return cfg.get("residual"), L, d, round(ar, 3)  # rounded so 32.0 and 32.0000001 are one point


def asked_ars(runs):
    """{AR as shape() rounds it: the --ar values asked for it (train configs' ar_asked) where they differ from the AR as
    a run folder names it}: --ar 9.1 solves to L9 d88, AR 9.78, and the figures say both."""
    out = {}
    for r in runs:
        ar, asked = shape(r["config"])[3], num(r["config"].get("ar_asked"))
        if math.isfinite(asked) and f"{asked:g}" != f"{round(ar, 2):g}":
            out.setdefault(ar, set()).add(asked)
    return out


def ar_text(ar, asked=(), sep=", "):
    """'9.78', or '9.78, asked 9.1': an AR as its run folder names it, and the --ar asked where it differs (asked_ars)
    after `sep`."""
    text = f"{round(ar, 2):g}"
    if asked:
        text += sep + asked_text(asked)
    return text


def asked_text(asked):
    """'asked 9.1': the --ar values asked for a shape (asked_ars)."""
    return f"asked {', '.join(f'{a:g}' for a in sorted(asked))}"


def label(meta):
    """A run's name in a title or a legend: 'Pre-LN L9 d88 seed 0' (design, shape, seed_of), 'Pre-LN' without a
    shape."""
    res, L, d, ar = shape(meta)
    if not L:
        return display(res)
    seed = seed_of(meta)
    return f"{display(res)} L{L} d{d:g}" + ("" if seed is None else f" seed {seed}")


def grid(n, ncols=4, w=3.8, h=3.2):
    """n panels in rows of ncols; returns (fig, list of n axes)."""
    ncols, nrows = max(1, min(ncols, n)), math.ceil(n / max(1, min(ncols, n)))
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat[:n])


def save(fig, out_path, svg, drew, title=None, legend=None, **extra):
    """Finish a figure and write it (PNG; with svg an SVG too) -> its result {"drew": drew, **extra}. title: above
    the panels; legend = (ax, axes): right of ax, one entry per label over all of axes (repeated bars and markers
    share labels)."""
    uniq = {}
    for a in legend[1] if legend else []:
        for h, lab in zip(*a.get_legend_handles_labels()):
            uniq.setdefault(lab, h)
    if uniq:
        legend[0].legend(uniq.values(), uniq.keys(), fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if title:
        fig.suptitle(title)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_path, dpi=150)
    if svg:
        fig.savefig(out_path.with_suffix(".svg"))
    plt.close(fig)
    return {"drew": drew, **extra}


def ar_axis(ax, ars, asked=None):
    """Log x axis of aspect ratio, inverted so wide-shallow is on the left and deep-narrow on the right; each tick the
    AR as a run folder names it, with the --ar asked beneath where it differs (asked: asked_ars)."""
    ax.set_xscale("log")
    ars = sorted(set(a for a in ars if math.isfinite(a) and a > 0))
    if ars:
        ax.set_xticks(ars, [ar_text(a, (asked or {}).get(a, ()), sep="\n") for a in ars])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_xlim(max(ars) * 1.15, min(ars) / 1.15)  # (left, right) = (wide, deep): inverted on purpose
    ax.set_xlabel("aspect ratio d_model / n_layer (log scale; deeper →)")
    ax.grid(alpha=0.3)


def by_design(points):
    """{(res, x): [y, ...]} -> {res: (xs, mean, min, max)} sorted by x, ignoring nan ys."""
    out = {}
    for (res, x), ys in sorted(points.items(), key=lambda kv: (design_order(kv[0][0]), kv[0][1])):
        ys = [y for y in ys if math.isfinite(y)]
        if ys:
            for col, v in zip(out.setdefault(res, ([], [], [], [])), (x, np.mean(ys), min(ys), max(ys))):
                col.append(v)
    return out


def heatmap(ax, m, cmap, title, xlabel, ylabel, vmin=None, top=100, **kw):
    """imshow with integer ticks and a colour bar, the colours from vmin (default: the least value) to the top-th
    percentile (default: the largest) of m's finite values; nothing when it has none."""
    v = finite(m)
    if not v.size:
        return
    norm = colors.Normalize(v.min() if vmin is None else vmin, float(np.percentile(v, top)))
    im = ax.imshow(m, cmap=cmap, norm=norm, interpolation="nearest", **kw)
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)


def unit(values, table):
    """The largest (scale, name) in table that the data reaches, e.g. (1e12, "TFLOP") vs (1e9, "GFLOP")."""
    top = max((v for v in values if math.isfinite(v)), default=0)
    return next(((s, u) for s, u in table if top >= s), table[-1])


def per_model(data, paths, out_path, svg, title, draw, panels=1, **size):
    """Frame of the per-model figures: `panels` panels per diagnose JSON that has any metric in `paths`;
    draw(g, axes) fills one model's panels."""
    docs = with_metric(data, *paths)
    if not docs:
        return {"skipped": f"no diagnose JSON with {' or '.join(paths)}"}
    fig, axes = grid(panels * len(docs), **size)
    for i, g in enumerate(docs):
        draw(g, axes[panels * i:panels * (i + 1)])
    return save(fig, out_path, svg, f"{len(docs)} model(s)", title=title)


def overlay(data, path, out_path, svg, title, draw, ncols=1, **size):
    """Frame of the figures that overlay models in one row of `ncols` panels, the legend right of the last:
    draw(docs, style, axes) draws the diagnose JSONs having `path`, style(g) = a line style per depth (colour
    already means design)."""
    docs = with_metric(data, path)
    if not docs:
        return {"skipped": f"no diagnose JSON with {path}"}
    styles = {L: STYLES[i % len(STYLES)] for i, L in enumerate(sorted({shape(g["meta"])[1] for g in docs}))}
    fig, axes = plt.subplots(1, ncols, squeeze=False, **size)
    draw(docs, lambda g: styles[shape(g["meta"])[1]], list(axes.flat))
    legend = (axes.flat[-1], axes.flat[-1:])
    return save(fig, out_path, svg, f"{len(docs)} model(s)", title=title, legend=legend)


# ----------------------------------------------------------------------------- a run's loss

def final_val(run):
    """A run's final validation loss: final.val_loss, else the last eval's, else nan."""
    v = num((run.get("final") or {}).get("val_loss"))
    last = (run.get("evals") or [None])[-1]
    return num(last.get("val_loss")) if math.isnan(v) and isinstance(last, dict) else v


def seed_losses(runs):
    """What common.best_lr scores for one LR's runs (the seeds): each finished run's final val loss, None for each
    diverged run. An unfinished run (killed or still going) would bring a too-early loss, and a finished one without
    a finite loss has none to give: both are left out."""
    losses = []
    for r in runs:
        if r.get("diverged"):
            losses.append(None)
        elif r.get("finished", True) and math.isfinite(final_val(r)):
            losses.append(final_val(r))
    return losses


# ----------------------------------------------------------------------------- the command line

def main(argv, figures, prog):
    """The command line of plot.py and of its sister scripts (plot_suite, plot_telemetry): read a folder of JSON
    (load_folder), draw each of `figures` ((file name, fig function) pairs) into --out, and say what each drew or
    why it skipped. A figure that fails costs itself, not the others: exit code 1 then."""
    parser = ArgParser(prog=prog, description="Draw DepthBench figures from a folder of JSON results.")
    parser.add_argument("runs_dir", type=Path, help="folder searched recursively for *.json (train/diagnose/profile)")
    parser.add_argument("--out", type=Path, default=Path("figs"), help="folder for the figures (created if missing)")
    parser.add_argument("--svg", action="store_true", help="also write an SVG next to each PNG")
    args = parser.parse_args(argv)
    if not args.runs_dir.is_dir():
        parser.error(f"runs_dir {str(args.runs_dir)!r} is not a folder")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} exists and is not a folder")
    if why := common.cannot_write(args.out / f"{figures[0][0]}.png"):  # before drawing, not once per figure
        parser.error(f"--out {str(args.out)!r}: {why}")

    data, skipped = load_folder(args.runs_dir)
    print(f"read {args.runs_dir}: " + ", ".join(f"{len(v)} {k}" for k, v in data.items())
          + f"; {len(skipped)} file(s) skipped")
    for path, reason in skipped:
        print(f"  skipped {path}: {reason}")
    failed = 0
    for name, fn in figures:
        out = args.out / f"{name}.png"
        try:
            info = fn(data, out, svg=args.svg)
        except Exception as e:  # one odd field should cost one figure, not the whole run; but say so loudly
            print(f"{name}: FAILED ({type(e).__name__}: {e})")
            failed += 1
            continue
        print(f"{name}: skipped ({info['skipped']})" if "skipped" in info else f"{name}: {out} ({info['drew']})")
    return 1 if failed else 0
