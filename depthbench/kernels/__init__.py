"""
depthbench/kernels: the fast bodies of ops.py's maths, one file per device and design family: cpu.py (every
family's fast bodies, the "fast" namespace; they run on any device), triton_attnres.py (Full and Block AttnRes'
depth mix as Triton kernels; triton_attnres_chunk.py, its two-phase mix, serves a chunk of consumers at once: the
file's 700 lines were full), triton_hc.py (HC's and mHC's maps, Sinkhorn and both mixes), triton_hc_read.py (HC's and
mHC's whole read fused, ops.hc_read: the maps, the width mix and the branch's norm; triton_hc_read_ops.py, the same
as ops) and triton_moda.py (MoDA's joint attention: the depth half and the merge as Triton kernels, the sequence half
PyTorch's fused kernel). graph_ops.py makes a body's launches torch.library ops, which a compiled graph holds (IN_GRAPH
below). A new body goes into the file of its device and family: cpu.py, or triton_<family>.py.

ops.py imports none of them (they import ops.py): importing this package registers them with ops.register, and
model.py and residuals.py import it, so every model built has them. `ops.namespace("fast")` is cpu.py's bodies,
with the Triton bodies (`triton_bodies`) in place of those they replace on a machine with CUDA where triton imports;
"triton" (--kernels triton) is cpu.py's with the Triton bodies always. Chosen once, when a model is built. Triton is
optional and imported only when a namespace asks for its bodies: without it this package imports and `available()`
is False. A Triton body runs its kernels only on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1) and hands
other tensors to cpu.py's body, so the CPU path does not change. tests/test_triton.py, tests/test_triton_hc.py and
tests/test_triton_moda.py check every kernel against ops.py's body under the interpreter (forward and every
gradient, fp32 and bf16).
"""
import ops
from depthbench.kernels import cpu


# The function bodies whose launches are ops (graph_ops.py): dynamo puts each as one node in the block's graph, on a
# GPU and under the interpreter alike, so a compiled block does not break there (tests/test_graphs.py)
IN_GRAPH = ("hc_read", "depth_connection")


def triton_bodies():
    """ops.TWO_BODIES names -> their GPU (Triton) body. Imports the Triton modules (and triton, where installed).
    Under Triton's CPU interpreter the function bodies not IN_GRAPH run eagerly inside a compiled graph
    (torch.compiler.disable): dynamo would trace the interpreter's own numpy code and fail."""
    import torch
    from depthbench.kernels import triton_attnres_chunk, triton_hc, triton_hc_read_ops, triton_moda
    bodies = {"DepthBank": triton_attnres_chunk.DepthBank, **triton_hc.BODIES, **triton_hc_read_ops.BODIES,
              "joint_attention": triton_moda.joint_attention, "DepthKV": triton_moda.DepthKV}
    if triton_hc.interpreted():
        bodies.update({name: torch.compiler.disable(body) for name, body in bodies.items()
                       if not isinstance(body, type) and name not in IN_GRAPH})
    return bodies


def available():
    """Whether triton imports (the bodies can run: on CUDA, or on the CPU under TRITON_INTERPRET=1)."""
    from depthbench.kernels import triton_attnres, triton_hc
    return triton_attnres.triton is not None and triton_hc.triton is not None


ops.register(cpu, triton_bodies, available)
