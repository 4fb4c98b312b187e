"""
runlog.py: what a run folder's run.json holds, and the one reader of it. train.py, mini.py (with its tables),
diagnose.py and plot.py read run.json, and a checkpoint's "config", through here: every field they use has a type,
and a file where one is missing or of another type is refused in one line naming the file and the field (a
RunLogError), never trusted by truthiness ("finished": "no" is not finished; it is an error). A run folder's state
(run_state: new, partial, diverged or finished) and run.json rebuilt from ckpt.pt's log (rebuild_run_log) are here too.

RunConfig is one run's settings, resolved (depthbench/training/recipe.py makes it, run.json and ckpt.pt keep it as
"config"). Each field says what it is to the run's identity (docs/reliability.md#run-identity):

- identity: it changes what the run computes; a folder's run answers only for a command with the same value;
- precision: the device's arithmetic (dtype); part of a done run's identity, but --resume may change it;
- the rest: how a run is carried out (ranks, micro-batch, compile, kernels) or observed (logs, evals' cadence,
  checkpoints, telemetry), or where (out, data_dir): may differ, --resume may change them.

No torch here: plot.py reads run.json without it (common.design_options imports the design registry when called).
"""
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from depthbench.files.common import (JSON_NAMES, CheckpointError, JsonError, design_options, json_name, load_checkpoint,
                                     load_json, print0, write_json)

SCHEMA = "depthbench.train/1"
IDENTITY = {"identity": "always"}     # part of the run's identity
PRECISION = {"identity": "done"}      # part of a done (finished or diverged) run's identity; --resume may change it
SYNTHETIC_ONLY = ("max_gap", "group", "answers_only")  # identity of a synthetic-task run only (real data ignores them)
# design options that change memory and time, never a loss or gradient (HC/mHC's recompute, chosen by the memory
# plan: recipe.recompute_choice): no part of a run's identity, so a run resumes or is reused whichever it had
MEMORY_OPTIONS = ("recompute",)
# fields a version of train.py added later, and what an older run.json or ckpt.pt that lacks one computed
LATE_DEFAULTS = {"schedule": "cosine", "val_tokens": None, "compile_scope": "blocks"}


class RunLogError(ValueError):
    """A run.json (or a checkpoint's config) that is not what train.py writes, or has a field missing or of another
    type; str() is one line naming the file and the field."""

    def __init__(self, where, field_path, problem):
        self.where, self.field, self.problem = str(where), field_path, problem
        super().__init__(f"{where}: {self.reason}")

    @property
    def reason(self):
        """The message without the file's name: "field 'finished' is a string, not true or false"."""
        if self.field is None:
            return f"not a run log of train.py: it {self.problem}"
        return f"field {self.field!r} {self.problem}"


