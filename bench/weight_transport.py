"""Weight-transport benchmark: every implemented transport, measured in one run against baselines
measured in the same run: grpc_stream, a plain copy of the same bytes in the transport's medium
(host memcpy for grpc_stream/shared_memory/nccl-over-Gloo; device-to-device copy for cuda_ipc and
nccl on CUDA), and for grpc_stream a raw gRPC byte stream (the same bytes in chunks of the same size
as plain `bytes` messages, no protobuf, received into memory, server and client in this process as the
learner and the rollout half are here): what gRPC itself costs, so the stream's overhead shows.

A real Learner service (in-process gRPC server on 127.0.0.1:0) publishes the weights of a random
Qwen2 model of the chosen size; the rollout's real staging code (`services.rollout.weight_sync`,
which calls each transport's rollout half in `services/transports/`, with the engine's worker half
in this process, or with `--stage-in process` in a second one) fetches, receives or attaches them and
verifies their checksums. cuda_ipc always stages in a second process: CUDA opens no IPC handle in the
process that exported it ("invalid device context", seen on an H200). Reports prepare
(learner: pack + checksum) and stage (fetch/receive/attach + verify) times and bandwidth. Loading
into an engine is not included (it does not depend on the transport). cuda_ipc needs a GPU
(`--device cuda`); nccl runs over Gloo on CPU, and over NCCL from GPU 0 to GPU 1 where there are two.

    .venv/bin/python bench/weight_transport.py --hidden 512 --layers 8 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.clients import grpc_options, open_channel
from services.common.serve import start_server
from services.common.weights import CHUNK_BYTES
from services.learner.config import LearnerSettings
from services.learner.server import LearnerApp
from services.rollout.weight_sync import WeightStager
from services.transports import WorkerContext
from services.transports.registry import TRANSPORTS, LocalWorkers, kind_to_proto, target_from_proto

# Every implemented transport (grpc_stream first: the baseline the others are compared with).
KINDS = {kind.value: kind_to_proto(kind) for kind in TRANSPORTS}


def build_model(directory: Path, hidden: int, layers: int, vocab: int) -> int:
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def copy_ms(nbytes: int, device: torch.device, repeats: int) -> float:
    """The medium's physical baseline: one plain copy of `nbytes` (host memcpy, or device to device)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[1:])


async def raw_stream_ms(nbytes: int, chunk: int, repeats: int) -> float:
    """A raw grpc.aio server stream of `nbytes` as `chunk`-sized `bytes` messages (identity
    serializers), each copied into a receive buffer; median over `repeats` after one warm-up."""
    source = memoryview(bytearray(nbytes))

    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        for offset in range(0, nbytes, chunk):
            yield bytes(source[offset : offset + chunk])

    handler = grpc.unary_stream_rpc_method_handler(stream)  # no (de)serializers: bytes as they are
    server = grpc.aio.server(options=grpc_options(2 * chunk))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Raw", {"Stream": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = open_channel(f"127.0.0.1:{port}", 2 * chunk)
    call = channel.unary_stream("/bench.Raw/Stream")
    received = memoryview(bytearray(nbytes))
    times = []
    try:
        for _ in range(repeats + 1):
            started, offset = time.perf_counter(), 0
            async for data in call(b"", timeout=600):
                received[offset : offset + len(data)] = data
                offset += len(data)
            assert offset == nbytes
            times.append((time.perf_counter() - started) * 1e3)
    finally:
        await channel.close()
        await server.stop(None)
    return statistics.median(times[1:])


class InProcess:
    """The rollout's staging half in this process: one stager across versions, as a rollout has it
    (what a transport keeps between versions, e.g. grpc_stream's receive segment, is kept)."""

    def __init__(self, device: torch.device) -> None:
        self.stager = WeightStager(
            "bench", fetch_timeout_s=600, workers=LocalWorkers(WorkerContext({}, 0, device))
        )

    async def stage_ms(self, message: types_pb2.WeightVersion) -> float:
        started = time.perf_counter()
        staged = await self.stager.stage(target_from_proto(message), current_version=-1)
        elapsed = (time.perf_counter() - started) * 1e3
        await self.stager.abort(staged.version)  # released, as after its commit
        return elapsed

    def close(self) -> None:
        self.stager.close()


ANSWER = "stage_ms="


class InChild:
    """The same staging half in a second process (`--stage-child`): each version's WeightVersion goes
    over its stdin as hex-encoded protobuf, its stage time comes back on its stdout."""

    def __init__(self, device: torch.device) -> None:
        root = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--stage-child", str(device)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip

    async def stage_ms(self, message: types_pb2.WeightVersion) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(message.SerializeToString().hex() + "\n")
        self.proc.stdin.flush()
        while answer := await asyncio.to_thread(self.proc.stdout.readline):
            if answer.startswith(ANSWER):  # other lines: the child's log
                return float(answer.removeprefix(ANSWER))
        raise RuntimeError(f"the staging process ended (exit {self.proc.wait()})")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def stage_child(device: str) -> None:
    """`--stage-child`: stage every WeightVersion read from stdin, answer its stage time in ms."""

    async def serve() -> None:
        stager = InProcess(torch.device(device))
        while line := await asyncio.to_thread(sys.stdin.readline):
            message = types_pb2.WeightVersion.FromString(bytes.fromhex(line.strip()))
            print(f"{ANSWER}{await stager.stage_ms(message)}", flush=True)
        stager.close()

    asyncio.run(serve())


