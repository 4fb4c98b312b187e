"""
Tests of train.py's stop that keeps the work (depthbench/training/stopping.py) and of what a user sees while a step runs
(depthbench/training/progress.py): a SIGTERM or SIGINT during gradient accumulation stops at the next micro-batch
boundary, the step in progress dropped, the last completed step's ckpt.pt on disk, run.json saying stopped and why, and
--resume giving the losses of an uninterrupted run bit for bit (an evaluation is cut short alike); in this process,
in a real process and under torch.distributed.run (2 gloo ranks). The time from the signal to the exit is printed
(pytest -s), not asserted.

    python -m pytest -q -p no:cacheprovider tests/test_stop.py
"""
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

import data
import train
from depthbench.training import progress, stopping
from test_train import ROOT, TINY, load_run, one_thread, run_main  # noqa: F401 (one_thread: one thread here too)

# TINY at 8 micro-batches of 2 sequences a step
ACCUM8 = TINY + ["--global-batch", "16", "--batch-size", "2", "--steps", "3", "--ckpt-every", "100"]
# a step of 128 micro-batches (64 a rank under torchrun) of 2 x 64 tokens: ~2 s on one busy core
LONG = ["--layers", "2", "--params", "100k", "--seq-len", "64", "--global-batch", "256", "--batch-size", "2",
        "--eval-iters", "1", "--log-every", "1", "--steps", "4", "--ckpt-every", "100"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def weights(folder):
    return torch.load(next(folder.glob("*/ckpt.pt")), weights_only=True)["model"]


def same_run(a, b):
    """Two run folders trained the same: every step's loss and grad norm, every eval, the final weights, bit for bit."""
    ra, rb = load_run(a), load_run(b)
    assert rb["finished"] is True and "stopped" not in rb  # a resumed run that finished is no longer stopped
    for key in ("loss", "grad_norm", "lr"):
        assert [s[key] for s in ra["steps"]] == [s[key] for s in rb["steps"]], key
    assert [e["val_loss"] for e in ra["evals"]] == [e["val_loss"] for e in rb["evals"]]
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_signal_mid_step_drops_it_at_the_next_micro_batch(tmp_path, capsys, monkeypatch):
    """SIGTERM while micro-batch 3 of step 2 runs (of 8): that micro-batch ends, no other starts; step 2 is dropped,
    ckpt.pt holds step 1 with the data position after it, run.json says why; --resume equals an uninterrupted run."""
    assert run_main(ACCUM8 + ["--out", str(tmp_path / "a")], capsys)[0] == 0
    calls, next_batch = [], data.BatchLoader.next_batch

    def counted(loader):
        calls.append(loader.state_dict())
        if len(calls) == 8 + 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs now, before micro-batch 3 of step 2 runs
        return next_batch(loader)
    monkeypatch.setattr(data.BatchLoader, "next_batch", counted)
    argv = ACCUM8 + ["--out", str(tmp_path / "b")]
    code, out, err = run_main(argv, capsys)
    assert code == 143 and len(calls) == 8 + 3  # no micro-batch started after the one the signal came in
    assert err.splitlines() == [
        f"interrupted at step 1: saved ckpt.pt; resume with: python {shlex.join(['train.py', *argv, '--resume'])}"]
    assert "step 2 dropped after micro-batch 3 of 8 (a signal)" in out
    run = load_run(tmp_path / "b")
    assert run["stopped"] == {"signal": "SIGTERM", "step": 1, "dropped_step": 2, "micro_batches_done": 3,
                              "micro_batches": 8, "after_signal": 1}
    assert [s["step"] for s in run["steps"]] == [1] and run["finished"] is False
    ckpt = torch.load(next((tmp_path / "b").glob("*/ckpt.pt")), weights_only=True)
    assert ckpt["step"] == 1 and ckpt["loader"] == {"step": 1, "micro_step": 0}
    monkeypatch.undo()
    assert run_main(argv + ["--resume"], capsys)[0] == 0
    same_run(tmp_path / "a", tmp_path / "b")


def test_a_signal_in_the_first_step_leaves_nothing_to_resume(tmp_path, capsys, monkeypatch):
    """SIGINT in step 1's micro-batch 2: nothing trained, no ckpt.pt; run.json says stopped at step 0, exit 130."""
    calls, next_batch = [], data.BatchLoader.next_batch

    def counted(loader):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return next_batch(loader)
    monkeypatch.setattr(data.BatchLoader, "next_batch", counted)
    code, _, err = run_main(ACCUM8 + ["--out", str(tmp_path)], capsys)
    assert code == 130 and err.splitlines() == ["interrupted at step 0: nothing trained yet"] and len(calls) == 2
    assert load_run(tmp_path)["stopped"] == {"signal": "SIGINT", "step": 0, "dropped_step": 1,
                                             "micro_batches_done": 2, "micro_batches": 8, "after_signal": 1}
    assert not list(tmp_path.glob("*/ckpt.pt"))


def test_a_signal_mid_eval_cuts_it_short_and_resume_evaluates_it(tmp_path, capsys, monkeypatch):
    """SIGTERM in micro-batch 2 of step 2's eval (8 micro-batches): no third one runs; ckpt.pt holds step 2, run.json
    says stopped at step 2 and has no eval of it; --resume evaluates step 2 and trains on: an uninterrupted run."""
    argv = ACCUM8 + ["--eval-every", "2"]
    assert run_main(argv + ["--out", str(tmp_path / "a")], capsys)[0] == 0
    trained, evals, get_batch, next_batch = [], [], data.BatchLoader.get_batch, data.BatchLoader.next_batch

    def counted_next(loader):
        trained.append(1)
        return next_batch(loader)

    def counted_get(loader, step, micro):
        if loader.split == "val" and len(trained) == 2 * 8:
            evals.append(micro)
            if len(evals) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        return get_batch(loader, step, micro)
    monkeypatch.setattr(data.BatchLoader, "next_batch", counted_next)
    monkeypatch.setattr(data.BatchLoader, "get_batch", counted_get)
    argv += ["--out", str(tmp_path / "b")]
    code, out, _ = run_main(argv, capsys)
    assert code == 143 and evals == [0, 1] and "eval step 2 cut short by a signal" in out
    run = load_run(tmp_path / "b")
    assert run["stopped"] == {"signal": "SIGTERM", "step": 2} and run["evals"] == [] and run["finished"] is False
    assert torch.load(next((tmp_path / "b").glob("*/ckpt.pt")), weights_only=True)["step"] == 2
    monkeypatch.undo()
    assert run_main(argv + ["--resume"], capsys)[0] == 0
    assert [e["step"] for e in load_run(tmp_path / "b")["evals"]] == [2, 3]
    same_run(tmp_path / "a", tmp_path / "b")


def test_progress_lines_before_and_during_a_step(tmp_path, capsys, monkeypatch):
    """A short run says what it does before its first step (building, micro-batch 1 starting and done, the step time
    expected); its first step line has tokens/s, MFU and the ETA of the whole run past --max-steps; a step expected
    over LONG_STEP_S shows its micro-batches: a plain line off a terminal (every PLAIN_EVERY_S), a tqdm bar on one;
    a shorter step shows none."""
    argv = ACCUM8 + ["--max-steps", "2", "--out", str(tmp_path / "a")]
    code, out, _ = run_main(argv, capsys)
    lines = out.splitlines()
    assert code == 0 and any(line.startswith("building   ") for line in lines)
    assert "step 1: micro-batch 1 of 8 starts" in lines
    assert any(line.startswith("step 1: micro-batch 1 done in ") for line in lines)
    assert any(line.startswith("step 1: ") and "a micro-batch after the first: this step takes ~" in line
               for line in lines)
    first = next(line for line in lines if line.startswith("step     1/3 "))
    assert "tok/s | MFU " in first and " | ETA " in first and "(to step 2; the whole run: " in first
    assert "micro-batch 2/8" not in out and "micro-batches |" not in out  # a short step: no progress line
    monkeypatch.setattr(progress, "LONG_STEP_S", 0.0)
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)
    assert run_main(argv[:-1] + [str(tmp_path / "b")], capsys)[1].count("step 2: micro-batch 7/8, ") == 1
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    out = run_main(argv[:-1] + [str(tmp_path / "c")], capsys)[1]
    assert "step 2: 1/8 micro-batches |" in out and "step 2: micro-batch 7/8, " not in out


