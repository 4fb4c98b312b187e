"""
Zero-shot evaluation for diagnose.py's `zeroshot` metric (docs/diagnostics.md#zero-shot): the release's seven tasks
(its eval/run_zero_shot.py: OpenBookQA, WinoGrande, ARC-Challenge, ARC-Easy, HellaSwag, SIQA, PIQA), scored by
lm-evaluation-harness itself on our GPT with the run's tokenizer, so the numbers are lm-eval's: its prompts, its
answer choices, its acc and acc_norm. Offline, one `<task>.jsonl` per task in that task's own hub field layout
(fixtures/zeroshot) is read through lm-eval's own task definition, with only where the data comes from changed.

lm-eval is optional: this module imports it inside the functions that need it (`missing()` says when it is absent).
"""
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from depthbench.files.common import json_lines


@dataclass(frozen=True)
class Task:
    """One of the release's zero-shot tasks, as lm-eval defines it."""
    yaml: str    # lm-eval's task definition, under lm_eval/tasks/
    hub: str     # the hub dataset it reads (and its config), whose field layout a local <task>.jsonl keeps
    split: str   # the split lm-eval scores (its test split where the task has one, else validation)
    fields: tuple  # the hub's fields that lm-eval's prompt, choices and target read (each item must have them)


# lm-eval's task name -> its definition; the release's order (eval/run_zero_shot.py's commonsense set)
ARC = ("question", "choices", "answerKey")
TASKS = {
    "openbookqa": Task("openbookqa/openbookqa.yaml", "allenai/openbookqa (main)", "test",
                       ("question_stem", "choices", "answerKey")),
    "winogrande": Task("winogrande/default.yaml", "allenai/winogrande (winogrande_xl)", "validation",
                       ("sentence", "option1", "option2", "answer")),
    "arc_challenge": Task("arc/arc_challenge.yaml", "allenai/ai2_arc (ARC-Challenge)", "test", ARC),
    "arc_easy": Task("arc/arc_easy.yaml", "allenai/ai2_arc (ARC-Easy)", "test", ARC),
    "hellaswag": Task("hellaswag/hellaswag.yaml", "Rowan/hellaswag", "validation",
                      ("activity_label", "ctx_a", "ctx_b", "endings", "label")),
    "social_iqa": Task("siqa/siqa.yaml", "lighteval/siqa", "validation",
                       ("context", "question", "answerA", "answerB", "answerC", "label")),
    "piqa": Task("piqa/piqa.yaml", "baber/piqa", "validation", ("goal", "sol1", "sol2", "label")),
}
FIELD_TYPES = {"choices": dict, "endings": list, "label": (int, str)}  # the others are text (str)
METRICS = ("acc", "acc_norm")  # what lm-eval reports for these tasks (WinoGrande and SIQA: acc only)


