"""
Graphs per block under torch.compile with the Triton bodies (kernels "triton", run by Triton's interpreter on CPU
tensors), each design against Pre-LN's (issue 68, item 4): a body whose launches are ops (depthbench/kernels/
graph_ops.py) is one node of the block's graph; one still under torch.compiler.disable breaks the graph there.

    python -m pytest -q tests/test_graphs.py

Counted with compile_model's per-block scope (what train.py runs) and a backend that is AOT autograd without code
generation ("aot_eager": the forward and the backward are traced, the ops' fake bodies included) wrapped to count
the graphs each block runs. Skipped, with the reason, where triton does not import. An eager step runs those
bodies as plain autograd.Functions and a compiled one as the ops (graph_ops.autograd_op): tested by name here too.
"""
import importlib

import pytest
import torch

import ops
from model import GPT, GPTConfig

pytest.importorskip("triton", reason="triton does not import: `pip install triton` runs these tests on the CPU")

from test_triton_hc import interpreted_hc  # noqa: E402  (sets TRITON_INTERPRET=1 while it imports the Triton bodies)

# the graphs a training step's forward runs at L3 (each block's share: a third), and the graph breaks dynamo reports
# compiling the model; Pre-LN's is the mark. A design whose depth state lives in a bank its Triton bodies keep in
# Python (Full and Block AttnRes' DepthBank, MoDA's DepthKV: torch.compiler.disable) still breaks at each read and
# push: their counts are today's, so that a change shows; where a design's bodies become ops its row becomes
# Pre-LN's. Before HC's and mHC's read and write were ops (graph_ops.py) both ran 6 graphs with 4 breaks.
LAYERS = 3
GRAPHS = {"preln": (3, 0), "hc": (3, 0), "mhc": (3, 0),
          "attnres": (11, 6), "block_attnres": (10, 6), "moda": (8, 4)}
IN_GRAPH = ("preln", "hc", "mhc")      # their rows must equal Pre-LN's: a break that comes back fails


def triton_model(residual, layers):
    """A tiny GPT (d32, 4 heads) whose every ops namespace is kernels "triton" with the interpreter's Triton bodies
    (built here: ops.namespace caches the first one a process made, maybe for a GPU)."""
    interpreted_hc()
    kernels = importlib.import_module("depthbench.kernels")
    bodies = ops.Kernels("triton", ops.FAST["cpu"], replaced=kernels.triton_bodies())
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=layers, d_model=32, n_head=4, d_ff=48, residual=residual,
                          kernels="triton"))
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = bodies
    return model


