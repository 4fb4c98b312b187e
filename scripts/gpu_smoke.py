"""The first contact with a GPU machine, as numbers: scripts/gpu_smoke.sh runs this driver.

Each check runs the project's own scripts as subprocesses (kernel_bench.py, profile_gpu.py, cuda_check.py, train.py,
torchrun), most informative first (issue 68 item 5: the kernel level before any model is compiled), each within its
own time budget (STAGE_CAPS) and what is left of the whole one (SMOKE_BUDGET_S, default 480 s). After every check
$OUT/summary.json is rewritten (atomically), so a kill leaves everything measured so far; $OUT/smoke.log holds every
command and its output; $OUT/kernels.json kernel_bench's whole JSON (rewritten after each of its sections);
$OUT/table.md the card's table in docs/speed.md's "GPU runs" format (paste it there). Nothing else is left in $OUT
(the device tool brings back at most 8 files). Scratch run folders live in a temporary folder, removed as each check
ends. summary.json answers, in order, each as a number or as null with a reason:

  kernels          the kernel level (scripts/kernel_bench.py; what each number means: its docstring): HC's, mHC's,
                   Full and Block AttnRes' and MoDA's hot kernels at the card's consumer or sublayer (L70 d640, 4,096
                   tokens, bf16) against ops.py's reference (cosine, max error: races show only on a GPU); each alone
                   with CUDA events beside its counted bytes (GB/s, eta of the HBM peak; registers, spills and issue
                   floor where kernel_bench gets scripts/kernel_probe.py's JSON, --probe); the host's microseconds
                   per mix + push (the Python call's wall time beside its kernels' time) and per bare 19-argument
                   launch; liger-kernel's mHC and Block AttnRes ops beside ours where the wheel is installed
  card             issue 52's table at L70 d640 T2048 (bf16, compiled per block, with the kernel profile): Pre-LN and
                   Full AttnRes at micro-batch 2 first (card_first), then the other designs (card_rest), then the
                   micro-batch the memory plan picks (card_planned; train.py's resolve, depthbench/training/costs.py):
                   step ms, x Pre-LN (at the same micro-batch), tok/s, GPU busy share (torch.profiler: kernel time over
                   the step), GPU kernels per step, peak memory, and scripts/roofline.py's estimate for this GPU
                   beside each (today's path / GPU path); the 15 kernels with the most time in each row's step
                   (top_kernels: name, calls, ms)
  card_captured    card_first's two with each step one CUDA graph, replayed (profile_gpu.py --compile capture): step
                   ms and x Pre-LN without the host's Python per step (issue 68; scripts/capture_check.py's CPU check)
  correctness      every design on CUDA against the CPU reference (scripts/cuda_check.py): fp32, bf16, compiled ==
                   eager, each kernels namespace ("fast", and "triton" where the model accepts it)
  launch_overhead  Pre-LN at the card's shape compiled per block, as the whole model, and under CUDA graphs
                   (profile_gpu.py --compile, each capped at LAUNCH_CAP_S): which is fastest (issue 52 item 2;
                   opt-in until it is measured)
  throughput       Pre-LN 400M L24 bf16 compiled: tokens/s and MFU (the median step after the first two)
  bf16_vs_fp32     the same 20 steps from one checkpoint, resumed in fp32 (CPU) and in bf16 autocast (CUDA)
  ddp_vs_fsdp2     with 2+ GPUs: the same 10 steps under DDP and under FSDP2 (--fsdp)
  memory           planned (train.py's estimate) vs measured peak GB for Pre-LN, mHC and Full AttnRes at L24
  memory_plan      every design's planned (costs.step_peak) vs measured (max_memory_allocated) peak of a compiled
                   training step, L70 d640 and L24 d1024 at micro-batch 8 x 2048
  compile_s        first step minus a steady step, Pre-LN and mHC at L24 and L70
  design_step      every design's compiled training step over Pre-LN's at the 400M shape with the fewest blocks
                   (L16 d1216: the cheapest to compile), with each --kernels value, and which value is faster

--tiny runs the same sequence on CPU at toy shapes (no compile), for the tests and as a rehearsal.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from depthbench.files.common import ArgParser, cannot_write  # noqa: E402  (the repository root, on the path above)
sys.path.insert(0, str(ROOT / "scripts"))
import roofline  # noqa: E402  (scripts/ is not a package; the estimate printed beside each measurement)
from smoke_run import Smoke, check, left, run, save, why  # noqa: E402  (how each check runs; Smoke for the tests)

DESIGNS = ["preln", "sandwich", "lns", "deepnorm", "keel", "hc", "mhc", "attnres", "block_attnres", "moda"]
FIRST_DESIGNS = ["preln", "hc", "mhc", "attnres"]  # measured first (with both kernels) when the budget is short
TINY_DESIGNS = ["preln", "mhc"]  # --tiny: a process per design and kernels value on the CPU; two designs show it
MEMORY_DESIGNS = ["preln", "mhc", "attnres"]
MEMORY_SHAPES = {False: [(70, "70x640"), (24, "24x1024")], True: [(3, "3x64"), (2, "2x64")]}  # by --tiny
CARD_DESIGNS = ["preln", "hc", "mhc", "attnres", "block_attnres", "moda"]  # issue 52's table, Pre-LN its base
TINY_CARD_DESIGNS = ["preln", "hc"]  # --tiny: a process per design on the CPU; HC's plan (4) makes a second table
DEFAULT_BUDGET_S = "480"
# each stage's own time budget in seconds on a GPU (x TINY_CAP_SCALE with --tiny), within the whole budget: a stage
# past it is killed and the next one starts with what is left; none named: the whole budget's rest
STAGE_CAPS = {"kernels": 150, "card_first": 120, "card_captured": 100, "card_rest": 150, "correctness": 90,
              "card_planned": 120}
TINY_CAP_SCALE = 4
FIRST_CARD = ["preln", "attnres"]  # the card's first table rows (Pre-LN the ratio's base); the others come next
CAPTURED_FIELDS = {"step_ms": "fwdbwd_ms", "busy_share": "busy_share", "kernels": "kernels"}  # summary <- profile
LAUNCH_CAP_S = 90  # each whole-model compile of the launch-overhead check: its compile time grows with depth
OLDEST_TORCH = (2, 6)  # the README's supported versions start here
# --tiny's profile_gpu.py runs: the CPU, one thread, every row measured in its one process, as on CUDA (without
# --in-process the CPU starts a process per row, a second torch import each: most of a tiny row's time)
TINY_PROFILE = ["--device", "cpu", "--threads", "1", "--in-process"]
GB = 1e9


# ----------------------------------------------------------------------------- train.py runs and what they tell


def train_args(s, design, layers, steps):
    """train.py flags of one short synthetic run: a 400M row, or --tiny's toy twin (L2 for L24, L3 for L70)."""
    if s.tiny:
        toy, budget = {24: (2, "100k"), 70: (3, "85k")}[layers]  # d64 and d48 (L70's twin: for a run by hand)
        return ["--preset", "cpu", "--layers", str(toy), "--params", budget, "--residual", design, "--device", "cpu",
                "--seq-len", "32", "--global-batch", "8", "--eval-iters", "1", "--log-every", "1",
                "--max-steps", str(min(steps, 5)), "--ckpt-every", "100000"]
    return ["--suite", "400m", "--layers", str(layers), "--residual", design, "--data", "synthetic",
            "--eval-iters", "1", "--log-every", "1", "--global-batch", "16",
            "--max-steps", str(steps), "--ckpt-every", "100000"]


