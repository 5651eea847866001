"""`shared_memory`: a POSIX shared-memory segment on the same host (also the load medium of grpc_stream).

    learner   packs the model's tensors into a new segment `grpo_<run>_<creator>_v<version>` (unlinked
              on release)
    rollout   attaches the segment by name (zero copy) and verifies every bucket checksum
    engine    attaches it again where the weights load (the HF engine thread, each vLLM worker) and
              builds zero-copy tensor views with `torch.frombuffer`

Segments are named by the learner; the rollout only attaches names that look like ours and exist.

Nothing leaks when a creator is killed. A segment is registered once, with its creator's resource
tracker, which unlinks it when the creator dies, however it dies (the tracker notices the end of its
pipe). Attaching never touches a tracker: vLLM's engine process shares the rollout's tracker, and an
attach that registered and then unregistered the name (Python < 3.13's `SharedMemory` registers every
attach) took the creator's one entry with it, so every kill -9 of a rollout after its first weight
load left its receive segment behind. When the tracker dies too (a whole process group SIGKILLed),
the name says whose the segment is: `<pid>-<start time>-<pid namespace>` of its creator
(`creator_token`), and `reclaim_stale_segments` unlinks those whose creator is gone. A restarted rollout
reclaims what its predecessor of the same id left; the launcher reclaims all of ours at exit.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import torch

from grpo.common.v1 import types_pb2
from services.common import weights
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, quoted
from services.common.logging import get_logger
from services.transports.base import (
    LoadPlan,
    Prepared,
    PublishContext,
    Receiver,
    StageContext,
    Staged,
    StageTarget,
    TransportKind,
    WeightTransport,
    WorkerContext,
)

log = get_logger(__name__)

SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared-memory segments (names are file names)

# Who created a segment: `<pid>-<start time in clock ticks since boot>-<pid namespace inode, hex>`.
# A pid alone could be reused; the pid's start time tells a new process from the creator, and the
# namespace keeps one container's pids from being read as another's (a shared /dev/shm).
_TOKEN = r"(\d{1,10})-(\d{1,20})-([0-9a-f]{1,16})"
_CREATED_BY = re.compile(rf"grpo_.+?_{_TOKEN}(?:_.*)?")

# The only names a rollout attaches: what a learner publishes, `grpo_<learner run>_<creator>_v<version>`
# (or, from a learner before the creator token, `grpo_<learner run>_v<version>`) for the very version
# being staged. A caller can name no other segment (`../x`, another program's).
_SEGMENT_NAME = re.compile(rf"grpo_([0-9A-Za-z]{{1,32}})(?:_{_TOKEN})?_v(\d{{1,19}})")
_MAX_NAME = 128


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (state first), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot), or None if no process of that pid is running (a
    zombie, killed but not yet reaped, is not)."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X", "x"):
        return None
    return int(fields[19])  # field 22 of the man page: starttime


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_token_cache: tuple[int, str] | None = None


def creator_token() -> str:
    """This process in a segment name: `<pid>-<start ticks>-<pid namespace, hex>`."""
    global _token_cache
    pid = os.getpid()
    if _token_cache is None or _token_cache[0] != pid:  # a forked child is another creator
        _token_cache = (pid, f"{pid}-{start_ticks(pid) or 0}-{_pid_namespace():x}")
    return _token_cache[1]


def segment_name(run_id: str, version: int) -> str:
    """The learner's segment of `version`: `grpo_<run>_<creator>_v<version>`."""
    return f"grpo_{run_id}_{creator_token()}_v{version}"


def rollout_segment_prefix(rollout_id: str) -> str:
    """What the receive segments of rollout `rollout_id` are named with first."""
    safe = "".join(c if c.isalnum() else "_" for c in rollout_id)[:40]
    return f"grpo_rollout_{safe}_"


def rollout_segment_name(rollout_id: str) -> str:
    """A new receive segment name of this rollout process: `grpo_rollout_<id>_<creator>_<nonce>`."""
    return f"{rollout_segment_prefix(rollout_id)}{creator_token()}_{uuid.uuid4().hex[:8]}"


