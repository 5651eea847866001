"""vLLM worker extension: load a staged weight version in place, inside each worker process.

vLLM appends this class to its worker's bases (`worker_extension_cls=`), and the rollout calls
`grpo_load_weights` through `AsyncLLM.collective_rpc` on every worker. Arguments are plain data (a
transport kind, its JSON-like spec, and the manifest's tensors as lists), because vLLM's msgpack RPC
rejects dtypes objects and does not reliably carry tensors; the transport's engine half
(`services.transports.registry.open_tensors`) rebuilds zero-copy tensor views here: no pickle.

Loading goes through the worker's `reload_weights(weights_iterator=..., is_checkpoint_format=True)`
(layer-wise, quantisation-safe, works on the CPU backend where plain `model.load_weights` fails).
The tensors are HF-named `state_dict()` items including `lm_head.weight`, so tied heads update.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from services.common.weights import TensorEntry
from services.transports import LoadPlan, TransportKind
from services.transports.registry import open_tensors


class GrpoWorkerExtension:
    """Mixed into vLLM's worker class; methods run inside each worker process."""

    def grpo_load_weights(
        self, kind: str, spec: dict[str, Any], tensors: list[list[Any]]
    ) -> dict[str, float]:
        """Open the staged version `spec` of transport `kind`, load every listed tensor; return timings."""
        started = time.perf_counter()
        entries = [
            TensorEntry(name, dtype, tuple(shape), offset, nbytes)
            for name, dtype, shape, offset, nbytes in tensors
        ]
        with open_tensors(LoadPlan(TransportKind(kind), spec), entries) as weights:
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"worker_load_ms": (time.perf_counter() - started) * 1e3, "tensors": float(len(entries))}
