"""
diagnose.py: the layer-wise diagnostics of DepthBench for one model, as one JSON file.

    python diagnose.py runs/preln_L6 --metrics all --out diag.json          # a run folder holding ckpt.pt
    python diagnose.py runs/hc_L6/ckpt.pt --metrics angular,causal --num-samples 16 --seq-len 128
    python diagnose.py --init attnres --layers 6 --width 128 --heads 4       # a fresh model, synthetic text
    python diagnose.py runs/austen_L6 --metrics nll --nll-data fixtures/nll  # NLL offline, on local JSONL

Metrics: angular, causal, perm, lens, pruning, attnres, erank, deadzone, nll. DEFINITIONS below says what
each computes, and the JSON carries it next to the numbers. docs/diagnostics.md has the setup (fp32, eval mode,
no gradients, fp64 sums), the depth states (the model's own `model(idx, record=True)`, no hooks) and the
interventions (`model(idx, skip=b)`; a swap moves two blocks' weights with the residual's own tensors).
"""
import contextlib
import glob
import hashlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from depthbench import common  # first, before torch: its sys.excepthook makes a Ctrl-C during the imports one line
import torch
import torch.nn.functional as F
from tqdm import tqdm

import data
from depthbench.common import (ArgParser, CheckpointError, check_options, comma_list, design_options, fail, first_line,
                    hub_unreachable, json_object, load_checkpoint, pick_device, positive, seed_number, write_json,
                    VAL_SEED)
from depthbench import official
import shapes
from depthbench import runlog, synthetic, windows
from model import GPT, GPTConfig
from ops import dead_zone, erank  # the metrics the designs' telemetry shares
from residuals import RESIDUALS

SCHEMA = "depthbench.diagnose/2"  # 2: R_perm is over the last three quarters (1: over all pairs)
METRICS = {"angular": "angular_distance", "causal": "causal_score", "perm": "permutation_score",
           "lens": "logit_lens", "pruning": "layer_pruning", "attnres": "attnres_weights",
           "erank": "transport_erank", "deadzone": "dead_zone", "nll": "nll"}
# what each metric computes; written into its JSON object as "definition"
DEFINITIONS = {
    "angular": "d(i, j) = mean over tokens of arccos(cos(z_i, z_j)) / pi for depth states i < j: z_0 = "
               "embedding, z_l = stream before the final norm (HC/mHC: n streams concatenated; AttnRes: raw depth mix "
               "at group boundaries); subsequent[n-1][l] = d(l, l+n)",
    "causal": "u_l = z_(l+1) - z_l; C(s, l) = mean over tokens of |u_l(block s skipped) - u_l| / max(|u_l|, eps), "
              "s < l (design skip rules); matrix_ratio_of_means = mean |du| / mean |u|; R_causal = share of pairs "
              "ceil(L/4) <= s < l <= L-1 (0-based) with C > threshold",
    "perm": "P(i, j) = |loss(blocks i and j swapped) - loss| / loss, mean next-token CE; a swap moves every "
            "tensor of the two blocks incl. the residual's own (norms, HC/mHC connectors, AttnRes: MLP-side mixer "
            "+ the mixer reading the block's output, LNS: its scale) exactly once; R_perm = share of pairs "
            "ceil(L/4) <= i < j <= L-1 (0-based, the last three quarters, as Fig. 6) with P > threshold; R_perm_all = "
            "the same over all pairs i < j",
    "lens": "p_l = softmax(W_out Norm_f(r_l)), r_l = what the head would read at state l (HC/mHC: streams "
            "reduced as the model does; AttnRes: block l's attention-side mix, the final mix at l = L); per position: "
            "CE = -log p_l(next token), KL(p_final || p_l), |top5(p_l) & top5(p_final)| / 5; means over positions",
    "pruning": "delta(l) = mean next-token CE with block l skipped (design skip rules) - baseline CE",
    "attnres": "w[c][j] = depth-softmax weight of consumer c on source j, mean over tokens; consumers 0..2L "
               "(sublayers; 2L = the head's readout), sources 0 = embedding, 1 + g = group g (Full AttnRes: sublayer "
               "g, so 2k+1 = attn k, 2k+2 = MLP k); null = not visible; block: rows = each block's attention-side "
               "consumer and the readout, Full AttnRes sums each block's two sources, Block AttnRes keeps groups",
    "erank": "erank(M) = exp(H(p)), p = sigma / sum(sigma); M = a connector's token-averaged stream transport "
             "(mHC: H_res; HC: A_r = alpha[:, 1:]) as [out, in]; product[k] = erank(M_k ... M_0); "
             "per_connector_sq uses p = sigma^2 / sum(sigma^2)",
    "deadzone": "schedule[k] = token-averaged weight of sublayer k's depth softmax on non-embedding sources ("
                "sublayer 0 reads only the embedding: 0); dead when < tau; count_blocks = blocks with both dead; "
                "Fig. 9 is Block AttnRes', Full AttnRes (groups of one sublayer) gets the same numbers",
    "nll": "-sum log p(answer tokens | prompt), teacher-forced; the prompt's trailing whitespace moves to the "
           "answer, answer tokens = tokens(prompt + answer) after tokens(prompt), left-truncated to max_len + 1; "
           "nll_mean = nll_sum / num_target_tokens, pooled over tokens per task, per category and over all",
}
# task -> (category, hub dataset, config, split), as the reference's NLL script (docs/diagnostics.md#nll)
NLL_TASKS = {"mbpp": ("coding", "google-research-datasets/mbpp", "full", "test"),
             "humaneval": ("coding", "openai/openai_humaneval", None, "test"),
             "sciq": ("stem", "allenai/sciq", None, "test"),
             "gpqa_diamond": ("stem", "Idavidrein/gpqa", "gpqa_diamond", "train"),
             "gsm8k": ("math", "openai/gsm8k", "main", "test"),
             "math500": ("math", "HuggingFaceH4/MATH-500", None, "test")}


