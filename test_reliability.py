"""
Faults and bad input, across the scripts: what each gives. Two lists drive the tests and docs/reliability.md:
CASES (bad input: one line on stderr, its exit code, nothing written) and FAULTS (kills, signals, two writers,
full disks, broken files: one test each, registered by @fault). The page is generated from them, and a test
checks the committed page is what the generator writes:

    python -m pytest -q test_reliability.py
    python test_reliability.py --write-docs         # after changing a case or a fault: rewrite the page

Runs are in-process on the tiny model of test_train.py; one real process takes Ctrl-C.
"""
import errno
import importlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import common
import data
import mini
import profile_gpu
import train
from test_train import TINY, load_run, one_thread, run_main  # noqa: F401 (one_thread: one intra-op thread here too)

HERE = Path(__file__).resolve().parent
DOCS = HERE / "docs" / "reliability.md"
RUN = "runs/preln_ar32_lr3e-3_s42"                   # the run folder of TINY
TRAIN = TINY + ["--steps", "2", "--out", "{tmp}/runs"]
INIT = ["--init", "preln", "--layers", "2", "--width", "32", "--heads", "2", "--vocab", "257"]


class Pickled:
    """A checkpoint that would run a command when unpickled without weights_only."""
    def __reduce__(self):
        return os.system, ("echo this should never run",)


def shards(ids):
    """A shard folder of bytes-tokenizer shards (vocab 257) that holds `ids`, as made from fineweb-edu."""
    def make(tmp):
        folder = tmp / "shards"
        for split in ("val", "train"):
            data.write_shard(folder / f"{split}_000000.bin", np.array(ids), 257, 256)
        common.write_json(folder / "meta.json", {"config": {"source": "fineweb-edu", "tokenizer": "bytes",
                          "vocab_size": 257}, "n_tokens": 2 * len(ids), "shards": {
                          s: [{"file": f"{s}_000000.bin", "tokens": len(ids)}] for s in ("val", "train")}})
    return make


