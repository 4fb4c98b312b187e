"""
HC's and mHC's connection kernels alone on the device, against the traffic model (issue 52; docs/speed.md#kernels).

    python scripts/kernel_bench.py                       # CUDA: one sublayer of L70 d640 T2048 B2 (4,096 tokens, n 4)
    python scripts/kernel_bench.py --tokens 16384 --json kernels.json           # micro-batch 8
    python scripts/kernel_bench.py --tiny                # the CPU rehearsal: Triton's interpreter, 39 tokens, d80

For each design, one sublayer's read (depthbench/kernels/triton_hc_read.py: the maps, the width connection and the
branch's norm) and write (triton_hc.DepthConnection), each timed forward and backward in bf16 (the GPU path's
streams) with the upstream gradients a model gives (h, H_post and mixed; H_pre and H_res feed nothing else), beside
the bytes and launches depthbench.kernels.triton_hc.traffic counts for the same launches: the achieved GB/s of each
(and eta, its fraction of the GPU's HBM peak: roofline.HBM_PEAK) and scripts/roofline.py's estimate for it on this
GPU (an H200's or an H100 SXM's, else the H200's: bytes / (0.8 x its HBM peak) + launches x tau), so the roofline's
assumptions are checked kernel by kernel where they were only counted. The read runs both ways: its backward in one
launch (_mhc_bwd / _hc_bwd, the model's path) and as three kernels (_width_norm_bwd, _mhc_read_bwd / _hc_read_bwd,
_proj_bwd: triton_hc_read.ONE_LAUNCH_BACKWARD off), its forward in one (_mhc_fwd / _hc_fwd) and as two
(_mhc_read_fwd / _hc_read_fwd, _width_norm_fwd: ONE_LAUNCH_FORWARD off); "one_launch_over_three" and
"forward_one_launch_over_two" < 1 keep the one launch (a kernel is kept where it measures faster), and the two
backwards' gradients must agree (cosine >= 0.999 each, else exit 1).

Timing: CUDA events over --repeat calls after 3 warm-ups (the backward: autograd.grad with retain_graph, so it
includes autograd's own work and the torch launches the traffic rows count: the sums, dW's GEMM, its copy). The
kernels each pass launches are recorded in one untimed pass. --tiny times the interpreter: the numbers only
rehearse the path.
"""
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root
from depthbench.files.common import ArgParser, cannot_write, write_json  # noqa: E402

DESIGNS = ("hc", "mhc")
MIN_COSINE = 0.999            # the two backward paths' gradients, each (bf16 outputs, fp32 inside)
# the kernels the fused read and the depth connection launch from Python (never the @jit helpers they call, which a
# kernel looks up in its module when it compiles)
LAUNCHED = ["_mhc_fwd", "_hc_fwd", "_mhc_read_fwd", "_mhc_read_bwd", "_hc_read_fwd", "_hc_read_bwd", "_width_norm_fwd", "_width_norm_bwd",
            "_mhc_bwd", "_hc_bwd", "_proj_bwd", "_depth_fwd", "_depth_bwd"]
TINY = {"tokens": 39, "d_model": 80, "repeat": 1}   # a partial block of 16 tokens, two tiles of 64 channels


def positive_int(text):
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


positive_int.__name__ = "integer >= 1"  # argparse names the type in its one-line error


def parse(argv):
    p = ArgParser(prog="kernel_bench.py", description="HC's and mHC's read and write kernels alone on the device, "
                  "timed against the bytes and launches the roofline counts for them (see the module docstring).")
    p.add_argument("--designs", default=",".join(DESIGNS), help="comma-separated, of hc, mhc (default both)")
    p.add_argument("--tokens", type=positive_int, default=4096, help="B x T of one sublayer (default 4096: the "
                   "card's micro-batch 2 x 2048)")
    p.add_argument("--d-model", type=positive_int, default=640, help="the streams' width D (default 640)")
    p.add_argument("--streams", type=positive_int, default=4, help="n, the number of streams (default 4)")
    p.add_argument("--repeat", type=positive_int, default=20, help="timed calls of each pass (default 20)")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--tiny", action="store_true", help="CPU under TRITON_INTERPRET=1 at 39 tokens, d80, one call")
    args = p.parse_args(argv)
    args.designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    unknown = sorted(set(args.designs) - set(DESIGNS))
    if unknown or not args.designs:
        p.error(f"--designs: {', '.join(unknown) or 'none given'} (choose from {', '.join(DESIGNS)})")
    if args.json and cannot_write(Path(args.json)):
        p.error(f"--json {args.json}: {cannot_write(Path(args.json))}")
    if args.tiny:
        args.tokens, args.d_model, args.repeat = TINY["tokens"], TINY["d_model"], TINY["repeat"]
    return args


