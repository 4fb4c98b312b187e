"""
The Triton kernels as the compiler builds them for an H100 (sm_90), judged on a CPU (issue 68, item 1;
docs/speed.md#the-time-model).

    python scripts/kernel_probe.py                       # every design at L70 d640 B2 T2048 (minutes; MoDA's step
                                                         # at L70 needs > 12 GB here: --fit-depths 2,3,4 for it)
    python scripts/kernel_probe.py --designs hc --layers 2 --seq 64 --json probe.json
    python scripts/kernel_probe.py --tools /nowhere      # where ptxas / cuobjdump are looked for (exit 2 if absent)

Three steps, each generic over the kernels (no kernel is named here):
  record   each design's Triton path runs one training step (forward and backward) in a child process under
           TRITON_INTERPRET=1 with every Triton launch replaced by a recorder that runs nothing (the wrappers
           allocate their outputs, so the step goes on): per launch, the kernel, its grid, and per argument what the
           JIT specialises on (a pointer's dtype and 16-byte alignment, an int's width, divisibility by 16 or value 1,
           a float, the constexprs), with the int values. The backbone's attention and MLP are stand-ins that cost
           nothing (attention's q = k = v = its input, reshaped to the heads; MoDA's depth attention is still its
           own), so a step at the card's shape runs on a CPU; the kernels see the shapes, dtypes (bf16 autocast) and
           sizes a real step passes them.
  compile  every distinct specialisation with triton.compile for sm_90 (GPUTarget("cuda", 90, 32)), as a launch
           would; ptxas and cuobjdump from the Triton wheel (or --tools).
  read     registers, stack and local memory (spills) from `cuobjdump --dump-resource-usage`; shared memory from
           the metadata; async copies from the TTGIR; from the SASS: the loops (backward branches), each loop's
           instructions and barriers, global load widths; loop trip counts from the TTIR's scf.for bounds evaluated
           at each launch's int arguments (matched to the SASS loops in order); the dots' shapes from the TTIR.

Per kernel and step: CTAs per SM = min(65,536 registers / (registers rounded to 8 x 32 x warps), 228 KB / (shared
+ 1 KB), 64 warps / warps, 32); waves = ceil(programs / (132 SMs x CTAs per SM)); warp-instructions = SASS
instructions a thread executes (outside loops once, a loop's body x its trips) x warps x programs, summed over the
step's launches. Host (a child under the interpreter, launches no-ops, at the card's depth and HOST_SHAPE's width): the
eager step of each design and Pre-LN, and the step compiled per block as train.py compiles it on a GPU
(compile_model's "blocks", inductor generating CPU code here: the backbone's tiny CPU work is Pre-LN's too), graphs
and breaks per block (torch._dynamo.explain), a launch's Python path, one argument's specialisation and one graph
break, in this process's CPU time. Exit 2, one line, where the tools or
triton are missing.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root
from depthbench.reports.compiled_code import (H100, Loop, Variant, ctas_per_sm, dot_flops,  # noqa: E402
                                              executions, loop_trips, match_loops, per_thread, read_sass, read_ttir,
                                              resource_usage, waves)
from depthbench.files.common import ArgParser  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import roofline  # noqa: E402  (scripts/ is not a package; the card's shape)

DESIGNS = ["hc", "mhc", "attnres", "block_attnres", "moda"]
CARD = {key: roofline.CARD[key] for key in ("layers", "width", "heads", "batch", "seq")}   # L70 d640 B2 T2048
# the host-time runs' width: the host's Python and dispatch do not depend on it, while a CPU's work on the weights does
# (bf16 casts and weight-gradient GEMMs that take microseconds on a GPU: at d640, MoDA's W_kv alone ~4 ms a block)
HOST_SHAPE = {"width": 64, "heads": 4}
TOOLS = ("ptxas", "cuobjdump")


class ProbeError(Exception):
    """A missing tool or package: main prints it as one line and exits 2."""


# ----------------------------------------------------------------------------- record (the child process)

@dataclass
class Launch:
    kernel: str                 # module:function of the @triton.jit function launched
    grid: list                  # programs on each axis
    signature: dict             # parameter -> "*bf16" | "i32" | "fp32" | "constexpr" ... (what the JIT specialises)
    constexprs: dict            # parameter -> value (declared constexprs, ints equal to 1, None)
    aligned: list               # parameters the JIT marks tt.divisibility 16 (pointers and ints)
    ints: dict                  # parameter -> value of every int argument (loop bounds are evaluated at these)
    options: dict               # the launch's keywords that are not parameters (num_warps, num_stages, ...)

    def key(self):
        """The compilation a launch selects: two launches with the same key run the same binary."""
        return json.dumps([self.kernel, self.signature, self.constexprs, sorted(self.aligned), self.options],
                          sort_keys=True, default=str)


def jit_specialisation(values=True):
    """triton's JIT's own per-argument specialisation: value -> (type, "D" where divisible by 16 | "" | None);
    values False: that of a parameter the kernel names in `do_not_specialize` (no constexpr 1, no divisibility)."""
    import functools
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    specialise = functools.partial(native_specialize_impl, BaseBackend)
    return lambda value: specialise(value, False, values, values)      # not const, specialised, aligned


def describe(fn, args, kwargs, unspecialised=()):
    """A Launch's arguments from a kernel's Python function and a launch's args: what triton's JIT would
    specialise (jit_specialisation), with the int values kept; unspecialised: the kernel's do_not_specialize."""
    import inspect
    specialise, plain = jit_specialisation(), jit_specialisation(values=False)
    parameters = inspect.signature(fn).parameters
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in parameters}   # num_warps, num_stages, ...
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs, aligned, ints = {}, {}, [], {}
    for name, value in bound.arguments.items():
        annotation = str(parameters[name].annotation)
        if "constexpr" in annotation:
            signature[name], constexprs[name] = "constexpr", value
            continue
        kind, attr = (plain if name in unspecialised else specialise)(value)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = value
        if attr == "D":
            aligned.append(name)
        if isinstance(value, int) and not isinstance(value, bool):
            ints[name] = value
    return signature, constexprs, aligned, ints, options


