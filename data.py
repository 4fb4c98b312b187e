"""
data.py: what depthbench feeds a model. Real text becomes token shards on disk; an embedded
synthetic task, generated on the fly, has answers that need composition depth.

    python data.py --source path/to/austen --tokenizer gpt2 --out data_cache/austen
    python data.py --source fineweb-edu --max-tokens 100000000 --out data_cache/fineweb
    python data.py --source austen --tokenizer bytes --out data_cache/austen-bytes
    python data.py --source synthetic --max-gap 4 --show 3

The sources, tokenizers, shard format and batch order: docs/training.md#shard-format-and-batch-order;
the synthetic task, its choice of group and its loss floor: docs/training.md#the-synthetic-task.
"""

import glob
import hashlib
import itertools
import os
import tempfile
import time
from pathlib import Path

# common first: its sys.excepthook makes a Ctrl-C while torch is imported one line
from depthbench.files.common import (ArgParser, fail, first_line, hub_unreachable, one_line_faults, parse_json, positive, read_json,
                    seed_number, unreachable, why_failed, write_atomic, write_json, VAL_SEED, WriteError)
import numpy as np
import torch

from depthbench.evaluation.synthetic import SPLITS, SyntheticTask

MAGIC, VERSION = 20260517, 1  # our own magic, so an llm.c or nanoGPT .bin is rejected, not misread
HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")


class DataError(ValueError):
    """A problem the user can fix (bad source, offline, corrupt shard). Scripts print it as one line and exit 2."""


def padded_vocab_size(vocab_size, multiple=64):
    """Round the embedding/LM-head size up to a multiple of 64: 50257 -> 50304 (faster matmuls)."""
    return -(-vocab_size // multiple) * multiple


# ----------------------------------------------------------------------------- tokenizers

# the two files tiktoken's gpt2 encoding fetches (tiktoken_ext/openai_public.py)
GPT2_URLS = ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
             "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, EOT = 256. Needs no download; any text round-trips."""
    name, vocab_size, eot = "bytes", 257, 256

    def encode_batch(self, texts):
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken. encode_ordinary: text that contains '<|endoftext|>' stays text."""
    name, vocab_size, eot = "gpt2", 50257, 50256

    def __init__(self):
        check_tiktoken_files()
        import tiktoken
        self.enc = tiktoken.get_encoding("gpt2")

    def encode_batch(self, texts):
        return self.enc.encode_ordinary_batch(list(texts))  # tiktoken spreads a batch over threads

    def decode(self, ids):
        return self.enc.decode([int(i) for i in ids])


def check_tiktoken_files(timeout=5.0, instead="use --tokenizer bytes"):
    """tiktoken downloads with requests.get and no timeout, which hangs offline. So: if the files are
    not in its cache (named by the sha1 of the URL, in the folder tiktoken itself would use), first
    check in a few seconds that the server answers, and otherwise stop with the way out (`instead`: the
    caller's other way, or None where it has none: export.py must write the tokenizer the run trained with)."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get(
        "DATA_GYM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache")))
    names = [hashlib.sha1(url.encode()).hexdigest() for url in GPT2_URLS]
    if cache and all(os.path.exists(os.path.join(cache, n)) for n in names):
        return
    if why := unreachable(GPT2_URLS[0], timeout):
        other = f", or {instead}" if instead else ""
        raise DataError(f"the GPT-2 BPE files are not in the tiktoken cache ({cache or 'disabled'}) and cannot "
                        f"be downloaded ({why}); offline, run with "
                        f"TIKTOKEN_CACHE_DIR=a folder holding the two GPT-2 BPE files{other}")


class JSONTokenizer:
    """A HuggingFace tokenizer.json (e.g. the official GPT-NeoX-OLMo one, vocab 50280, EOS 50279) through
    the `tokenizers` library, so official checkpoints read text as they were trained: no BOS, no special
    tokens added, EOS after each document (eot: the given id, else the tokenizer's <|endoftext|>)."""

    def __init__(self, path, eot=None):
        from tokenizers import Tokenizer
        path = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise DataError(f"{path}: not a tokenizer.json ({type(e).__name__}: {first_line(e, 120)})") from None
        self.name, self.vocab_size = str(path), self.tok.get_vocab_size()
        self.eot = self.tok.token_to_id("<|endoftext|>") if eot is None else eot
        if self.eot is None:
            raise DataError(f"{path}: no <|endoftext|> token; give the EOS id")

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids])


