"""Response bodies in OpenAI's (and vLLM's) shapes, built from the rollout's Completion protos (pure).

Token text: the gateway has no tokenizer (it reaches the model only through the rollouts' gRPC API),
so a logprob entry names its token as vLLM's `return_tokens_as_token_ids` does: "token_id:<id>",
with `bytes` null. The choice's `message.content` / `text` is the rollout's decoded text.
Every choice carries `weight_versions`: [{version, start, end}] over its tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from grpo.common.v1 import types_pb2
from services.common.tool_calls import parse_tool_calls

_FINISH = {
    types_pb2.FINISH_REASON_STOP: "stop",
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_ABORT: "abort",
}


def finish_reason(completion: types_pb2.Completion) -> str:
    return _FINISH.get(completion.finish_reason, "stop")


def weight_versions(completion: types_pb2.Completion) -> list[dict[str, int]]:
    return [{"version": s.version, "start": s.start, "end": s.end} for s in completion.version_spans]


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def chat_logprobs(completion: types_pb2.Completion) -> dict[str, Any]:
    return {
        "content": [
            {"token": token_name(t), "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(completion.completion_token_ids, completion.logprobs, strict=True)
        ]
    }


def usage(prompt_tokens: int, completions: Sequence[types_pb2.Completion]) -> dict[str, int]:
    generated = sum(len(c.completion_token_ids) for c in completions)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
    }


def chat_message(completion: types_pb2.Completion, parse_tools: bool, call_prefix: str) -> tuple[dict, str]:
    """The assistant message of one choice and its finish reason ("tool_calls" when it called tools).
    Malformed calls are not tool calls: their text stays in the content, for the caller to answer."""
    finish = finish_reason(completion)
    if not parse_tools:
        return {"role": "assistant", "content": completion.text}, finish
    parsed = parse_tool_calls(completion.text, call_prefix)
    if not parsed.calls:
        return {"role": "assistant", "content": completion.text}, finish
    calls = [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
        for call in parsed.calls
    ]
    content = parsed.content or None
    return {"role": "assistant", "content": content, "tool_calls": calls}, (
        "tool_calls" if finish == "stop" else finish
    )


def chat_response(
    request_id: str,
    model: str,
    prompt_ids: Sequence[int],
    completions: Sequence[types_pb2.Completion],
    *,
    logprobs: bool,
    return_token_ids: bool,
    parse_tools: bool,
) -> dict[str, Any]:
    choices = []
    for completion in completions:
        message, finish = chat_message(completion, parse_tools, f"call_{request_id}_{completion.index}")
        choice: dict[str, Any] = {
            "index": completion.index,
            "message": message,
            "logprobs": chat_logprobs(completion) if logprobs else None,
            "finish_reason": finish,
            "weight_versions": weight_versions(completion),
        }
        choices.append(choice)
    return _body(f"chatcmpl-{request_id}", "chat.completion", model, prompt_ids, completions, choices,
                 return_token_ids)  # fmt: skip


def completion_response(
    request_id: str,
    model: str,
    prompt_ids: Sequence[int],
    completions: Sequence[types_pb2.Completion],
    *,
    logprobs: bool,
    return_token_ids: bool,
) -> dict[str, Any]:
    choices = []
    for completion in completions:
        choice: dict[str, Any] = {
            "index": completion.index,
            "text": completion.text,
            "logprobs": _legacy_logprobs(completion) if logprobs else None,
            "finish_reason": finish_reason(completion),
            "weight_versions": weight_versions(completion),
        }
        choices.append(choice)
    return _body(f"cmpl-{request_id}", "text_completion", model, prompt_ids, completions, choices,
                 return_token_ids)  # fmt: skip


def _body(
    body_id: str, kind: str, model: str, prompt_ids: Sequence[int],
    completions: Sequence[types_pb2.Completion], choices: list[dict[str, Any]], return_token_ids: bool,
) -> dict[str, Any]:  # fmt: skip
    """A chat or text completion's response: its choices, usage and (vLLM's extension) token ids."""
    body: dict[str, Any] = {
        "id": body_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(len(prompt_ids), completions),
    }
    if return_token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
        for choice, completion in zip(choices, completions, strict=True):
            choice["token_ids"] = list(completion.completion_token_ids)
    return body


def _legacy_logprobs(completion: types_pb2.Completion) -> dict[str, Any]:
    """/v1/completions' logprobs shape (tokens, token_logprobs, top_logprobs, text_offset)."""
    return {
        "tokens": [token_name(t) for t in completion.completion_token_ids],
        "token_logprobs": list(completion.logprobs),
        "top_logprobs": None,
        "text_offset": None,
    }


def tokens_response(
    request_id: str, prompt_ids: Sequence[int], completions: Sequence[types_pb2.Completion], logprobs: bool
) -> dict[str, Any]:
    """vLLM's token-in route (`/inference/v1/generate`): token ids and logprobs per choice."""
    return {
        "request_id": request_id,
        "choices": [
            {
                "index": c.index,
                "token_ids": list(c.completion_token_ids),
                "logprobs": {
                    "content": [
                        {"token": token_name(t), "logprob": lp}
                        for t, lp in zip(c.completion_token_ids, c.logprobs, strict=True)
                    ]
                }
                if logprobs
                else None,
                "finish_reason": finish_reason(c),
                "weight_versions": weight_versions(c),
            }
            for c in completions
        ],
        "usage": usage(len(prompt_ids), completions),
    }


def vllm_generate_response(
    prompt_ids: Sequence[int], completions: Sequence[types_pb2.Completion]
) -> dict[str, Any]:
    """vLLM's native `/generate` answer as atropos' `VLLMServer` reads it: per choice, its tokens'
    logprobs as [[{"<token id>": logprob}] per token] (the sampled token only), its finish reason.
    `prompt` (the prompt's text in vLLM's answer) is null: the gateway has no tokenizer."""
    return {
        "text": [c.text for c in completions],
        "prompt": None,
        "prompt_token_ids": list(prompt_ids),
        "token_ids": [list(c.completion_token_ids) for c in completions],
        "logprobs": [
            [[{str(t): lp}] for t, lp in zip(c.completion_token_ids, c.logprobs, strict=True)]
            for c in completions
        ],
        "finish_reasons": [finish_reason(c) for c in completions],
        "weight_versions": [weight_versions(c) for c in completions],
    }
