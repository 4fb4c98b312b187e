"""
What a first-day user hits (issue 51): every script's --help, and every file a script reads, read by type.

- --help and -h of every script: exit 0, the usage, never a traceback (in this process for the quick tier; in a
  process of its own, as typed, in the slow one).
- Each reader of a checkpoint (train.py --resume, diagnose.py, export.py), of run.json (train.py, mini.py --report)
  and of an official config.json (depthbench.files.official), fed a truncated, a mistyped and a foreign file: one line,
  exit 2, nothing written.
- --max-steps below the step a run reached, the run.json rebuild said once, a long message cut at a word's end,
  export.py's offline GPT-2 message, the zero-shot data checked before lm-eval reads it.

    python -m pytest -q tests/test_first_day.py -m "not slow"
"""
import importlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from depthbench.files import common, runlog
from depthbench.evaluation import zeroshot
import data
import train
from model import GPT, GPTConfig
from test_train import TINY, one_thread, run_main  # noqa: F401 (one_thread: one thread here too)

ROOT = Path(__file__).resolve().parents[1]


def scripts():
    """Every script a user runs: (the path as typed, the module its main is in), found by their __main__ block:
    the root's, depthbench's (run with -m) and scripts/."""
    found = []
    for path in sorted(ROOT.glob("*.py")) + sorted((ROOT / "depthbench").rglob("*.py")) + sorted(
            (ROOT / "scripts").glob("*.py")):
        if re.search(r'^if __name__ == "__main__":', path.read_text(), re.M):
            rel = path.relative_to(ROOT)
            found.append((str(rel), ".".join(rel.with_suffix("").parts)))
    return found


SCRIPTS = scripts()


def test_every_script_is_found():
    """The list the help tests run: every script the issue names, none missed by the search."""
    names = {Path(rel).stem for rel, _ in SCRIPTS}
    assert {"train", "diagnose", "profile_gpu", "plot", "mini", "export", "shapes", "data", "official",
            "gpu_smoke", "paired_intervals", "mutation_score", "kernel_count"} <= names, names


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("rel, module", SCRIPTS, ids=[rel for rel, _ in SCRIPTS])
def test_every_help_formats(capsys, rel, module, flag):
    """main([flag]) of each script, in this process: argparse formats every help text (a % in one built from data
    once ended train.py --help in a TypeError), prints the usage and exits 0."""
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main([flag])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and out.startswith("usage: ") and not err, err


