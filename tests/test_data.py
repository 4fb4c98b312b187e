"""
Tests of data.py: shards, tokenizers, preparing real text, the synthetic task and the batch loader.
CPU only, no network, about 10 s:

    python -m pytest -q tests/test_data.py

Tests that need ../shared/data (the GPT-2 BPE cache and the Austen novels) skip where it is absent.
"""

import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import data
from data import BatchLoader, DataError
from depthbench.evaluation.synthetic import SyntheticTask, answer_metrics

ROOT = Path(__file__).resolve().parents[1]  # the repository root
TIKTOKEN_DIR = ROOT.parent / "shared" / "data" / "tiktoken"
AUSTEN_DIR = ROOT.parent / "shared" / "data" / "austen"
needs_tiktoken = pytest.mark.skipif(not TIKTOKEN_DIR.is_dir(), reason=f"no GPT-2 BPE cache at {TIKTOKEN_DIR}")
needs_austen = pytest.mark.skipif(not AUSTEN_DIR.is_dir(), reason=f"no Austen texts at {AUSTEN_DIR}")


def run_cli(*args, env=None, timeout=60):
    """Run `python data.py ...` in a subprocess; return (returncode, stdout, stderr, seconds)."""
    t0 = time.time()
    r = subprocess.run([sys.executable, str(ROOT / "data.py"), *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=timeout, cwd=ROOT)
    return r.returncode, r.stdout, r.stderr, time.time() - t0


def tokenizer(name, monkeypatch):
    if name == "gpt2":
        if not TIKTOKEN_DIR.is_dir():
            pytest.skip(f"no GPT-2 BPE cache at {TIKTOKEN_DIR}")
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_DIR))
    return data.get_tokenizer(name)


# -----------------------------------------------------------------------------
# shard files

def test_shard_round_trip(tmp_path):
    """The exact tokens and header fields come back, including the extreme ids 0 and 65535."""
    tokens = np.array([0, 1, 50256, 65535, 7], dtype=np.uint16)
    path = tmp_path / "s.bin"
    data.write_shard(path, tokens, vocab_size=50257, eot=50256)
    assert data.read_header(path) == {"n_tokens": 5, "vocab_size": 50257, "eot": 50256}
    assert np.array_equal(data.read_shard(path), tokens)
    assert path.stat().st_size == data.HEADER_BYTES + 2 * 5
    assert not list(tmp_path.glob("*.tmp"))  # written to .tmp and renamed


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:-2], "truncated or corrupt"),                                  # one token short
    (lambda b: np.int32(20240520).tobytes() + b[4:], "not a depthbench shard"),  # llm.c's magic
    (lambda b: b[:100], "shorter than the"),                                     # not even a header
])
def test_damaged_shard_is_rejected_in_one_line(tmp_path, damage, message):
    path = tmp_path / "s.bin"
    data.write_shard(path, np.arange(10), 257, 256)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError, match=message) as e:
        data.read_shard(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


# -----------------------------------------------------------------------------
# tokenizers

TEXT = "It is a truth universally acknowledged, — naïve café ☕ <|endoftext|>\n\n"


@pytest.mark.parametrize("name, vocab, eot", [("bytes", 257, 256), ("gpt2", 50257, 50256)])
def test_tokenizers_round_trip(name, vocab, eot, monkeypatch):
    tok = tokenizer(name, monkeypatch)
    ids = tok.encode_batch([TEXT])[0]
    assert (tok.vocab_size, tok.eot) == (vocab, eot)
    assert tok.decode(ids) == TEXT
    assert eot not in ids  # text that spells out <|endoftext|> stays text
    assert max(ids) < vocab


@needs_tiktoken
def test_gpt2_ids_match_reference(monkeypatch):
    """The ids quoted in ../shared/data/README.md, and the padded vocab the model uses."""
    assert tokenizer("gpt2", monkeypatch).encode_batch(["hello world"])[0] == [31373, 995]
    assert data.padded_vocab_size(50257) == 50304 and data.padded_vocab_size(257) == 320


def test_gpt2_download_offline_fails_fast_in_one_line(tmp_path):
    """An empty tiktoken cache and an unreachable network (a proxy nobody listens on): exit 2 in
    seconds with one line that names TIKTOKEN_CACHE_DIR, never a hang or a traceback."""
    (tmp_path / "a.txt").write_text("hello")
    dead = "http://127.0.0.1:9"
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"), "HTTPS_PROXY": dead, "HTTP_PROXY": dead,
           "https_proxy": dead, "http_proxy": dead, "NO_PROXY": "", "no_proxy": ""}
    rc, out, err, seconds = run_cli("--source", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), env=env)
    assert rc == 2 and seconds < 20
    assert err.count("\n") == 1 and "TIKTOKEN_CACHE_DIR=a folder holding the two GPT-2 BPE files" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["HF_HUB_OFFLINE", "unreachable-hub"])
