"""
Whether a design's training step can be recorded as one CUDA graph and replayed (depthbench/training/compiled.py
`capture_step`, profile_gpu.py --compile capture), checked on the CPU (issue 68: the host's time per step).

    python scripts/capture_check.py                        # every design, eager and compiled, L4 d64 B2 T16
    python scripts/capture_check.py --designs hc,attnres --layers 6 --steps 4

A replay launches what the captured step launched, with the same arguments and the same memory, and runs none of
the step's Python. So a step can be replayed in place of running it when
  1. it never waits for the GPU: no op whose result the host reads (.item(), bool() or int() of a tensor: aten's
     _local_scalar_dense; a shape that depends on data: nonzero, masked_select, unique, a boolean index, a
     repeat_interleave by a tensor) and no tensor made from Python data inside the step (torch.tensor: a copy from
     the host's memory, aten's lift_fresh);
  2. it launches the same Triton kernels every step, in the same order, with the same grids and the same arguments
     as the JIT sees them (dtypes, 16-byte alignment, integers, constexprs, launch options).
Each design's Triton path (kernels "triton") runs `--steps` training steps under TRITON_INTERPRET=1, eager and
compiled per block as profile_gpu.py --compile capture compiles them (`--modes`; inductor generates CPU code here),
every launch recorded and none run (scripts/kernel_probe.py's Stubbed, the backbone's branches its stand-ins), every
aten op of the steps after the first watched by a dispatch mode. The first step is the warm-up, as capture_step's
are: what it creates once (a compile, a cache, the gradients) is neither recorded in a graph nor compared. Compiled,
an op's host function (HC's and mHC's read and write) runs inside its node, where the dispatch mode does not see;
the eager steps run the same host functions in its sight.

What it cannot see: a copy between devices (every tensor is on the CPU here), a `.tolist()` of a CPU tensor (it
dispatches no op), and work outside the step (the optimizer, the data): capture_step records the forward and the
backward only. Exit 0 when every design passes, 1 when one fails (each failure one line), 2 for bad arguments or
without triton.
"""
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root
sys.path.insert(0, str(ROOT / "scripts"))
from depthbench.files.common import ArgParser, comma_list  # noqa: E402

DESIGNS = ["preln", "hc", "mhc", "attnres", "block_attnres", "moda"]
MODES = ("eager", "compiled")
SHAPE = {"layers": 4, "width": 64, "heads": 4, "batch": 2, "seq": 16}
# aten ops after which the host holds a value the GPU computed (it must wait for it), or whose output's shape does
# (the allocation waits for the GPU); and lift_fresh, torch.tensor's copy of Python data into a tensor
WAITING_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::allclose",
               "aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select", "aten::_unique",
               "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
               "aten::lift_fresh", "aten::lift_fresh_copy"}
LAUNCH_PARTS = ("kernel", "grid", "signature", "constexprs", "aligned", "ints", "options")   # kernel_probe.Launch's
BOOLEAN_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


@dataclass
class Verdict:
    design: str
    steps: int                                      # steps run, the first a warm-up
    launches: list = field(default_factory=list)    # per step after the warm-up, its Triton launches' count
    waits: dict = field(default_factory=dict)       # aten op -> times a compared step waited on the GPU for it
    difference: str = ""                            # the first launch that differs between two steps ("": none;
                                                    # steps numbered as run, 1 the warm-up)
    compiled: bool = False                          # the blocks compiled (else eager)

    @property
    def replayable(self):
        return not self.waits and not self.difference


def waiting(func, args, kwargs):
    """The aten op's name where running it makes the host wait for the GPU (WAITING_OPS; an index or index_put by
    a boolean mask; repeat_interleave by a tensor of repeats without output_size), else None."""
    import torch
    name = func._schema.name
    if name in WAITING_OPS:
        return name
    if name in BOOLEAN_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return f"{name} (a boolean mask)"
    if name == "aten::repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) < 2:
        if (kwargs or {}).get("output_size") is None:
            return f"{name} (repeats from a tensor)"
    return None


