"""
Faults and bad input, across the scripts: what each gives. Two lists drive the tests and docs/reliability.md:
CASES (bad input: one line on stderr, its exit code, nothing written) and FAULTS (kills, signals, two writers,
full disks, broken files: one test each, registered by @fault). The page is generated from them, and a test
checks the committed page is what the generator writes:

    python -m pytest -q tests/test_reliability.py
    python tests/test_reliability.py --write-docs         # after changing a case or a fault: rewrite the page

Runs are in-process on the tiny model of tests/test_train.py; one real process takes Ctrl-C.
"""
import errno
import importlib
import os
import re
import json
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for a direct run (--write-docs)
import numpy as np  # noqa: E402
import pytest
import torch

from depthbench.files import common, runlog
from depthbench.training import job_pool
import data
import mini
import profile_gpu
import train
from test_train import TINY, load_run, one_thread, run_json, run_main  # noqa: F401 (one_thread: one thread here too)

ROOT = Path(__file__).resolve().parents[1]  # the repository root
DOCS = ROOT / "docs" / "reliability.md"
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
    ("depthbench.files.official", "--device bogus", ["info", "{tmp}/step1", "--device", "bogus"], {}, 2, "is not a device"),
    ("depthbench.files.official", "--batch-size 0", ["evaluate", "{tmp}/step1", "--batch-size", "0"], {}, 2,
     "argument --batch-size: invalid"),
    ("diagnose.py", "--init at a width of an odd head_dim", ["--init", "preln", "--width", "36", "--heads", "4"], {},
     2, "with an even head_dim"),
    ("train.py", "--ar nan", [*TRAIN, "--ar", "nan"], {}, 2, "argument --ar: invalid"),
    ("train.py", "--lr nan", [*TRAIN, "--lr", "nan"], {}, 2, "argument --lr: invalid"),
    ("train.py", "--lr inf", [*TRAIN, "--lr", "inf"], {}, 2, "argument --lr: invalid"),
    ("train.py", "--grad-clip nan", [*TRAIN, "--grad-clip", "nan"], {}, 2, "argument --grad-clip: invalid"),
    ("train.py", "--weight-decay -1", [*TRAIN, "--weight-decay", "-1"], {}, 2, "argument --weight-decay: invalid"),
    ("diagnose.py", "--causal-threshold nan", [*INIT, "--causal-threshold", "nan"], {}, 2, "--causal-threshold"),
    ("diagnose.py", "an unknown zero-shot task in --tasks", [*INIT, "--metrics", "zeroshot", "--tasks", "piqa,mmlu"], {},
     2, "--tasks: choose from openbookqa, winogrande"),
    ("profile_gpu.py", "--ar nan", ["--analytic-only", "--ar", "nan"], {}, 2, "--ar 'nan': expected positive numbers"),
    ("shapes.py", "--ar inf", ["--ar", "inf"], {}, 2, "argument --ar: invalid"),
    ("train.py", "--max-gap 100000 (no answer fits a sequence)", [*TRAIN, "--max-gap", "100000"], {}, 2,
     "a sequence could hold no answer"),
    ("depthbench.files.official", "--max-tokens -5", ["evaluate", "{tmp}/step1", "--max-tokens", "-5"], {}, 2,
     "argument --max-tokens: invalid"),
    ("depthbench.files.official", "--seq-len 0", ["evaluate", "{tmp}/step1", "--seq-len", "0"], {}, 2, "argument --seq-len: invalid"),
    ("diagnose.py", "--residual-args with a checkpoint", ["{tmp}/run", "--residual-args", '{"n_groups": 4}'], {}, 2,
     "--residual-args: for --init or an official checkpoint"),
    ("train.py", "an AttnRes top-k fraction above 1", [*TRAIN, "--residual", "attnres", "--residual-args",
     '{"topk_fraction": 1.5}'], {}, 2, "AttnRes topk_fraction must be in (0, 1], got 1.5"),
    ("train.py", "a hybrid whose deep design is not cross-layer", [*TRAIN, "--residual", "hybrid", "--residual-args",
     '{"deep": "keel"}'], {}, 2, "hybrid deep must be one of hc, mhc, attnres"),
    ("diagnose.py", "an unknown Block AttnRes grouping", ["--init", "block_attnres", "--layers", "2", "--width", "32",
     "--heads", "2", "--residual-args", '{"grouping": "tripling"}'], {}, 2,
     "--residual-args: Block AttnRes grouping must be 'even' or 'doubling', got 'tripling'"),
    ("mini.py", "an unknown design in --designs", ["--designs", "preln,nope", "--out", "{tmp}/m"], {}, 2,
     "argument --designs: invalid"),
    ("mini.py", "a seed that is no number in --seeds", ["--seeds", "0,x", "--out", "{tmp}/m"], {}, 2,
     "argument --seeds: invalid"),
    # files
    ("train.py", "run.json that is a list", TRAIN, {f"{RUN}/run.json": "[]"}, 2,
     "run.json: not a run log of train.py: it is a list, not an object; move it away"),
    ("train.py", "run.json that is a folder", TRAIN, {f"{RUN}/run.json": None}, 2, "run.json is not a file"),
    ("train.py", "--out that is a file", TRAIN, {"runs": "a file"}, 2, "cannot write to"),
    ("diagnose.py", "a ckpt.pt that would run code when unpickled", ["{tmp}/run"], {"run/ckpt.pt": Pickled()}, 2,
     "not a depthbench checkpoint (UnpicklingError: it holds objects beyond tensors"),
    ("depthbench.files.official", "a truncated .distcp file", ["info", "{tmp}/step1"], official_checkpoint, 2, "unreadable DCP data"),
    ("diagnose.py", "--out that is a folder", [*INIT, "--out", "{tmp}/d"], {"d": None}, 2, "--out {tmp}/d is a folder"),
    ("diagnose.py", "--zeroshot-data that is a file", [*INIT, "--metrics", "zeroshot", "--zeroshot-data", "{tmp}/z"],
     {"z": "a file"}, 2, "--zeroshot-data {tmp}/z: not a folder"),
    # absurd sizes
    ("train.py", "--seq-len 100000000", [*TRAIN, "--seq-len", "100000000"], {}, 2, "needs at least"),
    ("profile_gpu.py", "10^8 layers, --analytic-only", ["--analytic-only", "--shapes", "100000000x64"], {}, 2,
     "more than the 1024 blocks"),
    ("shapes.py", "10^5 layers of 10^11 parameters", ["--params", "1e11", "--layers", "100000"], {}, 2,
     "more than the 1024 blocks"),
    ("mini.py", "an empty item in --ar", ["--ar", "92,,9.1", "--out", "{tmp}/m"], {}, 2, "argument --ar: invalid"),
    ("mini.py", "a trailing comma in --designs", ["--designs", "preln,", "--out", "{tmp}/m"], {}, 2,
     "argument --designs: invalid"),
    ("mini.py", "an empty item in --seeds", ["--seeds", "0,,1", "--out", "{tmp}/m"], {}, 2, "argument --seeds: invalid"),
    ("diagnose.py", "a trailing comma in --metrics", ["--init", "preln", "--metrics", "angular,", "--out",
     "{tmp}/d.json"], {}, 2, "argument --metrics: invalid comma-separated str value"),
    ("profile_gpu.py", "an empty item in --shapes", ["--shapes", "2x64,,4x32", "--analytic-only"], {}, 2,
     "--shapes '2x64,,4x32': an empty item"),
    ("profile_gpu.py", "an empty item in --residual", ["--residual", "preln,,hc", "--analytic-only", "--shapes", "2x64"],
     {}, 2, "--residual 'preln,,hc': an empty item"),
]

# ----------------------------------------------------------------------------- issue 31's bad input (own block)

def truncated_checkpoint(tmp):
    """A run folder whose ckpt.pt is cut off after its first 1,000 bytes."""
    ckpt = tmp / "run" / "ckpt.pt"
    common.save_checkpoint(ckpt, {"model": {"w": torch.zeros(1000)}, "model_config": {}, "config": {}, "step": 1})
    ckpt.write_bytes(ckpt.read_bytes()[:1000])


ONE_TXT = {"a.txt": "x" * 99}  # one document of 100 bytes tokens (EOT included)
CASES += [
    ("data.py", "--out under a plain file", ["--source", "{tmp}/a.txt", "--tokenizer", "bytes", "--out", "{tmp}/f/x"],
     {**ONE_TXT, "f": "a file"}, 2, "cannot write {tmp}/f/x: {tmp}/f is a file, not a folder (ENOTDIR)"),
    ("data.py", "--out that is a file", ["--source", "{tmp}/a.txt", "--tokenizer", "bytes", "--out", "{tmp}/f"],
     {**ONE_TXT, "f": "a file"}, 2, "cannot write {tmp}/f: {tmp}/f is a file, not a folder (EEXIST)"),
    ("data.py", "one .txt file, --val-tokens above its tokens", ["--source", "{tmp}/a.txt", "--tokenizer", "bytes",
     "--out", "{tmp}/o", "--val-tokens", "1000"], ONE_TXT, 2,
     "validation (--val-tokens 1,000) would take all 100 tokens of the source, leaving none for training; lower "
     "--val-tokens"),
    ("diagnose.py", "--out under a plain file", [*INIT, "--metrics", "erank", "--num-samples", "2", "--seq-len", "8",
     "--out", "{tmp}/f/d.json"], {"f": "a file"}, 2, "--out {tmp}/f/d.json: {tmp}/f is a file, not a folder"),
    ("profile_gpu.py", "--out under a plain file", ["--analytic-only", "--shapes", "2x64", "--vocab", "64", "--out",
     "{tmp}/f/p.json"], {"f": "a file"}, 2, "--out {tmp}/f/p.json: {tmp}/f is a file, not a folder"),
    ("diagnose.py", "a truncated ckpt.pt", ["{tmp}/run"], truncated_checkpoint, 2,
     "run/ckpt.pt (1,000 bytes): truncated or not a depthbench checkpoint"),
    # needs the integrator's train.py --val-tokens (passed to data.prepare)
    ("train.py", "one .txt file, --val-tokens above its tokens", [*TRAIN, "--data", "{tmp}/a.txt", "--tokenizer",
     "bytes", "--data-dir", "{tmp}/d", "--val-tokens", "1000"], ONE_TXT, 2,
     "validation (--val-tokens 1,000) would take all 100 tokens"),
]


# ----------------------------------------------------------------------------- export.py's bad input (issue 41)

def run_folder(residual, L=3, files=None):
    """A finished run folder {tmp}/run of a small random `residual` model (as train.py writes it), and `files`."""
    def make_it(tmp):
        from test_export import make_run
        make_run(tmp / "run", residual, L=L)
        for rel, text in (files or {}).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
    return make_it