# The release's calibration protocol (its analysis scripts' defaults, docs/diagnostics.md#setup): metric -> (windows,
# tokens per window). attnres, erank and deadzone come from the recording forward that angular distance runs.
PROTOCOL = {"angular": (128, 512), "attnres": (128, 512), "erank": (128, 512), "deadzone": (128, 512),
            "lens": (32, 512), "causal": (16, 256), "pruning": (16, 256), "perm": (12, 256)}


@dataclass
class Settings:
    """What the command line and the checkpoint resolve to (argparse's namespace keeps what was typed)."""
    todo: set                   # the metrics to compute
    nll_tasks: list             # the NLL tasks
    seed: int = None            # seeds the windows (and --init's weights)
    samples: dict = field(default_factory=dict)  # metric -> (windows, tokens per window)
    nll_max_len: int = None     # NLL context length
    tok_name: str = None        # tokenizer of text calibration and NLL
    nll_skip: str = None        # why NLL is skipped, or None
    out: str = None             # the output JSON


class DiagError(ValueError):
    """A problem the user can fix; main prints it (and a CheckpointError) as one line and exits with 2."""


# ----------------------------------------------------------------------------- model and calibration text

def load_model(args, st):
    """-> (model, the run's train config, checkpoint path or None, step or None)."""
    if args.init:  # the vocab follows the text: the tokenizer's, else the synthetic task's
        vocab = args.vocab or {"gpt2": data.padded_vocab_size(50257), "bytes": 257}.get(args.tokenizer)
        vocab = vocab or synthetic.SyntheticTask(args.max_gap).vocab_size
        torch.manual_seed(st.seed)
        cfg = GPTConfig(vocab_size=vocab, n_layer=args.layers, d_model=args.width, n_head=args.heads,
                        d_ff=shapes.ffn_dim(args.width), residual=args.init,
                        residual_args=design_options(args.init, args.residual_args), kernels=args.kernels)
        run = {"data": "synthetic" if args.tokenizer is None else None, "tokenizer": args.tokenizer,
               "max_gap": args.max_gap, "seed": st.seed}
        return GPT(cfg), run, None, None
    if official.is_official(args.checkpoint):  # the authors' released OLMo-core checkpoints (depthbench/official.py)
        model, info = official.load(args.checkpoint, args.step, args.kernels, args.residual_args)
        if st.out is None and not Path(args.checkpoint).is_dir():  # not into the hub cache
            st.out = f"diagnose_{args.checkpoint.split('/')[-1]}_step{info['step']}.json"
        return (model, {"tokenizer": info["tokenizer"], "seq_len": info["seq_len"]},
                str(Path(info["step_dir"]) / "config.json"), info["step"])
    if args.residual_args:
        raise DiagError("--residual-args: for --init or an official checkpoint (a run's ckpt.pt records its own)")
    path = Path(args.checkpoint)
    path = path / "ckpt.pt" if path.is_dir() else path
    if not path.is_file():
        raise DiagError(f"{args.checkpoint}: no checkpoint (give a run folder holding ckpt.pt, a .pt file, or --init)")
    ckpt = load_checkpoint(path)
    try:
        model = GPT(GPTConfig(**{**ckpt["model_config"], "kernels": args.kernels}))
        model.load_state_dict(ckpt["model"])
    except Exception as e:  # a config or state dict of another model: not our checkpoint
        raise DiagError(f"{path}: not a depthbench checkpoint ({type(e).__name__}: {first_line(e)})") from None
    try:
        runlog.check_config(ckpt["config"], path)  # the run's settings, read by type
    except runlog.RunLogError as e:
        raise DiagError(str(e)) from None
    return model, ckpt["config"], str(path), ckpt.get("step")


