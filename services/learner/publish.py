"""Prepared weight versions: each the weights as one transport publishes them, bounded in number.

`PreparedStore.prepare` exports the current weights and hands them to a weight transport
(`services/transports/`), which publishes them its own way: grpc_stream and shared_memory pack a CPU
snapshot into process memory or a POSIX segment the rollouts fetch or attach; cuda_ipc packs the
live tensors into a GPU staging buffer the rollouts attach to; nccl reads the live tensors and
pushes them to its receivers, bucket by bucket. A version stays until `release`; at most
`max_prepared` are held at once (ResourceExhausted beyond). The store knows nothing of any
particular transport.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from services.common.errors import FailedPrecondition, NotFound, ResourceExhausted
from services.transports import Prepared, PublishContext, Receiver, WeightTransport


class PreparedStore:
    """Thread-safe registry of prepared versions (prepare runs on the learner's model thread)."""

    def __init__(self, max_prepared: int) -> None:
        self.max_prepared = max_prepared
        self._items: dict[int, Prepared] = {}
        self._lock = threading.Lock()

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._items)

    def get(self, version: int) -> Prepared:
        with self._lock:
            item = self._items.get(version)
        if item is None:
            raise NotFound(f"weight version {version} is not prepared (prepared: {self.versions()})")
        return item

    def prepare(
        self,
        version: int,
        transport: WeightTransport,
        export: Callable[[], Mapping[str, torch.Tensor]],
        ctx: PublishContext,
        receivers: tuple[Receiver, ...],
    ) -> tuple[Prepared, bool]:
        """`version` packed by `transport` (exported only when new). Returns (item, newly prepared).

        Preparing the same version again with the same transport returns the existing one (a retried
        PrepareWeights; an item with `described_to`, cuda_ipc's, is told the receivers it now has
        too); with another transport it is FailedPrecondition until released.
        """
        with self._lock:
            item = self._items.get(version)
            if item is not None:
                if item.kind != transport.kind:
                    raise FailedPrecondition(
                        f"weight version {version} is already prepared as {item.kind}; "
                        f"release it before preparing {transport.kind}"
                    )
                described_to = getattr(item, "described_to", None)  # cuda_ipc: its buffer's readers
                if described_to is not None:
                    described_to(receivers)
                return item, False
            if len(self._items) >= self.max_prepared:
                raise ResourceExhausted(
                    f"{len(self._items)} weight versions already prepared (max {self.max_prepared}): "
                    f"release some of {sorted(self._items)} first"
                )
        item = transport.prepare(version, export(), ctx, receivers)
        with self._lock:
            self._items[version] = item
        return item, True

    def release(self, version: int) -> None:
        """Free a version (e.g. unlink its segment). NotFound if it is not prepared."""
        with self._lock:
            item = self._items.pop(version, None)
        if item is None:
            raise NotFound(f"weight version {version} is not prepared")
        item.close()

    def close(self) -> None:
        with self._lock:
            items, self._items = list(self._items.values()), {}
        for item in items:
            item.close()
