"""The env side of atropos' trajectory API, as grpo-mesh's gateway serves it (httpx, no atroposlib).

    POST /register-env {max_token_length, desired_name, weight, group_size, min_batch_allocation}
         -> {"status": "success", "env_id", "starting_step", "num_steps", ...}
    GET  /status-env   (JSON body {"env_id"}) -> {"current_step", "queue_size", ...}
    POST /scored_data  {tokens, masks, scores, env_id, ...} -> 200 {"status": "received"}

`/scored_data` may hold the request while the trainer's queue is full: the call's read deadline covers
that. A 4xx (the group was refused: tokens the gateway never generated, too stale, malformed) is final
and raised as `Refused` with the gateway's reason; 429/5xx and transport errors are retried with
capped exponential backoff until `retry_deadline_s` has passed, then raised as `Unavailable`.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx


class Refused(Exception):
    """The gateway refused the group (4xx); `status` and the gateway's `reason`."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


class Unavailable(Exception):
    """The trajectory API did not accept the call before the retry deadline."""


def auth_headers() -> dict[str, str]:
    """`Authorization: Bearer $GRPO_TOKEN` when the gateway runs with a token (docs/gateway.md)."""
    token = os.environ.get("GRPO_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def _reason(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(body)[:300]


class TrajectoryClient:
    """One env's connection to the trajectory API."""

    def __init__(self, base_url: str, *, call_timeout_s: float, retry_deadline_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry_deadline_s = retry_deadline_s
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(call_timeout_s, connect=10.0),
            headers=auth_headers(),
        )
        self.env_id: int | None = None

    async def close(self) -> None:
        await self.http.aclose()

    async def _call(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + self.retry_deadline_s
        delay = 0.25
        while True:
            try:
                response = await self.http.request(method, path, json=body)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 300:
                    return response.json()
                if response.status_code != 429 and response.status_code < 500:
                    raise Refused(response.status_code, _reason(response))
                last = f"{response.status_code}: {_reason(response)}"
                retry_after = response.headers.get("retry-after")
                if retry_after and retry_after.replace(".", "", 1).isdigit():
                    delay = max(delay, float(retry_after))
            if time.monotonic() + delay > deadline:
                raise Unavailable(f"{method} {path}: {last}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def register(self, *, name: str, group_size: int, max_token_length: int) -> dict[str, Any]:
        body = {
            "max_token_length": max_token_length,
            "desired_name": name,
            "weight": 1.0,
            "group_size": group_size,
            "min_batch_allocation": None,
        }
        answer = await self._call("POST", "/register-env", body)
        if answer.get("status") != "success" or "env_id" not in answer:
            raise Refused(200, f"/register-env answered {answer}")
        self.env_id = int(answer["env_id"])
        return answer

    async def status(self) -> dict[str, Any]:
        return await self._call("GET", "/status-env", {"env_id": self.env_id})

    async def submit(self, group: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", "/scored_data", {**group, "env_id": self.env_id})