def official_checkpoint(tmp):
    """An official step folder whose .distcp file lost its second half."""
    from test_official import ours, write_checkpoint
    step = write_checkpoint(tmp / "step1", ours("preln"))
    (distcp,) = (step / "model_and_optim").glob("*.distcp")
    distcp.write_bytes(distcp.read_bytes()[:distcp.stat().st_size // 2])


# (script, bad input, argv ({tmp}: the test's folder), files made first ({path: text, bytes or None for a folder},
# or a function of the folder), exit code, what the one line on stderr says)
CASES = [
    # data
    ("data.py", "a Latin-1 .txt file", ["--source", "{tmp}/latin1.txt", "--tokenizer", "bytes", "--out", "{tmp}/o"],
     {"latin1.txt": "caf\xe9 au lait".encode("latin-1")}, 2, "latin1.txt: cannot read it as txt (UnicodeDecodeError"),
    ("data.py", "a malformed .jsonl line", ["--source", "{tmp}/a.jsonl", "--tokenizer", "bytes", "--out", "{tmp}/o"],
     {"a.jsonl": '\n{"text": "no end\n'}, 2, "a.jsonl:2: cannot read it as jsonl (JSONDecodeError"),
    ("data.py", 'a .jsonl row {"text": 5}', ["--source", "{tmp}/a.jsonl", "--tokenizer", "bytes", "--out", "{tmp}/o"],
     {"a.jsonl": '{"text": 5}\n'}, 2, "a.jsonl:1: no field 'text' holding text"),
    ("data.py", "a .jsonl row that is a bare number", ["--source", "{tmp}/a.jsonl", "--tokenizer", "bytes", "--out",
     "{tmp}/o"],
     {"a.jsonl": "5\n"}, 2, "a.jsonl:1: no field 'text' holding text"),
    ("data.py", "a .parquet file that is not one", ["--source", "{tmp}/a.parquet", "--tokenizer", "bytes", "--out",
     "{tmp}/o"], {"a.parquet": "text, not parquet"}, 2, "a.parquet: cannot read it as parquet"),
    ("data.py", "--seed -1", ["--source", "synthetic", "--seed", "-1"], {}, 2, "argument --seed: invalid"),
    ("diagnose.py", "a corrupt meta.json in the calibration shards", [*INIT, "--calib", "{tmp}/o"],
     {"o/meta.json": '{"config": '}, 2, "no readable meta.json in"),
    ("train.py", "a shard with ids outside the vocabulary", [*TRAIN, "--data", "fineweb-edu", "--tokenizer", "bytes",
     "--data-dir", "{tmp}/shards"], shards([1, 2, 300, 4] * 40), 2, "token id 300 is outside the vocabulary of 257"),
    # flags
    ("train.py", "--seed -1", [*TRAIN, "--seed", "-1"], {}, 2, "argument --seed: invalid"),
    ("train.py", "--seed 2^63", [*TRAIN, "--seed", str(2**63)], {}, 2, "argument --seed: invalid"),
    ("train.py", "--params 1e400", [*TRAIN, "--params", "1e400"], {}, 2, "--params '1e400' is not a count"),
    ("train.py", "--device bogus", [*TRAIN, "--device", "bogus"], {}, 2, "invalid choice: 'bogus'"),
    ("diagnose.py", "--device bogus", [*INIT, "--device", "bogus"], {}, 2, "--device 'bogus' is not a device"),
    ("official.py", "--device bogus", ["info", "{tmp}/step1", "--device", "bogus"], {}, 2, "is not a device"),
    ("official.py", "--batch-size 0", ["evaluate", "{tmp}/step1", "--batch-size", "0"], {}, 2,
     "argument --batch-size: invalid"),
    ("diagnose.py", "--init at a width of an odd head_dim", ["--init", "preln", "--width", "36", "--heads", "4"], {},
     2, "with an even head_dim"),
    ("train.py", "--ar nan", [*TRAIN, "--ar", "nan"], {}, 2, "argument --ar: invalid"),
    ("train.py", "--lr nan", [*TRAIN, "--lr", "nan"], {}, 2, "argument --lr: invalid"),
    ("train.py", "--lr inf", [*TRAIN, "--lr", "inf"], {}, 2, "argument --lr: invalid"),
    ("train.py", "--grad-clip nan", [*TRAIN, "--grad-clip", "nan"], {}, 2, "argument --grad-clip: invalid"),
    ("train.py", "--weight-decay -1", [*TRAIN, "--weight-decay", "-1"], {}, 2, "argument --weight-decay: invalid"),
    ("diagnose.py", "--causal-threshold nan", [*INIT, "--causal-threshold", "nan"], {}, 2, "--causal-threshold"),
    ("profile_gpu.py", "--ar nan", ["--analytic-only", "--ar", "nan"], {}, 2, "expected a count like 405M"),
    ("shapes.py", "--ar inf", ["--ar", "inf"], {}, 2, "argument --ar: invalid"),
    ("train.py", "--max-gap 100000 (no answer fits a sequence)", [*TRAIN, "--max-gap", "100000"], {}, 2,
     "a sequence could hold no answer"),
    ("official.py", "--max-tokens -5", ["evaluate", "{tmp}/step1", "--max-tokens", "-5"], {}, 2,
     "argument --max-tokens: invalid"),
    ("official.py", "--seq-len 0", ["evaluate", "{tmp}/step1", "--seq-len", "0"], {}, 2, "argument --seq-len: invalid"),
    ("diagnose.py", "--residual-args with a checkpoint", ["{tmp}/run", "--residual-args", '{"n_groups": 4}'], {}, 2,
     "--residual-args: for --init or an official checkpoint"),
    ("mini.py", "an unknown design in --designs", ["--designs", "preln,nope", "--out", "{tmp}/m"], {}, 2,
     "argument --designs: invalid"),
    ("mini.py", "a seed that is no number in --seeds", ["--seeds", "0,x", "--out", "{tmp}/m"], {}, 2,
     "argument --seeds: invalid"),
    # files
    ("train.py", "run.json that is a list", TRAIN, {f"{RUN}/run.json": "[]"}, 2, "is not a run log of train.py"),
    ("train.py", "run.json that is a folder", TRAIN, {f"{RUN}/run.json": None}, 2, "run.json is not a file"),
    ("train.py", "--out that is a file", TRAIN, {"runs": "a file"}, 2, "cannot write to"),
    ("diagnose.py", "a ckpt.pt that would run code when unpickled", ["{tmp}/run"], {"run/ckpt.pt": Pickled()}, 2,
     "not a depthbench checkpoint (UnpicklingError: it holds objects beyond tensors"),
    ("official.py", "a truncated .distcp file", ["info", "{tmp}/step1"], official_checkpoint, 2, "unreadable DCP data"),
    ("diagnose.py", "--out that is a folder", [*INIT, "--out", "{tmp}/d"], {"d": None}, 2, "--out {tmp}/d is a folder"),
    # absurd sizes
    ("train.py", "--seq-len 100000000", [*TRAIN, "--seq-len", "100000000"], {}, 2, "needs at least"),
    ("profile_gpu.py", "10^8 layers, --analytic-only", ["--analytic-only", "--shapes", "100000000x64"], {}, 2,
     "more than the 1024 blocks"),
    ("shapes.py", "10^5 layers of 10^15 parameters", ["--params", "1e15", "--layers", "100000"], {}, 2,
     "more than the 1024 blocks"),
    ("mini.py", "an empty item in --ar", ["--ar", "92,,9.1", "--out", "{tmp}/m"], {}, 2, "argument --ar: invalid"),
    ("mini.py", "a trailing comma in --designs", ["--designs", "preln,", "--out", "{tmp}/m"], {}, 2,
     "argument --designs: invalid"),
    ("mini.py", "an empty item in --seeds", ["--seeds", "0,,1", "--out", "{tmp}/m"], {}, 2, "argument --seeds: invalid"),
]

FAULTS = []  # (fault, what it gives, test), in the page's order


def fault(what, gives):
    """Register the decorated test as the one that checks `what` gives `gives`."""
    def register(test):
        FAULTS.append((what, gives, test.__name__))
        return test
    return register


def make(tmp, setup):
    if callable(setup):
        return setup(tmp)
    for rel, content in setup.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir()
        elif isinstance(content, Pickled):
            torch.save(content, path)
        else:
            path.write_bytes(content.encode() if isinstance(content, str) else content)


def files(tmp):
    """{path: bytes} of every file under tmp but the run folders' lock files."""
    return {p: p.read_bytes() for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("script, what, argv, setup, code, message", CASES, ids=[f"{c[0]} {c[1]}" for c in CASES])
def test_bad_input_is_one_line(tmp_path, capsys, script, what, argv, setup, code, message):
    """One line on stderr, prefixed by the script, saying what is wrong; the exit code; no file written or changed."""
    make(tmp_path, setup)
    before = files(tmp_path)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(script[:-3]).main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert (e.value.code, len(err.strip().splitlines())) == (code, 1), err
    assert err.startswith(f"{script}: error: ") and message.replace("{tmp}", str(tmp_path)) in err, err
    assert "weights_only" not in err  # never suggest loading a checkpoint unsafely
    assert files(tmp_path) == before


# ----------------------------------------------------------------------------- 1. finished means the final ckpt.pt

@fault("a kill during the final save (simulated: the last checkpoint's save fails where the old order had "
       "already written run.json)", "run.json does not say finished; --resume trains on from the last ckpt.pt "
       "(from step 0 when there is none) to the losses of an uninterrupted run")
@pytest.mark.parametrize("ckpt_every", [2, 100])
def test_finished_only_after_the_final_checkpoint(tmp_path, capsys, monkeypatch, ckpt_every):
    args = TINY + ["--steps", "4", "--eval-every", "2", "--ckpt-every", str(ckpt_every)]
    assert run_main(args + ["--out", str(tmp_path / "a")], capsys)[0] == 0
    save = common.save_checkpoint

    def dies_at_the_end(path, obj):
        if obj["step"] == 4:
            raise OSError(errno.EIO, "killed")
        save(path, obj)
    monkeypatch.setattr(common, "save_checkpoint", dies_at_the_end)
    code, _, err = run_main(args + ["--out", str(tmp_path / "b")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "killed" in err
    assert load_run(tmp_path / "b")["finished"] is False
    monkeypatch.undo()
    code, out, _ = run_main(args + ["--resume", "--out", str(tmp_path / "b")], capsys)
    assert code == 0 and ("resumed from" in out if ckpt_every == 2 else "starting from step 0" in out)
    a, b = load_run(tmp_path / "a"), load_run(tmp_path / "b")
    assert b["finished"] is True and [s["loss"] for s in b["steps"]] == [s["loss"] for s in a["steps"]]


@fault("run.json says finished, ckpt.pt is older or gone (a kill between the two saves of a train.py that wrote "
       "run.json first)", "not skipped: one note, then --resume continues from the ckpt.pt there is (to the same "
       "losses), and without a ckpt.pt the run trains again")
def test_a_finished_run_with_an_older_checkpoint_is_not_skipped(tmp_path, capsys):
    args = TINY + ["--steps", "4", "--eval-every", "2", "--out", str(tmp_path)]
    assert run_main(args + ["--max-steps", "2"], capsys)[0] == 0
    (run,) = tmp_path.iterdir()
    at_2 = (run / "ckpt.pt").read_bytes()
    assert run_main(args + ["--resume"], capsys)[0] == 0
    want = load_run(tmp_path)
    (run / "ckpt.pt").write_bytes(at_2)  # run.json finished at step 4, ckpt.pt at step 2
    code, out, _ = run_main(args + ["--resume"], capsys)
    assert code == 0 and "finished at step 4, but ckpt.pt is at step 2: not finished" in out and "resumed from" in out
    assert [s["loss"] for s in load_run(tmp_path)["steps"]] == [s["loss"] for s in want["steps"]]
    (run / "ckpt.pt").unlink()
    code, out, _ = run_main(args, capsys)
    assert code == 0 and "ckpt.pt is missing or unreadable: not finished" in out and "starting over" in out
    assert load_run(tmp_path)["finished"] is True and "skipping" in run_main(args, capsys)[1]


# ----------------------------------------------------------------------------- 2. one writer per run folder

@fault("two train.py on one run folder (the test holds the folder's lock); a lock left by a killed process",
       "the second: one line naming the holder (pid, host, command), exit 2, nothing written; a stale lock "
       "blocks nothing (flock ends with its process)")
def test_a_second_writer_is_refused_and_a_stale_lock_blocks_nothing(tmp_path, capsys):
    args = TINY + ["--steps", "2", "--out", str(tmp_path)]
    lock = common.lock_folder(tmp_path / RUN.split("/")[1])
    code, _, err = run_main(args, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"pid {os.getpid()} on {socket.gethostname()}" in err
    assert [p.name for p in (tmp_path / RUN.split("/")[1]).iterdir()] == [".lock"]
    lock.close()  # the lock file stays, holding our pid, as a killed process' would
    assert run_main(args, capsys)[0] == 0 and load_run(tmp_path)["finished"] is True


@fault("two writers of one file at once; a write that fails half-way (a full disk)",
       "each writer has a temp file of its own, so both complete and the file is whole; a failed write leaves the "
       "old file and no temp file")
def test_atomic_writes_never_collide_or_leave_temp_files(tmp_path):
    path = tmp_path / "run.json"
    common.write_atomic(path, "old")

    def slow(f):  # a second writer comes and goes while this one is half-way
        f.write(b"first")
        common.write_atomic(path, "second")
    common.write_atomic(path, slow)
    assert path.read_text() == "first" and os.listdir(tmp_path) == ["run.json"]

    def full(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError):
        common.write_atomic(path, full)
    assert path.read_text() == "first" and os.listdir(tmp_path) == ["run.json"]


@fault("mini.py with repeats in its lists (--designs preln,preln, --seeds 0,0, --ar 9.1,9.10)",
       "each run once: no two train.py on one folder")
def test_mini_drops_repeats():
    args = mini.build_parser().parse_args(["--designs", "preln,preln", "--seeds", "0,0", "--deep-seeds", "1,1",
                                           "--ar", "9.1,9.10", "--lr-sweep", "1e-2,1e-2"])
    args.probes, args.sweep = ["synthetic"], [float(lr) for lr in args.lr_sweep]
    labels = [label for _, label, _ in mini.sweep_jobs(args)]
    assert len(labels) == len(set(labels)) == 1
    args.lr, args.sweep = 3e-3, []                                  # --lr: every seed at it, no sweep
    labels = [label for _, label, _ in mini.seed_jobs(args)]
    assert len(labels) == len(set(labels)) == 1


# ----------------------------------------------------------------------------- 3. Ctrl-C and SIGTERM

@fault("Ctrl-C (SIGINT) or SIGTERM during training", "the step ends, ckpt.pt is saved, one line `interrupted at "
       "step N: saved ckpt.pt; resume with: python train.py ... --resume`, exit 130 / 143; resuming gives the "
       "uninterrupted losses")
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_and_exits(tmp_path, capsys, monkeypatch, sig, code):
    args = TINY + ["--steps", "4", "--ckpt-every", "100"]
    assert run_main(args + ["--out", str(tmp_path / "a")], capsys)[0] == 0
    step, before = train.optimizer_step, signal.getsignal(sig)

    def signalled(r):
        out = step(r)
        if r.step == 2:
            os.kill(os.getpid(), sig)
        return out
    monkeypatch.setattr(train, "optimizer_step", signalled)
    argv = args + ["--out", str(tmp_path / "b")]
    got, _, err = run_main(argv, capsys)
    assert got == code and err.splitlines() == [
        f"interrupted at step 2: saved ckpt.pt; resume with: python {shlex.join(['train.py', *argv, '--resume'])}"]
    assert signal.getsignal(sig) is before  # the handlers are put back
    assert torch.load(next((tmp_path / "b").glob("*/ckpt.pt")), weights_only=True)["step"] == 2
    monkeypatch.undo()
    assert run_main(argv + ["--resume"], capsys)[0] == 0
    assert [s["loss"] for s in load_run(tmp_path / "b")["steps"]] == [s["loss"] for s in load_run(tmp_path / "a")["steps"]]


@fault("a second Ctrl-C while the first one's step ends", "KeyboardInterrupt at once (the default handler is back)")
def test_a_second_ctrl_c_aborts_at_once(tmp_path, monkeypatch):
    def twice(r):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(train, "optimizer_step", twice)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train.main(TINY + ["--steps", "4", "--out", str(tmp_path)])
    assert signal.getsignal(signal.SIGINT) is before


@fault("Ctrl-C in a terminal (a real process)", "exit 130, one line on stderr and no traceback; ckpt.pt and "
       "run.json both at that step")
def test_ctrl_c_in_a_real_process(tmp_path):
    p = subprocess.Popen([sys.executable, "train.py", *TINY, "--steps", "100000", "--out", str(tmp_path)], cwd=HERE,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    for line in p.stdout:
        if line.startswith("step     2/"):
            break
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130 and len(err.strip().splitlines()) == 1, err
    step = int(re.match(r"interrupted at step (\d+): saved ckpt.pt; resume with: python train.py ", err)[1])
    assert torch.load(next(tmp_path.glob("*/ckpt.pt")), weights_only=True)["step"] == step
    assert load_run(tmp_path)["steps"][-1]["step"] == step


# ----------------------------------------------------------------------------- 4. writes that fail

@fault("the disk fills up at a save (simulated: the second checkpoint's write fails half-way with ENOSPC)",
       "one line, exit 2; no temp file is left and ckpt.pt is still the last good one")
def test_a_failed_save_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    save = torch.save

    def full_at_step_2(obj, f):
        if isinstance(obj, dict) and obj.get("step") == 2:
            f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        save(obj, f)
    monkeypatch.setattr(torch, "save", full_at_step_2)
    code, _, err = run_main(TINY + ["--steps", "4", "--ckpt-every", "1", "--out", str(tmp_path)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "No space left on device" in err
    (run,) = tmp_path.iterdir()
    assert sorted(p.name for p in run.iterdir()) == [".lock", "ckpt.pt", "run.json"]
    monkeypatch.undo()
    assert torch.load(run / "ckpt.pt", weights_only=True)["step"] == 1


@fault("a read-only output folder (simulated: os.access says it is not writable, as it does for a read-only "
       "file system)", "one line and exit 2 before the first step")
def test_a_read_only_folder_is_refused_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(common.os, "access", lambda path, mode: False)
    code, out, err = run_main(TINY + ["--steps", "2", "--out", str(tmp_path)], capsys)
    assert code == 2 and err.count("\n") == 1 and "cannot write to" in err and "not writable" in err
    assert "step " not in out


# ----------------------------------------------------------------------------- 5.-7. results that are odd

@fault("profile_gpu.py when every row fails to measure (simulated)", "exit 1 and a last line saying so")
def test_profile_fails_when_every_row_failed(capsys, monkeypatch):
    monkeypatch.setattr(profile_gpu, "peak_flops", lambda dev, dtype: 1e9)
    monkeypatch.setattr(profile_gpu, "run_measured", lambda jobs, dev: [{"error": "RuntimeError: no memory"}] * len(jobs))
    with pytest.raises(SystemExit) as e:
        profile_gpu.main(["--shapes", "2x64", "--residual", "preln,hc", "--device", "cpu", "--vocab", "64"])
    assert e.value.code == 1 and "every row failed" in capsys.readouterr().err.strip().splitlines()[-1]


@fault("mini.py after a diagnose.json was corrupted", "it is treated as missing: diagnosed again, the summary written")
def test_mini_redoes_a_corrupt_diagnosis(tmp_path, monkeypatch):
    run = tmp_path / "synthetic" / "preln_ar32"
    common.write_json(run / "run.json", {"finished": True, "config": {"residual": "preln", "n_layer": 2,
                      "d_model": 64, "lr": 3e-3}, "final": {"val_loss": 1.0}, "wall_s": 1.0,
                      "evals": [{"per_level": {"1": {"acc": 0.5}}}]})
    (run / "diagnose.json").write_text('{"causal_score": ')
    pools = []
    monkeypatch.setattr(mini, "run_pool", lambda jobs, n, what, log_dir: pools.append((what, jobs)) or [])
    monkeypatch.setattr(mini.subprocess, "run", lambda *a, **k: None)
    assert mini.main(["--designs", "preln", "--ar", "32", "--seeds", "0", "--out", str(tmp_path)]) == 0
    assert pools[-1][0] == "diagnose" and [label for label, _ in pools[-1][1]] == ["diagnose preln_ar32"]
    assert "| preln | 2 | 64 |" in (tmp_path / "summary.md").read_text()


@fault("a corrupt meta.json in data.py's output folder", "the shards are made again")
def test_a_corrupt_meta_json_is_rebuilt(tmp_path):
    for name in ("a", "b"):
        common.write_atomic(tmp_path / "texts" / f"{name}.txt", "some text " * 20)
    common.write_atomic(tmp_path / "o" / "meta.json", "[1, 2")
    meta = data.prepare(str(tmp_path / "texts"), tmp_path / "o", "bytes", val_tokens=1)
    assert data.load_meta(tmp_path / "o") == meta and meta["n_tokens"] == 2 * 201


# ----------------------------------------------------------------------------- the page

def render():
    """docs/reliability.md from FAULTS and CASES."""
    lines = ["# Faults and bad input", "",
             "What the scripts do when something goes wrong. Generated from the tests' own lists by `python "
             "test_reliability.py --write-docs` (test_reliability.py: each fault has its test, each bad input is "
             "run as shown), and a test checks this page is what the generator writes.", "",
             "## Faults", "", "| fault | what it gives | test |", "|---|---|---|"]
    lines += [f"| {what} | {gives} | `{test}` |" for what, gives, test in FAULTS]
    lines += ["", "## Bad input", "",
              "Each: the exit code, one line on stderr starting `<script>: error:` that contains the text shown, no "
              "traceback, and no file written or changed. Paths are relative to a fresh folder; `<tiny run>` is "
              f"`{shlex.join(TRAIN).replace('{tmp}/', '')}`, `<init>` is `{shlex.join(INIT)}`.", "",
              "| script | bad input | arguments | exit | the line contains |", "|---|---|---|---|---|"]
    for script, what, argv, _, code, message in CASES:
        for name, head in (("<tiny run>", TRAIN), ("<init>", INIT)):
            argv = [name, *argv[len(head):]] if argv[:len(head)] == head else argv
        command = " ".join(a if a.startswith("<") else shlex.quote(a.replace("{tmp}/", "")) for a in argv)
        lines.append(f"| {script} | {what} | `{command}` | {code} | {message.replace('{tmp}/', '')} |")
    return "\n".join(lines) + "\n"


def test_the_docs_page_is_generated_from_these_lists():
    assert DOCS.read_text(encoding="utf-8") == render(), "run: python test_reliability.py --write-docs"


if __name__ == "__main__" and "--write-docs" in sys.argv:
    DOCS.write_text(render(), encoding="utf-8")
    print(f"wrote {DOCS}")
