"""The training step as one CUDA graph (depthbench/training/compiled.py capture_step) and scripts/capture_check.py,
which checks on the CPU that each design's step can be captured and replayed: it never waits on the GPU and launches
the same Triton kernels every step (issue 68: the host's time per step).

    python -m pytest -q tests/test_capture.py        # ~20 s: the slow ones run the check under the interpreter
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import capture_check  # noqa: E402  (scripts/ is not a package)
from kernel_probe import Launch  # noqa: E402
from depthbench.training.compiled import capture_step  # noqa: E402

TRITON_DESIGNS = ["hc", "mhc", "attnres", "block_attnres", "moda"]


def launch(kernel="m:k", grid=(4,), ints=None):
    return Launch(kernel=kernel, grid=list(grid), signature={"X": "*bf16", "N": "i32"}, constexprs={"B": 16},
                  aligned=["X"], ints=ints or {"N": 64}, options={"num_warps": 4})


def test_the_same_launches_pass_and_the_first_difference_is_named():
    """Steps that launch the same list pass (""); a step with one kernel more, a grid, an int argument or a kernel
    that differs is named with its step (as run: the first compared is step 2) and the part that differs."""
    same = [launch(), launch("m:j", ints={"N": 8})]
    assert capture_check.first_difference([same, list(same), list(same)]) == ""
    assert "step 4 launched 3 kernels, step 2 2" in capture_check.first_difference([same, same, same + [launch()]])
    moved = capture_check.first_difference([same, [launch(grid=(8,)), same[1]]])
    assert "step 3's launch 0 (k)" in moved and "grid: [4] -> [8]" in moved
    assert "in its ints" in capture_check.first_difference([same, [same[0], launch("m:j", ints={"N": 16})]])
    assert "in its kernel" in capture_check.first_difference([same, [launch("m:x"), same[1]]])


def test_the_ops_that_wait_on_the_gpu_are_named_and_others_not():
    """.item(), nonzero, a boolean index and torch.tensor's lift_fresh are waits; an add, an index by integers
    and a repeat_interleave with its output size given are not."""
    x = torch.arange(6.0)
    mode = capture_check.watcher()
    with mode:
        y = x + 1
        y.sum().item()
        torch.nonzero(y > 2)
        y[y > 3]
        y[torch.tensor([0, 2])]
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
    assert set(mode.waits) == {"aten::_local_scalar_dense", "aten::nonzero", "aten::index (a boolean mask)",
                               "aten::lift_fresh"}, mode.waits
    assert mode.waits["aten::lift_fresh"] == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's one-line refusal")
def test_capture_step_needs_a_gpu_and_says_so():
    with pytest.raises(RuntimeError, match="needs a GPU"):
        capture_step(lambda: None)


def run_check(*args, code=None):
    """capture_check.py with `args`, or python -c `code` (which imports it), under the interpreter."""
    pytest.importorskip("triton", reason="triton does not import: `pip install triton` (its interpreter runs here)")
    command = [sys.executable, "-c", code] if code else [sys.executable, "scripts/capture_check.py", *args]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "scripts")}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_every_designs_step_can_be_replayed():
    """Each design's Triton path at L3, eager and compiled per block: no wait on the GPU, the same Triton launches
    in steps 2 and 3 (and some: a design whose launches vanished would pass with none), as many compiled as eager;
    exit 0."""
    done = run_check("--layers", "3")
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert set(lines) == {f"{d} ({mode})" for d in capture_check.DESIGNS for mode in ("eager", "compiled per block")}
    for design in TRITON_DESIGNS:
        eager, compiled = lines[f"{design} (eager)"], lines[f"{design} (compiled per block)"]
        assert eager.startswith("replayable (") and not eager.startswith("replayable (0 "), lines
        assert compiled.split(" Triton")[0] == eager.split(" Triton")[0], (eager, compiled)


BROKEN = """
import capture_check as cc
from depthbench.kernels import triton_attnres_chunk as chunk, triton_hc_read_ops as read
gradient, blocks, calls = read.weight_gradient, chunk.phase1_blocks, []
def waits(x, rg, W, transposed=False):       # reads a value the GPU computed: the host would wait for it
    rg.sum().item()
    return gradient(x, rg, W, transposed=transposed)
def alternating(BT, D):                      # phase 1's tokens a program change from one step to the next
    calls.append(1)
    rows, columns = blocks(BT, D)
    return (rows // 2 if len(calls) % 2 else rows), columns
read.weight_gradient, chunk.phase1_blocks = waits, alternating
print(cc.line(cc.check("mhc")))
print(cc.line(cc.check("attnres")))
print(cc.line(cc.check("attnres", compiled=True)))
"""


@pytest.mark.slow
def test_a_wait_and_a_launch_that_changes_are_found():
    """mHC's weight gradient (cuBLAS' dphi; HC's is summed in its kernel) made to read .item(), Full AttnRes' phase 1
    made to halve its tokens a program every other step: each design is NOT replayable, for that reason; Full
    AttnRes' compiled per block too (its bank runs eagerly between the graphs)."""
    done = run_check(code=BROKEN)
    assert done.returncode == 0, done.stderr[-2000:]
    mhc, attnres, compiled = done.stdout.splitlines()
    assert mhc.startswith("mhc (eager): NOT replayable: waits on the GPU at aten::_local_scalar_dense"), mhc
    for line, mode in ((attnres, "eager"), (compiled, "compiled per block")):
        assert line.startswith(f"attnres ({mode}): NOT replayable: step 3's launch 0 (_chunk_forward)"), line
        assert "grid" in line


def test_bad_arguments_exit_2_in_one_line():
    done = subprocess.run([sys.executable, "scripts/capture_check.py", "--steps", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--steps 2" in done.stderr