def get_tokenizer(name, eot=None):
    """gpt2, bytes, or the path of a tokenizer.json (or of a folder holding one)."""
    if name in ("gpt2", "bytes"):
        return GPT2Tokenizer() if name == "gpt2" else ByteTokenizer()
    if name and (Path(name).is_file() or (Path(name) / "tokenizer.json").is_file()):
        return JSONTokenizer(name, eot)
    raise DataError(f"unknown tokenizer {name!r} (choose gpt2, bytes or the path of a tokenizer.json)")


# ----------------------------------------------------------------------------- shard files

def write_shard(path, tokens, vocab_size, eot):
    """Header + uint16 tokens, written to path.tmp and then renamed, so readers never see half a file."""
    tokens = np.asarray(tokens)
    assert tokens.size == 0 or int(tokens.max()) < 2**16, "token ids must fit in uint16"
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:5] = MAGIC, VERSION, tokens.size, vocab_size, eot
    write_atomic(path, lambda f: (f.write(header.tobytes()), f.write(tokens.astype("<u2").tobytes())))


def read_header(path):
    """Check that path is a whole depthbench shard; return its header fields as a dict."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise DataError(f"{path}: not a depthbench shard ({size} bytes, shorter than the {HEADER_BYTES}-byte header)")
    magic, version, n, vocab_size, eot = (int(v) for v in np.fromfile(path, dtype="<i4", count=5))
    if magic != MAGIC:
        raise DataError(f"{path}: not a depthbench shard (magic {magic}, expected {MAGIC}); rebuild it with data.py")
    if version != VERSION:
        raise DataError(f"{path}: shard format version {version}, this data.py reads version {VERSION}")
    if size != HEADER_BYTES + 2 * n:
        raise DataError(f"{path}: truncated or corrupt shard ({size} bytes, its header promises "
                        f"{n} tokens = {HEADER_BYTES + 2 * n} bytes); rebuild it with data.py")
    return {"n_tokens": n, "vocab_size": vocab_size, "eot": eot}


def read_shard(path):
    """The tokens of a shard as a read-only uint16 array (memory-mapped: nothing is loaded up front)."""
    n = read_header(path)["n_tokens"]
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))


class ShardWriter:
    """Packs a token stream into <split>_000000.bin, <split>_000001.bin, ... of shard_tokens each."""

    def __init__(self, out_dir, split, shard_tokens, tok):
        self.out_dir, self.split, self.tok = Path(out_dir), split, tok
        self.buf = np.empty(shard_tokens, dtype=np.uint16)
        self.fill = 0
        self.shards = []  # [{"file": name, "tokens": n}] of the finished files

    def add(self, tokens):
        tokens = np.asarray(tokens, dtype=np.uint16)
        while tokens.size:
            take = min(tokens.size, self.buf.size - self.fill)
            self.buf[self.fill:self.fill + take] = tokens[:take]
            self.fill, tokens = self.fill + take, tokens[take:]
            if self.fill == self.buf.size:
                self.flush()

    def flush(self):
        if self.fill:
            name = f"{self.split}_{len(self.shards):06d}.bin"
            write_shard(self.out_dir / name, self.buf[:self.fill], self.tok.vocab_size, self.tok.eot)
            self.shards.append({"file": name, "tokens": self.fill})
            self.fill = 0


# ----------------------------------------------------------------------------- documents: where the text comes from

def list_files(source):
    """A file, a folder (searched recursively) or a glob -> the sorted .txt/.jsonl/.parquet files."""
    p = Path(source)
    if p.is_dir():
        found = sorted(p.rglob("*"))
    else:
        found = [p] if p.is_file() else sorted(map(Path, glob.glob(source, recursive=True)))
    files = [f for f in found if f.is_file() and f.suffix in TEXT_SUFFIXES]
    if not files:
        raise DataError(f"no .txt/.jsonl/.parquet files at {source!r} (give a file, a folder, a quoted glob, "
                        f"'fineweb-edu', 'austen' or 'synthetic')")
    return files


def file_documents(path, text_field):
    """The documents of one local file, as strings. A file that is not UTF-8 or not what its suffix says, a
    malformed .jsonl line or a document that is not text is a DataError naming the file (and line)."""
    where = path
    try:
        if path.suffix == ".txt":
            yield path.read_text(encoding="utf-8")
        elif path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    where = f"{path}:{lineno}"
                    if line.strip():
                        row = parse_json(line, where)  # the project's one JSON reader
                        if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                            raise DataError(f"{where}: no field {text_field!r} holding text (data.py's --text-field)")
                        yield row[text_field]
        else:
            import pyarrow.parquet as pq  # comes with `datasets`
            pf = pq.ParquetFile(path)
            if text_field not in pf.schema_arrow.names or "string" not in str(pf.schema_arrow.field(text_field).type):
                raise DataError(f"{path}: no text column {text_field!r} in {pf.schema_arrow.names} "
                                f"(data.py's --text-field)")
            for batch in pf.iter_batches(columns=[text_field]):
                yield from (doc or "" for doc in batch.column(0).to_pylist())
    except DataError:
        raise
    except Exception as e:  # not UTF-8, malformed JSON, not a parquet file, unreadable
        why = getattr(e, "cause", None) or f"{type(e).__name__}: {first_line(e, 120)}"  # a JsonError: json's own
        raise DataError(f"{where}: cannot read it as {path.suffix[1:]} ({why})") from None


# Project Gutenberg's numbers of the six Austen novels: 4.0 MB of public-domain English, the text probe
# of the mini suite (`python data.py --source austen --tokenizer bytes --out data_cache/austen-bytes`)
AUSTEN = {"emma": 158, "mansfield_park": 141, "northanger_abbey": 121, "persuasion": 105,
          "pride_and_prejudice": 1342, "sense_and_sensibility": 161}
AUSTEN_URL = "https://www.gutenberg.org/cache/epub/{n}/pg{n}.txt"


def gutenberg_body(text):
    """The book between Project Gutenberg's '*** START OF ...' and '*** END OF ...' lines."""
    lines = text.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("*** START OF")), 0)
    end = next((i for i, line in enumerate(lines) if line.startswith("*** END OF")), len(lines))
    return "\n".join(lines[start:end]).strip() + "\n"


