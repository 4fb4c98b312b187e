"""
What every script shares, in one place: the one-line-error parser and its argument types, atomic writes,
checkpoints, the run folder's lock, rank-0 printing, the device choice and the network probe. No torch at module
level: plot.py imports this and must run (and start fast) without it.
"""
import argparse
import atexit
import contextlib
import errno
import json
import math
import os
import re
import signal
import sys
from pathlib import Path


# ----------------------------------------------------------------------------- command line

class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, where a help text may hold a plain % (text built from data: "the last 20% of the steps"):
    argparse expands each help with `%`, so a lone % would end --help in a TypeError. Only `%(name)s` and `%%` are
    argparse's; any other % is escaped here, in the one place every help text passes through."""

    def _get_help_string(self, action):
        return re.sub(r"%(\(\w+\)[-#0 +]*\d*(?:\.\d+)?[a-zA-Z]|%)?",
                      lambda m: m.group(0) if m.group(1) else "%%", action.help or "")


class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit code 2 (no usage dump); every script uses it. Its help
    may hold a plain % (HelpFormatter)."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        if not issubclass(formatter_class, HelpFormatter):  # argparse's RawDescriptionHelpFormatter: and ours
            formatter_class = type(formatter_class.__name__, (HelpFormatter, formatter_class), {})
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def given(self, args):
        """The options the command line set (a value other than its default), each by its first name ('--json'), in
        the parser's order: what a check that an option applies looks at."""
        out = []
        for action in self._actions:
            if not action.option_strings or action.dest == argparse.SUPPRESS:
                continue
            default = action.default
            if isinstance(default, str) and action.type is not None:  # argparse reads a text default by its type
                try:
                    default = action.type(default)
                except ValueError:
                    pass
            if getattr(args, action.dest, default) != default:
                out.append(action.option_strings[0])
        return out

    def refuse_beside(self, given, mode, applies):
        """One line and exit 2 naming every option in `given` (self.given's) that `mode` (an option, like
        '--bench') does not use: the ones outside `applies`."""
        unused = [o for o in given if o not in applies and o != mode]
        if unused:
            verb = "does" if len(unused) == 1 else "do"
            self.error(f"{', '.join(unused)} {verb} not apply to {mode} (it takes {', '.join(applies)})")

    def add_kernels(self):
        """--kernels, the switch of every script that builds a model (GPTConfig.kernels)."""
        self.add_argument("--kernels", default="fast", choices=["fast", "reference", "triton"], help="fast: ops.py's "
                          "functions run their depthbench/kernels/cpu.py bodies (default; on CUDA with triton: triton's); "
                          "reference: ops.py's plain PyTorch, the same maths; triton: fast with depthbench/kernels' Triton bodies")


def positive(kind=int, zero=False, below=math.inf, name=None):
    """argparse type: a finite number of `kind` > 0 (>= 0 with zero) and < below; nan and inf are refused too
    (argparse turns the ValueError into a one-line error, `invalid <name> value: '1e30'`). name: what the value is,
    saying its bound (argparse's message names only the type)."""
    def parse(text):
        value = kind(text)
        if not ((value >= 0) if zero else (value > 0)) or not value < below:
            raise ValueError(text)
        return value
    parse.__name__ = name or f"{'non-negative' if zero else 'positive'} {kind.__name__}"
    return parse


seed_number = positive(int, zero=True, below=2**63, name="seed (an int from 0 to 2^63 - 1)")  # every --seed's


def comma_list(kind, empty=False):
    """argparse type of every comma list in the project: '2e-3, 1e-2' -> [0.002, 0.01], each item stripped and
    read by `kind`, repeats dropped (each list makes a grid axis). An empty item ('92,,9.1', 'preln,') is refused;
    so is an empty list unless `empty` allows '' for [] (the caller says what an empty list means)."""
    def parse(text):
        if empty and not text.strip():
            return []
        items = [t.strip() for t in text.split(",")]
        if not all(items):
            raise ValueError(text)
        return list(dict.fromkeys(kind(t) for t in items))
    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse


VAL_SEED = 1337  # the seed of what every run is scored on (synthetic validation sequences, calibration windows) and
#                  of a data stream nobody seeded: one number, so every design and seed is measured on the same set


def format_lr(lr):
    """2e-3 -> '2e-3', 1.5e-3 -> '1.5e-3' (for run names)."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def duration(seconds):
    """A time span to read at a glance: '4.2 s', '42 s', '12.5 min', '3.2 h'."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def json_object(text):
    """argparse type: a JSON object, e.g. --residual-args '{"n_groups": 4}' (a design's `options`). Anything else is
    argparse's one line, saying why without echoing the text (it may be 200,000 brackets)."""
    try:
        value = parse_json(text, "the option")
    except JsonError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.cause})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{json_name(value)}, not a JSON object like '{{\"n_groups\": 4}}'")
    return value


def print0(*a, **kw):
    """print, flushed, from rank 0 only (torchrun sets RANK; a plain process is rank 0, and so is one whose RANK is
    no number: it prints the line that refuses it, depthbench/training/distributed.py's launcher_ranks)."""
    try:
        rank = int(os.environ.get("RANK", 0))
    except ValueError:
        rank = 0
    if rank == 0:
        print(*a, **kw, flush=True)


def fail(prog, message, code=2):
    """Bad input: one line on stderr (from rank 0) and exit code 2 (or `code`: 1 for a command that failed)."""
    print0(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(code)


def first_line(e, width=200):
    """The first line of an exception's message, at most `width` characters (None: all of it). A longer one is cut
    at the end of a word and marked with ' ...', never in the middle of a word or a name."""
    line = (str(e).splitlines() or [""])[0]
    if width is None or len(line) <= width:
        return line
    cut = line[:width - 4]
    if line[width - 4] != " " and " " in cut:
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip() + " ..."


def design_options(name, given=None):
    """Design `name`'s constructor options: its declared defaults (`options`), overridden by the keys of
    `given` that it declares (a grid's --residual-args may hold options of its other designs). A value of
    another type than the default's, or a count below 1, is a ValueError."""
    from residuals import RESIDUALS  # here, not at the top: plot.py imports this module without torch
    opts = {k: (given or {}).get(k, v) for k, v in RESIDUALS[name].options.items()}
    for k, v in opts.items():
        default = RESIDUALS[name].options[k]
        if default is None:  # an option that is off unless given (Block AttnRes' block_size): a count, or null
            if not (v is None or (type(v) is int and v >= 1)):
                raise ValueError(f"{name}: option {k} must be a positive int or null, got {v!r}")
            continue
        want = type(default)
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
        raise ValueError(f"no design of {', '.join(names)} has an option {unknown[0]!r} (theirs: {declared or 'none'})")
    for name in names:
        design_options(name, given)


# ----------------------------------------------------------------------------- faults: one line, not a traceback

# the OS failures a user fixes (a full disk or quota, a file-size limit, a read-only or forbidden place, a file where
# a folder should be, a folder where a file should be, a failing disk): one line naming the path, never a traceback
FS_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
             errno.EEXIST, errno.EISDIR, errno.ENAMETOOLONG, errno.EIO}


class WriteError(OSError):
    """A write of `filename` that failed for an OS reason; str() is one line naming the path and the cause."""

    def __str__(self):
        return f"cannot write {self.filename}: {why_failed(self, self.filename)}"


def os_error(e):
    """The OSError e is, or the one behind a RuntimeError (torch's zip writer raises `RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos` after the OSError of a full disk), else None."""
    for _ in range(8):  # a chain of a few RuntimeErrors at most
        if not isinstance(e, RuntimeError):
            break
        e = e.__cause__ or e.__context__
    return e if isinstance(e, OSError) and e.errno is not None else None


