"""
Calibration windows for diagnose.py (docs/diagnostics.md#setup): the release's rule for pre-tokenized token shards
(`--token-data-glob`), and random windows of text files. Windows carry T tokens; `shifted` gives their targets.
"""
import math
import random

import numpy as np
import torch

import data


def token_windows(paths, num_samples, seq_len, seed):
    """The release's rule for token shards (.npy; a raw uint16 file also reads): file f is drawn with probability
    proportional to its usable length max(0, len_f - T), every draw first, with numpy's default_rng(seed); then, per
    drawn file in order, a start uniform in [0, len_f - T) -> (num_samples, T) int64 windows."""
    arrays = []
    for path in paths:
        try:
            arrays.append(np.load(path, mmap_mode="r").reshape(-1))
        except ValueError:
            arrays.append(np.memmap(path, mode="r", dtype=np.uint16).reshape(-1))
    usable = np.asarray([max(0, len(a) - seq_len) for a in arrays], dtype=np.float64)
    if usable.sum() <= 0:
        raise data.DataError(f"token shards are all shorter than a window of {seq_len} tokens")
    rng = np.random.default_rng(seed)
    files = rng.choice(len(arrays), size=num_samples, p=usable / usable.sum())
    windows = []
    for f in files:
        a = arrays[int(f)]
        start = int(rng.integers(0, len(a) - seq_len))
        windows.append(np.asarray(a[start:start + seq_len], dtype=np.int64))
    return torch.from_numpy(np.stack(windows))


def text_windows(src, tok, N, T, seed):
    """N random windows of T tokens of text files (documents joined with EOS; too short: repeated)."""
    docs = (d for f in data.list_files(src) for d in data.file_documents(f, "text"))
    ids = [t for doc in data.tokenize_documents(docs, tok) for t in doc]
    if len(ids) < 2:
        raise data.DataError(f"{src}: no text to calibrate on")
    ids = ids * math.ceil((T + 1) / len(ids))
    rng = random.Random(seed)
    x = torch.tensor([ids[s:s + T] for s in (rng.randint(0, len(ids) - T) for _ in range(N))])
    return x, f"{src} ({len(ids)} {tok.name} tokens), {N} random windows, seed {seed}"


def shifted(x):
    """Targets of windows that carry no extra token: x shifted by one, the last position no target (-1)."""
    return torch.cat([x[:, 1:], torch.full((x.shape[0], 1), -1)], 1)
