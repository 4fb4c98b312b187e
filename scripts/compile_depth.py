"""How torch.compile's cost grows with depth, per design: the first training step with a cold inductor cache
(compile included), the steady step after it, and the number of graphs dynamo made, for each design, depth,
compile scope (train.py's --compile-scope) and kernels value. docs/speed.md#compile holds the measured table.

Every measurement runs in a fresh process, single-threaded, with its own empty inductor cache; --jobs of them run
side by side (on a 2-core machine two 1-thread runs beat one 2-thread run). A row that takes longer than --timeout
is stopped and reported as such. Examples:

    python scripts/compile_depth.py --designs all --layers 8,24,70 --scope blocks --out blocks.json
    python scripts/compile_depth.py --designs preln,mhc --layers 8 --scope model --out model.json
    python scripts/compile_depth.py --report blocks.json model.json       # the markdown table of saved rows
    python scripts/compile_depth.py --ratios --layers 8 --d 256 --out ratios.json   # which kernels compiled

--scopes compares, per design in one process, the two compile scopes: the first step of each (each compiles its
own graphs; the whole-model one first) and the steady steps timed in turn: per-block over whole-model.
--ratios measures, per design in one process, Pre-LN (fast kernels), the design with fast kernels and with the
reference ones, all compiled per block, timed in turn (profile_gpu.interleaved): each step over Pre-LN's.

The step is forward + loss + backward (no optimizer) on a fixed random batch, the logits-free loss as in training.
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from depthbench.files.common import ArgParser, comma_list, fail, write_json  # noqa: E402
from residuals import PAPER_DESIGNS, RESIDUALS  # noqa: E402


def measure(job):
    """In this (fresh) process: {first_s, steady_ms, graphs} of one job."""
    import torch
    from torch._dynamo.utils import counters

    import profile_gpu
    from depthbench.training.compiled import compile_model
    torch.set_num_threads(1)
    model = profile_gpu.tiny_gpt(job["design"], job["layers"], job["d"], kernels=job["kernels"])
    compiled = compile_model(model, job["scope"])
    step = profile_gpu.step_fn(compiled, job["batch"], job["seq"], 512, logits=False)
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    steady = profile_gpu.timed(step, job["repeats"], profile_gpu.CPU)
    return {"first_s": round(first, 1), "steady_ms": round(statistics.median(steady), 1),
            "graphs": counters["stats"]["unique_graphs"]}


def measure_ratios(job):
    """In this (fresh) process: the compiled steady step of the design with each kernels value over Pre-LN's (fast
    kernels), timed in turn after each was compiled."""
    import torch

    import profile_gpu
    from depthbench.training.compiled import compile_model
    torch.set_num_threads(1)
    pairs = [("preln", "fast"), (job["design"], "fast"), (job["design"], "reference")]
    steps = {}
    for design, kernels in dict.fromkeys(pairs):
        model = profile_gpu.tiny_gpt(design, job["layers"], job["d"], kernels=kernels)
        compiled = compile_model(model, "blocks")
        steps[(design, kernels)] = profile_gpu.step_fn(compiled, job["batch"], job["seq"], 512, logits=False)
        steps[(design, kernels)]()                                      # compiled here, not inside the timing
    ms = profile_gpu.interleaved(steps, job["repeats"])
    base = ms[("preln", "fast")]
    return {"preln_ms": round(base, 1), "fast_x": round(ms[(job["design"], "fast")] / base, 3),
            "reference_x": round(ms[(job["design"], "reference")] / base, 3)}


def measure_scopes(job):
    """In this (fresh) process: the first step under each compile scope, then both steady steps timed in turn."""
    import torch

    import profile_gpu
    from depthbench.training.compiled import compile_model
    torch.set_num_threads(1)
    steps, first = {}, {}
    for scope in ("model", "blocks"):
        model = profile_gpu.tiny_gpt(job["design"], job["layers"], job["d"], kernels=job["kernels"])
        steps[scope] = profile_gpu.step_fn(compile_model(model, scope), job["batch"], job["seq"], 512, logits=False)
        t0 = time.perf_counter()
        steps[scope]()
        first[scope] = round(time.perf_counter() - t0, 1)
    ms = profile_gpu.interleaved(steps, job["repeats"])
    return {"model_first_s": first["model"], "blocks_first_s": first["blocks"], "model_ms": round(ms["model"], 1),
            "blocks_ms": round(ms["blocks"], 1), "blocks_over_model": round(ms["blocks"] / ms["model"], 3)}


def run_child(job, timeout):
    """measure(job) in a new Python process with an empty inductor cache of its own -> the job's row."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--child", json.dumps(job)]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {**job, "error": f"stopped after {timeout} s"}
        wall = round(time.perf_counter() - t0, 1)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["exit code %d" % p.returncode])[-1]
        return {**job, "error": last[:200], "wall_s": wall}
    return {**job, **json.loads(p.stdout.strip().splitlines()[-1]), "wall_s": wall}


def ratio_table(rows):
    """Markdown: per design, its compiled step over Pre-LN's with each kernels value, and the faster one."""
    out = ["| design | fast kernels | reference kernels | faster compiled |", "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['design']} | {r['error']} | | |")
            continue
        faster = "fast" if r["fast_x"] < r["reference_x"] else "reference"
        out.append(f"| {r['design']} | {r['fast_x']:.2f}x | {r['reference_x']:.2f}x | {faster} |")
    return "\n".join(out)