def missing():
    """Why zero-shot evaluation cannot run here (lm-eval is not installed), or None."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return "zeroshot needs the optional lm-eval package (pip install lm-eval)"
    return None


def check_args(parser, args, asked):
    """diagnose.py's zero-shot options, before any work (asked: zeroshot is among the metrics): --zeroshot-data's
    files (check_data) and --skip-missing-tasks, which applies to them; else one line and exit 2 (parser.error)."""
    if args.skip_missing_tasks and not (asked and args.zeroshot_data):
        parser.error("--skip-missing-tasks applies to --metrics zeroshot with --zeroshot-data")
    if not (asked and args.zeroshot_data):
        return
    try:
        check_data(args.zeroshot_data, args.tasks, skip_missing=args.skip_missing_tasks)
    except ValueError as e:
        parser.error(f"--zeroshot-data: {e}")


def check_data(data_dir, tasks, skip_missing=False):
    """Local zero-shot data, checked before lm-eval reads it: each asked task's data_dir/<task>.jsonl holds at least
    one item, every line a JSON object with the task's fields (its hub layout, as in fixtures/zeroshot). A ValueError
    (one line naming the file, the line and what is wrong) otherwise; a task without a file too, unless skip_missing
    (then evaluate reports it skipped) -> the tasks without a file."""
    absent = [name for name in tasks if not (Path(data_dir) / f"{name}.jsonl").is_file()]
    if absent and not skip_missing:
        raise ValueError(f"no {absent[0]}.jsonl in {data_dir} (for {', '.join(absent)}): add it, leave the task out "
                         f"of --tasks, or give --skip-missing-tasks")
    for name in tasks:
        if name not in absent:
            check_task_file(Path(data_dir) / f"{name}.jsonl", TASKS[name].fields)
    return absent


def check_task_file(path, fields):
    """A ValueError (common.JsonError, one line naming the file and the line) unless path's every non-blank line is
    a JSON object holding `fields`, each of its type (FIELD_TYPES; text otherwise), and there is at least one."""
    json_lines(path, {name: FIELD_TYPES.get(name, str) for name in fields}, hint=": the hub dataset's layout, as in "
               "fixtures/zeroshot")


# ----------------------------------------------------------------------------- our GPT, scored

@torch.no_grad()
def score(model, pairs, max_len, batch_size=8, device="cpu"):
    """[(context ids, continuation ids)] -> [(sum of log p(continuation | context), whether greedy decoding gives the
    continuation)], as lm-eval's models score: context + continuation left-truncated to max_len + 1 tokens, the
    continuation's tokens scored teacher-forced. Longest first in batches of batch_size, right-padded (a causal
    model's positions never see the padding after them); results in the order given."""
    order = sorted(range(len(pairs)), key=lambda k: -(len(pairs[k][0]) + len(pairs[k][1])))
    out = [None] * len(pairs)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        seqs = [(list(pairs[k][0]) + list(pairs[k][1]))[-(max_len + 1):] for k in chunk]
        x = torch.zeros(len(chunk), max(len(s) for s in seqs) - 1, dtype=torch.long)
        for r, s in enumerate(seqs):
            x[r, :len(s) - 1] = torch.tensor(s[:-1])
        logp = model(x.to(device))[0].float().log_softmax(-1)
        for r, (k, s) in enumerate(zip(chunk, seqs)):
            n = min(len(pairs[k][1]), len(s) - 1)              # the continuation's tokens that fit
            target = torch.tensor(s[len(s) - n:], device=logp.device)
            lp = logp[r, len(s) - 1 - n:len(s) - 1]              # position t predicts token t + 1
            ll = lp.gather(-1, target[:, None]).double().sum().item()
            out[k] = (ll, bool((lp.argmax(-1) == target).all()))
    return out


def harness_model(model, tok, max_len, batch_size=8, device="cpu"):
    """Our GPT as an lm-eval model: a subclass of lm-eval's TemplateLM (its LM base for models with a tokenizer,
    which tokenizes context and continuation as its own models do), with batched loglikelihood and
    loglikelihood_rolling on `score`; generate_until is refused in one line."""
    from lm_eval import utils
    from lm_eval.api.model import TemplateLM

    class DepthbenchLM(TemplateLM):
        backend = "causal"

        def __init__(self):
            super().__init__()
            self._device = torch.device(device)

        @property
        def eot_token_id(self):
            return tok.eot                       # also what an empty context starts from (prefix_token_id)

        @property
        def max_length(self):
            return max_len

        @property
        def tokenizer_name(self):
            return tok.name

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return list(tok.encode_batch([string])[0])   # no BOS, no special tokens: as the model was trained

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
            results = score(model, [(ctx, cont) for _, ctx, cont in requests], max_len, batch_size=batch_size, device=device)
            for (key, _, _), result in zip(requests, results):
                self.cache_hook.add_partial("loglikelihood", key, result)
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            """A text's log-likelihood in windows of max_len tokens, each token predicted once (lm-eval's rule)."""
            owner, windows = [], []
            for k, (text,) in enumerate(req.args for req in requests):
                rolling = utils.get_rolling_token_windows(token_list=self.tok_encode(text), context_len=1,
                                                          prefix_token=self.prefix_token_id, max_seq_len=max_len)
                for window in map(utils.make_disjoint_window, rolling):
                    owner.append(k)
                    windows.append(window)
            totals = [0.0] * len(requests)
            for k, (ll, _) in zip(owner, score(model, windows, max_len, batch_size=batch_size, device=device)):
                totals[k] += ll
            for req, total in zip(requests, totals):
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            return totals

        def generate_until(self, requests, disable_tqdm=False):
            raise NotImplementedError("depthbench's lm-eval model scores log-likelihoods only; generative tasks "
                                      "(generate_until) are not supported")

    return DepthbenchLM()


