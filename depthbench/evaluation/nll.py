"""
Downstream NLL for diagnose.py's `nll` metric (the paper's Fig. 4, docs/diagnostics.md#nll): each example of six sets
becomes a prompt and a target in the reference's formats, and the summed log-likelihood of the target tokens is
scored teacher-forced. Offline, `{task}.jsonl` files in each set's own fields (fixtures/nll) stand in for the hub.
"""
import hashlib
import math
import random
from pathlib import Path

import torch
from tqdm import tqdm

import data
from depthbench.files.common import JsonError, first_line, json_lines

# task -> (category, hub dataset, config, split), as the reference's NLL script
TASKS = {"mbpp": ("coding", "google-research-datasets/mbpp", "full", "test"),
         "humaneval": ("coding", "openai/openai_humaneval", None, "test"),
         "sciq": ("stem", "allenai/sciq", None, "test"),
         "gpqa_diamond": ("stem", "Idavidrein/gpqa", "gpqa_diamond", "train"),
         "gsm8k": ("math", "openai/gsm8k", "main", "test"),
         "math500": ("math", "HuggingFaceH4/MATH-500", None, "test")}
# task -> the fields nll_pair reads of a row, and their types (a local {task}.jsonl is checked against them)
FIELDS = {"mbpp": {"text": str, "code": str, "test_list": list}, "humaneval": {"prompt": str, "canonical_solution": str},
          "sciq": {"question": str, "correct_answer": str, "support": str},
          "gpqa_diamond": {"Question": str, "Correct Answer": str, **{f"Incorrect Answer {k}": str for k in (1, 2, 3)}},
          "gsm8k": {"question": str, "answer": str}, "math500": {"problem": str, "answer": str}}


def nll_pair(task, row):
    """(prompt, target = the answer text) of one example in the reference's formats (docs/diagnostics.md#nll)."""
    if task == "mbpp":
        tests = (list(row["test_list"]) + ["", "", ""])[:3]
        prompt = (f"You are an expert Python programmer, and here is your task: {row['text']} "
                  "Your code should pass these tests:\n\n" + "\n".join(tests) + "\n[BEGIN]\n")
        return prompt, row["code"] if row["code"].endswith("\n") else row["code"] + "\n"
    if task == "humaneval":
        return row["prompt"], row["canonical_solution"]
    if task == "sciq":
        prompt = f"Question: {row['question']}\nAnswer:"
        target = f" {row['correct_answer']}\nExplanation: {row['support']}"
    elif task == "gpqa_diamond":
        correct = row["Correct Answer"].strip()
        options = [correct] + [row[f"Incorrect Answer {k}"].strip() for k in (1, 2, 3)]
        key = row.get("Record ID") or row["Question"]  # the shuffle is seeded by the record, so it is stable
        random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")).shuffle(options)
        choices = "".join(f"{c}. {o}\n" for c, o in zip("ABCD", options))
        prompt = f"Question: {row['Question'].strip()}\nChoices:\n{choices}Answer:"
        expl = (row.get("Explanation") or "").strip()
        target = f" {correct}" + (f"\nExplanation: {expl}" if expl else "")
    elif task == "gsm8k":
        prompt, target = f"Question: {row['question']}\nAnswer:", f" {row['answer']}"
    else:  # math500
        prompt, target = f"Problem:\n{row['problem']}\n\nSolution:", f" {row.get('solution') or row['answer']}"
    if prompt and target and not prompt[-1].isspace() and not target[0].isspace():  # leading-separator rule
        target = " " + target
    return prompt, target


def encode_pair(tok, prompt, target):
    """lm-eval's _encode_pair: the prompt's trailing whitespace moves to the target; the continuation is
    tokens(prompt + target) after the first len(tokens(prompt)) tokens. No BOS, no special tokens."""
    n = len(prompt) - len(prompt.rstrip())
    if n:
        prompt, target = prompt[:-n], prompt[-n:] + target
    whole, ctx = tok.encode_batch([prompt + target, prompt])
    return list(ctx), list(whole[len(ctx):])


