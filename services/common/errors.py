"""Domain errors and the two tables that map them to and from gRPC status codes.

Server side: services raise these typed exceptions from pure logic; the error interceptor (see
`serve.py`) turns them into a status with a clear message (`status_for`). Anything else becomes
INTERNAL and is logged with its traceback, so a client mistake is never reported as a server fault
and vice versa.

Client side: every gRPC client in the system turns a failed call into the same domain errors
(`from_rpc_error`), so callers decide with two flags instead of status-code sets of their own:

    retryable    the same request may succeed later (a different worker, after a back-off)
    unreachable  the peer did not answer (down, draining, too slow): mark it unhealthy

| code                | error              | retryable | unreachable |
|---------------------|--------------------|-----------|-------------|
| INVALID_ARGUMENT    | InvalidArgument    |           |             |
| FAILED_PRECONDITION | FailedPrecondition |           |             |
| NOT_FOUND           | NotFound           |           |             |
| ABORTED             | Aborted            | yes       |             |
| RESOURCE_EXHAUSTED  | ResourceExhausted  | yes       |             |
| UNAVAILABLE         | Unavailable        | yes       | yes         |
| DEADLINE_EXCEEDED   | DeadlineExceeded   | yes       | yes         |
| CANCELLED           | Cancelled          | yes       | yes         |
| DATA_LOSS           | DataLoss           |           |             |
| UNAUTHENTICATED     | Unauthenticated    |           |             |
| anything else       | RemoteError        |           |             |
"""

from __future__ import annotations

from typing import ClassVar

import grpc


class GrpoError(Exception):
    """Base class of every error that maps to a specific gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retryable: ClassVar[bool] = False
    unreachable: ClassVar[bool] = False


class InvalidArgument(GrpoError):
    """The request itself is malformed: never retry it unchanged."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(GrpoError):
    """The service is not in a state to do this (not loaded, unknown version, unsupported transport)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(GrpoError):
    """A named thing (weight version, request id) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class Aborted(GrpoError):
    """A conflicting concurrent change won (e.g. a stale weight version); retry at a higher level."""

    code = grpc.StatusCode.ABORTED
    retryable = True


class ResourceExhausted(GrpoError):
    """Backpressure: a bounded queue or concurrency cap is full. Back off and retry."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True


class Unavailable(GrpoError):
    """Draining or a dependency is down. Idempotent calls may retry."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True
    unreachable = True


class DataLoss(GrpoError):
    """Bytes arrived corrupted (checksum mismatch)."""

    code = grpc.StatusCode.DATA_LOSS


class DeadlineExceeded(GrpoError):
    """A call or an internal step (e.g. a weight transfer) ran past its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True
    unreachable = True


class Cancelled(GrpoError):
    """The call was cancelled (its channel closed, or the peer went away mid-call)."""

    code = grpc.StatusCode.CANCELLED
    retryable = True
    unreachable = True


class Unauthenticated(GrpoError):
    """No or a wrong bearer token (security.py): fix the configuration, retrying cannot help."""

    code = grpc.StatusCode.UNAUTHENTICATED


class RemoteError(GrpoError):
    """A peer failed with a status outside the table (INTERNAL, UNKNOWN, UNIMPLEMENTED, ...)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


# Status messages travel in a trailer; one that echoes a 64 KiB id would exceed gRPC's metadata limit
# and the client would see RESOURCE_EXHAUSTED instead of the real code. Every message is cut to this.
MAX_DETAIL_CHARS = 1024


def bounded(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """`text` cut to `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def quoted(value: object, limit: int = 80) -> str:
    """A client-supplied value for an error message: repr'd, at most `limit` characters of it."""
    return bounded(repr(value), limit)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and (bounded) message a server returns for `exc` (the server-side table)."""
    if isinstance(exc, GrpoError):
        return exc.code, bounded(str(exc) or type(exc).__name__)
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, bounded(str(exc) or "not implemented")
    return grpc.StatusCode.INTERNAL, bounded(f"internal error: {type(exc).__name__}: {exc}")


_FROM_CODE: dict[grpc.StatusCode, type[GrpoError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        FailedPrecondition,
        NotFound,
        Aborted,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        DataLoss,
        Unauthenticated,
    )
}


_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def code_number(code: grpc.StatusCode) -> int:
    """The wire number of a status code (google.rpc.Code), for a status carried inside a message."""
    return code.value[0]


def from_status(code: grpc.StatusCode | int, details: str, peer: str = "") -> GrpoError:
    """The domain error for a status (the client-side table): a failed call's, or one carried inside a
    message (a GenerateBatch request's `RequestError`, by number; an unknown number is UNKNOWN). The
    message names the peer, the code and the server's details."""
    if isinstance(code, int):
        code = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    where = f"{peer}: " if peer else ""
    message = f"{where}{code.name}: {details}"
    cls = _FROM_CODE.get(code)
    return cls(message) if cls is not None else RemoteError(message, code)


def from_rpc_error(exc: grpc.aio.AioRpcError, peer: str = "") -> GrpoError:
    """The domain error for a failed client call; raise it `from exc` to keep the original."""
    return from_status(exc.code(), exc.details(), peer)