def why_failed(e, path):
    """The cause of OSError e at path, in words: for a file in the way (ENOTDIR, EEXIST), which one."""
    code = errno.errorcode.get(e.errno, str(e.errno))
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and path:
        for p in [Path(path), *Path(path).parents]:
            if p.exists() and not p.is_dir():
                return f"{p} is a file, not a folder ({code})"
    return f"{e.strerror or e} ({code})"


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or another signal that asks a script to stop), raised where the script is, like Ctrl-C's
    KeyboardInterrupt: the `finally` blocks and write_atomic's clean-up run."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def one_line_faults(prog, note="what was finished is kept; run the same command again to go on"):
    """Around a script's main: Ctrl-C (KeyboardInterrupt) and SIGTERM end it with one line and exit code 130 / 143
    (128 + the signal's number), an OS failure at a write (WriteError, or an OSError of FS_ERRNOS) with one line
    naming the path and the cause and exit code 2, never a traceback. SIGTERM raises Interrupted for the time of
    the block, so clean-ups run; the old handler is put back after. A script whose own handlers catch a signal
    for a while (train.py's loop) keeps them: they replace these while they are installed.

        if __name__ == "__main__":
            with one_line_faults("data.py"):
                main()
    """
    old = signal.getsignal(signal.SIGTERM)
    if old == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        yield
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print0(f"{prog}: interrupted ({name}); {note}", file=sys.stderr)
        sys.exit(128 + signum)
    except OSError as e:
        if not isinstance(e, WriteError) and e.errno not in FS_ERRNOS:
            raise  # not the machine's fault: a bug, and its traceback helps
        message = str(e) if isinstance(e, WriteError) else f"{e.filename or 'a file'}: {why_failed(e, e.filename)}"
        fail(prog, message)
    finally:
        if old == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, old)


def interrupt_hook(kind, value, tb, previous=sys.excepthook):
    """sys.excepthook of every script: a Ctrl-C that nothing caught, say while torch is imported (seconds), is one
    line and exit code 130, not a traceback through the import machinery. Set when this module is imported, so a
    script imports it before torch; other exceptions go to the previous hook."""
    if not issubclass(kind, KeyboardInterrupt):
        return previous(kind, value, tb)
    print(f"{Path(sys.argv[0]).name}: interrupted (Ctrl-C); run the same command again to go on", file=sys.stderr)
    atexit._run_exitfuncs()  # what a normal exit runs (multiprocessing ends its children), then the exit code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


if sys.excepthook is sys.__excepthook__:  # not in an interpreter that set its own (IPython, pytest)
    sys.excepthook = interrupt_hook


# ----------------------------------------------------------------------------- files

def write_atomic(path, content):
    """Write str, bytes, or whatever the function `content(binary_file)` writes, to a temp file of its own beside
    path (two writers never share one), fsync it, then os.replace it: a reader sees the old file or the new one,
    never half of one. On any failure (a full disk, Ctrl-C) the temp file is removed and the old file stays; an OS
    failure is raised as a WriteError naming path (also when torch's zip writer turned it into a RuntimeError)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # the temp file may never have been made (a file in the way)
            tmp.unlink(missing_ok=True)
        cause = os_error(e)
        if cause is None or isinstance(e, WriteError):
            raise
        raise WriteError(cause.errno, cause.strerror, str(path)) from e


def cannot_write(path):
    """Why no file can be written at path, checked before the work that makes it (an --out given to a script), or
    None: path is a folder, the first of its parents that exists is a file or is not writable."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a folder"
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{parent} is a file, not a folder"
            if not os.access(parent, os.W_OK):
                return f"{parent} is not writable"
            return None
    return None


class JsonError(ValueError):
    """JSON that cannot be read: str() is one line, `where` (a file, a file's line, an option): `problem` ('not JSON
    (JSONDecodeError: ...)'); `cause`, the reader's exception in words ('JSONDecodeError: ...'), or None."""

    def __init__(self, where, problem, cause=None):
        self.where, self.problem, self.cause = str(where), problem, cause
        super().__init__(f"{where}: {problem}")


