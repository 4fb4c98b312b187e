"""
depthbench/kernels/graph_ops.py: the Triton bodies' host functions as operators of their own, so that torch.compile
keeps a block's read, mix and write in its graph instead of breaking it there (issue 68, item 4).

Each host function (its launches unchanged) becomes an op `torch.ops.depthbench.<name>` with a fixed schema and a
shape-only fake body: dynamo and AOT autograd put one opaque node in the graph and never trace the launch (on the
CPU the launch is Triton's interpreter, numpy code dynamo cannot trace; on a GPU the kernel's own compiled code). A
body's gradient is a second op. The Python state of a body (sizes, dtypes) is recomputed from the ops' tensors,
never carried past them.

How an op is called, and what it costs the host (docs/speed.md, "The time model"): the ops are declared with
torch.library.Library (a schema and a kernel for CPU and CUDA: the dispatcher calls the host function, ~3 us), not
torch.library.custom_op, whose every call passes through Python layers of its own (an autograd kernel, a
redispatch, an alias check: ~40 us a call at run time, measured on this project's compiled HC step). Their autograd
is `AutogradOp`, a torch.autograd.Function over the flattened arguments that dynamo traces into the graph: its
forward calls the op (one node), its backward the gradient's op (one node of the compiled backward); outside dynamo
the same Function calls the host functions directly (no dispatch at all).

Why not triton_op: its fake body is the host function itself with every launch through `wrap_triton`, which under
the interpreter hands back the bare kernel, so tracing launches it on fake tensors and fails. And the tests import
the Triton modules once for the GPU and again, reloaded, for the interpreter, while an op's name can be defined only
once a process: so an op is defined once, under its name, and calls the newest host function registered under that
name (`_BODIES`): a module reloaded for the interpreter replaces its host functions, the op stays.
"""
import torch

NAMESPACE = "depthbench"
LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")   # every op of this file is defined in it
DEVICES = ("CPU", "CUDA")   # the dispatch keys whose kernel is the host function (CPU: the interpreter's tensors)
_BODIES = {}   # op name -> the host function its op calls now (a reloaded module's replaces the first one's)
_OPS = {}      # (the host function's module, name) -> its op (an OpOverload: torch.ops.depthbench.<name>.default)
_NAMES = {}    # id of an op -> its op name (the key of _BODIES)


def graph_op(name, schema, fake):
    """A decorator: host function fn -> the op torch.ops.depthbench.<name>(schema), running fn (the newest one
    registered under name by fn's module), and `fake` (same arguments: empty outputs of the right shapes, dtypes
    and devices) when traced. No op here writes to its inputs (the schema has no `(a!)`): every output is a new
    tensor. A second module of the same file (a test's copy, under another module name) gets ops of its own
    (name_<k>)."""
    def register(fn):
        key = (fn.__module__, name)
        if key not in _OPS:
            opname = f"{name}_{len(_OPS)}" if name in _BODIES else name

            def run(*args):
                return _BODIES[opname](*args)
            LIBRARY.define(opname + schema)
            for device in DEVICES:
                LIBRARY.impl(opname, run, device)
            torch.library.register_fake(f"{NAMESPACE}::{opname}", fake, lib=LIBRARY)
            op = getattr(getattr(torch.ops, NAMESPACE), opname).default
            _OPS[key] = op
            _NAMES[id(op)] = opname
        op = _OPS[key]
        _BODIES[_NAMES[id(op)]] = fn
        return op
    return register


def host_function(op):
    """The host function an op of this namespace (an OpOverload, as a dispatch mode sees it) runs now: a tool that
    records the torch ops inside it calls this under its mode (calling the op there would dispatch to the mode
    again)."""
    return _BODIES[op._opname]


def keep(ctx, tensors, **attributes):
    """A setup_context's work (`autograd_op`): save `tensors` for the backward and set the attributes (sizes, dtypes:
    Python values the backward needs, fixed when the graph is traced)."""
    ctx.save_for_backward(*tensors)
    for name, value in attributes.items():
        setattr(ctx, name, value)


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


def call(op, *args, **kwargs):
    """A backward's call of an op of this namespace: the op while compiling (AOT autograd traces the backward on
    fake tensors: its fake body; one node of the compiled backward), else its host function directly (no
    dispatch)."""
    if torch.compiler.is_compiling():
        return op(*args, **kwargs)
    return _BODIES[_NAMES[id(op)]](*args, **kwargs)


def autograd_op(op, backward, setup_context):
    """op with its gradient -> a function of op's arguments: a torch.autograd.Function (named <op name>_function)
    whose forward calls the op while dynamo traces (one node in the graph) and the op's host function otherwise,
    then setup_context(ctx, inputs, output) (save what the backward needs); its backward is backward(ctx, *grads)
    -> a gradient per input (a list's gradients a list; `call` inside it)."""
    name = _NAMES[id(op)]

    def run(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return _BODIES[name](*args)
    return autograd_function(name, run, backward=backward, setup_context=setup_context)


def autograd_function(name, forward, backward, setup_context):
    """forward (a function of tensors and lists of tensors; dynamo traces it), its backward(ctx, *grads) and
    setup_context(ctx, inputs, output) -> a function of forward's arguments that runs them as a
    torch.autograd.Function named <name>_function. Autograd sees tensors only as direct arguments, so the Function
    takes the arguments flat (`flatten`: each list's items in place) and `layout` says which were lists."""
    def function_forward(ctx, layout, *leaves):
        args = unflatten(layout, leaves)
        output = forward(*args)
        setup_context(ctx, args, output)
        ctx.layout = layout
        return output

    def gradients(ctx, *grads):
        return (None, *flatten(ctx.layout, backward(ctx, *grads))[1])

    function = type(f"{name}_function", (torch.autograd.Function,),
                    {"forward": staticmethod(function_forward), "backward": staticmethod(gradients)})

    def apply(*args):
        layout, leaves = flatten(None, args)
        return function.apply(layout, *leaves)
    return apply
