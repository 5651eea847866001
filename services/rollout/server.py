"""Rollout service wiring: settings → `Rollout` → the shared server skeleton.

python -m services.rollout --port 50052 --model ./model --engine vllm --dtype float32
"""

from __future__ import annotations

import gc

import grpc

from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.serve import run_service, service_names
from services.common.telemetry import Reading
from services.rollout.config import RolloutSettings
from services.rollout.registration import Registration, advertised_address
from services.rollout.rollout import Rollout
from services.rollout.servicer import RolloutServicer


class RolloutApp:
    """ServiceApp adapter: registers the servicer and starts/stops the `Rollout` (which creates its
    engine in `Rollout.__init__` and starts it, inside the running loop, in `start()`).

    `freeze_heap`: the process's own server (`main`) freezes the start-up heap once the model is
    loaded (`freeze_heap()`); in-process servers (tests, benchmarks) leave their host's heap alone.
    """

    service_names = service_names(rollout_pb2)

    def __init__(self, settings: RolloutSettings, freeze_heap: bool = False) -> None:
        self.rollout = Rollout(settings)
        self.bound_port: int | None = None
        self.registration: Registration | None = None
        self._registration_config = settings.registration
        self._freeze_heap = freeze_heap

    def register(self, server: grpc.aio.Server) -> None:
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(self.rollout), server)

    async def start(self) -> None:
        await self.rollout.start()
        if self._freeze_heap:
            freeze_heap()
        config = self._registration_config
        if config.scheduler_address:  # once the engine is loaded: the scheduler may send work at once
            self.registration = Registration(config, advertised_address(config, self.bound_port))
            self.registration.start()

    @property
    def fatal(self) -> str:
        """Why this rollout must exit 1 once stopped ("" normally): its engine takes no more work."""
        return getattr(self.rollout.engine, "broken", "")

    async def stop(self) -> None:
        if self.registration is not None:
            await self.registration.stop()
        await self.rollout.stop()

    def metrics_snapshot(self) -> list[Reading]:
        """Prometheus view (telemetry.py): version, load and generated tokens of this rollout."""
        state = self.rollout.state()
        return [
            Reading("grpo_rollout_weight_version", "Weight version the engine serves.", state.weight_version),
            Reading("grpo_rollout_staged_version", "Weight version staged for the next commit (-1: none).",
                    state.staged_version),
            Reading("grpo_rollout_requests_in_flight", "Generate requests in flight.", state.in_flight),
            Reading("grpo_rollout_max_in_flight", "Generate requests accepted at once.", state.max_in_flight),
            Reading("grpo_rollout_completion_tokens", "Completion tokens generated.", state.tokens_generated,
                    counter=True),
            Reading("grpo_rollout_ready", "1 when serving requests (not loading, updating or draining).",
                    1.0 if state.status.value == "ready" else 0.0),
        ]  # fmt: skip


def freeze_heap() -> None:
    """Take everything allocated until now (torch, transformers, the vLLM front-end: ~600k objects)
    out of the garbage collector's reach, as vLLM's own server does after start-up (`freeze_gc_heap`).

    Otherwise every full collection walks all of them, on the event loop: under Generate load that
    was a 0.4-0.5 s stall every 10-20 s (the recurring loop-lag warnings of demo runs).
    """
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None, prog: str = "python -m services.rollout") -> None:
    settings = RolloutSettings.from_cli(argv, prog=prog)
    run_service("rollout", lambda: RolloutApp(settings, freeze_heap=True), settings)
