"""Pure request checks of the rollout service (no I/O, no engine).

Validation raises `InvalidArgument` with a message naming the offending field, so a scheduler bug
is reported as the caller's fault and never retried unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common import validation as check
from services.common.errors import InvalidArgument, quoted
from services.rollout.config import RequestLimits
from services.rollout.engine import Sampling
from services.rollout.templates import MessageInput

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PromptInput:
    """A prompt as the rollout sees it: plain text or chat messages (role, content) with the tools the
    template renders, or (token-in) the token ids to continue, which then replace both."""

    prompt_id: str
    text: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    tools_json: str = ""
    token_ids: tuple[int, ...] = ()


DEFAULT_LIMITS = RequestLimits()


def validate_prompt(prompt: PromptInput, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """A bounded id; exactly one of text / messages (unless token ids are given: then neither is
    read); chat roles must be known and contents non-empty."""
    check.text_id(prompt.prompt_id, "prompt.id", limits.max_id_chars, required=False)
    if prompt.token_ids:
        return
    if bool(prompt.text) == bool(prompt.messages):
        which = "both" if prompt.text else "neither"
        raise InvalidArgument(
            f"prompt {prompt.prompt_id!r}: set exactly one of text / messages ({which} set)"
        )
    for position, (role, content) in enumerate(prompt.messages):
        if role not in CHAT_ROLES:
            raise InvalidArgument(
                f"prompt.messages[{position}].role must be one of {CHAT_ROLES}, got {quoted(role)}"
            )
        if not content:
            raise InvalidArgument(f"prompt.messages[{position}].content is empty")


def validate_sampling(
    sampling: Sampling, limits: RequestLimits = DEFAULT_LIMITS, max_model_len: int = 0
) -> None:
    """1 ≤ n ≤ max_n, 1 ≤ max_tokens < max_model_len, 0 < temperature ≤ max_temperature, 0 < top_p ≤ 1,
    top_k ≥ 0, seed ≥ 0, a bounded number of non-empty, bounded stop strings."""
    if not 1 <= sampling.n <= limits.max_n:
        raise InvalidArgument(f"sampling_params.n must be in [1, {limits.max_n}], got {sampling.n}")
    if sampling.max_tokens < 1 or (max_model_len and sampling.max_tokens >= max_model_len):
        bound = f", < max_model_len {max_model_len}" if max_model_len else ""
        raise InvalidArgument(f"sampling_params.max_tokens must be >= 1{bound}, got {sampling.max_tokens}")
    if not sampling.temperature > 0:
        raise InvalidArgument(
            f"sampling_params.temperature must be > 0 (greedy is not supported: behaviour logprobs need "
            f"a sampling distribution), got {sampling.temperature}"
        )
    check.temperature(sampling.temperature, "sampling_params.temperature", limits.max_temperature)
    if not 0 < sampling.top_p <= 1:
        raise InvalidArgument(f"sampling_params.top_p must be in (0, 1] (1 = off), got {sampling.top_p}")
    if sampling.top_k < 0:
        raise InvalidArgument(f"sampling_params.top_k must be >= 0 (0 = off), got {sampling.top_k}")
    if sampling.seed < 0:
        raise InvalidArgument(f"sampling_params.seed must be >= 0 (0 = unseeded), got {sampling.seed}")
    if len(sampling.stop) > limits.max_stop_strings:
        raise InvalidArgument(
            f"sampling_params.stop has {len(sampling.stop)} strings (max {limits.max_stop_strings})"
        )
    for index, stop in enumerate(sampling.stop):
        if not stop:
            raise InvalidArgument("sampling_params.stop contains an empty string")
        if len(stop) > limits.max_stop_chars:
            raise InvalidArgument(
                f"sampling_params.stop[{index}] is {len(stop)} characters (max {limits.max_stop_chars})"
            )


def normalize_sampling(sampling: Sampling) -> Sampling:
    """Fill proto3 zero defaults: top_p 0 means "unset" and becomes 1.0 (off)."""
    if sampling.top_p == 0:
        return Sampling(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=1.0,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            stop=sampling.stop,
        )
    return sampling


def validate_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Every id must index the model's vocabulary."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # C loops: a long prompt costs ~0.1 ms
        return
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(
                f"{field}[{position}] = {token} is outside the vocabulary [0, {vocab_size})"
            )


def validate_score_request(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    temperature: float,
    vocab_size: int,
    max_len: int,
) -> None:
    """A scorable sequence: non-empty prompt and completion, T > 0, ids in vocab, fits the context."""
    if not prompt_ids:
        raise InvalidArgument("sequence.prompt_token_ids is empty")
    if not completion_ids:
        raise InvalidArgument("sequence.completion_token_ids is empty")
    check.temperature(temperature, "sequence.temperature")
    total = len(prompt_ids) + len(completion_ids)
    if total >= max_len:  # engines need room for one more position (vLLM rejects prompt == max_model_len)
        raise InvalidArgument(f"sequence has {total} tokens; it must be shorter than max_model_len {max_len}")
    validate_token_ids(prompt_ids, vocab_size, "sequence.prompt_token_ids")
    validate_token_ids(completion_ids, vocab_size, "sequence.completion_token_ids")


def validate_prompt_tokens(ids: Sequence[int], max_tokens: int, vocab_size: int, max_model_len: int) -> None:
    """Token-in: ids in the vocabulary, and room for `max_tokens` more (prompt + max_tokens ≤
    max_model_len)."""
    validate_token_ids(ids, vocab_size, "prompt_token_ids")
    if len(ids) + max_tokens > max_model_len:
        raise InvalidArgument(
            f"prompt_token_ids has {len(ids)} tokens; with sampling_params.max_tokens {max_tokens} that is "
            f"more than max_model_len {max_model_len}"
        )


def validate_render_request(
    mode: str,
    messages: Sequence[MessageInput],
    tools_json: str,
    previous_tail: Sequence[int],
    text: str,
    limits: RequestLimits,
    vocab_size: int,
) -> None:
    """A RenderMessages request: a known mode; messages for conversation / bridge (bounded in number
    and size, known roles), a text for text; a bounded previous_tail of vocabulary ids."""
    if mode not in ("conversation", "bridge", "text"):
        raise InvalidArgument("mode must be RENDER_MODE_CONVERSATION, RENDER_MODE_BRIDGE or RENDER_MODE_TEXT")
    if mode == "text":
        if not text:
            raise InvalidArgument("text is empty (RENDER_MODE_TEXT renders it)")
    elif not messages:
        raise InvalidArgument(f"messages is empty (RENDER_MODE_{mode.upper()} renders them)")
    if len(messages) > limits.max_render_messages:
        raise InvalidArgument(f"messages has {len(messages)} messages (max {limits.max_render_messages})")
    chars = len(tools_json) + len(text)
    for position, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{position}].role must be one of {CHAT_ROLES}, got {quoted(message.role)}"
            )
        chars += len(message.content) + len(message.tool_call_id) + len(message.name)
        chars += sum(len(c.id) + len(c.name) + len(c.arguments_json) for c in message.tool_calls)
    if chars > limits.max_render_chars:
        raise InvalidArgument(
            f"the request renders {chars} characters (max {limits.max_render_chars}: [rollout.limits] "
            "max_render_chars)"
        )
    if len(previous_tail) > limits.max_previous_tail:
        raise InvalidArgument(
            f"previous_tail has {len(previous_tail)} tokens (max {limits.max_previous_tail})"
        )
    validate_token_ids(previous_tail, vocab_size, "previous_tail")