def check_segment_name(name: str, version: int) -> None:
    """InvalidArgument unless `name` is a learner's segment for `version`."""
    match = _SEGMENT_NAME.fullmatch(name) if len(name) <= _MAX_NAME else None
    if match is None or int(match.group(5)) != version:
        raise InvalidArgument(
            f"weight_version.shared_memory.segment_name must be a learner's segment for version {version} "
            f"(grpo_<learner run id>_<creator>_v{version}), got {quoted(name)}"
        )


def creator_gone(name: str) -> bool:
    """True when `name` is one of ours whose creator has exited (or whose pid now belongs to a later
    process). False for a live creator, a name without a creator token, and a creator in another pid
    namespace (its pids are not ours to look up)."""
    match = _CREATED_BY.fullmatch(name)
    if match is None:
        return False
    pid, started, namespace = int(match.group(1)), int(match.group(2)), int(match.group(3), 16)
    if not started or not namespace or namespace != _pid_namespace():  # no /proc where it was made
        return False
    return start_ticks(pid) != started


def reclaim_stale_segments(rollout_id: str | None = None, directory: Path = SHM_DIR) -> list[str]:
    """Unlink our segments whose creator is gone (`creator_gone`): those of rollout `rollout_id`'s
    receive segments only, or with no id every `grpo_` segment. Never a live creator's segment, nor one
    whose name does not say who made it. Returns the names unlinked (none where `directory` is absent)."""
    prefix = rollout_segment_prefix(rollout_id) if rollout_id is not None else "grpo_"
    try:
        names = sorted(entry.name for entry in os.scandir(directory) if entry.name.startswith(prefix))
    except FileNotFoundError:
        return []
    own_id = re.compile(rf"{_TOKEN}_[0-9a-f]+")  # what follows the prefix in a receive segment's name
    unlinked = []
    for name in names:
        if rollout_id is not None and not own_id.fullmatch(name[len(prefix) :]):
            continue  # another rollout's, whose id starts like ours
        if not creator_gone(name):
            continue
        try:
            (directory / name).unlink()
        except FileNotFoundError:  # someone else reclaimed it first
            continue
        unlinked.append(name)
    if unlinked:
        log.warning("reclaimed stale shared-memory segments", segments=unlinked)
    return unlinked


class _AttachedSegment(shared_memory.SharedMemory):
    """A producer's segment mapped here and registered with no resource tracker (Python < 3.13's
    `SharedMemory(name)` registers every attach; 3.13's `track=False` is this)."""

    def __init__(self, name: str) -> None:  # no super().__init__(): it would register
        import _posixshmem  # CPython's own module behind SharedMemory on POSIX
        import mmap

        self._name = "/" + name
        self._flags, self._mode, self._prepend_leading_slash = os.O_RDWR, 0o600, True
        self._fd = _posixshmem.shm_open(self._name, self._flags, mode=self._mode)
        try:
            self._size = os.fstat(self._fd).st_size
            self._mmap = mmap.mmap(self._fd, self._size)
        except BaseException:
            os.close(self._fd)
            raise
        self._buf = memoryview(self._mmap)


def create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    """A new POSIX shared-memory segment owned (and later unlinked) by the caller; its resource
    tracker unlinks it if the caller dies first."""
    return shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Attach to a producer's segment without telling any resource tracker: the producer's tracker
    entry (one per segment) stays the only one, whoever attaches and wherever."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=False, track=False)
    return _AttachedSegment(name)


def unlink_segment(segment: shared_memory.SharedMemory) -> None:
    """Unmap and unlink a segment this process created (its tracker entry goes with it)."""
    close_segment(segment)
    try:
        segment.unlink()
    except FileNotFoundError:
        log.warning("segment already unlinked", segment=segment.name)


def close_segment(segment: shared_memory.SharedMemory) -> None:
    """Unmap; tensor views normally died with their iterator, else collect them first."""
    try:
        segment.close()
    except BufferError:
        gc.collect()
        try:
            segment.close()
        except BufferError:  # a view survived; the mapping goes away with the process
            log.warning("segment still has views; leaving it mapped", segment=segment.name)