async def measure(model_dir: Path, repeats: int, device: str, stage_in: str = "thread") -> dict[str, dict]:
    settings = LearnerSettings(model=str(model_dir), device=device, dtype="float32", port=0)
    app = LearnerApp(settings)
    running = await start_server(app, settings)
    channel = open_channel(running.address)
    learner = learner_pb2_grpc.LearnerServiceStub(channel)
    # NCCL allows one rank per GPU: over NCCL the receiving worker sits on a second GPU
    nccl_device = "cpu" if device == "cpu" else ("cuda:1" if torch.cuda.device_count() > 1 else None)
    receivers = [learner_pb2.WeightReceiver(rollout_id="bench", instance_id="bench", workers=1)]
    results: dict[str, dict] = {}
    try:
        for name, kind in KINDS.items():
            if name == "cuda_ipc" and device != "cuda":
                results[name] = {"skipped": "needs the learner and the rollout on one CUDA GPU"}
                continue
            if name == "nccl" and nccl_device is None:
                results[name] = {"skipped": "NCCL needs a second GPU (one rank per device)"}
                continue
            # the rollout engine's one worker (as the transformers engine has it); the first version is
            # the warm-up
            worker_device = torch.device(nccl_device if name == "nccl" else device)
            stager = (
                InChild(worker_device)
                if stage_in == "process" or name == "cuda_ipc"
                else InProcess(worker_device)
            )
            medium = "device" if name == "cuda_ipc" or (name == "nccl" and device == "cuda") else "host"
            rows = results[name] = {"medium": medium, "prepare_ms": [], "stage_ms": [], "bytes": []}
            try:
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    request = learner_pb2.PrepareWeightsRequest(transport=kind, receivers=receivers)
                    prepared = await learner.PrepareWeights(request, timeout=600)
                    t1 = time.perf_counter()
                    rows["stage_ms"].append(await stager.stage_ms(prepared.weight_version))
                    await learner.ReleaseWeights(
                        learner_pb2.ReleaseWeightsRequest(version=prepared.weight_version.version), timeout=60
                    )
                    rows["prepare_ms"].append((t1 - t0) * 1e3)
                    rows["bytes"].append(prepared.weight_version.total_bytes)
            finally:
                stager.close()
            for column in ("prepare_ms", "stage_ms"):
                rows[column] = rows[column][1:]
    finally:
        await channel.close()
        await running.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--stage-in",
        choices=["thread", "process"],
        default="thread",
        help="Where the rollout's staging half runs: this process, or a second one (cuda_ipc: always).",
    )
    parser.add_argument("--stage-child", metavar="DEVICE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage_child:
        stage_child(args.stage_child)
        return
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(Path(tmp), args.hidden, args.layers, args.vocab)
        results = asyncio.run(measure(Path(tmp), args.repeats, args.device, args.stage_in))
    nbytes = results["grpc_stream"]["bytes"][0]
    raw_ms = asyncio.run(raw_stream_ms(nbytes, CHUNK_BYTES, args.repeats))
    baselines = {"host": copy_ms(nbytes, torch.device("cpu"), args.repeats)}
    if args.device == "cuda":
        baselines["device"] = copy_ms(nbytes, torch.device("cuda"), args.repeats)
    base = statistics.median(results["grpc_stream"]["stage_ms"])
    print(
        f"model: {params / 1e6:.1f}M params, {nbytes / 2**20:.0f} MiB fp32, learner on {args.device}; "
        f"median of {args.repeats} after one warm-up version"
    )
    for medium, ms in baselines.items():
        print(
            f"baseline {medium} copy of the same bytes: {ms:.1f} ms ({nbytes / 2**30 / (ms / 1e3):.2f} GiB/s)"
        )
    print(
        f"baseline raw gRPC byte stream of the same bytes ({CHUNK_BYTES >> 10} KiB messages): "
        f"{raw_ms:.1f} ms ({nbytes / 2**30 / (raw_ms / 1e3):.2f} GiB/s); grpc_stream stage vs raw: "
        f"{raw_ms / base:.2f}x"
    )
    print(
        f"{'transport':<15}{'prepare ms':>12}{'stage ms':>12}{'stage GiB/s':>13}{'vs grpc':>10}"
        f"{'vs its medium copy':>20}"
    )
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<15}  skipped: {r['skipped']}")
            continue
        stage = statistics.median(r["stage_ms"])
        gibps = r["bytes"][0] / 2**30 / (stage / 1e3)
        prepare = statistics.median(r["prepare_ms"])
        medium = baselines[r["medium"]]
        print(
            f"{name:<15}{prepare:>12.1f}{stage:>12.1f}{gibps:>13.2f}{base / stage:>9.2f}x"
            f"{medium / stage:>13.2f}x ({r['medium']})"
        )


if __name__ == "__main__":
    main()
