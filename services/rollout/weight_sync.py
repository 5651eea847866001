"""Weight staging of the rollout: fetch + verify a published version now, load it on commit.

The transport named in the WeightVersion does the work (`services/transports/`: grpc_stream
fetches into a shared-memory segment, shared_memory attaches the learner's); this module keeps the
rollout's one staged slot and its version rules:

- a version not newer than the loaded one is refused (Aborted), unless the scheduler says `rewind`:
  the learner restarted from an older checkpoint, and the loaded weights are of a lost lineage;
- a retried StageWeights of the staged version returns it without fetching again;
- staging a newer version replaces an older staged one; an older one than staged is refused;
- a fetch has a deadline that grows with the version's `total_bytes` (`fetch_deadline`: a floor plus
  the bytes at the slowest rate accepted), so a hung learner holds the slot no longer than that.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import NoReturn

from services.common.deadlines import TransferDeadline
from services.common.errors import Aborted, FailedPrecondition, GrpoError
from services.common.logging import get_logger
from services.transports import EngineWorkers, StageContext, Staged, StageTarget, WeightTransport
from services.transports import registry as transports

log = get_logger(__name__)


class WeightStager:
    """The one staged slot, guarded by a lock so stage / take / abort never interleave."""

    def __init__(
        self,
        rollout_id: str,
        fetch_deadline: TransferDeadline,
        workers: EngineWorkers | None = None,
        adapters: str = "",
    ) -> None:
        """`adapters`: why the engine cannot serve a LoRA adapter version ("": it can)."""
        self._fetch_deadline = fetch_deadline
        self._adapters = adapters
        self._ctx = StageContext(
            rollout_id=rollout_id, fetch_timeout_s=fetch_deadline.floor_s, workers=workers
        )
        self._staged: Staged | None = None
        self._target: StageTarget | None = None  # what `_staged` was staged from
        self._lock = asyncio.Lock()

    @property
    def staged_version(self) -> int:
        return self._staged.version if self._staged else -1

    async def stage(self, target: StageTarget, current_version: int, rewind: bool = False) -> Staged:
        transport = transports.get(target.kind)
        if target.version <= current_version and not rewind:
            await self._refuse(
                transport,
                target,
                f"weight version {target.version} is not newer than the loaded version {current_version}",
            )
        if target.manifest.adapter is not None and self._adapters:
            why = f"weight version {target.version} is a LoRA adapter: {self._adapters}"
            await self._refuse(transport, target, why, FailedPrecondition)
        async with self._lock:
            staged = self._staged
            if staged is not None and self._target == target:
                return staged  # a retried StageWeights: already fetched and verified
            # (the same version described anew, e.g. a new nccl broadcast of it, is staged again)
            if staged is not None and staged.version > target.version and not rewind:
                await self._refuse(
                    transport,
                    target,
                    f"weight version {staged.version} is already staged; {target.version} is stale",
                )
            fetch_s = self._fetch_deadline.for_bytes(target.manifest.total_bytes)
            fresh = await transport.stage(target, dataclasses.replace(self._ctx, fetch_timeout_s=fetch_s))
            if self._staged is not None:
                self._staged.release()
            self._staged, self._target = fresh, target
            log.info(
                "weights staged",
                version=fresh.version,
                transport=target.kind,
                bytes=fresh.manifest.total_bytes,
                received_bytes=fresh.received_bytes,
                fetch_ms=round(fresh.fetch_ms, 1),
            )
            return fresh

    async def _refuse(
        self, transport: WeightTransport, target: StageTarget, reason: str, error: type[GrpoError] = Aborted
    ) -> NoReturn:
        """Refuse `target` (Aborted unless `error`), ending its collective transfer for the whole group
        at once: the learner's broadcast (and its next train step) must not wait out the join deadline
        for us."""
        await transport.refuse(target, f"{self._ctx.rollout_id} refused: {reason}")
        raise error(reason)

    async def take(self, version: int) -> Staged:
        """Hand the staged `version` to the committer (FailedPrecondition if it is not staged)."""
        async with self._lock:
            staged = self._staged
            if staged is None or staged.version != version:
                have = "nothing" if staged is None else f"v{staged.version}"
                raise FailedPrecondition(
                    f"weight version {version} is not staged ({have} is); call StageWeights first"
                )
            self._staged = None
            return staged

    async def put_back(self, staged: Staged) -> None:
        """Return a taken version whose load failed, unless something newer was staged meanwhile."""
        async with self._lock:
            if self._staged is None:
                self._staged = staged
            else:
                staged.release()

    async def abort(self, version: int) -> bool:
        """Drop the staged `version` if it is the staged one. Returns whether something was dropped."""
        async with self._lock:
            if self._staged is None or self._staged.version != version:
                return False
            self._staged.release()
            self._staged = None
            return True

    def close(self) -> None:
        if self._staged is not None:
            self._staged.release()
            self._staged = None
        transports.close_all()  # e.g. grpc_stream's spare receive segment
