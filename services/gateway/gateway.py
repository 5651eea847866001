"""The gateway's domain object: one method per route, over the rollout pool, sessions, admission and
the call recorder. Protocol-free apart from the rollout protos it sends: routes.py translates HTTP to
these calls and their results (dicts in OpenAI's shapes) back; failures are `ApiError`s (errors.py).

A generating call: checks (limits.py) → admission (429 when full) → the session's rollout, or the
least loaded one (429 when it is at its bound) →
prompt tokens (chat: the rollout's RenderMessages, CONVERSATION mode, or BRIDGE mode appended to the
session's last call when this call continues it; then a token-in Generate. completions: the text
through Generate, or token-in) → the generation registry (registry.py: every generation, every
route) → the prefix rule (sessions.py) → record.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2
from services.common.errors import FailedPrecondition, GrpoError
from services.gateway import limits as check
from services.gateway import responses
from services.gateway.admission import Admission
from services.gateway.config import GatewaySettings
from services.gateway.errors import ApiError, from_rollout, invalid, too_many
from services.gateway.recorder import CallRecord, CallRecorder, ChoiceRecord
from services.gateway.registry import GenerationRegistry
from services.gateway.rollouts import RolloutPool, RolloutView
from services.gateway.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerateTokensRequest,
    TokenizeRequest,
    VllmGenerateRequest,
)
from services.gateway.sessions import (
    Canonical,
    ChatTurn,
    Session,
    SessionTable,
    bridge_plan,
    canonical_arguments,
)
from services.gateway.stop_tokens import cut_at_stop_token, sampled_logprob_only, stop_token_set

# tokens of the previous model turn sent with a bridge (they tell how much of the close it sampled)
BRIDGE_TAIL = 16


def canonical(message: types_pb2.ChatMessage) -> Canonical:
    calls = tuple((c.name, canonical_arguments(c.arguments_json)) for c in message.tool_calls)
    return (message.role, message.content, calls, message.tool_call_id, message.name)


def reply(message: dict[str, Any]) -> Canonical:
    """An assistant message the gateway answered with, as a request would send it back."""
    calls = tuple(
        (c["function"]["name"], canonical_arguments(c["function"]["arguments"]))
        for c in message.get("tool_calls", ())
    )
    return ("assistant", message.get("content") or "", calls, "", "")


@dataclass
class _Call:
    """One admitted generating call: where it runs and the session it belongs to (if any)."""

    request_id: str
    view: RolloutView
    session: Session | None


def _context_param(exc: ApiError) -> str | None:
    """The field a rollout's refusal of a chat prompt it rendered names: the prompt alone is longer
    than the context ("messages") or max_tokens does not fit after it ("max_tokens"); None otherwise."""
    if exc.status != 400:
        return None
    if "max_model_len" not in exc.message:
        return None
    return "max_tokens" if "max_tokens" in exc.message else "messages"


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        pool: RolloutPool,
        admission: Admission,
        recorder: CallRecorder,
        registry: GenerationRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.limits = settings.limits
        self.pool = pool
        self.admission = admission
        self.recorder = recorder
        self.sessions = SessionTable(settings.sessions.max_sessions, settings.sessions.ttl_s)
        if registry is None:
            registry = GenerationRegistry(settings.registry.max_generations, settings.registry.ttl_s)
        self.registry = registry
        # more /metrics figures (the trajectory API's), each a callable answering a dict
        self.metric_sources: list[Callable[[], dict[str, float]]] = []
        self.requests = 0
        self.rejected_full = 0

    # ------------------------------------------------------------------ plumbing
    def _model(self, name: str | None) -> str:
        served = self.settings.served_model_name
        if name is not None and name != served:
            raise ApiError(404, f"model {name[:80]!r} does not exist; this gateway serves {served!r}",
                           "model", code="model_not_found")  # fmt: skip
        return served

    def _session_id(self, header: str | None) -> str:
        if header is None:
            return ""
        limit = self.settings.sessions.max_session_id_chars
        if not header or len(header) > limit or not header.isprintable():
            raise invalid(f"X-Session-ID must be 1 to {limit} printable characters", "X-Session-ID")
        return header

    @contextlib.asynccontextmanager
    async def _admitted(self, session_id: str) -> AsyncIterator[_Call]:
        """Admission, then the session's rollout (sticky) or the least loaded one, counted in flight."""
        retry_after = self.admission.try_admit(session_id)
        if retry_after is not None:
            self.rejected_full += 1
            raise too_many("the gateway is at its admission bound (in flight / staleness); retry later",
                           retry_after)  # fmt: skip
        try:
            session = self.sessions.get(session_id) if session_id else None
            try:
                view = self.pool.pick(session.rollout if session else None)
            except ApiError as exc:
                self.rejected_full += exc.status == 429
                raise
            if session_id and session is None:
                session = self.sessions.open(session_id, view.address)
            elif session is not None:
                session.rollout = view.address  # moved if its rollout was not usable: keep the move
            self.requests += 1
            with self.pool.busy(view):
                if session is not None:
                    session.in_flight += 1
                try:
                    yield _Call(uuid.uuid4().hex[:16], view, session)
                finally:
                    if session is not None:
                        session.in_flight -= 1
        finally:
            self.admission.release(session_id)

    async def _rollout(self, view: RolloutView, coro: Any) -> Any:
        """Await a rollout call; its failure becomes the HTTP answer (and an unreachable rollout is
        routed around)."""
        try:
            return await coro
        except GrpoError as exc:
            self.pool.mark_failed(view, exc)
            raise from_rollout(exc, self.settings.admission.retry_after_s) from exc

    async def _generate(
        self, call: _Call, params: types_pb2.SamplingParams, *, token_ids: list[int] | None = None,
        text: str = "", messages: list[types_pb2.ChatMessage] | None = None, tools_json: str = "",
        route: str, chat: Callable[[list[types_pb2.Completion]], ChatTurn] | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> tuple[list[int], list[types_pb2.Completion]]:  # fmt: skip
        """Generate on the call's rollout (token-in, a text, or chat messages it renders); the prompt's
        ids, the choices (each cut at its first of `stop_token_ids`); every choice into the registry;
        session bookkeeping."""
        request = rollout_pb2.GenerateRequest(request_id=call.request_id, sampling_params=params)
        request.prompt.id = call.request_id
        if token_ids is not None:
            request.prompt_token_ids.extend(token_ids)
        elif messages is not None:
            request.prompt.messages.extend(messages)
            request.prompt.tools_json = tools_json
        else:
            request.prompt.text = text
        completions = await self._rollout(call.view, call.view.client.generate(request))
        if stop_token_ids:
            completions = [cut_at_stop_token(c, stop_token_ids) for c in completions]
        if token_ids is None:
            token_ids = list(completions[0].prompt_token_ids) if completions else []
        self.registry.add(token_ids, completions)
        self._after(call, token_ids, completions, route, chat)
        return token_ids, completions

    def _after(
        self, call: _Call, prompt: list[int], completions: list[types_pb2.Completion], route: str,
        chat: Callable[[list[types_pb2.Completion]], ChatTurn] | None,
    ) -> None:  # fmt: skip
        session = call.session
        if session is None:
            return
        self.sessions.check_prefix(session, prompt)
        turn = chat(completions) if chat is not None else None
        SessionTable.advance(session, prompt, [c.completion_token_ids for c in completions], turn)
        self.recorder.record(
            CallRecord(
                session_id=session.session_id,
                request_id=call.request_id,
                route=route,
                rollout_id=completions[0].rollout_id if completions else call.view.rollout_id,
                prompt_token_ids=tuple(prompt),
                choices=tuple(
                    ChoiceRecord(
                        c.index,
                        tuple(c.completion_token_ids),
                        tuple(c.logprobs),
                        tuple((s.version, s.start, s.end) for s in c.version_spans),
                        responses.finish_reason(c),
                    )
                    for c in completions
                ),
                episode_broken=session.broken,
            )
        )

    async def _render(self, view: RolloutView, request: rollout_pb2.RenderMessagesRequest) -> list[int]:
        response = await self._rollout(view, view.client.render(request))
        return list(response.token_ids)

    # ------------------------------------------------------------------ routes
    async def chat(self, body: ChatRequest, session_header: str | None) -> dict[str, Any]:
        model = self._model(body.model)
        check.refuse_streaming(body)
        check.refuse_top_logprobs(body.top_logprobs, "top_logprobs")
        params = check.sampling(body, self.limits)
        messages = check.messages(body.messages, self.limits)
        tools_json, parse_tools = check.tools(body)
        session_id = self._session_id(session_header)
        async with self._admitted(session_id) as call:
            canon = tuple(canonical(m) for m in messages)

            def turn(completions: list[types_pb2.Completion]) -> ChatTurn:
                replies = tuple(
                    reply(responses.chat_message(c, parse_tools, f"call_{call.request_id}_{c.index}")[0])
                    for c in completions
                )
                return ChatTurn(canon, tools_json, replies)

            if self._renders_itself(call, messages, canon, tools_json, params):
                # one call: the rollout renders the messages exactly as RenderMessages would and
                # checks the context itself (prompt + max_tokens), answering with the prompt's ids
                check.fit_max_tokens(params, 1, call.view.max_model_len, self.limits)  # a prompt has a token
                try:
                    prompt, completions = await self._generate(
                        call, params, messages=messages, tools_json=tools_json, route="chat", chat=turn
                    )
                except ApiError as exc:  # the rendered prompt (+ max_tokens) did not fit
                    param = _context_param(exc)
                    if param is None:
                        raise
                    raise ApiError(400, exc.message, param, code="context_length_exceeded") from exc
            else:
                prompt = await self._chat_prompt(call, messages, canon, tools_json)
                max_len = call.view.max_model_len
                check.check_context(len(prompt), max_len, "messages")
                check.fit_max_tokens(params, len(prompt), max_len, self.limits)
                prompt, completions = await self._generate(
                    call, params, token_ids=prompt, route="chat", chat=turn
                )
        return responses.chat_response(
            call.request_id, model, prompt, completions, logprobs=bool(body.logprobs),
            return_token_ids=bool(body.return_token_ids), parse_tools=parse_tools,
        )  # fmt: skip

    @staticmethod
    def _renders_itself(
        call: _Call,
        messages: list[types_pb2.ChatMessage],
        canon: tuple[Canonical, ...],
        tools_json: str,
        params: Any,
    ) -> bool:
        """Whether the rollout can render this chat call's prompt inside Generate: a call that does not
        continue its session's last chat call (no bridge), whose messages are plain role + content
        (Generate's prompt carries no tool calls or tool-call ids), with max_tokens given (else the
        prompt's length, known only once rendered, sets it)."""
        if not params.max_tokens:
            return False
        if any(m.tool_calls or m.tool_call_id or m.name for m in messages):
            return False
        return call.session is None or bridge_plan(call.session, canon, tools_json) is None

    async def _chat_prompt(
        self,
        call: _Call,
        messages: list[types_pb2.ChatMessage],
        canon: tuple[Canonical, ...],
        tools_json: str,
    ) -> list[int]:
        """The prompt's tokens: the session's last chat call extended by a bridge of the new messages
        when this call continues it (sessions.py), else the whole conversation rendered."""
        plan = bridge_plan(call.session, canon, tools_json) if call.session is not None else None
        if plan is not None:
            base, sampled, first_new = plan
            bridge = rollout_pb2.RenderMessagesRequest(
                mode=rollout_pb2.RENDER_MODE_BRIDGE, messages=messages[first_new:], tools_json=tools_json,
                add_generation_prompt=True, previous_tail=sampled[-BRIDGE_TAIL:],
            )  # fmt: skip
            try:
                return list(base) + list((await call.view.client.render(bridge)).token_ids)
            except FailedPrecondition:  # the template cannot append these messages: render it whole
                pass
            except GrpoError as exc:
                self.pool.mark_failed(call.view, exc)
                raise from_rollout(exc, self.settings.admission.retry_after_s) from exc
        render = rollout_pb2.RenderMessagesRequest(
            mode=rollout_pb2.RENDER_MODE_CONVERSATION, messages=messages, tools_json=tools_json,
            add_generation_prompt=True,
        )  # fmt: skip
        return await self._render(call.view, render)

    async def complete(self, body: CompletionRequest, session_header: str | None) -> dict[str, Any]:
        model = self._model(body.model)
        check.refuse_streaming(body)
        check.refuse_top_logprobs(body.logprobs, "logprobs")
        if body.echo:
            raise invalid("echo is not supported", "echo", "unsupported")
        params = check.sampling(body, self.limits)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise invalid(
                    "prompt: one prompt per request (send a string or a list of token ids)", "prompt"
                )
            prompt = prompt[0]  # type: ignore[assignment]
        session_id = self._session_id(session_header)
        async with self._admitted(session_id) as call:
            max_len = call.view.max_model_len
            if isinstance(prompt, str):
                if not prompt or len(prompt) > self.limits.max_text_chars:
                    raise invalid(f"prompt must be 1 to {self.limits.max_text_chars} characters", "prompt")
                check.fit_max_tokens(params, 0, 0, self.limits)
                if max_len and params.max_tokens >= max_len:
                    raise invalid(f"max_tokens must be < the model's context {max_len}", "max_tokens")
                ids, completions = await self._generate(call, params, text=prompt, route="completions")
            else:
                ids = check.token_ids(list(prompt), self.limits, "prompt", max_len)  # type: ignore[arg-type]
                check.fit_max_tokens(params, len(ids), max_len, self.limits)
                ids, completions = await self._generate(call, params, token_ids=ids, route="completions")
        return responses.completion_response(
            call.request_id, model, ids, completions, logprobs=body.logprobs is not None,
            return_token_ids=bool(body.return_token_ids),
        )  # fmt: skip

    async def generate_tokens(
        self, body: GenerateTokensRequest, session_header: str | None
    ) -> dict[str, Any]:
        self._model(body.model)
        sampling = body.sampling_params
        sampled_logprob_only(sampling.logprobs, "sampling_params.logprobs")
        stop = stop_token_set(sampling.stop_token_ids, "sampling_params.stop_token_ids")
        params = check.sampling(sampling, self.limits, "sampling_params.")
        session_id = self._session_id(session_header)
        async with self._admitted(session_id) as call:
            max_len = call.view.max_model_len
            ids = check.token_ids(body.token_ids, self.limits, "token_ids", max_len)
            check.fit_max_tokens(params, len(ids), max_len, self.limits)
            ids, completions = await self._generate(
                call, params, token_ids=ids, route="generate", stop_token_ids=stop
            )
        return responses.tokens_response(body.request_id or call.request_id, ids, completions, True)

    async def generate_vllm(self, body: VllmGenerateRequest, session_header: str | None) -> dict[str, Any]:
        """vLLM's native `/generate` (atropos' `server_type: vllm`): a token prompt (or a text), the
        sampling parameters at the top level; the same checks, admission and sessions as
        `/inference/v1/generate`."""
        self._model(body.model)
        if body.stream:
            raise invalid("stream: streaming responses are not supported; send stream=false", "stream",
                          "unsupported")  # fmt: skip
        if body.prompt_logprobs is not None:
            raise invalid(
                "prompt_logprobs: prompt logprobs are not served (the rollout returns the sampled tokens' "
                "logprobs only); leave it out",
                "prompt_logprobs",
                "unsupported",
            )
        sampled_logprob_only(body.logprobs, "logprobs")
        if body.stop_token_ids:
            raise invalid(
                "stop_token_ids: not served on /generate (its answer carries each choice's text, which "
                "the gateway, having no tokenizer, cannot cut); use /inference/v1/generate",
                "stop_token_ids",
                "unsupported",
            )
        params = check.sampling(body, self.limits)
        session_id = self._session_id(session_header)
        async with self._admitted(session_id) as call:
            max_len = call.view.max_model_len
            if isinstance(body.prompt, str):
                if not body.prompt or len(body.prompt) > self.limits.max_text_chars:
                    raise invalid(f"prompt must be 1 to {self.limits.max_text_chars} characters", "prompt")
                check.fit_max_tokens(params, 0, 0, self.limits)
                if max_len and params.max_tokens >= max_len:
                    raise invalid(f"max_tokens must be < the model's context {max_len}", "max_tokens")
                ids, completions = await self._generate(call, params, text=body.prompt, route="generate")
            else:
                param = "prompt.prompt_token_ids"
                ids = check.token_ids(body.prompt.prompt_token_ids, self.limits, param, max_len)
                check.fit_max_tokens(params, len(ids), max_len, self.limits)
                ids, completions = await self._generate(call, params, token_ids=ids, route="generate")
        return responses.vllm_generate_response(ids, completions)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self._model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("send exactly one of prompt / messages", "prompt")
        if body.messages is not None:
            render = rollout_pb2.RenderMessagesRequest(
                mode=rollout_pb2.RENDER_MODE_CONVERSATION,
                messages=check.messages(body.messages, self.limits),
                tools_json=check.tools_json(body.tools),
                add_generation_prompt=body.add_generation_prompt,
            )
        else:
            text = body.prompt or ""
            if not text or len(text) > self.limits.max_text_chars:
                raise invalid(f"prompt must be 1 to {self.limits.max_text_chars} characters", "prompt")
            render = rollout_pb2.RenderMessagesRequest(mode=rollout_pb2.RENDER_MODE_TEXT, text=text)
        view = self.pool.pick(None)
        ids = await self._render(view, render)
        return {"count": len(ids), "max_model_len": view.max_model_len, "tokens": ids, "token_strs": None}

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.settings.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": self.settings.owned_by,
                    "max_model_len": self.pool.max_model_len(),
                }
            ],
        }

    async def healthy(self) -> bool:
        return await self.pool.refresh()

    def metrics(self) -> dict[str, float]:
        return {
            "episode/prefix_violations": self.sessions.prefix_violations,
            "gateway/requests": self.requests,
            "gateway/rejected_full": self.rejected_full,
            "gateway/sessions": len(self.sessions),
            "gateway/sessions_evicted": self.sessions.evicted,
            "gateway/in_flight": sum(v.in_flight for v in self.pool.views.values()),
            "gateway/rollouts_ready": sum(v.ready for v in self.pool.views.values()),
            "gateway/records_dropped": getattr(self.recorder, "dropped", 0),
            "gateway/registry_size": self.registry.size,
            "gateway/registry_evicted": self.registry.evicted,
        } | {key: value for source in self.metric_sources for key, value in source().items()}