def counted(residual, layers=LAYERS):
    """(graphs a compiled training step's forward runs, graph breaks while compiling, the eager loss and
    gradients, the compiled ones)."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch._dynamo.utils import counters

    from depthbench.training.compiled import compile_model
    torch._dynamo.reset()
    counters.clear()
    model = triton_model(residual, layers)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(x, x)[1]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    runs = []

    def counting(gm, example_inputs):
        compiled = aot_eager(gm, example_inputs)

        def run(*args):
            runs.append(gm)
            return compiled(*args)
        return run

    compiled = compile_model(model, "blocks", backend=counting)
    compiled(x, x)                                            # compiles
    runs.clear()
    loss_c = compiled(x, x)[1]
    grads_c = torch.autograd.grad(loss_c, list(model.parameters()))
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return len(runs), breaks, (loss, grads), (loss_c, grads_c)


@pytest.mark.slow
@pytest.mark.parametrize("residual", list(GRAPHS))
def test_graphs_per_block_with_the_triton_bodies(residual):
    """Each design's graphs per step (L3) and graph breaks are its row of GRAPHS (Pre-LN's for every design whose
    bodies are ops); the compiled step's loss and gradients equal the eager step's."""
    torch.set_num_threads(1)
    graphs, breaks, (loss, grads), (loss_c, grads_c) = counted(residual)
    assert (graphs, breaks) == GRAPHS[residual]
    if residual in IN_GRAPH:
        assert (graphs, breaks) == GRAPHS["preln"]
    torch.testing.assert_close(loss_c, loss, rtol=0, atol=1e-6)
    for g_c, g in zip(grads_c, grads):
        torch.testing.assert_close(g_c, g, rtol=1e-5, atol=1e-7)


def profiled_names(fn):
    """The names of the ops and autograd Functions `fn()` runs (forward and backward), as torch's profiler records
    them."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {event.name for event in prof.function_events}


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_eager_runs_the_function_compiled_runs_the_op(residual):
    """graph_ops.autograd_op's split: an eager step runs the read and write as their autograd Functions over the
    host functions (the ops never dispatched, forward or backward: no dispatch, no host time for it), a compiled step
    runs the ops (forward and backward: one node each in the graphs), the Functions traced away; a split collapsed
    either way fails here."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    model = triton_model(residual, layers=1)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    names = {"mhc": ("mhc_read", "mhc_read_bwd"), "hc": ("hc_read", "hc_read_bwd")}[residual]
    ops_run = {f"depthbench::{name}" for name in (*names, "hc_depth", "hc_depth_bwd")}
    functions = {f"{name}_function{part}" for name in (names[0], "hc_depth") for part in ("", "Backward")}
    eager = profiled_names(lambda: model(x, x)[1].backward())
    assert functions <= eager
    assert not {name for name in eager if name.startswith("depthbench::")}
    from depthbench.training.compiled import compile_model
    compiled = compile_model(model, "blocks", backend="aot_eager")
    compiled(x, x)[1].backward()                                     # compiles
    traced = profiled_names(lambda: compiled(x, x)[1].backward())
    assert ops_run <= traced
    assert not functions & traced
    torch._dynamo.reset()


def read_loss(model, H, weights):
    """A loss of HC's / mHC's read at block 1's attention site: the branch, H_post and the mixed streams weighted by
    `weights` (fixed random numbers of their shapes), and, with two more weights, H_pre and H_res (the diagnostics'
    case)."""
    h, ctx = model.res.read(H, model.res.site(2))
    terms = [h, ctx["H_post"], ctx["mixed"], ctx["H_pre"], ctx["H_res"]][:len(weights)]
    return sum((t.float() * w).sum() for t, w in zip(terms, weights))


def weights_for(model, H, use_maps):
    """read_loss's weights: N(0, 1) of each term's shape (seeded), the maps' only with use_maps."""
    with torch.no_grad():
        h, ctx = model.res.read(H, model.res.site(2))
    terms = [h, ctx["H_post"], ctx["mixed"]] + ([ctx["H_pre"], ctx["H_res"]] if use_maps else [])
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(t.shape, generator=generator) for t in terms]


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_compiled_read_backward_is_one_launch_and_the_maps_gradient_is_whole(residual, monkeypatch):
    """Compiled, the read's backward takes the one-launch path where H_pre and H_res feed nothing (the three-kernel
    path never runs: dynamo's traced backward would otherwise get zeros for them, not None), and where they do feed
    the loss their gradient arrives through maps_gradient's Function: the compiled gradients of the streams and of
    every parameter equal the eager ones in both cases."""
    from depthbench.kernels import graph_ops
    torch.set_num_threads(1)
    model = triton_model(residual, layers=2)
    ops_module = importlib.import_module(graph_ops._BODIES[f"{residual}_read_bwd"].__module__)
    three = []
    original = ops_module.three_kernels if residual == "hc" else ops_module.width_backward
    name = "three_kernels" if residual == "hc" else "width_backward"
    monkeypatch.setattr(ops_module, name, lambda *a, **k: three.append(1) or original(*a, **k))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():                                   # off the init (where the maps hardly depend on H)
        for parameter in model.res.site(2).conn.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    H = torch.randn(2, 8, 4, 32, generator=generator).requires_grad_()
    wanted = [H, *model.res.site(2).conn.parameters()]
    for use_maps in (False, True):
        torch._dynamo.reset()
        weights = weights_for(model, H, use_maps)
        eager = torch.autograd.grad(read_loss(model, H, weights), wanted)
        three.clear()
        compiled = torch.compile(read_loss, backend="aot_eager", fullgraph=True)
        grads = torch.autograd.grad(compiled(model, H, weights), wanted)
        assert bool(three) == use_maps                          # the three-kernel path: only for the maps' gradient
        for g_c, g in zip(grads, eager):
            torch.testing.assert_close(g_c, g, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
