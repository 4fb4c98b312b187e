"""
What diagnose.py measures on: the model (a run folder's ckpt.pt, a .pt file, an official checkpoint or a fresh
--init model), placed on its device in its precision, and its calibration windows, per metric setting
(docs/diagnostics.md#setup): the release's token-shard rule, the run's own validation data, or text files.
"""
import contextlib
import glob
from pathlib import Path

import torch

import data
import shapes
from depthbench.files import official
from depthbench.evaluation import synthetic, windows
from depthbench.files.checkpoints import checkpoint_model, read_checkpoint
from depthbench.files.common import design_options, first_line, pick_device
from model import GPT, GPTConfig


# the sizes a user gives diagnose.py, bounded where they are known (a larger one ended in the kernel's OOM kill)
INIT_PARAMS = 2 * 10**9       # --init's model: at most 2B parameters (the paper's largest model has 1.6B)
INIT_SEQ_LEN = 8192           # --seq-len without a run's seq_len (--init): 4 x the paper's 2,048
WINDOW_TOKENS = 2**24         # --num-samples x --seq-len, read at once: 16.8M tokens (the release's most: 256 x 512)


class DiagError(ValueError):
    """A problem the user can fix; diagnose.py prints it (and a CheckpointError) as one line and exits with 2."""


def init_model(args, st):
    """--init: a fresh model of the command line's shape, at most INIT_PARAMS -> (model, its 'run' settings)."""
    vocab = args.vocab or {"gpt2": data.padded_vocab_size(50257), "bytes": 257}.get(args.tokenizer)
    vocab = vocab or synthetic.SyntheticTask(args.max_gap).vocab_size
    size = shapes.preln_params(args.layers, args.width, shapes.ffn_dim(args.width), vocab=vocab)
    if args.layers > shapes.MAX_LAYERS or size > INIT_PARAMS:
        raise DiagError(f"--init with --layers {args.layers:,} --width {args.width:,} (vocab {vocab:,}): {size:,} "
                        f"parameters; a fresh model has at most {INIT_PARAMS:,} and {shapes.MAX_LAYERS} blocks")
    torch.manual_seed(st.seed)
    cfg = GPTConfig(vocab_size=vocab, n_layer=args.layers, d_model=args.width, n_head=args.heads,
                    d_ff=shapes.ffn_dim(args.width), residual=args.init,
                    residual_args=design_options(args.init, args.residual_args), kernels=args.kernels)
    run = {"data": "synthetic" if args.tokenizer is None else None, "tokenizer": args.tokenizer,
           "max_gap": args.max_gap, "seed": st.seed}
    try:
        return GPT(cfg), run
    except ValueError as e:        # an option value the design refuses (Block AttnRes' grouping, ...): one line
        raise DiagError(f"--residual-args: {first_line(e)}") from None


def load_model(args, st):
    """-> (model, the run's train config, checkpoint path or None, step or None). --step with anything but an
    official checkpoint, and weights holding NaN or inf, are refused (DiagError), never diagnosed in silence."""
    if args.step is not None and (args.init or not official.is_official(args.checkpoint)):
        raise DiagError(f"--step {args.step}: picks an official checkpoint's stepN folder; "
                        f"{'--init' if args.init else args.checkpoint} has one step")
    if args.init:  # the vocab follows the text: the tokenizer's, else the synthetic task's
        return (*init_model(args, st), None, None)
    if official.is_official(args.checkpoint):  # the authors' released OLMo-core checkpoints (depthbench/files/official.py)
        model, info = official.load(args.checkpoint, args.step, args.kernels, args.residual_args)
        if st.out is None and not Path(args.checkpoint).is_dir():  # not into the hub cache
            st.out = f"diagnose_{args.checkpoint.split('/')[-1]}_step{info['step']}.json"
        config = str(Path(info["step_dir"]) / "config.json")
        refuse_non_finite(model, config)
        return model, {"tokenizer": info["tokenizer"], "seq_len": info["seq_len"]}, config, info["step"]
    if args.residual_args:
        raise DiagError("--residual-args: for --init or an official checkpoint (a run's ckpt.pt records its own)")
    path = Path(args.checkpoint)
    path = path / "ckpt.pt" if path.is_dir() else path
    if not path.is_file():
        raise DiagError(f"{args.checkpoint}: no checkpoint (give a run folder holding ckpt.pt, a .pt file, or --init)")
    ckpt = read_checkpoint(path)  # read by type: the run's settings, its step, its design, its weights' names
    model = checkpoint_model(ckpt, path, kernels=args.kernels)
    refuse_non_finite(model, path)
    return model, ckpt["config"], str(path), ckpt.get("step")


def refuse_non_finite(model, where):
    """A DiagError naming the first weight that holds NaN or inf and how many do: every metric of such a model is
    NaN (a diverged run's weights; train.py never saves them, but a file can hold them)."""
    bad = [name for name, t in model.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise DiagError(f"{where}: {len(bad)} of its {len(model.state_dict())} weight tensors hold NaN or inf (the "
                        f"first: {bad[0]}); there is nothing to diagnose in them")


def check_setting(N, T, run):
    """A DiagError unless N windows of T tokens can be read: T at most the run's seq_len (INIT_SEQ_LEN without
    one), N x T at most WINDOW_TOKENS."""
    limit, whose = run.get("seq_len"), "the run's own seq_len"
    if not limit:
        limit, whose = INIT_SEQ_LEN, "what a model without a run's seq_len (--init) is read at"
    if T > limit:
        raise DiagError(f"--seq-len {T:,}: at most {whose}, {limit:,} tokens")
    if N * T > WINDOW_TOKENS:
        raise DiagError(f"--num-samples {N:,} x --seq-len {T:,} = {N * T:,} tokens: at most {WINDOW_TOKENS:,} are read "
                        f"at once; lower one of them")


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
        check_setting(N, T, run)
        x, y, what = calibration(args, st, run, N=N, T=T)
        vocab = model.cfg.vocab_size
        if int(x.max()) >= vocab or int(y.max()) >= vocab:
            top = int(max(x.max(), y.max()))
            raise DiagError(f"calibration tokens reach id {top} but the model's vocab is {vocab}")
        batches = [(a.to(device), b.to(device)) for a, b in zip(x.split(args.batch_size), y.split(args.batch_size))]
        out[(N, T)] = (set(metrics), batches, what)
    return out
