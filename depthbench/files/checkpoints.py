"""
checkpoints.py: a train.py ckpt.pt read by type, and the model it builds. read_checkpoint loads it (common.py's
load_checkpoint: weights only, memory-mapped) and checks every field the readers use (check_checkpoint: the run's
settings through runlog.py's types, the step, the design, the weights); checkpoint_model builds its GPT and loads the
weights, refusing another design's or shape's (check_state_dict). Every error is one line naming the file and the
field (a CheckpointError). train.py --resume, diagnose.py and export.py read checkpoints through here. No torch at
module level.
"""
from depthbench.files import runlog
from depthbench.files.common import JSON_NAMES, CheckpointError, first_line, json_name, load_checkpoint


def read_checkpoint(path, keys=("model", "model_config", "config")):
    """A train.py ckpt.pt read by type: load_checkpoint's (a whole checkpoint holding `keys`), then check_checkpoint
    -> its dict, or a one-line CheckpointError naming the file and the field. Every reader of a run's checkpoint
    (train.py --resume, diagnose.py, export.py) comes through here; checkpoint_model builds its model."""
    ckpt = load_checkpoint(path, keys)
    check_checkpoint(ckpt, path)
    return ckpt


def check_checkpoint(ckpt, path):
    """What the readers use of a checkpoint, each of its type, where present: "config" a mapping of RunConfig's
    types (runlog.py) whose residual is a design of the registry; "step" a step count (an int >= 0);
    "model_config" a mapping whose residual is a design of the registry; "model" a mapping of names to tensors.
    A CheckpointError (one line) otherwise, never trusted by truthiness."""
    import torch
    try:
        if "config" in ckpt:
            runlog.check_config(ckpt["config"], path)
    except runlog.RunLogError as e:
        raise CheckpointError(str(e)) from None
    step = ckpt.get("step", 0)
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{path}: field 'step' is {step!r}, not a step count (an integer >= 0)")
    for field in ("config", "model_config"):
        value = ckpt.get(field, {})
        if not isinstance(value, dict):
            raise CheckpointError(f"{path}: field {field!r} is {json_name(value)}, not an object")
        if field == "model_config" or "residual" in value:
            check_design(value.get("residual"), path, f"{field}.residual")
    check_model_config(ckpt.get("model_config", {}), path)
    weights = ckpt.get("model", {})
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise CheckpointError(f"{path}: field 'model' is not a state dict (names to tensors)")


def check_model_config(settings, path):
    """A CheckpointError (one line naming the field) unless each field of model_config that GPTConfig has is of
    its type: a count (vocab_size, n_layer, d_model, n_head, d_ff; n_kv_head or null) an integer >= 1, a float a
    finite number, a text a string, the options an object, a switch true or false; and the model no larger than
    shapes.py's bounds (MAX_LAYERS blocks, MAX_PARAMS parameters), which building it would not survive. Every
    reader checks it, train.py --resume too (it builds from its command line, and must not take a "2" for 2)."""
    import dataclasses
    import math
    import shapes
    from model import GPTConfig
    for spec in dataclasses.fields(GPTConfig):
        value, where = settings.get(spec.name), f"model_config.{spec.name}"
        if spec.name not in settings or (value is None and spec.default is None):
            continue
        if spec.type is int and not (type(value) is int and value >= 1):
            raise CheckpointError(f"{path}: field {where!r} is {value!r}, not a count (an integer >= 1)")
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if spec.type is float and not number:
            raise CheckpointError(f"{path}: field {where!r} is {value!r}, not a finite number")
        if spec.type in (str, dict, bool) and type(value) is not spec.type:
            raise CheckpointError(f"{path}: field {where!r} is {json_name(value)}, not {JSON_NAMES[spec.type]}")
    L, d, d_ff = (settings.get(k, 1) for k in ("n_layer", "d_model", "d_ff"))
    size = shapes.preln_params(L, d, d_ff, vocab=settings.get("vocab_size", 1))
    if L > shapes.MAX_LAYERS or size > shapes.MAX_PARAMS:
        raise CheckpointError(f"{path}: a model of {L:,} blocks of width {d:,} ({size:,} parameters): more than the "
                              f"{shapes.MAX_LAYERS} blocks or {shapes.MAX_PARAMS:,} parameters this code builds")


def check_design(name, path, field):
    """A CheckpointError unless `name` is a design of the registry (residuals.RESIDUALS)."""
    from residuals import RESIDUALS
    if not isinstance(name, str) or name not in RESIDUALS:
        raise CheckpointError(f"{path}: field {field!r} is {name!r}, not a design of residuals.py")


def check_state_dict(weights, model, path, shapes=None):
    """A CheckpointError (one line) unless the state dict `weights` holds exactly `model`'s tensors, by name and
    shape: another design's weights, or another shape's, are refused before load_state_dict sees them. shapes:
    {name: shape} of the parameters as the model had them before FSDP2 (depthbench/training/distributed.py's shard,
    which makes a 0-dim parameter a vector of one; checkpoints keep the shape before)."""
    want = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    want.update({k: tuple(shape) for k, shape in (shapes or {}).items() if k in want})
    missing = [k for k in want if k not in weights]
    unexpected = [k for k in weights if k not in want]
    if missing or unexpected:
        design = model.cfg.residual
        raise CheckpointError(f"{path}: its weights are not those of its config's {design} model (missing: "
                              f"{few(missing)}; unexpected: {few(unexpected)})")
    for k, shape in want.items():
        if tuple(weights[k].shape) != shape:
            raise CheckpointError(f"{path}: weight {k} has shape {tuple(weights[k].shape)}, its config's model "
                                  f"needs {shape}")


def few(names, n=3):
    """'a, b, c and 4 more' ('none' for no names)."""
    if not names:
        return "none"
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def checkpoint_model(ckpt, path, kernels=None):
    """The GPT a checkpoint's model_config builds (kernels: another --kernels), its weights checked (check_state_dict)
    and loaded -> the model, or a one-line CheckpointError."""
    from model import GPT, GPTConfig
    settings = dict(ckpt["model_config"])
    if kernels is not None:
        settings["kernels"] = kernels
    try:
        model = GPT(GPTConfig(**settings))
    except Exception as e:  # a model_config of another program: not ours
        raise CheckpointError(f"{path}: field 'model_config' builds no model ({type(e).__name__}: "
                              f"{first_line(e, 120)})") from None
    check_state_dict(ckpt["model"], model, path)
    model.load_state_dict(ckpt["model"])
    return model
