"""The token routes' vLLM extensions the rollout has no field for: `logprobs` 0/1 (the sampled token's
logprob, all the rollout returns) and `stop_token_ids` (each choice cut at its first stop token)."""

from __future__ import annotations

from grpo.common.v1 import types_pb2
from services.gateway.errors import ApiError, invalid
from services.gateway.limits import MAX_TOKEN_ID

# most ids in one request's stop_token_ids; token ids are int32
MAX_STOP_TOKEN_IDS = 256


def sampled_logprob_only(value: int | None, param: str) -> None:
    """vLLM's `logprobs` of the token-in routes: None, 0 and 1 are served, all three with each
    position's sampled token's logprob (the rollout returns nothing else; vLLM's 1 would add the top
    alternative, which a trainer reading the sampled token's logprob never uses). More is a 400."""
    if value is not None and not 0 <= value <= 1:
        raise ApiError(
            400,
            f"{param}={value}: only the sampled token's logprob is served (the rollout returns no "
            "alternatives per position); send 0 or 1, or leave it out",
            param,
            code="unsupported",
        )


def stop_token_set(ids: list[int] | None, param: str) -> frozenset[int]:
    """A request's `stop_token_ids`, checked (at most MAX_STOP_TOKEN_IDS, each a token id >= 0)."""
    if not ids:
        return frozenset()
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"{param}: at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}", param)
    bad = next((t for t in ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise invalid(f"{param}: {bad} is not a token id", param)
    return frozenset(ids)


def cut_at_stop_token(completion: types_pb2.Completion, stop: frozenset[int]) -> types_pb2.Completion:
    """`completion` ended at its first token in `stop` (kept as its last token, finish reason stop), as
    vLLM's `stop_token_ids` ends it; unchanged when it has none. The rollout's sampling params carry
    stop strings only, so the gateway cuts what the rollout sampled: sampling is autoregressive, so the
    tokens up to the stop token and their logprobs and versions are exactly what an engine stopping
    there would have given; only the compute spent after it is wasted. Version spans are cut with it
    (a token-in generation has no turns); the text, which the token route does not answer with and the
    gateway (no tokenizer) cannot cut, is cleared."""
    ids = completion.completion_token_ids
    end = next((i + 1 for i, token in enumerate(ids) if token in stop), None)
    if end is None:
        return completion
    cut = types_pb2.Completion()
    cut.CopyFrom(completion)
    del cut.completion_token_ids[end:]
    del cut.logprobs[end:]
    cut.finish_reason = types_pb2.FINISH_REASON_STOP
    cut.text = ""
    del cut.version_spans[:]
    for span in completion.version_spans:
        if span.start < end:
            cut.version_spans.add(version=span.version, start=span.start, end=min(span.end, end))
    return cut