@dataclass
class RunConfig:
    """One run, resolved: what passes from deciding what to run (recipe.resolve) to running it (train.py). Written to
    run.json ("config") and ckpt.pt ("config") as dataclasses.asdict; from_dict reads one back. A field's metadata
    says what it is to the run's identity (the module docstring)."""
    name: str                       # the run folder's name: design, options, shape, schedule (not the default), LR, seed
    preset: str                     # cpu | mini | 400m
    suite: Optional[str]            # the paper's suite the shape comes from, or None (solved for --params)
    residual: str = field(metadata=IDENTITY)            # the design (residuals.RESIDUALS)
    residual_args: dict = field(metadata=IDENTITY)      # its constructor options, every one (defaults filled in)
    n_layer: int = field(metadata=IDENTITY)             # blocks L
    d_model: int = field(metadata=IDENTITY)             # width d
    d_ff: int = field(metadata=IDENTITY)                # the MLP's hidden width
    n_head: int = field(metadata=IDENTITY)              # query heads
    n_kv_head: int = field(metadata=IDENTITY)           # key/value heads (GQA when fewer than n_head)
    head_dim: int                   # d_model // n_head
    ar: float                       # aspect ratio d_model / n_layer
    vocab_size: int = field(metadata=IDENTITY)          # padded to a multiple of 64 (data.padded_vocab_size)
    params_budget: int              # the parameter count the shape was chosen for
    fixed: str                      # what params_budget counts: total | backbone
    lr: float = field(metadata=IDENTITY)                # peak LR
    schedule: str = field(metadata=IDENTITY)            # the LR schedule (depthbench/training/schedules.py: SCHEDULES)
    final_lr_frac: float = field(metadata=IDENTITY)     # the schedule ends at this fraction of the peak
    warmup_steps: int = field(metadata=IDENTITY)        # linear warmup: 10% of the steps
    total_steps: int = field(metadata=IDENTITY)         # length of the LR schedule
    max_steps: Optional[int]        # stop at this step, schedule unchanged (None: at total_steps)
    weight_decay: float = field(metadata=IDENTITY)      # AdamW's (a design's static params get 0)
    betas: list = field(metadata=IDENTITY)              # AdamW's (0.9, 0.95), a list as JSON keeps it
    eps: float = field(metadata=IDENTITY)               # AdamW's
    grad_clip: float = field(metadata=IDENTITY)         # global grad-norm clip (0: off)
    seed: int = field(metadata=IDENTITY)                # of the init and the train data order
    data: str = field(metadata=IDENTITY)                # synthetic | fineweb-edu | a text source
    data_dir: Optional[str]         # token shards of real data (None: synthetic)
    val_tokens: Optional[int] = field(metadata=IDENTITY)  # real data: validation tokens asked for (None: data.py's)
    tokenizer: Optional[str] = field(metadata=IDENTITY)   # gpt2 | bytes (None: synthetic)
    max_gap: int = field(metadata=IDENTITY)             # synthetic: the largest gap
    group: str = field(metadata=IDENTITY)               # synthetic: the permutation group
    answers_only: bool = field(metadata=IDENTITY)       # synthetic: answers are the only targets
    seq_len: int = field(metadata=IDENTITY)             # tokens per sequence
    batch_size: Optional[int]       # micro-batch per rank
    global_batch: int = field(metadata=IDENTITY)        # sequences per optimizer step, all ranks together
    world_size: int                 # ranks (processes) of the job
    fsdp: bool                      # FSDP2 instead of DDP (under torchrun)
    activation_checkpointing: bool  # recompute each block in the backward
    tokens_per_step: int            # global_batch * seq_len
    total_tokens: int               # total_steps * tokens_per_step
    eval_every: int                 # evaluate every this many steps and at the end
    eval_iters: int = field(metadata=IDENTITY)          # global batches of validation data per eval (the result)
    ckpt_every: int                 # write ckpt.pt every this many steps and at the end
    log_every: int                  # print a training line every this many steps
    out: str                        # root folder of the run folders
    device: str                     # cpu | cuda
    compile: bool                   # torch.compile the model
    kernels: str                    # fast | reference (depthbench/kernels/cpu.py)
    dtype: str = field(metadata=PRECISION)  # "bfloat16 autocast" (CUDA) or "float32"
    compile_scope: Optional[str] = "blocks"  # blocks: each block on its own (one graph reused); model: one graph
    stats_every: Optional[int] = None  # depthbench/training/telemetry.py: a record every this many steps and at each eval; 0: off
    log_to: Optional[str] = None    # depthbench/training/trackers.py: tensorboard | wandb mirror the log; None: run.json only
    grad_accum: Optional[int] = None  # micro-steps per optimizer step: global_batch / (batch_size * world_size)
    ar_asked: Optional[float] = None  # the --ar that solved to this shape (None: --layers, a row): figures say both

    @classmethod
    def from_dict(cls, d, where="config"):
        """A config as run.json or ckpt.pt holds it, from any version, its types checked (check_config): keys it lacks
        are None, or what the older code computed (n_kv_head: n_head, as before GQA; LATE_DEFAULTS; design options
        added since: their defaults); keys this version does not know are dropped."""
        if isinstance(d, dict) and "residual" not in d:  # the design: what its options are read by
            raise RunLogError(where, "config.residual", "is missing")
        check_config(d, where)
        values = {f.name: d.get(f.name) for f in dataclasses.fields(cls)}
        if "n_kv_head" not in d:
            values["n_kv_head"] = d.get("n_head")
        for key, default in LATE_DEFAULTS.items():
            if key not in d:
                values[key] = default
        values["residual_args"] = design_options(values["residual"], d.get("residual_args"))
        return cls(**values)

    def identity_changes(self, other, done=True):
        """The identity fields whose values differ in `other` (a RunConfig): the folder's run (self) does not answer
        for it. done: a finished or diverged run, whose precision counts too; else a run to resume or start over,
        which may change it. The synthetic task's settings count for a synthetic-task run only."""
        kinds = ("always", "done") if done else ("always",)
        keys = [f.name for f in dataclasses.fields(self) if f.metadata.get("identity") in kinds]
        if self.data != "synthetic" and other.data != "synthetic":
            keys = [k for k in keys if k not in SYNTHETIC_ONLY]
        return [k for k in keys if identity_value(self, k) != identity_value(other, k)]

    def describe_changes(self, other, keys):
        """'weight_decay 0.1 there, 0.0 here; seq_len 128 there, 64 here' for the keys identity_changes gave."""
        return "; ".join(f"{k} {getattr(self, k)!r} there, {getattr(other, k)!r} here" for k in keys)


