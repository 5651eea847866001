"""Request checks and the translation of request bodies into rollout protos (pure: no I/O).

Every check raises a 400 `ApiError` naming the field, so nothing invalid reaches a rollout: the
rollout's own checks (services/rollout/validation.py) stay a second line, not the first.
"""

from __future__ import annotations

import json
import math

from grpo.common.v1 import types_pb2
from services.gateway.config import GatewayLimits
from services.gateway.errors import ApiError, invalid
from services.gateway.schemas import ChatRequest, Message, SamplingFields, TokenSampling, ToolDef

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0
MAX_TOKEN_ID = 2**31 - 1
DEFAULT_MAX_TOKENS = 256


def _finite(value: float, param: str) -> float:
    if not math.isfinite(value):
        raise invalid(f"{param} must be a finite number, got {value}", param)
    return value


def _stops(stop: str | list[str] | None, limits: GatewayLimits, param: str) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop:
        raise invalid(f"{param} has {len(stops)} strings (max {limits.max_stop})", param)
    for index, text in enumerate(stops):
        if not text or len(text) > 256:
            raise invalid(f"{param}[{index}] must be 1 to 256 characters", f"{param}[{index}]")
    return stops


def sampling(
    fields: SamplingFields | TokenSampling, limits: GatewayLimits, prefix: str = ""
) -> types_pb2.SamplingParams:
    """The rollout's SamplingParams for a request's OpenAI-named fields (`prefix`: where they sit,
    e.g. "sampling_params." on the token-in route)."""
    if not 1 <= fields.n <= limits.max_n:
        raise invalid(f"{prefix}n must be in [1, {limits.max_n}], got {fields.n}", f"{prefix}n")
    max_tokens, param = fields.max_tokens, f"{prefix}max_tokens"
    if isinstance(fields, SamplingFields) and fields.max_completion_tokens is not None:
        max_tokens, param = fields.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = 0  # unset: fit_max_tokens fills it once the prompt's length is known
    elif not 1 <= max_tokens <= limits.max_tokens:
        raise invalid(f"{param} must be in [1, {limits.max_tokens}], got {max_tokens}", param)
    temperature = 1.0 if fields.temperature is None else _finite(fields.temperature, f"{prefix}temperature")
    if not 0 < temperature <= MAX_TEMPERATURE:
        raise invalid(
            f"{prefix}temperature must be in (0, {MAX_TEMPERATURE}], got {temperature} (greedy decoding is "
            "not served: the behaviour logprobs a trainer needs come from a sampling distribution)",
            f"{prefix}temperature",
        )
    top_p = 1.0 if fields.top_p is None else _finite(fields.top_p, f"{prefix}top_p")
    if not 0 < top_p <= 1:
        raise invalid(f"{prefix}top_p must be in (0, 1], got {top_p}", f"{prefix}top_p")
    seed = 0 if fields.seed is None else fields.seed
    if not 0 <= seed <= MAX_SEED:
        raise invalid(f"{prefix}seed must be in [0, 2^63 - 1], got {seed}", f"{prefix}seed")
    return types_pb2.SamplingParams(
        n=fields.n,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        stop=_stops(fields.stop, limits, f"{prefix}stop"),
    )


def refuse_streaming(fields: SamplingFields) -> None:
    if fields.stream:
        raise invalid(
            "stream: streaming responses are not supported; send stream=false", "stream", "unsupported"
        )


def token_ids(ids: list[int], limits: GatewayLimits, param: str, max_model_len: int) -> list[int]:
    """A token-in prompt: non-empty, bounded, every id a non-negative int32, shorter than the context."""
    if not ids:
        raise invalid(f"{param} is empty", param)
    if len(ids) > limits.max_prompt_tokens:
        raise invalid(f"{param} has {len(ids)} tokens (max {limits.max_prompt_tokens})", param)
    for position, token in enumerate(ids):
        if not 0 <= token <= MAX_TOKEN_ID:
            raise invalid(f"{param}[{position}] = {token} is not a token id", f"{param}[{position}]")
    check_context(len(ids), max_model_len, param)
    return ids