def download_austen(folder="data_cache/austen_txt", timeout=30.0):
    """The six novels as <name>.txt in folder, fetched once from Project Gutenberg (each written atomically,
    so a failed download leaves no half novel); returns the folder."""
    import urllib.request
    folder = Path(folder)
    for name, number in AUSTEN.items():
        path = folder / f"{name}.txt"
        if path.exists():
            continue
        url = AUSTEN_URL.format(n=number)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                text = response.read().decode("utf-8-sig")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot download {url} ({getattr(e, 'reason', e)}); offline, give the novels as "
                            f"local .txt files instead: --source path/to/folder") from None
        write_atomic(path, gutenberg_body(text))
    return folder


def fineweb_documents(config, timeout=5.0):
    """Stream FineWeb-Edu from the hub. Offline, `datasets` retries for half a minute and then
    prints a long traceback, so we ask the hub first (a few seconds) and turn failures into one line."""
    way_out = "offline, prepare local files instead: --source 'path/to/*.jsonl|*.parquet|*.txt'"
    if down := hub_unreachable(timeout):
        raise DataError(f"cannot reach the HuggingFace hub at {down[0]} ({down[1]}); {way_out}")
    import datasets
    try:
        for row in datasets.load_dataset("HuggingFaceFW/fineweb-edu", name=config, split="train", streaming=True):
            yield row["text"]
    except OSError as e:  # ConnectionError, huggingface_hub's HTTP errors and missing files are all OSErrors
        raise DataError(f"fineweb-edu ({config}) failed: {first_line(e) or type(e).__name__}; {way_out}") from None