def stand_ins():
    """Attention and the MLP as branches that cost nothing (module docstring): (attention forward, MLP forward)."""
    from residuals import AttentionInputs

    def attention(self, x, rope, inputs=None):
        inputs = inputs or AttentionInputs()
        B, T, _ = x.shape
        q = x.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        o, share = (q, None) if inputs.attend is None else inputs.attend(q, q, q, rope)
        return o.transpose(1, 2).reshape(B, T, -1), {"k": q, "v": q, "depth_share": share}

    return attention, lambda self, x: x * 1.0


class Stubbed:
    """Every Triton launch replaced by `recorder` (None: a no-op), the backbone's branches by `stand_ins`; this
    process must have TRITON_INTERPRET=1 (the kernels are InterpretedFunctions). `launches` collects [Launch]."""

    def __init__(self, record=True):
        self.record, self.launches, self.saved = record, [], None

    def recorder(self, kernel, args, grid, kwargs):
        if self.record:
            grid = list(grid(kwargs) if callable(grid) else grid)
            sig, const, aligned, ints, options = describe(kernel.fn, args, dict(kwargs),
                                                          kernel.kwargs.get("do_not_specialize") or ())
            name = f"{kernel.fn.__module__}:{kernel.fn.__name__}"
            self.launches.append(Launch(kernel=name, grid=grid, signature=sig, constexprs=const, aligned=aligned,
                                        ints=ints, options=options))

    def __enter__(self):
        import model
        from triton.runtime.interpreter import InterpretedFunction
        self.saved = InterpretedFunction.run, model.Attention.forward, model.MLP.forward
        InterpretedFunction.run = lambda kernel, *args, grid, warmup, **kw: self.recorder(kernel, args, grid, kw)
        model.Attention.forward, model.MLP.forward = stand_ins()
        return self

    def __exit__(self, *exc):
        import model
        from triton.runtime.interpreter import InterpretedFunction
        InterpretedFunction.run, model.Attention.forward, model.MLP.forward = self.saved


