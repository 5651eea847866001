"""Atomic learner checkpoints: everything needed to continue bit-for-bit.

Layout of `<dir>/step_00000012/`:
    model.safetensors   trainable parameters (full model, or only the LoRA tensors)
    optimizer.pt        optimizer + LR-schedule state (torch.save of tensors and numbers;
                        loaded with weights_only=True, so no arbitrary pickle)
    rng.pt              torch CPU / CUDA, Python `random` RNG states
    state.json          weight version, step, id of the last consumed batch, loss, model, lineage

A learner of several ranks writes the model and optimizer with torch.distributed.checkpoint instead
(`sharded_checkpoint.py`: `.metadata` and one `__<rank>_0.distcp` per rank, each rank its own shards)
and the LR schedule in `schedule.pt`; rng.pt (rank 0's) and state.json as above. Either format
resumes at any number of ranks.

`<dir>/lineage.json` names the run's learner lineage: written once, when the directory is first used,
and kept by every process that resumes from it, so a scheduler can tell a learner restarted from this
run's checkpoints from one of another run.

A checkpoint is written into `<dir>/.tmp-step_…-<pid>` and renamed into place, so a crash never
leaves a half-written `step_*` directory; only the newest `keep` are kept, and a learner starting on
the directory removes what a dead writer left behind (`remove_stale_tmp`). A learner told to go back
(its run's ledger lost the later steps) removes the checkpoints newer than where it goes
(`discard_after`) before it loads that one.

Writing takes seconds for a large model (7.5 s for a 0.5B model and its AdamW state on an H200 host),
so periodic checkpoints go through a `CheckpointWriter`: the train step waits only for `snapshot` (host
copies of the tensors, taken before the next optimizer step changes them in place) and one background
thread writes it. A crash mid-write loses only that checkpoint: the learner resumes from the previous
one and the scheduler trains the steps since again, as after any learner restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from services.common.logging import get_logger

log = get_logger(__name__)
PREFIX = "step_"
TMP_PREFIX = f".tmp-{PREFIX}"


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


@dataclass
class Snapshot:
    """Everything one checkpoint holds, in host memory that no later training step touches."""

    state: TrainerState
    params: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: dict


def _host_copy(value: Any) -> Any:
    """`value` with every tensor copied to host memory and every container rebuilt (leaves shared)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(v) for v in value)
    return value


def snapshot(
    state: TrainerState, params: dict[str, torch.Tensor], optimizer: dict, scheduler: dict
) -> Snapshot:
    """Host copies of the live `params` and optimizer/schedule state (the optimizer updates its
    moments in place) and the RNG states now: the checkpoint of this moment, whenever it is written."""
    return Snapshot(
        state,
        {k: v.detach().to("cpu", copy=True).contiguous() for k, v in params.items()},
        _host_copy(optimizer),
        _host_copy(scheduler),
        rng_state(),
    )


@dataclass
class ShardedSnapshot:
    """Rank 0's part of a sharded checkpoint: the files every rank is writing into `tmp` (`files`,
    `sharded_checkpoint.PendingSave`) and what rank 0 adds once they are complete."""

    state: TrainerState
    scheduler: dict
    rng: dict
    tmp: Path
    files: Any  # .result() returns once every rank's files and DCP's metadata are written


def sharded_tmp(root: Path, step: int, leader_pid: int) -> Path:
    """The directory every rank writes step `step`'s sharded checkpoint into (named after rank 0's pid,
    so that `remove_stale_tmp` knows whose it is)."""
    return root / f"{TMP_PREFIX}{step:08d}-{leader_pid}"


def _complete(root: Path, tmp: Path, step: int, keep: int) -> Path:
    """fsync `tmp`'s files, rename it into place as step `step`, prune: the checkpoint now counts."""
    for path in tmp.iterdir():
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    final = root / f"{PREFIX}{step:08d}"
    if final.exists():  # re-saving the same step (e.g. at stop right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    prune(root, keep)
    return final


def save_sharded_checkpoint(root: Path, snap: ShardedSnapshot, keep: int) -> Path:
    """Rank 0, once every rank's files are written: the schedule, RNG and state, then the rename."""
    snap.files.result()
    torch.save({"scheduler": snap.scheduler}, snap.tmp / "schedule.pt")
    torch.save(dict(snap.rng, python=_python_rng_to_tensorable(snap.rng["python"])), snap.tmp / "rng.pt")
    (snap.tmp / "state.json").write_text(json.dumps(asdict(snap.state), indent=2))
    return _complete(root, snap.tmp, snap.state.step, keep)


