"""The gateway's one error table: what every failure becomes on the wire (an OpenAI-style JSON body).

    {"error": {"message": "...", "type": "invalid_request_error", "param": "<field>", "code": "..."}}

| failure                                           | HTTP | type                  |
|---------------------------------------------------|------|-----------------------|
| a client mistake (`ApiError`, pydantic validation) | 4xx  | invalid_request_error |
| body too large / not JSON (Content-Type)          | 413 / 415 | invalid_request_error |
| unknown path / method                             | 404 / 405 | invalid_request_error |
| no / wrong bearer token                           | 401  | authentication_error  |
| full (admission, a rollout's RESOURCE_EXHAUSTED)   | 429  | rate_limit_error      |
| rollout INVALID_ARGUMENT / FAILED_PRECONDITION     | 400  | invalid_request_error |
| rollout NOT_FOUND                                 | 404  | invalid_request_error |
| rollout UNAVAILABLE / CANCELLED, none usable       | 503  | service_unavailable   |
| rollout DEADLINE_EXCEEDED                         | 504  | timeout               |
| anything else from a rollout                      | 502  | upstream_error        |

Only a bug of the gateway itself is a 500 (`internal_error`), logged with its traceback.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from services.common.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    GrpoError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    bounded,
)

INVALID = "invalid_request_error"


class ApiError(Exception):
    """A refusal with its HTTP status, OpenAI error type, the field it concerns and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = INVALID,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = bounded(message)
        self.param = param
        self.type = type_
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code=code)


def too_many(message: str, retry_after_s: int) -> ApiError:
    return ApiError(
        429, message, None, "rate_limit_error", "rate_limited", headers={"Retry-After": str(retry_after_s)}
    )


def _loc(loc: tuple[Any, ...]) -> str:
    """pydantic's location as a field path: ("messages", 0, "role") → "messages[0].role"."""
    path = ""
    for part in loc:
        if part in ("body",) and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path or "body"


def from_validation(exc: ValidationError | list[dict[str, Any]]) -> ApiError:
    """The one mapping of a request's validation failure: 400 naming the first bad field."""
    errors = exc.errors() if isinstance(exc, ValidationError) else exc
    if not errors:
        return invalid("invalid request body", None)
    first = errors[0]
    param = _loc(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return invalid(f"{param}: {message}{more}", param, code=str(first.get("type", "invalid_value")))


def from_rollout(exc: GrpoError, retry_after_s: int) -> ApiError:
    """A rollout's failure (a mapped gRPC status) as the HTTP answer."""
    message = str(exc)
    if isinstance(exc, InvalidArgument | FailedPrecondition):
        return ApiError(400, message, None, INVALID, "rollout_rejected")
    if isinstance(exc, NotFound):
        return ApiError(404, message, None, INVALID, "not_found")
    if isinstance(exc, ResourceExhausted):
        return too_many(message, retry_after_s)
    if isinstance(exc, DeadlineExceeded):
        return ApiError(504, message, None, "timeout", "upstream_timeout")
    if isinstance(exc, Unavailable | Cancelled):
        return ApiError(
            503, message, None, "service_unavailable", "upstream_unavailable",
            headers={"Retry-After": str(retry_after_s)},
        )  # fmt: skip
    return ApiError(502, message, None, "upstream_error", exc.code.name.lower())