def tokenize_documents(docs, tok, batch_size=256):
    """One token list per document, EOT appended; encoded in batches so tiktoken can use its threads."""
    docs = iter(docs)
    while batch := list(itertools.islice(docs, batch_size)):
        for ids in tok.encode_batch(batch):
            yield list(ids) + [tok.eot]


# ----------------------------------------------------------------------------- prepare: source -> shards

def load_meta(out_dir):
    """meta.json of a shard folder, or None when there is none or it is unreadable (prepare() then rebuilds)."""
    meta = read_json(Path(out_dir) / "meta.json")
    return meta if meta and {"config", "shards", "n_tokens"} <= set(meta) else None


def shards_intact(out_dir, meta):
    """True when every shard that meta.json names is whole and holds the tokens it promises."""
    try:
        return all(read_header(Path(out_dir) / s["file"])["n_tokens"] == s["tokens"]
                   for split in ("val", "train") for s in meta["shards"][split])
    except (OSError, DataError) as e:
        print(f"cannot reuse the shards: {e}")
        return False


def open_source(source, text_field, fineweb_config):
    """(what identifies the source in meta.json, a lazy iterator over its documents). Local files are named
    with their sizes, so an edited file leads to a rebuild."""
    if source == "fineweb-edu":
        return {"fineweb_config": fineweb_config}, fineweb_documents(fineweb_config)
    files = list_files(download_austen() if source == "austen" else source)
    return ({"text_field": text_field, "files": [[str(f.resolve()), f.stat().st_size] for f in files]},
            (d for f in files for d in file_documents(f, text_field)))


def write_splits(docs, tok, out_dir, val_tokens, shard_tokens, max_tokens):
    """Tokenize docs into val and train shards: validation is the first whole documents, until at least val_tokens
    (no document is in both splits). Returns {split: [{"file", "tokens"}]} and the total; train is empty when the
    documents ran out first. The progress bar shows in a terminal only (disable=None), not in a log."""
    from tqdm import tqdm
    writers = {s: ShardWriter(out_dir, s, shard_tokens, tok) for s in ("val", "train")}
    split, total = "val", 0
    with tqdm(total=max_tokens, unit="tok", unit_scale=True, desc=f"tokenizing ({tok.name})", disable=None) as bar:
        for ids in tokenize_documents(docs, tok):
            ids = ids if max_tokens is None else ids[:max_tokens - total]
            writers[split].add(ids)
            total += len(ids)
            bar.update(len(ids))
            if split == "val" and total >= val_tokens:
                split = "train"  # switch only between documents: no document is in both splits
            if max_tokens is not None and total >= max_tokens:
                break
    for w in writers.values():
        w.flush()
    return {s: w.shards for s, w in writers.items()}, total


VAL_FRACTION = 0.1  # a source split by tokens without a given validation size: at most its last 10% (nanoGPT's)


def split_by_tokens(out_dir, tok, shards, n_val, shard_tokens):
    """Re-cut `shards`, all of a source that ran out of documents before the train split began (so at most
    val_tokens and one document: it fits in memory): its last n_val tokens become val shards, the rest train
    shards. Returns {split: [{"file", "tokens"}]}."""
    tokens = np.concatenate([read_shard(Path(out_dir) / s["file"]) for s in shards])  # a copy: the files can go
    for s in shards:
        (Path(out_dir) / s["file"]).unlink()
    writers = {s: ShardWriter(out_dir, s, shard_tokens, tok) for s in ("val", "train")}
    writers["train"].add(tokens[:len(tokens) - n_val])
    writers["val"].add(tokens[len(tokens) - n_val:])
    for w in writers.values():
        w.flush()
    return {s: w.shards for s, w in writers.items()}