def calibration(args, st, run, N, T):
    """N calibration windows of T tokens -> (x, y) int64 (N, T), y = x shifted by one (-1: no target), and a
    description. --token-data-glob: the release's token-shard rule; --calib auto = the run's own validation data;
    shards give their val windows in order, text N random windows (docs/diagnostics.md#setup)."""
    src = args.calib
    if args.token_data_glob:
        paths = sorted(glob.glob(args.token_data_glob))
        if not paths:
            raise DiagError(f"--token-data-glob {args.token_data_glob}: no file matches")
        try:
            x = windows.token_windows(paths, N, T, seed=st.seed)
        except (ValueError, OSError) as e:  # a file that is no token shard (an odd size, a folder): one line
            raise DiagError(f"--token-data-glob {args.token_data_glob}: not token shards ({first_line(e)})") from None
        what = f"{len(paths)} token shard(s) {args.token_data_glob}, the release's rule, seed {st.seed}"
        return x, windows.shifted(x), what
    if src == "auto":
        src = "synthetic" if run.get("data") == "synthetic" else run.get("data_dir")
        if not src:
            raise DiagError("the checkpoint names no data_dir: give --calib synthetic, a shard folder or text files")
    if src == "synthetic":
        task = synthetic.SyntheticTask(run.get("max_gap") or args.max_gap, run.get("group") or "s4",
                                  answers_only=run.get("answers_only", False))
        x, y, _ = data.BatchLoader(task, "val", N, T, seed=st.seed).get_batch(0, 0)
        return x, y, f"synthetic {task.group} max_gap {task.max_gap}, val split, seed {st.seed}"
    if (Path(src) / "meta.json").exists():
        x, y, _ = data.BatchLoader(src, "val", N, T, seed=st.seed).get_batch(0, 0)
        return x, y, f"val split of {src} (windows 0..{N - 1})"
    x, what = windows.text_windows(src, data.get_tokenizer(st.tok_name or "bytes"), N, T=T, seed=st.seed)
    return x, windows.shifted(x), what


# ----------------------------------------------------------------------------- interventions

def block_tensors(model, b):
    """{name: tensor} that block b owns: its attention and MLP weights, and the residual's own
    tensors of its two sublayers (norm gains, HC/mHC connectors, AttnRes mixers, MoDA's W_kv)."""
    own = {f"block.{n}": p for n, p in model.blocks[b].named_parameters()}
    for side, i in (("attn", 2 * b), ("mlp", 2 * b + 1)):
        own.update({f"{side}.{n}": t for n, t in model.res.sublayer_params(i).items()})
    return own


@torch.no_grad()
def swap_blocks(model, i, j):
    """Swap the weights of blocks i and j in place, twice restores the model (docs/diagnostics.md#interventions);
    -> the swap count. Tensors pair by name and shape (KEEL's block 0 has no attention post-norm: it stays);
    per-block constants (LNS' scales) move with the design's `swap_blocks`."""
    a, b = block_tensors(model, i), block_tensors(model, j)
    seen, n = set(), 0
    for name, ta in a.items():
        tb = b.get(name)
        keys = [(t.data_ptr(), tuple(t.shape), t.stride()) for t in (ta, tb)] if tb is not None else []
        if tb is None or ta.shape != tb.shape or keys[0] == keys[1] or seen & set(keys):
            continue  # a tensor under two names moves once (the reference swapped HC's shared modules twice)
        seen.update(keys)
        tmp = ta.clone()
        ta.copy_(tb)
        tb.copy_(tmp)
        n += 1
    model.res.swap_blocks(i, j)
    return n


# ----------------------------------------------------------------------------- metric math