@pytest.mark.slow
def test_every_help_runs_as_typed():
    """`python SCRIPT --help` (depthbench's modules: `python -m`), each a process of its own as a user types it (what
    the imports at its top do and its __main__ block included): exit 0, the usage, no traceback. Two processes at a
    time (each is one thread importing). `-h` runs in this process (test_every_help_formats): argparse gives both
    flags the one help action and no script reads either before its parser does, so a process per flag imported
    every script twice for nothing (44 processes, ~40 s: now 22)."""
    def run(case):
        (rel, module), flag = case
        command = ["-m", module] if rel.startswith("depthbench") else [rel]
        p = subprocess.run([sys.executable, "-B", *command, flag], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if p.returncode != 0 or "Traceback" in p.stderr or not p.stdout.startswith("usage: "):
            return f"{rel} {flag}: exit {p.returncode}: {p.stderr[-300:]}"
        return None

    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = [f for f in pool.map(run, itertools.product(SCRIPTS, ["--help"])) if f]
    assert not failed, "\n".join(failed)


def test_a_help_text_with_a_percent_sign():
    """The one place every help passes through (common.HelpFormatter) keeps argparse's %(default)s and %% and
    escapes any other %, in ArgParser and in a parser that asks for argparse's RawDescriptionHelpFormatter."""
    import argparse
    for formatter in (common.HelpFormatter, argparse.RawDescriptionHelpFormatter):
        p = common.ArgParser(prog="x", formatter_class=formatter)
        p.add_argument("--a", default=3, help="the last 20% of the steps, 5%% here, %(default)s by default")
        assert "the last 20% of the steps, 5% here, 3 by default" in " ".join(p.format_help().split())


# ----------------------------------------------------------------------------- files read by type

@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
    """A run stopped at step 2 of 4 (--max-steps 2): run.json and ckpt.pt as train.py leaves them."""
    root = tmp_path_factory.mktemp("partial")
    with pytest.raises(SystemExit):
        train.main(TINY + ["--steps", "4", "--max-steps", "2", "--out", str(root)])
    (run,) = root.iterdir()
    return run


def files(tmp):
    """{path: bytes} of every file under tmp but the run folders' lock files."""
    return {p: p.read_bytes() for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != ".lock"}


def edited(change):
    """A damage that loads ckpt.pt, applies change(ckpt) and saves it back."""
    def damage(path):
        ckpt = torch.load(path, weights_only=True)
        change(ckpt)
        torch.save(ckpt, path)
    return damage


def other_design(ckpt):
    """HC's weights, of the same shape otherwise, under the run's Pre-LN config."""
    ckpt["model"] = GPT(GPTConfig(**{**ckpt["model_config"], "residual": "hc"})).state_dict()


# the damages of a checkpoint: name -> (damage(path), what the one line says)
CHECKPOINT_DAMAGES = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:2000]), "truncated or not a depthbench checkpoint"),
    "foreign": (lambda p: torch.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 3}, p),
                "not a depthbench checkpoint (no 'model' in it)"),
    "text": (lambda p: p.write_text("not a checkpoint"), "truncated or not a depthbench checkpoint"),
    "config a string": (edited(lambda c: c.update(config="preln")),
                        "field 'config' is a string, not an object"),
    "step a string": (edited(lambda c: c.update(step="2")), "field 'step' is '2', not a step count"),
    "residual a number": (edited(lambda c: c["config"].update(residual=5)),
                          "field 'config.residual' is a number, not a string"),
    "residual no design": (edited(lambda c: c["model_config"].update(residual="nope")),
                           "field 'model_config.residual' is 'nope', not a design of residuals.py"),
    "model_config a list": (edited(lambda c: c.update(model_config=[1])),
                            "field 'model_config' is a list, not an object"),
    "another design's weights": (edited(other_design), "its weights are not those of its config's preln model"),
}
READERS = {
    "train.py": lambda run, out: train.main(TINY + ["--steps", "4", "--resume", "--out", str(run.parent)]),
    "diagnose.py": lambda run, out: importlib.import_module("diagnose").main(
        [str(run), "--metrics", "erank", "--num-samples", "2", "--seq-len", "8", "--out", str(out / "d.json")]),
    "export.py": lambda run, out: importlib.import_module("export").main(
        [str(run), "--format", "official", "--out", str(out / "o")]),
}


@pytest.mark.parametrize("damage", CHECKPOINT_DAMAGES)
@pytest.mark.parametrize("reader", READERS)
def test_each_checkpoint_reader_refuses_a_damaged_file(tmp_path, capsys, partial_run, reader, damage):
    """Each reader of a run's ckpt.pt, fed a truncated, a foreign, a mistyped file or another design's weights: one
    line naming the file and what is wrong (never cut mid-word), exit 2, no traceback, nothing written."""
    run = tmp_path / "runs" / partial_run.name
    shutil.copytree(partial_run, run)
    make, says = CHECKPOINT_DAMAGES[damage]
    make(run / "ckpt.pt")
    before = files(tmp_path)
    with pytest.raises(SystemExit) as e:
        READERS[reader](run, tmp_path)
    err = capsys.readouterr().err
    assert (e.value.code, len(err.splitlines())) == (2, 1), err
    assert err.startswith(f"{reader}: error: ") and str(run / "ckpt.pt") in err and says in err, err
    assert files(tmp_path) == before