def test_fineweb_offline_fails_fast_in_one_line(tmp_path, env):
    rc, out, err, seconds = run_cli("--source", "fineweb-edu", "--tokenizer", "bytes", "--out", str(tmp_path), env=env)
    assert rc == 2 and seconds < 20
    assert err.count("\n") == 1 and "--source" in err and "Traceback" not in err


# -----------------------------------------------------------------------------
# preparing real text

def split_tokens(out_dir, split):
    meta = data.load_meta(out_dir)
    return np.concatenate([data.read_shard(out_dir / s["file"]) for s in meta["shards"][split]]).tolist()


@needs_austen
@pytest.mark.parametrize("name", ["bytes", "gpt2"])
def test_prepare_austen(tmp_path, monkeypatch, name, capsys):
    """Three shortened novels: validation is exactly the first (sorted) document plus EOT, train is
    the other two each followed by EOT, spread over several shards; a re-run touches nothing."""
    tok = tokenizer(name, monkeypatch)
    src = tmp_path / "src"
    src.mkdir()
    docs = []
    for f in ["persuasion.txt", "emma.txt", "northanger_abbey.txt"]:
        docs.append((AUSTEN_DIR / f).read_text(encoding="utf-8")[:6000])
        (src / f).write_text(docs[-1], encoding="utf-8")
    docs = [docs[1], docs[2], docs[0]]  # sorted by file name: emma, northanger, persuasion
    out = tmp_path / "out"
    meta = data.prepare(str(src), out, name, val_tokens=10, shard_tokens=1000)
    enc = [ids + [tok.eot] for ids in tok.encode_batch(docs)]
    assert split_tokens(out, "val") == enc[0]
    assert split_tokens(out, "train") == enc[1] + enc[2]
    assert len(meta["shards"]["train"]) > 1 and all(s["tokens"] <= 1000 for s in meta["shards"]["train"])
    assert split_tokens(out, "train").count(tok.eot) == 2 and tok.decode(split_tokens(out, "val")[:-1]) == docs[0]

    stamps = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    capsys.readouterr()
    assert data.prepare(str(src), out, name, val_tokens=10, shard_tokens=1000) == meta
    assert "reusing" in capsys.readouterr().out
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == stamps
    # other settings rebuild (and leave no stale shard behind), and so does a damaged shard
    data.prepare(str(src), out, name, val_tokens=10, shard_tokens=10**6)
    assert sorted(f.name for f in out.iterdir()) == ["meta.json", "train_000000.bin", "val_000000.bin"]
    (out / "train_000000.bin").write_bytes(b"junk")
    data.prepare(str(src), out, name, val_tokens=10, shard_tokens=10**6)
    assert split_tokens(out, "train") == enc[1] + enc[2]


