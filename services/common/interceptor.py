"""The one server interceptor: what every RPC of every service goes through, in this order.

    token check (UNAUTHENTICATED before anything runs; exactly one `authorization` entry) →
    decode the body (INVALID_ARGUMENT for bytes that are not the request message) → request id
    bound to the logs → the servicer → domain exception → status code and a bounded message
    (errors.status_for) → RPC metrics.

Decoding here rather than in gRPC's own deserializer is what turns a malformed body into a precise
status: gRPC would answer it with UNKNOWN ("Unexpected DecodeError"), which says nothing to the
client and reads like a server fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from services.common.errors import bounded, status_for
from services.common.logging import get_logger
from services.common.security import TokenCheck
from services.common.telemetry import RpcMetrics

log = get_logger(__name__)

REQUEST_ID = "x-request-id"
MAX_REQUEST_ID = 64


class _Rejected(Exception):
    """Raised inside the interceptor to answer a call with `code` (never reaches a servicer)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _message_name(deserializer: Callable | None) -> str:
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "request message")


def _decoder(deserializer: Callable | None) -> Callable[[bytes], Any]:
    """Raw bytes → the request message, or _Rejected(INVALID_ARGUMENT)."""
    if deserializer is None:
        return lambda raw: raw
    name = _message_name(deserializer)

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except (DecodeError, ValueError, RecursionError) as exc:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request body ({len(raw)} bytes) is not a valid {name}: {bounded(str(exc), 200)}",
            ) from None

    return decode


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """Authentication, decoding, request ids, error mapping and RPC metrics for every call."""

    def __init__(self, tokens: TokenCheck, metrics: RpcMetrics) -> None:
        self._tokens = tokens
        self._metrics = metrics

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not (handler.unary_unary or handler.unary_stream):
            return handler  # reflection (stream-stream) and unknown methods: gRPC's own handling
        method = details.method
        pairs = tuple(details.invocation_metadata or ())
        metadata = {k: v for k, v in pairs if isinstance(v, str)}
        refusal = self._tokens.refusal(method, pairs)  # every entry: a repeated key must not hide
        denied = None if refusal is None else _Rejected(grpc.StatusCode.UNAUTHENTICATED, refusal)
        request_id = (metadata.get(REQUEST_ID) or uuid.uuid4().hex[:12])[:MAX_REQUEST_ID]
        decode = _decoder(handler.request_deserializer)
        observe = self._metrics.observer(method)

        def admit(raw: bytes) -> Any:
            structlog.contextvars.bind_contextvars(rpc=method, request_id=request_id)
            if denied is not None:
                raise denied
            return decode(raw)

        async def fail(context: grpc.aio.ServicerContext, exc: Exception) -> None:
            if isinstance(exc, _Rejected):
                code, message = exc.code, str(exc)
            else:
                code, message = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.error("rpc failed", error=message, exc_info=exc)
            else:
                log.info("rpc rejected", code=code.name, error=message)
            observe(code)
            await context.abort(code, message)

        @contextlib.asynccontextmanager
        async def answered(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            """Around the servicer: record how the call ended; map an exception to its status."""
            try:
                yield
            except asyncio.CancelledError:
                observe(grpc.StatusCode.CANCELLED)
                raise
            except grpc.aio.AbortError:
                observe(context.code() or grpc.StatusCode.UNKNOWN)
                raise
            except Exception as exc:
                await fail(context, exc)
            observe(grpc.StatusCode.OK)

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                async with answered(context):
                    return await inner(admit(raw), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)

        inner_stream = handler.unary_stream
        if not inspect.isasyncgenfunction(inner_stream):
            # a streaming handler that writes with context.write (e.g. grpc.health.v1 Watch)
            async def unary_stream_writer(raw: bytes, context: grpc.aio.ServicerContext) -> None:
                async with answered(context):
                    await inner_stream(admit(raw), context)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream_writer, None, handler.response_serializer
            )

        async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with answered(context):
                async for item in inner_stream(admit(raw), context):
                    yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, None, handler.response_serializer)
