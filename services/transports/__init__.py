"""Weight transports: how a published weight version travels from the learner to the rollouts.

One module per transport, each holding its learner, rollout and engine halves (`base.py` is the
contract, `registry.py` says which kinds exist):

| kind            | module             | where                                      |
|-----------------|--------------------|--------------------------------------------|
| `grpc_stream`   | `grpc_stream.py`   | anywhere: FetchWeights chunk stream        |
| `shared_memory` | `shared_memory.py` | same host: a POSIX segment, zero copy      |
| `cuda_ipc`      | `cuda_ipc.py`      | same GPU: rollouts attach to learner memory |
| `nccl`          | `nccl.py`          | other GPUs / hosts: NCCL; CPU: Gloo        |
| `checkpoint`    | planned            | shared file system                         |

This package depends only on `services.common` and the generated contracts; the learner and the
rollout use it, the scheduler only names kinds.
"""

from services.transports.base import (
    EngineWorkers,
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