@pytest.mark.parametrize("val_tokens, n_val", [(None, 100), (37, 37)])
def test_a_single_text_file_is_split_by_tokens(tmp_path, capsys, val_tokens, n_val):
    """One .txt file is one document, which a split by documents gives whole to validation: it is split by tokens
    instead, the last val_tokens (default: the less of 100k and 10%, printed) for validation, the rest for train;
    together they are the file's tokens, in order. A val_tokens that leaves no train token names the caller's flag."""
    text = ("To be, or not to be, that is the question:\n" * 24)[:999]  # 999 bytes, + EOT = 1000 tokens
    (tmp_path / "input.txt").write_text(text)
    out = tmp_path / "out"
    meta = data.prepare(str(tmp_path / "input.txt"), out, "bytes", val_tokens=val_tokens, shard_tokens=300)
    assert f"the last {n_val:,} of 1,000 tokens ({n_val / 10:.1f}%) are validation" in capsys.readouterr().out
    train, val = split_tokens(out, "train"), split_tokens(out, "val")
    assert (len(train), len(val), meta["split"]) == (1000 - n_val, n_val, "tokens")
    assert train + val == list(text.encode()) + [256]
    assert max(s["tokens"] for s in meta["shards"]["train"]) == 300  # shard_tokens still holds
    with pytest.raises(DataError, match=r"^validation \(--val-size 1,000\) would take all 1,000 tokens.*--val-size$"):
        data.prepare(str(tmp_path / "input.txt"), out, "bytes", val_tokens=1000, val_flag="--val-size")


def test_prepare_jsonl_parquet_and_max_tokens(tmp_path):
    """Rows of .jsonl and .parquet are documents; --max-tokens cuts the stream exactly."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    pq.write_table(pa.table({"text": ["three", "four"]}), tmp_path / "b.parquet")
    out = tmp_path / "out"
    data.prepare(str(tmp_path / "*"), out, "bytes", val_tokens=1)
    tok = data.ByteTokenizer()
    assert tok.decode(split_tokens(out, "val")) == "one"
    train = split_tokens(out, "train")
    assert train.count(256) == 3 and tok.decode(train) == "twothreefour"
    data.prepare(str(tmp_path / "*"), out, "bytes", val_tokens=1, max_tokens=9)
    assert len(split_tokens(out, "val") + split_tokens(out, "train")) == 9
    with pytest.raises(DataError, match=r"validation \(--val-tokens 1,000,000\) would take all 19 tokens"):
        data.prepare(str(tmp_path / "*"), out, "bytes", val_tokens=10**6)
    assert not list(out.iterdir())  # the failed set's shards are gone: a folder without meta.json is never read
    with pytest.raises(DataError, match="no field 'body'"):
        data.prepare(str(tmp_path / "a.jsonl"), out, "bytes", text_field="body")


# -----------------------------------------------------------------------------
# the synthetic task

def compose(p, q):
    """Independent of data.py: apply p, then q."""
    return tuple(q[p[i]] for i in range(len(p)))


@pytest.mark.parametrize("group, k", [("s4", 4), ("s5", 3), ("s4", 1), ("s3", 4)])
def test_synthetic_answers_and_levels(group, k):
    """Replay each sequence with our own permutations: every answer is previous·e1·…·eg, its level is
    g in 1..k, every other token has level -1, and every level 1..k occurs."""
    task = SyntheticTask(max_gap=k, group=group)
    perms = sorted(itertools.permutations(range(int(group[1]))))
    seen = set()
    for i in range(20):
        tokens, levels = task.sequence("train", i, 200)
        assert len(tokens) == len(levels) == 200 and tokens[0] == task.eq
        state, gap, t = perms[tokens[1]], 0, 2
        assert levels[:2] == [-1, -1]
        while t < 200:
            if tokens[t] == task.eq:
                assert 1 <= gap <= k and levels[t] == -1
                if t + 1 < 200:
                    assert perms[tokens[t + 1]] == state and levels[t + 1] == gap
                    seen.add(gap)
                gap, t = 0, t + 2
            else:
                state, gap, t = compose(state, perms[tokens[t]]), gap + 1, t + 1
                assert levels[t - 1] == -1 and gap <= k
    assert seen == set(range(1, k + 1))


def test_answers_only_task_is_the_same_task_with_own_answer_ids():
    """answers_only drops the "=" before each answer and gives answers ids of their own (eq+1+a): with
    those two changes undone, it is the shared-id task's sequence, with the same levels; answers are
    exactly the loader's targets, everything else is -1."""
    plain, own = SyntheticTask(max_gap=4), SyntheticTask(max_gap=4, answers_only=True)
    assert (plain.vocab_size, own.vocab_size) == (25, 49)
    for i in range(10):
        (a, la), (b, lb) = plain.sequence("val", i, 120), own.sequence("val", i, 120)
        kept = [(t, l) for j, (t, l) in enumerate(zip(a, la)) if j == 0 or t != plain.eq]  # the start "=" stays
        undone = [(t - own.answer_offset if l > 0 else t, l) for t, l in zip(b, lb)]
        assert undone[:len(kept)] == kept and len(kept) < 120
        assert all((t > own.eq) == (l > 0) for t, l in zip(b, lb))
    x, y, level = BatchLoader(own, "train", 8, 64).get_batch(0, 0)
    assert torch.equal(y >= 0, level > 0) and bool((y[level > 0] > own.eq).all())
    assert torch.equal(x[:, 1:], torch.where(y[:, :-1] >= 0, y[:, :-1], x[:, 1:]))  # y is x shifted, answers kept


