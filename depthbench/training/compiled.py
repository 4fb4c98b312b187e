"""
compiled.py: torch.compile for train.py, profile_gpu.py and scripts/compile_depth.py (docs/speed.md#compile), and a
training step recorded as one CUDA graph (`capture_step`, profile_gpu.py --compile capture).
"""
import contextlib

import torch


NESTED_GRAPH_BREAKS_FROM = "2.11"     # the first PyTorch whose nested graph breaks the tests ran on (the GPU image's)


def compile_model(model, scope, backend="inductor"):
    """torch.compile by scope -> the module to call.

    "blocks": each block is compiled on its own, in place. A block reaches its design only through its two sites
    (residuals.Site), and a state that grows with depth (AttnRes' sources, MoDA's depth K/V) is read and written
    eagerly at a few graph breaks per block, the same in every block; so every block reuses the first one's graphs
    and compile time does not grow with depth. The embedding, the head and the loss run eager. "model": the whole
    forward as one graph, inductor fusing across blocks; its compile time grows with depth. "graphs": "model" under
    CUDA graphs (mode "reduce-overhead"; CUDA only, opt-in: issue 52's launch-overhead experiment).
    backend: torch.compile's ("eager" traces without generating code: the tests count graphs)."""
    if scope == "model":
        return torch.compile(model, backend=backend)
    if scope == "graphs":  # the whole model, replayed as CUDA graphs: one launch per graph (profile_gpu.py --compile)
        return torch.compile(model, backend=backend, mode="reduce-overhead")
    # every variant compiles, even one graph per block (a design reading site.index): none falls back to eager
    # because a limit was reached (dynamo's default allows 8 graphs per code object, and all blocks share one)
    limit = 4 * len(model.blocks) + 8
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name):              # the names changed across PyTorch versions
            setattr(config, name, max(getattr(config, name), limit))
    # a graph break inside a call the block makes (a bank's read in res.read, in attention) resumes the block's
    # frame once, not once per frame on the way down: ~3x fewer compiled pieces per block (docs/speed.md#compile).
    # Experimental in dynamo (off by default through 2026); on where it was tested, PyTorch 2.11 and 2.13
    if hasattr(config, "nested_graph_breaks") and torch.__version__ >= NESTED_GRAPH_BREAKS_FROM:   # a TorchVersion
        config.nested_graph_breaks = True
    for block in model.blocks:
        block.compile(dynamic=False, backend=backend)
    return model


def eager():
    """A context in which compiled code runs eagerly (torch.compiler.set_stance, PyTorch 2.6+)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance else contextlib.nullcontext()


CAPTURE_WARMUP = 3   # steps before a capture: compiling, autotuning and the allocator's first blocks happen in them


def capture_step(step, warmup=CAPTURE_WARMUP):
    """step (no arguments: the forward and backward of one micro-batch, reading its inputs from tensors that stay in
    place and adding into the parameters' .grad) -> a function of no arguments that runs it again: every kernel the
    step launched while it was captured (torch.cuda.graph), launched by one call, without the step's Python: HC's
    ops, AttnRes' eager bank and MoDA's pushes then cost the host what Pre-LN's blocks cost, one replay (issue 68's
    host criterion; docs/speed.md, "The step as one CUDA graph"; measured by the first GPU's script). CUDA only.

    PyTorch's recipe: `warmup` steps on a side stream first (compiling, autotuning and the allocator's first blocks
    happen there, not in the graph); their .grad tensors stay, and the caller zeroes them in place
    (zero_grad(set_to_none=False)) between steps, since the graph adds into those very tensors. What a replay does
    not redo is the step's Python: the step must launch the same kernels with the same shapes every time and never
    wait for the GPU (.item(), a shape read from data). scripts/capture_check.py checks both on the CPU for every
    design (tests/test_capture.py)."""
    if not torch.cuda.is_available():
        raise RuntimeError("capture_step records CUDA kernels: it needs a GPU (torch.cuda.is_available() is False)")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay
