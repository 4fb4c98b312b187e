"""
A roofline estimate of one training step on an H200 (or an H100 SXM: --gpu), without a GPU (issue 52, item 5;
docs/speed.md#gpu-smoke-and-roofline).

    python scripts/roofline.py                          # L70 d640 T2048 B2: every design, today's path and the GPU path
    python scripts/roofline.py --batch 8 --seq 4096     # another shape (--layers, --width, --vocab too)
    python scripts/roofline.py --fit-on mhc --json r.json
    python scripts/roofline.py --gpu H100               # calibrated on the H200, moved by HBM bandwidth (`calibrate`)

The model is additive, one term per resource, each term counted analytically per design at the asked shape:

    step ms = GEMM FLOPs / F_gemm + attention FLOPs / F_attn + backbone elementwise (per activation element) x c_elem
              + depth-mixing HBM bytes / (eta x HBM peak: 4.8 TB/s on the H200) + GPU kernels x tau

(the GPU path of HC and mHC less Pre-LN's norm and residual add, whose work their kernels do: `replaced`)

Calibration (on the first GPU table, docs/speed.md#gpu-runs, copied into MEASURED below): Pre-LN's row gives
four constants, from its profile: F_gemm (GEMMs were 37% of its 54 ms busy time), F_attn (flash attention 28%),
c_elem (the other 35%, scaled by L B T d) and tau ((88.3 - 54) ms idle over 9,155 kernels: the launch-bound gap).
One more row gives eta, the achieved fraction of HBM bandwidth on the mixing's bytes (default: Full AttnRes, the
memory-bound one). Every other measured row is then PREDICTED, and `--loo` fits eta on each row in turn and
reports the error on the others (leave-one-out).

Two paths per design:
  today   the CPU-tuned bodies the H200 ran: fp32 state, a read-modify-write of the gradient bank per consumer
          (TODAY_PASSES, per design), and its kernels: scripts/kernel_count.py's eager count at L70 (CPU_KERNELS_L70,
          leaf aten ops of one d64 step; the count does not depend on the width) times inductor's fusion ratio on
          Pre-LN (9,155 / its eager count), scaled linearly in depth for other L
  gpu     fused kernels (issue 52's GPU bodies): the backbone is Pre-LN's, plus the mixing's HBM bytes in bf16 at
          the lower bound of the first GPU measurement's notes and a few launches per sublayer (FUSED_LAUNCHES); where
          depthbench/kernels/triton_attnres_chunk.py, triton_hc.py or triton_moda.py import, their traffic()
          functions replace the analytic bytes and launches (`traffic_rows`: the plug-in point)

The time model (issue 68; docs/speed.md#the-time-model), printed after the table where scripts/kernel_probe.py's
JSON is at hand (--probe, default docs/kernel_probe*.json) for this shape, on an H100 SXM: per Triton kernel
max(bytes / (eta_gpu x HBM peak), issue floor, FLOPs / peak) with the binding term named (its bytes: the traffic
rows tagged with its name; the torch ops' rows an entry of their own, bound on bytes), plus the host time the
probe measured beyond Pre-LN's (its training step compiled per block as train.py runs it, where measured; the eager
step's account beside it), over Pre-LN's step, against issue 68's targets (TIME_TARGETS).

What it leaves out (so read the errors as the model's): kernel overlap, L2 hits, the mixing's FLOPs (under 1% of
the step at n = 4), and that a launch-bound step hides some device time behind the host's.
"""
import importlib
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from depthbench.reports.compiled_code import H100  # noqa: E402  (the probe's GPU: its issue rate)
from depthbench.files.common import ArgParser  # noqa: E402