def train(s, args, folder, ranks=1):
    """(Result, run.json or None) of train.py, under torchrun for ranks > 1; the run folder is removed after."""
    out = s.work / folder
    head = [sys.executable, "train.py"]
    if ranks > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train.py"]
    res = run(s, head + args + ["--out", str(out)], env={"OMP_NUM_THREADS": "1"} if s.tiny else None)
    found = sorted(out.glob("*/run.json"))
    doc = json.loads(found[0].read_text()) if found else None
    shutil.rmtree(out, ignore_errors=True)
    return res, doc


def step_seconds(doc):
    """Seconds of each logged step (run.json keeps tokens per step over tokens/s)."""
    tokens = doc["config"]["tokens_per_step"]
    return [tokens / st["tok_per_s"] for st in doc["steps"]]


def compile_seconds(s, doc):
    """The first step's time beyond a steady step's: compiling the training graph (None without compile)."""
    dt = step_seconds(doc)
    if not doc["config"]["compile"] or len(dt) < 3:
        return None
    return round(dt[0] - statistics.median(dt[2:]), 2)


def memory_of(res, doc):
    """train.py's planned GB (its log line) and the measured peak (run.json)."""
    planned = re.search(r"memory\s+planned ([0-9.]+) GB", res.text)
    kind = "cpu peak RSS" if doc["device"] == "cpu" else "cuda max_memory_allocated"
    return {"planned_gb": float(planned[1]) if planned else None, "peak_gb": round(doc["peak_mem_bytes"] / GB, 2),
            "peak_kind": kind}


def throughput(s):
    """Pre-LN 400M L24: tokens/s, MFU, compile seconds and memory from one 20-step run."""
    res, doc = train(s, train_args(s, "preln", 24, 20), "preln-L24")
    if not doc or len(doc["steps"]) < 3:
        s.summary["throughput"] = {"tokens_per_s": None, "mfu": None, "reason": why(res)}
        return why(res)
    steady = step_seconds(doc)[2:]
    mfus = [float(m) / 100 for m in re.findall(r"MFU ([0-9.]+)%", res.text)][2:]
    s.summary["throughput"] = {
        "tokens_per_s": round(doc["config"]["tokens_per_step"] / statistics.median(steady)),
        "mfu": round(statistics.median(mfus), 4) if mfus else None,
        "step_ms": round(1000 * statistics.median(steady), 1), "device": doc["device"],
        "tokens_per_step": doc["config"]["tokens_per_step"], "world_size": doc["config"]["world_size"],
        "compile": doc["config"]["compile"], "dtype": doc["config"]["dtype"]}
    if not mfus:
        s.summary["throughput"]["reason"] = "train.py printed no MFU (a GPU its peak table lacks)"
    s.summary["memory"]["preln"] = memory_of(res, doc)
    s.summary["compile_s"]["preln_L24"] = compile_seconds(s, doc)


