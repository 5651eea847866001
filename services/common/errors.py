"""Domain errors and the one table that maps them to gRPC status codes.

Services raise these typed exceptions from pure logic; the error interceptor (see `serve.py`)
turns them into a status with a clear message. Anything else becomes INTERNAL and is logged with
its traceback, so a client mistake is never reported as a server fault and vice versa.
"""

from __future__ import annotations

import grpc


class GrpoError(Exception):
    """Base class of every error that maps to a specific gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


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


class ResourceExhausted(GrpoError):
    """Backpressure: a bounded queue or concurrency cap is full. Back off and retry."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(GrpoError):
    """Draining or a dependency is down. Idempotent calls may retry."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(GrpoError):
    """Bytes arrived corrupted (checksum mismatch)."""

    code = grpc.StatusCode.DATA_LOSS


class DeadlineExceeded(GrpoError):
    """An internal step (e.g. a weight transfer) ran past its own deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a server returns for `exc` (the one mapping table)."""
    if isinstance(exc, GrpoError):
        return exc.code, str(exc) or type(exc).__name__
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc) or "not implemented"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