# ----------------------------------------------------------------------------- real processes

def stop_mid_step(cmd, out_dir):
    """Start `cmd` (train.py with LONG), send SIGTERM half a step after step 1's line (the step's ms, as that line
    gives them: so the signal lands inside step 2, away from its ends, on a CPU that runs a step in 0.3 s as on one
    that takes 2 s) -> (exit code, stdout, stderr); prints the seconds from the signal to the exit."""
    p = subprocess.Popen(cmd + ["--out", str(out_dir)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("step     1/4 "):
            break
    step_ms = float(re.search(r"\| (\d+) ms", seen[-1]).group(1))    # "... | 394 ms (steady 388 ms) | ..."
    time.sleep(step_ms / 2 / 1e3)
    t = time.time()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    print(f"{shlex.join(cmd[:4])}...: SIGTERM to exit {time.time() - t:.1f} s")
    return p.returncode, "".join(seen) + out, err


def check_stopped(folder, accum):
    """run.json says SIGTERM stopped the run in a step after the first, that step dropped at most one micro-batch
    after rank 0's signal; ckpt.pt holds the step before it -> that step."""
    stopped = load_run(folder)["stopped"]
    assert stopped["after_signal"] in (0, 1), stopped
    step = stopped["step"]
    assert step >= 1 and stopped == {"signal": "SIGTERM", "step": step, "dropped_step": step + 1,
                                     "micro_batches": accum, "micro_batches_done": stopped["micro_batches_done"],
                                     "after_signal": stopped["after_signal"]}
    assert 1 <= stopped["micro_batches_done"] < accum
    assert torch.load(next(folder.glob("*/ckpt.pt")), weights_only=True)["step"] == step
    return step


@pytest.mark.slow
def test_sigterm_mid_accumulation_in_a_real_process(tmp_path):
    """A real process, SIGTERM during step 2 of 128 micro-batches: exit 143, one line, step 2 dropped, ckpt.pt at
    step 1; --resume gives the losses and weights of an uninterrupted run."""
    cmd = [sys.executable, "train.py", *LONG]
    code, out, err = stop_mid_step(cmd, tmp_path / "b")
    step = check_stopped(tmp_path / "b", 128)
    resume = shlex.join(["train.py", *LONG, "--out", str(tmp_path / "b"), "--resume"])
    assert code == 143 and err.splitlines() == [f"interrupted at step {step}: saved ckpt.pt; resume with: python {resume}"]
    assert f"step {step + 1} dropped after micro-batch " in out
    # the uninterrupted run and the resume side by side: one thread each, two cores (one after the other, one idled)
    runs = [subprocess.Popen(cmd + ["--out", str(tmp_path / folder), *extra], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            for folder, extra in (("a", []), ("b", ["--resume"]))]
    for p in runs:
        err = p.communicate(timeout=300)[1]
        assert p.returncode == 0, err[-2000:]
    same_run(tmp_path / "a", tmp_path / "b")


@pytest.mark.slow
def test_sigterm_mid_accumulation_under_torchrun(tmp_path):
    """SIGTERM to torch.distributed.run (it passes it to both gloo ranks) during step 2, 64 micro-batches a rank:
    both ranks stop at the same micro-batch boundary (else one would wait in a collective the other left, and be
    killed), well within torchrun's 30 s, ckpt.pt at step 1; --resume under torchrun equals an uninterrupted run."""
    cmd = [*TORCHRUN, "train.py", *LONG]
    code, out, err = stop_mid_step(cmd, tmp_path / "b")
    step = check_stopped(tmp_path / "b", 64)
    assert code != 0 and f"interrupted at step {step}: saved ckpt.pt; resume with: torchrun ... train.py" in err
    assert "SIGKILL" not in err and "exitcode  : -9" not in err, err[-3000:]
    for folder, extra in (("a", []), ("b", ["--resume"])):
        r = subprocess.run(cmd + ["--out", str(tmp_path / folder), *extra], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
    same_run(tmp_path / "a", tmp_path / "b")


def test_the_stop_flag_agrees_and_counts():
    """StopFlag: 0 until a signal, then its number; the micro-batches after it are counted from where it came."""
    flag = stopping.StopFlag()
    ranks = train.Ranks()
    assert flag.agreed(ranks) == 0
    flag.micro_done = 4
    before = signal.getsignal(signal.SIGINT)
    try:
        flag.handler(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGINT, before)
    flag.micro_done = 5
    assert flag.agreed(ranks) == signal.SIGTERM
    flag.dropped(step=3, accum=16)
    assert flag.record(signal.SIGTERM, 2) == {"signal": "SIGTERM", "step": 2, "dropped_step": 3,
                                              "micro_batches_done": 5, "micro_batches": 16, "after_signal": 1}
    assert flag.micro_done == 0
