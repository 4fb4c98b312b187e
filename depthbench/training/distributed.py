"""
distributed.py: train.py's processes under torchrun: who this process is (`Ranks`), a call made by rank 0 whose
result or error every rank gets, and FSDP2: sharding a model, and the whole (unsharded) model and optimizer
state that ckpt.pt holds, saved and loaded with any engine at any number of ranks.
"""
import dataclasses
import os
import sys
import warnings

import torch
import torch.distributed as dist

from depthbench.files import common


@dataclasses.dataclass
class Ranks:
    """This process among the torchrun processes of a job (a plain `python train.py` is rank 0 of 1)."""
    world_size: int = 1         # processes of the job, one per GPU (or CPU worker)
    rank: int = 0               # this process's place among them; rank 0 writes the files
    local_rank: int = 0         # its place on this machine: the GPU it uses
    device: str = "cpu"         # "cpu", or "cuda:<local_rank>"
    device_name: str = "cpu"    # the GPU's name, for the log and the peak FLOP/s table

    @property
    def master(self):
        return self.rank == 0

    @property
    def ddp(self):
        """More than one process: gradients are all-reduced (DDP) or sharded (FSDP2)."""
        return self.world_size > 1


MAX_WORLD_SIZE = 65536  # processes of one job: more than any cluster runs one training job on


def launcher_value(name, low, high, default=None):
    """The launcher's environment variable `name`, checked like a flag: an integer from low to high (or `default`
    when it is unset and default is not None) -> int; else one line naming it and exit 2, printed by every process
    (its RANK may be what is wrong, so print0's rank-0 rule cannot pick the printer)."""
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    problem = f"RANK is set but {name} is not: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE together (unset RANK " \
              "for a plain run)"
    if text is not None:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is not None and low <= value <= high:
            return value
        problem = f"{name}={text!r} is not an integer from {low} to {high:,} (torchrun sets it; a plain run leaves " \
                  "it unset)"
    print(f"train.py: error: {problem}", file=sys.stderr, flush=True)
    sys.exit(2)


def launcher_ranks(plan_only=False):
    """Who this process is by the launcher's variables, each checked like a flag (launcher_value): WORLD_SIZE
    processes, RANK and LOCAL_RANK among them, when RANK is set -> Ranks (on the CPU). Without RANK a plain
    process, rank 0 of 1; plan_only (--dry-run) plans for WORLD_SIZE's ranks even then."""
    torchrun = "RANK" in os.environ
    world_size = launcher_value("WORLD_SIZE", 1, MAX_WORLD_SIZE, default=None if torchrun else 1)
    if not torchrun:
        return Ranks(world_size=world_size if plan_only else 1)
    return Ranks(world_size=world_size, rank=launcher_value("RANK", 0, world_size - 1),
                 local_rank=launcher_value("LOCAL_RANK", 0, world_size - 1))


def init_distributed(cuda, plan_only=False):
    """torchrun sets RANK/LOCAL_RANK/WORLD_SIZE: one process per GPU (nccl), or per CPU worker (gloo) -> Ranks. The
    variables are checked first (launcher_ranks: one line and exit 2). plan_only (--dry-run): the ranks a plan is
    made for, WORLD_SIZE's even without RANK, and no process group."""
    ranks = launcher_ranks(plan_only)
    ranks.device = "cuda" if cuda else "cpu"
    if plan_only:
        return ranks
    if "RANK" in os.environ:
        if cuda:
            ranks.device = f"cuda:{ranks.local_rank}"
            torch.cuda.set_device(ranks.device)
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        ranks.device_name = torch.cuda.get_device_name(ranks.device)
    return ranks


def on_rank0(fn, ranks):
    """Run fn on rank 0 only and hand every rank its result, or its ValueError (a DataError, a folder in use or
    not writable), so all ranks stop together."""
    out = [None, None]
    if ranks.rank == 0:
        try:
            out[0] = fn()
        except ValueError as e:
            out[1] = str(e)
    if ranks.world_size > 1:
        dist.broadcast_object_list(out, src=0)
    if out[1] is not None:
        common.fail("train.py", out[1])  # one line on stderr (from rank 0) and exit code 2
    return out[0]


# ----------------------------------------------------------------------------- FSDP2 and the whole state

def shard(model):
    """FSDP2, the engine of the official runs: each block a unit, then the root (embedding, head and `model.res`,
    which every block reads). FSDP2 shards dim 0: a 0-dim parameter (HC/mHC's scales) becomes a vector of one,
    which checkpoints turn back. -> the model's {name: shape}."""
    from torch.distributed.fsdp import fully_shard
    warnings.filterwarnings("ignore", "FSDP2-wrapped module .* view")  # no design writes in place into a block's output
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for m in model.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dim() == 0:
                setattr(m, name, torch.nn.Parameter(p.detach().reshape(1)))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return shapes


def reshaped(model, osd, shapes):
    """State dicts (the optimizer's keyed by name) with each parameter, and its AdamW moments, in shapes[name]."""
    state = {}
    for name, moments in osd.get("state", {}).items():
        state[name] = {m: v if m == "step" else v.reshape(shapes[name]) for m, v in moments.items()}
    model = {k: v.reshape(shapes[k]) for k, v in model.items()}
    return model, {"state": state, "param_groups": osd.get("param_groups", [])}


def rekey(osd, key):
    """An optimizer state dict with its parameters renamed by key[...]: positions <-> names."""
    groups = [{**g, "params": [key[k] for k in g["params"]]} for g in osd.get("param_groups", [])]
    return {"state": {key[k]: v for k, v in osd.get("state", {}).items()}, "param_groups": groups}


def full_state(model, optimizer, shapes=None):
    """(model, optimizer) state dicts as one process saves them (whole tensors, plain names and shapes, the optimizer
    keyed by position); under FSDP (`shapes`: what shard returned) gathered onto rank 0's CPU, a collective that
    every rank calls."""
    if shapes is None:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # the optimizer's keyed by name; both empty off rank 0
    weights, osd = reshaped(get_model_state_dict(model, options=opts),
                            get_optimizer_state_dict(model, optimizer, options=opts), shapes)
    names = [n for g in osd["param_groups"] for n in g["params"]]
    return weights, rekey(osd, {n: k for k, n in enumerate(names)})


def load_full_state(model, optimizer, state, sharded):
    """Load state = (model, optimizer), as full_state saved them, into either engine at any number of ranks
    (sharded: FSDP2, where each rank keeps its shard)."""
    weights, osd = state
    if not sharded:
        model.load_state_dict(weights)
        return optimizer.load_state_dict(osd)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    names = {id(p): n for n, p in model.named_parameters()}
    osd = rekey(osd, [names[id(p)] for g in optimizer.param_groups for p in g["params"]])
    weights, osd = reshaped(weights, osd, {n: p.shape for n, p in model.named_parameters()})
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=opts)
    set_optimizer_state_dict(model, optimizer, osd, options=opts)
