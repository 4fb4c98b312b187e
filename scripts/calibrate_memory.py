"""Measure, on the CPU, the bytes a training forward keeps for the backward, and fit the memory plan's constants
(docs/training.md#memory): costs.BLOCK_BYTES and costs.EDGE_BYTES (Pre-LN's backbone) and each design's `act_bytes`
(residuals.py: its bytes beyond Pre-LN's).

Modes: "compiled" (bf16 autocast, each block compiled with the aot_eager_decomp_partition backend: inductor's
decompositions and its min-cut partition of what the forward saves, without generating code, so a shape compiles in
seconds; inductor itself keeps the same bytes, checked for Pre-LN), "bf16" (eager, bf16 autocast) and "fp32"
(eager). A token's bytes are the difference of micro-batch 2 and 1 over T (what does not grow with the batch, the
bf16 copies of the weights, drops out); they are fitted as L (a d + b) + e d + f, Pre-LN's with separate d, d_ff
and d_kv terms and V (the one-chunk loss's logits). Prints the constants as Python, to paste:

    python scripts/calibrate_memory.py                    # every design, every mode: ~20 minutes on 1 core
    python scripts/calibrate_memory.py --designs mhc --modes bf16
    TRITON_INTERPRET=1 python scripts/calibrate_memory.py --designs mhc --modes bf16 --kernels triton   # the GPU path
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from depthbench.training.compiled import compile_model  # noqa: E402  (the repository root, on the path above)
from depthbench.training.costs import kept_bytes  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

T = 32
BACKBONE_SHAPES = [  # (L, d, d_ff, n_head, n_kv_head, V)
    (2, 64, 176, 4, 4, 64), (4, 64, 176, 4, 4, 64), (2, 128, 352, 8, 8, 64), (4, 128, 352, 8, 8, 64),
    (4, 64, 352, 4, 4, 64), (4, 64, 176, 4, 2, 64), (4, 64, 176, 2, 2, 64), (2, 64, 176, 4, 4, 128)]
DESIGN_SHAPES = [(2, 64, 176, 4, 4, 64), (4, 64, 176, 4, 4, 64), (2, 128, 352, 8, 8, 64), (4, 128, 352, 8, 8, 64)]
MEASURED = {}  # (residual, shape, mode, options, kernels) -> bytes per token: Pre-LN's are measured once
KERNELS = "fast"  # GPTConfig.kernels of every model measured (--kernels)


def per_token(residual, shape, mode, options=None):
    """Bytes kept per token at (L, d, d_ff, n_head, n_kv_head, V): (kept at micro-batch 2 - at 1) / T."""
    key = (residual, shape, mode, repr(options), KERNELS)
    if key not in MEASURED:
        MEASURED[key] = measure(residual, shape, mode, options)
    return MEASURED[key]


def measure(residual, shape, mode, options):
    L, d, d_ff, n_head, n_kv, V = shape
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=V, n_layer=L, d_model=d, n_head=n_head, n_kv_head=n_kv, d_ff=d_ff,
                    residual=residual, residual_args=options or {}, kernels=KERNELS)
    model = GPT(cfg)
    if mode == "compiled":
        torch._dynamo.reset()
        compile_model(model, "blocks", backend="aot_eager_decomp_partition")
    kept = []
    for B in (1, 2):
        idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
        kept_bytes(model, idx, bf16=mode != "fp32")  # compiles, in the compiled mode
        kept.append(kept_bytes(model, idx, bf16=mode != "fp32"))
    return (kept[1] - kept[0]) / T


def solve(rows, values):
    """Least squares (exact when square) of rows @ x = values."""
    x = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(values, dtype=torch.float64)[:, None])
    return [round(v, 2) for v in x.solution[:, 0].tolist()]


def backbone(mode):
    """Pre-LN: (block per unit of d, d_ff, d_kv, head, bytes), (edge per unit of d, V, bytes)."""
    rows, values = [], []
    for shape in BACKBONE_SHAPES:
        L, d, d_ff, n_head, n_kv, V = shape
        rows.append([L * d, L * d_ff, L * d * n_kv // n_head, L * n_head, L, d, V, 1])
        values.append(per_token("preln", shape, mode))
    x = solve(rows, values)
    return tuple(x[:5]), tuple(x[5:])


def design(residual, mode, options=None):
    """(a, b, e, f): a design's bytes per token beyond Pre-LN's, L (a d + b) + e d + f."""
    rows, values = [], []
    for shape in DESIGN_SHAPES:
        L, d = shape[:2]
        rows.append([L * d, L, d, 1])
        values.append(per_token(residual, shape, mode, options) - per_token("preln", shape, mode))
    return tuple(solve(rows, values))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--designs", default=",".join(RESIDUALS))
    p.add_argument("--modes", default="compiled,bf16,fp32")
    p.add_argument("--kernels", default="fast", choices=("fast", "reference", "triton"),
                   help="the bodies measured (triton on the CPU: under TRITON_INTERPRET=1, the kept bytes of the GPU "
                        "path; its constants are not the plan's, which are fast's)")
    args = p.parse_args(argv)
    global KERNELS
    KERNELS = args.kernels
    torch.set_num_threads(1)
    modes = args.modes.split(",")
    for mode in modes:
        block, edge = backbone(mode)
        print(f"BLOCK_BYTES[{mode!r}] = {block}\nEDGE_BYTES[{mode!r}] = {edge}", flush=True)
    for residual in args.designs.split(","):
        variants = [({}, "")]
        if "recompute" in RESIDUALS[residual].options:
            variants.append(({"recompute": False}, " (recompute False)"))
        for options, tag in variants:
            got = {mode: design(residual, mode, options) for mode in modes}
            print(f"{residual}{tag}: act_bytes = {got}", flush=True)


if __name__ == "__main__":
    main()
