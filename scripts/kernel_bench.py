"""
The hot kernels of every design family alone on the device, against ops.py's reference and the traffic model
(issue 52, issue 68 item 5; docs/speed.md#kernels), at one consumer or sublayer of the card's shape (L70 d640,
4,096 tokens = micro-batch 2 x 2048, bf16 autocast).

    python scripts/kernel_bench.py                       # CUDA: every section at the card's shape
    python scripts/kernel_bench.py --designs hc,mhc --tokens 16384 --json kernels.json       # micro-batch 8
    python scripts/kernel_bench.py --probe probe.json    # scripts/kernel_probe.py's registers, spills, issue floors
    python scripts/kernel_bench.py --tiny                # the CPU rehearsal: Triton's interpreter, 39 tokens, d80

Sections of the JSON (--json) and of the printed tables, most informative first:
- designs (HC, mHC): one sublayer's read (depthbench/kernels/triton_hc_read.py: the maps, the width connection and
  the branch's norm) and write (triton_hc.DepthConnection), each timed forward and backward in bf16 with the
  upstream gradients a model gives (h, H_post and mixed), beside the bytes and launches triton_hc.traffic counts:
  GB/s, eta (its fraction of the GPU's HBM peak, roofline.HBM_PEAK) and scripts/roofline.py's estimate for this GPU
  (an H200's or an H100 SXM's, else the H200's: bytes / (0.8 x its HBM peak) + launches x tau). The read runs both
  ways: its backward in one launch (_mhc_bwd / _hc_bwd, the model's path) and as three kernels (ONE_LAUNCH_BACKWARD
  off), its forward in one and as two (ONE_LAUNCH_FORWARD off): "one_launch_over_three" and
  "forward_one_launch_over_two" < 1 keep the one launch; the two backwards' gradients must agree (cosine >= 0.999).
  "vs_reference": the fused read + write against the same model built with the reference bodies (ops.py), forward
  and every gradient (cosine, max error over the largest entry): a race shows here on a GPU.
- depth (Full AttnRes, Block AttnRes, MoDA; scripts/kernel_bench_depth.py): the deepest chunk of AttnRes consumers
  on triton_attnres_chunk's DepthBank, MoDA's deepest consumer on triton_moda's joint attention, against ops.py's
  DepthBank and joint_attention on the same inputs; forward and backward with CUDA events and with the host's clock
  around the Python call, the bytes the modules count, GB/s and eta, the host's microseconds per push and per
  consumer; on CUDA each GPU kernel's own time (torch.profiler) and the host's time over the kernels' (> 1:
  launch-bound).
- host: a bare Triton launch with 19 arguments, 1,000 times (--tiny: 20): microseconds per launch.
- liger (when liger_kernel imports; scripts/kernel_bench_liger.py): liger-kernel 0.8.5's mHC and Block AttnRes ops
  beside ours on the same inputs (outputs and gradients agreeing, ms, theirs over ours). The GPU machine gets the
  wheel as the ignored folder .whl/ (carried by the device tool), which scripts/gpu_smoke.py's environment check
  installs with `pip install --no-deps` (`liger_wheel`); here: `pip download liger-kernel==0.8.5 --no-deps -d .whl`.
- probe (--probe FILE): scripts/kernel_probe.py's JSON (issue 68 item 1, written on its own branch): each pass's
  launched kernels get the probe's record beside their time (registers, spills, CTAs per SM, issue floor, as the
  probe names them; `kernel_bench_depth.probe_records` says the shapes it reads), and "issue_floor_ms", their sum,
  where the probe gives an issue floor per launch.
A section that fails leaves {"reason": ...} and the others run. Exit 1 when any check against the reference (or
between the two backwards, or between liger's and ours) falls under cosine 0.999.

Timing: CUDA events over --repeat calls after warm-ups (HC/mHC: autograd.grad with retain_graph; AttnRes and MoDA:
a fresh bank per repeat, as their banks keep records between calls). --tiny times the interpreter: the numbers only
rehearse the path.
"""
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root
from depthbench.files.common import ArgParser, cannot_write, write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))  # kernel_bench_depth, kernel_bench_liger, roofline, profile_gpu's

HC_DESIGNS = ("hc", "mhc")
DEPTH_DESIGNS = ("attnres", "block_attnres", "moda")
DESIGNS = HC_DESIGNS + DEPTH_DESIGNS
MIN_COSINE = 0.999            # every check: bf16 outputs against fp32 maths, or two bf16 paths
TINY = {"tokens": 39, "d_model": 80, "repeat": 1}   # a partial block of 16 tokens, two tiles of 64 channels
LAUNCHES = {False: 1000, True: 20}                   # bare launches timed, by --tiny


