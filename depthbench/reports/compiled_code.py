"""
What the compiler built for one Triton kernel, read as text (scripts/kernel_probe.py compiles; this module reads):
cuobjdump's SASS (the loops as backward branches, each body's instructions, barriers, fp instructions and global
memory widths), the TTIR (each scf.for's bounds, evaluated at a launch's int arguments, and the tl.dot shapes), and
the H100 arithmetic on them (CTAs per SM, waves, instructions a thread executes). No triton or torch import: text in,
numbers out (tests/test_probe.py checks it on hand-written SASS and TTIR).
"""
import math
import re
from dataclasses import dataclass, field

# An H100 SXM (sm_90): the budgets a CTA draws on, and the issue rate (4 schedulers an SM, one warp-instruction a
# clock each, at the ~1.755 GHz an H100 SXM holds under load)
H100 = {"sms": 132, "schedulers": 4, "clock_hz": 1.755e9, "registers": 65536, "shared": 228 * 1024,
        "shared_reserved": 1024, "warps": 64, "ctas": 32}
DOT_KIND = {"bf16": "bf16", "f16": "bf16", True: "fp32", False: "tf32"}  # a dot's inputs (fp32: by its precision)
FLOP_WEIGHT = {"FFMA": 2, "FADD": 1, "FMUL": 1, "HFMA2": 4, "HADD2": 2, "HMUL2": 2}   # fp32 / packed-16-bit lanes


@dataclass
class Loop:
    start: int                  # SASS address of the loop's first instruction
    end: int                    # address of its backward branch
    instructions: int = 0       # its body's instructions, its inner loops' left out
    barriers: int = 0           # BAR.* in that body
    parent: int = -1            # index of the innermost loop around it, -1 for none


@dataclass
class Sass:
    outside: int                # instructions outside every loop (up to the last EXIT)
    loops: list                 # [Loop], by start address
    loads: dict                 # global load width in bits -> instructions (LDG; LDGSTS counted as async)
    async_copies: int           # LDGSTS / UTMALDG instructions inside loops
    flops: dict                 # {loop index (-1: outside loops): {fp opcode: count}}
    memory: dict                # {loop index (-1: outside): global bytes a thread loads or stores there}
    local: dict = field(default_factory=dict)   # {loop index (-1: outside): STL / LDL instructions (local memory:
                                                # spills, or a stack frame's traffic)}


INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def parse_sass(text):
    """[(address, opcode, operands)] of cuobjdump -sass's instructions, NOPs and the trailing self-branch left out."""
    out = []
    for match in INSTRUCTION.finditer(text):
        address, opcode, operands = int(match.group(1), 16), match.group(3), match.group(4)
        if opcode == "NOP":
            continue
        out.append((address, opcode, operands.strip()))
    last_exit = max((i for i, (_, op, _) in enumerate(out) if op == "EXIT"), default=len(out) - 1)
    return out[:last_exit + 1]


def sass_loops(instructions):
    """[Loop] of the backward branches, nested by address range (the innermost loop around each is its parent)."""
    loops = []
    for address, opcode, operands in instructions:
        target = re.match(r"(0x[0-9a-f]+)", operands)
        if opcode.startswith("BRA") and target and int(target.group(1), 16) < address:
            loops.append(Loop(int(target.group(1), 16), address))
    loops.sort(key=lambda x: (x.start, -x.end))
    for i, loop in enumerate(loops):
        around = [j for j, o in enumerate(loops) if j != i and o.start <= loop.start and loop.end <= o.end]
        loop.parent = max(around, key=lambda j: loops[j].start, default=-1)
    return loops


def innermost(loops, address):
    """Index of the innermost loop holding `address`, -1 for none."""
    holding = [i for i, x in enumerate(loops) if x.start <= address <= x.end]
    return max(holding, key=lambda i: loops[i].start, default=-1)


def read_sass(text):
    """Sass: per-loop bodies, barriers, load widths, async copies, fp instructions and local memory accesses, of one
    kernel's SASS."""
    instructions = parse_sass(text)
    loops = sass_loops(instructions)
    outside, loads, async_copies, flops, memory, local = 0, {}, 0, {}, {}, {}
    for address, opcode, _ in instructions:
        where = innermost(loops, address)
        if where < 0:
            outside += 1
        else:
            loops[where].instructions += 1
            loops[where].barriers += opcode.startswith("BAR")
            async_copies += opcode.startswith(("LDGSTS", "UTMALDG", "UBLKCP"))
        if opcode.startswith("LDG") and not opcode.startswith("LDGSTS"):
            loads[width_bits(opcode)] = loads.get(width_bits(opcode), 0) + 1
        if opcode.startswith(("LDG", "STG", "RED", "ATOMG")):
            memory[where] = memory.get(where, 0) + width_bits(opcode) // 8
        if opcode.startswith(("STL", "LDL")):
            local[where] = local.get(where, 0) + 1
        base = opcode.split(".")[0]
        if base in FLOP_WEIGHT:
            flops.setdefault(where, {}).setdefault(base, 0)
            flops[where][base] += 1
    return Sass(outside=outside, loops=loops, loads=loads, async_copies=async_copies, flops=flops, memory=memory,
                local=local)


