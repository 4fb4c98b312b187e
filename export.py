"""
export.py: write trained runs in the formats other programs load (docs/official.md#export).

    python export.py runs/NAME --format hf --out hf/NAME               # a Pre-LN run as a Hugging Face Llama folder
    python export.py runs/NAME/ckpt.pt --format official --out off/NAME   # any design the release has, in its layout
    python export.py runs/mini --format official --out exported         # a suite: every finished run, one folder each

--format hf (Pre-LN only: the one design that is a LlamaForCausalLM) writes config.json (LlamaConfig), model.safetensors
(the fp32 weights under HF Llama's names, depthbench/files/official.py's hf_llama table) and the run's tokenizer
(tokenizer.json and tokenizer_config.json: GPT-2 BPE, or the byte-level tokenizer as a byte-level BPE without merges),
so that `transformers.AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` load it as it
is. --format official writes OUT/stepN/ (config.json in OLMo-core's experiment schema, model_and_optim/: a torch DCP of
{"model": ...} under the official names) and OUT/tokenizer/tokenizer.json, which depthbench/files/official.py (and
diagnose.py) load, and the authors' loaders by their names. An existing output folder is never overwritten; each is
built beside its place and renamed into it when whole.
"""
import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import data
from depthbench.files import official
from depthbench.files.checkpoints import checkpoint_model, read_checkpoint
from depthbench.files.common import ArgParser, CheckpointError, cannot_write, fail, first_line, one_line_faults, write_atomic
from depthbench.files.runlog import run_state
from model import GPT

PROG = "export.py"
EOT = "<|endoftext|>"
SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}


@dataclass
class Run:
    """One trained run, loaded for export."""
    path: Path      # its ckpt.pt
    model: GPT      # fp32, eval mode, on the CPU
    config: dict    # the run's train config (ckpt.pt's "config"): tokenizer, seq_len, data
    step: int       # the step ckpt.pt holds

    @property
    def tokenizer(self):
        """'gpt2', 'bytes', or None (the synthetic task: its token ids have no text form)."""
        return self.config.get("tokenizer")


def load_run(source):
    """A run folder holding ckpt.pt, or a .pt file -> Run; a one-line CheckpointError when it is not ours."""
    path = Path(source)
    path = path / "ckpt.pt" if path.is_dir() else path
    if not path.is_file():
        raise CheckpointError(f"{source}: no checkpoint (give a run folder holding ckpt.pt, a .pt file or a suite folder)")
    ckpt = read_checkpoint(path)  # read by type: the run's settings, its step, its design, its weights' names
    model = checkpoint_model(ckpt, path)
    return Run(path=path, model=model.float().eval(), config=ckpt["config"], step=ckpt.get("step", 0))


# ----------------------------------------------------------------------------- tokenizers in the HF form

def byte_chars():
    """GPT-2's byte-level alphabet: byte b -> the character that stands for it (printable Latin-1 bytes as
    themselves, the other 68 as chr(256), chr(257), ... in byte order), as the tokenizers library maps them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def gpt2_files():
    """(encoder.json, vocab.bpe) of the GPT-2 BPE as bytes, from tiktoken's cache (fetched there first if missing,
    or a one-line DataError offline): the files HF's GPT-2 tokenizer calls vocab.json and merges.txt."""
    import tiktoken.load
    data.check_tiktoken_files(instead=None)  # the run trained on GPT-2's ids: no other tokenizer will do
    data.GPT2Tokenizer()
    return tuple(tiktoken.load.read_file_cached(url) for url in (data.GPT2_URLS[1], data.GPT2_URLS[0]))