def identity_value(cfg, key):
    """A RunConfig's field `key` as its identity compares it: the design options without MEMORY_OPTIONS."""
    value = getattr(cfg, key)
    if key == "residual_args":
        value = {k: v for k, v in value.items() if k not in MEMORY_OPTIONS}
    return value


def identity_fields(kind="always"):
    """The names of RunConfig's fields of one identity kind ('always', 'done', or None: the others), in order."""
    return [f.name for f in dataclasses.fields(RunConfig) if f.metadata.get("identity") == kind]


# ----------------------------------------------------------------------------- run.json's schema

@dataclass
class Level:
    """An eval's result at one gap of the synthetic task."""
    loss: Optional[float]          # mean answer loss at this gap
    acc: float                     # answer accuracy at this gap


@dataclass
class Step:
    """One optimizer step of "steps"."""
    step: int                      # 1-based
    loss: Optional[float] = None   # the step's training loss (null: not finite)
    lr: Optional[float] = None     # the schedule's LR at this step
    tokens: Optional[int] = None   # tokens trained on up to this step
    grad_norm: Optional[float] = None  # global gradient norm before clipping (null: not finite)
    tok_per_s: Optional[float] = None  # throughput of this step


@dataclass
class Eval:
    """One evaluation of "evals"."""
    step: int                                  # the step evaluated at
    val_loss: Optional[float] = None           # mean token loss over eval_iters global batches of validation data
    tokens: Optional[int] = None               # tokens trained on up to this step
    answer_loss: Optional[float] = None        # synthetic task: the answers' loss (null for real data)
    answer_acc: Optional[float] = None         # synthetic task: the answers' accuracy
    per_level: Optional[Dict[str, Level]] = None  # synthetic task: per gap ("1", "2", ...)


@dataclass
class Final:
    """ "final": the last eval's numbers (null before one, and when the run diverged)."""
    val_loss: Optional[float] = None
    answer_loss: Optional[float] = None
    answer_acc: Optional[float] = None


@dataclass
class Stopped:
    """ "stopped": the signal that ended the run's last session before its last step (absent otherwise)."""
    signal: str                                 # "SIGTERM" or "SIGINT"
    step: int                                   # the last completed step: ckpt.pt's (0: nothing trained)
    dropped_step: Optional[int] = None          # the step the signal cut short (gradients discarded), if one was
    micro_batches_done: Optional[int] = None    # how many of its micro-batches had run
    micro_batches: Optional[int] = None         # of how many
    after_signal: Optional[int] = None          # of those, how many ran after rank 0's signal (null: none came)


@dataclass
class TableConfig:
    """The fields of "config" every reader needs (the rest are RunConfig's, checked where present): what names a
    run in every table and figure."""
    residual: str                  # the design
    n_layer: int                   # blocks
    d_model: int                   # width
    lr: float                      # peak LR
    seed: int                      # seed


