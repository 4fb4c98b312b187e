"""
The 95% paired intervals of a mini suite summary.md written before issue 43 (docs/mini_summary.md), recomputed from
its per-cell table, which gives each cell's paired differences from Pre-LN only as mean [min, max], lower on k/n:

    python scripts/paired_intervals.py docs/mini_summary.md        # markdown: the grid, the changes, the rest

A summary written since lists every seed's loss and the intervals themselves; this is for the older ones.

- Two or three pairs: the differences are determined, min and max and (with three) 3 · mean - min - max, each to the
  summary's four decimals (the middle one to ±0.00025). Their t interval and verdict are
  depthbench/evaluation/compare.py's.
- Four or more (the ten-design suite's five seeds at L9): n - 2 differences are unknown, only their sum (n · mean -
  min - max) and their bounds [min, max] are. The interval's width then lies between the one with the unknown
  values equal (narrowest) and the one with as many as fit at min or max (widest: the sum of squares is largest at
  a corner). The verdict is determined only where both give the same; else the cell needs its per-seed losses.

A row with a diverged seed is listed, not recomputed. The older summary's claims are given beside the new verdict:
its paired verdict (better/worse only where every seed agreed) and its unpaired "beyond seed spread".
"""
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from depthbench.evaluation import compare  # noqa: E402
from depthbench.files.common import ArgParser, fail  # noqa: E402
from depthbench.reports.suite_tables import shape_name  # noqa: E402

HEAD = "Δ vs Pre-LN paired: mean [range], lower on"  # the older per-cell table's paired column
PAIRED = re.compile(r"([+-]\d+\.\d+) \[([+-]\d+\.\d+), ([+-]\d+\.\d+)\], lower on (\d+)/(\d+)")


@dataclass
class OldCell:
    """One row of the older per-cell table, a design against Pre-LN at one shape."""
    design: str     # the design's registry key
    L: int          # n_layer
    d: int          # d_model
    mean: float     # the mean of the paired differences
    low: float      # their least
    high: float     # their greatest
    lower: int      # on how many pairs the design is lower
    n: int          # the pairs (seeds both ran)
    verdict: str    # the older paired verdict: better / worse only where every pair agreed, else mixed
    unpaired: str   # 'beyond' or 'within' (the seed ranges overlap or not), or '' when not given
    note: str = ""  # why the row is not recomputed ('' when it is)