def hf_tokenizer(name):
    """The run's tokenizer as a `tokenizers` Tokenizer that gives the ids it trained on (no BOS, EOT special):
    GPT-2's BPE from its two files; 'bytes' as a byte-level BPE whose vocab is the 256 bytes (id = the byte) and
    EOT 256, with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    if name == "gpt2":
        vocab_json, merges_txt = gpt2_files()
        merges = [tuple(line.split(" ")) for line in merges_txt.decode().splitlines()[1:] if line]  # 1: "#version"
        tok = Tokenizer(models.BPE(vocab=json.loads(vocab_json), merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        vocab = {c: b for b, c in enumerate(byte_chars())}
        tok = Tokenizer(models.BPE(vocab={**vocab, EOT: 256}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok


def write_hf_tokenizer(folder, name, seq_len):
    """tokenizer.json and tokenizer_config.json (for GPT-2 also vocab.json and merges.txt, the slow tokenizer's)."""
    hf_tokenizer(name).save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "model_max_length": seq_len,
                "clean_up_tokenization_spaces": False}
    if name == "gpt2":
        vocab_json, merges_txt = gpt2_files()
        write_atomic(folder / "vocab.json", vocab_json)
        write_atomic(folder / "merges.txt", merges_txt)
        settings.update(tokenizer_class="GPT2Tokenizer", bos_token=EOT, unk_token=EOT, add_bos_token=False,
                        add_prefix_space=False)
    write_atomic(folder / "tokenizer_config.json", json.dumps(settings, indent=2))


# ----------------------------------------------------------------------------- --format hf

def hf_config(run):
    """LlamaConfig fields that make HF's Llama compute our Pre-LN: RMSNorm eps and RoPE theta as trained, RoPE
    rotate-half (HF Llama's layout, so no weight permutation), head_dim, KV heads (GQA), untied head, no biases,
    the vocab as stored (padded: the embedding's rows; the tokenizer never gives the padding ids)."""
    cfg = run.model.cfg
    eot = {"gpt2": 50256, "bytes": 256}.get(run.tokenizer)
    theta = cfg.rope_theta
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},   # transformers >= 5 reads this one
            "max_position_embeddings": run.config.get("seq_len") or 2048, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std,
            "bos_token_id": None, "eos_token_id": eot, "pad_token_id": None, "torch_dtype": "float32",
            "use_cache": True}


def write_safetensors(path, tensors):
    """The safetensors format, written here (no package needed): an 8-byte little-endian length, a JSON header
    naming each tensor's dtype, shape and byte range (from the end of the header), then the tensors' bytes."""
    if sys.byteorder != "little":
        raise CheckpointError("safetensors holds little-endian bytes; this machine is big-endian")
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data begins 8-byte aligned

    def write(f):
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for t in tensors.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    write_atomic(path, write)


def write_hf(run, folder):
    """A Pre-LN run -> a LlamaForCausalLM folder: config.json, model.safetensors and the tokenizer's files."""
    cfg = run.model.cfg
    folder.mkdir(parents=True)
    write_safetensors(folder / "model.safetensors", official.hf_llama(official.to_official(run.model), cfg.n_layer))
    write_atomic(folder / "config.json", json.dumps(hf_config(run), indent=2))
    if run.tokenizer:
        write_hf_tokenizer(folder, run.tokenizer, run.config.get("seq_len") or 2048)
    return f"config.json, model.safetensors, {run.tokenizer or 'no'} tokenizer"


# ----------------------------------------------------------------------------- --format official

def official_tokenizer(run):
    """dataset.tokenizer of the official config: TokenizerConfig's fields. GPT-2 by its hub id (the same BPE); the
    byte-level one by its file in the export (give it to the authors' loaders as --tokenizer_id)."""
    if run.tokenizer == "gpt2":
        return {"identifier": "gpt2", "vocab_size": 50257, "eos_token_id": 50256, "pad_token_id": 50256}
    if run.tokenizer == "bytes":
        return {"identifier": "tokenizer/tokenizer.json", "vocab_size": 257, "eos_token_id": 256, "pad_token_id": 256}
    return {"identifier": None, "vocab_size": run.model.cfg.vocab_size}


def write_official(run, folder):
    """Any run -> OUT/stepN/ (config.json, model_and_optim/ without optimizer state) and OUT/tokenizer/."""
    cfg = run.model.cfg
    config = official.official_config(cfg, official_tokenizer(run), run.config.get("seq_len"))  # may refuse: first
    config[official.EXPORT_KEY] = {"source": str(run.path), "step": run.step, "residual": cfg.residual,
                                   "residual_args": cfg.residual_args, "readings": official.open_readings(cfg)}
    official.write_checkpoint(folder / f"step{run.step}", official.official_state(run.model), config)
    if run.tokenizer:
        (folder / "tokenizer").mkdir()
        hf_tokenizer(run.tokenizer).save(str(folder / "tokenizer" / "tokenizer.json"))
    return f"step{run.step}/ (config.json, model_and_optim/), {run.tokenizer or 'no'} tokenizer"


# ----------------------------------------------------------------------------- one run, a suite

