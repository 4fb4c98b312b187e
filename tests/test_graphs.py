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
    """graph_ops.autograd_op's split: an eager step runs the read and write as EagerOp (torch.library's op never
    dispatched, forward or backward: its Python layers cost host time), a compiled step runs the ops (forward and
    backward: one node each in the graphs) and never EagerOp; a split collapsed either way fails here."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    model = triton_model(residual, layers=1)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    names = {"mhc": ("depthbench::mhc_read", "depthbench::mhc_read_bwd"),
             "hc": ("depthbench::hc_read", "depthbench::hc_read_bwd")}[residual]
    ops_run = {*names, "depthbench::hc_depth", "depthbench::hc_depth_bwd"}
    eager = profiled_names(lambda: model(x, x)[1].backward())
    assert "EagerOp" in eager and "EagerOpBackward" in eager
    assert not {name for name in eager if name.startswith("depthbench::")}
    from depthbench.training.compiled import compile_model
    compiled = compile_model(model, "blocks", backend="aot_eager")
    compiled(x, x)[1].backward()                                     # compiles
    traced = profiled_names(lambda: compiled(x, x)[1].backward())
    assert ops_run <= traced
    assert not {name for name in traced if name.startswith("EagerOp")}
    torch._dynamo.reset()