async def verify(segment: shared_memory.SharedMemory, manifest: weights.Manifest) -> None:
    """Bucket checksums of a segment (hashing runs in a thread: it releases the GIL)."""
    await asyncio.to_thread(weights.verify_buckets, segment.buf, manifest)


@dataclass(frozen=True)
class SharedMemoryDescriptor:
    segment_name: str
    size: int


class SharedMemoryPrepared(Prepared):
    kind = TransportKind.shared_memory

    def __init__(self, version: int, manifest: weights.Manifest, segment: shared_memory.SharedMemory):
        super().__init__(version, manifest)
        self.segment: shared_memory.SharedMemory | None = segment

    @property
    def segment_name(self) -> str:
        return self.segment.name.lstrip("/") if self.segment is not None else ""

    def view(self) -> memoryview:
        if self.segment is None:
            raise NotFound(f"weight version {self.version} was released")
        return self.segment.buf

    def close(self) -> None:
        if self.segment is not None:
            segment, self.segment = self.segment, None
            segment.close()
            segment.unlink()


class SegmentStaged(Staged):
    """Staged bytes in a segment: the learner's (attached) or our own (grpc_stream; unlinked on release)."""

    def __init__(
        self,
        version: int,
        manifest: weights.Manifest,
        segment: shared_memory.SharedMemory,
        owned: bool,
        fetch_ms: float,
    ) -> None:
        super().__init__(version, manifest, fetch_ms)
        self.segment = segment
        self.owned = owned
        self._released = False

    @property
    def plan(self) -> LoadPlan:
        return LoadPlan(TransportKind.shared_memory, {"segment_name": self.segment.name})

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self.owned:
            unlink_segment(self.segment)
        else:
            close_segment(self.segment)


class SharedMemoryTransport(WeightTransport):
    kind = TransportKind.shared_memory
    # `prepare` copies every tensor into the segment before it returns (on the model thread): a CPU
    # snapshot first would copy the model twice (~40 ms of a ~140 ms prepare for 127 MB, measured).
    live_state = True

    # ---- learner half
    def prepare(
        self,
        version: int,
        state: Mapping[str, torch.Tensor],
        ctx: PublishContext,
        receivers: tuple[Receiver, ...] = (),
    ) -> Prepared:
        entries = weights.plan_layout(state)
        segment = create_segment(segment_name(ctx.run_id, version), weights.packed_size(entries))
        try:
            manifest = weights.build_manifest(state, segment.buf, ctx.bucket_bytes)
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        return SharedMemoryPrepared(version, manifest, segment)

    def write_descriptor(self, prepared: Prepared, message: types_pb2.WeightVersion) -> None:
        assert isinstance(prepared, SharedMemoryPrepared)
        message.shared_memory.segment_name = prepared.segment_name
        message.shared_memory.size = prepared.manifest.total_bytes

    # ---- rollout half
    def read_descriptor(self, message: types_pb2.WeightVersion) -> SharedMemoryDescriptor:
        name = message.shared_memory.segment_name
        check_segment_name(name, message.version)
        return SharedMemoryDescriptor(name, message.shared_memory.size)

    async def stage(self, target: StageTarget, ctx: StageContext) -> Staged:
        started = time.perf_counter()
        name = target.descriptor.segment_name
        try:
            segment = attach_segment(name)
        except FileNotFoundError as exc:
            raise FailedPrecondition(f"shared-memory segment {name!r} does not exist on this host") from exc
        try:
            if segment.size < target.manifest.total_bytes:
                raise InvalidArgument(
                    f"segment {name!r} has {segment.size} bytes, manifest needs {target.manifest.total_bytes}"
                )
            await verify(segment, target.manifest)
        except BaseException:
            segment.close()
            raise
        return SegmentStaged(
            target.version, target.manifest, segment, False, (time.perf_counter() - started) * 1e3
        )

    # ---- engine half
    @contextmanager
    def open_tensors(
        self, spec: dict[str, Any], tensors: list[weights.TensorEntry], worker: WorkerContext
    ) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        segment = attach_segment(spec["segment_name"])
        try:
            yield weights.iter_tensors(segment.buf, tensors)
        finally:
            close_segment(segment)