def design_run(s, design, layers):
    """A 5-step run: its compile seconds, and at L24 its planned vs measured memory."""
    res, doc = train(s, train_args(s, design, layers, 5), f"{design}-L{layers}")
    if not doc or not doc["steps"]:
        s.summary["compile_s"][f"{design}_L{layers}"] = None
        if layers == 24 and design in MEMORY_DESIGNS:
            s.summary["memory"][design] = {"planned_gb": None, "peak_gb": None, "reason": why(res)}
        return why(res)
    s.summary["compile_s"][f"{design}_L{layers}"] = compile_seconds(s, doc)
    if layers == 24 and design in MEMORY_DESIGNS:
        s.summary["memory"][design] = memory_of(res, doc)


def bf16_vs_fp32(s):
    """One step in fp32 on the CPU makes a checkpoint; it is resumed for 20 steps (--tiny: 5) in fp32 (CPU) and in
    bf16 autocast (CUDA, eager): the same weights, optimizer state and batches, so the losses differ by precision
    alone (and device arithmetic). train.py builds a model with the device's own RNG, hence the shared checkpoint."""
    layers = "2" if s.tiny else "4"
    base = ["--preset", "cpu", "--layers", layers, "--residual", "preln", "--eval-every", "1000", "--log-every", "1",
            "--eval-iters", "1"]
    if s.tiny:
        base += ["--params", "100k", "--seq-len", "32", "--global-batch", "8"]
    seed = s.work / "precision-seed"
    res = run(s, [sys.executable, "train.py", *base, "--device", "cpu", "--max-steps", "1", "--out", str(seed)])
    legs = {"fp32": "cpu", "bf16": "cpu" if s.tiny else "cuda"}
    losses = {}
    for leg, device in legs.items():
        if res.rc != 0:
            break
        folder = s.work / f"precision-{leg}"
        shutil.copytree(seed, folder)
        stop = "6" if s.tiny else "21"
        res = run(s, [sys.executable, "train.py", *base, "--device", device, "--no-compile", "--max-steps", stop,
                      "--resume", "--out", str(folder)])
        if res.rc != 0:
            break
        doc = json.loads(next(folder.glob("*/run.json")).read_text())
        losses[leg] = [st["loss"] for st in doc["steps"][1:]]
    for folder in s.work.glob("precision-*"):
        shutil.rmtree(folder, ignore_errors=True)
    if res.rc != 0 or len(losses) < 2:
        s.summary["bf16_vs_fp32"] = {"max_abs_loss_diff": None, "reason": why(res)}
        return why(res)
    diffs = [abs(a - b) for a, b in zip(losses["fp32"], losses["bf16"])]
    s.summary["bf16_vs_fp32"] = {"max_abs_loss_diff": round(max(diffs), 6), "steps": len(diffs),
                                 "final_loss": {"fp32": losses["fp32"][-1], "bf16": losses["bf16"][-1]}}
    if s.tiny:  # both legs ran fp32 on the CPU: the number is the control (0 if resuming is exact), not bf16's
        s.summary["bf16_vs_fp32"] = {"max_abs_loss_diff": None, "reason": "no CUDA: train.py runs fp32 only on "
                                     "the CPU", "control_fp32_vs_fp32": round(max(diffs), 6)}


def ddp_vs_fsdp2(s):
    """The same steps under DDP and under FSDP2 on every GPU (--tiny: two gloo processes), HC at L24, eager."""
    ranks = 2 if s.tiny else s.ngpu
    if ranks < 2:
        s.summary["ddp_vs_fsdp2"] = {"max_abs_loss_diff": None, "reason": "one GPU: DDP and FSDP2 need 2+ ranks"}
        return "skipped: one GPU"
    args = train_args(s, "hc", 24, 3 if s.tiny else 10) + ["--no-compile"]
    if not s.tiny:
        args += ["--global-batch", str(8 * ranks)]  # the later flag wins: micro-batch 8, the plan's for HC
    losses = {}
    for engine, flag in (("ddp", []), ("fsdp2", ["--fsdp"])):
        res, doc = train(s, args + flag, f"engine-{engine}", ranks=ranks)
        if res.rc != 0 or not doc:
            s.summary["ddp_vs_fsdp2"] = {"max_abs_loss_diff": None, "reason": f"{engine}: {why(res)}"}
            return why(res)
        losses[engine] = [st["loss"] for st in doc["steps"]]
    diffs = [abs(a - b) for a, b in zip(losses["ddp"], losses["fsdp2"])]
    s.summary["ddp_vs_fsdp2"] = {"max_abs_loss_diff": round(max(diffs), 6), "steps": len(diffs), "ranks": ranks,
                                 "final_loss": {k: v[-1] for k, v in losses.items()}}


# ----------------------------------------------------------------------------- profile_gpu.py: the design ratios


def profile_args(s, designs, kernels):
    shape = ["--shapes", "2x64", "--seq", "32", "--batch", "2", "--vocab", "256", *TINY_PROFILE] if s.tiny else [
        "--shapes", "16x1216", "--seq", "2048", "--batch", "4"]
    return [sys.executable, "profile_gpu.py", *shape, "--residual", ",".join(designs), "--repeats", "3",
            "--kernels", kernels, "--out", str(s.work / "profile.json")]


