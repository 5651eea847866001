"""The shared value checks and the bounded error messages every service uses."""

from __future__ import annotations

import math

import pytest

from services.common import validation as check
from services.common.errors import MAX_DETAIL_CHARS, InvalidArgument, bounded, quoted, status_for


def test_messages_are_bounded_whatever_the_input() -> None:
    huge = "x" * 70_000
    assert bounded("short") == "short"
    cut = bounded(huge)
    assert len(cut) < MAX_DETAIL_CHARS + 40 and cut.endswith("(68976 more characters)")
    assert len(quoted(huge)) < 120
    _, message = status_for(InvalidArgument(f"request_id {huge}"))
    assert len(message) < MAX_DETAIL_CHARS + 40  # a status trailer far below gRPC's 8 KiB limit


@pytest.mark.parametrize("value", [0.0, -1.0, 0.009, 2.01, math.nan, math.inf, -math.inf])
def test_temperatures_outside_what_every_engine_accepts_are_refused(value: float) -> None:
    with pytest.raises(InvalidArgument, match=r"must be in \[0.01, 2\]"):
        check.temperature(value, "t")


def test_good_values_pass() -> None:
    assert check.temperature(0.01, "t") == 0.01 and check.temperature(2.0, "t") == 2.0
    assert check.address("rollout-0.grpo.svc:50052") and check.address("[::1]:1")
    assert check.text_id("p-7*8=@12", "prompt.id") == "p-7*8=@12"
    assert check.text_id("", "prompt.id", required=False) == ""
    check.all_finite([0.0, -1e30, 1e30], "rewards")


@pytest.mark.parametrize("value", ["no-port", "h:0", "h:65536", "a b:1", "../x:1", "h:1/x", "x" * 400 + ":1"])
def test_addresses_must_be_host_and_port(value: str) -> None:
    with pytest.raises(InvalidArgument, match="host:port"):
        check.address(value)


def test_ids_are_bounded_and_printable() -> None:
    with pytest.raises(InvalidArgument, match="is empty"):
        check.text_id("", "request_id")
    with pytest.raises(InvalidArgument, match="300 characters long"):
        check.text_id("r" * 300, "request_id")
    with pytest.raises(InvalidArgument, match="control characters"):
        check.text_id("a\x00b", "request_id")
    with pytest.raises(InvalidArgument, match=r"rewards\[1\]"):
        check.all_finite([0.0, math.nan], "rewards")
