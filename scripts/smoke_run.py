"""How scripts/gpu_smoke.py runs its checks: the smoke's state (`Smoke`), each command as its own process group
within the check's budget and the whole one (`run`), a failed command's reason (`why`), and one check recorded in
summary.json (`check`). Split from gpu_smoke.py, which holds the checks themselves and their order."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from depthbench.files.common import write_json

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Smoke:
    out: Path                  # $OUT: summary.json, smoke.log, kernels.json, table.md, nothing else
    work: Path                 # scratch run folders, removed at the end
    tiny: bool                 # CPU, toy shapes, no compile
    ngpu: int                  # GPUs detected (0 with --tiny)
    deadline: float            # time.monotonic() at which the budget is spent
    summary: dict = field(default_factory=dict)  # what summary.json holds, rewritten after every check
    stage_deadline: float = float("inf")         # time.monotonic() at which the running check's own budget is spent
    bases: dict = field(default_factory=dict)    # micro-batch -> Pre-LN's profile_gpu row (the card's ratio base)


@dataclass
class Result:
    rc: int | None             # exit status; None: killed at the budget
    text: str                  # stdout and stderr together
    seconds: float             # wall time of the command


def left(s):
    """Seconds left to the running check: the whole budget's rest, or its own (STAGE_CAPS), whichever ends first."""
    return min(s.deadline, s.stage_deadline) - time.monotonic()


def log(s, text):
    with open(s.out / "smoke.log", "a") as f:
        f.write(text)


def save(s):
    s.summary["elapsed_s"] = round(s.summary["budget_s"] - (s.deadline - time.monotonic()), 1)
    write_json(s.out / "summary.json", s.summary, strict=True)


def run(s, argv, env=None, cap=None):
    """argv from the repository root, its own process group, killed (TERM, then KILL) when the budget ends (or
    after cap seconds, where given)."""
    t0 = time.monotonic()
    log(s, f"\n$ {' '.join(argv)}\n")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        text, rc = proc.communicate(timeout=max(min(left(s), cap or float("inf")), 1))[0], proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # train.py saves and exits; torchrun passes it on
        try:
            text = proc.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text = proc.communicate()[0]
        text, rc = text + "\n[killed: the smoke budget (or the command's cap) is spent]\n", None
    log(s, text)
    return Result(rc, text, time.monotonic() - t0)


def why(res):
    """A null's reason from a failed command: the budget, or its last line."""
    if res.rc is None:
        return f"killed after {res.seconds:.0f} s (the budget or the command's cap)"
    lines = [line for line in res.text.strip().splitlines() if line.strip()] or ["no output"]
    return f"exit {res.rc}: {lines[-1][:300]}"


def check(s, name, fn, cap=float("inf")):
    """Run one check within its own budget (cap seconds), record its status and time, and write summary.json."""
    t0 = time.monotonic()
    s.stage_deadline = t0 + cap
    try:
        status = fn(s) or "ok"
    except Exception as e:  # one broken check must not lose the others
        status = f"error: {type(e).__name__}: {e}"[:300]
    finally:
        s.stage_deadline = float("inf")
    s.summary["checks"].append({"check": name, "status": status, "seconds": round(time.monotonic() - t0, 1)})
    save(s)
    line = f"ok    {name:<14} {time.monotonic() - t0:6.0f} s"
    if status != "ok":
        line = f"FAIL  {name:<14} {time.monotonic() - t0:6.0f} s  {status}"
    print(line, flush=True)