EXPORT = ["--format", "official", "--out", "{tmp}/o"]
CASES += [
    ("export.py", "a path that holds no checkpoint", ["{tmp}/nothing.pt", *EXPORT], {}, 2,
     "{tmp}/nothing.pt: no checkpoint (give a run folder holding ckpt.pt, a .pt file or a suite folder)"),
    ("export.py", "a .pt file that is not a checkpoint", ["{tmp}/a.pt", *EXPORT], {"a.pt": "text"}, 2,
     "truncated or not a depthbench checkpoint"),
    ("export.py", "--format hf of an HC run", ["{tmp}/run", "--format", "hf", "--out", "{tmp}/o"], run_folder("hc"), 2,
     "a hc run has no LlamaForCausalLM form (only Pre-LN is one); use --format official"),
    ("export.py", "--format official of Block AttnRes in groups of unequal size", ["{tmp}/run", *EXPORT],
     run_folder("block_attnres", L=5), 2, "n_groups 8 over 10 sublayers makes groups of unequal size"),
    ("export.py", "--out that holds a file", ["{tmp}/run", *EXPORT], run_folder("preln", files={"o/notes.txt": "x"}),
     2, "--out {tmp}/o exists and is not empty; give a new folder (nothing is overwritten)"),
    ("export.py", "--out under a plain file", ["{tmp}/run", "--format", "official", "--out", "{tmp}/f/o"],
     run_folder("preln", files={"f": "a file"}), 2, "--out {tmp}/f/o: {tmp}/f is a file, not a folder"),
    ("export.py", "a suite folder without a run", ["{tmp}/suite", *EXPORT], {"suite": None}, 2,
     "no finished run to export (no run folder holding ckpt.pt under it)"),
    ("export.py", "--format onnx", ["{tmp}/run", "--format", "onnx", "--out", "{tmp}/o"], {}, 2,
     "argument --format: invalid choice: 'onnx'"),
]

# ----------------------------------------------------------------------------- issue 42: every option applies or is
#                                                                                refused

MODULES = {"gpu_smoke.py": "scripts.gpu_smoke",  # a script outside the root: the module it is imported as
           "paired_intervals.py": "scripts.paired_intervals"}
TEXT = ["--data", "{tmp}/a.txt", "--tokenizer", "bytes"]
MINI = ["--out", "{tmp}/m"]
CASES += [
    ("train.py", "--val-tokens with the synthetic task", [*TRAIN, "--val-tokens", "100"], {}, 2,
     "--val-tokens does not apply to the synthetic task"),
    ("train.py", "--tokenizer and --data-dir with the synthetic task", [*TRAIN, "--tokenizer", "bytes", "--data-dir",
     "{tmp}/d"], {}, 2, "--tokenizer, --data-dir do not apply to the synthetic task"),
    ("train.py", "--max-gap and --group with real data", [*TRAIN, *TEXT, "--max-gap", "2", "--group", "s4"], ONE_TXT, 2,
     "--max-gap, --group do not apply to real data (--data {tmp}/a.txt)"),
    ("train.py", "--gpu-mem without --dry-run", [*TRAIN, "--gpu-mem", "80"], {}, 2,
     "--gpu-mem is what --dry-run plans for: give it with --dry-run"),
    ("train.py", "--compile-scope without compiling", [*TRAIN, "--compile-scope", "model"], {}, 2,
     "--compile-scope applies to a compiled run"),
    ("train.py", "--print-grid with a run's options", ["--suite", "400m", "--print-grid", "--seed", "1", "--steps", "5"],
     {}, 2, "--seed, --steps do not apply to --print-grid"),
    ("train.py", "an unknown --schedule", [*TRAIN, "--schedule", "linear"], {}, 2,
     "argument --schedule: invalid choice: 'linear'"),
    ("profile_gpu.py", "--bench --quick with --analytic-only", ["--bench", "--quick", "--analytic-only"], {}, 2,
     "--analytic-only does not apply to --bench"),
    ("profile_gpu.py", "--bench --quick with --shapes", ["--bench", "--quick", "--shapes", "2x64"], {}, 2,
     "--shapes does not apply to --bench"),
    ("profile_gpu.py", "--bench --quick with --json and --out", ["--bench", "--quick", "--json", "--out",
     "{tmp}/p.json"], {}, 2, "--out, --json do not apply to --bench"),
    ("profile_gpu.py", "--bench --quick with --device cuda", ["--bench", "--quick", "--device", "cuda"], {}, 2,
     "--device does not apply to --bench"),
    ("profile_gpu.py", "--quick without --bench", ["--quick", "--analytic-only", "--shapes", "2x64"], {}, 2,
     "--quick narrows --bench: give it with --bench"),
    ("mini.py", "a design twice in --design-lr", ["--design-lr", "preln=1e-3,preln=1e-2", *MINI], {}, 2,
     "--design-lr names preln twice"),
    ("mini.py", "--design-lr for a design the command does not run", ["--designs", "preln", "--design-lr", "hc=1e-3",
     *MINI], {}, 2, "--design-lr hc: not a design this command runs (preln)"),
    ("mini.py", "--report on an empty folder", ["--report", *MINI], {"m": None}, 2,
     "--report: {tmp}/m holds no run of the synthetic probe"),
    ("mini.py", "--report on a mistyped folder", ["--report", "--out", "{tmp}/typo"], {}, 2,
     "--report: {tmp}/typo holds no run"),
    ("mini.py", "--report with --dry-run", ["--report", "--dry-run", *MINI], {}, 2,
     "argument --dry-run: not allowed with argument --report"),
    ("mini.py", "--lr with --lr-sweep", ["--lr", "3e-3", "--lr-sweep", "1e-3,1e-2", *MINI], {}, 2,
     "--lr trains every run at one LR, no sweep"),
    ("mini.py", "--lr with --full-sweep", ["--lr", "3e-3", "--full-sweep", *MINI], {}, 2,
     "--lr-sweep and --full-sweep do not apply"),
    ("mini.py", "--full-sweep with no sweep", ["--full-sweep", "--lr-sweep", "", *MINI], {}, 2,
     "--full-sweep widens the LR sweep, but --lr-sweep '' asks for none"),
    ("mini.py", "--synthetic-designs without the synthetic probe", ["--probes", "text", "--text", "{tmp}/a.txt",
     "--synthetic-designs", "hc", *MINI], ONE_TXT, 2, "--synthetic-designs applies to the synthetic probe"),
    ("mini.py", "--text without the text probe", ["--probes", "synthetic", "--text", "{tmp}/a.txt", *MINI], ONE_TXT, 2,
     "--text is the text probe's corpus"),
    ("diagnose.py", "--token-data-glob on a file that is no token shard (an odd size)", [*INIT, "--metrics", "erank",
     "--num-samples", "2", "--seq-len", "8", "--token-data-glob", "{tmp}/odd.bin"], {"odd.bin": b"abc"}, 2,
     "--token-data-glob {tmp}/odd.bin: not token shards"),
    ("gpu_smoke.py", "--budget -5", ["--tiny", "--budget", "-5", "--out", "{tmp}/s"], {}, 2,
     "argument --budget: invalid number of seconds > 0 value: '-5'"),
    ("gpu_smoke.py", "--out that is a file", ["--tiny", "--budget", "10", "--out", "{tmp}/f"], {"f": "a file"}, 2,
     "--out {tmp}/f: {tmp}/f is a file, not a folder"),
    ("plot.py", "--out under a plain file (checked before any figure)", ["{tmp}/runs", "--out", "{tmp}/f/figs"],
     {"runs": None, "f": "a file"}, 2, "--out '{tmp}/f/figs': {tmp}/f is a file, not a folder"),
    ("paired_intervals.py", "a summary.md that does not exist", ["{tmp}/none.md"], {}, 2,
     "{tmp}/none.md: cannot read it (FileNotFoundError)"),
    ("paired_intervals.py", "a summary.md without the older per-cell table (one written since issue 43)",
     ["{tmp}/s.md"], {"s.md": "# Mini-DepthBench summary\n\n| design | L |\n|---|---|\n| hc | 2 |\n"}, 2,
     "{tmp}/s.md: no per-cell table with a column 'Δ vs Pre-LN paired: mean [range], lower on'"),
]

# ----------------------------------------------------------------------------- issue 51: every file read by type
#                                                                                (tests/test_first_day.py: the rest)

def edited_run(residual, change):
    """A finished run folder {tmp}/run (tests/test_export.py's) whose ckpt.pt is changed by change(ckpt)."""
    def make_it(tmp):
        from test_export import make_run
        make_run(tmp / "run", residual)
        ckpt = torch.load(tmp / "run" / "ckpt.pt", weights_only=True)
        change(ckpt)
        torch.save(ckpt, tmp / "run" / "ckpt.pt")
    return make_it


def hc_weights(ckpt):
    """HC's weights under the run's Pre-LN model_config."""
    from model import GPT, GPTConfig
    ckpt["model"] = GPT(GPTConfig(**{**ckpt["model_config"], "residual": "hc"})).state_dict()


