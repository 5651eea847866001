"""Checks of client-supplied values that several services share; each raises `InvalidArgument`
naming the field and quoting at most a bounded prefix of the value (errors.quoted).

Services keep their own request checks next to their domain (`services/rollout/validation.py`,
the learner's batch decoding); these are the pieces they have in common: finite numbers, sampling
temperatures, and strings that become names, ids or addresses.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from services.common.errors import InvalidArgument, quoted

# vLLM refuses temperatures above 2 (SamplingParams: "temperature must be in [0, 2]"); the learner
# and the transformers engine use the same bound so every engine accepts the same requests.
MAX_TEMPERATURE = 2.0
# ... and silently raises temperatures below 0.01 to 0.01 (logits / T overflows below it): a request
# at 0.001 would be sampled at 0.01 while its logprobs claim 0.001. Refused instead.
MIN_TEMPERATURE = 0.01
# host:port, host a DNS name, an IPv4 address or a bracketed IPv6 address
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])"
_ADDRESS = re.compile(_HOST + r":(\d{1,5})")


def finite(value: float, field: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"{field} must be a finite number, got {value}")
    return value


def all_finite(values: Iterable[float], field: str) -> None:
    for index, value in enumerate(values):
        if not math.isfinite(value):
            raise InvalidArgument(f"{field}[{index}] must be a finite number, got {value}")


def temperature(value: float, field: str, maximum: float = MAX_TEMPERATURE) -> float:
    """A sampling temperature: finite, ≥ 0.01 (behaviour logprobs need a distribution; see
    MIN_TEMPERATURE), ≤ `maximum`."""
    if not (math.isfinite(value) and MIN_TEMPERATURE <= value <= maximum):
        raise InvalidArgument(f"{field} must be in [{MIN_TEMPERATURE:g}, {maximum:g}], got {value}")
    return value


def _present(value: str, field: str, max_len: int, required: bool) -> bool:
    """False for an allowed empty value; InvalidArgument for a missing or over-long one."""
    if not value:
        if required:
            raise InvalidArgument(f"{field} is empty")
        return False
    if len(value) > max_len:
        raise InvalidArgument(f"{field} is {len(value)} characters long (max {max_len}): {quoted(value)}")
    return True


def text_id(value: str, field: str, max_len: int = 256, required: bool = True) -> str:
    """An id that is only echoed back or logged (prompt and request ids): bounded, no control chars."""
    if _present(value, field, max_len, required) and not value.isprintable():
        raise InvalidArgument(f"{field} contains control characters: {quoted(value)}")
    return value


def address(value: str, field: str = "address") -> str:
    """host:port with a DNS name, IPv4 or [IPv6] host and a port in 1..65535."""
    match = _ADDRESS.fullmatch(value) if len(value) <= 300 else None
    if match is None or not 0 < int(match.group(1)) <= 65535:
        raise InvalidArgument(f"{field} must be host:port (port 1-65535), got {quoted(value)}")
    return value