def watcher():
    """A TorchDispatchMode counting the ops of `waiting` in `.waits` (op -> count)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Waits(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.waits = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = waiting(func, args, kwargs or {})
            if name:
                self.waits[name] = self.waits.get(name, 0) + 1
            return func(*args, **(kwargs or {}))
    return Waits()


def first_difference(steps, first=2):
    """The first way the launch lists [[Launch]] of steps first, first + 1, ... differ from the first's, as one line
    ("" where every step launched the same kernels in the same order with the same grids, JIT specialisation and
    integer arguments)."""
    reference = steps[0]
    for number, launches in enumerate(steps[1:], start=first + 1):
        if len(launches) != len(reference):
            return f"step {number} launched {len(launches)} kernels, step {first} {len(reference)}"
        for k, (mine, theirs) in enumerate(zip(launches, reference)):
            for part in LAUNCH_PARTS:
                if getattr(mine, part) != getattr(theirs, part):
                    return (f"step {number}'s launch {k} ({mine.kernel.split(':')[-1]}) differs from step {first}'s "
                            f"in its {part}: {getattr(theirs, part)} -> {getattr(mine, part)}")
    return ""


def check(design, shape=SHAPE, steps=3, compiled=False):
    """The Verdict of `design`'s Triton path at `shape`: `steps` training steps (bf16 autocast), eager or (compiled)
    per block as profile_gpu.py --compile capture compiles them (inductor generating CPU code here), the first a
    warm-up (it compiles), the launches of the others compared and their waiting ops counted (the warm-up's, before
    the recording, would not be replayed). This process must run under TRITON_INTERPRET=1 (kernel_probe.Stubbed)."""
    import contextlib
    import kernel_probe
    from depthbench.training.compiled import compile_model
    net, idx = kernel_probe.build(design, shape)
    recorded, mode = [], watcher()
    with kernel_probe.Stubbed() as stub:
        if compiled:
            compile_model(net, "blocks")
        for number in range(steps):
            stub.launches = []
            with mode if number else contextlib.nullcontext():
                kernel_probe.step(net, idx)
            net.zero_grad(set_to_none=False)       # capture_step's caller keeps the gradients' tensors
            recorded.append(stub.launches)
    compared = recorded[1:]                       # step 1 is the warm-up
    return Verdict(design=design, steps=steps, launches=[len(x) for x in compared], waits=dict(mode.waits),
                   difference=first_difference(compared, first=2), compiled=compiled)


def line(verdict):
    """One line a design: replayable or why not."""
    launches = f"{verdict.launches[0]} Triton launches a step" if verdict.launches else "no step compared"
    name = f"{verdict.design} ({'compiled per block' if verdict.compiled else 'eager'})"
    if verdict.replayable:
        return f"{name}: replayable ({launches}, the same in {len(verdict.launches)} steps after a warm-up; no wait on " \
               f"the GPU)"
    why = [f"waits on the GPU at {op} x{n}" for op, n in sorted(verdict.waits.items())]
    why += [verdict.difference] if verdict.difference else []
    return f"{name}: NOT replayable: {'; '.join(why)}"


def parse(argv):
    p = ArgParser(prog="capture_check.py", description="Whether each design's training step can be captured as one "
                  "CUDA graph and replayed, checked on the CPU under Triton's interpreter (see the module docstring).")
    p.add_argument("--designs", default=",".join(DESIGNS), help=f"comma-separated, of {', '.join(DESIGNS)}")
    for key, value in SHAPE.items():
        p.add_argument(f"--{key}", type=int, default=value, help=f"default {value}")
    p.add_argument("--steps", type=int, default=3, help="training steps a design runs, the first a warm-up "
                   "(default 3: two compared)")
    p.add_argument("--modes", type=comma_list(str), default=list(MODES), help="eager, compiled (per block, as "
                   "profile_gpu.py --compile capture compiles), or both (the default), comma-separated")
    args = p.parse_args(argv)
    args.designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    unknown = sorted(set(args.designs) - set(DESIGNS))
    if unknown or not args.designs:
        p.error(f"--designs: {', '.join(unknown) or 'none given'} (choose from {', '.join(DESIGNS)})")
    if min(getattr(args, k) for k in SHAPE) < 1:
        p.error(f"--{', --'.join(SHAPE)} must be >= 1")
    if not args.modes or set(args.modes) - set(MODES):
        p.error(f"--modes {','.join(args.modes)}: of {', '.join(MODES)}")
    if args.steps < 3:
        p.error(f"--steps {args.steps}: at least 3 (a warm-up and two steps to compare)")
    if args.width % args.heads:
        p.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    return args


def main(argv=None):
    args = parse(argv)
    os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported: the kernels become interpretable
    try:
        import triton  # noqa: F401
    except ImportError:
        print("capture_check.py: triton does not import (pip install triton; its interpreter runs here)",
              file=sys.stderr)
        return 2
    shape = {k: getattr(args, k) for k in SHAPE}
    verdicts = [check(d, shape, steps=args.steps, compiled=mode == "compiled") for d in args.designs
                for mode in args.modes]
    for verdict in verdicts:
        print(line(verdict), flush=True)
    return 0 if all(v.replayable for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
