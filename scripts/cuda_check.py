"""
Every design on the device against the CPU reference: the first check of scripts/gpu_smoke.py (issue 52).

    python scripts/cuda_check.py --json check.json            # CUDA: 18 designs at L6 d128, ~1-2 minutes
    python scripts/cuda_check.py --device cpu --tiny          # the CPU rehearsal: the same legs at L2 d32

The reference is one fp32 training step (loss and every gradient) on the CPU with ops.py's own bodies ("reference"),
every parameter perturbed by N(0, 0.05^2) so that no gradient is zero by initialisation. Each kernels namespace
("fast", and "triton" where GPTConfig accepts it and triton imports; the reason it is skipped is printed otherwise)
then runs the same step on the device:

  fp32      loss within 1e-5 and every gradient that is not numerically zero (norm above 1e-4 of the largest) within
            1e-4 relative (the H200's first run: 1.7e-7 and 1.7e-5)
  bf16      autocast against the fp32 reference: loss within 1e-2, each gradient's cosine >= 0.99 (0.997 measured)
  compiled  the designs with a depth state, compiled per block (bf16; on the CPU the "eager" backend: dynamo's
            tracing without inductor) against the same model eager: loss within 1e-3, gradient cosine >= 0.999

Prints one line per design and namespace; --json writes every number. Exit status 1 if any leg fails its bound.
"""
import copy
import importlib.util
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from depthbench.files.common import ArgParser  # noqa: E402
from depthbench.training.compiled import compile_model  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

COMPILED = ["preln", "hc", "mhc", "attnres", "block_attnres", "moda"]  # the designs with a depth state, and the base
BOUNDS = {"fp32_loss": 1e-5, "fp32_grad_rel": 1e-4, "bf16_loss": 1e-2, "bf16_grad_cos": 0.99,
          "compiled_loss": 1e-3, "compiled_grad_cos": 0.999}


def namespaces():
    """(the kernels namespaces to check, {name: why it is skipped}): reference and fast always; triton where the
    GPU bodies exist (depthbench/kernels), triton imports and GPTConfig accepts the name."""
    names, skipped = ["fast"], {}
    try:
        GPTConfig(kernels="triton")
        if importlib.util.find_spec("depthbench.kernels") is None:
            raise ImportError("no depthbench/kernels package")
        import triton  # noqa: F401
        names.append("triton")
    except (ValueError, ImportError) as e:
        skipped["triton"] = f"{type(e).__name__}: {e}"
    return names, skipped


def shape(tiny):
    return dict(vocab_size=256, n_layer=2, d_model=32, n_head=2, d_ff=96) if tiny else \
        dict(vocab_size=256, n_layer=6, d_model=128, n_head=4, d_ff=352)