def save_checkpoint(root: Path, snap: Snapshot, keep: int) -> Path:
    """Write one checkpoint atomically and prune old ones. Returns its directory."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{snap.state.step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(snap.params, str(tmp / "model.safetensors"))
    torch.save({"optimizer": snap.optimizer, "scheduler": snap.scheduler}, tmp / "optimizer.pt")
    rng = dict(snap.rng, python=_python_rng_to_tensorable(snap.rng["python"]))
    torch.save(rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(asdict(snap.state), indent=2))
    return _complete(root, tmp, snap.state.step, keep)


class CheckpointWriter:
    """Writes snapshots on one background thread, one at a time.

    `submit` first waits for the write before it (so at most one snapshot sits in host memory and a
    slow disk slows training instead of piling up copies). A failed write is logged where it fails;
    `wait` raises it, for a caller that needs the checkpoint on disk (the one at stop).
    """

    def __init__(self, root: Path, keep: int, durable_step: int = 0) -> None:
        self.root, self.keep = root, keep
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Future[Path] | None = None
        self.durable_step = durable_step  # step of the newest checkpoint on disk (0: the model as loaded)

    def submit(self, snap: Snapshot | ShardedSnapshot) -> None:
        with contextlib.suppress(Exception):  # logged by _write where it failed; this one is a new try
            self.wait()
        self._pending = self._executor.submit(self._write, snap)

    def wait(self) -> Path | None:
        """Block until the pending write (if any) is on disk; its path, or its error raised."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def wait_quietly(self) -> None:
        """Block until the pending write (if any) is done; a failure is only logged (by `_write`)."""
        with contextlib.suppress(Exception):
            self.wait()

    def close(self) -> None:
        """Finish the pending write (a checkpoint under way is not abandoned) and stop the thread."""
        self._executor.shutdown(wait=True)

    def _write(self, snap: Snapshot | ShardedSnapshot) -> Path:
        started = time.perf_counter()
        try:
            if isinstance(snap, ShardedSnapshot):
                path = save_sharded_checkpoint(self.root, snap, self.keep)
            else:
                path = save_checkpoint(self.root, snap, self.keep)
        except Exception:
            log.exception("checkpoint write failed", step=snap.state.step, dir=str(self.root))
            raise
        self.durable_step = snap.state.step
        log.info("checkpoint saved", path=str(path), step=snap.state.step,
                 write_s=round(time.perf_counter() - started, 3))  # fmt: skip
        return path


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


def remove_stale_tmp(root: Path) -> None:
    """Remove half-written checkpoints of writers that are gone: this process's (it writes none yet
    when this runs at start; a restarted container's learner often has the same pid) or a dead one's."""
    if not root.is_dir():
        return
    for path in root.glob(f"{TMP_PREFIX}*-*"):
        pid = path.name.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid() or not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def step_of(path: Path) -> int:
    """The step a checkpoint directory `step_XXXXXXXX` holds."""
    return int(path.name[len(PREFIX) :])


def discard_after(root: Path, step: int) -> list[int]:
    """Remove every complete checkpoint newer than `step` (the run's record lost those steps), newest
    first; returns their steps. Each is first renamed to a `.tmp-` name of this process (atomic, and
    synced before anything is deleted), so a crash mid-way leaves no newer checkpoint for a restart
    to resume from, only leftovers that `remove_stale_tmp` removes."""
    gone = []
    for path in reversed(list_checkpoints(root)):
        if step_of(path) <= step:
            break
        doomed = root / f"{TMP_PREFIX}{path.name[len(PREFIX) :]}-discarded-{os.getpid()}"
        os.rename(path, doomed)
        _fsync_dir(root)
        shutil.rmtree(doomed, ignore_errors=True)
        gone.append(step_of(path))
    return gone


def prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)


@dataclass
class LoadedCheckpoint:
    path: Path
    state: TrainerState
    params: dict[str, torch.Tensor] | None  # None for a sharded checkpoint (sharded_checkpoint.py loads it)
    optimizer: dict | None
    scheduler: dict
    rng: dict


def load_latest(root: Path, tensors: bool = True) -> LoadedCheckpoint | None:
    """The newest complete checkpoint under `root`, or None. `tensors=False`, or a sharded checkpoint:
    without the model and optimizer (`sharded_checkpoint.load_model_and_optimizer` reads either format)."""
    found = list_checkpoints(root)
    if not found:
        return None
    path = found[-1]
    state = TrainerState(**json.loads((path / "state.json").read_text()))
    rng = torch.load(path / "rng.pt", weights_only=True)
    rng["python"] = _python_rng_from_tensorable(rng["python"])
    if (path / "schedule.pt").exists():  # sharded
        schedule = torch.load(path / "schedule.pt", weights_only=True)["scheduler"]
        return LoadedCheckpoint(path, state, None, None, schedule, rng)
    opt = torch.load(path / "optimizer.pt", weights_only=True)
    params = load_file(str(path / "model.safetensors")) if tensors else None
    return LoadedCheckpoint(path, state, params, opt["optimizer"] if tensors else None, opt["scheduler"], rng)