def build(design, shape):
    """(a `design` model with kernels "triton" at `shape`, d_ff 16 and 64 tokens of vocabulary; a batch of ids)."""
    import torch
    from model import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=64, n_layer=shape["layers"], d_model=shape["width"], n_head=shape["heads"], d_ff=16,
                    residual=design, kernels="triton")
    torch.manual_seed(0)
    return GPT(cfg), torch.randint(0, cfg.vocab_size, (shape["batch"], shape["seq"]))


def step(net, idx):
    """One forward and backward under bf16 autocast (the GPU path's dtypes)."""
    import torch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = net(idx, idx, logits=False)
    loss.backward()


def record_step(design, shape):
    """[Launch] of one training step of `design` at `shape`, the launches recorded and not run."""
    net, idx = build(design, shape)
    with Stubbed() as stub:
        step(net, idx)
    return stub.launches


def record_child(designs, shape, path):
    """The recording child's work: one design's launches at `shape` -> JSON at `path`."""
    Path(path).write_text(json.dumps([asdict(x) for x in record_step(designs[0], shape)]))
    return 0


def record(design, shape):
    """[Launch] of one step of `design` at `shape`, recorded in a child process under TRITON_INTERPRET=1 (this
    process keeps triton's compiling JIT)."""
    return [Launch(**x) for x in in_child("--record-child", [design], shape)]


# ----------------------------------------------------------------------------- compile

def find_tools(directory=None):
    """{tool: path} of ptxas and cuobjdump: in `directory` if given, else the Triton wheel's
    triton/backends/nvidia/bin. ProbeError (exit 2) naming what is missing."""
    if directory is None:
        try:
            import triton
        except ImportError:
            raise ProbeError("triton is not installed (pip install triton): the probe compiles with it")
        directory = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    tools = {name: Path(directory) / name for name in TOOLS}
    missing = [name for name, path in tools.items() if not os.access(path, os.X_OK)]
    if missing:
        raise ProbeError(f"{', '.join(missing)} not found in {directory} (the CUDA back end of the Triton wheel "
                         f"carries them; --tools names another folder)")
    return tools


def load_kernel(name):
    """The JITFunction `module:function` (imported here, where TRITON_INTERPRET is unset)."""
    import importlib
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def compile_for_sm90(launch, tools):
    """triton.compile of the launch's specialisation for sm_90 -> the compiled kernel (asm: ttir, ttgir, cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    os.environ["TRITON_PTXAS_PATH"] = str(tools["ptxas"])
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    fn = load_kernel(launch.kernel)
    if not hasattr(fn, "params"):                 # an InterpretedFunction: this process imported triton interpreted
        raise ProbeError("TRITON_INTERPRET=1 in the compiling process: unset it (the recording child sets its own)")
    names = [p.name for p in fn.params]
    constexprs = {(names.index(k),): v for k, v in launch.constexprs.items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in launch.aligned}
    source = ASTSource(fn, dict(launch.signature), constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(launch.options))


# ----------------------------------------------------------------------------- read the compiled code

def probe_variant(launch, tools):
    """Compile one launch's specialisation and read it -> Variant."""
    compiled = compile_for_sm90(launch, tools)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tools["cuobjdump"]), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass_text = subprocess.run([str(tools["cuobjdump"]), "-sass", str(cubin)], capture_output=True, text=True,
                                   check=True).stdout
    resources = resource_usage(usage)
    sass = read_sass(sass_text)
    loops, dots, definitions = read_ttir(compiled.asm["ttir"])
    return Variant(kernel=launch.kernel, registers=resources.get("REG", 0), stack=resources.get("STACK", 0),
                   local=resources.get("LOCAL", 0), shared=compiled.metadata.shared,
                   warps=compiled.metadata.num_warps, stages=compiled.metadata.num_stages, sass=sass,
                   ttir_loops=loops, ttir_dots=dots, definitions=definitions,
                   matched=match_loops(sass, loops, definitions),
                   async_ttgir=compiled.asm["ttgir"].count("async_copy_global_to_local"))


# ----------------------------------------------------------------------------- per kernel and step

