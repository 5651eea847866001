"""Atomic learner checkpoints: everything needed to continue bit-for-bit.

Layout of `<dir>/step_00000012/`:
    model.safetensors   trainable parameters (full model, or only the LoRA tensors)
    optimizer.pt        optimizer + LR-schedule state (torch.save of tensors and numbers;
                        loaded with weights_only=True, so no arbitrary pickle)
    rng.pt              torch CPU / CUDA, Python `random` RNG states
    state.json          weight version, step, id of the last consumed batch, loss, model, lineage

`<dir>/lineage.json` names the run's learner lineage: written once, when the directory is first used,
and kept by every process that resumes from it, so a scheduler can tell a learner restarted from this
run's checkpoints from one of another run.

A checkpoint is written into `<dir>/.tmp-step_…-<pid>` and renamed into place, so a crash never
leaves a half-written `step_*` directory; only the newest `keep` are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PREFIX = "step_"


@dataclass
class TrainerState:
    weight_version: int
    step: int
    last_batch_id: str
    loss: str
    model: str
    lineage_id: str = ""  # empty in checkpoints written before lineages existed


LINEAGE_FILE = "lineage.json"


def ensure_lineage(root: Path) -> str:
    """The lineage id of the checkpoint directory `root`, created (atomically) on first use."""
    path = root / LINEAGE_FILE
    if path.exists():
        return json.loads(path.read_text())["lineage_id"]
    root.mkdir(parents=True, exist_ok=True)
    lineage = uuid.uuid4().hex[:12]
    tmp = root / f".tmp-{LINEAGE_FILE}-{os.getpid()}"
    with tmp.open("w") as handle:
        json.dump({"lineage_id": lineage}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(tmp, path)
    _fsync_dir(root)
    return lineage


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_rng_to_tensorable(state: tuple) -> dict:
    version, internal, gauss = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def _python_rng_from_tensorable(data: dict) -> tuple:
    return (data["version"], tuple(int(x) for x in data["internal"].tolist()), data["gauss"])


def save_checkpoint(
    root: Path,
    state: TrainerState,
    params: dict[str, torch.Tensor],
    optimizer: dict,
    scheduler: dict,
    keep: int,
) -> Path:
    """Write one checkpoint atomically and prune old ones. Returns its directory."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in params.items()}, str(tmp / "model.safetensors")
    )
    torch.save({"optimizer": optimizer, "scheduler": scheduler}, tmp / "optimizer.pt")
    rng = rng_state()
    rng["python"] = _python_rng_to_tensorable(rng["python"])
    torch.save(rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
    for path in tmp.iterdir():
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():  # re-saving the same step (e.g. at stop right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    prune(root, keep)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").exists()
    ]
    return sorted(found, key=lambda p: p.name)


def prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)


@dataclass
class LoadedCheckpoint:
    path: Path
    state: TrainerState
    params: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: dict


def load_latest(root: Path) -> LoadedCheckpoint | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    if not found:
        return None
    path = found[-1]
    state = TrainerState(**json.loads((path / "state.json").read_text()))
    params = load_file(str(path / "model.safetensors"))
    opt = torch.load(path / "optimizer.pt", weights_only=True)
    rng = torch.load(path / "rng.pt", weights_only=True)
    rng["python"] = _python_rng_from_tensorable(rng["python"])
    return LoadedCheckpoint(path, state, params, opt["optimizer"], opt["scheduler"], rng)