@dataclass
class RunLog:
    """run.json of train.py (schema depthbench.train/1). Fields with a default may be missing; present, they have
    their type. "config" has TableConfig's fields, and any other field RunConfig declares has its type."""
    schema: str                    # "depthbench.train/1"
    config: TableConfig            # the run's RunConfig as a dict
    steps: List[Step]              # every optimizer step taken
    evals: List[Eval]              # every evaluation
    final: Final                   # the last eval's numbers
    diverged: bool                 # the loss or gradient went non-finite: the run stopped there
    finished: bool                 # trained to total_steps, its final ckpt.pt on disk
    wall_s: float                  # seconds trained, all sessions together
    params: Optional[dict] = None  # parameter counts: total, backbone, residual_extra
    peak_mem_bytes: Optional[int] = None  # the memory peak (CUDA: allocated; CPU: RSS)
    device: Optional[str] = None   # the device's name
    versions: Optional[dict] = None    # python, torch, cuda, git commit
    telemetry: Optional[dict] = None   # depthbench/training/telemetry.py's records and the tracker's state
    stopped: Optional[Stopped] = None  # SIGINT/SIGTERM ended the last session: why and where (train.py)


# ----------------------------------------------------------------------------- checking a value against a type

def is_kind(value, kind):
    """value is a JSON value of the plain type `kind` (int: an integer, not true/false; float: any number)."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def check(value, kind, where, path):
    """value against the type hint `kind` (a plain type, Optional, List, Dict[str, X] or one of the dataclasses
    here), or a RunLogError naming where (the file) and path (the field: 'evals[0].per_level.2')."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return
        kind, origin, args = args[0], typing.get_origin(args[0]), typing.get_args(args[0])
    if dataclasses.is_dataclass(kind):
        check_object(value, kind, where, path)
        return
    plain = origin or kind
    if value is None or not is_kind(value, plain):
        raise RunLogError(where, path, f"is {json_name(value)}, not {JSON_NAMES[plain]}")
    if plain is list and args:
        for i, item in enumerate(value):
            check(item, args[0], where, f"{path}[{i}]")
    if plain is dict and args:
        for key, item in value.items():
            check(item, args[1], where, f"{path}.{key}")


def check_object(value, kind, where, path=""):
    """A JSON object against a dataclass: each field without a default present, each present field of its type."""
    if not isinstance(value, dict):
        raise RunLogError(where, path or None, f"is {json_name(value)}, not an object")
    hints = typing.get_type_hints(kind)
    for f in dataclasses.fields(kind):
        inner = f"{path}.{f.name}".lstrip(".")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name not in value:
            if required:
                raise RunLogError(where, inner, "is missing")
            continue
        check(value[f.name], hints[f.name], where, inner)


def check_config(config, where, path="config"):
    """A run's config (run.json's or a checkpoint's): each field RunConfig declares, where present, of its type."""
    if not isinstance(config, dict):
        raise RunLogError(where, path, f"is {json_name(config)}, not an object")
    hints = typing.get_type_hints(RunConfig)
    for name, kind in hints.items():
        if name in config:
            check(config[name], kind, where, f"{path}.{name}")


def check_run_log(obj, where):
    """A run.json's content -> the same dict, every field a reader uses of its type (RunLog), or a RunLogError."""
    check_object(obj, RunLog, where)
    if obj["schema"] != SCHEMA:
        raise RunLogError(where, "schema", f"is {obj['schema']!r}, not {SCHEMA!r}")
    check_config(obj["config"], where)
    return obj


def problem(obj):
    """Why a run.json's content cannot be read (RunLogError.reason, without a file's name), or None."""
    try:
        check_run_log(obj, "run.json")
    except RunLogError as e:
        return e.reason
    return None


def read_run_log(path):
    """run.json at path -> its dict, every field a reader uses of its type. A file that is not JSON, not train.py's
    run log, or has a field missing or of another type: a RunLogError (one line naming the file and the field). A
    missing file: FileNotFoundError."""
    try:
        obj = load_json(path)  # the project's one JSON reader; FileNotFoundError passes through
    except JsonError as e:
        raise RunLogError(path, None, f"is {e.problem}") from None
    return check_run_log(obj, path)


# ----------------------------------------------------------------------------- a folder's run, and a command's

