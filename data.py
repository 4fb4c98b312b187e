"""
data.py: everything depthbench feeds a model. Real text becomes token shards on disk, and an
embedded synthetic task (generated on the fly) has answers that need composition depth.

    python data.py --source ../shared/data/austen --tokenizer gpt2 --out data_cache/austen
    python data.py --source fineweb-edu --max-tokens 100000000 --out data_cache/fineweb
    python data.py --source synthetic --max-gap 4 --show 3

Sources
  fineweb-edu  HuggingFaceFW/fineweb-edu streamed with `datasets` (--fineweb-config sample-10BT),
               cut at --max-tokens.
  local files  a file, a folder or a glob of .txt (one file = one document), .jsonl (one JSON
               object per line) and .parquet (one row per document) files, text in --text-field.
  synthetic    never written to disk, see SyntheticTask below.

Tokenizers: `gpt2` (tiktoken, vocab 50257, EOT 50256) and `bytes` (the 256 byte values + EOT 256,
vocab 257, nothing to download). The model pads the vocab itself: padded_vocab_size(50257) = 50304.

Shard format (llm.c style, so a shard describes itself)
  header  256 little-endian int32: [MAGIC, VERSION, n_tokens, vocab_size, eot, 0, ...]
  body    n_tokens uint16 tokens (both vocabs are < 2**16)
Documents are packed back to back, each followed by EOT (spec §1.1: EOS appended), and may
straddle two shard files. An output folder holds
  val_000000.bin          the first whole documents of the source, until at least --val-tokens
                          tokens (Austen sorted by name: emma.txt), so no document is in both splits
  train_000000.bin, ...   the rest, --shard-tokens tokens per file
  meta.json               written last: the settings that made the shards and their token counts.
Every file is written to a .tmp name and renamed, so a crash never leaves a half file that looks
finished. A re-run whose settings match meta.json reuses the shards. A truncated or foreign shard
raises DataError, a ValueError with a one-line message that the scripts print before exiting with 2.

Batch order (BatchLoader): optimizer step s consumes `global_batch` sequences with global indices
s*global_batch ... s*global_batch + global_batch - 1. They are cut into micro-batches of B
sequences, and rank r at micro-step m takes slot m*world_size + r, i.e. indices
s*global_batch + (m*world_size + r)*B + [0, B). The ranks therefore read disjoint slices, and the
set of sequences in a step does not depend on the number of GPUs. A global index g maps to:
  real, train  epoch g // n_windows, then window perm_epoch[g % n_windows], where the windows are
               the non-overlapping T+1-token spans starting at multiples of T and perm_epoch is a
               permutation seeded by (seed, epoch)
  real, val    window g % n_windows, in order (the same eval batches every time)
  synthetic    a sequence generated from an RNG seeded by (seed, split, g)
So every batch is a pure function of (step, micro_step), and the loader's position is two ints.
"""

import argparse
import glob
import hashlib
import itertools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

MAGIC, VERSION = 20260517, 1  # our own magic, so an llm.c or nanoGPT .bin is rejected, not misread
HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
SPLITS = {"train": 0, "val": 1}  # the split's number goes into the synthetic RNG seed


class DataError(ValueError):
    """A problem the user can fix (bad source, offline, corrupt shard). Scripts print it as one line and exit 2."""