def width_bits(opcode):
    """Bits a thread loads in one LDG: .128 / .64 / .U16 / .U8 ... (none: 32)."""
    for suffix, bits in ((".128", 128), (".64", 64), (".U16", 16), (".S16", 16), (".U8", 8), (".S8", 8)):
        if suffix in opcode:
            return bits
    return 32


# ----------------------------------------------------------------------------- the TTIR: loop bounds and dots

SCALAR = re.compile(r"^\s*(%[\w.#]+) = arith\.(\w+) (.*?) : (i32|i64)(?: to i(?:32|64))?\s+loc")
PROGRAM = re.compile(r"^\s*(%[\w.#]+) = tt\.get_program_id")
FOR = re.compile(r"scf\.for (%[\w.]+) = (%[\w.]+) to (%[\w.]+) step (%[\w.]+)")
DOT = re.compile(r"tt\.dot .*?: tensor<(\d+)x(\d+)x(\w+)> \* tensor<\d+x(\d+)x\w+> -> tensor<[^>]*>")
BINARY = {"addi": lambda a, b: a + b, "subi": lambda a, b: a - b, "muli": lambda a, b: a * b,
          "divsi": lambda a, b: int(a / b), "divui": lambda a, b: a // b, "ceildivsi": lambda a, b: -(-a // b),
          "remsi": lambda a, b: a - b * int(a / b), "minsi": min, "maxsi": max, "minui": min, "maxui": max}


@dataclass
class TtirLoop:
    bounds: tuple               # (lower, upper, step) SSA names
    parent: int                 # index of the scf.for around it, -1 for none
    dots: list = field(default_factory=list)   # [(M, N, K, element type, precision)] directly in its body


def read_ttir(text):
    """([TtirLoop] in textual order, [(M, N, K, dtype, precision)] of the dots outside loops, {SSA: definition})."""
    loops, dots_outside, definitions, stack = [], [], {}, []
    for line in text.splitlines():
        scalar = SCALAR.match(line)
        if scalar:
            definitions[scalar.group(1)] = (scalar.group(2), scalar.group(3))
        program = PROGRAM.match(line)
        if program:                               # the first program's: a grid-stride loop's most trips
            definitions[program.group(1)] = ("constant", "0")
        loop = FOR.search(line)
        dot = DOT.search(line)
        if dot:
            precision = re.search(r"inputPrecision = (\w+)", line)
            shape = (int(dot.group(1)), int(dot.group(4)), int(dot.group(2)), dot.group(3),
                     precision.group(1) if precision else "tf32")
            enclosing = [i for i in stack if i is not None]
            (loops[enclosing[-1]].dots if enclosing else dots_outside).append(shape)
        closes = line.strip().startswith("}")
        if closes and stack:
            stack.pop()
        if line.rstrip().endswith("{"):
            if loop:
                enclosing = [i for i in stack if i is not None]
                loops.append(TtirLoop(loop.group(2, 3, 4), enclosing[-1] if enclosing else -1))
                stack.append(len(loops) - 1)
            else:
                stack.append(None)
    return loops, dots_outside, definitions


def evaluate(name, definitions, ints, depth=0):
    """The integer value of SSA `name` from the kernel's int arguments (`%D` is parameter D), constants, program ids
    (read_ttir takes them as 0: the first program, which a grid-stride loop gives the most trips) and scalar
    arithmetic; None where it depends on anything else (a load, an induction variable)."""
    if name[1:] in ints:
        return ints[name[1:]]
    if name not in definitions or depth > 50:
        return None
    op, operands = definitions[name]
    if op == "constant":
        return int(operands) if re.fullmatch(r"-?\d+", operands) else None
    parts = [p.strip() for p in operands.split(",")]
    values = [evaluate(p, definitions, ints, depth + 1) for p in parts]
    if any(v is None for v in values):
        return None
    if op in ("extsi", "extui", "trunci", "index_cast"):
        return values[0]
    if op in BINARY and len(values) == 2 and (values[1] or op not in ("divsi", "divui", "ceildivsi", "remsi")):
        return BINARY[op](*values)
    return None


