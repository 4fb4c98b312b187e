"""
What each residual design costs at a shape: analytic FLOPs and bytes, measured time and memory (Fig. 11).
The fields and formulas: docs/diagnostics.md#cost; measured results and the --bench benchmark: docs/speed.md.

    # the paper's sweep on one GPU (400M family, AR 76 -> 9.1, T = 4096, batch 8, bf16 autocast):
    python profile_gpu.py --residual all --params 405M --ar 76,42.67,28,9.1 --seq 4096 --batch 8 --out gpu.json
    # formulas only, any machine, instant: 2.98e12 / 4.33e12 FLOPs and 318.8 / 734.0 MB of KV cache per sequence
    python profile_gpu.py --analytic-only --shapes 16x1216,70x640 --seq 4096 --json
    # a CPU table (one thread: spinning threads stall when cores are shared)
    python profile_gpu.py --shapes 11x320,45x192 --vocab 8192 --seq 256 --batch 4 --repeats 3 --threads 1
    # the speed benchmark (CPU, one thread; ~30-60 minutes on 2 shared cores, --quick: the step ratios and HF only)
    python profile_gpu.py --bench
"""
import concurrent.futures
import json
import math
import multiprocessing
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext

from depthbench.files import common  # first, before torch: its sys.excepthook makes a Ctrl-C during the imports one line
import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import shapes
from depthbench.training.costs import analytic, gpu_peak, step_peak
from depthbench.training.compiled import capture_step, compile_model, eager
from depthbench.training.recipe import RunConfig
from model import GPT, GPTConfig
from depthbench.files.common import (ArgParser, check_options, comma_list, design_options, first_line, json_object, pick_device,
                    positive, write_json)
from residuals import RESIDUALS

MAX_SEQ, MAX_BATCH = 2**20, 2**16  # --seq and --batch: a million tokens (256 x Fig. 11's 4,096), 65,536 sequences
PAPER_AR = "76,42.67,28,9.1"  # the 400M points of Fig. 11: L16, L24, L32, L70
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MEASURED = ["fwd_ms", "fwdbwd_ms", "tok_per_s", "peak_mem_bytes", "peak_mem_kind", "utilization", "kernels",
            "kernel_ms", "busy_share", "top_kernels"]
CPU = torch.device("cpu")
TOP_KERNELS = 15  # --kernel-profile's top_kernels: the names with the most time in the step


# ----------------------------------------------------------------------------- measuring

def timed(fn, repeats, dev, warmup=1):
    """Milliseconds of each of `repeats` calls of fn, after `warmup` untimed ones (allocator, kernel choice)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":  # events time the GPU's work, not the host's kernel launches
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def in_fresh_process(fn, job):
    """fn(job) in a new spawned process: a clean allocator, thread setting and inductor cache for each run. The
    child is started ignoring Ctrl-C (inherited through exec, so from its first import on: no traceback of its
    own); on Ctrl-C or SIGTERM here it is stopped at once."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        future = pool.submit(fn, job)  # starts the child
    finally:
        signal.signal(signal.SIGINT, old)
    try:
        return future.result()
    except KeyboardInterrupt:  # common.Interrupted (SIGTERM) too
        for process in list(pool._processes.values()):  # Python 3.14 has pool.terminate_workers()
            process.terminate()
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def peak_flops(dev, dtype):
    """The device's matmul peak in FLOP/s, measured: the best of a few n x n matmuls in the run's dtype."""
    n = 8192 if dev.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n ** 3 / (min(timed(lambda: a @ b, 5, dev, warmup=2)) / 1e3)


def reset_peak(dev):
    """Start a peak-memory window: CUDA's allocator statistics, or (Linux) the kernel's peak-RSS mark."""
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    elif os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: VmHWM := VmRSS


def memory(dev, field="VmHWM"):
    """Bytes: CUDA max_memory_allocated, or this process's VmHWM (peak) / VmRSS (now) on Linux, else None."""
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


class TensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage allocated while it is active, on any device: the counterpart of CUDA's
    max_memory_allocated, for the CPU, where peak RSS also counts the C allocator's kept pages and is noisy.
    After `with TensorBytes() as tb: step()`, tb.peak is the most bytes alive at once, of storages the step
    created (parameters and inputs excluded).

    Every op's outputs are recorded by storage (views and in-place results add nothing); storages that died
    are swept before each op, so the peak is exact at op granularity. Not counted: scratch memory inside one
    kernel and allocations made outside the dispatcher. Autograd's backward ops run under it too."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0   # storage pointer -> (weak reference, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for ptr in [p for p, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(ptr)[1]
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                s = t.untyped_storage()
                self.live[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
                self.now += s.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def measure(job):
    """Build one model on the device, time a prefill and a training step, and read their memory peaks."""
    dev, B, T = torch.device(job["device"]), job["batch"], job["seq"]
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=job["vocab"], n_layer=job["n_layer"], d_model=job["d_model"], n_head=job["heads"],
                    n_kv_head=job["kv_heads"], d_ff=job["d_ff"], residual=job["residual"],
                    residual_args=job["residual_args"], kernels=job["kernels"])
    with dev:  # parameters are created and initialised on the device itself: no slow CPU init and copy
        model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if job["dtype"] == "bf16" else nullcontext()
    warmup = 2 if dev.type == "cuda" else 1

    def prefill():  # eager, also where the blocks are compiled below
        with torch.inference_mode(), amp, eager():
            model(idx)

    train_step = training_step(model, idx, amp, job.get("compile", "blocks"))
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers(), idx])

    def window(fn):
        """(median ms, peak bytes) of fn's timed runs (CUDA) or of one more run under TensorBytes (CPU)."""
        reset_peak(dev)
        ms = statistics.median(timed(fn, job["repeats"], dev, warmup))
        if dev.type == "cuda":
            return ms, memory(dev)
        with TensorBytes() as tb:  # counted apart from the timed runs: its per-op bookkeeping costs time
            fn()
        return ms, resident + tb.peak

    out, errors = {}, []
    for name, fields, fn in (("prefill", ("fwd_ms", "peak_mem_bytes"), prefill),
                             ("train", ("fwdbwd_ms", "peak_mem_train_bytes"), train_step)):
        # the head sees only the last position in the prefill (a hook, so that model.py stays as it is)
        hook = model.lm_head.register_forward_pre_hook(lambda m, a: (a[0][:, -1:],)) if fn is prefill else None
        try:
            out.update(zip(fields, window(fn)))
        except Exception as e:  # out of memory in one window keeps the other's numbers
            errors.append(f"{name}: {type(e).__name__}: {first_line(e, None)}"[:200])
        finally:
            if hook:
                hook.remove()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if job.get("kernel_profile") and "fwdbwd_ms" in out:
        out.update(kernel_profile(train_step, dev))
    return {**out, "error": "; ".join(errors)} if errors else out


def training_step(model, idx, amp, scope):
    """The timed training step (a function of no arguments): forward with train.py's loss and backward under `amp`,
    compiled by `scope` on CUDA as train.py compiles (the CPU runs eager), then the gradients dropped; "capture"
    compiles the blocks and replays the step as one CUDA graph (`captured`)."""
    cuda = idx.device.type == "cuda"
    trained = model
    if cuda:  # as train.py: compiled on CUDA only; the jobs share this process, and without a reset
        torch._dynamo.reset()  # each design and shape would count against dynamo's recompile limit, then run eager
        trained = compile_model(model, "blocks" if scope == "capture" else scope)

    def forward_backward():
        if cuda and scope == "graphs":                     # a new step for cudagraph trees (the last
            torch.compiler.cudagraph_mark_step_begin()     # step's outputs may be overwritten)
        with amp:
            _, loss = trained(idx, idx, logits=False)  # train.py's loss (any targets do for timing)
        loss.backward()

    def train_step():
        forward_backward()
        model.zero_grad(set_to_none=True)
    return captured(forward_backward) if cuda and scope == "capture" else train_step


def captured(forward_backward):
    """--compile capture: the blocks compiled as "blocks" and forward_backward recorded as one CUDA graph
    (compiled.capture_step) at its first call, inside the first timed window (so that window's memory peak holds
    the graph's pool), then replayed: one launch a step. The gradients add up from replay to replay (no zeroing
    between, which would be ~10 launches a block outside the graph; their values do not matter for timing)."""
    replay = []

    def step():
        if not replay:
            replay.append(capture_step(forward_backward))
        replay[0]()
    return step