def test_answers_only_inputs_keep_every_token_at_batch_one():
    """At micro-batch 1 the inputs and targets are separate tensors: masking the targets (-1) leaves every input a
    token (a contiguous() view of a one-row batch aliased them, so the inputs got -1s too)."""
    own = SyntheticTask(max_gap=4, answers_only=True)
    (x1, y1, _), (x8, y8, _) = (BatchLoader(own, "train", B, 64, global_batch=8).get_batch(0, 0) for B in (1, 8))
    assert bool((y1 == -1).any()) and bool((x1 >= 0).all())
    assert torch.equal(x1, x8[:1]) and torch.equal(y1, y8[:1])


def test_synthetic_splits_disjoint_and_deterministic():
    task = SyntheticTask(max_gap=4)
    train = {tuple(task.sequence("train", i, 64)[0]) for i in range(300)}
    val = {tuple(task.sequence("val", i, 64)[0]) for i in range(300)}
    assert len(train) == len(val) == 300 and not train & val
    assert task.sequence("val", 7, 64) == SyntheticTask(max_gap=4).sequence("val", 7, 64)
    assert task.sequence("val", 7, 64) != task.sequence("val", 7, 64, seed=1)


def oracle_loss(task, tokens):
    """The loss of the best possible predictor on each target, worked out from the tokens alone."""
    k, G = task.max_gap, task.eq
    losses, gap = [math.log(G)], 0  # target 0 is the uniform start a0
    for t in range(1, len(tokens) - 1):
        if tokens[t] == G:  # a closing "=": the answer is determined
            losses.append(0.0)
        elif tokens[t - 1] == G:  # a0 or an answer: a uniform element follows
            gap = 0
            losses.append(math.log(G))
        else:  # the gap-th element: "=" with the hazard of a uniform gap, else a uniform element
            gap += 1
            h = 1 / (k - gap + 1)
            losses.append(-math.log(h if tokens[t + 1] == G else (1 - h) / G))
    return losses


def test_loss_floor_matches_the_oracle_and_the_formula():
    """The oracle's mean loss on generated sequences agrees with loss_floor(T) (so the floor describes
    what the generator really does), and the long-sequence limit is the closed form in the docstring."""
    task, T = SyntheticTask(max_gap=4), 64
    losses = [l for i in range(400) for l in oracle_loss(task, task.sequence("train", i, T + 1)[0])]
    assert len(losses) == 400 * T
    assert abs(np.mean(losses) - task.loss_floor(T)) < 0.03
    assert abs(task.loss_floor(10**5) - task.loss_floor()) < 1e-4
    assert abs(task.loss_floor() - 2.0737) < 1e-4  # the number quoted in the docstring
    assert task.loss_floor(T) > task.loss_floor() > 0  # the uniform start makes short sequences dearer