class Recorder:
    """The names of the Triton kernels launched while it is on (each module attribute wrapped, as the tests do)."""

    def __init__(self, modules, names):
        self.modules, self.names, self.launched, self.saved = modules, names, [], []

    def __enter__(self):
        for module in self.modules:
            for name in self.names:
                kernel = getattr(module, name, None)
                if kernel is not None and hasattr(kernel, "__getitem__"):
                    self.saved.append((module, name, kernel))
                    setattr(module, name, type("Launch", (), {"__getitem__": lambda _, grid, k=kernel, nm=name: (
                        self.launched.append(nm), k[grid])[1]})())
        return self

    def __exit__(self, *exc):
        for module, name, kernel in self.saved:
            setattr(module, name, kernel)


def model_rows(hc, design, args, device):
    """triton_hc.traffic's rows for this sublayer, grouped as timed: read forward / backward, depth forward /
    backward -> {group: {bytes, launches, kernels}}."""
    rows = hc.traffic(design, args.tokens, args.d_model, n=args.streams, gemm_fp32_out=device == "cuda")
    groups = {}
    for r in rows:
        key = ("depth_" if r["kernel"] == "depth_connection" else "read_") + r["pass"]
        g = groups.setdefault(key, {"bytes": 0, "launches": 0, "rows": []})
        g["bytes"] += r["read"] + r["written"]
        g["launches"] += r["launches"]
        g["rows"].append(r["kernel"])
    return groups


def cosine(torch, a, b):
    a, b = a.double().flatten(), b.double().flatten()
    if not a.norm() and not b.norm():
        return 1.0
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-300)).item()