def build_shards(docs, tok, out_dir, config, given, val_flag):
    """Write config's shard set (prepare's) from docs into out_dir, meta.json last: a folder without it is rebuilt,
    never read. given, val_flag: the val_tokens the caller gave (None: the default), its flag. On any failure (a
    full disk, Ctrl-C) the shards so far are removed, and an OS failure is a DataError naming the path -> meta."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot write {out_dir}: {why_failed(e, out_dir)}") from None
    for old in [out_dir / "meta.json", *out_dir.glob("val_*.bin"), *out_dir.glob("train_*.bin")]:
        old.unlink(missing_ok=True)  # start clean, meta.json first
    t0 = time.time()
    try:
        shards, total = write_splits(docs, tok, out_dir, val_tokens=config["val_tokens"],
                                     shard_tokens=config["shard_tokens"], max_tokens=config["max_tokens"])
        split = "documents"
        if not shards["train"]:  # fewer documents than two splits need (a single .txt file is one document)
            n_val = config["val_tokens"]
            if given is None:
                n_val = max(1, min(n_val, int(total * VAL_FRACTION)))
            elif n_val >= total:
                raise DataError(f"validation ({val_flag} {n_val:,}) would take all {total:,} tokens of the source, "
                                f"leaving none for training; lower {val_flag}")
            print(f"{config['source']}: too few documents for a split by documents, so split by tokens: the last "
                  f"{n_val:,} of {total:,} tokens ({n_val / total:.1%}) are validation")
            shards = split_by_tokens(out_dir, tok, shards["val"], n_val=n_val, shard_tokens=config["shard_tokens"])
            split = "tokens"
        meta = {"format": "depthbench-shards", "version": VERSION, "config": config, "split": split,
                "n_tokens": total, "seconds": round(time.time() - t0, 2), "shards": shards}
        write_json(out_dir / "meta.json", meta)
    except BaseException as e:
        for f in [*out_dir.glob("val_*.bin"), *out_dir.glob("train_*.bin")]:
            f.unlink(missing_ok=True)
        if isinstance(e, WriteError):
            raise DataError(str(e)) from None
        raise
    return meta


def prepare(source, out_dir, tokenizer="gpt2", val_tokens=None, shard_tokens=100_000_000,
            max_tokens=None, text_field="text", fineweb_config="sample-10BT", val_flag="--val-tokens"):
    """Tokenize a real source into shards in out_dir, or reuse them; return the meta dict. Validation is the first
    whole documents, until at least val_tokens (default 10M for fineweb-edu, 100k for local files: Austen's one
    novel); a source with too few documents (one .txt file) is split by tokens instead: its last val_tokens, or
    without them the less of 100k and 10% of all. val_flag: how the caller's command line names val_tokens."""
    out_dir, tok = Path(out_dir), get_tokenizer(tokenizer)
    given = val_tokens
    if val_tokens is None:
        val_tokens = 10_000_000 if source == "fineweb-edu" else 100_000
    described, docs = open_source(source, text_field, fineweb_config)
    config = {"source": source, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot,
              "val_tokens": val_tokens, "shard_tokens": shard_tokens, "max_tokens": max_tokens, **described}
    meta = load_meta(out_dir)
    if meta is not None and meta["config"] == config and shards_intact(out_dir, meta):
        print(f"reusing the shards in {out_dir} (meta.json matches these settings)")
        return meta
    first = next(docs, None)  # read now: an unreachable source fails before anything is deleted
    if first is None:
        raise DataError(f"{source}: no documents")
    return build_shards(itertools.chain([first], docs), tok, out_dir, config=config, given=given, val_flag=val_flag)


# ----------------------------------------------------------------------------- batches

class ShardStream:
    """The tokens of one split of a shard folder, read as one long array across its files. Opening it checks
    every token id against the vocabulary (one pass), so a bad id is a DataError now, not at some step of training."""

    def __init__(self, folder, split):
        self.meta = load_meta(folder)
        if self.meta is None:
            raise DataError(f"no readable meta.json in {folder}: make it with python data.py --source ... "
                            f"--out {folder}")
        files = [Path(folder) / s["file"] for s in self.meta["shards"][split]]
        self.shards = [read_shard(f) for f in files]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])  # where each file begins in the stream
        vocab = self.meta["config"]["vocab_size"]
        for f, shard in zip(files, self.shards):
            if len(shard) and int(shard.max()) >= vocab:
                raise DataError(f"{f}: token id {int(shard.max())} is outside the vocabulary "
                                f"of {vocab} (meta.json); rebuild the shards with data.py")

    def __len__(self):
        return int(self.starts[-1])

    def read(self, start, n):
        """Tokens [start, start + n) of the split, as int64."""
        pieces, i = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        while n > 0:
            piece = self.shards[i][start - self.starts[i]:start - self.starts[i] + n]
            pieces.append(piece)
            start, n, i = start + len(piece), n - len(piece), i + 1
        return np.concatenate(pieces).astype(np.int64)