def design_step(s):
    """Every design's training step (forward + backward; compiled on CUDA) over Pre-LN's, with each --kernels
    value: four designs first (both values), then the other six."""
    rest = [d for d in DESIGNS if d not in FIRST_DESIGNS]
    batches = [TINY_DESIGNS] if s.tiny else [FIRST_DESIGNS, ["preln", *rest]]
    ms = {"fast": {}, "reference": {}}
    for designs in batches:
        for kernels in ("fast", "reference"):
            res = run(s, profile_args(s, designs, kernels))
            if res.rc != 0:
                design_summary(s, ms, why(res))
                return why(res)
            rows = json.loads((s.work / "profile.json").read_text())["rows"]
            ms[kernels].update({r["residual"]: r.get("fwdbwd_ms") for r in rows})
            design_summary(s, ms)
            save(s)


def design_summary(s, ms, reason=None):
    """Ratios to Pre-LN per kernels value, fast over reference per design, and the faster value overall."""
    out = {"shape": "L2 d64 T32 B2, CPU eager (tiny)" if s.tiny else "L16 d1216 T2048 B4, bf16, compiled"}
    for kernels, got in ms.items():
        base = got.get("preln")
        out[kernels] = {d: round(v / base, 3) if v and base else None for d, v in got.items()}
    both = [d for d in ms["fast"] if ms["fast"][d] and ms["reference"].get(d)]
    out["fast_over_reference"] = {d: round(ms["fast"][d] / ms["reference"][d], 3) for d in both}
    out["step_ms"] = {k: {d: round(v, 2) if v else None for d, v in got.items()} for k, got in ms.items()}
    total = {k: sum(ms[k][d] for d in both) for k in ms}
    out["use"] = (min(total, key=total.get) if both else None)  # the value whose summed step time is smaller
    if reason or len(both) < len(DESIGNS):
        out["reason"] = reason or ("tiny: two designs" if s.tiny else "budget spent before every design was measured")
    s.summary["design_step"] = out


# ----------------------------------------------------------------------------- the card's table (L70 d640 T2048)

CARD_SHAPE = ["--shapes", "70x640", "--seq", "2048"]
TINY_CARD_SHAPE = ["--shapes", "4x64", "--seq", "32", "--vocab", "256", *TINY_PROFILE]
PLAN_PROBE = """import json, sys, train
args, cuda = train.parse_args(sys.argv[1:])
print(json.dumps({r.residual: r.batch_size for r in train.resolve_grid(args, 1)}))"""


def correctness(s):
    """Every design on CUDA against the CPU reference (scripts/cuda_check.py: fp32, bf16, compiled == eager, each
    kernels namespace, triton included where it is accepted); --tiny: the CPU against itself, the designs with
    Triton bodies (CARD_DESIGNS), their kernels run by Triton's interpreter (TRITON_INTERPRET=1), so the rehearsal
    runs every kernel the device check runs (without it a Triton body hands CPU tensors to the CPU's)."""
    argv = [sys.executable, "scripts/cuda_check.py", "--json", str(s.work / "check.json")]
    if s.tiny:
        argv += ["--device", "cpu", "--tiny", "--designs", ",".join(CARD_DESIGNS)]
    res = run(s, argv, env={"TRITON_INTERPRET": "1"} if s.tiny else None)
    if not (s.work / "check.json").exists():
        s.summary["correctness"] = {"ok": None, "reason": why(res)}
        return why(res)
    doc = json.loads((s.work / "check.json").read_text())
    worst = lambda key, pick: pick((r[key] for r in doc["rows"] if key in r), default=None)  # noqa: E731
    s.summary["correctness"] = {
        "ok": doc["ok"], "device": doc["device"], "namespaces": doc["namespaces"], "skipped": doc["skipped"],
        "designs": len({r["design"] for r in doc["rows"]}), "failed": [f"{r['design']}/{r['kernels']}" for r in
                                                                       doc["rows"] if not r["ok"]],
        "worst": {k: worst(k, min if k.endswith("cos") else max) for k in doc["bounds"]}, "bounds": doc["bounds"]}
    return None if doc["ok"] else f"{len(s.summary['correctness']['failed'])} design/kernels rows out of bounds"


def card_designs(s):
    return TINY_CARD_DESIGNS if s.tiny else CARD_DESIGNS


def card_first(s):
    """The card's first rows at micro-batch 2: Pre-LN and Full AttnRes (--tiny: Pre-LN), with the kernel profile."""
    return card_table(s, planned=False, designs=[d for d in card_designs(s) if d in FIRST_CARD])


def card_captured(s):
    """card_first's designs, each step one CUDA graph (profile_gpu.py --compile capture; a process each, Pre-LN, the
    ratio's base, first), beside their step-by-step rows (--tiny: Pre-LN and HC in one process, the CPU running
    each step itself: a rehearsal; HC's step-by-step row comes later)."""
    rows, failed = {}, []
    for group in [TINY_CARD_DESIGNS] if s.tiny else [[design] for design in FIRST_CARD]:
        res, measured = card_run(s, group, 2, ["--compile", "capture"])
        rows.update({d: {key: r.get(source) for key, source in CAPTURED_FIELDS.items()} for d, r in measured.items()})
        failed += [why(res)] if res.rc != 0 else []       # None: killed at its cap or the budget
    stepwise = {r["design"]: r["step_ms"] for r in s.summary["card"]["rows"] if r["batch"] == 2}
    base = rows.get("preln", {}).get("step_ms")
    for design, row in rows.items():
        row.update(x_preln=round(row["step_ms"] / base, 3) if row["step_ms"] and base else None,
                   stepwise_step_ms=stepwise.get(design))
    s.summary["captured"] = {"rows": rows, "reason": "; ".join(failed) or None}
    save(s)
    return s.summary["captured"]["reason"]