def scope_table(rows):
    """Markdown: per design, each scope's first step and steady step, and per-block over whole-model."""
    out = ["| design | L | whole model: first s / step ms | per block: first s / step ms | per block / whole |",
           "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['design']} | {r['layers']} | {r['error']} | | |")
            continue
        out.append(f"| {r['design']} | {r['layers']} | {r['model_first_s']:.0f} / {r['model_ms']:.0f} | "
                   f"{r['blocks_first_s']:.0f} / {r['blocks_ms']:.0f} | {r['blocks_over_model']:.2f}x |")
    return "\n".join(out)


def report(rows):
    """The table that fits the rows: kernels ratios, scope comparison or compile by depth."""
    if rows and "fast_x" in rows[0]:
        return ratio_table(rows)
    if rows and "blocks_over_model" in rows[0]:
        return scope_table(rows)
    return table(rows)


def table(rows):
    """Markdown: one line per (design, scope, kernels), a column pair per depth (first step s / steady ms)."""
    depths = sorted({r["layers"] for r in rows})
    keys = list(dict.fromkeys((r["design"], r["scope"], r["kernels"]) for r in rows))
    head = " | ".join(f"L{L}: first s / step ms / graphs" for L in depths)
    out = [f"| design | scope | kernels | {head} | L{depths[-1]} / L{depths[0]} first |",
           "|---|---|---|" + "---|" * (len(depths) + 1)]
    for design, scope, kernels in keys:
        cells, first = [], {}
        for L in depths:
            r = next((r for r in rows if (r["design"], r["scope"], r["kernels"], r["layers"]) ==
                      (design, scope, kernels, L)), None)
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append(r["error"])
            else:
                first[L] = r["first_s"]
                cells.append(f"{r['first_s']:.0f} / {r['steady_ms']:.0f} / {r['graphs']}")
        ratio = ""
        if depths[0] in first and depths[-1] in first:
            ratio = f"{first[depths[-1]] / first[depths[0]]:.2f}x"
        out.append(f"| {design} | {scope} | {kernels} | {' | '.join(cells)} | {ratio} |")
    return "\n".join(out)


def build_parser():
    p = ArgParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--designs", default="all", help="'all' (the paper's ten) or a comma list")
    p.add_argument("--layers", type=comma_list(int), default=[8, 24, 70], help="depths (default 8,24,70)")
    p.add_argument("--scope", choices=["blocks", "model"], default="blocks", help="train.py's --compile-scope")
    p.add_argument("--kernels", choices=["fast", "reference", "triton"], default="fast")
    p.add_argument("--d", type=int, default=128, help="width (default 128; 16 heads)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--batch", type=int, default=4, help="batch (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="steady steps timed after one untimed (default 3)")
    p.add_argument("--jobs", type=int, default=2, help="measurements side by side (default 2)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds before a row is stopped (default 1200)")
    p.add_argument("--out", help="JSON file: the rows so far, rewritten after each (rows already there are kept)")
    p.add_argument("--scopes", action="store_true", help="per-block against whole-model compile (one process per "
                   "design and depth, interleaved)")
    p.add_argument("--ratios", action="store_true", help="compiled step over Pre-LN's with each kernels value "
                   "(one process per design, interleaved), at the first of --layers")
    p.add_argument("--report", nargs="+", metavar="JSON", help="print the table of saved rows and stop")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.child:
        job = json.loads(args.child)
        measure_fn = {"ratios": measure_ratios, "scopes": measure_scopes}.get(job.get("mode"), measure)
        print(json.dumps(measure_fn(job)))
        return
    if args.report:
        rows = [r for path in args.report for r in json.loads(Path(path).read_text())["rows"]]
        print(report(rows))
        return
    designs = PAPER_DESIGNS if args.designs == "all" else comma_list(str)(args.designs)
    unknown = [d for d in designs if d not in RESIDUALS]
    if unknown:
        fail("compile_depth.py", f"unknown design(s): {', '.join(unknown)}")
    rows = json.loads(Path(args.out).read_text())["rows"] if args.out and Path(args.out).exists() else []
    shape = {"d": args.d, "seq": args.seq, "batch": args.batch, "repeats": args.repeats, "scope": args.scope,
             "kernels": args.kernels}
    jobs = [{"design": d, "layers": L, **shape} for L in args.layers for d in designs]
    if args.ratios:
        jobs = [{"design": d, "layers": args.layers[0], **shape, "mode": "ratios"} for d in designs]
    if args.scopes:
        jobs = [{**job, "mode": "scopes"} for job in jobs]
    done = [{k: r[k] for k in jobs[0]} for r in rows if "error" not in r] if jobs else []
    jobs = [j for j in jobs if j not in done]
    print(f"{len(jobs)} measurements, {args.jobs} at a time", file=sys.stderr, flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for row in pool.map(lambda j: run_child(j, args.timeout), jobs):
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.out:
                write_json(args.out, {"rows": rows})
    print(report(rows))


if __name__ == "__main__":
    main()
