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

Eager calls skip the op (`autograd_op`, `call` in a backward): torch.library's Python layers (argument trees,
dispatch, its autograd wrapper) cost about as much host time as the body itself (docs/speed.md#compile), so outside
dynamo the same host function, setup_context and backward run as a plain torch.autograd.Function; inside dynamo
the op, so that the graph keeps it as one node.
"""
import torch

NAMESPACE = "depthbench"
_BODIES = {}   # op name -> the host function its op calls now (a reloaded module's replaces the first one's)
_OPS = {}      # (the host function's module, name) -> (op name, its op: torch.library.custom_op's CustomOpDef)
_NAMES = {}    # id of an op -> its op name (the key of _BODIES)


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
            _NAMES[id(op)] = opname
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


class EagerOp(torch.autograd.Function):
    """An op's host function with the op's setup_context and backward as a plain autograd.Function (`autograd_op`'s
    eager path). Its inputs are flat (autograd sees tensors only as direct arguments): `layout` says which of the
    op's arguments were lists (their length) and `flatten`/`unflatten` go between the two."""

    @staticmethod
    def forward(ctx, owner, layout, *leaves):
        args = unflatten(layout, leaves)
        output = _BODIES[owner.name](*args)
        owner.setup_context(ctx, args, output)
        ctx.owner, ctx.layout = owner, layout   # owner: the AutogradOp called
        return output

    @staticmethod
    def backward(ctx, *grads):
        gradients = ctx.owner.backward(ctx, *grads)
        return (None, None, *flatten(ctx.layout, gradients)[1])


def flatten(layout, args):
    """(layout: per argument None, or a list argument's length; the arguments with every list's items in place) for
    `args`; with `layout` given (not None), args' lists are flattened by it (a list's gradient None: None per item)."""
    layout = layout or tuple(len(a) if isinstance(a, (list, tuple)) else None for a in args)
    leaves = []
    for length, arg in zip(layout, args):
        if length is None:
            leaves.append(arg)
        elif arg is None:
            leaves.extend([None] * length)
        else:
            leaves.extend(arg)
    return layout, leaves


def unflatten(layout, leaves):
    """`flatten`'s arguments back: each list argument a list again."""
    args, at = [], 0
    for length in layout:
        if length is None:
            args.append(leaves[at])
            at += 1
        else:
            args.append(list(leaves[at:at + length]))
            at += length
    return args


class AutogradOp:
    """An op with its autograd, callable: the op itself while dynamo traces (torch.compiler.is_compiling(): one node
    in the graph, its backward op in the compiled backward) and EagerOp otherwise (the same host function, setup_context
    and backward without torch.library's Python layers: about half the host time of an eager call)."""
    __slots__ = ("op", "name", "backward", "setup_context")

    def __init__(self, op, backward, setup_context):
        self.op = op                            # the torch.library op (CustomOpDef)
        self.name = _NAMES[id(op)]              # its name in _BODIES: the host function both paths run
        self.backward = backward                # register_autograd's backward(ctx, *grads) -> a gradient per input
        self.setup_context = setup_context      # register_autograd's setup_context(ctx, inputs, output)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        layout, leaves = flatten(None, args)
        return EagerOp.apply(self, layout, *leaves)


def call(op, *args, **kwargs):
    """A backward's call of an op of this namespace: the op while compiling (AOT autograd traces the backward on
    fake tensors: its fake body), else its host function directly (no dispatch, as EagerOp's forward)."""
    if torch.compiler.is_compiling():
        return op(*args, **kwargs)
    return _BODIES[_NAMES[id(op)]](*args, **kwargs)


def autograd_op(op, backward, setup_context):
    """op.register_autograd(backward, setup_context=setup_context) -> AutogradOp: the op under torch.compile, the
    same functions as an autograd.Function in eager."""
    op.register_autograd(backward, setup_context=setup_context)
    return AutogradOp(op, backward, setup_context)