def step(model, idx, amp):
    """(loss, {name: gradient}) of one training step, gradients in fp32 on the CPU."""
    model.zero_grad(set_to_none=True)
    with amp:
        _, loss = model(idx, idx, logits=False)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def reference(design, tiny):
    """(the perturbed CPU model's state, its fp32 loss and gradients, the batch) of one design."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(residual=design, kernels="reference", **shape(tiny)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, 256, (2, 16 if tiny else 64), generator=torch.Generator().manual_seed(1))
    loss, grads = step(model, idx, nullcontext())
    return model.state_dict(), loss, grads, idx


def on_device(design, kernels, state, dev, tiny):
    model = GPT(GPTConfig(residual=design, kernels=kernels, **shape(tiny)))
    model.load_state_dict(state)
    return model.to(dev)


def grad_rel(ref, got):
    """The largest relative error over the gradients that are not numerically zero."""
    top = max(g.norm().item() for g in ref.values())
    errs = [(got[n] - g).norm().item() / g.norm().item() for n, g in ref.items() if g.norm().item() > 1e-4 * top]
    return max(errs)


def grad_cos(ref, got):
    """The smallest cosine between matching gradients that are not numerically zero."""
    top = max(g.norm().item() for g in ref.values())
    cos = [torch.nn.functional.cosine_similarity(got[n].flatten(), g.flatten(), dim=0).item()
           for n, g in ref.items() if g.norm().item() > 1e-4 * top]
    return min(cos)


def check_design(design, kernels, dev, tiny):
    """The fp32, bf16 and (COMPILED designs) compiled legs of one design and namespace -> a row of numbers."""
    state, loss, grads, idx = reference(design, tiny)
    idx = idx.to(dev)
    model = on_device(design, kernels, state=state, dev=dev, tiny=tiny)
    row = {"design": design, "kernels": kernels}
    got_loss, got = step(model, idx, nullcontext())
    row.update(fp32_loss=abs(got_loss - loss), fp32_grad_rel=grad_rel(grads, got))
    bf16 = torch.autocast(dev.type, dtype=torch.bfloat16)
    got_loss, got = step(model, idx, bf16)
    row.update(bf16_loss=abs(got_loss - loss), bf16_grad_cos=grad_cos(grads, got))
    if design in COMPILED:
        eager_loss, eager_grads = got_loss, got
        torch._dynamo.reset()
        compiled = compile_model(copy.deepcopy(model), "blocks", backend="eager" if dev.type == "cpu" else "inductor")
        got_loss, got = step(compiled, idx, bf16)
        row.update(compiled_loss=abs(got_loss - eager_loss), compiled_grad_cos=grad_cos(eager_grads, got))
    row["ok"] = passes(row)
    return row


def passes(row):
    """Every leg of the row within its bound (BOUNDS: losses and relative errors at most, cosines at least)."""
    for key, bound in BOUNDS.items():
        if key in row and (row[key] < bound if key.endswith("cos") else row[key] > bound):
            return False
    return True


def describe(row):
    text = (f"{row['design']:<16}{row['kernels']:<10}fp32 loss {row['fp32_loss']:.1e} grad {row['fp32_grad_rel']:.1e}"
            f"  bf16 loss {row['bf16_loss']:.1e} cos {row['bf16_grad_cos']:.5f}")
    if "compiled_loss" in row:
        text += f"  compiled loss {row['compiled_loss']:.1e} cos {row['compiled_grad_cos']:.5f}"
    return ("ok    " if row["ok"] else "FAIL  ") + text


def main(argv=None):
    p = ArgParser(prog="cuda_check.py", description="Every design on the device against the CPU "
                                "reference: fp32, bf16, compiled == eager, each kernels namespace.")
    p.add_argument("--device", default="cuda", help="where the checked steps run (default cuda; cpu rehearses)")
    p.add_argument("--tiny", action="store_true", help="L2 d32 instead of L6 d128 (the CPU rehearsal)")
    p.add_argument("--designs", default=",".join(RESIDUALS), help="comma list (default: all)")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    designs = args.designs.split(",")
    if unknown := [d for d in designs if d not in RESIDUALS]:
        p.error(f"unknown design(s) {', '.join(unknown)}; choose from {', '.join(RESIDUALS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here")
    dev, (names, skipped) = torch.device(args.device), namespaces()
    for name, reason in skipped.items():
        print(f"skip  kernels {name!r}: {reason}", flush=True)
    t0, rows = time.monotonic(), []
    for design in designs:
        for kernels in names:
            try:
                rows.append(check_design(design, kernels, dev, args.tiny))
            except Exception as e:  # one design's failure is a failed row, not a lost check
                rows.append({"design": design, "kernels": kernels, "ok": False, "error": f"{type(e).__name__}: {e}"})
            print(describe(rows[-1]) if "error" not in rows[-1] else f"FAIL  {design} {kernels}: {rows[-1]['error']}",
                  flush=True)
    doc = {"device": str(dev), "namespaces": names, "skipped": skipped, "bounds": BOUNDS, "rows": rows,
           "seconds": round(time.monotonic() - t0, 1), "ok": all(r["ok"] for r in rows)}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