def padded_vocab_size(vocab_size, multiple=64):
    """Round the embedding/LM-head size up to a multiple of 64: 50257 -> 50304 (faster matmuls)."""
    return -(-vocab_size // multiple) * multiple


# -----------------------------------------------------------------------------
# tokenizers

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


def check_tiktoken_files(timeout=5.0):
    """tiktoken downloads with requests.get and no timeout, which hangs offline. So: if the files are
    not in its cache (named by the sha1 of the URL, in the folder tiktoken itself would use), first
    check in a few seconds that the server answers, and otherwise stop with the way out."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get(
        "DATA_GYM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache")))
    names = [hashlib.sha1(url.encode()).hexdigest() for url in GPT2_URLS]
    if cache and all(os.path.exists(os.path.join(cache, n)) for n in names):
        return
    import requests
    try:
        requests.get(GPT2_URLS[0], timeout=timeout, stream=True).close()
    except requests.RequestException as e:
        raise DataError(f"the GPT-2 BPE files are not in the tiktoken cache ({cache or 'disabled'}) and cannot be "
                        f"downloaded ({type(e).__name__}); offline, run with TIKTOKEN_CACHE_DIR=../shared/data/tiktoken "
                        f"or use --tokenizer bytes") from None


def get_tokenizer(name):
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "bytes":
        return ByteTokenizer()
    raise DataError(f"unknown tokenizer {name!r} (choose gpt2 or bytes)")


# -----------------------------------------------------------------------------
# shard files

def write_shard(path, tokens, vocab_size, eot):
    """Header + uint16 tokens, written to path.tmp and then renamed, so readers never see half a file."""
    tokens = np.asarray(tokens)
    assert tokens.size == 0 or int(tokens.max()) < 2**16, "token ids must fit in uint16"
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:5] = MAGIC, VERSION, tokens.size, vocab_size, eot
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    os.replace(tmp, path)


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


# -----------------------------------------------------------------------------
# documents: where the text comes from

def list_files(source):
    """A file, a folder (searched recursively) or a glob -> the sorted .txt/.jsonl/.parquet files."""
    p = Path(source)
    found = sorted(p.rglob("*")) if p.is_dir() else [p] if p.is_file() else sorted(map(Path, glob.glob(source, recursive=True)))
    files = [f for f in found if f.is_file() and f.suffix in TEXT_SUFFIXES]
    if not files:
        raise DataError(f"no .txt/.jsonl/.parquet files at {source!r} (give a file, a folder, a quoted glob, "
                        f"'fineweb-edu' or 'synthetic')")
    return files


def file_documents(path, text_field):
    """The documents of one local file, as strings."""
    if path.suffix == ".txt":
        yield path.read_text(encoding="utf-8")
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if text_field not in row:
                        raise DataError(f"{path}:{lineno}: no field {text_field!r} (choose it with --text-field)")
                    yield row[text_field]
    else:
        import pyarrow.parquet as pq  # comes with `datasets`
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise DataError(f"{path}: no column {text_field!r}, it has {pf.schema_arrow.names} (choose with --text-field)")
        for batch in pf.iter_batches(columns=[text_field]):
            yield from batch.column(0).to_pylist()


def fineweb_documents(config, timeout=5.0):
    """Stream FineWeb-Edu from the hub. Offline, `datasets` retries for half a minute and then
    prints a long traceback, so we ask the hub first (a few seconds) and turn failures into one line."""
    way_out = "offline, prepare local files instead: --source 'path/to/*.jsonl|*.parquet|*.txt'"
    offline = any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if not offline:
        import requests
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        try:
            requests.get(endpoint, timeout=timeout, stream=True).close()
        except requests.RequestException as e:
            raise DataError(f"cannot reach the HuggingFace hub at {endpoint} ({type(e).__name__}); {way_out}") from None
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")  # huggingface_hub's defaults; read when it is first imported
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    import datasets
    try:
        for row in datasets.load_dataset("HuggingFaceFW/fineweb-edu", name=config, split="train", streaming=True):
            yield row["text"]
    except OSError as e:  # ConnectionError, huggingface_hub's HTTP errors and missing files are all OSErrors
        raise DataError(f"fineweb-edu ({config}) failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}; {way_out}") from None


def tokenize_documents(docs, tok, batch_size=256):
    """One token list per document, EOT appended; encoded in batches so tiktoken can use its threads."""
    docs = iter(docs)
    while batch := list(itertools.islice(docs, batch_size)):
        for ids in tok.encode_batch(batch):
            yield list(ids) + [tok.eot]


# -----------------------------------------------------------------------------
# prepare: source -> shards

def load_meta(out_dir):
    path = Path(out_dir) / "meta.json"
    return json.loads(path.read_text()) if path.exists() else None


def shards_intact(out_dir, meta):
    """True when every shard meta.json names is whole and holds the token count it promises."""
    try:
        return all(read_header(Path(out_dir) / s["file"])["n_tokens"] == s["tokens"]
                   for split in ("val", "train") for s in meta["shards"][split])
    except (OSError, DataError) as e:
        print(f"cannot reuse the shards: {e}")
        return False


def prepare(source, out_dir, tokenizer="gpt2", val_tokens=None, shard_tokens=100_000_000,
            max_tokens=None, text_field="text", fineweb_config="sample-10BT"):
    """Tokenize a real source into shards in out_dir (see the module docstring); return the meta dict.
    val_tokens defaults to 10M for fineweb-edu and 100k for local files (Austen: one novel)."""
    out_dir = Path(out_dir)
    tok = get_tokenizer(tokenizer)
    if val_tokens is None:
        val_tokens = 10_000_000 if source == "fineweb-edu" else 100_000
    config = {"source": source, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot,
              "val_tokens": val_tokens, "shard_tokens": shard_tokens, "max_tokens": max_tokens}
    if source == "fineweb-edu":
        config["fineweb_config"] = fineweb_config
        docs = fineweb_documents(fineweb_config)
    else:  # name each file with its size, so an edited file leads to a rebuild
        files = list_files(source)
        config.update(text_field=text_field, files=[[str(f.resolve()), f.stat().st_size] for f in files])
        docs = (d for f in files for d in file_documents(f, text_field))
    meta = load_meta(out_dir)
    if meta is not None and meta["config"] == config and shards_intact(out_dir, meta):
        print(f"reusing the shards in {out_dir} (meta.json matches these settings)")
        return meta
    docs = iter(docs)  # read the first document now: an unreachable source fails before we delete anything
    first = next(docs, None)
    if first is None:
        raise DataError(f"{source}: no documents")
    docs = itertools.chain([first], docs)

    # start clean: meta.json first, so a crash from here on can never look like a finished run
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [out_dir / "meta.json", *out_dir.glob("val_*.bin"), *out_dir.glob("train_*.bin")]:
        old.unlink(missing_ok=True)
    from tqdm import tqdm
    t0 = time.time()
    writers = {s: ShardWriter(out_dir, s, shard_tokens, tok) for s in ("val", "train")}
    split, total = "val", 0
    with tqdm(total=max_tokens, unit="tok", unit_scale=True, desc=f"tokenizing ({tok.name})") as bar:
        for ids in tokenize_documents(docs, tok):
            if max_tokens is not None:
                ids = ids[:max_tokens - total]
            writers[split].add(ids)
            total += len(ids)
            bar.update(len(ids))
            if split == "val" and total >= val_tokens:
                split = "train"  # switch only between documents: no document is in both splits
            if max_tokens is not None and total >= max_tokens:
                break
    for w in writers.values():
        w.flush()
    if not writers["train"].shards:
        raise DataError(f"nothing left for training: the validation split (whole documents, at least --val-tokens "
                        f"{val_tokens}) took all {total} tokens; lower --val-tokens or add documents")
    meta = {"format": "depthbench-shards", "version": VERSION, "config": config, "n_tokens": total,
            "seconds": round(time.time() - t0, 2), "shards": {s: w.shards for s, w in writers.items()}}
    tmp = out_dir / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out_dir / "meta.json")
    return meta


# -----------------------------------------------------------------------------
# the synthetic task

class SyntheticTask:
    """Running products in the permutation group S4 (or S5), with the answer written after a gap.

    Tokens: 0..|G|-1 are the group elements (permutations of 0..n-1 in lexicographic order, so 0 is
    the identity) and |G| is the separator "=". Vocab 25 for S4, 121 for S5. A sequence is

        = a0 | e e = a1 | e = a2 | e e e e = a3 | ...

    It opens with "=" and a random start a0. Then each segment draws a gap g uniform in 1..max_gap,
    writes g uniform random elements, then "=", then the answer a_j = a_{j-1}·e_1·…·e_g. The product
    p·q means "apply p, then q": (p·q)[i] = q[p[i]]. (The "|" are not tokens.) The answer after a gap
    of g needs g compositions of what came before, so g is the answer's difficulty level. If every
    partial product were written right after its element, each answer would be a single table lookup,
    and a one-layer model would solve it.

    S4 by default: it is non-abelian, so there is no order-free shortcut. The only thing an answer
    reveals without composing is its sign, and its 24x24 table is quick to learn, so depth is the
    bottleneck rather than memorising the table. S5 (--group s5) is non-solvable, so it has no
    constant-depth shortcut at all (Barrington), but it has a 120x120 table and a larger vocab.

    Loss floor. Answers are determined by the context (0 nats). Elements are uniform (ln|G| each).
    After the j-th element of a segment, "=" comes next with probability 1/(k-j+1), since g is
    uniform. By the chain rule a segment carries ln k + (k+1)/2·ln|G| nats in (k+5)/2 tokens, so for
    long sequences the floor is that ratio: 2.0735 nats/token for S4 and k = 4. loss_floor(T) gives
    the exact value for the T targets of one sequence, including the uniform a0 and the cut at the end.
    """

    def __init__(self, max_gap=4, group="s4", seed=1337):
        if max_gap < 1 or group not in ("s4", "s5"):
            raise DataError(f"synthetic task needs max_gap >= 1 and group s4|s5, got {max_gap}, {group!r}")
        self.max_gap, self.group, self.seed = max_gap, group, seed
        self.elements = list(itertools.permutations(range(int(group[1]))))
        index = {p: i for i, p in enumerate(self.elements)}
        # mul[a][b] = a·b, as a list of lists because the generator indexes it one token at a time
        self.mul = [[index[tuple(b[i] for i in a)] for b in self.elements] for a in self.elements]
        self.eq = len(self.elements)
        self.vocab_size = self.eq + 1

    def sequence(self, split, index, length):
        """Sequence number `index` of a split: (tokens, levels), two int lists of `length`.
        levels[t] is g when token t is an answer written after a gap of g, else -1. The RNG is
        seeded by (seed, split, index), so train and val never share a stream and any sequence
        can be rebuilt from its index alone."""
        rng = np.random.default_rng([self.seed, SPLITS[split], index])
        gaps = rng.integers(1, self.max_gap + 1, size=length).tolist()
        elems = iter(rng.integers(0, self.eq, size=length + self.max_gap).tolist())
        state = next(elems)
        tokens, levels = [self.eq, state], [-1, -1]
        for g in gaps:
            if len(tokens) >= length:
                break
            for _ in range(g):
                e = next(elems)
                state = self.mul[state][e]
                tokens.append(e)
                levels.append(-1)
            tokens += [self.eq, state]
            levels += [-1, g]
        return tokens[:length], levels[:length]

    def loss_floor(self, seq_len=None):
        """The least mean cross-entropy (nats per target) any model can reach on all targets of a
        (B, seq_len) batch; seq_len=None gives the long-sequence limit. Exact: it follows the
        probability of each "what came last" state through the seq_len positions."""
        k, lnG = self.max_gap, math.log(self.eq)
        if seq_len is None:
            return (math.log(k) + (k + 1) / 2 * lnG) / ((k + 5) / 2)
        # target 0 is a0 (uniform). Then the states: 0 = after a0 or an answer (an element is next:
        # ln|G|), j = 1..k = j elements into a segment, k+1 = after a closing "=" (the answer is next: 0)
        hazard = [None] + [1 / (k - j + 1) for j in range(1, k + 1)]  # P("=" next | j elements so far)
        cost = [lnG] + [-h * math.log(h) - (1 - h) * math.log((1 - h) / self.eq) if h < 1 else 0.0
                        for h in hazard[1:]] + [0.0]
        p, total = [1.0] + [0.0] * (k + 1), lnG
        for _ in range(seq_len - 1):
            total += sum(pi * ci for pi, ci in zip(p, cost))
            nxt = [p[k + 1]] + [0.0] * (k + 1)  # an answer is followed by the next segment
            nxt[1] += p[0]
            for j in range(1, k + 1):
                nxt[k + 1] += p[j] * hazard[j]
                if j < k:
                    nxt[j + 1] += p[j] * (1 - hazard[j])
            p = nxt
        return total / seq_len

    def decode(self, tokens, levels):
        """Readable text: elements in one-line notation, answers as 'g2:3021 |'."""
        words = [("=" if t == self.eq else "".join(map(str, self.elements[t]))) for t in tokens]
        return " ".join(f"g{l}:{w} |" if l > 0 else f"{w} |" if i == 1 else w
                        for i, (w, l) in enumerate(zip(words, levels)))


# -----------------------------------------------------------------------------
# batches

class ShardStream:
    """The tokens of one split of a shard folder, read as one long array across its files."""

    def __init__(self, folder, split):
        meta = load_meta(folder)
        if meta is None:
            raise DataError(f"no meta.json in {folder}: prepare it first with python data.py --source ... --out {folder}")
        self.meta = meta
        self.shards = [read_shard(Path(folder) / s["file"]) for s in meta["shards"][split]]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])  # where each file begins in the stream

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
    """(x, y, level) batches for one rank: x, y are (B, T) int64 with y = x shifted left by one.
    level is (B, T) int64 for the synthetic task (the gap g where y is an answer, -1 elsewhere) and
    None for real text. The order is in the module docstring: each batch is a pure function of
    (step, micro_step), and the loader only remembers where it is."""

    def __init__(self, source, split, batch_size, seq_len, global_batch=None, rank=0, world_size=1, seed=1337):
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
                raise DataError(f"{source}: the {split} split has {len(self.stream)} tokens, too few for one sequence of {seq_len}")
            self._perm_epoch, self._perm = None, None
        self.step, self.micro_step = 0, 0

    def sequence_indices(self, step, micro_step):
        """The global indices of the B sequences this rank reads at (step, micro_step)."""
        first = step * self.global_batch + (micro_step * self.world_size + self.rank) * self.B
        return range(first, first + self.B)

    def window(self, g):
        """The T+1 tokens of global sequence g of real data (see the module docstring)."""
        epoch, i = divmod(g, self.n_windows)
        if self.split == "train":
            if self._perm_epoch != epoch:  # one permutation per epoch, kept until the next one
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
                self._perm_epoch = epoch
            i = int(self._perm[i])
        return self.stream.read(i * self.T, self.T + 1)

    def get_batch(self, step, micro_step):
        if self.task is None:
            seqs = np.stack([self.window(g) for g in self.sequence_indices(step, micro_step)])
            level = None
        else:
            rows = [self.task.sequence(self.split, g, self.T + 1) for g in self.sequence_indices(step, micro_step)]
            seqs = np.array([r[0] for r in rows], dtype=np.int64)
            level = torch.from_numpy(np.array([r[1][1:] for r in rows], dtype=np.int64))  # the level of each target
        seqs = torch.from_numpy(seqs)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous(), level

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


# -----------------------------------------------------------------------------
# command line

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + error, still exit code 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def show_synthetic(args):
    task = SyntheticTask(args.max_gap, args.group, args.seed)
    print(f"synthetic {args.group.upper()} running products, max gap {args.max_gap}: vocab {task.vocab_size} "
          f"({task.eq} elements + '='), answers ~{2 / (args.max_gap + 5):.1%} of targets")
    print(f"loss floor over all targets: {task.loss_floor(args.seq_len):.4f} nats/token at T={args.seq_len}, "
          f"{task.loss_floor():.4f} for long sequences; answers alone: 0")
    for i in range(args.show):
        print(f"\nval sequence {i}:\n" + task.decode(*task.sequence("val", i, args.seq_len)))


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
    p = Parser(description="Prepare token shards from a real source, or show the synthetic task.")
    p.add_argument("--source", required=True, help="'fineweb-edu', 'synthetic', or a .txt/.jsonl/.parquet file, folder or quoted glob")
    p.add_argument("--out", help="output folder for the shards (required for real sources)")
    p.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "bytes"], help="gpt2 (tiktoken BPE) or bytes (UTF-8, vocab 257)")
    p.add_argument("--val-tokens", type=positive, help="validation = the first whole documents, until at least this many tokens "
                   "(default 10M for fineweb-edu, 100k for local files)")
    p.add_argument("--shard-tokens", type=positive, default=100_000_000, help="tokens per train shard file")
    p.add_argument("--max-tokens", type=positive, help="stop after this many tokens in all (default: the whole source)")
    p.add_argument("--text-field", default="text", help="the text field of .jsonl rows / .parquet columns")
    p.add_argument("--fineweb-config", default="sample-10BT", help="the fineweb-edu subset to stream")
    p.add_argument("--max-gap", type=positive, default=4, help="synthetic: the largest gap k (compositions per answer)")
    p.add_argument("--group", default="s4", choices=["s4", "s5"], help="synthetic: the permutation group")
    p.add_argument("--show", type=int, default=0, help="print this many decoded example sequences")
    p.add_argument("--seq-len", type=positive, default=64, help="length of the shown sequences (and T for the loss floor)")
    p.add_argument("--seed", type=int, default=1337, help="synthetic task seed / train window order seed")
    args = p.parse_args(argv)
    if args.source != "synthetic" and args.out is None:
        p.error("--out is required to prepare shards from a real source")
    if args.show < 0:
        p.error(f"--show must be >= 0, got {args.show}")
    try:
        if args.source == "synthetic":
            show_synthetic(args)
        else:
            meta = prepare(args.source, args.out, args.tokenizer, args.val_tokens, args.shard_tokens,
                           args.max_tokens, args.text_field, args.fineweb_config)
            show_shards(args, meta, args.out)
    except DataError as e:
        print(f"data.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
