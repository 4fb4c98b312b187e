"""
depthbench/kernels/graph_ops.py: the Triton bodies' host functions as torch.library custom ops, so that torch.compile
keeps a block's read, mix and write in its graph instead of breaking it there (issue 68, item 4).

Each host function (its launches unchanged) becomes an op `torch.ops.depthbench.<name>` with a fixed schema and a
shape-only fake body: dynamo and AOT autograd put one opaque node in the graph and never trace the launch (on the
CPU the launch is Triton's interpreter, numpy code dynamo cannot trace; on a GPU the kernel's own compiled code). A
body's gradient is a second op, called by the function `register_autograd` gets, so a compiled backward has no
break either. The Python state of a body (sizes, dtypes) is recomputed from the ops' tensors, never carried past
them.

Why torch.library.custom_op and not triton_op: triton_op's fake body is the host function itself with every launch
through `wrap_triton`, which under the interpreter hands back the bare kernel, so tracing launches it on fake tensors
and fails; and the tests import the Triton modules once for the GPU and again, reloaded, for the interpreter, while
an op's name can be registered only once a process. So an op here is registered once, under its name, and calls
the newest host function registered under that name (`_BODIES`): a module reloaded for the interpreter replaces its
host functions, the op stays. Inductor runs such an op as one call into Python (the host function as in eager);
triton_op would let it launch the kernels from its own wrapper, a few microseconds less per launch (not measurable
without a GPU; see docs/speed.md#compile).
"""
import torch

NAMESPACE = "depthbench"
_BODIES = {}   # op name -> the host function its op calls now (a reloaded module's replaces the first one's)
_OPS = {}      # (the host function's module, name) -> (op name, its op: torch.library.custom_op's CustomOpDef)


def graph_op(name, schema, fake):
    """A decorator: host function fn -> the op torch.ops.depthbench.<name>(schema), running fn (the newest one
    registered under name by fn's module), and `fake` (same arguments: empty outputs of the right shapes, dtypes
    and devices) when traced. No op here writes to its inputs (mutates_args empty): every output is a new tensor.
    A second module of the same file (a test's copy, under another module name) gets ops of its own (name_<k>)."""
    def register(fn):
        key = (fn.__module__, name)
        if key not in _OPS:
            opname = f"{name}_{len(_OPS)}" if name in _BODIES else name

            def run(*args):
                return _BODIES[opname](*args)
            op = torch.library.custom_op(f"{NAMESPACE}::{opname}", run, mutates_args=(), schema=schema)
            op.register_fake(fake)
            _OPS[key] = opname, op
        opname, op = _OPS[key]
        _BODIES[opname] = fn
        return op
    return register

def host_function(op):
    """The host function an op of this namespace (an OpOverload, as a dispatch mode sees it) runs now: a tool that
    records the torch ops inside it calls this under its mode (calling the op there would dispatch to the mode
    again)."""
    return _BODIES[op._opname]


def keep(ctx, tensors, **attributes):
    """A setup_context's work (torch.library's register_autograd): save `tensors` for the backward and set the
    attributes (sizes, dtypes: Python values the backward needs, fixed when the graph is traced)."""
    ctx.save_for_backward(*tensors)
    for name, value in attributes.items():
        setattr(ctx, name, value)
