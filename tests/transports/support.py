"""Test support for weights in flight: packed state_dicts, a small REAL FetchWeights server,
perturbed state_dicts and reference logprobs (used by tests/transports and tests/rollout).

`WeightsServer` is a genuine gRPC LearnerService that serves FetchWeights from a state_dict packed
with services/common/weights.py (the learner's packing code), so the grpc_stream rollout half is
exercised end to end without depending on the learner service package.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import grpc
import torch

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common import weights as W
from services.common.clients import grpc_options
from services.common.config import CONTROL_MESSAGE_BYTES
from services.transports.shared_memory import create_segment


def sample_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small state_dict of three dtypes whose fp32 tensor spans several 256 KiB buckets."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(300, 400, generator=generator),
        "b.bias": torch.randn(7, generator=generator).to(torch.bfloat16),
        "c.steps": torch.arange(5),
    }


def perturbed_state(model: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """state_dict() (incl. the tied lm_head.weight) with seeded Gaussian noise on every float tensor."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.dtype)
        state[name] = (tensor + scale * noise) if tensor.is_floating_point() else tensor.clone()
    # keep ties tied: lm_head aliases embed_tokens in the model
    if "lm_head.weight" in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def model_with_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    clone = copy.deepcopy(model)
    clone.load_state_dict(state)
    return clone.eval()


@torch.inference_mode()
def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token: the convention every service follows. [C]"""
    ids = torch.tensor([prompt + completion])  # [1, P+C]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [C, V]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)  # [C, V]
    return logprobs.gather(-1, torch.tensor(completion)[:, None])[:, 0]  # [C]


class Packed:
    """A state_dict packed into bytes with its manifest (bucketed small so several buckets exist)."""

    def __init__(self, state: dict[str, torch.Tensor], bucket_bytes: int = 256 << 10) -> None:
        entries = W.plan_layout(state)
        self.data = bytearray(W.packed_size(entries))
        self.manifest = W.build_manifest(state, memoryview(self.data), bucket_bytes)

    def weight_version(self, version: int) -> types_pb2.WeightVersion:
        message = types_pb2.WeightVersion(version=version, parent_version=version - 1)
        W.manifest_to_proto(self.manifest, message)
        return message

    def to_segment(self, name: str):
        segment = create_segment(name, len(self.data))
        segment.buf[: len(self.data)] = self.data
        return segment


Tamper = Callable[[list[types_pb2.WeightChunk]], list[types_pb2.WeightChunk]]


class _FetchServicer(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self) -> None:
        self.versions: dict[int, Packed] = {}
        self.corrupt: set[int] = set()
        self.tamper: dict[int, Tamper] = {}  # version -> what a faulty learner does to its chunk list

    async def FetchWeights(self, request, context):
        packed = self.versions.get(request.version)
        if packed is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"version {request.version} is not prepared")
        chunks = []
        for bucket, offset, size in W.chunk_ranges(packed.manifest.buckets):
            data = bytes(packed.data[offset : offset + size])
            if request.version in self.corrupt and offset == 0:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            chunk = types_pb2.WeightChunk(version=request.version, bucket=bucket, offset=offset, data=data)
            chunks.append(chunk)
        for chunk in self.tamper[request.version](chunks) if request.version in self.tamper else chunks:
            yield learner_pb2.FetchWeightsResponse(chunk=chunk)


class WeightsServer:
    """A real grpc.aio server with a LearnerService that only answers FetchWeights."""

    def __init__(self) -> None:
        self.servicer = _FetchServicer()
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def __aenter__(self) -> WeightsServer:
        self.server = grpc.aio.server(options=grpc_options(CONTROL_MESSAGE_BYTES))
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(None)

    def publish(
        self, version: int, packed: Packed, corrupt: bool = False, tamper: Tamper | None = None
    ) -> types_pb2.WeightVersion:
        """Serve `packed` as `version`; returns the WeightVersion for the grpc_stream transport."""
        self.servicer.versions[version] = packed
        if corrupt:
            self.servicer.corrupt.add(version)
        if tamper is not None:
            self.servicer.tamper[version] = tamper
        message = packed.weight_version(version)
        message.grpc_stream.address = self.address
        message.grpc_stream.chunk_bytes = W.CHUNK_BYTES
        return message
