"""pytest's setup for the whole suite, read before any test module is imported: Triton's CPU interpreter.

Triton decorates its own library (tl.sum's combine functions, ...) and every @triton.jit kernel for the interpreter
only when TRITON_INTERPRET=1 is set before triton's first import in the process, and many modules import triton
early (torch.compile's machinery, scripts/cuda_check.py). Set here, first, the Triton kernels of depthbench/kernels
run on CPU tensors in tests/test_triton.py and tests/test_triton_hc.py in every run of the suite, whole or in part.
Nothing else changes: the CPU path never calls Triton. A process a test launches inherits the flag; one that must
run without it (a GPU compile, a script run as a user runs it) gets TRITON_INTERPRET=0, which this file keeps (an
absent flag would be set again here, and a pytest launched without it would launch itself again).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