# ----------------------------------------------------------------------------- the tasks

def lm_eval_config(name):
    """lm-eval's own definition of task `name` as a dict: its YAML with includes merged and !function resolved."""
    import lm_eval.tasks
    path = Path(lm_eval.tasks.__file__).parent / TASKS[name].yaml
    try:
        from lm_eval.tasks._yaml_loader import load_yaml        # lm-eval 0.4.10 and newer
    except ImportError:
        from lm_eval.utils import load_yaml_config               # older 0.4 releases
        return load_yaml_config(str(path))
    return load_yaml(path, resolve_func=True)


def hub_config(name):
    """lm-eval's definition of task `name`, as its task manager would build it from the name (which would first
    index every task lm-eval has: seconds)."""
    return {k: v for k, v in lm_eval_config(name).items() if k not in ("tag", "group")}


def local_config(name, path):
    """lm-eval's definition of task `name`, reading `path` (JSONL in the hub's fields) as the split it scores:
    prompts, choices, targets, preprocessing and metrics stay lm-eval's; only where the data comes from changes."""
    split = TASKS[name].split
    return {**hub_config(name), "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(Path(path).resolve())}},
            "training_split": None, "validation_split": None, "test_split": None, f"{split}_split": split}


def evaluate(lm, tasks, data_dir=None, limit=None, samples=False):
    """lm-eval's simple_evaluate on `tasks` (names of TASKS) as the release runs it (each task's own few-shot count,
    0 for these seven), from the hub or from data_dir/<task>.jsonl -> {task: acc and acc_norm with their standard
    errors as lm-eval reports them, the examples scored, the few-shot count, the source}; with samples, lm-eval's
    per-example records too. A task without a file is {"skipped": why}."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    logging.getLogger("lm_eval").setLevel(logging.WARNING)     # its INFO lines would bury the progress bars
    specs, results, source = [], {}, {}
    for name in tasks:
        path = Path(data_dir) / f"{name}.jsonl" if data_dir else None
        if path is not None and not path.is_file():  # --skip-missing-tasks (check_data refuses it otherwise)
            results[name] = {"skipped": f"no {name}.jsonl in {data_dir}"}
            print(f"zeroshot: {name} skipped (no {name}.jsonl in {data_dir}; --skip-missing-tasks)", flush=True)
            continue
        specs.append(local_config(name, path) if path else hub_config(name))
        source[name] = str(path) if path else TASKS[name].hub
    if not specs:
        return results
    out = lm_eval.simple_evaluate(model=lm, tasks=specs, num_fewshot=None, limit=limit, log_samples=samples,
                                  task_manager=TaskManager(include_defaults=False))  # not its whole index (6 s)
    for name in source:
        got = out["results"][name]
        row = {m: got[f"{m},none"] for m in METRICS if f"{m},none" in got}
        row.update({f"{m}_stderr": got[f"{m}_stderr,none"] for m in METRICS if f"{m}_stderr,none" in got})
        row.update(num_examples=out["n-samples"][name]["effective"], num_fewshot=out["configs"][name]["num_fewshot"],
                   source=source[name])
        if samples:
            row["samples"] = out["samples"][name]
        results[name] = row
    return {name: results[name] for name in tasks}


def version():
    """The installed lm-eval's version, for the JSON."""
    from importlib.metadata import version as installed
    return installed("lm_eval")
