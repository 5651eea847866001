"""Model + optimizer checkpoints of a (possibly FSDP2-sharded) learner with torch.distributed.checkpoint.

A checkpoint directory written here (format "dcp") holds DCP's files: one `__<rank>_0.distcp` per
writing rank and `.metadata` (written last, by rank 0). Its keys are fully qualified names
(`get_model_state_dict` / `get_optimizer_state_dict`): "model" → {fqn: tensor}, "optimizer" →
{"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}. Every tensor is stored
with its global shape and the offsets of each rank's shard, so any world size can load it, a 1-rank
learner without a process group included; DCP re-slices on load. Only trainable parameters are
stored, under the names `trainable_state` gives them (a tied weight once): a LoRA checkpoint holds
the LoRA tensors, not the frozen base, and a full model's holds the keys of checkpoint.py's
model.safetensors.

`load_model_and_optimizer` also reads checkpoint.py's format ("single": `model.safetensors` with the
trainable parameters by name, `optimizer.pt` with `optimizer.state_dict()` keyed by the index of the
parameter in `[p for p in model.parameters() if p.requires_grad]`), so a run of a 1-rank learner can
continue on N ranks.

The caller owns the rest of a checkpoint (state.json, LR schedule, RNG, the `.tmp-` directory and its
rename): these functions write and read only the model and the optimizer.

Collectives: with a process group, both functions are collectives; every rank calls them, in the same
order. A background save runs its collectives on a process group of its own (Gloo, created once by
`checkpoint_group`, itself a collective), never on the group the training step uses, so its thread
cannot interleave with the step's all-gathers and reduce-scatters. DCP's coordination messages (save
plans, metadata) travel between the learner's own ranks as pickled objects, and DCP pickles its
`.metadata` and the non-tensor values (the optimizer's param groups) into its own files; both are
DCP's, not this module's.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

DCP_METADATA = ".metadata"
SINGLE_MODEL, SINGLE_OPTIMIZER = "model.safetensors", "optimizer.pt"
CHECKPOINT_GROUP_TIMEOUT = timedelta(minutes=10)

_SHARDED = StateDictOptions(ignore_frozen_params=True)  # local shards (DTensors), trainable only
_FULL = StateDictOptions(full_state_dict=True, strict=False)  # full tensors in, every rank

_group: dist.ProcessGroup | None = None  # the checkpoint group of this process's default group
_group_of: dist.ProcessGroup | None = None  # the default group `_group` was made for
_pending: Future | None = None  # the newest save's upload, until done


def format_of(path: Path) -> Literal["dcp", "single"]:
    """Which format the checkpoint directory `path` holds: DCP's files, or checkpoint.py's."""
    if (path / DCP_METADATA).is_file():
        return "dcp"
    if (path / SINGLE_MODEL).is_file() and (path / SINGLE_OPTIMIZER).is_file():
        return "single"
    raise ValueError(
        f"{path} holds no model checkpoint ({DCP_METADATA} or {SINGLE_MODEL} + {SINGLE_OPTIMIZER})"
    )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def checkpoint_group(timeout: timedelta = CHECKPOINT_GROUP_TIMEOUT) -> dist.ProcessGroup | None:
    """The Gloo group background saves use (None without a process group). Made on the first call,
    which is a collective: every rank makes it at the same point (e.g. at start-up, or its first save)."""
    global _group, _group_of
    if not _distributed():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _group is None or _group_of is not default:
        _group, _group_of = dist.new_group(backend="gloo", timeout=timeout), default
    return _group


class PendingSave:
    """A save whose state is staged (host copies taken: training may go on and change the live tensors)
    and whose files are being written by a background thread.

    `result()` returns `target` once its files are complete: on whichever rank it returns, every rank's
    `__<rank>_0.distcp` is written and fsynced and rank 0 has written `.metadata` (DCP's last step is a
    gather of all ranks' write results to rank 0, which writes `.metadata` and then broadcasts the
    outcome, so no rank finishes before that). Only then may the caller rename the directory into
    place (on one rank). A failed write raises here, on every rank.
    """

    def __init__(self, target: Path, upload: Future) -> None:
        self.target, self._upload = target, upload

    def done(self) -> bool:
        return self._upload.done()

    def result(self, timeout: float | None = None) -> Path:
        self._upload.result(timeout)
        return self.target


def save_model_and_optimizer(
    target: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> PendingSave:
    """Write the trainable parameters of `model` and the state of `optimizer` into directory `target`
    with DCP, in the background. Called by every rank (a collective), with the same `target` on a
    filesystem they all see; without a process group, by the one process.

    First waits for the previous save of this process (one upload at a time: two would run
    collectives on the checkpoint group from two threads). Returns once the state is staged: DCP's
    stager has copied every local shard and optimizer tensor into new host memory, so the next
    optimizer step may change the model and the optimizer in place. See `PendingSave` for when the
    files are complete. Each rank writes only its own shards (no gathering of full tensors).
    Raises ValueError before any optimizer step (the optimizer has no state to save yet).
    """
    global _pending
    if not optimizer.state:  # DCP's get_optimizer_state_dict would give it state: step 1, zero moments
        raise ValueError("no optimizer step yet: the model as loaded needs no checkpoint")
    if _pending is not None:
        with contextlib.suppress(Exception):  # that save's failure is raised to its own handle's owner
            _pending.result()
        _pending = None
    state = _local_state(model, optimizer)
    group = checkpoint_group()
    response = dcp.async_save(state, checkpoint_id=str(target), process_group=group, no_dist=group is None)
    upload = response if isinstance(response, Future) else response.upload_completion
    _pending = upload
    return PendingSave(Path(target), upload)


def load_model_and_optimizer(source: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the checkpoint in directory `source` (either format) into `model` (its trainable
    parameters) and `optimizer`, in place. Called by every rank, or by the one process without a
    process group; the world size that wrote the checkpoint does not matter.

    `optimizer` must optimise exactly the trainable parameters of `model` (in any order: its state
    is matched by parameter name). Raises ValueError if the checkpoint lacks a trainable parameter
    of `model` (or, for the single format, names one `model` does not train).
    """
    if format_of(source) == "dcp":
        # Destination tensors shaped like this rank's shards; DCP reads the overlapping slices of the
        # stored ones into them (missing keys raise), then they are set into the model and optimizer.
        state = _local_state(model, optimizer)
        stored = dcp.FileSystemReader(str(source)).read_metadata().state_dict_metadata  # "model.<fqn>"
        missing = sorted(k for k in state["model"] if f"model.{k}" not in stored)
        if missing:  # checked before any collective, alike on every rank
            raise ValueError(f"checkpoint {source} does not match the model: missing {missing[:3]}")
        dcp.load(state, checkpoint_id=str(source), no_dist=not _distributed())
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        return
    # checkpoint.py's format: full tensors, read by every rank and sliced into its shards.
    names = _trainable_names(model)
    params = load_file(str(source / SINGLE_MODEL))  # {name: full tensor}
    missing, unexpected = set(names) - set(params), set(params) - set(names)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source} does not match the model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    saved = torch.load(source / SINGLE_OPTIMIZER, weights_only=True)["optimizer"]
    set_model_state_dict(model, params, options=_FULL)
    set_optimizer_state_dict(model, optimizer, _optimizer_by_name(saved, names), options=_FULL)