ZEROSHOT = [*INIT, "--tokenizer", "bytes", "--metrics", "zeroshot", "--zeroshot-data", "{tmp}/z", "--tasks", "piqa"]
PIQA = '{"goal": "g", "sol1": "a", "sol2": "b", "label": 0}\n'
CASES += [
    ("diagnose.py", "--zeroshot-data with a malformed JSONL line", ZEROSHOT, {"z/piqa.jsonl": PIQA + '{"goal": \n'},
     2, "--zeroshot-data: {tmp}/z/piqa.jsonl:2: not JSON (JSONDecodeError"),
    ("diagnose.py", "--zeroshot-data with a task file of no items", ZEROSHOT, {"z/piqa.jsonl": "\n"}, 2,
     "--zeroshot-data: {tmp}/z/piqa.jsonl: no items (one JSON object per line)"),
    ("diagnose.py", "--zeroshot-data with a task file in another field layout", ZEROSHOT,
     {"z/piqa.jsonl": '{"question": "q", "answer": "a"}\n'}, 2,
     "--zeroshot-data: {tmp}/z/piqa.jsonl:1: no field 'goal' (each item needs goal, sol1, sol2, label"),
    ("diagnose.py", "--zeroshot-data without the asked task's file", [*ZEROSHOT[:-1], "piqa,winogrande"],
     {"z/piqa.jsonl": PIQA}, 2, "--zeroshot-data: no winogrande.jsonl in {tmp}/z (for winogrande): add it, leave "
     "the task out of --tasks, or give --skip-missing-tasks"),
    ("diagnose.py", "--skip-missing-tasks without --zeroshot-data", [*INIT, "--skip-missing-tasks"], {}, 2,
     "--skip-missing-tasks applies to --metrics zeroshot with --zeroshot-data"),
    ("diagnose.py", "a ckpt.pt holding another design's weights", ["{tmp}/run"], edited_run("preln", hc_weights), 2,
     "run/ckpt.pt: its weights are not those of its config's preln model (missing: "),
    ("export.py", "a ckpt.pt whose config is a string", ["{tmp}/run", *EXPORT],
     edited_run("preln", lambda c: c.update(config="preln")), 2,
     "run/ckpt.pt: field 'config' is a string, not an object"),
    ("export.py", 'a ckpt.pt whose step is "2" and config.residual 5', ["{tmp}/run", *EXPORT],
     edited_run("preln", lambda c: c.update(step="2", config={"residual": 5})), 2,
     "run/ckpt.pt: field 'config.residual' is a number, not a string"),
    ("export.py", 'a ckpt.pt whose step is "2"', ["{tmp}/run", *EXPORT], edited_run("preln", lambda c: c.update(
     step="2")), 2, "run/ckpt.pt: field 'step' is '2', not a step count (an integer >= 0)"),
    ("train.py", "--out that is a run folder (it would nest a run inside it)", TRAIN,
     {"runs/run.json": json.dumps(run_json())}, 2, "--out {tmp}/runs is a run folder (it holds run.json); --out is "
     "the folder the run folders go in: give its parent, {tmp}"),
    ("mini.py", "--report on a suite with one damaged run.json (the figures would be drawn without it)",
     ["--report", *MINI], {"m/synthetic/a/run.json": json.dumps(run_json()), "m/synthetic/b/run.json": "{",
                           "m/summary.md": "an older summary"}, 2,
     "--report: {tmp}/m/synthetic/b/run.json: not a run log of train.py: it is not JSON (JSONDecodeError: Expecting "
     "property name enclosed in double quotes: line 1 column 2 (char 1)); nothing written (no figure, summary.md as "
     "it was)"),
]


# ----------------------------------------------------------------------------- issue 66: every size bounded, every
#                                                                                reader of JSON one line

def nan_weights(ckpt):
    """The first weight of a checkpoint all NaN (what a diverged run's weights become)."""
    first = next(iter(ckpt["model"]))
    ckpt["model"][first] = torch.full_like(ckpt["model"][first], float("nan"))


NESTED = "[" * 100_000 + "]" * 100_000  # a JSON text nested deeper than Python's json reads (a RecursionError)
NLL = [*INIT, "--tokenizer", "bytes", "--metrics", "nll", "--nll-data", "{tmp}/n", "--nll-tasks", "gsm8k"]
GSM8K = '{"question": "1 + 1?", "answer": "2"}\n'
ANGULAR = ["--metrics", "angular"]


def official_width(d_model):
    """An official step folder {tmp}/step1 whose config.json says d_model (its weights those of d_model 32)."""
    def make_it(tmp):
        from test_official import ours, write_checkpoint
        step = write_checkpoint(tmp / "step1", ours("preln"))
        config = json.loads((step / "config.json").read_text())
        config["model"]["d_model"] = d_model
        (step / "config.json").write_text(json.dumps(config))
    return make_it