def refusal(run, fmt):
    """Why run cannot be written in fmt (one line), or None."""
    cfg = run.model.cfg
    if fmt == "hf" and cfg.residual != "preln":
        return f"a {cfg.residual} run has no LlamaForCausalLM form (only Pre-LN is one); use --format official"
    if fmt != "official":
        return None
    try:                                       # a design beyond the paper has no release block; uneven AttnRes groups
        official.official_block(cfg)
        if cfg.residual in ("attnres", "block_attnres"):
            official.attnres_block_size(cfg)
    except CheckpointError as e:
        return str(e)
    return None


def export_run(run, fmt, out):
    """Write run into the new folder out: built beside it, renamed into place when whole -> what was written."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        what = write_hf(run, tmp) if fmt == "hf" else write_official(run, tmp)
        os.replace(tmp, out)   # onto nothing or an empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"{run.path} (step {run.step}, {run.model.cfg.residual}) -> {out}: {what}", flush=True)


def suite_runs(folder):
    """The run folders under a suite folder (each holding ckpt.pt) -> ([finished], [(folder, why not)])."""
    done, left = [], []
    for ckpt in sorted(Path(folder).rglob("ckpt.pt")):
        try:
            state = run_state(ckpt.parent)
        except ValueError as e:
            state = str(e)
        if state == "finished":
            done.append(ckpt.parent)
        else:
            left.append((ckpt.parent, state))
    return done, left


def export_member(run_dir, fmt, target):
    """One run of a suite -> target; None, or why it is left out (one line): not ours, not this format's, or its
    tokenizer's files cannot be had (GPT-2's, offline). The suite's other runs go on."""
    try:
        run = load_run(run_dir)
        why = refusal(run, fmt)
        if why is None:
            export_run(run, fmt, target)
        return why
    except (CheckpointError, data.DataError) as e:
        return first_line(e)


def export_suite(folder, fmt, out):
    """Every finished run under folder -> out/<its path under folder>; a folder there already is kept. Returns the
    count written or kept, and [(run folder, why)] of the runs left out, which it prints."""
    done, left = suite_runs(folder)
    kept = 0
    for run_dir in done:
        target = out / run_dir.relative_to(folder)
        if target.exists():
            print(f"{target}: exists, kept", flush=True)
            kept += 1
            continue
        why = export_member(run_dir, fmt, target)
        if why:
            left.append((run_dir, why))
        else:
            kept += 1
    for run_dir, why in left:
        print(f"{run_dir}: left out ({why})", flush=True)
    return kept, left


def build_parser():
    p = ArgParser(prog=PROG, description="Write trained runs as a Hugging Face Llama folder (Pre-LN) or in the "
                  "authors' OLMo-core release layout (any design the release has a block for).")
    p.add_argument("source", help="a run folder holding ckpt.pt, a .pt file, or a suite folder (every finished run)")
    p.add_argument("--format", required=True, choices=["hf", "official"], help="hf: LlamaForCausalLM (Pre-LN); "
                   "official: the release's config.json + DCP checkpoint (the release's designs)")
    p.add_argument("--out", required=True, type=Path, help="the new folder (a suite: one sub-folder per run)")
    return p


def export_one(src, fmt, out):
    """A run folder or .pt file -> out, which must be new or an empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out} exists and is not empty; give a new folder (nothing is overwritten)")
    run = load_run(src)
    if why := refusal(run, fmt):
        raise CheckpointError(f"{src}: {why}")
    export_run(run, fmt, out)


def main(argv=None):
    args = build_parser().parse_args(argv)
    src, out = Path(args.source), args.out
    if why := cannot_write(out / "config.json"):
        fail(PROG, f"--out {out}: {why}")
    try:
        if not src.is_dir() or (src / "ckpt.pt").is_file():
            return export_one(src, args.format, out)
        kept, left = export_suite(src, args.format, out)
    except (CheckpointError, data.DataError) as e:
        fail(PROG, first_line(e, None))
    if not kept:
        found = f"{len(left)} left out, above" if left else "no run folder holding ckpt.pt under it"
        fail(PROG, f"{src}: no finished run to export ({found})")
    print(f"{kept} run(s) in {out}, {len(left)} left out")


if __name__ == "__main__":
    with one_line_faults(PROG, "nothing half-written is left; run the same command again"):
        main()
