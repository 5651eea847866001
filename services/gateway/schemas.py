"""Request bodies of every route, as pydantic models (types only; the limits are checked in limits.py).

Like OpenAI's server: fields the gateway does not know are ignored, a known field of the wrong type
is a 400 naming it. Types are strict (no "3" for 3, no true for 1), except that an integer is a
valid float.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class SamplingFields(_Body):
    """What every generating route accepts (OpenAI's names)."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    # vLLM's extension: top-level prompt_token_ids and choices[i].token_ids
    return_token_ids: bool | None = None


class ChatRequest(SamplingFields):
    messages: list[Message]
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's legacy field: how many alternatives per position; only 0 (the sampled token) is served
    logprobs: int | None = None
    echo: bool | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True


class TokenSampling(_Body):
    """vLLM's `sampling_params` of the token-in route."""

    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    # vLLM's: end a choice at the first of these tokens (kept as its last token, as vLLM keeps it)
    stop_token_ids: list[int] | None = None


class GenerateTokensRequest(_Body):
    model: str | None = None
    request_id: str | None = None
    token_ids: list[int]
    sampling_params: TokenSampling = Field(default_factory=TokenSampling)


class PromptTokens(_Body):
    """vLLM's token prompt ({"prompt_token_ids": [...]})."""

    prompt_token_ids: list[int]


class VllmGenerateRequest(TokenSampling):
    """vLLM's native `POST /generate` (what atropos' `server_type: vllm` client sends): the prompt, and
    the sampling parameters flattened at the top level."""

    model: str | None = None
    prompt: PromptTokens | str
    prompt_logprobs: int | None = None
    stream: bool | None = None