CASES += [
    ("shapes.py", "--params 1e40 (the width search never returned)", ["--params", "1e40", "--ar", "9.1"], {}, 2,
     "--params '1e40': a budget from 1 to 1,000,000,000,000 parameters (1T; the paper's largest model has 1.6B)"),
    ("train.py", "--params 1e40", [*TRAIN, "--params", "1e40"], {}, 2,
     "--params '1e40': a budget from 1 to 1,000,000,000,000 parameters"),
    ("profile_gpu.py", "--params 1e40", ["--analytic-only", "--params", "1e40"], {}, 2,
     "--params '1e40': a budget from 1 to 1,000,000,000,000 parameters"),
    ("profile_gpu.py", "a shape of 10^19 parameters", ["--analytic-only", "--shapes", "2x1000000000"], {}, 2,
     "2x1000000000: more than the 1,000,000,000,000 parameters (1T) a budget may have"),
    ("train.py", "--gpu-mem 1e30 (was planned as fitting)", [*TRAIN, "--dry-run", "--gpu-mem", "1e30"], {}, 2,
     "argument --gpu-mem: invalid GB per GPU, at most 1,024, value: '1e30'"),
    ("diagnose.py", "--seq-len 10^8 on a run of seq_len 16 (was used: the kernel's OOM kill at 23 GB)",
     ["{tmp}/run", *ANGULAR, "--seq-len", "100000000"], run_folder("preln"), 2,
     "--seq-len 100,000,000: at most the run's own seq_len, 16 tokens"),
    ("diagnose.py", "--seq-len 10^8 with --init", [*INIT, *ANGULAR, "--seq-len", "100000000"], {}, 2,
     "--seq-len 100,000,000: at most what a model without a run's seq_len (--init) is read at, 8,192 tokens"),
    ("diagnose.py", "--num-samples 10^6 windows of 512 tokens", [*INIT, *ANGULAR, "--num-samples", "1000000",
     "--seq-len", "512"], {}, 2, "--num-samples 1,000,000 x --seq-len 512 = 512,000,000 tokens: at most 16,777,216"),
    ("diagnose.py", "--init at a width of 10^5", ["--init", "preln", "--width", "100000", "--heads", "2"], {}, 2,
     "parameters; a fresh model has at most 2,000,000,000 and 1024 blocks"),
    ("diagnose.py", "--step on a run folder (was ignored)", ["{tmp}/run", "--step", "3"], run_folder("preln"), 2,
     "--step 3: picks an official checkpoint's stepN folder; {tmp}/run has one step"),
    ("diagnose.py", "--step -1", ["{tmp}/run", "--step", "-1"], {}, 2, "argument --step: invalid"),
    ("diagnose.py", "a ckpt.pt of NaN weights (was diagnosed, exit 0)", ["{tmp}/run"], edited_run("preln", nan_weights),
     2, "run/ckpt.pt: 1 of its 30 weight tensors hold NaN or inf (the first: wte.weight)"),
    ("diagnose.py", "--nll-data rows without their fields (was a KeyError)", NLL, {"n/gsm8k.jsonl": '{"question": 1}\n'},
     2, "--nll-data: {tmp}/n/gsm8k.jsonl:1: no field 'answer' (each item needs question, answer: the hub dataset's"),
    ("diagnose.py", "--nll-data with a field of another type", NLL, {"n/gsm8k.jsonl": GSM8K.replace('"2"', "2")}, 2,
     "--nll-data: {tmp}/n/gsm8k.jsonl:1: field 'answer' is a number, not a string"),
    ("train.py", "run.json of 100,000 nested brackets (was a RecursionError)", TRAIN, {f"{RUN}/run.json": NESTED}, 2,
     "run.json: not a run log of train.py: it is not JSON (RecursionError: nested deeper than Python's json reads)"),
    ("depthbench.files.official", "a config.json of width 1.6 x 10^7 (the model would be built: the OOM kill)",
     ["info", "{tmp}/step1"], official_width(16 * 10**6), 2, "step1/config.json: a model of 3 blocks of width "
     "16,000,000 (3,072,010,864,000,000 parameters): more than the 1024 blocks or 1,000,000,000,000 parameters"),
    ("train.py", "--steps 10^29 (planned as fitting)", [*TRAIN, "--steps", str(10**29)], {}, 2,
     "argument --steps: invalid count from 1 to 10^9 value"),
    ("profile_gpu.py", "--seq 10^23 (its analytic numbers printed as such)", ["--analytic-only", "--shapes", "2x64",
     "--seq", str(10**23)], {}, 2, "argument --seq: invalid sequence length from 1 to 1,048,576 value"),
    ("mini.py", "--report over a run.json of 100,000 nested brackets", ["--report", *MINI],
     {"m/synthetic/a/run.json": NESTED}, 2, "a/run.json: not a run log of train.py: it is not JSON (RecursionError"),
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
    module = MODULES.get(script, script.removesuffix(".py"))
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main([a.replace("{tmp}", str(tmp_path)) for a in argv])
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

@fault("Ctrl-C (SIGINT) or SIGTERM during training (here between steps; during gradient accumulation: "
       "tests/test_stop.py, plain and under torchrun)", "the run stops at the next micro-batch boundary, a step in "
       "progress dropped; the last completed step's ckpt.pt is on disk, run.json says `stopped` (the signal, the "
       "step), one line `interrupted at step N: saved ckpt.pt; resume with: python train.py ... --resume`, exit 130 / "
       "143; resuming gives the uninterrupted losses")
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
    assert load_run(tmp_path / "b")["stopped"] == {"signal": signal.Signals(sig).name, "step": 2}
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


@pytest.mark.slow
@fault("Ctrl-C in a terminal (a real process)", "exit 130, one line on stderr and no traceback; ckpt.pt and "
       "run.json both at that step")
def test_ctrl_c_in_a_real_process(tmp_path):
    p = subprocess.Popen([sys.executable, "train.py", *TINY, "--steps", "100000", "--out", str(tmp_path)], cwd=ROOT,
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
    failed = {"error": "RuntimeError: no memory"}
    monkeypatch.setattr(profile_gpu, "run_measured", lambda jobs, dev, in_process=False: [failed] * len(jobs))
    with pytest.raises(SystemExit) as e:
        profile_gpu.main(["--shapes", "2x64", "--residual", "preln,hc", "--device", "cpu", "--vocab", "64"])
    assert e.value.code == 1 and "every row failed" in capsys.readouterr().err.strip().splitlines()[-1]


@fault("mini.py after a diagnose.json was corrupted", "it is treated as missing: diagnosed again, the summary written")
def test_mini_redoes_a_corrupt_diagnosis(tmp_path, monkeypatch):
    run = tmp_path / "synthetic" / "preln_ar32"
    common.write_json(run / "run.json", run_json(steps=0, val_loss=1.0))  # no step: no checkpoint to match
    (run / "diagnose.json").write_text('{"causal_score": ')
    pools = []
    monkeypatch.setattr(mini, "run_pool", lambda jobs, n, what, log_dir, took=None: pools.append((what, jobs)) or [])
    monkeypatch.setattr(mini.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))  # every figure drawn
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


# ----------------------------------------------------------------------------- 8. issue 31: writes that fail, signals
#                                                                                outside the training loop, one .txt

def limited(max_bytes):
    """preexec_fn of a subprocess: no file it writes may grow past max_bytes (ulimit -f). SIGXFSZ is ignored (Python
    ignores it too), so the write fails with EFBIG instead of killing the process."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
    return limit


def script(argv, preexec_fn=None):
    """python argv in this folder, one thread -> the finished process (stdout and stderr as text)."""
    return subprocess.run([sys.executable, "-B", *argv], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600, preexec_fn=preexec_fn)


def one_text_file(tmp, n_bytes=2000):
    path = tmp / "input.txt"
    path.write_text(("First Citizen: Before we proceed any further, hear me speak.\n" * 50)[:n_bytes])
    return path


@fault("a full disk or a read-only file system while data.py writes its shards (simulated: the second shard's "
       "fsync fails with ENOSPC / EROFS / EACCES)", "one line naming the shard and the cause, exit 2; no shard, no temp file "
       "and no meta.json left (a folder without meta.json is rebuilt, never read); the rerun completes")
@pytest.mark.parametrize("code, cause", [(errno.ENOSPC, "No space left on device (ENOSPC)"),
                                         (errno.EROFS, "Read-only file system (EROFS)"),
                                         (errno.EACCES, "Permission denied (EACCES)")])
def test_data_on_a_full_disk_leaves_no_shard(tmp_path, capsys, monkeypatch, code, cause):
    source = one_text_file(tmp_path)
    argv = ["--source", str(source), "--tokenizer", "bytes", "--out", str(tmp_path / "o"), "--shard-tokens", "500"]
    fsync, calls = os.fsync, []

    def fails_second(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(code, os.strerror(code))
        fsync(fd)
    monkeypatch.setattr(os, "fsync", fails_second)
    with pytest.raises(SystemExit) as e:
        data.main(argv)
    err = capsys.readouterr().err
    want = f"data.py: error: cannot write {tmp_path}/o/val_000001.bin: {cause}"
    assert (e.value.code, err.splitlines()) == (2, [want])
    assert list(files(tmp_path)) == [source]
    monkeypatch.undo()
    data.main(argv)
    assert data.load_meta(tmp_path / "o")["n_tokens"] == 2001


@fault("a file-size limit (`ulimit -f`, a real RLIMIT_FSIZE) while data.py writes a shard",
       "one line, `cannot write .../val_000000.bin: File too large (EFBIG)`, exit 2; the output folder is empty")
def test_data_under_a_file_size_limit(tmp_path):
    source = one_text_file(tmp_path)
    p = script(["data.py", "--source", str(source), "--tokenizer", "bytes", "--out", str(tmp_path / "o"),
                "--shard-tokens", "4000"], limited(3000))
    assert (p.returncode, p.stderr.strip().splitlines()[-1]) == (
        2, f"data.py: error: cannot write {tmp_path}/o/val_000000.bin: File too large (EFBIG)"), p.stderr
    assert "Traceback" not in p.stderr and list(files(tmp_path)) == [source]


@pytest.mark.slow
@fault("a file-size limit (a real RLIMIT_FSIZE) at a checkpoint of train.py --resume: torch's zip writer raises "
       "`RuntimeError: [enforce fail at inline_container.cc] unexpected pos` after the OSError",
       "one line naming ckpt.pt and `File too large (EFBIG)`, exit 2; ckpt.pt is the last good one (byte for byte), "
       "run.json says not finished, no temp file")
def test_train_checkpoint_under_a_file_size_limit(tmp_path, capsys):
    args = [*TINY, "--steps", "4", "--out", str(tmp_path)]
    assert run_main(args + ["--max-steps", "2"], capsys)[0] == 0
    (run,) = tmp_path.iterdir()
    before = files(tmp_path)
    p = script(["train.py", *args, "--resume"], limited(100_000))  # run.json fits, ckpt.pt (~1 MB) does not
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "enforce fail" not in p.stderr, p.stderr
    assert f"cannot write {run}/ckpt.pt: File too large (EFBIG)" in lines[0], p.stderr
    after = files(tmp_path)
    assert sorted(after) == sorted(before) and after[run / "ckpt.pt"] == before[run / "ckpt.pt"]
    assert runlog.run_state(run) == "partial"  # run.json may hold the steps after it (an eval): --resume redoes them


@fault("an OSError that is no failure of the machine (ENOENT: a path a script got wrong)",
       "common.one_line_faults lets it through: a bug keeps its traceback")
def test_other_os_errors_keep_their_traceback(tmp_path):
    with pytest.raises(FileNotFoundError), common.one_line_faults("x.py"):
        open(tmp_path / "missing")


@fault("Ctrl-C (SIGINT) or SIGTERM while data.py tokenizes (the test signals itself after the first shard)",
       "one line, exit 130 / 143; no shard or temp file left, no meta.json; the same command then makes the shards")
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_tokenizing(tmp_path, capsys, monkeypatch, sig, code):
    source = one_text_file(tmp_path)
    argv = ["--source", str(source), "--tokenizer", "bytes", "--out", str(tmp_path / "o"), "--shard-tokens", "500"]
    write_shard = data.write_shard

    def signalled(path, *a, **k):
        write_shard(path, *a, **k)
        os.kill(os.getpid(), sig)
    monkeypatch.setattr(data, "write_shard", signalled)
    with pytest.raises(SystemExit) as e, common.one_line_faults("data.py", "no meta.json was written"):
        data.main(argv)
    name = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}[sig]
    assert (e.value.code, capsys.readouterr().err.splitlines()) == (
        code, [f"data.py: interrupted ({name}); no meta.json was written"])
    assert list(files(tmp_path)) == [source] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    monkeypatch.undo()
    data.main(argv)
    assert data.load_meta(tmp_path / "o")["n_tokens"] == 2001


@fault("Ctrl-C while train.py tokenizes a text source (before its training loop's handlers)",
       "one line, exit 130 (common.one_line_faults around train.py's main); no shard left")
def test_ctrl_c_while_train_tokenizes(tmp_path, capsys, monkeypatch):
    source = one_text_file(tmp_path)
    monkeypatch.setattr(data, "tokenize_documents", lambda docs, tok: os.kill(os.getpid(), signal.SIGINT) or [])
    with pytest.raises(SystemExit) as e, common.one_line_faults("train.py"):
        train.main([*TRAIN[:-1], str(tmp_path / "runs"), "--data", str(source), "--tokenizer", "bytes",
                    "--data-dir", str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert e.value.code == 130 and err.splitlines() == ["train.py: interrupted (Ctrl-C); what was finished is kept; "
                                                        "run the same command again to go on"]
    assert list(files(tmp_path)) == [source]


@fault("Ctrl-C or SIGTERM during diagnose.py's sweep", "one line, exit 130 / 143; no diagnose.json, no temp file")
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_diagnose(tmp_path, capsys, monkeypatch, sig, code):
    import diagnose
    monkeypatch.setattr(diagnose, "sweep", lambda *a: os.kill(os.getpid(), sig))
    with pytest.raises(SystemExit) as e, common.one_line_faults("diagnose.py", "nothing was written"):
        diagnose.main([*INIT, "--metrics", "erank", "--num-samples", "2", "--seq-len", "8", "--out",
                       str(tmp_path / "d.json")])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == code and len(err) == 1 and err[0].startswith("diagnose.py: interrupted (")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@fault("Ctrl-C in a terminal (to the whole process group) while profile_gpu.py measures in its spawned worker",
       "one line after the progress lines, no traceback from either process, exit 130; the worker is gone too")
def test_ctrl_c_while_profile_measures(tmp_path):
    p = subprocess.Popen([sys.executable, "-B", "profile_gpu.py", "--shapes", "2x64", "--residual", "preln", "--device",
                          "cpu", "--vocab", "64", "--seq", "64", "--batch", "2", "--repeats", "1000000", "--out",
                          str(tmp_path / "p.json")], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = []
    for line in p.stderr:
        seen.append(line)
        if line.startswith("measuring"):
            break
    time.sleep(1)  # (not asserted on) the worker ignores Ctrl-C from its start: any moment will do
    os.killpg(p.pid, signal.SIGINT)
    err = "".join(seen) + p.stderr.read()
    assert p.wait(timeout=120) == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "profile_gpu.py: interrupted (Ctrl-C); nothing was written; run the same " \
                                           "command again"
    for _ in range(300):  # the worker (same process group) ends with its parent
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a process of profile_gpu.py outlived it")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@fault("Ctrl-C while a script imports torch (simulated: a script that imports common, then is interrupted)",
       "one line, exit 130, no traceback; data.py, diagnose.py and profile_gpu.py import common before torch")
def test_ctrl_c_at_start_up(tmp_path):
    (tmp_path / "starting.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                                          "from depthbench.files import common\n"
                                          "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nimport torch\n")
    p = script([str(tmp_path / "starting.py")])
    assert (p.returncode, p.stderr) == (130, "starting.py: interrupted (Ctrl-C); run the same command again to go "
                                             "on\n")
    for name in ("data", "diagnose", "profile_gpu"):
        order = script(["-c", f"import sys; import {name}; m = list(sys.modules); "
                              f"print(m.index('depthbench.files.common') < m.index('torch'))"]).stdout
        assert order == "True\n", name


def processes_naming(path):
    """The command lines of the running processes that name `path` (Linux /proc; one may end while we read)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes()
        except OSError:
            continue
        if str(path).encode() in text:
            found.append(text.replace(b"\0", b" ").decode(errors="replace"))
    return found


@pytest.mark.slow
@fault("SIGTERM to mini.py alone (not its process group) while its pool trains a run",
       "the run saves ckpt.pt and stops (train.py's own handler), then one line, exit 143; no train.py outlives the "
       "suite; the same command again resumes that run from its checkpoint and finishes it")
def test_sigterm_to_the_mini_suite_stops_its_runs_and_a_rerun_resumes(tmp_path):
    out = tmp_path / "suite"
    # the signal lands mid-run: it is sent at the first step's line, with ~6 s of steps left on an idle core (0.15 s
    # a step; under load every step is slower alike), as in the kill -9 test below; the rerun trains the rest. Its
    # diagnostics at 2 windows, as there: what it resumes is the property, not diagnose.py (32 windows took ~12 s)
    steps = 40
    argv = [sys.executable, "-B", "mini.py", "--probes", "synthetic", "--designs", "preln", "--ar", "9.1", "--seeds",
            "0", "--deep-seeds", "", "--lr", "3e-3", "--steps", str(steps), "--diag-samples", "2", "--jobs", "1",
            "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(1200):  # until the run has taken a step: its first step line (the header's "tokens/step " is not)
        logs = list((out / "logs").glob("*.log")) if (out / "logs").is_dir() else []
        if logs and re.search(r"^step +\d+/\d+ \|", logs[0].read_text(), re.M):
            break
        time.sleep(0.1)
    else:
        p.kill()
        pytest.fail("the suite's run never started training")
    p.send_signal(signal.SIGTERM)
    err = p.stderr.read()
    assert p.wait(timeout=300) == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("mini.py: interrupted (SIGTERM); what was finished is kept")
    assert not processes_naming(out), "a train.py of the suite outlived it"
    (run,) = (out / "synthetic").iterdir()
    stopped_at = torch.load(run / "ckpt.pt", weights_only=True)["step"]
    assert 0 < stopped_at < steps and "interrupted at step" in logs[0].read_text()
    again = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {run / 'ckpt.pt'} at step {stopped_at}" in logs[0].read_text()
    assert runlog.run_state(run) == "finished"


@fault("a truncated ckpt.pt", "`<path> (<size> bytes): truncated or not a depthbench checkpoint (...)`, one line")
def test_a_truncated_checkpoint_names_its_size(tmp_path):
    truncated_checkpoint(tmp_path)
    with pytest.raises(common.CheckpointError, match=r"ckpt.pt \(1,000 bytes\): truncated or not a depthbench"):
        common.load_checkpoint(tmp_path / "run" / "ckpt.pt")


@fault("run.json cut off (or gone) with an intact ckpt.pt", "runlog.rebuild_run_log writes run.json again from "
       "ckpt.pt's log (not finished: run_state says partial); nothing is written when run.json is readable or ckpt.pt "
       "is not whole")
def test_run_json_is_rebuilt_from_the_checkpoint(tmp_path, capsys):
    assert run_main([*TINY, "--steps", "4", "--max-steps", "2", "--out", str(tmp_path)], capsys)[0] == 0
    (run,) = tmp_path.iterdir()
    assert runlog.rebuild_run_log(run) is None  # readable: left alone
    log = torch.load(run / "ckpt.pt", weights_only=True)["log"]
    text = (run / "run.json").read_text()
    (run / "run.json").write_text(text[:len(text) // 2])
    assert runlog.rebuild_run_log(run) == {**log, "finished": False} == common.read_json(run / "run.json")
    assert runlog.run_state(run) == "partial" and [s["step"] for s in log["steps"]] == [1, 2]
    (run / "run.json").write_text("{")
    (run / "ckpt.pt").write_bytes((run / "ckpt.pt").read_bytes()[:1000])
    assert runlog.rebuild_run_log(run) is None and (run / "run.json").read_text() == "{"


@fault("train.py --resume with run.json cut off and an intact ckpt.pt", "run.json is rebuilt from ckpt.pt's log, the run resumes to the losses "
       "of an uninterrupted run")
def test_resume_rebuilds_a_damaged_run_json(tmp_path, capsys):
    args = [*TINY, "--steps", "4", "--eval-every", "2"]
    assert run_main(args + ["--out", str(tmp_path / "a")], capsys)[0] == 0
    assert run_main(args + ["--max-steps", "2", "--out", str(tmp_path / "b")], capsys)[0] == 0
    (run,) = (tmp_path / "b").iterdir()
    (run / "run.json").write_text((run / "run.json").read_text()[:100])
    code, out, err = run_main(args + ["--resume", "--out", str(tmp_path / "b")], capsys)
    assert code == 0 and "rebuilt from ckpt.pt" in out and "resumed from" in out, err
    a, b = load_run(tmp_path / "a"), load_run(tmp_path / "b")
    assert b["finished"] is True and [s["loss"] for s in b["steps"]] == [s["loss"] for s in a["steps"]]


@fault("train.py on a single .txt file (one document: a split by documents would give it all to validation)",
       "split by tokens: the last 10% (at most 100k) validate, printed; it trains; with `--val-tokens N` (needs the "
       "integrator's flag) the last N")
@pytest.mark.parametrize("val_tokens", [None, 300])
def test_train_on_one_text_file(tmp_path, capsys, val_tokens):
    source = one_text_file(tmp_path)
    flag = [] if val_tokens is None else ["--val-tokens", str(val_tokens)]
    code, out, err = run_main([*TINY, "--max-steps", "2", "--out", str(tmp_path / "runs"), "--data", str(source),
                               "--tokenizer", "bytes", "--data-dir", str(tmp_path / "d"), *flag], capsys)
    n_val = val_tokens or 200
    assert code == 0 and f"the last {n_val:,} of 2,001 tokens" in out, err
    meta = data.load_meta(tmp_path / "d")
    assert [sum(s["tokens"] for s in meta["shards"][k]) for k in ("train", "val")] == [2001 - n_val, n_val]
    assert [s["step"] for s in load_run(tmp_path / "runs")["steps"]] == [1, 2]


# ----------------------------------------------------------------------------- 9. issue 42: a run folder answers
#                                                                                only for the settings that made it

def folder_files(folder):
    """{path: bytes} of a run folder's files (its lock aside): what a refused command must leave as it was."""
    return {p: p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file() and p.name != ".lock"}


@fault("a finished run's folder, then the same command with other settings (`--max-gap 2 --weight-decay 0`, "
       "`--weight-decay 0.5 --seq-len 64`), with and without --resume",
       "one line naming each differing setting with both values (`max_gap 4 there, 2 here`), exit 2, the folder byte "
       "for byte as it was: never \"finished already\" for settings it never trained. Settings that only observe or "
       "carry out a run (--eval-every, --log-every, --ckpt-every, --stats-every, --batch-size, --kernels) skip it as "
       "finished; another --schedule trains a folder of its own")
def test_a_finished_run_answers_only_for_its_settings(tmp_path, capsys):
    args = TINY + ["--steps", "4", "--out", str(tmp_path)]
    assert run_main(args, capsys)[0] == 0
    (run,) = tmp_path.iterdir()
    before = folder_files(run)
    others = {("--max-gap", "2", "--weight-decay", "0"): "weight_decay 0.1 there, 0.0 here; max_gap 4 there, 2 here",
              ("--weight-decay", "0.5", "--seq-len", "64"): "weight_decay 0.1 there, 0.5 here; seq_len 32 there, 64 here"}
    for flags, named in others.items():
        for resume in ([], ["--resume"]):
            code, out, err = run_main(args + [*flags, *resume], capsys)
            assert code == 2 and err.splitlines() == [f"train.py: error: {run} holds a run made with other settings "
                                                      f"({named}); it answers for its own only: use another --out, or "
                                                      "move the folder away"], err
            assert "skipping" not in out and folder_files(run) == before
    looks = ["--eval-every", "3", "--log-every", "2", "--ckpt-every", "7", "--stats-every", "0", "--batch-size", "8",
             "--kernels", "reference"]
    code, out, _ = run_main(args + looks, capsys)
    assert code == 0 and "finished already (run.json says so): skipping" in out and folder_files(run) == before
    code, out, _ = run_main(args + ["--schedule", "wsd"], capsys)
    assert code == 0 and "wsd: linear warmup, the peak held" in out and folder_files(run) == before
    wsd = load_run(tmp_path, "preln_ar32_wsd_lr3e-3_s42")
    assert wsd["config"]["schedule"] == "wsd" and wsd["finished"] is True
    assert [s["lr"] for s in wsd["steps"]] != [s["lr"] for s in load_run(tmp_path, run.name)["steps"]]


@fault("a partial run's folder (stopped by --max-steps), then other settings, with and without --resume",
       "refused in one line naming them (never started over: that would lose the run); --resume with other observation "
       "settings (--eval-every, --log-every) continues it to the losses of an uninterrupted run, bit for bit")
def test_a_partial_run_answers_only_for_its_settings(tmp_path, capsys):
    args = TINY + ["--steps", "6", "--eval-every", "3"]
    assert run_main(args + ["--out", str(tmp_path / "a")], capsys)[0] == 0
    b = args + ["--out", str(tmp_path / "b")]
    assert run_main(b + ["--max-steps", "3"], capsys)[0] == 0
    (run,) = (tmp_path / "b").iterdir()
    before = folder_files(run)
    for resume in ([], ["--resume"]):
        code, out, err = run_main(b + ["--grad-clip", "0.5", "--eval-iters", "2", *resume], capsys)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "(grad_clip 1.0 there, 0.5 here; eval_iters 1 there, 2 here)" in err and folder_files(run) == before
    code, out, _ = run_main(b + ["--resume", "--eval-every", "2", "--log-every", "5"], capsys)
    assert code == 0 and "resumed from" in out
    want, got = load_run(tmp_path / "a"), load_run(tmp_path / "b")
    assert got["finished"] and [s["loss"] for s in got["steps"]] == [s["loss"] for s in want["steps"]]


@fault("a grid whose second run's folder holds a run of other settings",
       "refused in one line before the first run trains: nothing written anywhere")
def test_a_grid_is_checked_before_it_trains(tmp_path, capsys):
    args = TINY + ["--steps", "2", "--out", str(tmp_path)]
    assert run_main(args + ["--seed", "1"], capsys)[0] == 0
    before = files(tmp_path)
    code, _, err = run_main(args + ["--seed", "0,1", "--grad-clip", "0"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "_s1 holds a run made with other settings (grad_clip" in err
    assert files(tmp_path) == before and not (tmp_path / "preln_ar32_lr3e-3_s0").exists()


@fault("a run folder written before the schedule and val_tokens joined the config (run.json and ckpt.pt without them)",
       "still resumes, and is still skipped once finished, when its settings match (they read as cosine and none)")
def test_a_folder_of_the_code_before_still_resumes(tmp_path, capsys):
    args = TINY + ["--steps", "4", "--out", str(tmp_path)]
    assert run_main(args + ["--max-steps", "2"], capsys)[0] == 0
    (run,) = tmp_path.iterdir()
    log = load_run(tmp_path)
    for key in ("schedule", "val_tokens"):
        del log["config"][key]
    common.write_json(run / "run.json", log)
    ckpt = torch.load(run / "ckpt.pt", weights_only=True)
    ckpt["config"] = log["config"]
    torch.save(ckpt, run / "ckpt.pt")
    code, out, err = run_main(args + ["--resume"], capsys)
    assert code == 0 and "resumed from" in out, err
    assert run_main(args, capsys)[1].count("skipping") == 1


@fault("mini.py over a suite folder of runs made with other settings (a toy at --steps 2, then --steps 3)",
       "one line naming the run folder and `total_steps 2 there, 3 here`, exit 2, before anything starts; with the "
       "settings that made them the runs are found done (not started again)")
def test_mini_reuses_a_run_only_with_its_settings(tmp_path, capsys):
    toy = ["--designs", "preln", "--ar", "32", "--seeds", "0", "--deep-seeds", "", "--lr", "3e-3", "--out",
           str(tmp_path)]
    jobs = [(label, argv) for _, label, argv in mini.seed_jobs(mini.parse_args(toy + ["--steps", "2"]))]
    assert run_main(jobs[0][1][2:], capsys)[0] == 0          # the job's own train.py command, in this process
    (folder,) = mini.check_jobs(jobs).values()
    assert mini.found_done(folder) == "done before"
    before = files(tmp_path)
    with pytest.raises(SystemExit) as e:
        mini.main(toy + ["--steps", "3"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err.splitlines() == [
        f"mini.py: error: {folder} holds a run made with other settings (total_steps 2 there, 3 here); it answers "
        "for its own only: use another --out, or move the folder away"], err
    assert "[train]" not in out and files(tmp_path) == before


def set_field(obj, path, value):
    """Set (value MISSING: delete) the field at path ('evals[0].per_level', 'config.lr') of a run.json's dict."""
    *parents, last = re.findall(r"[^.\[\]]+", path)
    for key in parents:
        obj = obj[int(key)] if isinstance(obj, list) else obj[key]
    if isinstance(obj, list):
        last = int(last)
    if value is MISSING:
        del obj[last]
    else:
        obj[last] = value


MISSING = object()
# each field a reader of run.json uses (depthbench/files/runlog.py): a value of another type for it, whether null and a
# missing field are refused too (an optional number may be null: a non-finite loss; may be missing: an older log)
READ_FIELDS = [("schema", 1, True, True), ("config", "x", True, True), ("config.residual", 5, True, True),
               ("config.n_layer", "2", True, True), ("config.d_model", 64.5, True, True),
               ("config.lr", "3e-3", True, True), ("config.seed", "0", True, True), ("steps", "oops", True, True),
               ("steps[0]", "x", True, False), ("steps[0].step", "1", True, True), ("steps[1].loss", "x", False, False),
               ("evals", {}, True, True), ("evals[0].step", "2", True, True), ("evals[0].val_loss", "x", False, False),
               ("evals[0].per_level", [], False, False), ("evals[0].per_level.1", 0.5, True, False),
               ("final", [], True, True), ("final.val_loss", "low", False, False), ("diverged", "no", True, True),
               ("finished", "no", True, True), ("wall_s", "1 s", True, True), ("config.weight_decay", "0", True, False),
               ("config.schedule", 1, True, False), ("config.answers_only", "yes", True, False)]
BAD_VALUES = [(path, kind, value) for path, other, null, missing in READ_FIELDS
              for kind, value in (("another type", other), ("null", None), ("missing", MISSING))
              if kind == "another type" or (kind == "null" and null) or (kind == "missing" and missing)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished tiny run (2 steps): run.json and ckpt.pt as train.py writes them, for each test to copy."""
    root = tmp_path_factory.mktemp("finished")
    with pytest.raises(SystemExit):
        train.main(TINY + ["--steps", "2", "--out", str(root)])
    (run,) = root.iterdir()
    return run


@fault("run.json with a field of another type, null or missing, for each field a reader uses (`\"finished\": \"no\"`, "
       "`\"diverged\": \"no\"`, `\"steps\": \"oops\"`, ...)",
       "the one reader (depthbench/files/runlog.py) refuses it in one line naming the file and the field, in every script: "
       "train.py exits 2 (never skips the run, never takes a string for true), mini.py's tables and diagnose.py say "
       "the same line, plot.py skips the file naming the field")
@pytest.mark.parametrize("path, kind, value", BAD_VALUES, ids=[f"{p} {k}" for p, k, _ in BAD_VALUES])
def test_run_json_is_read_by_type(tmp_path, capsys, finished_run, path, kind, value):
    from depthbench.reports import drawing
    from depthbench.files import runlog
    from depthbench.reports import suite_tables
    run = tmp_path / finished_run.name
    shutil.copytree(finished_run, run)
    log = json.loads((run / "run.json").read_text())
    set_field(log, path, value)
    (run / "run.json").write_text(json.dumps(log))
    with pytest.raises(runlog.RunLogError) as e:
        runlog.read_run_log(run / "run.json")
    assert e.value.field == path and str(e.value).startswith(f"{run / 'run.json'}: field {path!r} ")
    code, out, err = run_main(TINY + ["--steps", "2", "--out", str(tmp_path)], capsys)
    assert code == 2 and err.splitlines() == [f"train.py: error: {e.value}; move it away to train this run (--resume "
                                              "writes it again from ckpt.pt)"] and "skipping" not in out
    with pytest.raises(runlog.RunLogError, match=re.escape(str(e.value))):
        suite_tables.done_runs(tmp_path)
    assert drawing.check_schema(log) == (None, f"schema depthbench.train/1 but {e.value.reason}") or path == "schema"


@fault("train.py --resume over a run.json with a field of another type beside a whole ckpt.pt",
       "run.json is written again from ckpt.pt's log (said so), and the run goes on from there")
def test_resume_rebuilds_a_run_json_of_the_wrong_types(tmp_path, capsys, finished_run):
    run = tmp_path / finished_run.name
    shutil.copytree(finished_run, run)
    log = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**log, "finished": "no"}))
    code, out, err = run_main(TINY + ["--steps", "2", "--resume", "--out", str(tmp_path)], capsys)
    assert code == 0 and "rebuilt from ckpt.pt's log (step 2)" in out and "resumed from" in out, err
    assert load_run(tmp_path)["finished"] is True and load_run(tmp_path)["steps"] == log["steps"]


@fault("a ckpt.pt whose config has a field of another type (diagnose.py reads the run's settings from it)",
       "one line naming the checkpoint and the field, exit 2")
def test_diagnose_reads_the_run_config_by_type(tmp_path, capsys, finished_run):
    import diagnose
    ckpt = torch.load(finished_run / "ckpt.pt", weights_only=True)
    ckpt["config"]["seq_len"] = "32"
    torch.save(ckpt, tmp_path / "ckpt.pt")
    with pytest.raises(SystemExit) as e:
        diagnose.main([str(tmp_path), "--metrics", "erank", "--num-samples", "2"])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [
        f"diagnose.py: error: {tmp_path / 'ckpt.pt'}: field 'config.seq_len' is a string, not an integer"]


# ----------------------------------------------------------------------------- 10. issue 42: process lifetime

def pids_naming(path):
    """The pids of the running processes whose command line names `path` (Linux /proc; one may end while we read)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(path).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def alive(pid):
    """Whether process pid runs (a zombie, ended but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@fault("kill -9 of mini.py alone while its pool trains a run, then the same command at once",
       "the run ends with its driver (Linux: the kernel sends it SIGTERM: it keeps its last step's ckpt.pt); the "
       "rerun waits for it in one line while it lives, never writes its log meanwhile (no NUL bytes), then resumes "
       "it: the losses of an uninterrupted run, bit for bit")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_kill_9_of_mini_ends_its_runs_and_a_rerun_resumes_them(tmp_path):
    out = tmp_path / "suite"
    flags = ["--probes", "synthetic", "--designs", "preln", "--ar", "9.1", "--seeds", "0", "--deep-seeds", "", "--lr",
             "3e-3", "--steps", "40", "--diag-samples", "2", "--jobs", "1", "--out", str(out)]
    argv, env = [sys.executable, "-B", "mini.py", *flags], {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):  # until its run has taken a step
        logs = list((out / "logs").glob("*.log")) if (out / "logs").is_dir() else []
        if logs and "step     1/" in logs[0].read_text():
            break
        time.sleep(0.1)
    else:
        p.kill()
        pytest.fail("the suite's run never started training")
    runs = [pid for pid in pids_naming(out) if pid != p.pid]
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    again = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the suite's run uninterrupted, as mini starts it (its own folder), beside the rerun: both one thread, two cores
    (job,) = mini.seed_jobs(mini.parse_args(flags))
    at = job[2].index("--out")
    alone = subprocess.Popen([*job[2][:at + 1], str(tmp_path / "alone"), *job[2][at + 2:]], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(1200):  # the runs of the killed suite end with it
        if not any(alive(pid) for pid in runs):
            break
        time.sleep(0.1)
    else:
        again.kill()
        alone.kill()
        pytest.fail("a train.py of the killed suite outlived it")
    stdout, stderr = again.communicate(timeout=900)
    assert again.returncode == 0 and "Traceback" not in stderr, stdout[-2000:] + stderr
    text = logs[0].read_text()
    assert "\0" not in text and "FAILED" not in stdout
    stopped_at = int(re.search(r"^resumed from .*ckpt.pt at step (\d+)$", text, re.M)[1])
    assert 0 < stopped_at < 40
    alone_err = alone.communicate(timeout=900)[1]
    assert alone.returncode == 0, alone_err[-2000:]
    (run,) = (out / "synthetic").iterdir()
    assert [s["loss"] for s in load_run(out / "synthetic")["steps"]] == [s["loss"] for s in
                                                                         load_run(tmp_path / "alone")["steps"]]


@fault("a live process holding what mini.py would write for a run: its run folder (a train.py started by hand: the "
       "test holds the folder's lock) or its log (a run of a killed mini.py, where the OS keeps it alive)",
       "one line on the terminal naming what is held (and by whom) and that it waits, up to job_pool.LOCK_WAIT_S (60 s); "
       "then one line, exit 2; the log is never opened for writing meanwhile")
@pytest.mark.parametrize("held", ["folder", "log"])
def test_mini_never_writes_where_a_live_run_does(tmp_path, capsys, monkeypatch, held):
    import fcntl
    monkeypatch.setattr(job_pool, "LOCK_WAIT_S", 1)
    argv = ["--designs", "preln", "--ar", "32", "--seeds", "0", "--deep-seeds", "", "--lr", "3e-3", "--steps", "2",
            "--out", str(tmp_path)]
    ((_, label, job),) = mini.seed_jobs(mini.parse_args(argv))
    cfg = mini.planned_run(job)
    folder, log = Path(cfg.out) / cfg.name, mini.log_path(tmp_path / "logs", label)
    log.parent.mkdir()
    log.write_text("a live run's log\n")
    lock = common.lock_folder(folder)
    if held == "log":
        lock.close()
        lock = open(log, "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
    before = files(tmp_path)
    with pytest.raises(SystemExit) as e:
        mini.main(argv)
    out, err = capsys.readouterr()
    lock.close()
    what = {"folder": f"{folder} is in use by pid {os.getpid()} on {socket.gethostname()}",
            "log": f"{log} is held by a live process (a run of an earlier mini.py, ending?)"}[held]
    assert f"\nmini.py: {what}" in out and out.endswith(": waiting up to 1 s for it to end\n")
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(f"mini.py: error: {what}")
    assert "still after 1 s: its files are not written while it lives" in err
    assert files(tmp_path) == before


@fault("SMOKE_BUDGET_S that is no number of seconds > 0 (abc, -5, 0, nan) for scripts/gpu_smoke.sh",
       "one line naming it, exit 2, nothing written (not a ValueError); a budget too short for any check still writes "
       "the smoke.log its last line names")
@pytest.mark.parametrize("budget", ["abc", "-5", "0", "nan"])
def test_a_smoke_budget_is_a_number_of_seconds(tmp_path, capsys, monkeypatch, budget):
    smoke = importlib.import_module("scripts.gpu_smoke")
    monkeypatch.setenv("SMOKE_BUDGET_S", budget)
    with pytest.raises(SystemExit) as e:
        smoke.main(["--tiny", "--out", str(tmp_path / "s")])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [
        f"gpu_smoke.py: error: SMOKE_BUDGET_S={budget!r} is not a number of seconds > 0"]
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("SMOKE_BUDGET_S", "1")
    assert smoke.main(["--tiny", "--out", str(tmp_path / "s")]) == 1  # every check skipped: the budget is spent
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"wrote {tmp_path / 's' / 'summary.json'} and {tmp_path / 's' / 'smoke.log'}")
    assert (tmp_path / "s" / "smoke.log").read_text().startswith("gpu_smoke.py: budget 1 s, tiny")


# ----------------------------------------------------------------------------- 11. issue 66: the environment, exits
#                                                                                that say what happened, a pending stop

LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
BAD_LAUNCHES = [
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not an integer from 1 to 65,536"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer from 1 to 65,536"),
    ({"WORLD_SIZE": str(10**9)}, "WORLD_SIZE='1000000000' is not an integer from 1 to 65,536"),
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE together"),
    ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK='2' is not an integer from 0 to 1"),
    ({"RANK": "1", "LOCAL_RANK": "x", "WORLD_SIZE": "2"}, "LOCAL_RANK='x' is not an integer from 0 to 1"),
]


@fault("the launcher's variables of no sense, with train.py --dry-run or a run (WORLD_SIZE=0, abc or 10^9; RANK "
       "without WORLD_SIZE; RANK or LOCAL_RANK outside the world)", "one line naming the variable and what it may be, "
       "exit 2, printed by every process whatever its RANK (was a ZeroDivisionError or ValueError traceback); "
       "WORLD_SIZE=2 without RANK plans --dry-run for 2 ranks, as before")
@pytest.mark.parametrize("env, says", BAD_LAUNCHES, ids=[" ".join(f"{k}={v}" for k, v in e.items())
                                                         for e, _ in BAD_LAUNCHES])
def test_the_launchers_variables_are_checked_like_flags(capsys, monkeypatch, env, says):
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for argv in (["--preset", "mini", "--dry-run"], ["--preset", "mini", "--steps", "1", "--out", "/nonexistent/x"]):
        with pytest.raises(SystemExit) as e:
            train.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(f"train.py: error: {says}"), err


def test_a_world_size_without_rank_is_what_dry_run_plans_for(capsys, monkeypatch):
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.init_distributed(False, plan_only=True).world_size == 2
    assert train.init_distributed(False).world_size == 1  # a plain run: no process group without RANK


@fault("train.py --resume over a ckpt.pt whose model_config.n_layer is the string \"2\" (diagnose.py and export.py "
       "refused it; --resume trained on)", "every reader of a checkpoint reads model_config by GPTConfig's types "
       "(checkpoints.check_model_config): one line naming the file and the field, exit 2, nothing written")
def test_resume_reads_the_model_config_by_type(tmp_path, capsys):
    args = TINY + ["--steps", "2", "--max-steps", "1", "--out", str(tmp_path)]
    assert run_main(args, capsys)[0] == 0
    (path,) = tmp_path.glob("*/ckpt.pt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_config"]["n_layer"] = "2"
    torch.save(ckpt, path)
    before = files(tmp_path)
    code, _, err = run_main(args[:-4] + ["--resume", "--out", str(tmp_path)], capsys)
    assert code == 2 and err.splitlines() == [
        f"train.py: error: cannot resume: {path}: field 'model_config.n_layer' is '2', not a count (an integer >= 1)"]
    assert files(tmp_path) == before


@fault("mini.py --report when a figure command fails (simulated: plot.py exits 1)", "summary.md is written, then one "
       "line naming each failed command and its exit code, exit 1 (was exit 0 and `wrote ... the figures`)")
def test_a_report_whose_figure_failed_says_so(tmp_path, capsys, monkeypatch):
    common.write_json(tmp_path / "synthetic" / "a" / "run.json", run_json())

    def figure(command, **_):
        return subprocess.CompletedProcess(command, 1 if command[1].endswith("plot.py") else 0)
    monkeypatch.setattr(mini.subprocess, "run", figure)
    with pytest.raises(SystemExit) as e:
        mini.main(["--report", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and err.splitlines() == [
        f"mini.py: error: --report: plot.py synthetic (exit 1) failed (its lines above); wrote {tmp_path / 'summary.md'}"]
    assert "the figures in" not in out and (tmp_path / "summary.md").is_file()


@fault("a signal that comes after the loop's check between steps (here: during the save before step 2; the same "
       "check guards an evaluation's first micro-batch)", "the step never starts: no micro-batch runs, so no first "
       "compile begins while a signal is pending (`step 2 dropped after micro-batch 0 of 2`); ckpt.pt at step 1, "
       "exit 143. A signal during a compile is answered when that micro-batch ends (docs/training.md#stopping)")
def test_a_pending_signal_never_starts_a_step(tmp_path, capsys, monkeypatch):
    save, batches = train.maybe_save, []

    def signalled_save(run, last, force=False):
        save(run, last, force)
        if run.step == 1 and not batches:
            batches.append(run.train_loader.state_dict())
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(train, "maybe_save", signalled_save)
    code, out, err = run_main(TINY + ["--steps", "4", "--ckpt-every", "1", "--out", str(tmp_path)], capsys)
    assert code == 143 and "step 2 dropped after micro-batch 0 of 2" in out and "step 2: micro-batch" not in out
    assert load_run(tmp_path)["stopped"] == {"signal": "SIGTERM", "step": 1, "dropped_step": 2,
                                             "micro_batches_done": 0, "micro_batches": 2, "after_signal": 0}
    assert torch.load(next(tmp_path.glob("*/ckpt.pt")), weights_only=True)["loader"] == batches[0]


# ----------------------------------------------------------------------------- 12. issue 66: every reader of JSON, fed
#                                                                                randomly damaged files of its format

DAMAGES = ("truncated", "nested", "wrong type", "huge number")
HUGE = "1" + "0" * 5000  # an integer of 5,001 digits: more than the 4,300 that Python's int() reads from text


def get_field(obj, path):
    """The value at path ('steps[0].step', 'model.block') of a JSON value."""
    for key in re.findall(r"[^.\[\]]+", path):
        obj = obj[int(key)] if isinstance(obj, list) else obj[key]
    return obj


def other_type(value):
    """A JSON value of another type than `value`'s, and not null (a number for text, a list for a number, else text)."""
    if isinstance(value, str):
        return 5
    if isinstance(value, (bool, int, float)):
        return [1]
    return "x"


def damaged(text, kind, fields, rng):
    """One JSON object's text (a file, or one line of a JSON Lines file) damaged as `kind`, at a field drawn from
    `fields` (the fields its reader checks): cut off at a random character; the field nested 100,000 deep; the field
    of another type; the field a number of 5,001 digits."""
    if kind == "truncated":
        return text.strip()[:rng.randrange(1, len(text.strip()))]
    obj, path = json.loads(text), rng.choice(fields)
    set_field(obj, path, other_type(get_field(obj, path)) if kind == "wrong type" else "<damage>")
    return json.dumps(obj).replace('"<damage>"', NESTED if kind == "nested" else HUGE)


def reader_run_json(tmp, finished_run, capsys, monkeypatch):
    """train.py over its own run folder: the undamaged run.json is skipped as finished (exit 0)."""
    shutil.copytree(finished_run, tmp / finished_run.name)
    return tmp / finished_run.name / "run.json", lambda: run_main(TINY + ["--steps", "2", "--out", str(tmp)], capsys)


def reader_report(tmp, finished_run, capsys, monkeypatch):
    """mini.py --report over a suite holding the run (the figure commands simulated)."""
    shutil.copytree(finished_run, tmp / "synthetic" / finished_run.name)
    monkeypatch.setattr(mini.subprocess, "run", lambda command, **_: subprocess.CompletedProcess(command, 0))
    return tmp / "synthetic" / finished_run.name / "run.json", lambda: called(mini.main, ["--report", "--out",
                                                                                         str(tmp)], capsys)


def reader_zeroshot(tmp, finished_run, capsys, monkeypatch):
    """diagnose.py --zeroshot-data: a piqa.jsonl of two items, checked before any work."""
    (tmp / "z").mkdir()
    argv = [a.replace("{tmp}", str(tmp)) for a in ZEROSHOT]
    return tmp / "z" / "piqa.jsonl", lambda: called(importlib.import_module("diagnose").main, argv, capsys)


def reader_nll(tmp, finished_run, capsys, monkeypatch):
    """diagnose.py --nll-data: a gsm8k.jsonl of two items, checked before any task is scored."""
    (tmp / "n").mkdir()
    argv = [a.replace("{tmp}", str(tmp)) for a in NLL]
    return tmp / "n" / "gsm8k.jsonl", lambda: called(importlib.import_module("diagnose").main, argv, capsys)


def reader_official(tmp, finished_run, capsys, monkeypatch):
    """depthbench.files.official info over a step folder's config.json (tests/test_official.py's)."""
    from depthbench.files import official
    from test_official import ours, write_checkpoint
    step = write_checkpoint(tmp / "step1", ours("preln"))
    return step / "config.json", lambda: called(official.main, ["info", str(step)], capsys)


def reader_text(tmp, finished_run, capsys, monkeypatch):
    """data.py over a .jsonl source of two documents."""
    argv = ["--source", str(tmp / "a.jsonl"), "--tokenizer", "bytes", "--out", str(tmp / "o")]
    return tmp / "a.jsonl", lambda: called(data.main, argv, capsys)


def called(main, argv, capsys):
    """main(argv) in-process -> (exit code, stdout, stderr)."""
    try:
        code = main(argv) or 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


RUN_FIELDS = [path for path, *_ in READ_FIELDS]
# reader -> (script, its setup, the fields it checks, a valid line of a JSON Lines file or None for a file of one object)
READERS = {"train.py run.json": ("train.py", reader_run_json, RUN_FIELDS, None),
           "mini.py --report run.json": ("mini.py", reader_report, RUN_FIELDS, None),
           "diagnose.py --zeroshot-data": ("diagnose.py", reader_zeroshot, ["goal", "sol1", "sol2", "label"], PIQA),
           "diagnose.py --nll-data": ("diagnose.py", reader_nll, ["question", "answer"], GSM8K),
           "official config.json": ("depthbench.files.official", reader_official,
                                    ["model", "model.block", "model.d_model", "model.n_layers"], None),
           "data.py .jsonl source": ("data.py", reader_text, ["text"], '{"text": "a document"}\n')}


@fault("every reader of JSON (run.json: train.py, mini.py --report; --zeroshot-data and --nll-data task files; an "
       "official config.json; data.py's .jsonl sources) fed randomly damaged files of its own format, seeded: cut "
       "off, a field nested 100,000 deep, a field of another type, a number of 5,001 digits",
       "one line naming the file, exit 2, for each (common.parse_json / load_json / json_lines: the one reader of "
       "JSON text, RecursionError and int()'s digit limit included); plot.py skips such a run.json in one line")
@pytest.mark.parametrize("kind", DAMAGES)
@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_damaged_files_in_one_line(tmp_path, capsys, monkeypatch, finished_run, reader, kind):
    import random
    script, setup, fields, line = READERS[reader]
    rng = random.Random(f"{reader} {kind}")
    for draw in range(2):
        tmp = tmp_path / str(draw)
        tmp.mkdir()
        path, run = setup(tmp, finished_run, capsys, monkeypatch)
        valid = line or path.read_text()
        bad = damaged(valid, kind, fields, rng)
        path.write_text(line + bad + "\n" if line else bad)  # a JSON Lines file: its second line damaged
        code, _, err = run()
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"{script}: error: "), (bad[:300], err)
        assert str(path) in err and "Traceback" not in err, err


@pytest.mark.parametrize("kind", DAMAGES)
def test_an_options_json_damaged_is_one_line(tmp_path, capsys, kind):
    """--residual-args, the JSON a command line gives (common.json_object through parse_json), damaged as the files
    above: one line, exit 2, without echoing the text (200,000 brackets would be the line)."""
    import random
    bad = damaged('{"n_groups": 4}', kind, ["n_groups"], random.Random(kind))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in TRAIN] + ["--residual", "block_attnres", "--residual-args", bad]
    code, _, err = run_main(argv, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("train.py: error: ") and len(err) < 300, err
    assert "--residual-args" in err and not list(tmp_path.iterdir())

def test_the_width_bisection_is_the_scan_it_replaced():
    """shapes.solve's width per depth, bisected (a scan of 2 x n_head steps took minutes at 10^13 params): the width
    the scan found, the smaller of two equally close, for seeded random budgets, depths, heads and families; a 1T
    budget is solved over all 256 depths of the AR search."""
    import random
    import shapes

    def scanned(budget, L, n_head, fixed):
        widths, d = [], 0
        while not widths or widths[-1][1] <= budget:
            d += 2 * n_head
            size = shapes.backbone_params(L, d, shapes.ffn_dim(d))
            if fixed == "total":
                size = shapes.preln_params(L, d, shapes.ffn_dim(d))
            widths.append((d, size))
        return min(widths, key=lambda w: abs(w[1] - budget))[0]
    rng = random.Random(66)
    for _ in range(100):
        budget, L = int(10 ** rng.uniform(3, 9)), rng.randint(1, 256)
        n_head, fixed = rng.choice([4, 16]), rng.choice(["total", "backbone"])
        got = shapes.solve(budget, layers=L, fixed=fixed, n_head=n_head, tolerance=None)["d_model"]
        assert got == scanned(budget, L, n_head, fixed), (budget, L, n_head, fixed)
    assert shapes.solve(shapes.MAX_PARAMS, ar=9.1, tolerance=None)["n_layer"] == 256  # returns (the scan did not)

@pytest.mark.parametrize("kind", DAMAGES)
def test_plot_skips_a_damaged_run_json_in_one_line(tmp_path, capsys, finished_run, kind):
    import random
    import plot
    shutil.copytree(finished_run, tmp_path / "runs" / "a")
    path = tmp_path / "runs" / "a" / "run.json"
    path.write_text(damaged(path.read_text(), kind, RUN_FIELDS, random.Random(kind)))
    assert plot.main([str(tmp_path / "runs"), "--out", str(tmp_path / "figs")]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("  skipped ")] == [
        line for line in out.splitlines() if line.startswith("  skipped a/run.json: ")] and "  skipped a/run.json" in out


# ----------------------------------------------------------------------------- the page

def ticked(names):
    return ", ".join(f"`{name}`" for name in names)


def rules():
    """The page's rules, written here; the lists of settings come from RunConfig's fields
    (depthbench/files/runlog.py)."""
    from depthbench.files.runlog import SYNTHETIC_ONLY, identity_fields
    rest = identity_fields(None)
    return [
        "## Run identity", "",
        "A run folder answers only for the settings that made it. Each field of a run's config (run.json's and "
        "ckpt.pt's `config`, depthbench/files/runlog.py's `RunConfig`) says what it is to the run's identity:", "",
        f"- **Identity**: {ticked(identity_fields('always'))}: what the run computes (and `eval_iters`, what its "
        "result is measured on). A command whose value differs from the folder's run, finished, diverged or partial, "
        "with or without `--resume`, is refused in one line naming each setting with both values (`weight_decay 0.1 "
        "there, 0.0 here`), exit 2, and nothing is written: use another `--out`, or move the folder away. A grid "
        "checks every folder before its first run trains. Non-default design options and a schedule other than the "
        f"default (`--schedule`) join the run's name: such runs have folders of their own. {ticked(SYNTHETIC_ONLY)} "
        "count for a synthetic-task run only; HC/mHC's `recompute` (the memory plan's choice, the same losses) does "
        "not count.",
        f"- **Precision**: {ticked(identity_fields('done'))}. Part of a finished or diverged run's identity; "
        "`--resume` may change it (scripts/gpu_smoke.py resumes one checkpoint in fp32 and in bf16 to compare them).",
        f"- **The rest** may differ, and `--resume` may change them: {ticked(rest)}. They are derived from the "
        "identity, or say how the run is carried out (ranks, micro-batch, FSDP, activation checkpointing, compile, "
        "kernels: the same maths, other float rounding; a resume is bit for bit when they are unchanged), how it is "
        "observed (log, eval and checkpoint cadence, telemetry, trackers) or where it is kept (`out`, `data_dir`). "
        "`max_steps` sets where a session stops, not the schedule.", "",
        "mini.py keeps the same rule: before each phase it resolves every job's run as train.py does and refuses, in "
        "one line, a folder holding a run of other settings (say an earlier toy of another `--steps` in the same "
        "`--out`); a done run of the same settings is not started again. Folders written before `schedule` and "
        "`val_tokens` joined the config read them as `cosine` and none: they resume, and are skipped once finished, "
        "when the rest matches.", "",
        "run.json is read by type, through one reader (depthbench/files/runlog.py) in train.py, mini.py, diagnose.py (a "
        "checkpoint's config) and plot.py: a field missing, null where it may not be, or of another type (`\"finished\""
        ": \"no\"`) is one line naming the file and the field, never read by truthiness. train.py --resume writes such "
        "a run.json again from ckpt.pt's log, and says so.", "",
        *bounds(),
        "## Process lifetime", "",
        "- mini.py's children (train.py, diagnose.py, plot.py) end when it ends, however it ends. On Linux each asks "
        "the kernel for SIGTERM at its parent's death (`prctl(PR_SET_PDEATHSIG)`: common.end_with_parent), kill -9 "
        "included, and a training run answers it at its next micro-batch, keeping its last completed step's ckpt.pt "
        "(docs/training.md#stopping). They run in mini.py's process "
        "group: a terminal's Ctrl-C, or `kill -- -PGID`, reaches them all.",
        "- A live run's files are never written by another process: train.py locks its run folder, and mini.py locks "
        "each run's log together with the run that writes it (the lock lasts while either lives). A rerun that finds "
        "one held says so on the terminal in one line and waits, up to 60 s (a killed suite's runs are saving), then "
        "stops with one line and exit 2. Where the OS has no PR_SET_PDEATHSIG, a killed suite's runs train on to "
        "their end, and a rerun waits for them or says so.",
        "- The same command again resumes each stopped run from its ckpt.pt, to the losses of an uninterrupted run.",
        ""]


def bounds():
    """The page's section on the sizes a user gives and the JSON the scripts read, its numbers from the code."""
    import shapes
    from depthbench.evaluation import calibration
    from depthbench.training import distributed, recipe
    return [
        "## Sizes and JSON", "",
        "Every size a user gives is bounded where it is parsed, the message saying the largest value that makes "
        f"sense: a parameter budget (`--params` of shapes.py, train.py, profile_gpu.py) from 1 to "
        f"{shapes.MAX_PARAMS:,} (1T), a model of at most {shapes.MAX_LAYERS:,} blocks (`--layers`, `--shapes`, a "
        f"checkpoint's model_config), every count of train.py at most {recipe.MAX_COUNT:,}, `--gpu-mem` at most "
        f"{recipe.MAX_GPU_GB:,} GB, profile_gpu.py's `--seq` at most {profile_gpu.MAX_SEQ:,} and `--batch` at most "
        f"{profile_gpu.MAX_BATCH:,}, diagnose.py's `--seq-len` at most the run's own seq_len "
        f"({calibration.INIT_SEQ_LEN:,} for `--init`), `--num-samples` x `--seq-len` at most "
        f"{calibration.WINDOW_TOKENS:,} tokens and an `--init` model at most {calibration.INIT_PARAMS:,} parameters. "
        f"The launcher's variables are checked like flags: WORLD_SIZE from 1 to {distributed.MAX_WORLD_SIZE:,}, RANK "
        "and LOCAL_RANK below it, all three together.", "",
        "Every JSON a user gives a script (run.json, a checkpoint's config files, task files, .jsonl sources, an option's "
        "JSON) goes through one function, depthbench/files/common.py's `parse_json` (`load_json` for a file, "
        "`json_lines` for JSON Lines with each item's fields and types): a cut-off file, brackets nested deeper than "
        "Python's json reads (its RecursionError), a number of more than 4,300 digits, a field of another type are "
        "one line naming the file (and line), exit 2. A command that runs others says which failed: mini.py --report "
        "exits 1 naming each figure command that did. Weights holding NaN or inf are refused by diagnose.py, an "
        "option that does not apply (`--step` on a run folder) too.", ""]


def render():
    """docs/reliability.md from rules(), FAULTS and CASES."""
    lines = ["# Faults and bad input", "",
             "What the scripts do when something goes wrong. Generated from the tests' own lists by `python "
             "tests/test_reliability.py --write-docs` (tests/test_reliability.py: the rules below are written there, "
             "each fault has its test, each bad input is run as shown), and a test checks this page is what the "
             "generator writes.", "", *rules(),
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
    assert DOCS.read_text(encoding="utf-8") == render(), "run: python tests/test_reliability.py --write-docs"


if __name__ == "__main__" and "--write-docs" in sys.argv:
    DOCS.write_text(render(), encoding="utf-8")
    print(f"wrote {DOCS}")
