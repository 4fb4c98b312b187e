"""
depthbench/gpu/: the GPU (Triton) bodies of ops.py's cross-layer maths, one file per design family (hc.py: HC and
mHC's connection). Each module exposes its bodies under the names ops.TWO_BODIES uses, so a namespace can take them
in place of depthbench/kernels.py's; the CPU path never imports them. Triton is optional: each module imports it
guarded (`HAVE_TRITON`), and its bodies run on CUDA tensors, or on CPU tensors under the interpreter
(TRITON_INTERPRET=1 set before triton is first imported). tests/test_triton_hc.py checks every body against ops.py's
under the interpreter, forward and every gradient.
"""