def positive_int(text):
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


positive_int.__name__ = "integer >= 1"  # argparse names the type in its one-line error


def parse(argv):
    p = ArgParser(prog="kernel_bench.py", description="Every design family's hot kernels alone on the device, "
                  "checked against ops.py and timed against the bytes the modules count (see the module docstring).")
    p.add_argument("--designs", default=",".join(DESIGNS), help=f"comma-separated, of {', '.join(DESIGNS)} "
                   "(default all)")
    p.add_argument("--tokens", type=positive_int, default=4096, help="B x T of one sublayer (default 4096: the "
                   "card's micro-batch 2 x 2048)")
    p.add_argument("--d-model", type=positive_int, default=640, help="the streams' width D (default 640)")
    p.add_argument("--streams", type=positive_int, default=4, help="n, the number of streams (default 4)")
    p.add_argument("--repeat", type=positive_int, default=20, help="timed calls of each pass (default 20)")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--probe", help="scripts/kernel_probe.py's JSON: its record of each kernel beside its time")
    p.add_argument("--no-liger", action="store_true", help="leave out liger-kernel's section even where it imports")
    p.add_argument("--tiny", action="store_true", help="CPU under TRITON_INTERPRET=1 at 39 tokens, d80, one call")
    args = p.parse_args(argv)
    args.designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    unknown = sorted(set(args.designs) - set(DESIGNS))
    if unknown or not args.designs:
        p.error(f"--designs: {', '.join(unknown) or 'none given'} (choose from {', '.join(DESIGNS)})")
    if args.probe and not Path(args.probe).is_file():
        p.error(f"--probe {args.probe}: no such file")
    if args.json and cannot_write(Path(args.json)):
        p.error(f"--json {args.json}: {cannot_write(Path(args.json))}")
    if args.tiny:
        args.tokens, args.d_model, args.repeat = TINY["tokens"], TINY["d_model"], TINY["repeat"]
    return args


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


@dataclass
class Sublayer:
    """One HC/mHC sublayer of a one-layer model on the device, its connector moved off its init."""
    res: object                # the design (residuals.HC or MHC)
    site: object               # its sublayer 1's Site (conn, norm)
    params: list               # the connector's parameters and the norm's gain
    H: object                  # the streams (1, tokens, n, D), bf16, a leaf
    y: object                  # the branch output (1, tokens, D), bf16, a leaf
    generator: object          # the torch.Generator that made H and y (the upstream gradients come next)


