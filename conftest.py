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

import gc  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402  (after the flag: nothing here imports triton)
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# A suite started in the background (`pytest &` from a script: POSIX shells start such a job with Ctrl-C ignored)
# hands that on to every process a test starts, so the Ctrl-C tests' scripts would never see their Ctrl-C and wait
# for it until killed. Python's own handler here instead: a process started from this one begins with the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SMOKE_TEST = "test_tiny_smoke_answers_every_question"  # tests/test_launch.py's check of the rehearsal's summary.json


def run_smoke(out, budget, timeout):
    """`bash scripts/gpu_smoke.sh --tiny` into `out` within `budget` seconds, launched as a user would: without this
    file's interpreter flag (gpu_smoke sets it for the stages that run Triton), one thread."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "OUT": str(out),
           "SMOKE_BUDGET_S": str(budget)}
    return subprocess.run(["bash", "scripts/gpu_smoke.sh", "--tiny"], cwd=Path(__file__).resolve().parent,
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_smoke(tmp_path_factory):
    """One whole tiny smoke per session (the GPU smoke rehearsed on the CPU, ~2-3 minutes) -> (its CompletedProcess,
    its $OUT): tests/test_launch.py checks its summary.json, and tests/test_triton_hc.py the kernels.json of its
    kernels stage (scripts/kernel_bench.py --tiny, the command that test would otherwise run again)."""
    out = tmp_path_factory.mktemp("smoke")
    return run_smoke(out, 900, 1200), out


def runs_the_smoke(request):
    """Whether this session runs the tiny smoke's own test (then tiny_smoke runs once for it anyway)."""
    return any(item.name == SMOKE_TEST for item in request.session.items)


@pytest.fixture
def frozen_heap():
    """The objects made before the test out of the collector's reach while it runs (gc.freeze), given back after:
    a collection in it, explicit (costs.kept_bytes') or automatic, walks the test's own objects only, never the
    whole suite's heap (~400,000 objects once every test is collected: ~0.2-0.7 s a full collection), and frees
    nothing the test did not make. For a test that measures many times (tests/test_memory.py) or builds many models
    (tests/test_train.py's 540 meta builds); a test that keeps many objects (compiled graphs) gains nothing: its
    smaller counted heap makes full collections come more often."""
    gc.freeze()
    yield
    gc.unfreeze()
