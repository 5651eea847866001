"""Every HTTP route of the gateway under generated hostile input (hypothesis), against real rollouts.

Per route, generated requests of four kinds: random JSON values as the body; JSON objects whose keys
are the route's own field names (and nested sampling_params / messages) with values of any type,
huge numbers, NaN and infinities among them; junk bytes; and random content types, methods and
headers (X-Session-ID, Authorization, Content-Length lies). Asserted for each: never a 5xx (a
client's mistake is a 4xx with an OpenAI error body naming it; a valid request drawn by chance is a
200), and at the end the gateway still answers a valid request of every route.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.support import gateway

pytestmark = pytest.mark.asyncio(loop_scope="package")

SETTINGS = settings(
    max_examples=int(os.environ.get("GRPO_FUZZ_EXAMPLES", "40")),
    deadline=None,
    derandomize=not os.environ.get("GRPO_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=list(HealthCheck),
)
POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate", "/tokenize")
GET_ROUTES = ("/v1/models", "/health", "/metrics")
FIELDS = [
    "model", "messages", "prompt", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "stop", "seed", "stream", "return_token_ids", "tools", "tool_choice", "logprobs", "top_logprobs",
    "echo", "token_ids", "sampling_params", "add_generation_prompt", "request_id", "user",
]  # fmt: skip
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id"]
HUGE = [
    2**31,
    2**63,
    2**64 + 1,
    -(2**63) - 1,
    10**30,
    -1,
    0,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e308,
]
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["user", "assistant", "tool", "system", "auto", "none", "grpo-mesh", "x" * 5000, "\x00"]),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(HUGE), st.floats(), TEXT
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
MESSAGE = st.dictionaries(st.sampled_from(MESSAGE_FIELDS), JSON, max_size=5)
FIELD_VALUE = st.one_of(JSON, st.lists(MESSAGE, max_size=3), st.lists(st.integers(-5, 2**40), max_size=6))
BODY = st.dictionaries(st.sampled_from(FIELDS), FIELD_VALUE, max_size=8)
CONTENT_TYPES = st.sampled_from(
    ["application/json", "text/plain", "application/x-www-form-urlencoded", "", "\x7f",
     "multipart/form-data; boundary=x", "application/json; charset=latin-1", "application/problem+json"]
)  # fmt: skip
HEADERS = st.dictionaries(
    st.sampled_from(["X-Session-ID", "Authorization", "Accept", "X-Request-ID", "Content-Encoding"]),
    # what an HTTP client can send at all: visible ASCII, no surrounding blanks
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=300).map(str.strip),
    max_size=3,
)


def _encode(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


REQUEST = st.one_of(
    st.builds(_encode, JSON),
    st.builds(_encode, BODY),
    st.binary(max_size=200),
    st.sampled_from([b"", b"{", b'{"messages": [' * 2000, b"\xff\xfe", b"[]", b"null", b'{"n": 1e999999}']),
)


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def gw(rollouts):
    # generation drawn by chance stays short: at most 2 choices of 4 tokens
    limits = {"max_n": 2, "max_tokens": 4, "max_body_bytes": 64 * 1024}
    async with gateway([r.address for r in rollouts], limits=limits) as (running, client):
        yield running, client


async def _assert_served(client, method: str, path: str, content: bytes, headers: dict) -> None:
    reply = await client.request(method, path, content=content, headers=headers)
    assert reply.status_code < 500, (path, content[:200], headers, reply.status_code, reply.text[:300])
    if method == "HEAD":  # a HEAD answer has no body
        return
    if reply.status_code >= 400 and reply.headers.get("content-type", "").startswith("application/json"):
        error = reply.json()["error"]
        assert error["message"] and error["type"]
    elif reply.status_code >= 400:  # refused by uvicorn's HTTP parser before the app saw it
        assert reply.status_code == 400 and "Invalid HTTP request" in reply.text, reply.text


@SETTINGS
@given(path=st.sampled_from(POST_ROUTES), content=REQUEST, content_type=CONTENT_TYPES, headers=HEADERS)
async def test_post_routes_never_answer_5xx(
    gw, path: str, content: bytes, content_type: str, headers: dict
) -> None:
    _, client = gw
    await _assert_served(client, "POST", path, content, {**headers, "Content-Type": content_type})


@SETTINGS
@given(
    path=st.sampled_from(GET_ROUTES + POST_ROUTES + ("/", "/v1", "/v1/chat", "/%00", "/v1/models/../health")),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    content=st.binary(max_size=50),
    headers=HEADERS,
)
async def test_any_method_on_any_path_never_answers_5xx(
    gw, path: str, method: str, content: bytes, headers
) -> None:
    _, client = gw
    await _assert_served(client, method, path, content, headers)


async def test_body_larger_than_the_limit_is_413(gw) -> None:
    _, client = gw
    reply = await client.post(
        "/v1/completions", content=b" " * (70 * 1024), headers={"Content-Type": "application/json"}
    )
    assert reply.status_code == 413
    # a declared length past the limit is refused before anything is read (raw socket: httpx
    # refuses to send a lie); then raw junk where a request line belongs
    running, _ = gw
    for raw in (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 99999999\r\n\r\n{}",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03junk\r\n\r\n",
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
        writer.write(raw)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 30)
        writer.close()
        assert status.split()[1] in (b"413", b"400"), status


async def test_gzip_bodies_are_inflated_within_the_limit(gw) -> None:
    """atropos gzips its bodies: a gzip body is served, one that inflates past the limit (a 64 KiB
    limit, 1 MiB of spaces in ~1 KiB) is 413, bytes that are not gzip are 400, another encoding 415."""
    _, client = gw
    body = json.dumps({"prompt": "1+1=", "max_tokens": 2}).encode()
    gz = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    reply = await client.post("/v1/completions", content=gzip.compress(body), headers=gz)
    assert reply.status_code == 200, reply.text
    bomb = gzip.compress(b" " * (1 << 20))
    assert len(bomb) < 64 * 1024
    reply = await client.post("/v1/completions", content=bomb, headers=gz)
    assert reply.status_code == 413 and "inflated" in reply.json()["error"]["message"]
    reply = await client.post("/v1/completions", content=body, headers=gz)
    assert reply.status_code == 400 and "gzip" in reply.json()["error"]["message"]
    reply = await client.post("/v1/completions", content=body, headers={**gz, "Content-Encoding": "br"})
    assert reply.status_code == 415, reply.text


async def test_still_serving_every_route_afterwards(gw) -> None:
    _, client = gw
    messages = [{"role": "user", "content": "hi"}]
    for path, body in [
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "1+1=", "max_tokens": 2}),
        ("/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}}),
        ("/tokenize", {"prompt": "1+1="}),
    ]:
        reply = await client.post(path, json=body)
        assert reply.status_code == 200, (path, reply.text)
    for path in GET_ROUTES:
        assert (await client.get(path)).status_code == 200