# aten ops that only make a new view of a tensor or read its metadata: no kernel on a GPU
NO_KERNEL = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::t", "aten::transpose",
             "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::permute",
             "aten::detach", "aten::alias", "aten::empty", "aten::empty_strided", "aten::empty_like",
             "aten::lift_fresh", "aten::unflatten", "aten::flatten", "aten::split", "aten::chunk", "aten::unbind",
             "aten::narrow", "aten::movedim", "aten::result_type", "aten::is_nonzero", "aten::_unsafe_view",
             "aten::resolve_conj", "aten::resolve_neg", "aten::set_", "aten::resize_", "aten::split_with_sizes",
             "aten::expand_as", "aten::view_as", "aten::numpy_T", "aten::swapaxes", "aten::contiguous"}


def kernels_of(prof, cuda, views=False):
    """(kernels, kernel ms) of a torch.profiler run: on CUDA the kernels the GPU ran and the sum of their times;
    on the CPU the leaf aten ops (those that call no other aten op), views and metadata aside unless views=True
    (they launch nothing on a GPU), and None: the CPU proxy of a GPU's launches (docs/speed.md#kernels)."""
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(kernels), sum(e.device_time for e in kernels) / 1e3  # device_time: microseconds
    leaves = [e for e in prof.events() if e.name.startswith("aten::") and not any(
        c.name.startswith("aten::") for c in e.cpu_children)]
    return sum(views or e.name not in NO_KERNEL for e in leaves), None


def kernel_profile(step, dev):
    """One more training step under torch.profiler -> {kernels, kernel_ms}: the GPU's kernels and their summed time
    (the busy share is kernel_ms over the timed step), or on the CPU the leaf aten ops and None."""
    from torch.profiler import ProfilerActivity, profile
    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    kernels, ms = kernels_of(prof, cuda)
    return {"kernels": kernels, "kernel_ms": ms, "top_kernels": top_kernels(prof, cuda)}


def top_kernels(prof, cuda, k=TOP_KERNELS):
    """Where the step's time goes, by name: the k names with the most time, each {name, calls, ms}: on CUDA the
    GPU's kernels and their device time, on the CPU the aten ops (views aside) and their own (self) CPU time."""
    by_name = {}
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time
        elif not cuda and e.name.startswith("aten::") and e.name not in NO_KERNEL:
            us = e.self_cpu_time_total                 # its own time: a matmul's, not the leaf ops' it calls
        else:
            continue
        calls, total = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (calls + 1, total + us)
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:k]
    return [{"name": name[:160], "calls": calls, "ms": round(us / 1e3, 3)} for name, (calls, us) in ranked]


def run_measured(jobs, dev, in_process=False):
    """measure() every job: in this process on CUDA (and on CPU with in_process: --in-process), else in a fresh
    process per job on CPU."""
    results = []
    for job in jobs:
        print(f"measuring {job['residual']} L{job['n_layer']} d{job['d_model']} ...", file=sys.stderr, flush=True)
        try:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                results.append(measure(job))
            elif in_process:
                results.append(measure(job))
            else:
                results.append(in_fresh_process(measure, job))
        except Exception as e:  # one design running out of memory (MoDA's T x T logits at T = 4096) ends only its row
            results.append({"error": f"{type(e).__name__}: {first_line(e, None)}"[:200]})
    return results


# ----------------------------------------------------------------------------- the speed benchmark (--bench)

BENCH_DESIGNS = [r for r, cls in RESIDUALS.items() if cls.cost(8, 128, 256)[0]]  # those with extra work
def device_peak(dev):
    """Peak FLOP/s for MFU: the dense bf16 table on CUDA (costs.GPU_BF16_PEAK; None for an unknown GPU), a measured
    fp32 matmul on CPU."""
    if dev.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(dev))
    return peak_flops(dev, torch.float32)


def tiny_gpt(residual, L, d, V=512, kernels="fast"):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, n_layer=L, d_model=d, n_head=shapes.N_HEAD, d_ff=shapes.ffn_dim(d),
                         residual=residual, kernels=kernels))


def step_fn(model, B, T, V, logits=True):
    """A forward + loss + backward of `model` on a fixed random batch."""
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))

    def step():
        model(idx, idx, logits=logits)[1].backward()
        model.zero_grad(set_to_none=True)
    return step