@pytest.mark.parametrize("k, T", [(1, 7), (3, 12), (4, 9)])
def test_loss_floor_exact_by_enumerating_gaps(k, T):
    """Exactly: average over every equally likely list of gaps the entropy of each of the T targets,
    which depends only on the token before it (start, a0, answer: ln|G|; j-th element: the
    "=" hazard; closing "=": 0)."""
    task = SyntheticTask(max_gap=k)
    G = task.eq

    def entropy_after(j):  # after the j-th element of a segment
        h = 1 / (k - j + 1)
        return 0.0 if h == 1 else -h * math.log(h) - (1 - h) * math.log((1 - h) / G)

    paths = list(itertools.product(range(1, k + 1), repeat=T // 3 + 1))  # enough segments to fill T targets
    total = 0.0
    for gaps in paths:
        costs = [math.log(G), math.log(G)]  # after the opening "=" and after a0
        for g in gaps:
            costs += [entropy_after(j) for j in range(1, g + 1)] + [0.0, math.log(G)]
        total += sum(costs[:T]) / T
    assert abs(total / len(paths) - task.loss_floor(T)) < 1e-9


# -----------------------------------------------------------------------------
# the batch loader

@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    """A small byte-level shard folder (bytes tokenizer: no download needed)."""
    src = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    for i in range(3):
        (src / f"doc{i}.txt").write_text("".join(rng.choice(list("abcdefgh "), 3000)))
    out = tmp_path_factory.mktemp("shards")
    data.prepare(str(src), out, "bytes", val_tokens=100, shard_tokens=1500)
    return out


@pytest.fixture(params=["synthetic", "shards"])
def source(request, shard_dir):
    return SyntheticTask(max_gap=3) if request.param == "synthetic" else shard_dir


def global_batch_rows(source, step, world_size, B=2, G=8, T=16):
    """The rows of one optimizer step as read by all ranks, in slot order, and the per-rank sets."""
    loaders = [BatchLoader(source, "train", B, T, G, rank=r, world_size=world_size) for r in range(world_size)]
    slots, per_rank = [], []
    for m in range(loaders[0].accum_steps):
        for ld in loaders:
            x, y, level = ld.get_batch(step, m)
            assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])
            slots.append(torch.cat([x, y[:, -1:]], 1))
    for r in range(world_size):
        per_rank.append({tuple(row) for m in range(loaders[0].accum_steps)
                         for row in slots[m * world_size + r].tolist()})
    return torch.cat(slots), per_rank


def test_rank_slices_are_disjoint_and_add_up_to_the_global_batch(source):
    for step in (0, 5):
        single, _ = global_batch_rows(source, step, world_size=1)
        for world in (2, 4):
            rows, per_rank = global_batch_rows(source, step, world)
            assert torch.equal(rows, single)  # the same global batch in the same order, whatever the world size
            assert all(not a & b for a, b in itertools.combinations(per_rank, 2))
    assert not torch.equal(global_batch_rows(source, 0, 1)[0], global_batch_rows(source, 1, 1)[0])


