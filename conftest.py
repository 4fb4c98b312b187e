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

import shutil  # noqa: E402  (after the flag: nothing here imports triton)
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent
SMOKE_TEST = "test_tiny_smoke_answers_every_question"  # tests/test_launch.py's check of the rehearsal's summary.json
QUICK_START_TEST = "test_readme_quick_start_prints_the_result_the_readme_quotes"   # tests/test_train.py's


@dataclass
class Background:
    """A long run started when the session's tests are known (`pytest_collection_finish`), beside the others: most
    tests use one core of two, and the suite's two longest runs (the tiny smoke ~2.5 min, the README's `python
    train.py` ~3.5 min) take the other; their tests wait for them (`finished`)."""
    process: subprocess.Popen   # the run; its output goes to files, so a full pipe never stalls it
    folder: Path                # its own temporary folder: the run's --out or $OUT, and stdout.txt, stderr.txt
    started: float              # time.time() at its start


BACKGROUND = {}    # test name -> its Background run


def smoke_command(out, budget):
    """(argv, env) of `bash scripts/gpu_smoke.sh --tiny` into `out` within `budget` seconds, launched as a user
    would: without this file's interpreter flag (gpu_smoke sets it for the stages that run Triton), one thread."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "OUT": str(out),
           "SMOKE_BUDGET_S": str(budget)}
    return ["bash", "scripts/gpu_smoke.sh", "--tiny"], env


def run_smoke(out, budget, timeout):
    """smoke_command run to its end -> its CompletedProcess (text)."""
    argv, env = smoke_command(out, budget)
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def start(name, argv, env=None, folder=None):
    """Start argv (in the repository root) as test `name`'s Background run, its output into files of `folder` (a new
    temporary one when None)."""
    folder = Path(folder or tempfile.mkdtemp(prefix=f"{name[:24]}_"))
    with open(folder / "stdout.txt", "w") as out, open(folder / "stderr.txt", "w") as err:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, env=env)
    BACKGROUND[name] = Background(process=process, folder=folder, started=time.time())


def pytest_collection_finish(session):
    """The two long runs start now, each only where its test was collected (a quick-tier session starts neither)."""
    names = {item.name for item in session.items}
    if SMOKE_TEST in names:
        out = Path(tempfile.mkdtemp(prefix="smoke_"))
        argv, env = smoke_command(out / "out", budget=900)
        (out / "out").mkdir()
        start(SMOKE_TEST, argv, env=env, folder=out)
    if QUICK_START_TEST in names:
        folder = Path(tempfile.mkdtemp(prefix="quick_start_"))
        start(QUICK_START_TEST, [sys.executable, "train.py", "--out", str(folder / "runs")], folder=folder)


def pytest_sessionfinish(session):
    """A run still going (its test deselected by -x, or interrupted) is stopped; every Background folder removed."""
    for run in BACKGROUND.values():
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()
        shutil.rmtree(run.folder, ignore_errors=True)


def finished(name, timeout):
    """(test `name`'s Background run waited for -> (its CompletedProcess with the text it wrote, its folder, the
    seconds it took from its start)), or None where none was started (the test was run some other way)."""
    run = BACKGROUND.get(name)
    if run is None:
        return None
    run.process.wait(timeout=timeout)
    seconds = time.time() - run.started
    result = subprocess.CompletedProcess(run.process.args, run.process.returncode,
                                         (run.folder / "stdout.txt").read_text(), (run.folder / "stderr.txt").read_text())
    return result, run.folder, seconds


@pytest.fixture(scope="session")
def tiny_smoke(tmp_path_factory):
    """One whole tiny smoke per session (the GPU smoke rehearsed on the CPU, ~2-3 minutes; started in the background
    when the tests were collected, where its test was) -> (its CompletedProcess, its $OUT): tests/test_launch.py
    checks its summary.json, and tests/test_triton_hc.py the kernels.json of its kernels stage (scripts/kernel_bench.py
    --tiny, the command that test would otherwise run again)."""
    done = finished(SMOKE_TEST, timeout=1200)
    if done is not None:
        result, folder, _ = done
        return result, folder / "out"
    out = tmp_path_factory.mktemp("smoke")
    return run_smoke(out, 900, 1200), out


def runs_the_smoke(request):
    """Whether this session runs the tiny smoke's own test (then tiny_smoke runs once for it anyway)."""
    return any(item.name == SMOKE_TEST for item in request.session.items)