def table_rows(text):
    """(header cells, [row cells]) of the first Markdown table whose header has HEAD; None when there is none."""
    lines = text.splitlines()
    for k, line in enumerate(lines):
        if line.startswith("|") and HEAD in line:
            rows = []
            for row in lines[k + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([cell.strip() for cell in row.strip("|").split("|")])
            return [cell.strip() for cell in line.strip("|").split("|")], rows
    return None


def old_cells(text):
    """Every OldCell of a summary's first per-cell table (Pre-LN's rows have no difference: left out); None when the
    text has no such table."""
    found = table_rows(text)
    if found is None:
        return None
    head, rows = found
    col = {name: head.index(name) for name in ("design", "L", "d", "seeds", HEAD)}
    out = []
    for row in rows:
        match = PAIRED.fullmatch(row[col[HEAD]].split(" (diverged")[0])
        if not match:
            continue
        mean, low, high = (float(v) for v in match.groups()[:3])
        unpaired = next((word for word in ("beyond", "within") if f"({word} seed spread)" in " ".join(row)), "")
        verdict = row[head.index("paired verdict")] if "paired verdict" in head else ""
        cell = OldCell(design=row[col["design"]], L=int(row[col["L"]]), d=int(row[col["d"]]), mean=mean, low=low,
                       high=high, lower=int(match.group(4)), n=int(match.group(5)), verdict=verdict, unpaired=unpaired)
        if "diverged" in row[col["seeds"]] or "diverged" in row[col[HEAD]]:
            cell.note = "a seed diverged: not recomputed"
        out.append(cell)
    return out


def determined(cell):
    """The paired differences of a cell with two or three pairs, from its mean, least and greatest; None with more."""
    if cell.n == 2:
        return [cell.low, cell.high]
    if cell.n == 3:
        return [cell.low, 3 * cell.mean - cell.low - cell.high, cell.high]
    return None


def widest_unknowns(cell):
    """The n - 2 unknown differences of a cell with n >= 4 that sum to n · mean - min - max, each in [min, max], with
    the largest sum of squares: k at max, the rest at min but one, which takes what is left."""
    k_free, total = cell.n - 2, cell.n * cell.mean - cell.low - cell.high
    best = None
    for at_high in range(k_free):
        rest = total - at_high * cell.high - (k_free - 1 - at_high) * cell.low
        if cell.low - 1e-9 <= rest <= cell.high + 1e-9:
            values = [cell.high] * at_high + [cell.low] * (k_free - 1 - at_high) + [rest]
            if best is None or sum(v * v for v in values) > sum(v * v for v in best):
                best = values
    return best


def bounds(cell):
    """(narrowest, widest) 95% t interval of a cell with n >= 4 over every set of unknown differences its summary
    allows (narrowest: the unknowns equal, their mean)."""
    k_free = cell.n - 2
    middle = (cell.n * cell.mean - cell.low - cell.high) / k_free
    narrow = compare.t_interval([cell.low, cell.high] + [middle] * k_free)
    wide = compare.t_interval([cell.low, cell.high] + (widest_unknowns(cell) or [middle] * k_free))
    return narrow, wide


def old_claim(cell):
    """The older summary's words for a cell: 'better, beyond' (its paired verdict, its unpaired spread)."""
    return ", ".join(word for word in (cell.verdict, cell.unpaired) if word)


def interval_words(interval):
    return f"[{interval[0]:+.3f}, {interval[1]:+.3f}]"


def grid(cells):
    """The recomputed grid: design x shape (the determined cells), the mean, its interval and verdict, the count lower,
    and the older claim in brackets."""
    shapes = sorted({(c.L, c.d) for c in cells if determined(c) and not c.note})
    designs = list(dict.fromkeys(c.design for c in cells))
    lines = ["| design | " + " | ".join(shape_name(L, d) for L, d in shapes) + " |", "|" + "---|" * (len(shapes) + 1)]
    by_key = {(c.design, c.L, c.d): c for c in cells}
    for name in designs:
        cols = []
        for L, d in shapes:
            cell = by_key.get((name, L, d))
            if cell is None or cell.note:
                cols.append("—")
                continue
            interval = compare.t_interval(determined(cell))
            said = compare.interval_verdict(interval)
            cols.append(f"{cell.mean:+.3f} {interval_words(interval)}, {said}, lower on {cell.lower}/{cell.n} "
                        f"(was: {old_claim(cell)})")
        lines.append(f"| {name} | " + " | ".join(cols) + " |")
    return lines


def changes(cells):
    """One line per determined cell where the verdict by interval differs from the older paired verdict, or from
    the unpaired 'beyond' claim."""
    lines = []
    for cell in cells:
        values = determined(cell)
        if values is None or cell.note:
            continue
        interval = compare.t_interval(values)
        said = compare.interval_verdict(interval)
        moved = (cell.verdict in ("better", "worse") and said != cell.verdict) or (cell.unpaired == "beyond" and
                                                                                  said == "unresolved")
        gained = said != "unresolved" and cell.verdict not in ("better", "worse")
        if moved or gained:
            lines.append(f"- {cell.design} at {shape_name(cell.L, cell.d)}: {said} {interval_words(interval)}, "
                         f"was {old_claim(cell)} (differences {', '.join(f'{v:+.4f}' for v in values)})")
    return lines


def open_cells(cells):
    """One line per cell that cannot be recomputed: its verdict by interval where the summary fixes it anyway (the
    narrowest and the widest interval it allows agree), else 'undetermined'; and the diverged rows."""
    lines = []
    for cell in cells:
        if cell.note:
            lines.append(f"- {cell.design} at {shape_name(cell.L, cell.d)}: {cell.note}")
            continue
        if determined(cell) is not None:
            continue
        narrow, wide = bounds(cell)
        verdicts = {compare.interval_verdict(narrow), compare.interval_verdict(wide)}
        said = verdicts.pop() if len(verdicts) == 1 else "undetermined"
        lines.append(f"- {cell.design} at {shape_name(cell.L, cell.d)} ({cell.n} pairs): {cell.mean:+.3f}, interval "
                     f"between {interval_words(narrow)} and {interval_words(wide)}: {said} (was: {old_claim(cell)})")
    return lines


def build_parser():
    p = ArgParser(prog="paired_intervals.py", description="95% paired intervals from an older mini suite summary.md.")
    p.add_argument("summary", type=Path, help="a summary.md of mini.py --report from before issue 43")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        text = args.summary.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        fail("paired_intervals.py", f"{args.summary}: cannot read it ({type(e).__name__})")
    cells = old_cells(text)
    if not cells:
        fail("paired_intervals.py", f"{args.summary}: no per-cell table with a column '{HEAD}' and a row to "
             "recompute (a summary.md written since issue 43 lists the intervals itself)")
    print("\n".join(["## Recomputed (determined cells)", "", *grid(cells), "", "## Changed claims", "",
                     *(changes(cells) or ["- none"]), "", "## Not recomputed", "", *(open_cells(cells) or ["- none"])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