def sublayer(design, args, device):
    """HC's or mHC's sublayer 1 at (tokens, D, n) on the device, the connector's parameters moved off their init
    (zero-initialised maps would hide a difference between two backwards)."""
    import torch
    from depthbench.kernels import triton_hc_read as hcr
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
    g = torch.Generator(device).manual_seed(1)
    H = torch.randn(1, args.tokens, n, D, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    y = torch.randn(1, args.tokens, D, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    if not hcr.fused(res, H, site):
        raise SystemExit(f"kernel_bench.py: {design}'s read is not the fused one on {device} (triton missing?)")
    return Sublayer(res=res, site=site, params=list(site.conn.parameters()) + [site.norm.weight], H=H, y=y,
                    generator=g)


def passes(design, args, device):
    """One design's sublayer on the device (`sublayer`): {pass name: a function that runs it (the backwards return
    the gradients)}."""
    import torch
    from depthbench.kernels import triton_hc as hc
    from depthbench.kernels import triton_hc_read_ops as hcro
    sub = sublayer(design, args, device)
    res, site, params, H, y, g = sub.res, sub.site, sub.params, sub.H, sub.y, sub.generator
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
    import kernel_bench_depth as depth
    from depthbench.kernels import triton_hc as hc
    from depthbench.kernels import triton_hc_read as hcr
    import profile_gpu
    import roofline
    model = model_rows(hc, design, args, device)
    result, grads = {}, {}
    for name, fn in passes(design, args, device).items():
        hcr.ONE_LAUNCH_BACKWARD = name != "read_backward_three_kernels"
        hcr.ONE_LAUNCH_FORWARD = name != "read_forward_two_kernels"
        try:
            with depth.Launches() as rec:
                grads[name] = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            ms = statistics.median(profile_gpu.timed(fn, args.repeat, torch.device(device),
                                                          warmup=3 if device == "cuda" else 0))
        finally:
            hcr.ONE_LAUNCH_BACKWARD = hcr.ONE_LAUNCH_FORWARD = True
        row = {"ms": round(ms, 4), "kernels": rec.names}
        if name in model:
            m = model[name]
            predicted = m["bytes"] / (roofline.ETA_GPU * c["hbm"]) + m["launches"] * c["tau"]
            row.update(bytes=m["bytes"], launches=m["launches"], model_rows=m["rows"],
                       gb_per_s=round(m["bytes"] / ms / 1e6, 1), predicted_ms=round(1e3 * predicted, 4),
                       eta=None if peak is None else round(m["bytes"] / ms / 1e-3 / peak, 3))
        result[name] = row
    cosines = [depth.cosine(a, b) for a, b in zip(grads["read_backward"], grads["read_backward_three_kernels"])]
    result["paths_min_cosine"] = round(min(cosines), 6)
    for ratio, one, split in (("one_launch_over_three", "read_backward", "read_backward_three_kernels"),
                              ("forward_one_launch_over_two", "read_forward", "read_forward_two_kernels")):
        result[ratio] = round(result[one]["ms"] / result[split]["ms"], 3)
    return result


def hc_reference(design, args, device):
    """The fused read + write (the triton namespace) against the same sublayer built with ops.py's bodies (the
    reference namespace, the same parameters): h and the new streams, and every gradient (streams, branch output,
    connector, norm) from one set of upstream gradients -> {forward, gradients: {min_cosine, max_error}}."""
    import torch
    import kernel_bench_depth as depth
    from model import GPT, GPTConfig
    sub = sublayer(design, args, device)
    cfg = GPTConfig(vocab_size=32, n_layer=1, d_model=args.d_model, n_head=1, d_ff=8, residual=design,
                    residual_args={"n_streams": args.streams}, kernels="reference")
    ref = GPT(cfg).res.to(device)
    ref.load_state_dict(sub.res.state_dict())
    sites = {"fast": (sub.res, sub.site), "reference": (ref, ref.site(1))}
    got = {}
    for name, (res, site) in sites.items():
        params = list(site.conn.parameters()) + [site.norm.weight]
        with torch.autocast(device, dtype=torch.bfloat16):
            h, _, post, _, mixed = res.ops.hc_read(res, sub.H, site)      # ops.hc_read, or the fused body
            out = res.ops.depth_connection(mixed, post, sub.y)
        g = torch.Generator(device).manual_seed(2)
        ups = [torch.randn(o.shape, device=device, generator=g).to(o.dtype) for o in (h, out)]
        got[name] = ([h, out], torch.autograd.grad([h, out], [sub.H, sub.y] + params, ups))
    (a_out, a_grad), (b_out, b_grad) = got["fast"], got["reference"]
    return {"forward": depth.agreement(a_out, b_out), "gradients": depth.agreement(a_grad, b_grad)}


def depth_sections(args, device, peak, doc, save):
    """kernel_bench_depth's section of each AttnRes / MoDA design asked for, into doc["depth"][design] (the section,
    or {reason}), saved after each."""
    import kernel_bench_depth as depth
    for design in args.designs:
        if design not in DEPTH_DESIGNS:
            continue
        try:
            if design == "moda":
                doc["depth"][design] = depth.moda_bench(args, device, peak)
            else:
                doc["depth"][design] = depth.attnres_bench(design, args, device, peak)
        except Exception as e:  # one family's failure (a kernel re-tiled elsewhere) must not lose the others
            doc["depth"][design] = {"reason": f"{type(e).__name__}: {e}"[:300]}
        save()
        print(f"kernel_bench: {design} done", file=sys.stderr, flush=True)


def checks_below(doc):
    """The names of the checks whose cosine is under MIN_COSINE (exit 1)."""
    bad = [f"{d} two backwards" for d, r in doc["designs"].items() if r["paths_min_cosine"] < MIN_COSINE]
    for d, r in doc["designs"].items():
        bad += [f"{d} {k} vs reference" for k, v in r.get("vs_reference", {}).items()
                if v["min_cosine"] < MIN_COSINE]
    for d, r in doc["depth"].items():
        bad += [f"{d} {k}" for k in ("forward_vs_reference", "gradients_vs_reference")
                if k in r and r[k]["min_cosine"] < MIN_COSINE]
    for d, r in doc["liger"].items():
        if isinstance(r, dict):
            bad += [f"liger {d} {k}" for k, v in r.items() if k.endswith(("_agree", "_vs_reference"))
                    and v["min_cosine"] < MIN_COSINE]
    return bad


def report(doc):
    print(f"kernel_bench: {doc['device_name']}, torch {doc['torch']}, triton {doc['triton']}; {doc['tokens']} tokens, "
          f"D {doc['d_model']}, n {doc['streams']}, bf16")
    print(f"| design | pass | ms | {doc['roofline_gpu']} estimate ms | GB/s | eta | launches (counted) | kernels "
          f"launched |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for design, r in doc["designs"].items():
        for name, row in r.items():
            if isinstance(row, dict) and "ms" in row:
                est = row.get("predicted_ms", "")
                eta = "" if row.get("eta") is None else row["eta"]
                print(f"| {design} | {name} | {row['ms']:.3f} | {est} | {row.get('gb_per_s', '')} | {eta} | "
                      f"{row.get('launches', '')} | {' '.join(row['kernels'])} |")
        print(f"{design}: one launch over the split, backward {r['one_launch_over_three']:.3f}, forward "
              f"{r['forward_one_launch_over_two']:.3f} (keep the one launch where < 1); the two backwards' "
              f"gradients, min cosine {r['paths_min_cosine']:.6f}; against the reference {r.get('vs_reference')}")
    report_depth(doc)


def report_depth(doc):
    """The depth families' rows (GPU ms beside the host's), the bare launch and liger's section."""
    print("| design | pass | ms | host ms | host us / consumer | GB/s | eta | launches (counted) | kernels launched |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for design, r in doc["depth"].items():
        if "reason" in r:
            print(f"| {design} | failed: {r['reason']} |")
            continue
        for name in ("forward", "backward"):
            row = r[name]
            print(f"| {design} | {name} | {row['ms']:.3f} | {row['host_ms']:.3f} | {row['host_us_per_consumer']} | "
                  f"{row.get('gb_per_s', '')} | {'' if row.get('eta') is None else row['eta']} | "
                  f"{row.get('launches', '')} | {' '.join(dict.fromkeys(row['kernels']))} |")
        print(f"{design}: against ops.py, forward {r['forward_vs_reference']}, gradients "
              f"{r['gradients_vs_reference']}; a push {r['push_host_us']} us of host time; host over kernels "
              f"{r['host_over_kernels']}")
    print(f"bare launch: {doc['host']}")
    print(f"liger: {doc['liger']}")


def run_sections(args, device, doc, c, save):
    """Every section asked for, in the docstring's order, into doc; save() after each (--json: a run killed at its
    time limit leaves what it measured)."""
    import kernel_bench_depth as depth
    import kernel_bench_liger
    import roofline
    peak = roofline.hbm_peak(doc["device_name"])
    for design in args.designs:
        if design in HC_DESIGNS:
            doc["designs"][design] = bench(design, args, device, c, peak=peak)
            doc["designs"][design]["vs_reference"] = hc_reference(design, args, device)
            save()
    depth_sections(args, device, peak=peak, doc=doc, save=save)
    doc["host"] = {"bare_launch": depth.bare_launch(device, LAUNCHES[args.tiny])}
    save()
    if args.no_liger:
        doc["liger"] = {"reason": "--no-liger"}
    else:
        try:
            doc["liger"] = kernel_bench_liger.section(args, device, sublayer, doc["depth"].get("block_attnres"))
        except Exception as e:  # their ops failing here is a finding, not a reason to lose ours
            doc["liger"] = {"reason": f"{type(e).__name__}: {e}"[:300]}
    if args.probe:
        records = depth.probe_records(args.probe)
        doc["probe"] = {"file": args.probe, "kernels": len(records)}
        for section in list(doc["designs"].values()) + list(doc["depth"].values()):
            depth.attach_probe(section, records)
    save()


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"          # before triton is first imported
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
    doc = {"schema": "depthbench.kernel_bench/2", "device": device, "torch": torch.__version__,
           "triton": triton.__version__, "tokens": args.tokens, "d_model": args.d_model, "streams": args.streams,
           "repeat": args.repeat, "tau_us": round(1e6 * c["tau"], 3), "eta": roofline.ETA_GPU,
           "device_name": name, "roofline_gpu": c["gpu"], "min_cosine": MIN_COSINE, "designs": {}, "depth": {},
           "host": {}, "liger": {}, "probe": None}
    def save():
        if args.json:
            write_json(Path(args.json), doc, strict=True)
    run_sections(args, device, doc=doc, c=c, save=save)
    report(doc)
    bad = checks_below(doc)
    if bad:
        print(f"kernel_bench.py: under cosine {MIN_COSINE}: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
