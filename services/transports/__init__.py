"""Weight transports: how a published weight version travels from the learner to the rollouts.

One module per transport, each holding its learner, rollout and engine halves (`base.py` is the
contract, `registry.py` says which kinds exist, `kinds.py` is the torch-free part the scheduler uses):

| kind            | module             | where                                      |
|-----------------|--------------------|--------------------------------------------|
| `grpc_stream`   | `grpc_stream.py`   | anywhere: FetchWeights chunk stream        |
| `shared_memory` | `shared_memory.py` | same host: a POSIX segment, zero copy      |
| `cuda_ipc`      | `cuda_ipc.py`      | same GPU: rollouts attach to learner memory |
| `nccl`          | `nccl.py`          | other GPUs / hosts: NCCL; CPU: Gloo        |
| `checkpoint`    | planned            | shared file system                         |

This package depends only on `services.common` and the generated contracts; the learner and the
rollout use it, the scheduler only names kinds. Importing the package loads no torch: the names from
`base.py` are resolved on first use, so `from services.transports import TransportKind` in the
scheduler stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from services.transports.kinds import Receiver, TransportKind

if TYPE_CHECKING:
    from services.transports.base import (
        EngineWorkers,
        LoadPlan,
        Prepared,
        PublishContext,
        StageContext,
        Staged,
        StageTarget,
        WeightTransport,
        WorkerContext,
    )

_FROM_BASE = {
    "EngineWorkers",
    "LoadPlan",
    "Prepared",
    "PublishContext",
    "StageContext",
    "Staged",
    "StageTarget",
    "WeightTransport",
    "WorkerContext",
}


def __getattr__(name: str) -> Any:
    if name in _FROM_BASE:
        return getattr(importlib.import_module("services.transports.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EngineWorkers",
    "LoadPlan",
    "Prepared",
    "PublishContext",
    "Receiver",
    "StageContext",
    "StageTarget",
    "Staged",
    "TransportKind",
    "WeightTransport",
    "WorkerContext",
]