def fit_max_tokens(
    params: types_pb2.SamplingParams, prompt_tokens: int, max_model_len: int, limits: GatewayLimits
) -> None:
    """Unset max_tokens becomes what the context leaves (at most limits.max_tokens; DEFAULT_MAX_TOKENS
    when the context is unknown); a set one must fit: prompt + max_tokens ≤ max_model_len (as vLLM)."""
    if params.max_tokens == 0:
        room = max_model_len - prompt_tokens if max_model_len else DEFAULT_MAX_TOKENS
        params.max_tokens = max(1, min(limits.max_tokens, room))
    elif max_model_len and prompt_tokens + params.max_tokens > max_model_len:
        raise invalid(
            f"max_tokens: the prompt's {prompt_tokens} tokens + max_tokens {params.max_tokens} exceed the "
            f"model's context of {max_model_len}",
            "max_tokens",
            "context_length_exceeded",
        )


def check_context(prompt_tokens: int, max_model_len: int, param: str) -> None:
    if max_model_len and prompt_tokens >= max_model_len:
        raise invalid(
            f"{param}: the prompt has {prompt_tokens} tokens; the model's context is {max_model_len}",
            param,
            "context_length_exceeded",
        )


def messages(
    items: list[Message], limits: GatewayLimits, param: str = "messages"
) -> list[types_pb2.ChatMessage]:
    """Chat messages as the rollout's ChatMessage protos ("developer" is a system message)."""
    if not items:
        raise invalid(f"{param} is empty", param)
    if len(items) > limits.max_messages:
        raise invalid(f"{param} has {len(items)} messages (max {limits.max_messages})", param)
    out = []
    for index, message in enumerate(items):
        where = f"{param}[{index}]"
        text = message.text()
        if len(text) > limits.max_text_chars:
            raise invalid(
                f"{where}.content is {len(text)} characters (max {limits.max_text_chars})", f"{where}.content"
            )
        role = "system" if message.role == "developer" else message.role
        proto = types_pb2.ChatMessage(role=role, content=text)
        if message.tool_calls:
            if role != "assistant":
                raise invalid(
                    f"{where}.tool_calls: only assistant messages carry tool calls", f"{where}.tool_calls"
                )
            for position, call in enumerate(message.tool_calls):
                args = call.function.arguments
                try:
                    json.loads(args)
                except ValueError:
                    param_at = f"{where}.tool_calls[{position}].function.arguments"
                    raise invalid(f"{param_at} is not JSON text", param_at) from None
                proto.tool_calls.add(id=call.id, name=call.function.name, arguments_json=args)
        if role == "tool":
            proto.tool_call_id = message.tool_call_id or ""
            proto.name = message.name or ""
        out.append(proto)
    return out


def tools(request: ChatRequest) -> tuple[str, bool]:
    """(tools_json for the chat template, whether to parse tool calls out of the completions).
    tool_choice "auto" (the default with tools) parses them; "none" renders the tools, parses none;
    anything else (a named function, "required") is refused: the gateway does not force calls."""
    choice = request.tool_choice
    if isinstance(choice, dict) or choice not in (None, "auto", "none"):
        raise invalid(
            f"tool_choice {json.dumps(choice)[:80]} is not supported: send 'auto' or 'none'",
            "tool_choice",
            "unsupported",
        )
    if not request.tools:
        return "", False
    return tools_json(request.tools), choice != "none"


def tools_json(items: list[ToolDef] | None) -> str:
    if not items:
        return ""
    return json.dumps([tool.model_dump(exclude_none=True) for tool in items], separators=(",", ":"))


def refuse_top_logprobs(value: int | None, param: str) -> None:
    if value:
        raise ApiError(
            400,
            f"{param}={value}: alternatives per position are not served (the rollout returns the sampled "
            "token's logprob only); send 0 or leave it out",
            param,
            code="unsupported",
        )