def test_resume_gives_the_exact_next_batch(source):
    a = BatchLoader(source, "train", 2, 16, global_batch=6)
    for _ in range(4):
        a.next_batch()
    state = a.state_dict()
    assert state == {"step": 1, "micro_step": 1}  # 4 micro-steps, 3 per step
    b = BatchLoader(source, "train", 2, 16, global_batch=6)
    b.load_state_dict(state)
    for _ in range(4):  # crosses a step boundary
        (xa, ya, la), (xb, yb, lb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and (la is lb is None or torch.equal(la, lb))


def test_synthetic_level_marks_answer_targets():
    task = SyntheticTask(max_gap=4)
    x, y, level = BatchLoader(task, "val", 4, 64).get_batch(0, 0)
    answer = (x == task.eq) & (torch.arange(64) > 0)  # after a closing "=", i.e. not the opening one
    assert torch.equal(level >= 1, answer) and bool((level[~answer] == -1).all()) and level.max() <= 4
    assert bool((y[answer] < task.eq).all())


def test_answer_metrics_count_answers_per_level():
    """Perfect logits: accuracy 1 and ~0 loss on every level; uniform logits: loss ln(V) and the
    counts are the number of answer targets of each level; non-answer targets never count."""
    task = SyntheticTask(max_gap=3)
    x, y, level = BatchLoader(task, "train", 4, 64).get_batch(0, 0)
    V = data.padded_vocab_size(task.vocab_size)
    counts = torch.tensor([(level == g).sum().item() for g in (1, 2, 3)], dtype=torch.float)
    perfect = answer_metrics(20 * torch.nn.functional.one_hot(y, V).float(), y, level, 3)
    assert torch.equal(perfect[:, 2], counts) and torch.equal(perfect[:, 1], counts) and perfect[:, 0].max() < 1e-3
    uniform = answer_metrics(torch.zeros(4, 64, V), y, level, 3)
    assert torch.allclose(uniform[:, 0] / uniform[:, 2], torch.full((3,), math.log(V)))
    wrong_elsewhere = 20 * torch.nn.functional.one_hot(torch.where(level > 0, y, (y + 1) % V), V).float()
    assert torch.equal(answer_metrics(wrong_elsewhere, y, level, 3)[:, 1], counts)


def test_real_data_order(shard_dir):
    """Train visits every window once per epoch, in a shuffled order that changes each epoch; val
    reads in order; level is None; a window can straddle two shard files."""
    T = 50
    train = BatchLoader(shard_dir, "train", 1, T)
    n, stream = train.n_windows, train.stream
    in_order = [tuple(stream.read(w * T, T + 1)) for w in range(n)]
    epochs = [[tuple(train.get_batch(g, 0)[0][0].tolist() + [train.get_batch(g, 0)[1][0, -1].item()])
               for g in range(e * n, e * n + n)] for e in (0, 1)]
    assert all(sorted(ep) == sorted(in_order) and ep != in_order for ep in epochs) and epochs[0] != epochs[1]
    flat = np.concatenate([data.read_shard(shard_dir / s["file"]) for s in stream.meta["shards"]["train"]])
    assert len(stream.shards) > 1 and stream.read(1450, 101).tolist() == flat[1450:1551].tolist()
    val = BatchLoader(shard_dir, "val", 1, T)
    x, y, level = val.get_batch(1, 0)
    assert level is None and x[0].tolist() == val.stream.read(T, T).tolist()


# -----------------------------------------------------------------------------
# reads at the edges: shard boundaries, the first and the last window (issue 44)

def shard_folder(folder, split_sizes):
    """A shard folder whose split s holds files of the given sizes; token t of a split (counted across its files)
    is 100 + t, so every expected read below is written as the range it must be."""
    folder.mkdir(parents=True)
    shards = {}
    for split, sizes in split_sizes.items():
        shards[split], start = [], 0
        for k, n in enumerate(sizes):
            name = f"{split}_{k:06d}.bin"
            data.write_shard(folder / name, np.arange(100 + start, 100 + start + n), 257, 256)
            shards[split].append({"file": name, "tokens": n})
            start += n
    (folder / "meta.json").write_text(json.dumps({"config": {"vocab_size": 257}, "shards": shards, "n_tokens": 0}))
    return folder


@pytest.mark.parametrize("sizes", [[5, 3, 7], [5, 0, 3, 7]], ids=["three files", "an empty file between"])
def test_shard_reads_that_start_or_end_on_a_boundary(tmp_path, sizes):
    """ShardStream.read(start, n) is tokens [start, start + n) of the split, also when start or start + n is exactly
    where a file begins or ends (0, 5, 8, 15), a read is exactly one file, or crosses two or three."""
    stream = data.ShardStream(shard_folder(tmp_path / "s", {"train": sizes, "val": [4]}), "train")
    assert len(stream) == 15
    assert stream.read(0, 5).tolist() == [100, 101, 102, 103, 104]          # exactly the first file
    assert stream.read(5, 3).tolist() == [105, 106, 107]                    # exactly the second, from its first token
    assert stream.read(8, 7).tolist() == [108, 109, 110, 111, 112, 113, 114]  # the last file, to the split's end
    assert stream.read(4, 2).tolist() == [104, 105]                         # across the first boundary
    assert stream.read(0, 1).tolist() == [100] and stream.read(14, 1).tolist() == [114]
    assert stream.read(0, 15).tolist() == list(range(100, 115))             # every file
    for start in range(15):
        for n in range(1, 16 - start):
            assert stream.read(start, n).tolist() == list(range(100 + start, 100 + start + n)), (start, n)
    assert stream.read(3, 9).dtype == np.int64


@pytest.mark.parametrize("sizes, n_windows", [([4, 4, 5], 3), ([4, 4, 4], 2)], ids=["4k+1 tokens", "4k tokens"])
def test_loader_windows_at_the_first_and_last_token(tmp_path, sizes, n_windows):
    """Windows of T + 1 = 5 tokens start at multiples of T = 4, so with files of 4 tokens each window begins on a
    file boundary and ends one token into the next file. 13 tokens hold 3 windows, the last ending on the split's
    last token; 12 tokens hold only 2 (a third would need token 12). Val reads them in order, then wraps."""
    folder = shard_folder(tmp_path / "s", {"train": sizes, "val": sizes})
    val = BatchLoader(folder, "val", batch_size=n_windows, seq_len=4)
    assert val.n_windows == n_windows
    x, y, level = val.get_batch(0, 0)
    windows = [[100, 101, 102, 103, 104], [104, 105, 106, 107, 108], [108, 109, 110, 111, 112]][:n_windows]
    assert x.tolist() == [w[:4] for w in windows] and y.tolist() == [w[1:] for w in windows] and level is None
    x2, _, _ = val.get_batch(1, 0)                      # global sequences n .. 2n - 1: the same windows again
    assert x2.tolist() == x.tolist()
    train = BatchLoader(folder, "train", batch_size=1, seq_len=4)
    seen = sorted(tuple(train.get_batch(g, 0)[0][0].tolist()) for g in range(n_windows))
    assert seen == sorted(tuple(w[:4]) for w in windows)   # an epoch of train visits each window once


def test_token_windows_stay_inside_one_file_and_never_reach_its_end(tmp_path):
    """The release's rule: a file is drawn with probability proportional to len - T (a file of exactly T tokens
    never), and the start is uniform in [0, len - T): with T = 8, file a (8 tokens) is never read, file b (9) only
    as b[0:8], file c (11) from starts 0, 1 and 2 but never 3, whose window would end on c's last token."""
    from depthbench.evaluation import windows
    T, paths = 8, []
    for name, first, n in (("a", 0, 8), ("b", 1000, 9), ("c", 2000, 11)):
        np.save(tmp_path / f"{name}.npy", np.arange(first, first + n, dtype=np.uint16))
        paths.append(tmp_path / f"{name}.npy")
    got = windows.token_windows(paths, 400, T, seed=0)
    assert got.shape == (400, T) and got.dtype == torch.int64
    starts = [int(w[0]) for w in got]
    assert all(w.tolist() == list(range(int(w[0]), int(w[0]) + T)) for w in got)   # contiguous: one file each
    assert not any(s < 1000 for s in starts)                                         # a: never
    assert {s for s in starts if s < 2000} == {1000}                                  # b: its only window
    assert {s for s in starts if s >= 2000} == {2000, 2001, 2002}                     # c: 0, 1, 2, never 3
    share_b = sum(s < 2000 for s in starts) / len(starts)                             # p(b) = 1 / (1 + 3)
    assert 0.18 < share_b < 0.32


def test_text_windows_reach_the_last_token(tmp_path):
    """Random windows of text: one document of T bytes is T + 1 tokens with its EOT, so a window starts at 0 or 1,
    and both are drawn (the second ends on the EOT); a shorter text is repeated until a window fits."""
    from depthbench.evaluation import windows
    T = 6
    (tmp_path / "a.txt").write_text("abcdef")
    x, _ = windows.text_windows(str(tmp_path / "a.txt"), data.ByteTokenizer(), N=64, T=T, seed=0)
    assert {tuple(w) for w in x.tolist()} == {(97, 98, 99, 100, 101, 102), (98, 99, 100, 101, 102, 256)}
    (tmp_path / "a.txt").write_text("ab")
    x, _ = windows.text_windows(str(tmp_path / "a.txt"), data.ByteTokenizer(), N=8, T=T, seed=0)
    assert x.shape == (8, T) and set(x.flatten().tolist()) == {97, 98, 256}


# -----------------------------------------------------------------------------
# command line (in-process: data.main(argv))

def test_cli_show_synthetic(capsys):
    data.main(["--source", "synthetic", "--max-gap", "4", "--show", "3", "--seq-len", "40"])
    out = capsys.readouterr().out
    assert out.count("val sequence") == 3 and "2.0737" in out and "vocab 25" in out


def test_cli_prepare_prints_counts(tmp_path, capsys):
    for i in range(2):
        (tmp_path / f"{i}.txt").write_text(f"document {i} " * 50)
    data.main(["--source", str(tmp_path / "*.txt"), "--tokenizer", "bytes", "--out", str(tmp_path / "o"),
               "--val-tokens", "1", "--show", "1", "--seq-len", "20"])
    out = capsys.readouterr().out
    assert "val_000000.bin: 551 tokens" in out and "train_000000.bin: 551 tokens" in out  # 50 * 11 bytes + EOT
    assert "document 1" in out.split("validation")[1]  # the shown sequence comes from train


@pytest.mark.parametrize("argv", [["--source", "synthetic", "--max-gap", "0"], ["--source", "a.txt"],
                                  ["--source", "synthetic", "--group", "s6"],
                                  ["--source", "/no/such/*.txt", "--out", "o", "--tokenizer", "bytes"]])
def test_cli_bad_arguments_exit_2_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        data.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("data.py: error:")


def test_austen_download_cuts_the_licence_and_never_leaves_half_a_novel(tmp_path, monkeypatch):
    """`--source austen` fetches each novel once from Project Gutenberg (faked here: no network), keeps
    only the book between the START/END lines, and a failed fetch leaves no file behind for that novel."""
    import io
    import urllib.request
    fetched, broken = [], {"persuasion"}

    def fake_urlopen(url, timeout):
        number = int(url.rsplit("pg", 1)[1].split(".")[0])
        name = {n: k for k, n in data.AUSTEN.items()}[number]
        fetched.append(name)
        if name in broken:
            raise OSError("connection reset")
        body = f"\ufeffThe Project Gutenberg eBook\n*** START OF THE PROJECT GUTENBERG EBOOK {name} ***\n{name} text\n" \
               f"*** END OF THE PROJECT GUTENBERG EBOOK ***\nlicence\n"
        return io.BytesIO(body.encode("utf-8"))

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    folder = tmp_path / "austen_txt"
    with pytest.raises(DataError, match="cannot download .*pg105.txt"):
        data.download_austen(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["emma.txt", "mansfield_park.txt", "northanger_abbey.txt"]
    assert (folder / "emma.txt").read_text() == "emma text\n"
    broken.clear()
    fetched.clear()
    assert data.download_austen(folder) == folder
    assert fetched == ["persuasion", "pride_and_prejudice", "sense_and_sensibility"]  # the rest were kept
    assert len(list(folder.glob("*.txt"))) == 6 and not list(folder.glob("*.tmp"))
