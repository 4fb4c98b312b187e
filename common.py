"""
What every script shares, in one place: the one-line-error parser and its argument types, atomic writes,
checkpoints, rank-0 printing, the device choice and the network probe.

No torch at module level: plot.py imports this and must run (and start fast) without it.
"""
import argparse
import json
import os
import sys
from pathlib import Path


# ----------------------------------------------------------------------------- command line

class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit code 2 (no usage dump); every script uses it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def add_kernels(self):
        """--kernels, the switch of every script that builds a model (GPTConfig.kernels)."""
        self.add_argument("--kernels", default="fast", choices=["fast", "reference"], help="fast: ops.py's functions "
                          "run their kernels.py bodies (default); reference: ops.py's plain PyTorch, the same maths")


def positive(kind=int):
    """argparse type: a number of `kind` > 0 (argparse turns the ValueError into a one-line error)."""
    def parse(text):
        if (value := kind(text)) <= 0:
            raise ValueError(text)
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def csv(kind):
    """argparse type for a comma-separated list: '2e-3,1e-2' -> [0.002, 0.01]; every list makes a grid axis."""
    def parse(text):
        return [kind(v) for v in text.split(",")]
    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse


def json_object(text):
    """argparse type: a JSON object, e.g. --residual-args '{"n_groups": 4}' (a design's `options`)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(text)
    return value


def is_rank0():
    return int(os.environ.get("RANK", 0)) == 0  # torchrun sets RANK; a plain process is rank 0


def print0(*a, **kw):
    """print, flushed, from rank 0 only."""
    if is_rank0():
        print(*a, **kw, flush=True)


def fail(prog, message):
    """Bad input: one line on stderr (from rank 0) and exit code 2."""
    if is_rank0():
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def first_line(e, width=200):
    """The first line of an exception's message, at most `width` characters."""
    return (str(e).splitlines() or [""])[0][:width]


def design_options(name, given=None):
    """Design `name`'s constructor options: its declared defaults (`options`), overridden by the keys of
    `given` that it declares (a grid's --residual-args may hold options of its other designs). A value of
    another type than the default's, or a count below 1, is a ValueError."""
    from residuals import RESIDUALS  # here, not at the top: plot.py imports this module without torch
    opts = {k: (given or {}).get(k, v) for k, v in RESIDUALS[name].options.items()}
    for k, v in opts.items():
        want = type(RESIDUALS[name].options[k])
        if type(v) is not want or (want is int and v < 1):
            raise ValueError(f"{name}: option {k} must be a{' positive' if want is int else ''} {want.__name__}, "
                             f"got {v!r}")
    return opts


def check_options(names, given):
    """ValueError unless every key of `given` is an option of one of the designs `names`, of the right type."""
    from residuals import RESIDUALS
    declared = {k: v for name in names for k, v in RESIDUALS[name].options.items()}
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise ValueError(f"no design of {', '.join(names)} has an option {unknown[0]!r} "
                         f"(theirs: {declared or 'none'})")
    for name in names:
        design_options(name, given)


# ----------------------------------------------------------------------------- files

def write_atomic(path, content):
    """Write str, bytes, or whatever the function `content(binary_file)` writes, to a temp file beside path,
    then os.replace it: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if callable(content):
            content(f)
        else:
            f.write(content.encode() if isinstance(content, str) else content)
    os.replace(tmp, path)


def write_json(path, obj, strict=False):
    """Write JSON atomically. strict: NaN/inf become null (strict JSON)."""
    if strict:
        obj = json.loads(json.dumps(obj), parse_constant=lambda _: None)  # json writes NaN; read it back as null
    write_atomic(path, json.dumps(obj, indent=1, allow_nan=not strict))


class CheckpointError(ValueError):
    """A checkpoint we cannot load as it is; the message is one line."""


def save_checkpoint(path, obj):
    import torch
    write_atomic(path, lambda f: torch.save(obj, f))


def load_checkpoint(path, keys=("model", "model_config", "config")):
    """A train.py ckpt.pt, loaded weights-only onto the CPU, memory-mapped (each rank reads pages as it uses them), or
    a one-line CheckpointError: a truncated file, another program's checkpoint, or one without `keys`. Every script
    loads ckpt.pt through this."""
    import torch
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # unpickling errors of every kind: not a (whole) checkpoint
        raise CheckpointError(f"{path}: not a depthbench checkpoint ({type(e).__name__}: {first_line(e)})") from None
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a depthbench checkpoint (no {missing[0]!r} in it)")
    return ckpt


# ----------------------------------------------------------------------------- machine and network

def pick_device(name="auto"):
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; a CUDA device without one is a ValueError."""
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}, but torch sees no CUDA device")
    return name


def unreachable(url, timeout=5.0):
    """None if `url` answers within `timeout` seconds, else why not (the exception's name). Offline,
    tiktoken hangs and `datasets`/huggingface_hub retry for half a minute, then print a traceback: ask first."""
    import requests
    try:
        requests.get(url, timeout=timeout, stream=True).close()
    except requests.RequestException as e:
        return type(e).__name__
    return None


def hub_unreachable(timeout=5.0):
    """(endpoint, why) when the HuggingFace hub does not answer, else None. Under HF_HUB_OFFLINE nothing is
    asked: the libraries then read their cache or fail at once. Sets the hub library's timeouts (read when
    it is first imported) to their defaults unless given."""
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    if os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE"):
        return None
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    why = unreachable(endpoint, timeout)
    return (endpoint, why) if why else None


def versions():
    """Provenance for a run's JSON: Python, torch and CUDA versions, and the git commit of this code."""
    import subprocess

    import torch
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    # str(): torch.__version__ is a TorchVersion, which torch.load(weights_only=True) refuses
    return {"python": sys.version.split()[0], "torch": str(torch.__version__), "cuda": torch.version.cuda,
            "git_commit": commit}