def _trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters in `model.parameters()` order; a tied weight once, by its
    first name (as `trainable_state`, and the keys of checkpoint.py's model.safetensors)."""
    return [name for name, param in model.named_parameters() if param.requires_grad]


def _local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's part of the checkpoint: {"model": {fqn: trainable param (a DTensor when sharded;
    the live tensor, not a copy)}, "optimizer": FQN-keyed state (moments: DTensors when sharded)}.

    `ignore_frozen_params` drops frozen parameters by their first name only, so a tied frozen weight
    (a LoRA model's embedding, tied to lm_head) would still be stored under its other name; the model
    part is therefore cut down to exactly the trainable names. A trainable parameter missing from
    DCP's state dict (a module wrapper that renames parameters) raises instead of going unsaved."""
    names = _trainable_names(model)
    params = get_model_state_dict(model, options=_SHARDED)
    absent = [n for n in names if n not in params]
    if absent:
        raise ValueError(f"parameters not in the model's state dict by their names: {absent[:3]}")
    return {
        "model": {n: params[n] for n in names},
        "optimizer": get_optimizer_state_dict(model, optimizer, options=_SHARDED),
    }


def _optimizer_by_name(saved: dict, names: list[str]) -> dict:
    """`optimizer.state_dict()` of a 1-rank learner (parameters by index into `names`) with its
    parameters named instead, the form `set_optimizer_state_dict` takes."""
    indices = [i for group in saved["param_groups"] for i in group["params"]]
    if sorted(indices) != list(range(len(names))):
        raise ValueError(f"optimizer state is for {len(indices)} parameters; the model trains {len(names)}")
    return {
        "state": {names[i]: value for i, value in saved["state"].items()},
        "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in saved["param_groups"]],
    }