def parse_json(text, where):
    """text -> its JSON value, or a JsonError naming `where`. Every JSON the project reads comes through here
    (load_json for a file): malformed JSON, and what Python's json raises past its own limits, a RecursionError for
    brackets nested deeper than the interpreter's stack (a run.json of 100,000 '[') and a ValueError for an integer
    of over 4,300 digits, all become one line. Python's json also takes the NaN/Infinity that train.py writes."""
    try:
        return json.loads(text)
    except (RecursionError, ValueError) as e:  # ValueError: json's JSONDecodeError, int()'s digit limit
        cause = f"{type(e).__name__}: {first_line(e, 120)}"
        if isinstance(e, RecursionError):
            cause = "RecursionError: nested deeper than Python's json reads"
        raise JsonError(where, f"not JSON ({cause})", cause) from None


def load_json(path):
    """The JSON value in file `path`, or a JsonError naming it (unreadable, not UTF-8, not JSON: parse_json's); a
    missing file is a FileNotFoundError, which a reader may take as 'none yet'."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise JsonError(path, f"unreadable ({getattr(e, 'strerror', None) or type(e).__name__})") from None
    return parse_json(text, path)


def json_lines(path, fields, hint=""):
    """The items of a JSON Lines file (one JSON object a line; blank lines skipped) -> [dict], each holding `fields`
    ({name: the type its value must have, a tuple of types, or None for any}); else a JsonError naming the file and the line: unreadable,
    not JSON, not an object, a field missing or of another type, or no item at all. hint: what the message adds
    after the fields an item needs (where a right file is found). Every task file is read through here."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise JsonError(path, f"unreadable ({getattr(e, 'strerror', None) or type(e).__name__})") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        item = parse_json(line, f"{path}:{n}")
        lacks = [f for f in fields if not isinstance(item, dict) or f not in item]
        if lacks:
            raise JsonError(f"{path}:{n}", f"no field {lacks[0]!r} (each item needs {', '.join(fields)}{hint})")
        for name, kind in fields.items():  # kind: a type, a tuple of types, or None
            if kind is not None and not isinstance(item[name], kind):
                wanted = " or ".join(JSON_NAMES[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
                raise JsonError(f"{path}:{n}", f"field {name!r} is {json_name(item[name])}, not {wanted}")
        items.append(item)
    if not items:
        raise JsonError(path, "no items (one JSON object per line)")
    return items


def read_json(path):
    """The JSON object in path, or None when it is missing, unreadable, not JSON or not an object."""
    try:
        obj = load_json(path)
    except (FileNotFoundError, JsonError):
        return None
    return obj if isinstance(obj, dict) else None


JSON_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "true or false", int: "an integer",
              float: "a number", type(None): "null"}


def json_name(value):
    """What a JSON value is, in words: 'a string', 'null', 'an object'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return JSON_NAMES.get(type(value), type(value).__name__)


def part_of(section, key, where):
    """A checkpoint's JSON config's sub-section section[key] (where: its file, for the message): an object, {} when
    absent or null; a value of another type is a CheckpointError naming it (read by type, never by truthiness)."""
    value = section.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: section {key!r} is {json_name(value)}, not an object")
    return value


def lock_folder(folder):
    """Lock a run folder for this process: flock on folder/.lock (made with the folder) -> the open lock file. The
    lock ends when that file is closed or the process ends, even by kill -9, so a stale lock blocks nothing; the
    holder's pid, host and command are written in it. A ValueError (one line) names the holder when another process
    has the lock, or says why the folder cannot be written (a file in the way, read-only, full)."""
    import fcntl
    import socket
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(13, "not writable")
        f = open(Path(folder) / ".lock", "a+")
    except OSError as e:
        raise ValueError(f"cannot write to {folder}: {why_failed(e, folder)}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()} ({' '.join(sys.argv)[:200]})")
        f.flush()
        os.fsync(f.fileno())
        return f
    except OSError as e:  # held by another process, or a full disk
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ValueError(f"{folder} is in use by {holder}; wait for it, or stop it" if isinstance(e, BlockingIOError)
                         else f"cannot write to {folder}: {e.strerror or e}") from None


def lock_holder(folder):
    """Who holds folder's lock (lock_folder's): the line the holder wrote (its pid, host and command), or None when no
    live process holds it. Creates nothing: a folder without a .lock is held by none."""
    import fcntl
    try:
        f = open(Path(folder) / ".lock")
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free: ours for a moment, released as the file closes
        except BlockingIOError:
            return f.read().strip() or "another process"
    return None


PR_SET_PDEATHSIG = 1  # prctl(2): the signal the kernel sends a process when its parent dies (Linux)


def end_with_parent():
    """A preexec_fn for subprocess: the child ends with this process, however this one dies (kill -9 included). On
    Linux the kernel sends the child SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), which train.py answers at
    its next micro-batch, keeping its last step's ckpt.pt; a parent that died before the child set it ends the child at once. Elsewhere the
    child outlives a killed parent (the folder locks still keep a rerun out of its files)."""
    parent = os.getpid()
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def in_the_child():
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent is gone already
            os._exit(128 + signal.SIGTERM)
    return in_the_child


def write_json(path, obj, strict=False):
    """Write JSON atomically. strict: NaN/inf become null (strict JSON)."""
    if strict:
        obj = json.loads(json.dumps(obj), parse_constant=lambda _: None)  # json writes NaN; read it back as null
    write_atomic(path, json.dumps(obj, indent=1, allow_nan=not strict))


class CheckpointError(ValueError):
    """A checkpoint we cannot load as it is; the message is one line."""


def save_checkpoint(path, obj):
    """torch.save through write_atomic: the old ckpt.pt stays whole until the new one is; a full disk is a
    WriteError (one line), not torch's `[enforce fail at inline_container.cc] unexpected pos`."""
    import torch
    write_atomic(path, lambda f: torch.save(obj, f))


