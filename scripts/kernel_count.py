"""
Kernels per training step, by design and depth: the CPU proxy for a GPU's kernel launches (docs/speed.md#kernels).

    python scripts/kernel_count.py                                  # every paper design at L8, L32 and L70
    python scripts/kernel_count.py --designs preln,attnres,moda --depths 8,70 --json counts.json

One eager training step (forward, loss, backward) of a small model (d64, 4 heads, T32, batch 2, vocab 256, the
design's default options) under torch.profiler; a kernel is a leaf aten op (one that calls no other aten op), views
and metadata aside (they launch nothing on a GPU; --views counts them too), or with --device cuda a kernel the GPU
ran. Prints the counts, each over Pre-LN's at the same depth, and how
each grows from the shallowest depth to the deepest.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from model import GPT, GPTConfig  # noqa: E402
from profile_gpu import kernels_of  # noqa: E402  (the one rule of what counts as a kernel)
from residuals import PAPER_DESIGNS, RESIDUALS  # noqa: E402

def count(residual, n_layer, views=False, device="cpu"):
    """Leaf aten ops that launch a kernel in one eager training step of `residual` at n_layer blocks (views=True:
    every leaf aten op, views and metadata reads too); on CUDA, the kernels the GPU ran."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, n_layer=n_layer, d_model=64, n_head=4, d_ff=176, residual=residual)
    model = GPT(cfg).to(device)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    model(idx, idx, logits=False)[1].backward()                   # warm: lazy allocations happen once
    model.zero_grad(set_to_none=True)
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        model(idx, idx, logits=False)[1].backward()
        if cuda:
            torch.cuda.synchronize()
    return kernels_of(prof, cuda, views)[0]


def build_parser():
    p = argparse.ArgumentParser(prog="kernel_count.py", description=__doc__.split("\n\n")[1])
    p.add_argument("--designs", default=",".join(PAPER_DESIGNS), help="comma list of registry keys (default: the "
                   "paper's ten); Pre-LN is always counted, as the base of the ratios")
    p.add_argument("--depths", default="8,32,70", help="comma list of block counts (default 8,32,70)")
    p.add_argument("--views", action="store_true", help="count every leaf aten op, views and metadata reads too")
    p.add_argument("--device", default="cpu", help="cpu (default: leaf aten ops) or cuda (the kernels the GPU ran)")
    p.add_argument("--json", help="also write the counts here")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    designs = ["preln"] + [d for d in args.designs.split(",") if d != "preln"]
    unknown = [d for d in designs if d not in RESIDUALS]
    if unknown:
        p.error(f"unknown design(s) {', '.join(unknown)}; choose from {', '.join(RESIDUALS)}")
    try:
        depths = [int(x) for x in args.depths.split(",")]
    except ValueError:
        p.error(f"--depths {args.depths!r}: a comma list of block counts")
    if not depths or min(depths) < 1:
        p.error("--depths: block counts >= 1")
    torch.set_num_threads(1)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here")
    counts = {d: {L: count(d, L, args.views, args.device) for L in depths} for d in designs}
    head = " | ".join(f"L{L}: kernels / Pre-LN" for L in depths)
    print(f"| design | {head} | L{depths[-1]} / L{depths[0]} |")
    print("|---" * (len(depths) + 2) + "|")
    for d in designs:
        cells = " | ".join(f"{counts[d][L]:,} / {counts[d][L] / counts['preln'][L]:.2f}x" for L in depths)
        print(f"| {d} | {cells} | {counts[d][depths[-1]] / counts[d][depths[0]]:.1f}x |")
    if args.json:
        doc = {"counts": counts, "shape": "d64 H4 T32 B2 V256", "device": args.device, "views": args.views}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