def card_rest(s):
    """The other designs of the card's table at micro-batch 2, over the Pre-LN row card_first measured."""
    return card_table(s, planned=False, designs=[d for d in card_designs(s) if d not in FIRST_CARD])


def planned_batches(s):
    """{design: micro-batch} the memory plan picks for the card's command (train.py's resolve, costs' plan)."""
    argv = ["--suite", "400m", "--ar", "9.1", "--residual", ",".join(card_designs(s)), "--data", "synthetic",
            "--dry-run"] + (["--gpu-mem", "80"] if s.tiny else [])
    res = run(s, [sys.executable, "-c", PLAN_PROBE, *argv])
    if res.rc != 0:
        raise RuntimeError(f"the memory plan: {why(res)}")
    return json.loads(res.text.strip().splitlines()[-1])


def card_run(s, designs, batch, extra=(), cap=None):
    """profile_gpu.py at the card's shape (--tiny: L4 d64 T32 on the CPU) -> (Result, {design: row})."""
    out = s.work / "card.json"
    out.unlink(missing_ok=True)
    shape = TINY_CARD_SHAPE if s.tiny else CARD_SHAPE
    res = run(s, [sys.executable, "profile_gpu.py", *shape, "--batch", str(batch), "--residual", ",".join(designs),
                  "--repeats", "3", "--kernel-profile", *extra, "--out", str(out)], cap=cap)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    return res, {r["residual"]: r for r in rows}


def roofline_gpu(s):
    """The GPU the roofline estimates beside the measurements: this machine's first where the model has it
    (roofline.model_gpu: an H200 or an H100 SXM), else the H200 it was calibrated on (and the CPU of --tiny)."""
    gpus = s.summary["environment"].get("gpus") or ["none"]
    return roofline.model_gpu(gpus[0]) or "H200"


def card_rows(s, measured, batch):
    """The table's rows of one micro-batch: each design against Pre-LN's at the same micro-batch, and the roofline's
    estimate for this GPU beside it (roofline_gpu; today's path and the fused GPU path; an estimate at the card's
    shape, also in --tiny)."""
    c = roofline.calibrate(gpu=roofline_gpu(s))
    s.summary["card"]["roofline_gpu"] = c["gpu"]
    shape = {**roofline.CARD, "batch": batch}
    if "preln" in measured:
        s.bases[batch] = measured["preln"]
    base = s.bases.get(batch, {})
    rows = []
    for design, r in measured.items():
        est = roofline.estimate(design, shape, c)
        ratio = lambda key: round(r[key] / base[key], 3) if r.get(key) and base.get(key) else None  # noqa: E731
        rows.append({"design": design, "batch": batch, "step_ms": r.get("fwdbwd_ms"), "x_preln": ratio("fwdbwd_ms"),
                     "roofline_today_ms": round(est["today_ms"], 1), "roofline_gpu_ms": round(est["gpu_ms"], 1),
                     "tok_per_s": r.get("tok_per_s"), "busy_share": r.get("busy_share"), "kernels": r.get("kernels"),
                     "kernels_x_preln": ratio("kernels"), "peak_train_gb": gb(r.get("peak_mem_train_bytes")),
                     "roofline_peak_gb": None if est["gpu_peak_gb"] is None else round(est["gpu_peak_gb"], 1),
                     "fwd_ms": r.get("fwd_ms"), "top_kernels": r.get("top_kernels"), "error": r.get("error")})
    return rows


def gb(value):
    return None if value is None else round(value / GB, 2)


def card_table(s, planned, designs=None):
    """The card's table: `designs` at micro-batch 2 (planned=False: a process per design, so that a stage killed at
    its budget keeps the rows before; Pre-LN's row, measured first, is the ratio's base of every later one), or
    every design at the micro-batch the memory plan picks (planned=True: one run per distinct micro-batch other than
    2, Pre-LN in each as the ratio's base)."""
    card = s.summary["card"]
    runs = [(2, [design]) for design in designs or []]
    if planned:
        card["planned_batch"] = planned_batches(s)
        groups = {}
        for design, batch in card["planned_batch"].items():
            if batch != 2:  # micro-batch 2 is the first table's row
                groups.setdefault(batch, ["preln"]).extend([design] * (design != "preln"))
        runs = sorted(groups.items())
    failed = []
    for batch, group in runs:
        res, measured = card_run(s, group, batch)
        card["rows"] += card_rows(s, measured, batch)
        write_table(s)
        save(s)
        if res.rc != 0:
            failed.append(why(res))
    return "; ".join(failed) or None