@dataclass
class KernelRow:
    design: str
    kernel: str                 # the @triton.jit function's name
    variants: int               # distinct specialisations the step compiles
    launches: int               # per step
    registers: int              # the bulk variant's (the specialisation that issues most of the step's instructions)
    spills: int                 # local memory bytes a thread (stack included), the most of any variant
    shared: int                 # bytes a CTA, the bulk variant's
    warps: int                  # the bulk variant's
    ctas_per_sm: int            # the bulk variant's
    worst_ctas_per_sm: int      # the fewest of any variant (e.g. HC's sublayer 0, whose streams are still fp32)
    bulk_launches: int          # the launches of the bulk variant
    programs: int               # the most of any launch
    waves: int                  # the most of any launch
    async_copies: int           # in its loops (TTGIR async copies + SASS LDGSTS), the most of any variant
    loads: dict                 # global load width (bits) -> LDG instructions, the hottest variant's
    loop_instructions: int      # the hottest loop's body (its inner loops left out), per iteration
    loop_barriers: int          # BAR.* in that body
    warp_instructions: float    # per step
    fp32_flops: float           # per step, CUDA cores (FFMA 2, FADD and FMUL 1; packed 16-bit x 2)
    dot_flops: dict             # per step, "bf16" | "tf32" | "fp32" (ieee) -> tl.dot FLOPs
    access_bytes: float         # per step: bytes the loads and stores name (predicated lanes counted)
    trips_known: bool           # every loop's trip count evaluated (else a loop counts once: a lower bound)
    arguments: int              # arguments a launch passes that are not constexprs (the host specialises each)
    local_accesses: int = 0     # STL / LDL instructions (spills, a stack frame's traffic), the most of any variant
    loop_local_accesses: int = 0   # of them inside a loop, the most of any variant: a spill each iteration pays

    def issue_floor_s(self, gpu=H100):
        """Seconds the step's warp-instructions of this kernel take at one a clock per scheduler on every SM."""
        return self.warp_instructions / (gpu["sms"] * gpu["schedulers"] * gpu["clock_hz"])


def hottest_loop(variant, ints):
    """Index of the loop whose body a thread executes the most instructions of (-1 for none)."""
    loops = variant.sass.loops
    trips, _ = loop_trips(variant, ints)
    work = [loop.instructions * executions(loops, trips, i) for i, loop in enumerate(loops)]
    return max(range(len(loops)), key=lambda i: work[i], default=-1)


def kernel_row(design, name, launches, variants):
    """The KernelRow of one kernel's launches in a step; variants: {launch key: Variant}."""
    used = [variants[x.key()] for x in launches]
    total = {"instructions": 0.0, "flops": 0.0, "memory": 0.0, "known": True, "dots": {}, "waves": 0, "programs": 0}
    by_variant = {}                                                   # launch key -> warp-instructions in the step
    for launch, variant in zip(launches, used):
        programs = math.prod(launch.grid)
        per_warp = programs * variant.warps * 32
        instructions, flops, memory, known = per_thread(variant, launch.ints)
        total["instructions"] += instructions * programs * variant.warps
        by_variant[launch.key()] = by_variant.get(launch.key(), 0.0) + instructions * programs * variant.warps
        total["flops"] += flops * per_warp
        total["memory"] += memory * per_warp
        total["known"] = total["known"] and known
        for kind, n in dot_flops(variant, launch.ints).items():
            total["dots"][kind] = total["dots"].get(kind, 0) + n * programs
        ctas = ctas_per_sm(variant.registers, variant.warps, variant.shared)
        total["waves"] = max(total["waves"], waves(programs, ctas))
        total["programs"] = max(total["programs"], programs)
    hot_launch = max(launches, key=lambda x: per_thread(variants[x.key()], x.ints)[0])
    hot = variants[hot_launch.key()]
    bulk_key = max(by_variant, key=by_variant.get)
    bulk = variants[bulk_key]
    loop = hottest_loop(hot, hot_launch.ints)
    body = hot.sass.loops[loop] if loop >= 0 else Loop(0, 0)
    return KernelRow(
        design=design, kernel=name.split(":")[1], variants=len({x.key() for x in launches}), launches=len(launches),
        registers=bulk.registers, spills=max(v.local + v.stack for v in used), shared=bulk.shared, warps=bulk.warps,
        ctas_per_sm=ctas_per_sm(bulk.registers, bulk.warps, bulk.shared),
        worst_ctas_per_sm=min(ctas_per_sm(v.registers, v.warps, v.shared) for v in used),
        bulk_launches=sum(x.key() == bulk_key for x in launches), programs=total["programs"],
        waves=total["waves"], async_copies=max(v.async_ttgir + v.sass.async_copies for v in used),
        loads=hot.sass.loads, loop_instructions=body.instructions, loop_barriers=body.barriers,
        warp_instructions=total["instructions"], fp32_flops=total["flops"], dot_flops=total["dots"],
        access_bytes=total["memory"], trips_known=total["known"],
        arguments=sum(kind != "constexpr" for kind in hot_launch.signature.values()),
        local_accesses=max(sum(v.sass.local.values()) for v in used),
        loop_local_accesses=max(sum(n for where, n in v.sass.local.items() if where >= 0) for v in used))