def trip_count(loop, definitions, ints):
    """Iterations of an scf.for at these int arguments (None where a bound is not known)."""
    lower, upper, step = (evaluate(x, definitions, ints) for x in loop.bounds)
    if None in (lower, upper, step) or step <= 0:
        return None
    return max(0, -(-(upper - lower) // step))


def match_loops(sass, ttir_loops, definitions):
    """{SASS loop index: TTIR loop index}: in order where the counts agree, else after leaving out the TTIR loops
    with constant bounds (the compiler unrolls those), else {} (the trips are then taken as 1: a lower bound)."""
    if len(sass.loops) == len(ttir_loops):
        return dict(enumerate(range(len(ttir_loops))))
    dynamic = [i for i, x in enumerate(ttir_loops) if trip_count(x, definitions, {}) is None]
    if len(sass.loops) == len(dynamic):
        return dict(enumerate(dynamic))
    return {}


@dataclass
class Variant:
    """One compiled specialisation of a kernel and what the compiler says of it."""
    kernel: str
    registers: int
    stack: int                  # bytes of stack a thread
    local: int                  # bytes of local memory a thread: spills (with stack)
    shared: int                 # bytes of shared memory a CTA
    warps: int
    stages: int
    sass: Sass
    ttir_loops: list
    ttir_dots: list             # dots outside loops
    definitions: dict
    matched: dict               # SASS loop -> TTIR loop
    async_ttgir: int            # async_copy_global_to_local in the TTGIR


def resource_usage(text):
    """{REG, STACK, SHARED, LOCAL} of cuobjdump --dump-resource-usage's one function."""
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def ctas_per_sm(registers, warps, shared, gpu=H100):
    """CTAs an SM holds (module docstring): registers per thread rounded up to 8, each limit floored."""
    by_registers = gpu["registers"] // (8 * math.ceil(max(registers, 1) / 8) * 32 * warps)
    by_shared = gpu["shared"] // (shared + gpu["shared_reserved"])
    return min(by_registers, by_shared, gpu["warps"] // warps, gpu["ctas"])


def waves(programs, ctas, gpu=H100):
    """Rounds of CTAs the grid takes on the GPU's SMs."""
    return math.ceil(programs / (gpu["sms"] * max(ctas, 1)))


def loop_trips(variant, ints):
    """[per-entry trips of each SASS loop] at these int arguments (1 where unmatched or unknown) and whether every
    one was known."""
    trips, known = [], bool(variant.matched) or not variant.sass.loops
    for i in range(len(variant.sass.loops)):
        n = trip_count(variant.ttir_loops[variant.matched[i]], variant.definitions, ints) if i in variant.matched \
            else None
        known = known and n is not None
        trips.append(1 if n is None else n)
    return trips, known


def executions(loops, trips, i):
    """How many times a thread runs loop i's body: its trips x those of every loop around it."""
    count = 1
    while i >= 0:
        count *= trips[i]
        i = loops[i].parent
    return count


def per_thread(variant, ints):
    """(SASS instructions a thread executes, its fp32 FLOPs, the global bytes its loads and stores name (predicated
    lanes counted: an upper bound), whether every trip count was known) at a launch's int arguments."""
    loops = variant.sass.loops
    trips, known = loop_trips(variant, ints)
    runs = {i: executions(loops, trips, i) for i in range(len(loops))}
    instructions = variant.sass.outside + sum(loop.instructions * runs[i] for i, loop in enumerate(loops))
    runs[-1] = 1
    flops = sum(sum(FLOP_WEIGHT[op] * n for op, n in counts.items()) * runs[where]
                for where, counts in variant.sass.flops.items())
    memory = sum(nbytes * runs[where] for where, nbytes in variant.sass.memory.items())
    return instructions, flops, memory, known


def dot_flops(variant, ints):
    """{"bf16" | "tf32" | "fp32": FLOPs a program does in tl.dot} at a launch's int arguments ("ieee" fp32 dots run
    on CUDA cores and are in the SASS' FFMAs as well: kept apart here, never added twice)."""
    out = {}
    ttir_trips = []
    for loop in variant.ttir_loops:
        n = trip_count(loop, variant.definitions, ints)
        ttir_trips.append(1 if n is None else n)
    sites = [(variant.ttir_dots, 1)]
    for i, loop in enumerate(variant.ttir_loops):
        count, j = 1, i
        while j >= 0:
            count *= ttir_trips[j]
            j = variant.ttir_loops[j].parent
        sites.append((loop.dots, count))
    for dots, count in sites:
        for M, N, K, dtype, precision in dots:
            kind = DOT_KIND.get(dtype) or DOT_KIND[precision == "ieee"]
            out[kind] = out.get(kind, 0) + 2 * M * N * K * count
    return out