def kernels(s):
    """The kernel level, first (scripts/kernel_bench.py at the card's consumer or sublayer; --tiny: the interpreter
    at its toy shapes): every family's hot kernels against ops.py (a race shows here), each alone with CUDA events
    beside its counted bytes (GB/s, eta), the host's microseconds per mix + push and per bare launch, and
    liger-kernel's ops beside ours where it imports. Its JSON is $OUT/kernels.json, rewritten after each of its
    sections (a stage killed at its budget leaves what it measured); summary.json gets the digest (`kernel_digest`)."""
    out = s.out / "kernels.json"
    argv = [sys.executable, "scripts/kernel_bench.py", "--json", str(out)] + (["--tiny"] if s.tiny else [])
    res = run(s, argv, env={"TRITON_INTERPRET": "1"} if s.tiny else None)
    if not out.exists():
        s.summary["kernels"] = {"reason": why(res)}
        return why(res)
    doc = json.loads(out.read_text())
    s.summary["kernels"] = {**kernel_digest(doc), "file": "kernels.json"}
    return None if res.rc == 0 else why(res)


def kernel_digest(doc):
    """summary.json's part of kernel_bench's JSON: the device, HC's and mHC's passes as they were (`designs`), and
    per AttnRes / MoDA section its checks against the reference, ms, host ms and GB/s each way; the bare launch;
    liger's ratios."""
    digest = {k: doc.get(k) for k in ("device_name", "triton", "tokens", "d_model", "streams", "designs", "host")}
    digest["depth"] = {}
    for design, r in doc.get("depth", {}).items():
        keep = {k: r[k] for k in ("forward_vs_reference", "gradients_vs_reference", "push_host_us",
                                  "host_over_kernels", "reason") if k in r}
        for name in ("forward", "backward"):
            if name in r:
                keep[name] = {k: r[name].get(k) for k in ("ms", "host_ms", "gb_per_s", "eta")}
        digest["depth"][design] = keep
    liger = doc.get("liger") or {}
    digest["liger"] = {k: ({key: v[key] for key in v if key.startswith("theirs_over_ours") or key.endswith(
        ("_agree", "_vs_reference"))} if isinstance(v, dict) and "reason" not in v else v) for k, v in liger.items()}
    return digest


def launch_overhead(s):
    """Issue 52 item 2: Pre-LN at the card's shape, micro-batch 2, compiled as the whole model and under CUDA graphs,
    against per-block compile (the first table's row): step ms and busy share of each (--tiny: every scope runs eager
    on the CPU; the numbers only rehearse the path)."""
    out = {}
    for scope in ("model", "graphs"):
        res, measured = card_run(s, ["preln"], 2, ["--compile", scope], cap=LAUNCH_CAP_S)
        row = measured.get("preln", {})
        out[scope] = {"step_ms": row.get("fwdbwd_ms"), "busy_share": row.get("busy_share"),
                      "kernels": row.get("kernels"), "reason": None if res.rc == 0 else why(res)}
    blocks = next((r for r in s.summary["card"]["rows"] if r["design"] == "preln" and r["batch"] == 2), {})
    out["blocks"] = {"step_ms": blocks.get("step_ms"), "busy_share": blocks.get("busy_share"),
                     "kernels": blocks.get("kernels")}
    timed_scopes = {k: v["step_ms"] for k, v in out.items() if v["step_ms"]}
    out["fastest"] = min(timed_scopes, key=timed_scopes.get) if timed_scopes else None
    s.summary["launch_overhead"] = out
    if any(v.get("reason") for v in out.values() if isinstance(v, dict)):
        return "; ".join(f"{k}: {v['reason']}" for k, v in out.items() if isinstance(v, dict) and v.get("reason"))


def fmt(value, spec, scale=1):
    return "" if value is None else format(value * scale, spec)


def predicted(gb_value):
    """' (x.x)': the roofline's peak beside a measured one, where it has one (the card's micro-batch)."""
    return "" if gb_value is None else f" ({gb_value:.1f})"