# HBM bytes/s by device name: the first key a name contains (the longer names first). The model is calibrated on
# an H200 and moved to an H100 SXM (the same GH100 compute and clocks, 3.35 TB/s of HBM3) by its bandwidth alone
# (`calibrate`'s gpu); any other GPU differs in compute too, so its estimate stays the H200's
HBM_PEAK = {"H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
PEAK_HBM = HBM_PEAK["H200"]        # the calibration's GPU
MODEL_GPUS = ("H200", "H100")      # the GPUs the model estimates
ETA_GPU = 0.8                      # HBM fraction a streaming fused kernel reaches (the first notes' bound assumes it)
DESIGNS = ["preln", "hc", "mhc", "attnres", "block_attnres", "moda"]
TARGETS = {"preln": 1.0, "hc": 1.15, "mhc": 1.10, "attnres": 1.5, "block_attnres": 1.05, "moda": 1.3}
BLOCK_GROUPS = 8                   # Block AttnRes' N (residuals.py's default)
KERNEL_TARGET = 1.5                # GPU kernels per step over Pre-LN's (issue 52's acceptance)
FALLBACKS = set()                  # designs whose kernel file did not import (gpu_traffic says why, once)
CARD = {"layers": 70, "width": 640, "seq": 2048, "batch": 2, "vocab": 50280, "heads": 16}
# docs/speed.md#gpu-runs (2026-12-04): one H200, PyTorch 2.11.0+cu130, bf16 autocast, compiled per block,
# L70 d640 T2048 B2
MEASURED = {"preln": {"step_ms": 88.3, "busy_ms": 54.0, "kernels": 9155, "peak_gb": 9.3},
            "hc": {"step_ms": 245.8, "peak_gb": 22.4},
            "mhc": {"step_ms": 563.0, "busy_ms": 166.0, "kernels": 66288, "peak_gb": 22.4},
            "attnres": {"step_ms": 433.8, "busy_ms": 354.0, "kernels": 23192, "peak_gb": 12.7},
            "block_attnres": {"step_ms": 481.1, "peak_gb": 11.4},
            "moda": {"step_ms": 465.9, "peak_gb": 20.7}}
# Bytes per token the GPU path (kernels "triton") keeps for the backward beyond Pre-LN's, L (a d + b) + e d + f, in
# the "compiled" mode (bf16 autocast, each block compiled), as residuals.py's act_bytes count today's path's (kernels
# "fast"): `TRITON_INTERPRET=1 python scripts/calibrate_memory.py --designs hc,mhc,attnres,block_attnres,moda
# --modes compiled --kernels triton`, 2026-12-06 (the Triton bodies run eagerly inside the compiled blocks there)
GPU_ACT_BYTES = {"preln": (0, 0, 0, 0), "hc": (14, 416, 24, 0), "mhc": (14, 520, 24, 0), "attnres": (10, 40, 0, 4),
                 "block_attnres": (18, 32, 0, 4), "moda": (10, 0, -1.5, 0)}
PRELN_SHARES = {"gemm": 0.37, "attention": 0.28}  # of Pre-LN's busy time (the profile); the rest is elementwise
# scripts/kernel_count.py --depths 70 (d64 H4 T32 B2 V256, eager, CPU leaf aten ops), counted 2026-12-05
CPU_KERNELS_L70 = {"preln": 5997, "hc": 12860, "mhc": 53603, "attnres": 12230, "block_attnres": 13836, "moda": 17596}
# passes over a consumer's (or sublayer's) state slots, forward + backward: today's fp32 bodies and the fused bound
TODAY_PASSES = {"hc": 12, "mhc": 12, "attnres": 6, "block_attnres": 6, "moda": 9}
FUSED_PASSES = {"hc": 6, "mhc": 6, "attnres": 2, "block_attnres": 2, "moda": 4}
FUSED_LAUNCHES = {"hc": 6, "mhc": 8, "attnres": 2, "block_attnres": 2, "moda": 2}  # per sublayer / consumer / block
# Pre-LN's sublayer norm and residual add, which the backbone's terms hold (calibrated on Pre-LN's step) and which
# HC's and mHC's kernels replace: their traffic() counts the branch's RMSNorm inside the read and the add inside the
# write, so the GPU path takes Pre-LN's out of the backbone (`replaced`). What inductor makes of them (its output code
# for one compiled Pre-LN block, fwd + bwd under bf16 autocast, read on the CPU: the same scheduler's fusions; the
# stream fp32, y, h and the projections' input gradients bf16), per block: forward the first norm (reads x, writes
# h: 6 bytes a channel and token), the second with the first add (reads x, y1, writes h: 8), the block's two adds
# (reads x, y1, y2, writes x: 12); backward the MLP norm's (reads its two input gradients, x, y1 and the stream's
# gradient, writes that gradient and y1's: 20), the gains' reductions (18) and the attention norm's (three input
# gradients, x, the stream's gradient in, out: 18): 82 bytes and 6 launches a block, 41 and 3 a sublayer. Of these HC
# still runs the sum of the input projections' gradients into its read's dh (2 or 3 bf16 reads, a bf16 write: 7 on
# average, 1 launch), so it replaces 34 bytes and 2 launches a sublayer (the first GPU's top_kernels show the real
# split at 4,096 tokens, where inductor may split the gains' reductions in two).
NORM_ADD_BYTES = 34
NORM_ADD_LAUNCHES = 2
REPLACES_NORM_ADD = ("hc", "mhc")
# The time model (issue 68; docs/speed.md#the-time-model): per Triton kernel max(bytes / (eta_gpu x HBM), issue
# floor, FLOPs / peak) + host time, on an H100 SXM. Dense peaks of NVIDIA's H100 SXM datasheet: bf16 tensor cores
# 989 TFLOP/s, tf32 495, fp32 on CUDA cores 67 (its boost clock; the issue floor uses 1.755 GHz)
PEAK_FLOPS = {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}
TIME_TARGETS = {"preln": 1.0, "hc": 1.15, "mhc": 1.15, "attnres": 1.5, "block_attnres": 1.10, "moda": 1.5}
DOCS = Path(__file__).resolve().parents[1] / "docs"   # docs/kernel_probe*.json: scripts/kernel_probe.py's card runs
# The GPU's gap between two kernels of one CUDA graph replayed (the step as one graph: compiled.capture_step), in
# place of tau, the launch gap the first H200 measured step by step: an assumption until the first GPU's
# card_captured stage measures it ((Pre-LN's captured step - its kernels' time) / its kernels)
GRAPH_GAP_S = 1.0e-6
TORCH_OPS = "torch ops"            # the time model's entry for the traffic rows no Triton kernel moves
NAMED_OFF = 2.0                    # a kernel whose loads name this many times its own rows' bytes (or 1 / it) is noted


def d_ff(width):
    """shapes.ffn_dim: SwiGLU's ceil(8d/3), rounded up to a multiple of 16 (copied: this script imports no torch)."""
    return 16 * math.ceil(math.ceil(8 * width / 3) / 16)


def flops(shape):
    """(GEMM FLOPs, attention FLOPs) of one training step of the backbone (fwd + bwd = 3x fwd for GEMMs; causal
    attention's two T x T products at half the square, its backward 2.5x its forward, as flash attention's)."""
    L, d, T, B = shape["layers"], shape["width"], shape["seq"], shape["batch"]
    tokens = B * T
    gemm = 3 * 2 * tokens * (L * (4 * d * d + 3 * d * d_ff(d)) + d * shape["vocab"])
    attention = 3.5 * 2 * 2 * B * T * T / 2 * d * L
    return gemm, attention


def group_of(k, n_sub, n_groups=None):
    """Block AttnRes' group of sublayer k (residuals.BlockAttnRes.groups, the even reading)."""
    return k * (n_groups or BLOCK_GROUPS) // n_sub


def slots_read(design, L):
    """State slots (one slot: B T d elements) a design's mixing reads per pass, summed over the step's consumers:
    HC/mHC n = 4 streams per sublayer; Full AttnRes k sources at consumer k (2L + 1 consumers, the last the final
    readout); Block AttnRes the embedding, the completed groups and the partial one; MoDA 2b depth keys and values
    at block b."""
    n_sub = 2 * L
    if design in ("hc", "mhc"):
        return 4 * n_sub
    if design == "attnres":
        return sum(range(1, n_sub + 2))
    if design == "block_attnres":
        return sum(2 + group_of(k, n_sub) for k in range(n_sub + 1))
    if design == "moda":
        return sum(2 * b for b in range(L))
    return 0


def mixing_bytes(design, shape, passes, elem_bytes):
    """HBM bytes of a design's depth mixing in one step: passes x slots read x slot bytes."""
    slot = shape["batch"] * shape["seq"] * shape["width"] * elem_bytes
    return passes.get(design, 0) * slots_read(design, shape["layers"]) * slot


def today_kernels(design, shape, fusion):
    """GPU kernels of today's path: the CPU eager count at L70 x inductor's fusion ratio, linear in depth."""
    return CPU_KERNELS_L70[design] * fusion * shape["layers"] / 70


def gpu_traffic(design, shape):
    """(bytes, extra launches) of the fused GPU path's mixing: depthbench/kernels/triton_*.py's traffic rows where they
    import (`traffic_rows`: the plug-in point), else the analytic bound (FUSED_PASSES in bf16, FUSED_LAUNCHES) ->
    (bytes, launches, source)."""
    L = shape["layers"]
    try:
        made = traffic_rows(design, shape)
        if made is not None:
            rows, source = made
            return sum(r["read"] + r["written"] for r in rows), sum(r["launches"] for r in rows), source
    except ImportError as error:                  # no triton here: the bound, and say so (once per design)
        if design not in FALLBACKS:
            FALLBACKS.add(design)
            print(f"roofline: {design}'s GPU path from the analytic bound ({error})", file=sys.stderr)
    units = {"hc": 2 * L, "mhc": 2 * L, "attnres": 2 * L + 1, "block_attnres": 2 * L + 1, "moda": L}
    return (mixing_bytes(design, shape, FUSED_PASSES, 2), FUSED_LAUNCHES.get(design, 0) * units.get(design, 0),
            "analytic bound")


def traffic_rows(design, shape):
    """(rows, source) of one step of the design's GPU path: its kernel file's traffic rows (each {read, written,
    launches, launch}: `launch` the Triton kernel or torch op that moves the row's bytes) times the step's count of
    each, and the function that made them; None for a design without a kernel file (Pre-LN)."""
    L, tokens, D = shape["layers"], shape["batch"] * shape["seq"], shape["width"]
    if design in ("hc", "mhc"):                     # one sublayer's rows, 2L sublayers
        rows = importlib.import_module("depthbench.kernels.triton_hc").traffic(design, tokens, D)
        return [scaled(r, 2 * L) for r in rows], "depthbench.kernels.triton_hc.traffic"
    if design in ("attnres", "block_attnres"):
        return attnres_rows(design, L, tokens, D), "depthbench.kernels.triton_attnres_chunk.step_traffic"
    if design == "moda":
        return moda_rows(L, tokens, D, shape["heads"]), "depthbench.kernels.triton_moda.traffic"
    return None


def scaled(row, times):
    """A traffic row moved `times` in a step: its bytes and launches times that, its tags as they are."""
    return {**row, "read": times * row["read"], "written": times * row["written"],
            "launches": times * row["launches"]}


def attnres_reads(design, L):
    """[(k, n)] for the consumers that mix, k = 1 .. 2L (2L: the head; consumer 0 reads RMSNorm(e), no mix): n bank
    sources, as residuals.py's Full and Block AttnRes push them (Block: after a group closes, at the write of the
    sublayer that opens the next, and every consumer k >= 1 reads the open sum as the extra source), and how many
    sources the design pushes in all."""
    n_sub = 2 * L
    if design == "attnres":
        return [(k, k + 1) for k in range(1, n_sub + 1)], n_sub + 1
    opens = [i for i in range(1, n_sub) if group_of(i, n_sub) != group_of(i - 1, n_sub)]
    return [(k, 1 + sum(i < k for i in opens)) for k in range(1, n_sub + 1)], 1 + len(opens)


def attnres_rows(design, L, tokens, D):
    """depthbench.kernels.triton_attnres_chunk's step_traffic of the design's bank (its consumers' reads, its size),
    the bank in bf16: the two-phase mix residuals.py's Full and Block AttnRes run, one row a launch or op."""
    module = importlib.import_module("depthbench.kernels.triton_attnres_chunk")
    reads = [n for k, n in attnres_reads(design, L)[0]]
    n_max = 2 * L + 1 if design == "attnres" else BLOCK_GROUPS + 1         # residuals.py's bank sizes
    return module.step_traffic(reads, n_max, tokens, D, extra=design == "block_attnres")


def moda_rows(L, tokens, D, heads):
    """depthbench.kernels.triton_moda.traffic's rows over MoDA's consumers (block b = 1 .. L - 1 reads 2b slots: its
    CONSUMER_PARTS) and its slots (2L - 1: two per block, the last block's MLP writes none; SLOT_PARTS once each);
    as many kv heads as heads."""
    moda = importlib.import_module("depthbench.kernels.triton_moda")
    hd = D // heads
    rows = []
    for b in range(1, L):
        parts = moda.traffic(2 * b, tokens, heads=heads, kv_heads=heads, head_dim=hd)
        rows += [parts[k] for k in moda.CONSUMER_PARTS]
    parts = moda.traffic(0, tokens, heads=heads, kv_heads=heads, head_dim=hd)
    return rows + [scaled(parts[k], 2 * L - 1) for k in moda.SLOT_PARTS]


def kept_per_token(act_bytes, shape):
    """L (a d + b) + e d + f: a design's bytes per token beyond Pre-LN's (costs.token_bytes' form)."""
    a, b, e, f = act_bytes
    return shape["layers"] * (a * shape["width"] + b) + e * shape["width"] + f


def gpu_peak_gb(design, shape):
    """The GPU path's peak training memory (GB) at the card's micro-batch: the measured peak of today's path plus
    the tokens x the difference of what the two paths keep for the backward (GPU_ACT_BYTES, today's act_bytes in the
    compiled mode). None at another shape, where no peak was measured. The backward's transients (the gradient
    banks, a chunk's phase-1 results) are taken as today's: an estimate, the GPU script measures it."""
    if {k: shape[k] for k in CARD} != CARD:
        return None
    from residuals import RESIDUALS                # torch: only where the kernels' traffic imports it anyway
    today = RESIDUALS[design].activation_bytes()["compiled"]
    tokens = shape["batch"] * shape["seq"]
    change = kept_per_token(GPU_ACT_BYTES[design], shape) - kept_per_token(today, shape)
    return MEASURED[design]["peak_gb"] + tokens * change / 1e9


def hbm_peak(name):
    """HBM bytes/s of a GPU by its device name (HBM_PEAK), None for one the table lacks (or the CPU)."""
    return next((value for key, value in HBM_PEAK.items() if key in name), None)


def model_gpu(name):
    """The GPU of MODEL_GPUS a device name is ("NVIDIA H100 80GB HBM3": "H100"; not "NVIDIA H100 PCIe", whose
    HBM_PEAK differs), None for any other."""
    return next((gpu for gpu in MODEL_GPUS if hbm_peak(name) == HBM_PEAK[gpu] and gpu in name), None)


def calibrate(fit_on="attnres", measured=MEASURED, shape=CARD, gpu="H200"):
    """The constants from Pre-LN's row and eta from `fit_on`'s (None: eta = 0.8, the notes' assumption), on the
    H200 the rows were measured on; then moved to `gpu` (MODEL_GPUS): its HBM bandwidth for the mixing's bytes,
    and the backbone's elementwise work (bandwidth-bound) scaled by the two peaks' ratio. GEMMs, attention and the
    launch gap stay (the same compute; the host's launches)."""
    base = measured["preln"]
    gemm, attention = flops(shape)
    busy = base["busy_ms"] / 1e3
    c = {"F_gemm": gemm / (PRELN_SHARES["gemm"] * busy), "F_attn": attention / (PRELN_SHARES["attention"] * busy),
         "c_elem": (1 - sum(PRELN_SHARES.values())) * busy / activations(shape),
         "tau": (base["step_ms"] - base["busy_ms"]) / 1e3 / base["kernels"], "hbm": PEAK_HBM, "gpu": "H200",
         "fusion": base["kernels"] / CPU_KERNELS_L70["preln"], "eta": ETA_GPU, "eta_gpu": ETA_GPU, "fit_on": fit_on}
    if fit_on:
        moved = mixing_bytes(fit_on, shape, TODAY_PASSES, 4)
        rest = step_today(fit_on, shape, c) - moved / (c["eta"] * PEAK_HBM)  # every term but the mixing's bytes
        left = measured[fit_on]["step_ms"] / 1e3 - rest
        if left <= 0 or not moved:
            raise ValueError(f"cannot fit eta on {fit_on}: the other terms already predict {1e3 * rest:.1f} ms")
        c["eta"] = moved / PEAK_HBM / left
    if gpu not in MODEL_GPUS:
        raise ValueError(f"the roofline models {', '.join(MODEL_GPUS)}, not {gpu!r}")
    c["hbm"], c["gpu"] = HBM_PEAK[gpu], gpu
    c["c_elem"] *= PEAK_HBM / c["hbm"]
    return c


def activations(shape):
    return shape["layers"] * shape["batch"] * shape["seq"] * shape["width"]


def backbone(shape, c):
    """Seconds of Pre-LN's busy time at `shape`: GEMMs, attention and its elementwise work."""
    gemm, attention = flops(shape)
    return gemm / c["F_gemm"] + attention / c["F_attn"] + c["c_elem"] * activations(shape)


def step_today(design, shape, c):
    """Seconds of one step of today's path: the backbone, the mixing's fp32 bytes and every kernel's launch."""
    return (backbone(shape, c) + mixing_bytes(design, shape, TODAY_PASSES, 4) / (c["eta"] * c["hbm"])
            + today_kernels(design, shape, c["fusion"]) * c["tau"])


def replaced(design, shape):
    """(HBM bytes, launches) of Pre-LN's norms and residual adds that `design`'s GPU kernels replace, for one step:
    NORM_ADD_BYTES and NORM_ADD_LAUNCHES a sublayer for HC and mHC, (0, 0) for the others."""
    if design not in REPLACES_NORM_ADD:
        return 0, 0
    n_sub = 2 * shape["layers"]
    return NORM_ADD_BYTES * activations(shape) * 2, NORM_ADD_LAUNCHES * n_sub   # activations: L B T d


def estimate(design, shape, c):
    """{today_ms, gpu_ms, gpu_kernels, ...} of one design at `shape` with the constants c: the GPU path is Pre-LN's
    backbone and kernels, less what the design's kernels replace (`replaced`), plus its mixing's bytes and launches."""
    base_kernels = today_kernels("preln", shape, c["fusion"])
    mix, launches, source = gpu_traffic(design, shape)
    gone_bytes, gone_launches = replaced(design, shape)
    kernels = base_kernels + launches - gone_launches
    net = mix - gone_bytes                         # Pre-LN's replaced bytes at the eta of the kernels replacing them
    gpu = backbone(shape, c) + kernels * c["tau"]
    return {"today_ms": 1e3 * step_today(design, shape, c), "gpu_ms": 1e3 * (gpu + net / (c["eta_gpu"] * c["hbm"])),
            "gpu_ms_fitted_eta": 1e3 * (gpu + net / (c["eta"] * c["hbm"])),
            "today_kernels": round(today_kernels(design, shape, c["fusion"])),
            "gpu_kernels": round(kernels), "replaced_bytes": gone_bytes, "replaced_launches": gone_launches,
            "gpu_mix_bytes": mix, "gpu_traffic": source, "gpu_peak_gb": gpu_peak_gb(design, shape)}


def table(shape, c, designs=DESIGNS):
    """{design: estimate + the ratios to Pre-LN's GPU path and whether each meets issue 52's targets}."""
    rows = {d: estimate(d, shape, c) for d in designs}
    base = rows["preln"]
    for d, r in rows.items():
        r["gpu_x_preln"] = r["gpu_ms"] / base["gpu_ms"]
        r["gpu_x_preln_fitted_eta"] = r["gpu_ms_fitted_eta"] / base["gpu_ms_fitted_eta"]
        r["gpu_kernels_x_preln"] = r["gpu_kernels"] / base["gpu_kernels"]
        r["memory_ok"] = r["gpu_peak_gb"] is None or r["gpu_peak_gb"] <= MEASURED[d]["peak_gb"]
        r["meets"] = r["gpu_x_preln"] <= TARGETS[d] and r["gpu_kernels_x_preln"] <= KERNEL_TARGET and r["memory_ok"]
    return rows


def leave_one_out(shape=CARD):
    """{fitted row: {other measured row: relative error of its predicted today's step}}, eta fitted on each in turn."""
    out = {}
    for fit_on in [d for d in MEASURED if d != "preln"]:
        c = calibrate(fit_on, shape=shape)
        out[fit_on] = {d: 1e3 * step_today(d, shape, c) / MEASURED[d]["step_ms"] - 1
                       for d in MEASURED if d not in ("preln", fit_on)}
    return out


def report(rows, c, shape):
    """The table: per design today's predicted step (and the measured one at the card's shape), the GPU path's, and
    its ratio to Pre-LN against issue 52's targets."""
    card = shape == CARD and c["gpu"] == "H200"     # the measured rows: the H200's at the card's shape
    print(f"roofline for an {c['gpu']} ({c['hbm'] / 1e12:.2f} TB/s) at L{shape['layers']} d{shape['width']} "
          f"T{shape['seq']} B{shape['batch']}: F_gemm "
          f"{c['F_gemm'] / 1e12:.0f} TFLOP/s, F_attn {c['F_attn'] / 1e12:.0f} TFLOP/s, "
          f"tau {1e6 * c['tau']:.2f} us/kernel, eta {c['eta']:.2f} of {PEAK_HBM / 1e12:.1f} TB/s "
          f"(fitted on preln + {c['fit_on'] or 'nothing'}, on the H200); the GPU path at "
          f"eta {c['eta_gpu']:.2f} (and, the last x, at the fitted eta)")
    print(f"| design | today ms (pred) | today ms (measured) | GPU path ms (pred) | x Pre-LN | target | kernels "
          f"(pred) | x Pre-LN | peak GB today (measured) | GPU path (pred) | meets | x Pre-LN, fitted eta | "
          f"GPU path traffic |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for d, r in rows.items():
        seen = MEASURED.get(d, {}).get("step_ms", "-") if card else "-"
        peak_today = MEASURED[d]["peak_gb"] if card else "-"
        peak = "-" if r["gpu_peak_gb"] is None else f"{r['gpu_peak_gb']:.1f}"
        meets = "yes" if r["meets"] else "NO"
        print(f"| {d} | {r['today_ms']:.1f} | {seen} | {r['gpu_ms']:.1f} | "
              f"{r['gpu_x_preln']:.2f} | {TARGETS[d]:.2f} | {r['gpu_kernels']:,} | {r['gpu_kernels_x_preln']:.2f} | "
              f"{peak_today} | {peak} | {meets} | {r['gpu_x_preln_fitted_eta']:.2f} | {r['gpu_traffic']} |")


def load_probe(paths):
    """One probe document from scripts/kernel_probe.py's JSON files (rows concatenated, host designs merged; the
    first file's shape and launch costs), None where none exists."""
    doc = None
    for path in [Path(p) for p in paths if Path(p).exists()]:
        part = json.loads(path.read_text())
        if doc is None:
            doc = {**part, "rows": list(part["rows"]), "host": part.get("host")}
            continue
        doc["rows"] += part["rows"]
        if part.get("host"):
            host = doc["host"] or {**part["host"], "designs": {}}
            host["designs"] = {**host["designs"], **part["host"]["designs"]}
            doc["host"] = host
    return doc


def kernel_time(row, nbytes, c):
    """{bytes, issue, flops: seconds; binds: the largest's name; seconds: the max} of one kernel's step: its bytes
    over eta_gpu x the HBM peak, its warp-instructions over the issue rate (132 SMs x 4 schedulers x 1.755 GHz),
    its tl.dot FLOPs (bf16, tf32) and CUDA-core fp32 FLOPs (the SASS' FFMA / FADD / FMUL) over their peaks."""
    gpu = H100
    terms = {"bytes": nbytes / (c["eta_gpu"] * c["hbm"]),
             "issue": row["warp_instructions"] / (gpu["sms"] * gpu["schedulers"] * gpu["clock_hz"]),
             "flops": row["fp32_flops"] / PEAK_FLOPS["fp32"] + sum(
                 n / PEAK_FLOPS[kind] for kind, n in row["dot_flops"].items() if kind != "fp32")}
    binds = max(terms, key=terms.get)
    return {**terms, "binds": binds, "seconds": terms[binds]}


def host_time(design, rows, host, shape):
    """Seconds of host work a step of `design` adds to Pre-LN's (the probe's host runs, launches no-ops, scaled to
    shape's depth) -> {step, specialise, breaks, total, eager_total, compiled}. Where the probe measured the step
    compiled per block as train.py runs it on a GPU (compiled_ms, design and Pre-LN): that step beyond Pre-LN's, its
    graph breaks inside it (breaks 0); else the eager step beyond Pre-LN's plus its graph breaks beyond Pre-LN's at
    the measured cost of one. Either way plus each Triton launch's argument specialisation (not in the no-op
    launches). eager_total: the eager account, kept beside the compiled one."""
    mine, base = host["designs"][design], host["designs"]["preln"]
    depth = shape["layers"] / host["shape"]["layers"]
    specialise = sum(r["launches"] * r["arguments"] for r in rows) * host["per_argument_us"] / 1e6
    eager = (mine["eager_ms"] - base["eager_ms"]) / 1e3 * depth
    breaks = (mine["breaks_per_block"] - base["breaks_per_block"]) * shape["layers"] * host["break_us"] / 1e6
    eager_total = eager + specialise + breaks
    if "compiled_ms" not in mine or "compiled_ms" not in base:
        return {"step": eager, "specialise": specialise, "breaks": breaks, "total": eager_total,
                "eager_total": eager_total, "compiled": False}
    compiled = (mine["compiled_ms"] - base["compiled_ms"]) / 1e3 * depth
    return {"step": compiled, "specialise": specialise, "breaks": 0.0, "total": compiled + specialise,
            "eager_total": eager_total, "compiled": True}


class AccountError(ValueError):
    """A design's traffic rows and the probe's kernels do not pair up: the time model cannot book a kernel's bytes."""


def is_triton(launch):
    """Whether a traffic row's launch tag names a Triton kernel: the kernel files name their @triton.jit functions
    with a leading underscore (`_chunk_forward`, as scripts/kernel_probe.py records them); torch ops' tags have none
    ("copy", "dW GEMM (and cast)")."""
    return launch.startswith("_")


def booked(design, shape, kernels):
    """The design's step traffic by what moves it -> ({Triton kernel: bytes}, torch ops' bytes, torch ops'
    launches), each kernel's bytes the sum of the traffic rows tagged with its name. AccountError, in one line,
    where a row has no tag, a probe kernel (of `kernels`, the probe's names) has no row, or rows name a Triton kernel
    the probe did not record."""
    try:
        made = traffic_rows(design, shape)
    except ImportError as error:
        raise AccountError(f"time model: {design}'s traffic rows did not import ({error})") from error
    rows = made[0] if made else []
    if any("launch" not in r for r in rows):
        raise AccountError(f"time model: {design}: a traffic row names no launch (`moved`'s / `row`'s launch=)")
    own, torch_bytes, torch_launches = {}, 0, 0
    for r in rows:
        if is_triton(r["launch"]):
            own[r["launch"]] = own.get(r["launch"], 0) + r["read"] + r["written"]
        else:
            torch_bytes += r["read"] + r["written"]
            torch_launches += r["launches"]
    problems = [f"the probe's kernel {k} has no traffic row" for k in sorted(set(kernels) - set(own))]
    problems += [f"traffic rows name Triton kernel {k}, which the probe did not record" for k in
                 sorted(set(own) - set(kernels))]
    if problems:
        raise AccountError(f"time model: {design}: {'; '.join(problems)} (tag each row with the kernel that moves "
                           f"it, or run scripts/kernel_probe.py again)")
    return own, torch_bytes, torch_launches


def time_model(design, shape, c, probe):
    """{step_ms, device_ms, host_ms, kernels: [{kernel, bytes, issue, flops, binds, ...}]} of `design` on the
    probe's GPU: Pre-LN's backbone and launches (less what HC's and mHC's kernels replace), each Triton kernel's
    max(bytes, issue, FLOPs) term, the torch ops' bytes and launches, and host time. A kernel's bytes are its own
    traffic rows' (`booked`: the honest account, each row tagged with the launch that moves it), so one kernel's code
    moves no other's time; `named_x` beside them: the global bytes its compiled loads and stores name over those
    (far above 1: re-reads through L2, or bytes the account misses). The torch ops' rows (copies, zeros, autograd's
    adds, cuBLAS' dW) are a visible "torch ops" entry bound on their bytes at the same eta x HBM, their launches x tau
    in the launch gap as Pre-LN's own torch launches are (an entry, not a hidden glue term, so the table shows what
    the kernels leave to torch)."""
    base = backbone(shape, c) + today_kernels("preln", shape, c["fusion"]) * c["tau"]
    if design == "preln":
        return {"step_ms": 1e3 * base, "device_ms": 1e3 * base, "host_ms": 0.0, "kernels": []}
    rows = [r for r in probe["rows"] if r["design"] == design]
    own, torch_bytes, torch_launches = booked(design, shape, [r["kernel"] for r in rows])
    gone_bytes, gone_launches = replaced(design, shape)
    bandwidth = c["eta_gpu"] * c["hbm"]
    kernels = [{"kernel": r["kernel"], "own_bytes": own[r["kernel"]],
                "named_x": r["access_bytes"] / max(own[r["kernel"]], 1), **kernel_time(r, own[r["kernel"]], c)}
               for r in rows]
    torch_s = torch_bytes / bandwidth
    kernels.append({"kernel": TORCH_OPS, "own_bytes": torch_bytes, "launches": torch_launches, "bytes": torch_s,
                    "issue": 0.0, "flops": 0.0, "binds": "bytes", "seconds": torch_s})
    glue = torch_launches - gone_launches
    device = base + glue * c["tau"] - gone_bytes / bandwidth + sum(k["seconds"] for k in kernels)
    host = host_time(design, rows, probe["host"], shape) if probe.get("host") else {"total": 0.0}
    return {"step_ms": 1e3 * (device + host["total"]), "device_ms": 1e3 * device, "host_ms": 1e3 * host["total"],
            "host": {k: 1e3 * v for k, v in host.items() if k != "compiled"}, "kernels": kernels}


def host_parts(row):
    """A time model row's host ms as "total (step + arguments + breaks)" and the eager account's total beside it;
    Pre-LN's (the base) as 0."""
    host = row.get("host", {})
    if "step" not in host:
        return f"{row['host_ms']:.1f} | -"
    return (f"{row['host_ms']:.1f} ({host['step']:.1f} + {host['specialise']:.1f} + {host['breaks']:.1f}) | "
            f"{host['eager_total']:.1f}")


def host_header(probe):
    """The time model table's host column: compiled per block where the probe measured it, else eager."""
    designs = (probe.get("host") or {}).get("designs", {})
    compiled = bool(designs) and all("compiled_ms" in h for h in designs.values())
    step = "compiled per block" if compiled else "eager"
    return f"host ms ({step} + arguments + breaks) | host ms if eager"


def time_report(shape, probe, eta_gpu, designs=DESIGNS):
    """The time model's table on an H100 SXM: per design its step, ratio to Pre-LN against issue 68's targets,
    device and host ms, and each Triton kernel's ms and the term that binds it."""
    c = {**calibrate("attnres", gpu="H100"), "eta_gpu": eta_gpu}
    rows = {d: time_model(d, shape, c, probe) for d in designs if d == "preln" or any(
        r["design"] == d for r in probe["rows"])}
    base = rows["preln"]["step_ms"]
    print(f"\ntime model, H100 SXM (probe: {len(probe['rows'])} kernels at L{probe['shape']['layers']} "
          f"d{probe['shape']['width']}): per kernel max(bytes / ({eta_gpu:.2f} x {c['hbm'] / 1e12:.2f} TB/s), issue "
          f"floor, FLOPs / peak) + host")
    print(f"| design | step ms | x Pre-LN | target | meets | device ms | {host_header(probe)} | "
          "kernels: ms (binding term) |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|")
    for d, r in rows.items():
        ratio = r["step_ms"] / base
        r["x_preln"], r["meets"] = ratio, ratio <= TIME_TARGETS[d]
        parts = ", ".join(f"{k['kernel']} {1e3 * k['seconds']:.1f} ({k['binds']})"
                          for k in sorted(r["kernels"], key=lambda k: -k["seconds"]))
        print(f"| {d} | {r['step_ms']:.1f} | {ratio:.2f} | {TIME_TARGETS[d]:.2f} | {'yes' if r['meets'] else 'NO'} | "
              f"{r['device_ms']:.1f} | {host_parts(r)} | {parts or '-'} |")
    off = named_off(rows)
    if off:
        print(f"(bytes: each kernel's own traffic rows; its compiled loads and stores name over {NAMED_OFF:.0f}x or "
              f"under 1/{NAMED_OFF:.0f} of them: {off})")
    for d, captured in captured_report(shape, probe, c, list(rows)).items():
        rows[d]["captured"] = captured
    return rows


def captured_report(shape, probe, c, designs, gap_s=GRAPH_GAP_S):
    """The time model with each training step one CUDA graph (compiled.capture_step; the smoke's card_captured
    measures it): no host term for any design (a replay is one launch; scripts/capture_check.py checks on the CPU
    that every design's step can be replayed), and every kernel, Pre-LN's and the Triton ones included (step by step
    their launches are host time), `gap_s` apart instead of tau.
    Pre-LN gets faster too (its step-by-step step idles the GPU 39% of the time on the first H200), so a design's device
    work weighs more against it -> {design: {step_ms, x_preln, meets}}; printed as a table."""
    graph = {**c, "tau": gap_s}
    steps = {}
    for d in designs:                       # time_model's tau is the torch launches' gap; the Triton ones' here too
        triton_launches = sum(r["launches"] for r in probe["rows"] if r["design"] == d)
        steps[d] = time_model(d, shape, graph, {**probe, "host": None})["step_ms"] + 1e3 * triton_launches * gap_s
    base = steps["preln"]
    print(f"\nthe step as one CUDA graph (no host time; {1e6 * gap_s:.1f} us between kernels, an assumption the "
          "first GPU measures):")
    print("| design | step ms | x Pre-LN | target | meets |")
    print("|---|---:|---:|---:|---|")
    out = {}
    for d, ms in steps.items():
        out[d] = {"step_ms": ms, "x_preln": ms / base, "meets": ms / base <= TIME_TARGETS[d]}
        print(f"| {d} | {ms:.1f} | {ms / base:.3f} | {TIME_TARGETS[d]:.2f} | {'yes' if out[d]['meets'] else 'NO'} |")
    return out


def named_off(rows):
    """The kernels whose compiled loads and stores name more than NAMED_OFF times their own traffic rows' bytes, or
    less than 1 / NAMED_OFF of them, as "design kernel: named GB / own GB" joined by commas."""
    off = []
    for d, r in rows.items():
        for k in r["kernels"]:
            x = k.get("named_x")
            if x is not None and not 1 / NAMED_OFF <= x <= NAMED_OFF:
                off.append(f"{d} {k['kernel']} {x * k['own_bytes'] / 1e9:.1f} / {k['own_bytes'] / 1e9:.1f} GB")
    return ", ".join(off)


def main(argv=None):
    p = ArgParser(prog="roofline.py", description=__doc__.split("\n\n")[1])
    for key in ("layers", "width", "seq", "batch", "vocab"):
        p.add_argument(f"--{key}", type=int, default=CARD[key], help=f"default {CARD[key]} (the card's)")
    p.add_argument("--fit-on", default="attnres", choices=[d for d in MEASURED if d != "preln"],
                   help="the row eta (HBM fraction) is fitted on, beside Pre-LN's (default attnres)")
    p.add_argument("--gpu", default="H200", choices=MODEL_GPUS, help="the GPU estimated (default H200, the "
                   "calibration's; H100: an H100 SXM, the same compute with 3.35 TB/s)")
    p.add_argument("--eta-gpu", type=float, default=ETA_GPU, help=f"HBM fraction of the fused GPU path (default "
                   f"{ETA_GPU}: a streaming kernel's; the fitted eta is today's fp32 read-modify-write pattern's)")
    p.add_argument("--loo", action="store_true", help="also fit eta on each measured row in turn, and print the "
                   "error of today's prediction on every other (leave-one-out)")
    p.add_argument("--probe", action="append", help="scripts/kernel_probe.py's JSON (repeatable; default "
                   "docs/kernel_probe*.json): the time model's table, at its shape")
    p.add_argument("--json", help="write the estimates and constants here")
    args = p.parse_args(argv)
    missing = [path for path in args.probe or [] if not Path(path).is_file()]
    if missing:
        p.error(f"--probe {', '.join(missing)}: no such file (scripts/kernel_probe.py --json writes one)")
    if min([args.layers, args.width, args.seq, args.batch, args.vocab]) < 1:
        p.error("--layers, --width, --seq, --batch and --vocab must be >= 1")
    shape = {**CARD, **{k: getattr(args, k) for k in ("layers", "width", "seq", "batch", "vocab")}}
    if not 0 < args.eta_gpu <= 1:
        p.error(f"--eta-gpu {args.eta_gpu}: a fraction in (0, 1]")
    c = {**calibrate(args.fit_on, gpu=args.gpu), "eta_gpu": args.eta_gpu}
    rows = table(shape, c)
    report(rows, c, shape)
    doc = {"shape": shape, "constants": c, "estimates": rows}
    probe = load_probe(args.probe or sorted(DOCS.glob("kernel_probe*.json")))
    if probe and all(probe["shape"][k] == shape[k] for k in probe["shape"] if k in shape):
        try:
            doc["time_model"] = time_report(shape, probe, args.eta_gpu)
        except AccountError as error:             # a kernel's bytes cannot be booked: say which, once
            p.error(str(error))
    elif probe:
        print(f"\ntime model: the probe ran at {probe['shape']}, not this shape (run scripts/kernel_probe.py there)")
    if args.loo:
        doc["leave_one_out"] = leave_one_out()
        for fit_on, errors in doc["leave_one_out"].items():
            print(f"eta fitted on {fit_on:<14}" + "  ".join(f"{d} {100 * e:+.0f}%" for d, e in errors.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
