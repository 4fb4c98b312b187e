"""
depthbench/gpu: the GPU (Triton) bodies of the depth mixing, one file per design family (attnres.py: Full and Block
AttnRes' depth mix; hc.py: HC's and mHC's maps, Sinkhorn and both mixes). Each replaces a name of ops.TWO_BODIES in the fast namespace: the "triton" namespace
(`ops.namespace("triton")`, --kernels triton) is depthbench/kernels.py's bodies with the names in `BODIES` replaced by
these; "fast" is that namespace on a machine with CUDA where triton imports, kernels.py's alone elsewhere. Chosen once,
when a model is built. Triton is optional: without it this package imports and `available()` is False. A body runs its
kernels only on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1) and hands other tensors to kernels.py's body,
so the CPU path does not change. tests/test_triton.py and tests/test_triton_hc.py check every kernel against ops.py's body under the interpreter
(forward and every gradient, fp32 and bf16).
"""
from depthbench.gpu import attnres, hc

BODIES = {"DepthBank": attnres.DepthBank, **hc.BODIES}   # ops.TWO_BODIES names -> their GPU body


def available():
    """Whether triton imports (the bodies can run: on CUDA, or on the CPU under TRITON_INTERPRET=1)."""
    return attnres.triton is not None and hc.triton is not None