def interleaved(steps, repeats):
    """{name: median ms} of the steps run in turn, one of each per round, in one process (after one warm-up
    each), so that load on shared cores hits them all alike."""
    times = {k: timed(f, 0, CPU, warmup=1) for k, f in steps.items()}
    for _ in range(repeats):
        for k, f in steps.items():
            times[k] += timed(f, 1, CPU, warmup=0)
    return {k: statistics.median(v) for k, v in times.items()}


def compile_cost(job):
    """In a fresh process: (compile s, eager ms, compiled ms) of one design's training step under inductor."""
    torch.set_num_threads(1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = job["cache"]
    model = tiny_gpt(job["residual"], job["L"], job["d"], kernels=job["kernels"])
    eager = statistics.median(timed(step_fn(model, job["B"], job["T"], 512, logits=False), 3, CPU))
    compiled = step_fn(torch.compile(model), job["B"], job["T"], 512, logits=False)
    t0 = time.perf_counter()
    compiled()
    first = time.perf_counter() - t0
    fast = statistics.median(timed(compiled, 3, CPU))
    return first - fast / 1e3, eager, fast


def compile_break_even(designs, L=8, d=128, B=8, T=256, kernels="fast"):
    """{design: {cold_s, warm_s, eager_ms, compiled_ms, break_even_steps}}: cold = an empty inductor cache,
    warm = the same cache again; break-even = cold compile s / s saved per step (None: compile never pays)."""
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for r in designs:
            job = {"residual": r, "L": L, "d": d, "B": B, "T": T, "cache": os.path.join(root, r), "kernels": kernels}
            (cold, eager, fast), (warm, _, _) = [in_fresh_process(compile_cost, job) for _ in ("cold", "warm")]
            saved = (eager - fast) / 1e3
            out[r] = {"cold_s": cold, "warm_s": warm, "eager_ms": eager, "compiled_ms": fast,
                      "break_even_steps": math.ceil(cold / saved) if saved > 0 else None}
            print(f"compile {r}: {out[r]}", file=sys.stderr, flush=True)
    return out


def loss_memory(job):
    """In a fresh process, one training step at the job's shape with the plain or the logits-free loss:
    (peak bytes of the tensors it allocated (TensorBytes; gradients included), its peak RSS above the RSS
    with the model built, the shape)."""
    torch.set_num_threads(1)
    s = shapes.solve(job["params"], layers=job["L"], vocab=50304)  # GPT-2's vocab padded, as train.py does
    cfg = GPTConfig(vocab_size=50304, n_layer=s["n_layer"], d_model=s["d_model"], n_head=s["n_head"],
                    d_ff=s["d_ff"])
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to_empty(device="cpu")  # memory, not values, is measured: skip the slow 400M init
    torch.nn.init.normal_(model.lm_head.weight, std=0.02)
    step = step_fn(model, 1, job["T"], cfg.vocab_size, logits=job["logits"])
    reset_peak(CPU)
    base = memory(CPU, "VmRSS")
    with TensorBytes() as tb:
        step()
    return tb.peak, memory(CPU) - base, f"L{s['n_layer']} d{s['d_model']} V{cfg.vocab_size}"


def hf_llama_ratio(L, d, V, T, B, repeats=5, kernels="fast"):
    """Our Pre-LN's training tokens/s (fwd + bwd + AdamW) over HF LlamaForCausalLM's (sdpa) at the same shape."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=d, intermediate_size=shapes.ffn_dim(d),
                                      num_hidden_layers=L, num_attention_heads=shapes.N_HEAD, rms_norm_eps=1e-6,
                                      max_position_embeddings=T, tie_word_embeddings=False,
                                      attn_implementation="sdpa"))
    ours = tiny_gpt("preln", L, d, V=V, kernels=kernels)
    idx = torch.randint(0, V, (B, T))
    steps = {}
    for name, model, call in [("ours", ours, lambda m: m(idx, idx, logits=False)[1]),
                              ("hf", hf, lambda m: m(input_ids=idx, labels=idx).loss)]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, call=call, opt=opt):
            call(model).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps[name] = step
    ms = interleaved(steps, repeats)
    return ms["hf"] / ms["ours"]


def bench(repeats, quick=False, kernels="fast"):
    """--bench: every speed figure of the project in one run, on CPU, one thread (docs/speed.md)."""
    torch.set_num_threads(1)
    load = lambda: f"   [load {os.getloadavg()[0]:.1f}]"  # noqa: E731
    print(f"bench: cpu, 1 thread, fp32, {kernels} kernels, vocab 512, T 256, batch 8; "
          f"load average {os.getloadavg()[0]:.1f} at start")
    for L, d in [(8, 256), (32, 128)]:
        ms = interleaved({r: step_fn(tiny_gpt(r, L, d, kernels=kernels), 8, 256, 512)
                          for r in ["preln", *BENCH_DESIGNS]}, repeats)
        print(f"step / Pre-LN at L{L} d{d} (Pre-LN {ms['preln']:.0f} ms): "
              + "  ".join(f"{r} {ms[r] / ms['preln']:.2f}x" for r in BENCH_DESIGNS) + load(), flush=True)
    try:
        import transformers  # noqa: F401  (optional: only this comparison needs it)
        for L, d, V, T, B in [(4, 128, 256, 256, 16), (8, 256, 8192, 256, 8), (16, 64, 256, 128, 32)]:
            ratio = hf_llama_ratio(L, d, V, T, B=B, repeats=repeats, kernels=kernels)
            print(f"Pre-LN vs HF Llama at L{L} d{d} V{V} T{T} B{B}: {ratio:.2f}x its tokens/s (fwd+bwd+AdamW)"
                  + load(), flush=True)
    except ImportError:
        print("Pre-LN vs HF Llama: skipped (transformers is not installed)")
    if quick:
        return
    for r, c in compile_break_even(["preln", *BENCH_DESIGNS], kernels=kernels).items():
        be = "never" if c["break_even_steps"] is None else f"{c['break_even_steps']} steps"
        print(f"compile at L8 d128 T256 B8, {r}: cold {c['cold_s']:.0f} s, warm {c['warm_s']:.0f} s, step "
              f"{c['eager_ms']:.0f} -> {c['compiled_ms']:.0f} ms, pays after {be}", flush=True)
    for logits in (True, False):
        peak, rss, shape = in_fresh_process(loss_memory, {"params": 405_000_000, "L": 24, "T": 2048, "logits": logits})
        print(f"loss memory, one 400M step ({shape}, micro-batch 1, T 2048), "
              f"{'full fp32 logits' if logits else 'the logits-free chunked loss'}: peak tensor memory "
              f"{peak / 2 ** 20:,.0f} MiB (peak RSS above the step's start {rss / 2 ** 20:,.0f} MiB)", flush=True)


# ----------------------------------------------------------------------------- output

def summary(doc):
    """One line per row; x = measured ratio to Pre-LN at the same shape, when Pre-LN was measured."""
    rows, measured = doc["rows"], doc["peak_flops"] is not None
    ref = {(r["n_layer"], r["d_model"]): r for r in rows if r["residual"] == "preln" and r.get("fwdbwd_ms")}
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    print(f"{doc['device']}, {doc['dtype']}, T={rows[0]['seq']}, batch {rows[0]['batch']}"
          + (f", matmul peak {doc['peak_flops'] / 1e12:.3f} TFLOP/s" if measured else ""))
    print(f"{'design':<14}{'L':>4}{'d':>6}{'AR':>6}{'params':>9}{'prefill':>10}{'+design':>8}{'KV MB':>8}"
          f"{'state MB':>9}" + (f"{'fwd ms':>9}{'step ms':>9}{'x':>6}{'tok/s':>8}{'peak MB':>9}{'x':>6}"
                                f"{'train MB':>9}{'x':>6}{'util':>6}" if measured else ""))
    for r in rows:
        p = ref.get((r["n_layer"], r["d_model"]), {})
        ratio = lambda k: fmt(r.get(k) / p[k] if r.get(k) is not None and p.get(k) else None, ".2f")
        mb = lambda k: fmt(None if r.get(k) is None else r[k] / 1e6, ".1f")
        over = r["residual_overhead_flops"]
        line = (f"{r['residual']:<14}{r['n_layer']:>4}{r['d_model']:>6}{r['ar']:>6.1f}{r['params'] / 1e6:>8.1f}M"
                f"{r['prefill_flops']:>10.3e}{fmt(over and 100 * over / r['prefill_flops'], '.1f'):>7}%"
                f"{mb('kv_cache_bytes'):>8}{mb('residual_state_bytes'):>9}")
        if measured:
            line += (f"{fmt(r['fwd_ms'], '.1f'):>9}{fmt(r['fwdbwd_ms'], '.1f'):>9}{ratio('fwdbwd_ms'):>6}"
                     f"{fmt(r['tok_per_s'], '.0f'):>8}{mb('peak_mem_bytes'):>9}{ratio('peak_mem_bytes'):>6}"
                     f"{mb('peak_mem_train_bytes'):>9}{ratio('peak_mem_train_bytes'):>6}"
                     f"{fmt(r['utilization'] and 100 * r['utilization'], '.1f'):>5}%  {r.get('error', '')}")
        print(line.rstrip())
    print("prefill: formula A, FLOPs per sequence (no head); +design: residual_overhead_flops, % of it; KV, state:"
          " MB per sequence" + ("; step = fwd+bwd; peak = prefill, train = step; x = ratio to Pre-LN" if measured
                                else ""))


def parse_shapes(p, args):
    """[(L, d)] from --shapes LxD,... or from --params and --ar through shapes.solve."""
    if args.shapes:
        if args.params or args.ar:
            p.error("give --shapes or --params/--ar, not both")
        try:
            texts = comma_list(str)(args.shapes)  # the project's one comma-list parser: an empty item is refused
        except ValueError:
            p.error(f"--shapes {args.shapes!r}: an empty item; give shapes LxD like 16x1216,70x640")
        dims = [re.fullmatch(r"([1-9]\d*)x([1-9]\d*)", t) for t in texts]
        for text, m in zip(texts, dims):
            if not m:
                p.error(f"--shapes: {text!r} is not a shape LxD like 16x1216")
        return [(int(m[1]), int(m[2])) for m in dims]
    try:
        budget = shapes.parse_count(args.params or "405M")  # a count from 1 to shapes.MAX_PARAMS
    except ValueError as e:
        p.error(str(e))
    try:
        ars = comma_list(positive(float))(args.ar or PAPER_AR)
    except ValueError:
        p.error(f"--ar {args.ar!r}: expected positive numbers like 76,9.1")
    try:
        return [(s["n_layer"], s["d_model"]) for s in (shapes.solve(budget, ar=ar, vocab=args.vocab) for ar in ars)]
    except ValueError as e:
        p.error(str(e))


def build_parser():
    p = ArgParser(prog="profile_gpu.py", description="FLOPs, KV cache, memory and time of the residual designs, "
                  "per shape.")
    p.add_argument("--residual", default="all", help=f"'all' or a comma list of: {', '.join(RESIDUALS)}")
    p.add_argument("--shapes", help="shapes LxD, comma separated, e.g. 16x1216,70x640 (d_ff = shapes.ffn_dim(d))")
    p.add_argument("--params", help="budget solved by shapes.solve at each --ar, e.g. 405M (default without --shapes)")
    p.add_argument("--ar", help=f"aspect ratios d/L for --params, comma separated (default {PAPER_AR}, the paper's)")
    p.add_argument("--heads", type=positive(), default=shapes.N_HEAD,
                   help="attention heads (default 16; head_dim must be even)")
    p.add_argument("--kv-heads", type=positive(), help="key/value heads, dividing --heads (default: --heads; the "
                   "1.6b suite's GQA: 8)")
    p.add_argument("--seq", type=positive(int, below=MAX_SEQ + 1, name=f"sequence length from 1 to {MAX_SEQ:,}"),
                   default=4096,
                   help="sequence length T (default 4096, as in Fig. 11)")
    p.add_argument("--batch", type=positive(int, below=MAX_BATCH + 1, name=f"batch from 1 to {MAX_BATCH:,}"), default=8,
                   help="batch of the measured runs and of kv_cache_bytes_batch (default 8)")
    p.add_argument("--vocab", type=positive(), default=shapes.VOCAB,
                   help="vocabulary size (default 50280, the paper's)")
    p.add_argument("--residual-args", type=json_object, default={}, help="design options as JSON (each design's "
                   "`options` in residuals.py; each design takes the keys it declares), e.g. '{\"n_groups\": 4}'")
    p.add_argument("--analytic-only", action="store_true", help="formulas only: build and run no model")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to measure (auto: cuda if any)")
    p.add_argument("--dtype", choices=list(DTYPES), help="bf16 (autocast) or fp32; default bf16 on CUDA and with "
                   "--analytic-only, fp32 on CPU")
    p.add_argument("--threads", type=positive(),
                   help="CPU threads when measuring (default torch's); 1 is steadier on shared cores")
    p.add_argument("--repeats", type=positive(), default=10,
                   help="timed runs after warm-up; the median is kept (default 10)")
    p.add_argument("--out", help="write the JSON to this file (atomically)")
    p.add_argument("--json", action="store_true", help="print the JSON on stdout instead of the table")
    p.add_argument("--bench", action="store_true", help="the speed benchmark instead: cross-layer designs / Pre-LN "
                   "(interleaved), Pre-LN vs HF Llama (if transformers is installed), compile break-even, loss memory")
    p.add_argument("--quick", action="store_true", help="with --bench: the step ratios and HF only")
    p.add_kernels()
    p.add_argument("--compile", default="blocks", choices=["blocks", "model", "graphs", "capture"],
                   help="what is compiled on CUDA (the CPU runs eager): blocks, each block on its own, as train.py "
                   "(default); model, the whole model as one graph; graphs, the whole model under CUDA graphs (mode "
                   "reduce-overhead): issue 52's launch-overhead experiment; capture, blocks with the whole training "
                   "step (forward and backward, eager parts included) recorded as one CUDA graph and replayed: "
                   "issue 68's host time, opt-in")
    p.add_argument("--kernel-profile", action="store_true", help="one more training step under torch.profiler: "
                   "kernels per step, the GPU busy share (kernel time over the step) and the 15 kernels with the "
                   "most time (CPU: leaf aten ops, no share)")
    p.add_argument("--in-process", action="store_true", help="CPU: measure every row in this process, as on CUDA, "
                   "not each in a fresh one (a second sooner per row, the allocator shared; scripts/gpu_smoke.py "
                   "--tiny)")
    return p


def checked_args(p, args):
    """The designs, the shapes [(L, d)] and the device the command line asks for; bad input exits 2."""
    try:
        designs = comma_list(str)(args.residual)
    except ValueError:
        p.error(f"--residual {args.residual!r}: an empty item; 'all' or a comma list of {', '.join(RESIDUALS)}")
    if designs == ["all"]:
        designs = list(RESIDUALS)
    for name in designs:
        if name not in RESIDUALS:
            p.error(f"unknown residual {name!r}; choose from all, {', '.join(RESIDUALS)}")
    try:
        check_options(designs, args.residual_args)
    except ValueError as e:
        p.error(f"--residual-args: {e}")
    dims = parse_shapes(p, args)
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    for L, d in dims:
        if d % args.heads or (d // args.heads) % 2:
            p.error(f"d={d} must split into {args.heads} heads of an even head_dim (RoPE rotates pairs)")
        if L > shapes.MAX_LAYERS:
            p.error(f"L={L:,}: more than the {shapes.MAX_LAYERS} blocks this code builds a model of")
        if d > shapes.MAX_PARAMS or shapes.preln_params(L, d, shapes.ffn_dim(d), vocab=args.vocab) > shapes.MAX_PARAMS:
            p.error(f"{L}x{d}: more than the {shapes.MAX_PARAMS:,} parameters (1T) a budget may have (shapes.py)")
    try:
        dev = torch.device(pick_device(args.device))
    except ValueError as e:
        p.error(str(e))
    return designs, dims, dev


def analytic_rows(args, designs, dims, dtype, mode):
    """One row per shape and design: its shape, parameters and analytic fields, the measured ones None, and the
    memory plan's peak of the training step in `mode` (costs.step_peak: "compiled" on CUDA, else the dtype)."""
    rows = []
    for L, d in dims:
        for res in designs:
            d_ff, opts = shapes.ffn_dim(d), design_options(res, args.residual_args)
            params = shapes.count_params(L, d, d_ff, res, vocab=args.vocab, n_head=args.heads, n_kv_head=args.kv_heads,
                                         **opts)
            fields = analytic(res, n_layer=L, d_model=d, d_ff=d_ff, seq=args.seq, batch=args.batch, vocab=args.vocab,
                              params=params, elem_bytes=DTYPES[dtype].itemsize, options=opts,
                              kv_ratio=args.kv_heads / args.heads)
            run = RunConfig.from_dict({"n_layer": L, "d_model": d, "d_ff": d_ff, "n_head": args.heads,
                                       "n_kv_head": args.kv_heads, "vocab_size": args.vocab, "residual": res,
                                       "residual_args": opts, "batch_size": args.batch, "seq_len": args.seq,
                                       "activation_checkpointing": False, "world_size": 1, "fsdp": False})
            rows.append({"residual": res, "n_layer": L, "d_model": d, "d_ff": d_ff, "ar": d / L, "seq": args.seq,
                         "batch": args.batch, "params": params, **fields, **dict.fromkeys(MEASURED),
                         "planned_train_bytes": step_peak(run, params, mode)})
    return rows


def measure_rows(args, rows, dev, dtype):
    """Time and memory of every row, measured, into the rows -> the device's measured matmul peak FLOP/s."""
    settings = {"heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "repeats": args.repeats,
                "threads": args.threads, "device": str(dev), "dtype": dtype, "kernels": args.kernels,
                "compile": args.compile, "kernel_profile": args.kernel_profile}
    # measure() reads the shape off the row
    jobs = [{**row, **settings, "residual_args": design_options(row["residual"], args.residual_args)}
            for row in rows]
    peak = peak_flops(dev, DTYPES[dtype])
    kind = "cuda max_memory_allocated" if dev.type == "cuda" else "cpu model + peak tensor bytes (TensorBytes)"
    for row, got in zip(rows, run_measured(jobs, dev, in_process=args.in_process)):
        row.update(got, peak_mem_kind=kind)
        if "fwdbwd_ms" in got:
            row["tok_per_s"] = row["batch"] * row["seq"] / (got["fwdbwd_ms"] / 1e3)
            row["utilization"] = row["train_flops_per_token"] * row["tok_per_s"] / peak
        if got.get("kernel_ms") is not None:
            row["busy_share"] = got["kernel_ms"] / got["fwdbwd_ms"]
    return peak


BENCH_OPTIONS = ("--repeats", "--quick", "--kernels")  # what --bench reads: its shapes, device and output are its own


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    given = p.given(args)
    if args.bench:  # every option applies, or one line and exit 2: not a 30-60 min CPU benchmark that ignores it
        p.refuse_beside(given, "--bench", BENCH_OPTIONS)
    elif args.quick:
        p.error("--quick narrows --bench: give it with --bench")
    if args.out and (why := common.cannot_write(args.out)):  # before the work, not after
        p.error(f"--out {args.out}: {why}")
    if args.bench:
        return bench(min(args.repeats, 5), args.quick, args.kernels)
    designs, dims, dev = checked_args(p, args)
    if args.threads:
        torch.set_num_threads(args.threads)  # for the matmul peak here; every measuring process sets it too
    dtype = args.dtype or ("bf16" if dev.type == "cuda" or args.analytic_only else "fp32")
    device = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    if dev.type == "cuda":
        device = torch.cuda.get_device_name(dev)
    print(f"device {device}, dtype {dtype}, {len(dims)} shapes x {len(designs)} designs", file=sys.stderr)

    rows = analytic_rows(args, designs, dims, dtype, mode="compiled" if dev.type == "cuda" else dtype)
    peak = None
    if not args.analytic_only:
        peak = measure_rows(args, rows, dev, dtype)
    doc = {"schema": "depthbench.profile/1", "device": device, "dtype": str(DTYPES[dtype]).removeprefix("torch."),
           "peak_flops": peak, "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else list(argv),
           "rows": rows}
    if args.out:
        try:
            write_json(args.out, doc)
        except OSError as e:  # a common.WriteError, one line naming the path and the cause
            common.fail("profile_gpu.py", str(e))
        print(f"wrote {args.out}", file=sys.stderr)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        summary(doc)
    if not args.analytic_only and all(r.get("error") for r in rows):
        print(f"profile_gpu.py: every row failed to measure, the first with {rows[0]['error']}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    with common.one_line_faults("profile_gpu.py", "nothing was written; run the same command again"):  # Ctrl-C: one line
        main()