def recorded_config(folder):
    """The settings of the run in a run folder -> (RunConfig, done): run.json's config, else (run.json gone) the
    one ckpt.pt carries; done: run.json says finished or diverged. (None, False) when the folder holds no run (or
    only a checkpoint that cannot be read: nothing to keep). A run.json or config of the wrong types: RunLogError."""
    folder = Path(folder)
    try:
        log = read_run_log(folder / "run.json")
        return RunConfig.from_dict(log["config"], where=folder / "run.json"), log["finished"] or log["diverged"]
    except FileNotFoundError:
        pass
    path = folder / "ckpt.pt"
    if not path.is_file():
        return None, False
    try:
        config = load_checkpoint(path, keys=("config",))["config"]
    except CheckpointError:
        return None, False
    return RunConfig.from_dict(config, where=path), False


def check_same_run(folder, cfg, done=None):
    """A ValueError (one line) when run folder `folder` holds a run made with other settings than `cfg` (a
    RunConfig): it names each identity setting that differs with both values. done: whether the folder's run
    counts as done (finished or diverged; None: as its run.json says)."""
    old, was_done = recorded_config(folder)
    if old is None:
        return
    if done is None:
        done = was_done
    keys = old.identity_changes(cfg, done=done)
    if keys:
        raise ValueError(f"{folder} holds a run made with other settings ({old.describe_changes(cfg, keys)}); it "
                         f"answers for its own only: use another --out, or move the folder away")


# ----------------------------------------------------------------------------- a run folder's state

def run_state(folder):
    """What a train.py run folder holds: 'new' (nothing), 'partial' (a run.json or ckpt.pt to resume or redo),
    'diverged' (run.json says the loss or gradient went non-finite: a result, not redone) or 'finished'. Finished
    means run.json says so *and* ckpt.pt holds its last step: ckpt.pt is saved first, so when it is missing or older
    (a kill between the two saves of an older train.py, which wrote run.json first) the run is only partial, and
    --resume continues from the ckpt.pt there is. The one definition train.py, mini.py and plot.py use. run.json is
    read by type (read_run_log): one that is not train.py's run log, or has a field of another type or
    missing, is a RunLogError (a ValueError, one line naming the file and the field), never read by truthiness."""
    folder = Path(folder)
    ckpt = folder / "ckpt.pt"
    try:
        log = read_run_log(folder / "run.json")
    except FileNotFoundError:
        return "partial" if ckpt.exists() else "new"
    if log["diverged"]:
        return "diverged"
    if not log["finished"]:
        return "partial"
    last = log["steps"][-1]["step"] if log["steps"] else None
    try:
        at = load_checkpoint(ckpt, keys=("step",))["step"]
    except Exception:  # missing, unreadable or foreign: not the final checkpoint
        at = None
    if at == last:
        return "finished"
    print0(f"{folder}: run.json says finished at step {last}, but ckpt.pt is "
           + (f"at step {at}" if at else "missing or unreadable") + ": not finished")
    return "partial"


def rebuild_run_log(folder):
    """When folder/run.json is damaged (cut off, not a JSON object, a field missing or of another type) or gone and
    folder/ckpt.pt is a whole train.py checkpoint, write run.json again from the log the checkpoint carries (train.py
    saves its run log in ckpt.pt as "log", as of the checkpoint's step), marked not finished: run_state then says
    'partial' and --resume trains on from that step (when it was the last one, --resume only marks the run
    finished). Returns the log written, or None, writing nothing, when run.json is readable or ckpt.pt is missing or
    not whole. train.py calls it for --resume before run_state, holding the folder's lock."""
    folder = Path(folder)
    try:
        read_run_log(folder / "run.json")
        return None
    except (FileNotFoundError, RunLogError):
        pass
    try:
        ckpt = load_checkpoint(folder / "ckpt.pt", keys=("log", "step", "config"))
    except CheckpointError:
        return None
    log = ckpt["log"]
    if not isinstance(log, dict) or not isinstance(log.get("steps"), list):
        return None
    log = {**log, "finished": False}
    write_json(folder / "run.json", log)
    print0(f"{folder / 'run.json'} was damaged or missing: rebuilt from ckpt.pt's log (step {ckpt['step']})")
    return log