class BatchLoader:
    """(x, y, level) batches for one rank: x, y are (B, T) int64, y = x shifted left by one; level is (B, T)
    int64 for the synthetic task (the gap g where y is an answer, -1 elsewhere) and None for real text.
    Rank r at micro-step m of step s reads the global sequences s*global_batch + (m*world_size + r)*B + [0, B);
    global sequence g is a window of real text (train: shuffled per epoch, seeded by (seed, epoch); val: in
    order) or the synthetic sequence seeded by (seed, split, g): docs/training.md#shard-format-and-batch-order."""

    def __init__(self, source, split, batch_size, seq_len, global_batch=None, rank=0, world_size=1, seed=VAL_SEED):
        """source: a SyntheticTask, or a folder of shards made by prepare(). global_batch: sequences
        per optimizer step over all ranks and micro-steps (default batch_size * world_size)."""
        global_batch = global_batch or batch_size * world_size
        if split not in SPLITS or not 0 <= rank < world_size or global_batch % (batch_size * world_size):
            raise DataError(f"bad loader settings: split {split!r}, rank {rank} of {world_size}, global batch "
                            f"{global_batch} must be a multiple of batch_size * world_size = {batch_size * world_size}")
        self.split, self.B, self.T, self.seed = split, batch_size, seq_len, seed
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        self.accum_steps = global_batch // (batch_size * world_size)  # micro-steps per optimizer step
        if isinstance(source, SyntheticTask):
            self.task, self.vocab_size = source, source.vocab_size
        else:
            self.task, self.stream = None, ShardStream(source, split)
            self.vocab_size = self.stream.meta["config"]["vocab_size"]
            self.n_windows = (len(self.stream) - 1) // seq_len
            if self.n_windows < 1:
                raise DataError(f"{source}: {split} has {len(self.stream)} tokens, fewer than T + 1 = {seq_len + 1}")
            self._perm_epoch, self._perm = None, None
        self.step, self.micro_step = 0, 0

    def sequence_indices(self, step, micro_step):
        """The global indices of the B sequences this rank reads at (step, micro_step)."""
        first = step * self.global_batch + (micro_step * self.world_size + self.rank) * self.B
        return range(first, first + self.B)

    def window(self, g):
        """The T+1 tokens of global sequence g of real data: window perm_e[g % n_windows] of epoch
        e = g // n_windows for train, window g % n_windows for val (windows start at multiples of T)."""
        epoch, i = divmod(g, self.n_windows)
        if self.split == "train":
            if self._perm_epoch != epoch:  # one permutation per epoch, kept until the next one
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
                self._perm_epoch = epoch
            i = int(self._perm[i])
        return self.stream.read(i * self.T, self.T + 1)

    def get_batch(self, step, micro_step):
        if self.task is None:
            seqs, level = np.stack([self.window(g) for g in self.sequence_indices(step, micro_step)]), None
        else:
            rows = [self.task.sequence(self.split, g, self.T + 1, self.seed)
                    for g in self.sequence_indices(step, micro_step)]
            seqs = np.array([r[0] for r in rows], dtype=np.int64)
            level = torch.from_numpy(np.array([r[1][1:] for r in rows], dtype=np.int64))  # the level of each target
        seqs = torch.from_numpy(seqs)
        x, y = seqs[:, :-1].clone(), seqs[:, 1:].clone()  # clone: at batch 1 a contiguous() view aliases
        if self.task is not None and self.task.answers_only:
            y[level <= 0] = -1  # the model's loss ignores target -1: answers are the only targets
        return x, y, level

    def next_batch(self):
        """The batch at the current position, then move on by one micro-step."""
        batch = self.get_batch(self.step, self.micro_step)
        self.micro_step += 1
        if self.micro_step == self.accum_steps:
            self.step, self.micro_step = self.step + 1, 0
        return batch

    def state_dict(self):
        return {"step": self.step, "micro_step": self.micro_step}

    def load_state_dict(self, state):
        self.step, self.micro_step = int(state["step"]), int(state["micro_step"])