def load_checkpoint(path, keys=("model", "model_config", "config")):
    """A train.py ckpt.pt, loaded weights-only onto the CPU, memory-mapped (each rank reads pages as it uses them), or
    a one-line CheckpointError: a truncated file, another program's checkpoint, or one without `keys`. Every script
    loads ckpt.pt through this."""
    import torch
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    except Exception as e:  # unpickling errors of every kind: not a (whole) checkpoint; never loaded unsafely
        if "weights_only" in str(e):
            why = f"{type(e).__name__}: it holds objects beyond tensors and plain data"
            raise CheckpointError(f"{path}: not a depthbench checkpoint ({why})") from None
        # a cut-off zip: "failed finding central directory", or (cut near its end) OSError EINVAL from mmap
        size = os.path.getsize(path)
        raise CheckpointError(f"{path} ({size:,} bytes): truncated or not a depthbench checkpoint "
                              f"({type(e).__name__}: {first_line(e, 80)})") from None
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a depthbench checkpoint (no {missing[0]!r} in it)")
    return ckpt


# ----------------------------------------------------------------------------- results

def best_lr(results):
    """The best LR of {lr: [each seed's final val loss, None (or nan) where the run diverged]}: the fewest diverged
    runs first, then the lowest mean loss of the rest. An LR that sometimes blows up does not win because its
    surviving seeds happen to be good. None when no LR has a finite loss. mini.py's sweep (one seed per LR) and
    plot.py's figures (every seed) both choose with this."""
    scored = []
    for lr, losses in results.items():
        finite = [v for v in losses if v is not None and math.isfinite(v)]
        if finite:
            scored.append((len(losses) - len(finite), sum(finite) / len(finite), lr))
    return min(scored)[2] if scored else None


# ----------------------------------------------------------------------------- machine and network

def pick_device(name="auto"):
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; a CUDA device without one is a ValueError."""
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:1, ...)") from None
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