def ce_sum(logits, y):
    """Summed CE over the targets; -1 marks a position that is no target (an answers-only synthetic run)."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").double().item()


def angle_sums(states, chunk=1024):
    """states: S tensors (N, D') -> (S, S) fp64 sums over tokens of the angle between z_i and z_j.
    fp64, so that a state with itself gives 0, not the ~1e-4 that arccos makes of fp32 rounding."""
    out = 0
    for k in range(0, states[0].size(0), chunk):                         # bounds the fp64 copy
        Z = F.normalize(torch.stack([z[k:k + chunk] for z in states]).double(), dim=-1)  # (S, n, D')
        out = out + torch.arccos(torch.einsum("ind,jnd->ijn", Z, Z).clamp(-1.0, 1.0)).sum(-1)
    return out.cpu()


def share_above(M, threshold, L, lo=0):
    """Over the pairs lo <= a < b <= L-1 (0-based blocks): (number of pairs, how many have M[a][b] > threshold,
    their share). R_causal and R_perm use lo = ceil(L/4), the last three quarters; R_perm_all uses lo = 0."""
    pairs = [(a, b) for a in range(lo, L) for b in range(a + 1, L)]
    above = sum(M[a][b] is not None and M[a][b] > threshold for a, b in pairs)
    return len(pairs), above, (above / len(pairs) if pairs else None)


def triangle(M, ok):
    """Tensor -> list of lists, None where ok(i, j) is false."""
    return [[float(M[i][j]) if ok(i, j) else None for j in range(len(M[i]))] for i in range(len(M))]


# ----------------------------------------------------------------------------- the sweeps

@torch.no_grad()
def sweep(model, batches, todo, eps):
    """One pass over the calibration batches: the recording forward (states, design internals), the
    logit lens, and one forward per skipped block (shared by causal score and pruning). Raw fp64 sums."""
    L = model.cfg.n_layer
    z64 = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
    acc = {"tokens": 0, "targets": 0, "loss": 0.0, "angles": z64(L + 1, L + 1), "skip_loss": z64(L), "ratio": z64(L, L),
           "du": z64(L, L), "u": z64(L), "lens": z64(L + 1, 3), "H_res": 0, "attnres_weights": 0}
    bar = tqdm(total=len(batches) * (1 + L * bool({"causal", "pruning"} & todo)), desc="layers", unit="fwd")
    for x, y in batches:
        n = x.numel()
        logits, _, rec = model(x, record=True)                              # states, readouts, internals
        acc["tokens"] += n
        acc["targets"] += int((y >= 0).sum())
        acc["loss"] += ce_sum(logits, y)
        states = [z.float().flatten(0, 1) for z in rec["states"]]           # L+1 x (N, D'), stream-major for HC
        if "angular" in todo:
            acc["angles"] += angle_sums(states)
        for key in ("H_res", "attnres_weights"):                            # token means of this batch -> sums
            if key in rec:
                acc[key] = [a + v.double().cpu() * n for a, v in zip(acc[key] or [0] * len(rec[key]), rec[key])]
        if "lens" in todo:
            acc["lens"] += lens_sums(model, rec["readouts"], logits, y)
        bar.update()
        u = torch.stack([b - a for a, b in zip(states, states[1:])])        # (L, N, D') the blocks' updates
        u_norm = u.norm(dim=-1)                                               # (L, N)
        acc["u"] += u_norm.double().sum(-1).cpu()
        for s in range(L) if {"causal", "pruning"} & todo else []:
            logits_s, _, rec_s = model(x, record=True, skip=s)
            acc["skip_loss"][s] += ce_sum(logits_s, y)
            if s < L - 1 and "causal" in todo:
                z = [t.float().flatten(0, 1) for t in rec_s["states"]]
                d = torch.stack([z[l + 1] - z[l] - u[l] for l in range(s + 1, L)]).norm(dim=-1)  # (L-s-1, N)
                acc["ratio"][s, s + 1:] += (d / u_norm[s + 1:].clamp_min(eps)).double().sum(-1).cpu()
                acc["du"][s, s + 1:] += d.double().sum(-1).cpu()
            bar.update()
    bar.close()
    return acc


def lens_sums(model, readouts, final_logits, y):
    """(L+1, 3) sums over positions of [early-exit CE, KL(p_final || p_l), top-5 overlap] per state."""
    logp_f = final_logits.float().log_softmax(-1)
    k = min(5, logp_f.size(-1))
    top_f = logp_f.topk(k).indices
    rows = []
    for r in readouts:
        logp = model.lm_head(r).float().log_softmax(-1)
        ce = -logp.gather(-1, y.clamp_min(0)[..., None])[..., 0] * (y >= 0)  # no target: 0
        kl = (logp_f.exp() * (logp_f - logp)).sum(-1)
        overlap = (logp.topk(k).indices[..., :, None] == top_f[..., None, :]).any(-1).sum(-1) / k
        rows.append(torch.stack([v.double().sum() for v in (ce, kl, overlap)]).cpu())
    return torch.stack(rows)


@torch.no_grad()
def permutation(model, batches, threshold):
    """P(i, j) = |loss(i, j swapped) - loss| / loss for all i < j -> JSON (docs/diagnostics.md#permutation)."""
    L = model.cfg.n_layer
    if L < 2:
        return {"skipped": "needs at least 2 blocks"}

    def loss():
        return sum(ce_sum(model(x)[0], y) for x, y in batches) / sum(int((y >= 0).sum()) for _, y in batches)
    base, P = loss(), [[None] * L for _ in range(L)]
    with tqdm(total=L * (L - 1) // 2, desc="swaps", unit="pair") as bar:
        for i in range(L):
            for j in range(i + 1, L):
                swap_blocks(model, i, j)
                P[i][j] = abs(loss() - base) / base
                swap_blocks(model, i, j)
                bar.update()
    return {"matrix": P, "threshold": threshold, **perm_shares(P, threshold, L), "baseline_loss": base,
            "swap_dedup": True, "definition": DEFINITIONS["perm"]}


def perm_shares(P, threshold, L):
    """R_perm over the last three quarters (the headline, Fig. 6) and over all pairs (secondary)."""
    n, above, share = share_above(P, threshold, L, math.ceil(L / 4))
    n_all, above_all, share_all = share_above(P, threshold, L)
    return {"R_perm": share, "n_pairs": n, "n_above": above, "s_min": math.ceil(L / 4),
            "R_perm_all": share_all, "n_pairs_all": n_all, "n_above_all": above_all}


# ----------------------------------------------------------------------------- downstream NLL (Fig. 4)

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


def nll_rows(task, nll_data, limit):
    """The task's rows: from {task}.jsonl under nll_data (None if there is none), else from the hub."""
    if nll_data:
        path = Path(nll_data) / f"{task}.jsonl"
        if not path.exists():
            return None
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        import datasets
        rows = datasets.load_dataset(*NLL_TASKS[task][1:3], split=NLL_TASKS[task][3])
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
            raise DiagError(f"{task}: token ids reach {int(x.max())}, beyond the model's vocab {model.cfg.vocab_size}")
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


def nll_metric(model, args, st, tok, device):
    tasks = {}
    for task in tqdm(st.nll_tasks, desc="nll", unit="task"):
        try:
            rows = nll_rows(task, args.nll_data, args.nll_limit) or f"no {task}.jsonl in {args.nll_data}"
        except Exception as e:  # a gated or missing dataset costs that task only (the hub itself was checked)
            rows = f"{type(e).__name__}: {first_line(e)}"
        if isinstance(rows, str):
            tasks[task] = {"skipped": rows}
            continue
        s, n = nll_task(model, tok, rows, task, max_len=st.nll_max_len, batch_size=args.batch_size, device=device)
        tasks[task] = pooled(s, n, category=NLL_TASKS[task][0], num_examples=len(rows))
    done = {t: v for t, v in tasks.items() if "skipped" not in v}
    def pool(ts):  # a category or all tasks: pooled over tokens, not a mean of the task means
        return pooled(sum(done[t]["nll_sum"] for t in ts), sum(done[t]["num_target_tokens"] for t in ts), tasks=ts)
    cats = dict.fromkeys(v["category"] for v in done.values())
    return {"tasks": tasks, "categories": {c: pool([t for t in done if done[t]["category"] == c]) for c in cats},
            "aggregate": pool(list(done)), "source": args.nll_data or "huggingface hub", "max_len": st.nll_max_len,
            "definition": DEFINITIONS["nll"]}


# ----------------------------------------------------------------------------- metrics -> JSON objects

def layer_metrics(model, acc, todo, args):
    """The sums of `sweep` -> the JSON objects of the layer metrics; {"skipped": why} where one does not apply."""
    L, N = model.cfg.n_layer, acc["tokens"]
    base, out = acc["loss"] / acc["targets"], {}
    if "angular" in todo:
        D = acc["angles"] / (N * math.pi)
        sub = [[float(D[l, l + n]) if l + n <= L else None for l in range(L)] for n in range(1, L + 1)]
        out["angular"] = {"matrix": triangle(D, lambda i, j: i < j), "subsequent": sub}
    if "causal" in todo and L < 2:
        out["causal"] = {"skipped": "needs at least 2 blocks"}
    elif "causal" in todo:
        C = triangle(acc["ratio"] / N, lambda s, l: s < l)
        RoM = torch.where(acc["u"] > 1e-8 * N, acc["du"] / acc["u"].clamp_min(1e-300), torch.zeros(()))
        n_pairs, n_above, share = share_above(C, args.causal_threshold, L, math.ceil(L / 4))
        out["causal"] = {"matrix": C, "matrix_ratio_of_means": triangle(RoM, lambda s, l: s < l),
                         "threshold": args.causal_threshold, "s_min": math.ceil(L / 4), "R_causal": share,
                         "n_pairs": n_pairs, "n_above": n_above, "variant": "mean_of_ratios", "eps": args.eps}
    if "pruning" in todo:
        out["pruning"] = {"baseline_loss": base, "metric": "lm_loss", "layers": [
            {"layer": l, "loss": v, "delta": v - base}
            for l, v in enumerate((acc["skip_loss"] / acc["targets"]).tolist())]}
    if "lens" in todo:
        out["lens"] = {"final_loss": base, "states": [
            {"index": l, "early_exit_ce": ce, "kl_to_final": kl, "top5_overlap": top}
            for l, (ce, kl, top) in enumerate((acc["lens"] / torch.tensor([acc["targets"], N, N])).tolist())]}
    if acc["attnres_weights"] and {"attnres", "deadzone"} & todo:          # a design with a depth softmax
        w = [[1.0]] + [(v / N).tolist() for v in acc["attnres_weights"]]     # consumer 0 reads the embedding only
        n_groups = len(w[-1]) - 1                                             # the head reads every group
        rows = [r + [None] * (n_groups + 1 - len(r)) for r in w]
        block = [rows[2 * b] for b in range(L)] + [rows[2 * L]]
        if n_groups == 2 * L:                                                 # Full AttnRes: sum per block
            block = [[r[0]] + [None if r[1 + 2 * k] is None else r[1 + 2 * k] + (r[2 + 2 * k] or 0.0)
                               for k in range(L)] for r in block]
        out["attnres"] = {"sublayer": rows, "block": block, "n_groups": n_groups}
        out["deadzone"] = {**dead_zone(w, L, args.dead_tau), "n_groups": n_groups}  # Full AttnRes too
    if acc["H_res"] and "erank" in todo:                                       # a design with a stream transport
        Ms, prod = [v / N for v in acc["H_res"]], []
        for M in Ms:
            prod.append(M if not prod else M @ prod[-1])
        per = [erank(M) for M in Ms]
        out["erank"] = {"per_connector": per, "mean": sum(per) / len(per), "product": [erank(P) for P in prod],
                        "per_connector_sq": [erank(M, squared=True) for M in Ms], "n_streams": len(Ms[0]),
                        "matrices": [M.tolist() for M in Ms]}
    for m in todo & {"attnres", "deadzone", "erank"} - set(out):
        out[m] = {"skipped": "HC/mHC only: this design has no stream-transport matrix" if m == "erank"
                  else "AttnRes only: this design has no depth softmax"}
    return {m: {**v, "definition": DEFINITIONS[m]} if "skipped" not in v else v for m, v in out.items() if m in todo}


# ----------------------------------------------------------------------------- command line

def build_parser():
    p = ArgParser(prog="diagnose.py", description="Layer-wise diagnostics of one DepthBench model -> JSON.")
    pos, share = positive(int), positive(float, zero=True)
    p.add_argument("checkpoint", nargs="?", help="a run folder holding ckpt.pt, a .pt file, or an official "
                   "checkpoint: hub id, folder with stepN/ folders or a step folder (depthbench/official.py); or use --init")
    p.add_argument("--step", type=int, help="official checkpoint: the stepN folder (default: the highest)")
    p.add_argument("--metrics", type=comma_list(str), default="all", help=f"comma list of {', '.join(METRICS)}, or all (default)")
    p.add_argument("--out", help="output JSON (default: diagnose.json in the checkpoint's folder, or here for --init)")
    g = p.add_argument_group("a fresh model instead of a checkpoint")
    g.add_argument("--init", choices=list(RESIDUALS), help="diagnose a freshly initialised model of this design")
    g.add_argument("--layers", type=pos, default=6, help="--init: blocks L (default 6)")
    g.add_argument("--width", type=pos, default=128, help="--init: d_model (default 128)")
    g.add_argument("--heads", type=pos, default=4, help="--init: attention heads (default 4)")
    g.add_argument("--vocab", type=pos, help="--init: vocab size (default: the tokenizer's, else the synthetic task's)")
    g.add_argument("--residual-args", type=json_object, default={},
                   help="--init: the design's options as JSON, e.g. '{\"n_groups\": 4}' (its class' `options`); an "
                   "official checkpoint: what its config.json cannot tell (docs/official.md)")
    g = p.add_argument_group("calibration text and compute")
    g.add_argument("--calib", default="auto", help="auto (the run's val data), synthetic, a shard folder or text files")
    g.add_argument("--token-data-glob", help="pre-tokenized .npy token shards (a glob), windows drawn by the release's "
                   "rule (files in proportion to their usable length, numpy default_rng(seed)); replaces --calib")
    g.add_argument("--tokenizer", help="gpt2, bytes or a tokenizer.json, for text files and NLL (default: the run's)")
    g.add_argument("--max-gap", type=pos, default=4, help="synthetic task's max gap if the run says none (default 4)")
    protocol = ", ".join(f"{m} {n} x {t}" for m, (n, t) in PROTOCOL.items() if m not in ("attnres", "erank",
                                                                                          "deadzone"))
    g.add_argument("--num-samples", type=pos, help=f"windows, for every metric (default: the release's per metric: "
                   f"{protocol}; attnres, erank and deadzone as angular)")
    g.add_argument("--seq-len", type=pos, help="tokens per window, for every metric (default: the release's per "
                   "metric, as --num-samples; at most the run's own seq_len)")
    g.add_argument("--batch-size", type=pos, default=8, help="windows (NLL: examples) per forward pass (default 8)")
    g.add_argument("--seed", type=seed_number, help="seeds the windows and --init (default: the run's seed, else %d; "
                   "the release's analysis used 42)" % VAL_SEED)
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="fp32 (default), or bf16 on CUDA as the "
                   "release's analysis: weights rounded to bf16, the forward under bf16 autocast")
    p.add_kernels()
    g.add_argument("--threads", type=pos, default=1, help="CPU threads (default 1: tiny models run several "
                   "times faster single-threaded, most of all on a shared machine)")
    g = p.add_argument_group("metric settings")
    g.add_argument("--causal-threshold", type=share, default=0.45, help="R_causal counts C > this (default 0.45)")
    g.add_argument("--perm-threshold", type=share, default=0.15, help="R_perm counts P > this (default 0.15)")
    g.add_argument("--dead-tau", type=share, default=0.05, help="dead when non-embedding weight < this (0.05)")
    g.add_argument("--eps", type=positive(float), default=1e-8, help="floor of |u_l| in causal ratios (default 1e-8)")
    g = p.add_argument_group("downstream NLL")
    g.add_argument("--nll-data", help="folder of local {task}.jsonl in each dataset's own fields (e.g. fixtures/nll)")
    g.add_argument("--nll-tasks", type=comma_list(str), default=",".join(NLL_TASKS), help=f"comma list of {', '.join(NLL_TASKS)}")
    g.add_argument("--nll-limit", type=pos, help="at most this many examples per task (default: all)")
    g.add_argument("--nll-max-len", type=pos, help="context length, left-truncated (default: the run's seq_len)")
    return p


def parse_args(argv):
    """The command line -> (args as typed, Settings with the metrics and tasks); bad input exits 2 in one line."""
    p = build_parser()
    args = p.parse_args(argv)
    if (args.checkpoint is None) == (args.init is None):
        p.error("give a checkpoint or --init RESIDUAL (one of them)")
    todo = set(args.metrics)  # comma_list: an empty item was refused already
    if todo == {"all"}:
        todo = set(METRICS)
    if todo - set(METRICS):
        bad = ", ".join(sorted(todo - set(METRICS)))
        p.error(f"unknown metric(s) {bad}; choose from {', '.join(METRICS)}, all")
    tasks = args.nll_tasks
    if set(tasks) - set(NLL_TASKS):
        p.error(f"--nll-tasks: choose from {', '.join(NLL_TASKS)}")
    try:
        check_options([args.init] if args.init else list(RESIDUALS), args.residual_args)
    except ValueError as e:
        p.error(f"--residual-args: {e}")
    if args.init and (args.width % args.heads or args.width // args.heads % 2):
        p.error(f"--width {args.width} must be a multiple of --heads {args.heads} with an even head_dim (RoPE)")
    if args.out and Path(args.out).is_dir():
        p.error(f"--out {args.out} is a folder; give the JSON file's name")
    if args.out and (why := common.cannot_write(args.out)):  # before the work, not after
        p.error(f"--out {args.out}: {why}")
    if args.tokenizer not in (None, "gpt2", "bytes") and not Path(args.tokenizer).exists():
        p.error(f"--tokenizer {args.tokenizer}: not gpt2, bytes or a tokenizer.json")
    if args.nll_data and not Path(args.nll_data).is_dir():
        p.error(f"--nll-data {args.nll_data}: not a folder")
    seed = VAL_SEED if args.init and args.seed is None else args.seed
    return args, Settings(todo=todo, nll_tasks=tasks, seed=seed, out=args.out)


def resolve(args, st, run):
    """Fill in what the checkpoint's run decides: the seed, each metric's windows, NLL's length and tokenizer."""
    st.seed = run.get("seed", VAL_SEED) if st.seed is None else st.seed
    run_len = run.get("seq_len")
    for m in st.todo & set(PROTOCOL):
        N, T = PROTOCOL[m]
        T = args.seq_len or min(T, run_len or T)
        st.samples[m] = (args.num_samples or N, T)
    st.nll_max_len = args.nll_max_len or run_len or args.seq_len or 512
    st.tok_name = args.tokenizer or run.get("tokenizer")
    if "nll" in st.todo:
        if st.tok_name is None or (run.get("data") == "synthetic" and not args.tokenizer):
            st.nll_skip = "the model reads synthetic-task tokens, not text (--tokenizer forces a text tokenizer)"
        elif not args.nll_data and (down := hub_unreachable()):  # fail fast, before any compute
            raise DiagError(f"cannot reach the HuggingFace hub at {down[0]} ({down[1]}); offline, use "
                            f"--nll-data fixtures/nll (local JSONL) or leave nll out of --metrics")


def place(model, args):
    """The model on its device and in its precision -> (model, device, the forward's autocast context)."""
    try:
        device = torch.device(pick_device(args.device))
    except ValueError as e:
        raise DiagError(str(e)) from None
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    model = model.float()
    if args.dtype == "bf16":
        if device.type != "cuda":
            raise DiagError(f"--dtype bf16 runs on CUDA (as the release's analysis), not on {device}")
        model = model.to(torch.bfloat16).float()          # the weights as bf16 holds them
        return model.to(device).eval(), device, torch.autocast("cuda", dtype=torch.bfloat16)
    return model.to(device).eval(), device, contextlib.nullcontext()


def calibration_groups(args, st, run, model, device):
    """{(windows, tokens): (metrics, batches, description)}: metrics that share a setting share their windows."""
    groups = {}
    for m, setting in sorted(st.samples.items()):
        groups.setdefault(setting, []).append(m)
    out = {}
    for (N, T), metrics in groups.items():
        x, y, what = calibration(args, st, run, N=N, T=T)
        vocab = model.cfg.vocab_size
        if int(x.max()) >= vocab or int(y.max()) >= vocab:
            top = int(max(x.max(), y.max()))
            raise DiagError(f"calibration tokens reach id {top} but the model's vocab is {vocab}")
        batches = [(a.to(device), b.to(device)) for a, b in zip(x.split(args.batch_size), y.split(args.batch_size))]
        out[(N, T)] = (set(metrics), batches, what)
    return out


def setup(args, st):
    """Model, calibration batches per setting and the run's meta; every problem a user can fix is a DiagError."""
    model, run, ckpt_path, step = load_model(args, st)
    resolve(args, st, run)
    model, device, precision = place(model, args)
    groups = calibration_groups(args, st, run, model=model, device=device)
    cfg, res = model.cfg, model.res
    samples = {m: {"num_samples": N, "seq_len": T, "calibration": what}
               for (N, T), (metrics, _, what) in groups.items() for m in sorted(metrics)}
    meta = {"residual": cfg.residual, "n_layer": cfg.n_layer, "d_model": cfg.d_model, "ar": cfg.d_model / cfg.n_layer,
            "n_head": cfg.n_head, "d_ff": cfg.d_ff, "vocab_size": cfg.vocab_size, "residual_args": cfg.residual_args,
            "n_streams": getattr(res, "n", None), "n_groups": getattr(res, "n_groups", None),
            "checkpoint": ckpt_path, "step": step, "init": args.init, "samples": samples,
            "batch_size": args.batch_size, "dtype": {"fp32": "float32", "bf16": "bfloat16 (autocast)"}[args.dtype],
            "device": str(device), "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "seed": st.seed, "torch": torch.__version__, "timings_s": {}}
    return model, groups, meta, device, precision


def compute(model, args, st, groups, meta):
    """Every metric, group by group of calibration windows -> {JSON key: object}."""
    out, timings = {}, meta["timings_s"]
    for (N, T), (metrics, batches, _) in groups.items():
        t0 = time.time()
        if metrics - {"perm"}:  # the layer metrics of a group come from one sweep over its batches
            acc = sweep(model, batches, metrics, args.eps)
            out.update({METRICS[m]: obj for m, obj in layer_metrics(model, acc, metrics, args).items()})
        if "perm" in metrics:
            out["permutation_score"] = permutation(model, batches, args.perm_threshold)
        timings[f"{N}x{T}"] = round(time.time() - t0, 2)
    if "nll" in st.todo:
        t0 = time.time()
        if st.nll_skip:
            out["nll"] = {"skipped": st.nll_skip}
        else:
            tok = data.get_tokenizer(st.tok_name)
            out["nll"] = nll_metric(model, args, st, tok=tok, device=meta["device"])
        timings["nll"] = round(time.time() - t0, 2)
    return out


def main(argv=None):
    args, st = parse_args(argv)
    t_start = time.time()
    try:
        model, groups, meta, device, precision = setup(args, st)
        cfg = model.cfg
        plan = "; ".join(f"{', '.join(sorted(ms))}: {N} x {T}" for (N, T), (ms, _, _) in groups.items())
        print(f"diagnose: {cfg.residual} L={cfg.n_layer} d={cfg.d_model} on {device} ({meta['threads'] or 'GPU'} "
              f"threads), {meta['dtype']}, windows x tokens: {plan or 'none'}; "
              f"metrics: {', '.join(m for m in METRICS if m in st.todo)}")
        with precision:
            out = {"schema": SCHEMA, "meta": meta, **compute(model, args, st, groups=groups, meta=meta)}
    except (DiagError, CheckpointError, data.DataError) as e:
        fail("diagnose.py", first_line(e, None))
    meta["wall_s"] = round(time.time() - t_start, 2)
    path = st.out or (Path(meta["checkpoint"]).parent / "diagnose.json" if meta["checkpoint"] else "diagnose.json")
    try:
        write_json(path, out, strict=True)
    except OSError as e:  # a common.WriteError, one line naming the path and the cause (a file in the way, full)
        fail("diagnose.py", str(e))
    print(f"wrote {path} in {meta['wall_s']}s")


if __name__ == "__main__":
    with common.one_line_faults("diagnose.py", "nothing was written; run the same command again"):  # Ctrl-C: one line
        main()
