"""
Full / Block AttnRes' and MoDA's depth kernels alone, the host's cost of a call and of a bare launch: the sections of
scripts/kernel_bench.py beyond HC/mHC (issue 68 item 5). Imported by it; not run on its own.

Each family runs one consumer group of the card's shape (L70 d640, 4,096 tokens, bf16 autocast) through its public
Python body, and the same inputs through ops.py's reference:
- AttnRes (Full and Block): the deepest chunk of consumers (triton_attnres_chunk.CHUNK of them, the last ones of
  roofline.attnres_reads: Full reads 134 .. 141 sources, Block its last group's sources and the open sum as the
  extra) on triton_attnres_chunk.DepthBank started with their queries and key gains (phase 1 once, phase 2 each,
  the chunk's backward), against ops.DepthBank;
- MoDA: the deepest attention consumer (block L - 1 reads 2(L - 1) depth slots; 16 heads of 40), triton_moda's
  DepthKV and joint_attention, against ops.DepthKV and ops.joint_attention.
Every repeat builds its bank afresh (untimed: a bank keeps records and chunks between calls), then times the
consumers' forward and the backward of all their outputs (autograd.grad: the consumers' passes and the deferred
source passes the pushes run), each with CUDA events (the GPU's time) and with the host's clock around the Python
call (it returns when the launches are queued: the host's time). The
first repeat's outputs and gradients are compared with the reference's (cosine and max error over the largest
entry: a race on the GPU shows here). The bytes beside each time are the modules' own counts (`chunk_traffic` /
`phase_traffic`, `traffic`); a module whose counting functions changed leaves "bytes_reason" instead. On CUDA one
more build runs under torch.profiler: "kernel_profile", each GPU kernel's own time by name (profile_gpu's), and
"host_over_kernels", the host's time over the kernels' (> 1: launch-bound, the events then time the host's pace).

`bare_launch`: a trivial Triton kernel with 19 arguments (8 pointers, 10 integers, a constexpr), launched many times
back to back: the host's microseconds per launch (issue 68: ~10-15 us measured on a busy CPU, 3.75 us booked).

`Launches` records the Triton kernels launched while it is on, by their names, at Triton's launch (KernelInterface
.__getitem__), so it sees every module's kernels, liger-kernel's included, and never the @jit helpers a kernel calls.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from depthbench.kernels.triton_attnres import jit, tl  # triton.jit and triton.language where triton imports

TINY_LAYERS = 3              # --tiny: the card's patterns at L3 (6 consumers, a chunk of them)
MODA_HEADS, MODA_HEAD_DIM = 16, 40   # the card's: d640 = 16 heads of 40
TINY_MODA = {"heads": 2, "head_dim": 8, "batch": 1, "seq": 8}


class Launches:
    """The names of the Triton kernels launched inside `with Launches() as rec:` (rec.names, in order)."""

    def __init__(self):
        self.names, self.saved = [], []

    def __enter__(self):
        from triton.runtime import interpreter, jit
        for cls in (jit.KernelInterface, interpreter.InterpretedFunction):
            if "__getitem__" in cls.__dict__:
                original = cls.__dict__["__getitem__"]
                self.saved.append((cls, original))
                setattr(cls, "__getitem__", self.recording(original))
        return self

    def recording(self, original):
        def launch(kernel, grid):
            self.names.append(kernel_name(kernel))
            return original(kernel, grid)
        return launch

    def __exit__(self, *exc):
        for cls, original in self.saved:
            setattr(cls, "__getitem__", original)


def kernel_name(kernel):
    """A launched kernel's function name (a JITFunction's, an interpreted one's, an autotuner's inner one)."""
    inner = getattr(kernel, "fn", kernel)
    return getattr(inner, "__name__", None) or type(kernel).__name__


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    if not a.norm() and not b.norm():
        return 1.0
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-300)).item()


def agreement(got, want):
    """{min_cosine, max_error (over the reference's largest entry)} of two lists of tensors (None pairs skipped)."""
    cosines, errors = [], []
    for a, b in zip(got, want):
        if a is None or b is None:
            continue
        cosines.append(cosine(a, b))
        scale = b.detach().abs().max().clamp_min(1e-30)
        errors.append(((a.detach().double() - b.detach().double()).abs().max() / scale).item())
    return {"min_cosine": round(min(cosines), 6), "max_error": float(f"{max(errors):.3g}")}


# ----------------------------------------------------------------------------- timing one consumer group


@dataclass
class Run:
    """One freshly built consumer group: what its forward makes and what its backward differentiates."""
    forward: object            # () -> list of output tensors (the timed consumers' calls)
    leaves: list               # the tensors the backward differentiates (sources, parameters, slots)
    push_host_us: list = field(default_factory=list)   # the host's clock around each push of the build


class Clock:
    """The GPU's time (CUDA events) and the host's (perf_counter around the call, no sync) of one call."""

    def __init__(self, device):
        self.cuda = device == "cuda"

    def __call__(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn()
        host_ms = 1e3 * (time.perf_counter() - t0)
        if not self.cuda:
            return out, host_ms, host_ms
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end), host_ms


def measure(build, device, repeat, warmup):
    """Times build()'s forward and backward over repeat fresh builds after warmup untimed ones -> (numbers, the first
    timed run's outputs and gradients, the kernels each pass launched)."""
    clock, first, kernels = Clock(device), None, {}
    times = {"forward_ms": [], "forward_host_ms": [], "backward_ms": [], "backward_host_ms": [], "push_host_us": []}
    for i in range(warmup + repeat):
        run = build()
        with Launches() as fwd:
            outs, ms, host = clock(run.forward)
        ups = [torch.randn(o.shape, device=o.device, generator=torch.Generator(o.device).manual_seed(j)).to(o.dtype)
               for j, o in enumerate(outs)]
        with Launches() as bwd:
            grads, bms, bhost = clock(lambda: torch.autograd.grad(outs, run.leaves, ups, allow_unused=True))
        if i < warmup:
            continue
        first = first or (outs, grads)
        kernels = {"forward": fwd.names, "backward": bwd.names}
        for key, value in (("forward_ms", ms), ("forward_host_ms", host), ("backward_ms", bms),
                           ("backward_host_ms", bhost)):
            times[key].append(value)
        times["push_host_us"] += [1e3 * t for t in run.push_host_us]
    numbers = {key: round(statistics.median(values), 4) for key, values in times.items() if values}
    return numbers, first, kernels


def profiled(build, device):
    """One more fresh build's forward + backward under torch.profiler (profile_gpu.kernel_profile) on CUDA: the
    GPU's kernels by name, each {name, calls, ms}: each kernel's own time beside the pass's; None on the CPU (the
    interpreter's kernels are no GPU's)."""
    if device != "cuda":
        return None
    import profile_gpu
    run = build()

    def step():
        outs = run.forward()
        torch.autograd.grad(outs, run.leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
    return profile_gpu.kernel_profile(step, torch.device(device))


def host_over_kernels(doc):
    """doc["host_over_kernels"]: the host's time of forward + backward (the Python calls, not waiting for the GPU)
    over the GPU kernels' summed time (kernel_profile): > 1, the calls are launch-bound (the events' ms then measure
    the host's pace, not the kernels'); None without a profile (the CPU)."""
    profile = doc.get("kernel_profile") or {}
    host = doc["forward"]["host_ms"] + doc["backward"]["host_ms"]
    doc["host_over_kernels"] = round(host / profile["kernel_ms"], 3) if profile.get("kernel_ms") else None


def pass_rows(numbers, kernels, moved, consumers, peak):
    """{forward, backward: {ms, host_ms, host_us_per_consumer, bytes, launches, gb_per_s, eta, kernels}}."""
    rows = {}
    for name in ("forward", "backward"):
        ms, host = numbers[f"{name}_ms"], numbers[f"{name}_host_ms"]
        row = {"ms": ms, "host_ms": host, "host_us_per_consumer": round(1e3 * host / consumers, 1),
               "kernels": kernels.get(name, [])}
        if moved is not None:
            got = moved[name]
            row.update(bytes=got["bytes"], launches=got["launches"], gb_per_s=round(got["bytes"] / ms / 1e6, 1),
                       eta=None if peak is None else round(got["bytes"] / ms / 1e-3 / peak, 3))
        rows[name] = row
    return rows


def totals(rows):
    """{bytes, launches} summed over `moved` rows (dicts with read, written, launches)."""
    return {"bytes": sum(r["read"] + r["written"] for r in rows), "launches": sum(r["launches"] for r in rows)}


# ----------------------------------------------------------------------------- AttnRes (Full, Block)


@dataclass
class AttnResCase:
    design: str                # "attnres" | "block_attnres"
    reads: list                # the bank sources each consumer of the chunk reads (forward order)
    n_max: int                 # the bank's slots (every source the chunk's consumers read)
    extra: bool                # Block AttnRes: each consumer also mixes its open partial sum (fp32)
    tokens: int
    D: int


def attnres_case(design, tokens, D, tiny):
    """The deepest chunk of the design's consumers at the card's depth (--tiny: L3), as roofline.attnres_reads
    lists them."""
    import roofline
    from depthbench.kernels.triton_attnres_chunk import CHUNK
    reads = [n for _, n in roofline.attnres_reads(design, TINY_LAYERS if tiny else roofline.CARD["layers"])[0]]
    chunk = reads[-CHUNK:]
    return AttnResCase(design=design, reads=chunk, n_max=max(chunk), extra=design == "block_attnres", tokens=tokens,
                       D=D)


def attnres_inputs(case, device):
    """The sources (bf16, as a block's outputs under autocast), the chunk's queries and key gains (fp32 rows, off
    their init) and the open sums (fp32), as leaves; one generator, so both bodies see the same numbers."""
    g = torch.Generator(device).manual_seed(0)
    shape = (1, case.tokens, case.D)
    sources = [torch.randn(shape, device=device, generator=g).to(torch.bfloat16).requires_grad_()
               for _ in range(case.n_max)]
    rows = len(case.reads)
    queries = (0.5 * torch.randn(rows, case.D, device=device, generator=g)).requires_grad_()
    gains = (1 + 0.1 * torch.randn(rows, case.D, device=device, generator=g)).requires_grad_()
    extras = [torch.randn(shape, device=device, generator=g).requires_grad_() if case.extra else None
              for _ in range(rows)]
    return sources, queries, gains, extras


def attnres_build(case, inputs, device, fast):
    """A Run of the chunk: the bank holds every source before the first timed mix (pushes untimed, their host time
    kept); fast: triton_attnres_chunk.DepthBank with the queries (rows 0 .. C - 1: one chunk), else ops.DepthBank."""
    import ops
    from depthbench.kernels import triton_attnres_chunk as chunked
    from residuals import Site
    sources, queries, gains, extras = inputs
    autocast = torch.autocast(device, dtype=torch.bfloat16)

    def build():
        with autocast:
            state = (chunked.DepthBank.start(sources[0], n_max=case.n_max, queries=queries, key_gains=gains) if fast
                     else ops.DepthBank([sources[0]]))
        states, push_us = [state], []
        while len(states) < case.n_max:
            t0 = time.perf_counter()
            with autocast:
                states.append(states[-1].push(sources[len(states)]))
            push_us.append(1e3 * (time.perf_counter() - t0))

        def forward():
            outs = []
            with autocast:
                for r, n in enumerate(case.reads):
                    site = Site(r + 1, None, row=r).to(device)
                    mix, _, _ = states[n - 1].mix(site.pick(queries), site.pick(gains), 1e-5, extra=extras[r],
                                                  site=site)
                    outs.append(mix)
            return outs
        leaves = sources + [queries, gains] + [e for e in extras if e is not None]
        return Run(forward, leaves, push_us if fast else [])
    return build


def attnres_moved(case):
    """{forward, backward: {bytes, launches}} of the chunk as triton_attnres_chunk counts it: phase 1 and its
    backward (`chunk_traffic`), each consumer's phase 2 both ways (`phase_traffic`), the gradient bank's zeroing."""
    from depthbench.kernels import triton_attnres_chunk as chunked
    n1, C, S = case.reads[0], len(case.reads), case.tokens * case.D
    chunk = chunked.chunk_traffic(n1, C, rows=C, tokens=case.tokens, D=case.D)
    phases = [chunked.phase_traffic(n1, n, case.tokens, case.D, extra=case.extra) for n in case.reads]
    forward = [chunk[0]] + [p[0] for p in phases]
    backward = chunk[1:] + [p[1] for p in phases] + [{"read": 0, "written": 4 * case.n_max * S, "launches": 1}]
    return {"forward": totals(forward), "backward": totals(backward)}


def checked_against_reference(build, device, args):
    """The fast body's pass timed (`measure`) and its outputs and gradients against the reference body's on the same
    inputs and upstream gradients: build(fast) -> a built pass. -> (numbers, kernels, {forward_vs_reference,
    gradients_vs_reference})."""
    numbers, (outs, grads), kernels = measure(build(True), device, args.repeat, warmup=0 if args.tiny else 2)
    reference = build(False)()
    ref = reference.forward()
    ups = [torch.randn(o.shape, device=o.device, generator=torch.Generator(o.device).manual_seed(j)).to(o.dtype)
           for j, o in enumerate(outs)]
    ref_grads = torch.autograd.grad(ref, reference.leaves, [u.to(r.dtype) for u, r in zip(ups, ref)],
                                    allow_unused=True)
    return numbers, kernels, {"forward_vs_reference": agreement(outs, ref),
                              "gradients_vs_reference": agreement(grads, ref_grads)}


def attnres_bench(design, args, device, peak):
    """One AttnRes design's chunk, timed and checked -> its section of kernel_bench's JSON."""
    case = attnres_case(design, args.tokens, args.d_model, args.tiny)
    inputs = attnres_inputs(case, device)
    numbers, kernels, checks = checked_against_reference(lambda fast: attnres_build(case, inputs, device, fast),
                                                         device, args)
    doc = {"consumers": len(case.reads), "reads": case.reads, "n_max": case.n_max, "extra": case.extra,
           "tokens": case.tokens, "d_model": case.D, **checks}
    moved = counted(lambda: attnres_moved(case), doc)
    doc.update(pass_rows(numbers, kernels, moved=moved, consumers=len(case.reads), peak=peak))
    doc["push_host_us"] = numbers.get("push_host_us")
    doc["kernel_profile"] = profiled(attnres_build(case, inputs, device, fast=True), device)
    host_over_kernels(doc)
    return doc


def counted(fn, doc):
    """fn()'s byte count, or None with doc["bytes_reason"] (a module whose counting functions changed)."""
    try:
        return fn()
    except Exception as e:  # another engineer's re-tiling may change the counts' signatures: say so, keep timing
        doc["bytes_reason"] = f"{type(e).__name__}: {e}"[:300]
        return None


# ----------------------------------------------------------------------------- MoDA


@dataclass
class ModaCase:
    slots: int                 # depth slots the consumer reads: 2 (L - 1), block L - 1's attention
    batch: int
    seq: int
    heads: int
    head_dim: int


def moda_case(tokens, tiny):
    """Block L - 1's attention at the card's shape (micro-batch 2 of 2048 tokens when tokens = 4096)."""
    import roofline
    if tiny:
        return ModaCase(slots=2 * (TINY_LAYERS - 1), **TINY_MODA)
    seq = roofline.CARD["seq"]
    return ModaCase(slots=2 * (roofline.CARD["layers"] - 1), batch=max(1, tokens // seq), seq=seq, heads=MODA_HEADS,
                    head_dim=MODA_HEAD_DIM)


def moda_inputs(case, device):
    """q in the projection's layout ((B, T, H, hd) in memory, seen as (B, H, T, hd)), k, v and the slots' keys and
    values (B, H, T, hd), bf16 leaves."""
    g = torch.Generator(device).manual_seed(0)
    B, T, H, hd = case.batch, case.seq, case.heads, case.head_dim

    def leaf(*shape):
        return torch.randn(shape, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    q = leaf(B, T, H, hd)
    k, v = leaf(B, H, T, hd), leaf(B, H, T, hd)
    slots = [(leaf(B, H, T, hd), leaf(B, H, T, hd)) for _ in range(case.slots)]
    return q, k, v, slots


def moda_build(case, inputs, device, fast):
    """A Run of one joint attention over the case's slots; fast: triton_moda's DepthKV, else ops.DepthKV."""
    import ops
    from depthbench.kernels import triton_moda
    q, k, v, slots = inputs
    autocast = torch.autocast(device, dtype=torch.bfloat16)

    def build():
        depth, push_us = (triton_moda.DepthKV.start(case.slots) if fast else ops.DepthKV([], [])), []
        for key, value in slots:
            t0 = time.perf_counter()
            with autocast:
                depth = depth.push(key, value)
            push_us.append(1e3 * (time.perf_counter() - t0))

        def forward():
            with autocast:
                body = triton_moda.joint_attention if fast else ops.joint_attention
                return [body(q.transpose(1, 2), k, v, depth)[0]]
        leaves = [q, k, v] + [t for pair in slots for t in pair]
        return Run(forward, leaves, push_us if fast else [])
    return build


def moda_moved(case):
    """{forward, backward: {bytes, launches}} of the consumer as triton_moda.traffic counts it (the backward with its
    share of the slot passes, `deferred`)."""
    from depthbench.kernels import triton_moda
    parts = triton_moda.traffic(case.slots, case.batch * case.seq, heads=case.heads, kv_heads=case.heads,
                                head_dim=case.head_dim)
    return {"forward": totals([parts["forward"]]), "backward": totals([parts["backward"], parts["deferred"]])}


def moda_bench(args, device, peak):
    """MoDA's deepest consumer, timed and checked -> its section of kernel_bench's JSON."""
    case = moda_case(args.tokens, args.tiny)
    inputs = moda_inputs(case, device)
    numbers, kernels, checks = checked_against_reference(lambda fast: moda_build(case, inputs, device, fast),
                                                         device, args)
    doc = {"slots": case.slots, "batch": case.batch, "seq": case.seq, "heads": case.heads,
           "head_dim": case.head_dim, **checks}
    moved = counted(lambda: moda_moved(case), doc)
    doc.update(pass_rows(numbers, kernels, moved=moved, consumers=1, peak=peak))
    doc["push_host_us"] = numbers.get("push_host_us")
    doc["kernel_profile"] = profiled(moda_build(case, inputs, device, fast=True), device)
    host_over_kernels(doc)
    return doc


# ----------------------------------------------------------------------------- a bare launch


@jit
def _bare(p0, p1, p2, p3, p4, p5, p6, p7, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, BLOCK: tl.constexpr):
    """A Triton kernel of 19 arguments (8 pointers, 10 integers, one constexpr) that stores one number: its launch
    is the host's cost of a launch of our kernels' size, nothing else."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(p0 + offs, (n0 + n9).to(tl.float32), mask=offs < n1)


def bare_launch(device, launches):
    """Host microseconds per launch of `_bare` (launches back to back, after a warm-up that compiles it), and
    per launch of a torch op on a tiny tensor (x.add_(1)), for scale -> {us_per_launch, torch_op_us, launches}."""
    kernel = _bare
    x = torch.zeros(128, device=device)
    pointers = [x] * 8
    numbers = [0, 128] + list(range(2, 10))

    def launch():
        kernel[(1,)](*pointers, *numbers, BLOCK=128)
    out = {"launches": launches, "arguments": 19}
    for name, fn in (("us_per_launch", launch), ("torch_op_us", lambda: x.add_(1))):
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(launches):
            fn()
        out[name] = round(1e6 * (time.perf_counter() - t0) / launches, 2)
        if device == "cuda":
            torch.cuda.synchronize()
    return out


# ----------------------------------------------------------------------------- the probe's numbers, when given


def probe_records(path):
    """scripts/kernel_probe.py's JSON (issue 68 item 1, written on another branch) -> {kernel name: its record}.
    Accepted: {"kernels": [{"kernel": name, ...}]}, {"kernels": {name: {...}}}, or a list of records; the fields are
    the probe's (registers, spills, ctas_per_sm, issue_floor_ms, ...) and kernel_bench copies them as they are."""
    import json
    doc = json.loads(Path(path).read_text())
    rows = doc.get("kernels", doc) if isinstance(doc, dict) else doc
    if isinstance(rows, dict):
        return {name: record for name, record in rows.items() if isinstance(record, dict)}
    return {r.get("kernel") or r.get("name"): r for r in rows if isinstance(r, dict)}


def attach_probe(section, records):
    """Puts the probe's record of each kernel a pass launched beside its time (row["probe"]), and the sum of their
    issue floors (row["issue_floor_ms"], where the probe gives issue_floor_ms per launch)."""
    for row in section.values():
        if not isinstance(row, dict) or not isinstance(row.get("kernels"), list):   # a pass's row names its kernels
            continue
        found = {name: records[name] for name in dict.fromkeys(row["kernels"]) if name in records}
        row["probe"] = found
        floors = [records[name].get("issue_floor_ms") for name in row["kernels"] if name in records]
        if floors and all(isinstance(f, (int, float)) for f in floors):
            row["issue_floor_ms"] = round(sum(floors), 4)