def probe_design(design, shape, tools, variants, log=print):
    """[KernelRow] of `design`'s Triton kernels in one step at `shape`; variants: the compile cache (shared by the
    designs: HC and mHC launch some kernels alike)."""
    launches = record(design, shape)
    if not launches:
        raise ProbeError(f"{design}'s step launched no Triton kernel (is its GPU path wired to ops.namespace?)")
    by_kernel = {}
    for launch in launches:
        by_kernel.setdefault(launch.kernel, []).append(launch)
        if launch.key() not in variants:
            log(f"kernel_probe: compiling {launch.kernel.split(':')[1]} for sm_90 ({design})")
            variants[launch.key()] = probe_variant(launch, tools)
    return [kernel_row(design, name, group, variants) for name, group in by_kernel.items()]


# ----------------------------------------------------------------------------- host time (the child process)

def fastest_step_ms(net, idx, warmup, repeats):
    """The fastest of `repeats` training steps of `net` in ms, after `warmup` untimed ones (the launches stubbed by
    the caller), in this process's CPU time (time.process_time, one thread). The fastest, not the median: other work
    on a shared machine only ever adds to a step (caches, the cores' clocks), so the minimum is the estimate of the
    step's own cost that varies least (the median of 5 moved Pre-LN's compiled step from 9 to 15 ms with the load)."""
    import time
    for _ in range(warmup):
        step(net, idx)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        step(net, idx)
        times.append(time.process_time() - start)
    return 1e3 * min(times)


def eager_ms(design, shape, repeats=7):
    """The fastest ms (fastest_step_ms) of one eager training step of `design` with every Triton launch a no-op and
    the branches stand-ins: the host's Python and eager torch work of its path (at a tiny token count, where the
    tensor work is small)."""
    net, idx = build(design, shape)
    with Stubbed(record=False):
        return fastest_step_ms(net, idx, warmup=1, repeats=repeats)


def compiled_ms(design, shape, repeats=15):
    """(the fastest ms of one training step of `design` compiled as train.py compiles it on a GPU, CPU seconds the
    compiling took, graphs dynamo compiled for the step, graph breaks it met): compile_model's per-block scope with inductor (here generating CPU code), the launches no-ops
    and the branches stand-ins as in eager_ms. Bodies that are ops (kernels.IN_GRAPH) are nodes of the block's
    graph; the others are torch.compiler.disable under the interpreter, graph breaks as they would be on a GPU. The
    backbone's remaining torch work (norms, casts, the stand-ins' reshapes, the weights' GEMMs at HOST_SHAPE) runs
    as inductor's CPU code: tiny, and paid alike by Pre-LN, whose step the model subtracts."""
    import time
    import torch
    from torch._dynamo.utils import counters
    from depthbench.training.compiled import compile_model
    net, idx = build(design, shape)
    torch._dynamo.reset()
    counters.clear()
    with Stubbed(record=False):
        start = time.process_time()
        compile_model(net, "blocks")
        step(net, idx)                        # compiles every block's forward and backward (the first reused)
        compile_s = time.process_time() - start
        ms = fastest_step_ms(net, idx, warmup=2, repeats=repeats)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return ms, compile_s, graphs, breaks


