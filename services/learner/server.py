"""Learner wiring: settings → `Learner` → the shared server skeleton.

    python -m services.learner --model PATH --port 50053 --loss.kind dapo --optim.lr 4e-4

Under `torchrun --nproc-per-node N -m services.learner ...` rank 0 serves and the other ranks follow
it (ranks.py); only rank 0 binds the port.

Rollouts fetch weights from the address this learner advertises: `--publish.advertise-address`, or
host:port as bound (the skeleton sets `bound_port` before `start()`, so `--port 0` works).
"""

from __future__ import annotations

import math
import os
import sys

import grpc

from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.malloc import keep_freed, set_mmap_threshold
from services.common.serve import run_service, service_names
from services.common.telemetry import Reading
from services.learner.config import LearnerSettings
from services.learner.learner import Learner
from services.learner.model import resolve_device, unavailable
from services.learner.ranks import run_follower
from services.learner.servicer import LearnerServicer
from services.learner.sharding import world_size
from services.transports.chunk_wire import FETCH_PATH, PreEncodedResponses


class LearnerApp:
    """ServiceApp adapter: registers the servicer and starts/stops the `Learner`."""

    service_names = service_names(learner_pb2)

    def __init__(self, settings: LearnerSettings) -> None:
        self.learner = Learner(settings)

    @property
    def bound_port(self) -> int | None:
        """The learner's own `bound_port` (the skeleton sets it here before `start()`)."""
        return self.learner.bound_port

    @bound_port.setter
    def bound_port(self, port: int | None) -> None:
        self.learner.bound_port = port

    def register(self, server: grpc.aio.Server) -> None:
        server_view = PreEncodedResponses(server, [FETCH_PATH])  # FetchWeights yields wire bytes
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(self.learner), server_view)

    async def start(self) -> None:
        await self.learner.start()

    async def stop(self) -> None:
        await self.learner.stop()

    def metrics_snapshot(self) -> list[Reading]:
        """Prometheus view (telemetry.py): step, version and the last step's metrics (loss, grad norm,
        step time, tokens/s, ...) as `grpo_learner_last_step{metric=...}`."""
        snapshot = self.learner.metrics_snapshot()
        if snapshot is None:
            return []
        step, version, metrics = snapshot
        readings = [
            Reading("grpo_learner_step", "Optimizer steps taken.", step),
            Reading("grpo_learner_weight_version", "Newest weight version.", version),
        ]
        readings += [
            Reading(
                "grpo_learner_last_step", "The last optimizer step's metrics, by metric.", v, {"metric": k}
            )
            for k, v in metrics.items()
            if math.isfinite(v)
        ]
        return readings


def main(argv: list[str] | None = None, prog: str = "python -m services.learner") -> None:
    """Rank 0 (the only rank without torchrun) serves; under torchrun the other ranks follow it."""
    settings = LearnerSettings.from_cli(argv, prog=prog)
    device = resolve_device(settings.device)
    if (missing := unavailable(device)) is not None:
        print(f"{prog}: error: --device: {missing} (got {settings.device!r})", file=sys.stderr)
        raise SystemExit(2)
    if settings.keeps_freed(world_size(), device.type):
        keep_freed()  # before the model's first allocation and the service's threads
    elif threshold := settings.mmap_threshold(world_size()):
        set_mmap_threshold(threshold)
    if world_size() > 1 and int(os.environ.get("RANK", "0")) != 0:
        run_follower(settings)
        return
    run_service("learner", lambda: LearnerApp(settings), settings)
