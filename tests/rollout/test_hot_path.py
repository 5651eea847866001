"""The per-request path of the rollout, without an engine: reading vLLM's sampled-token logprobs,
decoding a completion's text as vLLM would, building Completion protos from a per-request template,
tokenizing on the loop or in a thread."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo.common.v1 import types_pb2
from services.rollout.config import RolloutSettings
from services.rollout.engine import FinishedCompletion, Sampling, VersionSpan
from services.rollout.rollout import INLINE_TOKENIZE_CHARS, Generated, Rollout
from services.rollout.servicer import completion_template, fill_completion, generate_response
from services.rollout.validation import PromptInput
from services.rollout.vllm_engine import VllmEngine
from services.rollout.vllm_outputs import completion_text, sampled_logprobs


def flat(token_ids: list[int], logprobs: list[float]) -> SimpleNamespace:
    """vLLM's FlatLogprobs as far as the rollout reads it (one entry per position: logprobs=0)."""
    return SimpleNamespace(token_ids=token_ids, logprobs=logprobs)


def test_flat_logprobs_are_taken_as_they_are() -> None:
    logprobs = [-0.5, -1.25, -3.0]
    assert sampled_logprobs(flat([5, 7, 9], logprobs), [5, 7, 9]) is logprobs


def test_vllms_own_flat_logprobs_are_read_without_a_per_token_loop() -> None:
    logprobs_module = pytest.importorskip("vllm.logprobs")
    positions = logprobs_module.FlatLogprobs()
    for token, value in ((5, -0.5), (7, -1.25)):
        positions.append({token: logprobs_module.Logprob(logprob=value, rank=1, decoded_token=None)})
    assert sampled_logprobs(positions, [5, 7]) is positions.logprobs == [-0.5, -1.25]


def test_per_position_logprobs_are_read_by_sampled_token() -> None:
    positions = [{5: SimpleNamespace(logprob=-0.5)}, {7: SimpleNamespace(logprob=-1.0), 3: None}]
    assert sampled_logprobs(positions, [5, 7]) == [-0.5, -1.0]


def test_flat_logprobs_that_do_not_line_up_fall_back_or_fail() -> None:
    class Flat(list):  # a flat view whose entries are not one per sampled token
        token_ids = (5, 6)
        logprobs = (-0.5, -0.7)

    positions = Flat([{5: SimpleNamespace(logprob=-0.5)}, {7: SimpleNamespace(logprob=-2.0)}])
    assert sampled_logprobs(positions, [5, 7]) == [-0.5, -2.0]
    with pytest.raises(RuntimeError, match="1 logprobs for 2 tokens"):
        sampled_logprobs([{5: SimpleNamespace(logprob=-0.5)}], [5, 7])
    with pytest.raises(RuntimeError, match="no logprobs"):
        sampled_logprobs(None, [5])
    assert sampled_logprobs(None, []) == []


def finished(index: int, tokens: tuple[int, ...], spans: tuple[VersionSpan, ...]) -> FinishedCompletion:
    return FinishedCompletion(
        index=index,
        token_ids=tokens,
        logprobs=tuple(-0.25 * (i + 1) for i in range(len(tokens))),
        finish_reason="length" if index else "stop",
        version_spans=spans,
        text=f"text{index}",
    )


def generated(*completions: FinishedCompletion) -> Generated:
    return Generated("p1", (1, 2, 3), Sampling(n=3, temperature=0.5, max_tokens=4, seed=9), completions)


def test_completions_of_one_request_share_a_template_but_nothing_else() -> None:
    first = finished(0, (10, 11), (VersionSpan(3, 0, 2),))
    second = finished(1, (12, 13, 14), (VersionSpan(3, 0, 1), VersionSpan(4, 1, 3)))
    third = finished(2, (15,), (VersionSpan(4, 0, 1),))
    together, later = generated(first, second), generated(third)
    template = completion_template(together, "r0")
    responses = [generate_response(together, template), generate_response(later, template)]
    assert [len(r.completions) for r in responses] == [2, 1]  # one message per finishing step
    for item, message in zip(
        (first, second, third), [c for r in responses for c in r.completions], strict=True
    ):
        alone = types_pb2.Completion()  # the same completion built from a template of its own
        fill_completion(alone, item, completion_template(generated(item), "r0"))
        assert message == alone
    one, two = responses[0].completions
    assert (one.index, list(one.completion_token_ids), one.text) == (0, [10, 11], "text0")
    assert (two.index, list(two.completion_token_ids), two.text) == (1, [12, 13, 14], "text1")
    assert list(two.logprobs) == [-0.25, -0.5, -0.75] and len(one.logprobs) == 2
    assert [(s.version, s.start, s.end) for s in two.version_spans] == [(3, 0, 1), (4, 1, 3)]
    assert [(s.version, s.start, s.end) for s in one.version_spans] == [(3, 0, 2)]
    assert one.finish_reason == types_pb2.FINISH_REASON_STOP
    assert two.finish_reason == types_pb2.FINISH_REASON_LENGTH
    for message in (c for r in responses for c in r.completions):
        assert message.prompt_id == "p1" and list(message.prompt_token_ids) == [1, 2, 3]
        assert message.rollout_id == "r0" and message.sampling_params.seed == 9
    assert len(template.completion_token_ids) == 0  # the template itself is never written