def graphs_per_block(design, shape):
    """(graphs, graph breaks) torch._dynamo.explain finds in block 1 of `design` (block 0 run eagerly first, so the
    state is what a middle block receives); the count does not depend on the width or the token count."""
    import torch
    import ops
    net, idx = build(design, {**shape, "layers": 2})
    with Stubbed(record=False), torch.no_grad():
        s = net.res.init_stream(net.wte(idx))
        rope = ops.rope_cos_sin(idx.size(1), net.cfg.head_dim, net.cfg.rope_theta, idx.device)
        sites = net.res.sites
        s = net.blocks[0](s, (sites[0], sites[1]), net.res, rope)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(net.blocks[1])(s, (sites[2], sites[3]), net.res, rope)
    return explained.graph_count, explained.graph_break_count


def launch_costs(repeats=20000):
    """(us a launch's Python path takes with a no-op kernel, us the JIT's specialisation of one argument takes):
    the two host costs of a launch measurable without a GPU (jit_specialisation is what JITFunction.run's binder
    calls per argument)."""
    import time
    import torch
    from triton.runtime.jit import KernelInterface

    class NoOp(KernelInterface):
        def run(self, *args, grid, warmup, **kwargs):
            return None

    kernel, t = NoOp(), torch.zeros(16)
    start = time.process_time()
    for _ in range(repeats):
        kernel[(1,)](t, 16, x=t)
    launch = (time.process_time() - start) / repeats
    specialise = jit_specialisation()
    start = time.process_time()
    for _ in range(repeats):
        specialise(t)
        specialise(4096)
    return 1e6 * launch, 1e6 * (time.process_time() - start) / (2 * repeats)


def break_cost_us(repeats=300):
    """us one graph break adds to a compiled call on this CPU: a function compiled (backend "eager") with a break
    in the middle against the same without."""
    import time
    import torch

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    def whole(x):
        return (x + 1) * 2

    x, timing = torch.zeros(4), []
    for fn in (torch.compile(broken, backend="eager"), torch.compile(whole, backend="eager")):
        fn(x)
        start = time.process_time()
        for _ in range(repeats):
            fn(x)
        timing.append((time.process_time() - start) / repeats)
    return 1e6 * (timing[0] - timing[1])


def host_child(designs, shape, path):
    """The host-time child's work (TRITON_INTERPRET=1): per design and Pre-LN at `shape` (the card's depth, few
    tokens) the eager and the per-block compiled step's ms, graphs and breaks per block, the launch and break costs
    -> JSON at `path`. Every design's graphs are counted before anything is compiled (compile_model sets dynamo's
    nested graph breaks for the process, which would change explain's count for the designs after the first)."""
    import torch
    torch.set_num_threads(1)          # CPU time of this process is the host's work, whatever else the machine runs
    out = {"shape": shape, "designs": {}}
    for design in ["preln", *designs]:
        graphs, breaks = graphs_per_block(design, shape)
        out["designs"][design] = {"graphs_per_block": graphs, "breaks_per_block": breaks}
    for design in ["preln", *designs]:
        eager = eager_ms(design, shape)
        compiled, compile_s, graphs, breaks = compiled_ms(design, shape)
        out["designs"][design].update(eager_ms=eager, compiled_ms=compiled, compile_s=compile_s,
                                      compiled_graphs=graphs, compiled_breaks=breaks)
    out["launch_us"], out["per_argument_us"] = launch_costs()
    out["break_us"] = break_cost_us()
    Path(path).write_text(json.dumps(out))
    return 0


