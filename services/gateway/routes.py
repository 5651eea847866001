"""The HTTP surface (FastAPI): route handlers that only translate, the body and auth guards, and the
one place where every failure becomes an OpenAI-style JSON error (errors.py's table).

    POST /v1/chat/completions   POST /v1/completions   POST /inference/v1/generate
    POST /generate (vLLM's native route, as atropos' `server_type: vllm` client calls it)
    POST /tokenize              GET  /v1/models        GET  /health       GET /metrics

Bodies are read and parsed here (`read_json`, which the trajectory API's routes use too; not FastAPI's
form/JSON sniffing), so a wrong content type or encoding, junk bytes, a non-object, an oversized body
each get their own 4xx. Every route but /health needs the bearer token when one is configured (as the
gRPC services: probes cannot send one).
"""

from __future__ import annotations

import hmac
import json
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.logging import get_logger
from services.gateway.errors import ApiError, from_validation, invalid
from services.gateway.gateway import Gateway
from services.gateway.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerateTokensRequest,
    TokenizeRequest,
    VllmGenerateRequest,
)

log = get_logger(__name__)

B = TypeVar("B", bound=BaseModel)
OPEN_PATHS = ("/health",)
_NO_BODY = object()  # read_json: an empty body is invalid JSON


class _JSON(JSONResponse):
    """Compact JSON (no spaces), NaN refused: a body the gateway builds is always valid JSON."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()


def _error_response(error: ApiError) -> Response:
    headers = dict(error.headers)
    if error.status == 401:
        headers.setdefault("WWW-Authenticate", 'Bearer realm="grpo-mesh gateway"')
    return _JSON(error.body(), status_code=error.status, headers=headers)


async def read_json(request: Request, max_bytes: int, *, empty: Any = _NO_BODY) -> Any:
    """The request's body as parsed JSON: 415 for a content type other than JSON, 413 past `max_bytes`
    (a gzip body, as atropos sends from 1 KiB, counts inflated), 400 for bytes that are not JSON.
    `empty`, when given, is what an empty body reads as (atropos' GETs send no body)."""
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type != "application/json" and not content_type.endswith("+json"):
        raise ApiError(415, f"Content-Type {content_type[:60]!r}: send application/json", None,
                       code="unsupported_media_type")  # fmt: skip
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the body is {declared} bytes (max {max_bytes})", None, code="body_too_large")
    raw, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the body is over {max_bytes} bytes", None, code="body_too_large")
        raw.append(chunk)
    body = b"".join(raw)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding == "gzip":
        body = _inflate(body, max_bytes)
    elif encoding != "identity":
        raise ApiError(415, f"Content-Encoding {encoding[:40]!r}: send gzip or none", None,
                       code="unsupported_media_type")  # fmt: skip
    if not body and empty is not _NO_BODY:
        return empty
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise invalid(f"the body is not valid JSON: {str(exc)[:120]}", None, "invalid_json") from None


def _inflate(body: bytes, max_bytes: int) -> bytes:
    inflater = zlib.decompressobj(wbits=31)
    try:
        inflated = inflater.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise invalid(f"the gzip body does not inflate: {exc}", None, "invalid_body") from None
    if len(inflated) > max_bytes or inflater.unconsumed_tail:
        raise ApiError(413, f"the inflated body is over {max_bytes} bytes", None, code="body_too_large")
    return inflated


def validated(model: type[B], data: Any) -> B:
    """`data` as `model`: 400 naming the first field of the wrong type."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None
    except RecursionError:
        raise invalid("the body is nested too deeply", None, "invalid_json") from None


async def read_body(request: Request, model: type[B], max_bytes: int) -> B:
    """The request's JSON object as `model` (`read_json`'s refusals; 400 for a body that is not an
    object or has a field of the wrong type)."""
    data = await read_json(request, max_bytes)
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object", None, "invalid_json")
    return validated(model, data)


def _token_guard(token: str) -> Callable[[Request], ApiError | None]:
    expected = f"Bearer {token}".encode() if token else None

    def refusal(request: Request) -> ApiError | None:
        if expected is None or request.url.path in OPEN_PATHS:
            return None
        given = request.headers.getlist("authorization")
        if len(given) != 1:
            why = "no bearer token" if not given else f"{len(given)} Authorization headers"
            return ApiError(401, f"{why}: send 'Authorization: Bearer <token>' once", None,
                            "authentication_error", "invalid_api_key")  # fmt: skip
        if not hmac.compare_digest(given[0].encode("utf-8", "surrogateescape"), expected):
            return ApiError(401, "a wrong bearer token", None, "authentication_error", "invalid_api_key")
        return None

    return refusal


class TokenGuard:
    """Pure ASGI middleware: the bearer-token check before anything of the request is read."""

    def __init__(self, app: Any, refusal: Callable[[Request], ApiError | None]) -> None:
        self.app = app
        self.refusal = refusal

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            error = self.refusal(Request(scope))
            if error is not None:
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(gateway: Gateway, token: str, lifespan: Any = None) -> FastAPI:
    """The FastAPI app over `gateway`; `token` ("" = none) guards every route but /health."""
    app = FastAPI(
        title="grpo-mesh gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    max_bytes = gateway.settings.limits.max_body_bytes
    refusal = _token_guard(token)

    app.add_middleware(TokenGuard, refusal=refusal)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(from_validation(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error_response(ApiError(exc.status_code, str(exc.detail), None, code=code))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("gateway bug", path=request.url.path)
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}", None, "internal_error"))

    def session(request: Request) -> str | None:
        return request.headers.get("x-session-id")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatRequest, max_bytes)
        return _JSON(await gateway.chat(body, session(request)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, max_bytes)
        return _JSON(await gateway.complete(body, session(request)))

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        body = await read_body(request, GenerateTokensRequest, max_bytes)
        return _JSON(await gateway.generate_tokens(body, session(request)))

    @app.post("/generate")
    async def generate_vllm(request: Request) -> Response:
        body = await read_body(request, VllmGenerateRequest, max_bytes)
        return _JSON(await gateway.generate_vllm(body, session(request)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await read_body(request, TokenizeRequest, max_bytes)
        return _JSON(await gateway.tokenize(body))

    @app.get("/v1/models")
    async def models() -> Response:
        return _JSON(gateway.models())

    @app.get("/health")
    async def health() -> Response:
        if await gateway.healthy():
            return Response(status_code=200)
        return _error_response(
            ApiError(503, "no rollout is READY", None, "service_unavailable", "no_rollout")
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return _JSON(gateway.metrics())

    return app