def sample(index: int, tokens: list[int], finish: str | None) -> SimpleNamespace:
    """A vLLM `CompletionOutput` delta as the rollout reads it (flat logprobs, text, finish reason)."""
    return SimpleNamespace(
        index=index,
        token_ids=tokens,
        logprobs=flat(tokens, [-0.5] * len(tokens)),
        text="".join(map(str, tokens)),
        finish_reason=finish,
        weight_versions=None,
    )


async def test_vllm_samples_finishing_in_one_output_are_yielded_together() -> None:
    """Each vLLM `RequestOutput` becomes at most one list (one stream message): samples that finish in
    it go together, with their first-token deltas joined; an output finishing nothing yields nothing."""
    sampling_params = pytest.importorskip("vllm.sampling_params")
    outputs = [
        [sample(0, [1], None), sample(1, [2], None), sample(2, [3], None)],  # first tokens
        [sample(1, [4, 5], "length"), sample(2, [6, 7], "length")],  # two finish in one step
        [sample(0, [8], None)],  # a delta that finishes nothing
        [sample(0, [9], "stop")],
    ]

    async def stream():
        for samples in outputs:
            yield SimpleNamespace(outputs=samples)

    engine = VllmEngine(RolloutSettings(model="unused"))
    engine._SamplingParams = sampling_params.SamplingParams
    engine._delta = sampling_params.RequestOutputKind.DELTA
    engine._llm = SimpleNamespace(generate=lambda *args, **kwargs: stream())
    engine._engine_input = lambda ids: ids  # type: ignore[method-assign]
    got = [finished async for finished in engine.generate([7], Sampling(n=3, max_tokens=3), "r")]
    assert [[(c.index, c.token_ids, c.text) for c in finished] for finished in got] == [
        [(1, (2, 4, 5), "245"), (2, (3, 6, 7), "367")],
        [(0, (1, 8, 9), "189")],
    ]
    assert [c.finish_reason for c in got[0] + got[1]] == ["length", "length", "stop"]


async def test_short_prompts_tokenize_inline_long_ones_in_a_thread(tiny_model_dir: Path) -> None:
    settings = RolloutSettings.load(model=str(tiny_model_dir), engine="transformers")
    rollout = Rollout(settings, engine=SimpleNamespace(max_model_len=100_000, adapters_refused=""))  # type: ignore[arg-type]
    rollout._load_tokenizer()
    tokenize, seen = rollout._tokenize, []

    def spy(prompt: PromptInput) -> list[int]:
        seen.append((prompt.prompt_id, threading.current_thread() is threading.main_thread()))
        return tokenize(prompt)

    rollout._tokenize = spy  # type: ignore[method-assign]
    try:
        prompts = [
            PromptInput("short", text="12+34="),
            PromptInput("long", text="1+2=" * (INLINE_TOKENIZE_CHARS // 4 + 1)),
            PromptInput("chat", messages=(("user", "2+2?"),)),
        ]
        for prompt in prompts:
            ids = await rollout.tokenize(prompt)
            assert ids and ids == tokenize(prompt)
        assert seen == [("short", True), ("long", False), ("chat", False)]
    finally:
        rollout._tokenize_pool.shutdown()


def test_completion_text_is_what_vllms_detokenizer_gives(tiny_model_dir: Path) -> None:
    detokenizer = pytest.importorskip("vllm.v1.engine.detokenizer")
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    prompt = tokenizer("12+34=")["input_ids"]
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    cases = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    cases += [tokenizer("57 apples, é ü 你好")["input_ids"] + [eos], [eos], [rng.randrange(vocab), eos]]
    for ids in cases:
        stop = ids[-1] == eos  # a completion that ended on EOS (finish reason "stop")
        request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams())
        reference = detokenizer.FastIncrementalDetokenizer(tokenizer, request)
        reference.update(ids, stop)
        assert completion_text(tokenizer._tokenizer, prompt, ids, stop) == reference.output_text, ids