def in_child(flag, designs, shape, timeout=3600):
    """Run this script with `flag` in a child process under TRITON_INTERPRET=1 -> its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        command = [sys.executable, __file__, flag, ",".join(designs), "--json", str(path),
                   *[f"--{k}={v}" for k, v in shape.items()]]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise ProbeError(f"{flag} {','.join(designs)} failed: {' '.join(done.stderr.strip().splitlines()[-1:])}")
        return json.loads(path.read_text())


# ----------------------------------------------------------------------------- depth extrapolation

EXTRAPOLATED = ("launches", "warp_instructions", "fp32_flops", "access_bytes")


def through(points, x):
    """The polynomial through `points` [(x_i, y_i)] (Lagrange) at x."""
    total = 0.0
    for i, (xi, yi) in enumerate(points):
        term = yi
        for j, (xj, _) in enumerate(points):
            if j != i:
                term *= (x - xj) / (xi - xj)
        total += term
    return total


def extrapolate(rows_at, layers):
    """[KernelRow] at depth `layers` from {depth: [KernelRow]} recorded at a few small depths: each per-step total
    (EXTRAPOLATED, and the dots' FLOPs) by the polynomial through them (3 depths: a quadratic, as a design whose
    consumer at depth b reads O(b) sources sums to); the compiled facts from the deepest recording."""
    depths = sorted(rows_at)
    deepest = {(r.design, r.kernel): r for r in rows_at[depths[-1]]}
    out = []
    for key, row in deepest.items():
        seen = {d: next((r for r in rows_at[d] if (r.design, r.kernel) == key), None) for d in depths}
        fields = {}
        for name in EXTRAPOLATED:
            fields[name] = through([(d, getattr(r, name) if r else 0) for d, r in seen.items()], layers)
        fields["launches"] = round(fields["launches"])
        fields["bulk_launches"] = fields["launches"] - (row.launches - row.bulk_launches)   # the others: as recorded
        kinds = {k for r in seen.values() if r for k in r.dot_flops}
        fields["dot_flops"] = {k: through([(d, r.dot_flops.get(k, 0) if r else 0) for d, r in seen.items()], layers)
                               for k in kinds}
        out.append(KernelRow(**{**asdict(row), **fields}))
    return out


# ----------------------------------------------------------------------------- the command

def ctas_column(row):
    """CTAs per SM of the bulk variant, and where another variant fits fewer, theirs with its launches: "2 (1 x 1)"."""
    if row.worst_ctas_per_sm == row.ctas_per_sm:
        return str(row.ctas_per_sm)
    return f"{row.ctas_per_sm} ({row.worst_ctas_per_sm} x {row.launches - row.bulk_launches})"


def report(rows, host=None):
    """The probe's table (one row per design and kernel) and, with `host`, the host-time lines."""
    print("| design | kernel | launches | regs x warps | stack+local B (STL/LDL, in loops) | shared KB | CTAs/SM | "
          "programs | waves | async copies | loads (bits: LDGs) | loop instr / barriers | warp-instr / step | issue "
          "floor ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        loads = " ".join(f"{bits}: {n}" for bits, n in sorted(r.loads.items(), key=lambda x: -int(x[0])))
        floor = f"{1e3 * r.issue_floor_s():.2f}" + ("" if r.trips_known else " (>=)")
        print(f"| {r.design} | {r.kernel} | {r.launches} | {r.registers} x {r.warps} | {r.spills} "
              f"({r.local_accesses}, {r.loop_local_accesses}) | "
              f"{r.shared / 1024:.1f} | {ctas_column(r)} | {r.programs:,} | {r.waves} | {r.async_copies} | {loads} | "
              f"{r.loop_instructions} / {r.loop_barriers} | {r.warp_instructions / 1e9:.2f} G | {floor} |")
    if host:
        print(f"host (this CPU, launches no-ops): a launch's Python path {host['launch_us']:.2f} us + "
              f"{host['per_argument_us']:.3f} us an argument specialised; a graph break {host['break_us']:.1f} us")
        for design, h in host["designs"].items():
            print(f"  {design}: eager step {h['eager_ms']:.1f} ms, compiled per block {h['compiled_ms']:.1f} ms "
                  f"(compiled in {h['compile_s']:.0f} s: {h['compiled_graphs']} graphs, {h['compiled_breaks']} breaks"
                  f") at L{host['shape']['layers']} "
                  f"d{host['shape']['width']} B{host['shape']['batch']} T{host['shape']['seq']}; "
                  f"{h['graphs_per_block']} graphs, {h['breaks_per_block']} breaks a block")


def parse(argv):
    p = ArgParser(prog="kernel_probe.py", description="Every Triton kernel a design's step launches, compiled for "
                  "sm_90 on this CPU at the shapes the launch passes (see the module docstring).")
    p.add_argument("--designs", default=",".join(DESIGNS), help=f"comma-separated, of {', '.join(DESIGNS)}")
    for key, value in CARD.items():
        p.add_argument(f"--{key}", type=int, default=value, help=f"default {value} (the card's)")
    p.add_argument("--host-seq", type=int, default=8, help="tokens a sequence for the host-time runs (default 8: "
                   "the host's work, not the tensors'; their width is 64, 4 heads: HOST_SHAPE)")
    p.add_argument("--no-host", action="store_true", help="skip the host-time runs")
    p.add_argument("--host-only", action="store_true", help="only the host-time runs (no recording, no compiling)")
    p.add_argument("--fit-depths", help="record at these depths (comma-separated, e.g. 2,3,4) and extrapolate each "
                   "kernel's step totals to --layers by the polynomial through them (a step too large to record at "
                   "--layers on this machine); default: record at --layers")
    p.add_argument("--tools", help="folder holding ptxas and cuobjdump (default: the Triton wheel's)")
    p.add_argument("--json", help="write every row here (scripts/roofline.py --probe reads it)")
    p.add_argument("--record-child", help=argparse_hidden())
    p.add_argument("--host-child", help=argparse_hidden())
    args = p.parse_args(argv)
    args.designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    unknown = sorted(set(args.designs) - set(DESIGNS) - {"preln"})
    if unknown or not args.designs:
        p.error(f"--designs: {', '.join(unknown) or 'none given'} (choose from {', '.join(DESIGNS)})")
    if min(getattr(args, k) for k in CARD) < 1 or args.host_seq < 1:
        p.error("--layers, --width, --heads, --batch, --seq and --host-seq must be >= 1")
    try:
        args.fit_depths = sorted({int(x) for x in (args.fit_depths or "").split(",") if x.strip()})
    except ValueError:
        p.error(f"--fit-depths {args.fit_depths!r}: comma-separated integers")
    if args.host_only and args.no_host:
        p.error("--host-only and --no-host: one or the other")
    if args.fit_depths and (len(args.fit_depths) < 2 or min(args.fit_depths) < 1):
        p.error("--fit-depths: at least two depths, each >= 1")
    if args.width % args.heads:
        p.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    return args


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


def run(args):
    """Probe every design asked -> the JSON document (shape, rows, host, the depths fitted)."""
    shape = {k: getattr(args, k) for k in CARD}
    designs = [d for d in args.designs if d != "preln"]
    doc = {"shape": shape, "gpu": H100, "rows": [], "host": None, "fit_depths": args.fit_depths}
    if not args.host_only:
        doc["rows"] = [asdict(r) for r in probe_rows(designs, shape, args)]
    if not args.no_host:
        doc["host"] = in_child("--host-child", designs, {**shape, **HOST_SHAPE, "seq": args.host_seq})
    return doc


def probe_rows(designs, shape, args):
    """[KernelRow] of every design: recorded at --layers, or at --fit-depths and extrapolated."""
    tools = find_tools(args.tools)
    rows, variants = [], {}
    log = lambda line: print(line, file=sys.stderr)   # noqa: E731  (progress on stderr, the table on stdout)
    for design in designs:
        if not args.fit_depths:
            rows += probe_design(design, shape, tools, variants, log=log)
            continue
        rows_at = {L: probe_design(design, {**shape, "layers": L}, tools, variants, log=log) for L in args.fit_depths}
        rows += extrapolate(rows_at, shape["layers"])
    return rows


def main(argv=None):
    args = parse(argv)
    if not (args.record_child or args.host_child):
        os.environ["TRITON_INTERPRET"] = "0"      # this process compiles (triton not imported yet); children record
    shape = {k: getattr(args, k) for k in CARD}
    if args.record_child:
        return record_child(args.record_child.split(","), shape, args.json)
    if args.host_child:
        return host_child(args.host_child.split(","), shape, args.json)
    try:
        doc = run(args)
    except ProbeError as error:
        print(f"kernel_probe.py: {error}", file=sys.stderr)
        return 2
    report([KernelRow(**r) for r in doc["rows"]], doc["host"])
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