def passes(design, args, device):
    """One design's sublayer on the device, its connector's parameters moved off their init (zero-initialised maps
    would hide a difference between the two backwards): {pass name: a function that runs it (the backwards return
    the gradients)}."""
    import torch
    from depthbench.kernels import triton_hc as hc
    from depthbench.kernels import triton_hc_read as hcr
    from depthbench.kernels import triton_hc_read_ops as hcro
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    D, n = args.d_model, args.streams
    cfg = GPTConfig(vocab_size=32, n_layer=1, d_model=D, n_head=1, d_ff=8, residual=design,
                    residual_args={"n_streams": n}, kernels="triton")
    res = GPT(cfg).res.to(device)
    with torch.no_grad():
        for p in res.parameters():
            p.add_(0.05 * torch.randn_like(p))                         # off the zero-initialised maps
    site = res.site(1)
    params = list(site.conn.parameters()) + [site.norm.weight]
    g = torch.Generator(device).manual_seed(1)
    H = torch.randn(1, args.tokens, n, D, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    y = torch.randn(1, args.tokens, D, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    if not hcr.fused(res, H, site):
        raise SystemExit(f"kernel_bench.py: {design}'s read is not the fused one on {device} (triton missing?)")
    autocast = torch.autocast(device, dtype=torch.bfloat16)
    with autocast:
        outs = hcro.hc_read(res, H, site)
    used = [outs[0], outs[2], outs[4]]                                   # h, H_post, mixed: a model's
    ups = [torch.randn(o.shape, device=device, generator=g).to(o.dtype) for o in used]
    with autocast:
        mixed, post = outs[4].detach().requires_grad_(), outs[2].detach().requires_grad_()
        out = hc.depth_connection(mixed, post, y)
    dout = torch.randn(out.shape, device=device, generator=g).to(out.dtype)

    def read_forward():
        with autocast:
            hcro.hc_read(res, H, site)

    def read_backward():
        return torch.autograd.grad(used, [H] + params, ups, retain_graph=True)

    def depth_forward():
        with autocast:
            hc.depth_connection(mixed, post, y)

    def depth_backward():
        return torch.autograd.grad(out, [mixed, post, y], dout, retain_graph=True)

    return {"read_forward": read_forward, "read_backward": read_backward, "depth_forward": depth_forward,
            "depth_backward": depth_backward, "read_forward_two_kernels": read_forward,
            "read_backward_three_kernels": read_backward}


def bench(design, args, device, c, peak):
    """One design's passes, timed -> {pass: {ms, kernels, and where traffic counts it: bytes, launches, gb_per_s,
    predicted_ms: the roofline's for c's GPU}, paths_min_cosine, one_launch_over_three}."""
    import torch
    from depthbench.kernels import triton_hc as hc
    from depthbench.kernels import triton_hc_read as hcr
    from depthbench.kernels import triton_hc_read_ops as hcro
    import profile_gpu
    import roofline
    model = model_rows(hc, design, args, device)
    result, grads = {}, {}
    for name, fn in passes(design, args, device).items():
        hcr.ONE_LAUNCH_BACKWARD = name != "read_backward_three_kernels"
        hcr.ONE_LAUNCH_FORWARD = name != "read_forward_two_kernels"
        try:
            with Recorder([hcr, hcro, hc], LAUNCHED) as rec:   # hcro launches the kernels it imported
                grads[name] = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            ms = statistics.median(profile_gpu.timed(fn, args.repeat, torch.device(device),
                                                          warmup=3 if device == "cuda" else 0))
        finally:
            hcr.ONE_LAUNCH_BACKWARD = hcr.ONE_LAUNCH_FORWARD = True
        row = {"ms": round(ms, 4), "kernels": rec.launched}
        if name in model:
            m = model[name]
            predicted = m["bytes"] / (roofline.ETA_GPU * c["hbm"]) + m["launches"] * c["tau"]
            row.update(bytes=m["bytes"], launches=m["launches"], model_rows=m["rows"],
                       gb_per_s=round(m["bytes"] / ms / 1e6, 1), predicted_ms=round(1e3 * predicted, 4),
                       eta=None if peak is None else round(m["bytes"] / ms / 1e-3 / peak, 3))
        result[name] = row
    cosines = [cosine(torch, a, b) for a, b in zip(grads["read_backward"], grads["read_backward_three_kernels"])]
    result["paths_min_cosine"] = round(min(cosines), 6)
    for ratio, one, split in (("one_launch_over_three", "read_backward", "read_backward_three_kernels"),
                              ("forward_one_launch_over_two", "read_forward", "read_forward_two_kernels")):
        result[ratio] = round(result[one]["ms"] / result[split]["ms"], 3)
    return result


def report(doc):
    print(f"kernel_bench: {doc['device_name']}, torch {doc['torch']}, triton {doc['triton']}; {doc['tokens']} tokens, "
          f"D {doc['d_model']}, n {doc['streams']}, bf16")
    print(f"| design | pass | ms | {doc['roofline_gpu']} estimate ms | GB/s | eta | launches (counted) | kernels "
          f"launched |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for design, r in doc["designs"].items():
        for name, row in r.items():
            if isinstance(row, dict):
                est = row.get("predicted_ms", "")
                eta = "" if row.get("eta") is None else row["eta"]
                print(f"| {design} | {name} | {row['ms']:.3f} | {est} | {row.get('gb_per_s', '')} | {eta} | "
                      f"{row.get('launches', '')} | {' '.join(row['kernels'])} |")
        print(f"{design}: one launch over the split, backward {r['one_launch_over_three']:.3f}, forward "
              f"{r['forward_one_launch_over_two']:.3f} (keep the one launch where < 1); the two backwards' "
              f"gradients, min cosine {r['paths_min_cosine']:.6f}")


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"          # before triton is first imported
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    import roofline
    from depthbench.kernels import triton_hc as hc
    if hc.triton is None:
        print("kernel_bench.py: needs triton (pip install triton)", file=sys.stderr)
        return 2
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("kernel_bench.py: no CUDA device (--tiny rehearses it on the CPU)", file=sys.stderr)
        return 2
    if args.tiny and not hc.interpreted():
        print("kernel_bench.py --tiny: triton was imported before TRITON_INTERPRET=1 could be set", file=sys.stderr)
        return 2
    import triton
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton's interpreter)"
    c = roofline.calibrate(gpu=roofline.model_gpu(name) or "H200")
    doc = {"schema": "depthbench.kernel_bench/1", "device": device, "torch": torch.__version__,
           "triton": triton.__version__, "tokens": args.tokens, "d_model": args.d_model, "streams": args.streams,
           "repeat": args.repeat, "tau_us": round(1e6 * c["tau"], 3), "eta": roofline.ETA_GPU,
           "device_name": name, "roofline_gpu": c["gpu"], "min_cosine": MIN_COSINE, "designs": {}}
    for design in args.designs:
        doc["designs"][design] = bench(design, args, device, c, peak=roofline.hbm_peak(name))
    report(doc)
    if args.json:
        write_json(Path(args.json), doc, strict=True)
    bad = [d for d, r in doc["designs"].items() if r["paths_min_cosine"] < MIN_COSINE]
    if bad:
        print(f"kernel_bench.py: the two backwards disagree for {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
