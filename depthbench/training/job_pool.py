"""
job_pool.py: mini.py's process pool. Its jobs (label, argv) run --jobs at a time with one thread each, each with its
log locked for it (a run of a killed suite keeps its log while it lives), a progress line per finished job with the
phase's ETA, and no run left behind however the pool ends (docs/reliability.md#process-lifetime). A job whose run
folder holds a done run (found_done) is not started again.
"""
import os
import signal
import subprocess
import time
from typing import NamedTuple

import numpy as np

from depthbench.files import common, runlog
from depthbench.files.common import fail

LOCK_WAIT_S = 60  # how long a job waits for a live process (a train.py of a killed mini.py, saving) to leave its files


def found_done(folder):
    """'done before' or 'diverged' when runlog.run_state says the job's run folder (check_jobs': of the job's
    settings) holds a done run; None otherwise (not done, or not a train.py job). Such a job is not started again:
    train.py would find the same and skip it, after seconds of start-up."""
    if folder is None:
        return None
    return {"finished": "done before", "diverged": "diverged"}.get(runlog.run_state(folder))


def holder_of(log, folder):
    """Who holds a job's files: its log `log` (an open file; flock'd here when free, the lock then shared with the
    child that writes it, so it lasts while either lives) or its run folder (train.py's lock) -> what is held by
    whom, in words, or None when both are free."""
    import fcntl
    holder = folder and common.lock_holder(folder)
    if holder:
        return f"{folder} is in use by {holder}"
    try:
        fcntl.flock(log, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return f"{log.name} is held by a live process (a run of an earlier mini.py, ending?)"
    return None


def open_log(path, folder):
    """The job's log, locked for it and emptied. While a live process holds the log or the run folder (a train.py of
    a killed mini.py still saving, or one started by hand), one line says so and the job waits, up to LOCK_WAIT_S;
    then one line and exit 2 (run_pool's clean-up stops this phase's runs): a live run's files are never written."""
    deadline = None
    while True:
        log = open(path, "a+")  # appending: nothing is cut before the lock is ours
        held = holder_of(log, folder)
        if not held:
            log.truncate(0)
            return log
        log.close()
        if deadline is None:
            deadline = time.time() + LOCK_WAIT_S
            print(f"mini.py: {held}: waiting up to {LOCK_WAIT_S} s for it to end", flush=True)
        if time.time() > deadline:
            fail("mini.py", f"{held}, still after {LOCK_WAIT_S} s: its files are not written while it lives; wait for "
                 "it to end, or stop it, then run the same command again")
        time.sleep(0.5)


def log_path(log_dir, label):
    """The log of the job `label` in log_dir: logs/text_preln_ar9.1_seed0_lr3e-3.log."""
    return log_dir / (label.replace(" ", "_").replace("=", "") + ".log")


def outcome(returncode, log_path):
    """What a finished job came to, from its exit status and log: 'ok', 'done before' (train.py found it finished
    and skipped it), 'diverged' (a result: train.py exits 1 and says so; also when found diverged before), or
    'FAILED' (the log says why)."""
    try:
        tail = log_path.read_text(errors="replace")[-4000:]
    except OSError:
        tail = ""
    if "diverged already" in tail or (returncode == 1 and " diverged at step " in tail):
        return "diverged"
    if returncode != 0:
        return "FAILED"
    return "done before" if "finished already" in tail else "ok"


class Progress(NamedTuple):
    """A phase of run_pool, for its progress lines."""
    what: str       # the phase's name: "sweep", "sweep edge", "train", "diagnose"
    total: int      # its number of jobs
    n: int          # jobs at a time
    t0: float       # when it started (time.time())


def progress_line(phase, done, what_came, took):
    """'[sweep 3/30] <label>: ok in 155 s | elapsed 6.9 min, ETA 62.2 min for this phase': the ETA is the mean time
    of the runs this mini.py trained so far (in any phase; not the ones found done before) x the phase's jobs left /
    the jobs at a time. Before a run has trained (a resumed suite skipping what is done) there is no ETA to give."""
    elapsed = time.time() - phase.t0
    eta = "ETA after the first run it trains"
    if took:
        eta = f"ETA {np.mean(took) * (phase.total - done) / phase.n / 60:.1f} min for this phase"
    return f"[{phase.what} {done}/{phase.total}] {what_came} | elapsed {elapsed / 60:.1f} min, {eta}"


def run_pool(jobs, folders, n, what, log_dir, took=None):
    """Run (label, argv) jobs, n at a time, one thread each; print the phase's number of runs first, then a progress
    line per finished job. folders: {label: the job's run folder (None: not a train.py job)}, each holding nothing or
    a run of the job's settings (mini.check_jobs). `took`: the seconds of the runs trained so far (this phase adds to
    it; the ETA reads it). Returns the labels that failed (their logs say why); a diverged run is a result, not a
    failure."""
    log_dir.mkdir(parents=True, exist_ok=True)
    if jobs:
        print(f"[{what}] {len(jobs)} runs, {n} at a time (a run found done before is skipped in seconds)", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    phase, pending, running, failed = Progress(what, len(jobs), n, time.time()), list(jobs), {}, []
    took = [] if took is None else took
    try:
        while pending or running:
            while pending and len(running) < n:
                label, argv = pending.pop(0)
                path = log_path(log_dir, label)
                state = found_done(folders[label])
                if state:  # done in an earlier call: its log stays as it is
                    done = len(jobs) - len(pending) - len(running)
                    print(progress_line(phase, done, f"{label}: {state} (found done)", took), flush=True)
                    continue
                log = open_log(path, folders[label])
                # the child ends with this process, however it dies (on Linux; common.end_with_parent)
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=common.end_with_parent())
                running[proc] = (label, log, path, time.time())
            for proc in [p for p in running if p.poll() is not None]:
                label, log, path, start = running.pop(proc)
                log.close()
                state, seconds = outcome(proc.returncode, path), time.time() - start
                if state == "FAILED":
                    failed.append(label)
                if state != "done before":
                    took.append(seconds)
                done = len(jobs) - len(pending) - len(running)
                print(progress_line(phase, done, f"{label}: {state} in {seconds:.0f} s", took), flush=True)
            time.sleep(0.2)
    except BaseException:  # Ctrl-C, SIGTERM (common.one_line_faults) or a bug: no run is left behind
        stop_runs(running)
        raise
    return failed


def stop_runs(running, grace=300):
    """Ask each running train.py to stop (SIGTERM: it stops at its next micro-batch and keeps its last step's ckpt.pt,
    so rerunning the suite resumes it), wait for it up to `grace` seconds, then kill it; close the logs."""
    for proc in running:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.time() + grace
    for proc, (_, log, _, _) in running.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