# the damages of a run.json: name -> (its text, from the run's own; what the one line says)
RUN_JSON_DAMAGES = {
    "truncated": (lambda text: text[:len(text) // 2], "not a run log of train.py: it is not JSON"),
    "foreign": (lambda text: json.dumps({"loss": 1.0, "epoch": 3}), "field 'schema' is missing"),
    "mistyped": (lambda text: json.dumps({**json.loads(text), "steps": "2"}), "field 'steps' is a string"),
}


@pytest.mark.parametrize("damage", RUN_JSON_DAMAGES)
def test_each_run_json_reader_refuses_a_damaged_file(tmp_path, capsys, partial_run, damage):
    """The one reader of run.json (depthbench/files/runlog.py) and the scripts on it, train.py and mini.py --report, fed
    a truncated, a foreign and a mistyped run.json: a RunLogError; one line, exit 2, nothing written."""
    import mini
    run = tmp_path / "synthetic" / partial_run.name
    shutil.copytree(partial_run, run)
    write, says = RUN_JSON_DAMAGES[damage]
    (run / "run.json").write_text(write((run / "run.json").read_text()))
    with pytest.raises(runlog.RunLogError, match=re.escape(says)):
        runlog.read_run_log(run / "run.json")
    before = files(tmp_path)
    for reader, main in (("train.py", lambda: train.main(TINY + ["--steps", "4", "--out", str(run.parent)])),
                         ("mini.py", lambda: mini.main(["--report", "--out", str(tmp_path)]))):
        with pytest.raises(SystemExit) as e:
            main()
        err = capsys.readouterr().err
        assert (e.value.code, len(err.splitlines())) == (2, 1), err
        assert err.startswith(f"{reader}: error: ") and says in err, err
        assert files(tmp_path) == before


def official_step(tmp):
    """An official step folder of a small Pre-LN model (tests/test_official.py's)."""
    from test_official import ours, write_checkpoint
    return write_checkpoint(tmp / "step1", ours("preln"))


OFFICIAL_DAMAGES = {
    "truncated": (lambda text: text[:len(text) // 2], "not an OLMo-core experiment config (JSONDecodeError"),
    "foreign": (lambda text: json.dumps(["a", "list"]), "not an OLMo-core experiment config (TypeError"),
    "a block that is a string": (lambda text: json.dumps({**json.loads(text), "model": {
        **json.loads(text)["model"], "block": "x"}}), "not an OLMo-core experiment config (AttributeError"),
    "lm_head a string": (lambda text: json.dumps({**json.loads(text), "model": {
        **json.loads(text)["model"], "lm_head": "x"}}), "section 'lm_head' is a string, not an object"),
    "export section a list": (lambda text: json.dumps({**json.loads(text), "depthbench": [1]}),
                              "section 'depthbench' is a list, not an object"),
    "tokenizer a number": (lambda text: json.dumps({**json.loads(text), "dataset": {"tokenizer": 5}}),
                           "section 'tokenizer' is a number, not an object"),
}


@pytest.mark.parametrize("damage", OFFICIAL_DAMAGES)
def test_an_official_config_is_read_by_type(tmp_path, capsys, damage):
    """depthbench.files.official (and diagnose.py through it) on a config.json cut off, of another program, or with a
    section of another type: one line naming the file, exit 2, never an AttributeError's traceback."""
    from depthbench.files import official
    step = official_step(tmp_path)
    write, says = OFFICIAL_DAMAGES[damage]
    (step / "config.json").write_text(write((step / "config.json").read_text()))
    with pytest.raises(SystemExit) as e:
        official.main(["info", str(step)])
    err = capsys.readouterr().err
    assert (e.value.code, len(err.splitlines())) == (2, 1), err
    assert err.startswith("depthbench.files.official: error: ") and "config.json" in err and says in err, err


# ----------------------------------------------------------------------------- resume, messages

def test_max_steps_below_the_step_reached_is_refused(tmp_path, capsys, partial_run):
    """--resume --max-steps 1 on a run at step 2: one line, exit 2, run.json and ckpt.pt untouched (it once said
    "stopping at 1", ended "done at step 2" and recorded max_steps 1 beside 2 steps). --max-steps 2 still resumes
    (nothing to train: done at once)."""
    run = tmp_path / partial_run.name
    shutil.copytree(partial_run, run)
    before = files(tmp_path)
    code, out, err = run_main(TINY + ["--steps", "4", "--max-steps", "1", "--resume", "--out", str(tmp_path)], capsys)
    assert code == 2 and err.splitlines() == [
        f"train.py: error: cannot resume {run / 'ckpt.pt'} with --max-steps 1: the run is at step 2 already (give "
        "--max-steps 2 or more, or leave it out)"], err
    assert files(tmp_path) == before
    code, out, err = run_main(TINY + ["--steps", "4", "--max-steps", "2", "--resume", "--out", str(tmp_path)], capsys)
    assert code == 0 and "resumed from" in out, err


def test_the_rebuilt_run_json_is_said_once(tmp_path, capsys, partial_run):
    """--resume over a cut-off run.json beside a whole ckpt.pt: the rebuild is one line of the output, not two."""
    run = tmp_path / partial_run.name
    shutil.copytree(partial_run, run)
    (run / "run.json").write_text((run / "run.json").read_text()[:100])
    code, out, err = run_main(TINY + ["--steps", "4", "--max-steps", "2", "--resume", "--out", str(tmp_path)], capsys)
    assert code == 0 and len([line for line in out.splitlines() if "run.json was damaged" in line]) == 1, out + err


def test_a_long_message_is_cut_at_a_word_end():
    """common.first_line: a line over the width ends at a whole word, marked ' ...', within the width; a short one,
    and width None, keep it all."""
    e = RuntimeError("Unexpected key(s) in state_dict: " + ", ".join(f'"blocks.{i}.res.alpha_res"' for i in range(40)))
    line = common.first_line(e)
    assert len(line) <= 200 and line.endswith(" ...") and str(e).startswith(line[:-4])
    assert str(e)[len(line) - 4] in " ,"  # the next character ends a word: none was cut
    assert common.first_line(e, None) == str(e) and common.first_line(ValueError("short\nsecond")) == "short"


def test_export_offline_names_only_what_export_accepts(tmp_path, monkeypatch):
    """Offline without GPT-2's BPE files, export.py's message names the way out it has (TIKTOKEN_CACHE_DIR), not
    --tokenizer bytes (a flag export.py lacks: the run trained on GPT-2's ids); data.py's keeps it."""
    export = importlib.import_module("export")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(data, "unreachable", lambda url, timeout=5.0: "ConnectionError")
    with pytest.raises(data.DataError) as e:
        export.gpt2_files()
    assert "TIKTOKEN_CACHE_DIR" in str(e.value) and "--tokenizer" not in str(e.value)
    with pytest.raises(data.DataError, match="or use --tokenizer bytes"):
        data.check_tiktoken_files()


def test_zero_shot_data_with_skip_missing_tasks(tmp_path):
    """check_data: a folder lacking an asked task's file is an error unless skip_missing, which returns the tasks
    it skips; the files present are still checked (fixtures/zeroshot's pass)."""
    shutil.copy(ROOT / "fixtures" / "zeroshot" / "piqa.jsonl", tmp_path)
    with pytest.raises(ValueError, match="no winogrande.jsonl in"):
        zeroshot.check_data(tmp_path, ["piqa", "winogrande"])
    assert zeroshot.check_data(tmp_path, ["piqa", "winogrande"], skip_missing=True) == ["winogrande"]
    assert zeroshot.check_data(ROOT / "fixtures" / "zeroshot", list(zeroshot.TASKS)) == []
    (tmp_path / "piqa.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b"}\n')
    with pytest.raises(ValueError, match="piqa.jsonl:1: no field 'label'"):
        zeroshot.check_data(tmp_path, ["piqa", "winogrande"], skip_missing=True)