# ----------------------------------------------------------------------------- command line

def show_synthetic(args):
    task = SyntheticTask(args.max_gap, args.group)
    print(f"synthetic {args.group.upper()} running products, max gap {args.max_gap}: vocab {task.vocab_size} "
          f"({task.eq} elements + '='), answers ~{2 / (args.max_gap + 5):.1%} of targets")
    print(f"loss floor over all targets: {task.loss_floor(args.seq_len):.4f} nats/token at T={args.seq_len}, "
          f"{task.loss_floor():.4f} for long sequences; answers alone: 0")
    for i in range(args.show):
        print(f"\nval sequence {i}:\n" + task.decode(*task.sequence("val", i, args.seq_len, args.seed)))


def show_shards(args, meta, out):
    for split in ("val", "train"):
        for s in meta["shards"][split]:
            print(f"{split:5s} {s['file']}: {s['tokens']:,} tokens")
    n_val = sum(s["tokens"] for s in meta["shards"]["val"])
    print(f"{meta['n_tokens']:,} tokens ({n_val:,} validation) with {meta['config']['tokenizer']} "
          f"in {meta['seconds']}s, in {out}")
    if args.show:
        x, _, _ = BatchLoader(out, "train", args.show, args.seq_len, seed=args.seed).get_batch(0, 0)
        tok = get_tokenizer(meta["config"]["tokenizer"])
        for row in x.tolist():
            print(f"\n{tok.decode(row)!r}")


def main(argv=None):
    p = ArgParser(prog="data.py", description="Prepare token shards from a real source, or show the synthetic task.")
    p.add_argument("--source", required=True, help="'fineweb-edu', 'austen' (downloaded once), 'synthetic', or a "
                   ".txt/.jsonl/.parquet file, folder or quoted glob")
    p.add_argument("--out", help="output folder for the shards (required for real sources)")
    p.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "bytes"],
                   help="gpt2 (tiktoken BPE) or bytes (UTF-8, vocab 257)")
    p.add_argument("--val-tokens", type=positive(), help="validation = the first whole documents, until at least "
                   "this many tokens (default 10M for fineweb-edu, 100k for local files); a source of too few "
                   "documents (one .txt file): its last this many tokens (default: 100k or 10%%, the less)")
    p.add_argument("--shard-tokens", type=positive(), default=100_000_000, help="tokens per train shard file")
    p.add_argument("--max-tokens", type=positive(), help="stop after this many tokens in all (default: all)")
    p.add_argument("--text-field", default="text", help="the text field of .jsonl rows / .parquet columns")
    p.add_argument("--fineweb-config", default="sample-10BT", help="the fineweb-edu subset to stream")
    p.add_argument("--max-gap", type=positive(), default=4, help="synthetic: the largest gap (compositions per answer)")
    p.add_argument("--group", default="s4", choices=["s3", "s4", "s5"], help="synthetic: the permutation group")
    p.add_argument("--show", type=positive(), default=0, help="print this many decoded example sequences")
    p.add_argument("--seq-len", type=positive(), default=64, help="T of the shown sequences and the loss floor")
    p.add_argument("--seed", type=seed_number, default=VAL_SEED, help="seeds synthetic sequences and train window order")
    args = p.parse_args(argv)
    if args.source != "synthetic" and args.out is None:
        p.error("--out is required to prepare shards from a real source")
    try:
        if args.source == "synthetic":
            show_synthetic(args)
        else:
            meta = prepare(args.source, args.out, args.tokenizer, val_tokens=args.val_tokens,
                           shard_tokens=args.shard_tokens, max_tokens=args.max_tokens, text_field=args.text_field,
                           fineweb_config=args.fineweb_config)
            show_shards(args, meta, args.out)
    except DataError as e:
        fail("data.py", e)


if __name__ == "__main__":
    with one_line_faults("data.py", "no meta.json was written, so the same command makes these shards again"):
        main()
