"""services/common/errors.py: the server-side and client-side tables agree, and flags drive retries."""

from __future__ import annotations

import grpc
import pytest

from services.common import errors


class _Failed(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


DOMAIN = [
    errors.InvalidArgument,
    errors.FailedPrecondition,
    errors.NotFound,
    errors.Aborted,
    errors.ResourceExhausted,
    errors.Unavailable,
    errors.DataLoss,
    errors.DeadlineExceeded,
    errors.Cancelled,
]


@pytest.mark.parametrize("cls", DOMAIN)
def test_a_domain_error_survives_the_round_trip_through_a_status(cls) -> None:
    code, message = errors.status_for(cls("what went wrong"))
    back = errors.from_rpc_error(_Failed(code, message), peer="learner h:1")
    assert type(back) is cls and back.code == code
    assert str(back) == f"learner h:1: {code.name}: what went wrong"


def test_flags_say_what_callers_do() -> None:
    retryable = {cls for cls in DOMAIN if cls.retryable}
    unreachable = {cls for cls in DOMAIN if cls.unreachable}
    assert retryable == {
        errors.Aborted,
        errors.ResourceExhausted,
        errors.Unavailable,
        errors.DeadlineExceeded,
        errors.Cancelled,
    }
    assert unreachable == {errors.Unavailable, errors.DeadlineExceeded, errors.Cancelled}


def test_codes_outside_the_table_keep_their_code_and_are_not_retried() -> None:
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED):
        failure = errors.from_rpc_error(_Failed(code, "boom"))
        assert isinstance(failure, errors.RemoteError) and failure.code == code
        assert not failure.retryable and not failure.unreachable
        assert str(failure) == f"{code.name}: boom"
    assert errors.status_for(ValueError("x")) == (grpc.StatusCode.INTERNAL, "internal error: ValueError: x")


@pytest.mark.parametrize("cls", DOMAIN)
def test_a_status_carried_by_number_inside_a_message_maps_like_a_call_status(cls) -> None:
    """A GenerateBatch request's RequestError carries its code as a number (google.rpc.Code)."""
    code, message = errors.status_for(cls("what went wrong"))
    back = errors.from_status(errors.code_number(code), message, peer="rollout h:2")
    assert type(back) is cls and back.code == code
    assert str(back) == f"rollout h:2: {code.name}: what went wrong"


def test_an_unknown_status_number_is_a_remote_error() -> None:
    failure = errors.from_status(99, "from the future")
    assert isinstance(failure, errors.RemoteError) and failure.code == grpc.StatusCode.UNKNOWN
    assert not failure.retryable and str(failure) == "UNKNOWN: from the future"
    assert errors.code_number(grpc.StatusCode.INVALID_ARGUMENT) == 3