def write_table(s):
    """$OUT/table.md: the card's rows in docs/speed.md's "GPU runs" format, to paste there under its heading."""
    env = s.summary["environment"]
    where = s.summary["card"]["shape"]
    lines = [f"### {s.summary['started'][:10]}, {', '.join(env.get('gpus') or ['no GPU'])}, PyTorch {env.get('torch')},"
             f" Triton {env.get('triton') or 'none'}", "",
             f"{where}; `bash scripts/gpu_smoke.sh` at {env.get('commit') or 'an unknown commit'}. Roofline: "
             f"scripts/roofline.py's {roofline_gpu(s)} estimate at L70 d640 T2048 (today's path / the fused GPU "
             "path).", "",
             "| design | micro-batch | step ms | x Pre-LN | roofline ms | tok/s | GPU busy | kernels / step "
             "| x Pre-LN | peak train GB (roofline) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in s.summary["card"]["rows"]:
        lines.append(f"| {r['design']} | {r['batch']} | {fmt(r['step_ms'], '.1f')} | {fmt(r['x_preln'], '.2f')} | "
                     f"{r['roofline_today_ms']:.0f} / {r['roofline_gpu_ms']:.0f} | {fmt(r['tok_per_s'], ',.0f')} | "
                     f"{fmt(r['busy_share'], '.0f', 100)}{'%' * (r['busy_share'] is not None)} | "
                     f"{fmt(r['kernels'], ',')} | {fmt(r['kernels_x_preln'], '.2f')} | "
                     f"{fmt(r['peak_train_gb'], '.1f')}{predicted(r['roofline_peak_gb'])} |")
    text = "\n".join(lines) + "\n"
    tmp = s.out / "table.md.tmp"
    tmp.write_text(text)
    tmp.replace(s.out / "table.md")


def memory_plan(s):
    """The memory plan against the GPU, every design: costs.step_peak (fp32 weights, the activations the plan
    counts, a chunk of the loss's logits) against max_memory_allocated of profile_gpu.py's compiled bf16 training
    step, at the 400m rows L70 d640 and L24 d1024, micro-batch 8 x 2048 (--tiny: Pre-LN and mHC at L3 and L2,
    d64, fp32 on the CPU, where the peak is the model plus TensorBytes' peak)."""
    out = s.summary["memory_plan"]
    for L, shape in MEMORY_SHAPES[s.tiny]:
        if s.tiny:
            argv = ["--shapes", shape, "--seq", "32", "--batch", "2", "--vocab", "256", *TINY_PROFILE]
        else:
            argv = ["--shapes", shape, "--seq", "2048", "--batch", "8"]
        designs = TINY_DESIGNS if s.tiny else DESIGNS
        res = run(s, [sys.executable, "profile_gpu.py", *argv, "--residual", ",".join(designs), "--repeats", "1",
                      "--out", str(s.work / "memory.json")])
        if res.rc not in (0, 1):  # 1: every row failed, each with its reason
            out[f"L{L}"] = {"reason": why(res)}
            return why(res)
        rows = json.loads((s.work / "memory.json").read_text())["rows"]
        out[f"L{L}"] = {r["residual"]: planned_vs_measured(r) for r in rows}
        save(s)


def planned_vs_measured(row):
    planned, peak = row["planned_train_bytes"], row.get("peak_mem_train_bytes")
    got = {"planned_gb": round(planned / GB, 2), "peak_gb": peak and round(peak / GB, 2),
           "planned_over_peak": peak and round(planned / peak, 3), "batch": row["batch"]}
    if row.get("error"):
        got["reason"] = row["error"]
    return got


# ----------------------------------------------------------------------------- the sequence


ENV_PROBE = """import json, platform, torch
try:
    import triton
    triton = triton.__version__
except ImportError:
    triton = None
n = torch.cuda.device_count()
print(json.dumps({"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda,
                  "triton": triton, "gpus": [torch.cuda.get_device_name(i) for i in range(n)]}))"""


def commit():
    """The repository's commit (with "+changes" when the tree differs from it), or None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + "+changes" * bool(dirty.stdout.strip())


def environment(s):
    """torch, CUDA and the GPUs, from a child process (this one never holds a CUDA context)."""
    res = run(s, [sys.executable, "-c", ENV_PROBE])
    if res.rc != 0:
        s.summary["environment"] = {"reason": why(res)}
        return why(res)
    env = json.loads(res.text.strip().splitlines()[-1])
    s.ngpu = 0 if s.tiny else min(len(env["gpus"]), 8)
    version = tuple(int(x) for x in re.findall(r"\d+", env["torch"])[:2])
    s.summary["environment"] = {**env, "gpus_used": s.ngpu, "torch_supported": version >= OLDEST_TORCH,
                                "commit": commit()}
    if not s.tiny and not s.ngpu:
        return "no GPU: run with --tiny for the CPU rehearsal"
    if version < OLDEST_TORCH:
        return f"torch {env['torch']} is older than the oldest supported, {'.'.join(map(str, OLDEST_TORCH))}"
    s.summary["environment"]["liger_kernel"] = liger_wheel(s)


LIGER_IMPORT = "import importlib.metadata as m, liger_kernel; print(m.version('liger-kernel'))"


def liger_wheel(s):
    """liger-kernel for kernel_bench's optional section (issue 68 item 7): its version where it imports; else the
    wheel carried in .whl/ (git ignores the folder; the device tool's carry brings it) installed without its
    dependencies (the GPU image's torch and triton stay as they are); else None with the reason. --tiny installs
    nothing (a shared environment stays as it is)."""
    if s.tiny:
        return {"version": None, "reason": "tiny: nothing is installed"}
    probe = run(s, [sys.executable, "-c", LIGER_IMPORT])
    wheels = sorted((ROOT / ".whl").glob("liger_kernel-*.whl"))
    if probe.rc != 0 and wheels:
        run(s, [sys.executable, "-m", "pip", "install", "-q", "--no-deps", str(wheels[-1])])
        probe = run(s, [sys.executable, "-c", LIGER_IMPORT])
    if probe.rc != 0:
        return {"version": None, "reason": why(probe) if wheels else "not installed, and no .whl/liger_kernel-*.whl"}
    return {"version": probe.text.strip().splitlines()[-1]}


def sequence(tiny):
    """(name, fn) in the order they run, the most informative first (issue 68 item 5): the kernel level (every hot
    kernel against the reference at the card's shape, each alone, the host's costs: scripts/kernel_bench.py), then
    Pre-LN and Full AttnRes at micro-batch 2 with the kernel profile, the same two with each step one CUDA graph
    (the host's share of their steps), then the card's other designs, whole-model
    correctness on the device, the plan's micro-batch, the launch-overhead experiment, then the 400M checks. --tiny
    leaves out the L70 train.py runs, which on the CPU (no compile) would answer nothing."""
    checks = [("environment", environment), ("kernels", kernels), ("card_first", card_first),
              ("card_captured", card_captured), ("card_rest", card_rest), ("correctness", correctness),
              ("card_planned", lambda s: card_table(s, planned=True)),
              ("launch_overhead", launch_overhead), ("throughput", throughput), ("bf16_vs_fp32", bf16_vs_fp32),
              ("ddp_vs_fsdp2", ddp_vs_fsdp2)]
    for design in MEMORY_DESIGNS[1:]:
        checks.append((f"{design}_L24", lambda s, d=design: design_run(s, d, 24)))
    for design in [] if tiny else ["preln", "mhc"]:
        checks.append((f"{design}_L70", lambda s, d=design: design_run(s, d, 70)))
    checks.append(("memory_plan", memory_plan))
    checks.append(("design_step", design_step))
    return checks


def empty_summary(s, budget):
    """Every question's key, null until its check answers (a killed smoke leaves the reason)."""
    pending = "not run yet (budget spent or smoke stopped)"
    compiled = {"reason": "tiny: nothing is compiled on the CPU"} if s.tiny else {}
    card = "L4 d64 T32, CPU eager (tiny)" if s.tiny else "L70 d640 T2048, bf16, compiled per block"
    return {"schema": "depthbench.smoke/1", "mode": "tiny" if s.tiny else "gpu", "budget_s": budget,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": {},
            "throughput": {"tokens_per_s": None, "mfu": None, "reason": pending},
            "bf16_vs_fp32": {"max_abs_loss_diff": None, "reason": pending},
            "ddp_vs_fsdp2": {"max_abs_loss_diff": None, "reason": pending},
            "memory": {d: {"planned_gb": None, "peak_gb": None, "reason": pending} for d in MEMORY_DESIGNS},
            "memory_plan": {f"L{L}": {"reason": pending} for L, _ in MEMORY_SHAPES[s.tiny]},
            "correctness": {"ok": None, "reason": pending},
            "card": {"shape": card, "rows": [], "planned_batch": None},
            "kernels": {"reason": pending}, "launch_overhead": {"fastest": None, "reason": pending},
            "captured": {"rows": {}, "reason": pending},
            "compile_s": {**dict.fromkeys(["preln_L24", "mhc_L24", "preln_L70", "mhc_L70"]), **compiled},
            "design_step": {"fast": {}, "reference": {}, "use": None, "reason": pending}, "checks": []}


def budget_seconds(text):
    """argparse type of --budget (and $SMOKE_BUDGET_S): a finite number of seconds > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise ValueError(text)
    return value


budget_seconds.__name__ = "number of seconds > 0"  # argparse names the type in its one-line error


def main(argv=None):
    p = ArgParser(prog="gpu_smoke.py", description="The first contact with a GPU machine: summary.json and smoke.log "
                  "under $OUT (see the module docstring).")
    p.add_argument("--tiny", action="store_true", help="CPU, toy shapes, no compile: the same sequence in minutes")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/depthbench-smoke"),
                   help="folder of summary.json and smoke.log (default $OUT, else /tmp/depthbench-smoke)")
    p.add_argument("--budget", type=budget_seconds, help="seconds for everything (default $SMOKE_BUDGET_S, else "
                   f"{DEFAULT_BUDGET_S}); checks past it are skipped")
    args = p.parse_args(argv)
    if args.budget is None:  # the environment's, checked as the flag is: one line and exit 2, not a traceback
        env = os.environ.get("SMOKE_BUDGET_S", DEFAULT_BUDGET_S)
        try:
            args.budget = budget_seconds(env)
        except ValueError:
            p.error(f"SMOKE_BUDGET_S={env!r} is not a number of seconds > 0")
    out = Path(args.out)
    why = cannot_write(out / "summary.json")
    if why:
        p.error(f"--out {out}: {why}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "smoke.log").write_text(f"gpu_smoke.py: budget {args.budget:g} s, {'tiny' if args.tiny else 'gpu'}\n")
    with tempfile.TemporaryDirectory(prefix="depthbench-smoke-") as work:
        s = Smoke(out=out, work=Path(work), tiny=args.tiny, ngpu=0, deadline=time.monotonic() + args.budget)
        s.summary = empty_summary(s, args.budget)
        save(s)
        for name, fn in sequence(s.tiny):
            if left(s) < 5:
                s.summary["checks"].append({"check": name, "status": "skipped: budget spent", "seconds": 0})
                print(f"skip  {name:<14} budget spent", flush=True)
                continue
            check(s, name, fn, cap=STAGE_CAPS.get(name, float("inf")) * (TINY_CAP_SCALE if s.tiny else 1))
            if name == "environment" and not s.tiny and not s.ngpu:
                break
        save(s)
    written = [str(out / "summary.json"), str(out / "smoke.log")] + [str(out / "kernels.json")] * (
        out / "kernels.json").exists()
    if (out / "table.md").exists():  # the card's table, on stdout too (to paste into docs/speed.md)
        print((out / "table.md").read_text(), end="")
        written.append(str(out / "table.md"))
    print(f"wrote {', '.join(written[:-1])} and {written[-1]} in {s.summary['elapsed_s']:.0f} s")
    failed = [c for c in s.summary["checks"] if c["status"] not in ("ok", "skipped: one GPU")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