def local_rows(nll_data, task):
    """{task}.jsonl under nll_data, every row holding the fields nll_pair reads, of their types (FIELDS) -> the rows;
    None when there is no such file; a damaged one: a JsonError naming the file and the line."""
    path = Path(nll_data) / f"{task}.jsonl"
    if not path.exists():
        return None
    return json_lines(path, FIELDS[task], hint=": the hub dataset's layout, as in fixtures/nll")


def nll_rows(task, nll_data, limit):
    """The task's rows: from {task}.jsonl under nll_data (None if there is none), else from the hub."""
    if nll_data:
        rows = local_rows(nll_data, task)
        if rows is None:
            return None
    else:
        import datasets
        rows = datasets.load_dataset(*TASKS[task][1:3], split=TASKS[task][3])
    return [rows[k] for k in range(min(len(rows), limit or len(rows)))]


@torch.no_grad()
def nll_task(model, tok, rows, task, max_len=2048, batch_size=8, device="cpu"):
    """Summed NLL of the answer tokens over all examples, and how many answer tokens were scored."""
    seqs = []
    for row in rows:
        ctx, cont = encode_pair(tok, *nll_pair(task, row))
        seq = (ctx + cont)[-(max_len + 1):]           # left-truncate to the model's training length
        seqs.append((seq, min(len(cont), len(seq) - 1)))
    total, count = 0.0, 0
    for k in range(0, len(seqs), batch_size):
        chunk = seqs[k:k + batch_size]
        x = torch.zeros(len(chunk), max(len(s) for s, _ in chunk) - 1, dtype=torch.long)  # right-padded
        for r, (seq, _) in enumerate(chunk):
            x[r, :len(seq) - 1] = torch.tensor(seq[:-1])
        if int(x.max()) >= model.cfg.vocab_size:
            raise data.DataError(f"{task}: token ids reach {int(x.max())}, beyond the model's vocab {model.cfg.vocab_size}")
        logp = model(x.to(device))[0].float().log_softmax(-1)
        for r, (seq, n) in enumerate(chunk):
            tgt = torch.tensor(seq[len(seq) - n:], device=device)
            total -= logp[r, len(seq) - 1 - n:len(seq) - 1].gather(-1, tgt[:, None]).double().sum().item()
            count += n
    return total, count


def pooled(nll_sum, tokens, **extra):
    mean = nll_sum / tokens if tokens else None
    return {**extra, "nll_mean": mean, "nll_sum": nll_sum, "num_target_tokens": tokens,
            "perplexity": None if mean is None else math.exp(min(mean, 700.0))}


def evaluate(model, tok, tasks, nll_data=None, limit=None, max_len=2048, batch_size=8, device="cpu"):
    """Every task's pooled NLL, then per category and over all (pooled over tokens, not a mean of the task means);
    a task without data (no {task}.jsonl in nll_data, a gated hub set) is {"skipped": why}, the others go on."""
    results = {}
    for task in tasks if nll_data else []:  # a damaged local file is the user's to fix, not a task to skip
        try:
            local_rows(nll_data, task)
        except JsonError as e:  # one line, exit 2 (diagnose.py), before any task is scored
            raise data.DataError(f"--nll-data: {e}") from None
    for task in tqdm(tasks, desc="nll", unit="task"):
        try:
            rows = nll_rows(task, nll_data, limit) or f"no {task}.jsonl in {nll_data}"
        except Exception as e:  # a gated or missing dataset costs that task only (the hub itself was checked)
            rows = f"{type(e).__name__}: {first_line(e)}"
        if isinstance(rows, str):
            results[task] = {"skipped": rows}
            continue
        s, n = nll_task(model, tok, rows, task, max_len=max_len, batch_size=batch_size, device=device)
        results[task] = pooled(s, n, category=TASKS[task][0], num_examples=len(rows))
    done = {t: v for t, v in results.items() if "skipped" not in v}

    def pool(ts):
        return pooled(sum(done[t]["nll_sum"] for t in ts), sum(done[t]["num_target_tokens"] for t in ts), tasks=ts)
    cats = dict.fromkeys(v["category"] for v in done.values())
    return {"tasks": results, "categories": {c: pool([t for t in done if done[t]["category"] == c]) for c in cats},
            "aggregate": pool(list(done)), "source": nll_data or "huggingface hub", "max_len": max_len}
