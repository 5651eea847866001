"""atropos' trajectory API, served by the gateway in front of a scheduler whose source is "external".

An atropos environment talks to two servers: an inference server and this API. Pointing both at the
gateway (`--openai.base_url http://gw/v1 --env.rollout_server_url http://gw`) runs it unmodified:

    env side       POST /register-env  GET /status-env  POST /scored_data  POST /scored_data_list
                   GET /info  GET /wandb_info  POST /disconnect-env
    trainer side   GET /status (the scheduler is the trainer: /register and /batch are refused, so a
                   second trainer can never drain the run's queue)

What it does beyond atropos' own server (atroposlib/api/server.py):

- **Every sequence is matched to what the gateway generated** (`matching.py`): each span the env says
  the model sampled must be exactly one of the gateway's generations, whose prompt is everything
  before it. The group that goes to the scheduler carries the registry's tokens, behaviour logprobs
  and weight versions, never the env's. A sequence the gateway never produced, a generation used
  twice, or one sampled with top-p/top-k truncation is refused with a 400 that says why (atropos logs
  only the status, so the reason is logged here too and counted at /metrics).
- **Bounded queue, nothing lost.** A submission is answered only once the scheduler has it durably
  in its ledger. While the trainer's queue is full, or the scheduler is restarting, the request is
  held (retrying `SubmitGroups`) for up to `--trajectories.hold-s`, then answered 503 (atropos retries
  5xx); at most `--trajectories.max-held` submissions are held at once, beyond that 503 at once.
  /status-env reports the groups waiting (the scheduler's queue plus the ones held here), which is
  what atropos' env loop reads to stop adding workers: the real bound, not an unbounded list.
- **Steps count when trained** (the scheduler's step), the **staleness bound** applies (a group too
  old is refused, 409), and a **restart resumes**: the scheduler's ledger holds every accepted group
  (a submission id is a digest of its content, so a retried one is acknowledged, never trained twice).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from grpo.common.v1 import types_pb2
from grpo.scheduler.v1 import scheduler_pb2
from services.common.errors import GrpoError, InvalidArgument
from services.common.logging import get_logger
from services.gateway.admission import SchedulerClient
from services.gateway.config import TrajectoryConfig
from services.gateway.errors import ApiError, invalid
from services.gateway.matching import MatchedSequence, Refused, match_sequence
from services.gateway.registry import GenerationRegistry
from services.gateway.routes import read_json, validated

log = get_logger(__name__)

# answered submission ids kept to tell a retry from a reuse (the oldest are forgotten first)
REMEMBERED_SUBMISSIONS = 100_000


class ScoredData(BaseModel):
    """atropos' ScoredData (the fields a trainer reads; the rest are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    env_id: int | None = None
    advantages: list[list[float]] | None = None
    generation_params: dict[str, Any] | None = None


class RegisterEnv(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_token_length: int = -1
    desired_name: str | None = None  # atropos sends its wandb_name: None unless set
    weight: float | None = 1.0
    group_size: int = 0
    min_batch_allocation: float | None = None


@dataclass
class EnvEntry:
    env_id: int
    name: str
    group_size: int
    connected: bool = True


@dataclass
class Counters:
    accepted: int = 0
    duplicates: int = 0
    refused: int = 0  # 4xx: never generated, reused, truncated sampling, malformed
    stale: int = 0
    held_out: int = 0  # 503 after --trajectories.hold-s
    held_max: int = 0  # the most groups held at once
    reasons: dict[str, int] = field(default_factory=dict)


def submission_id(data: ScoredData) -> str:
    """A digest of a group's content: the same group submitted again has the same id."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(json.dumps([data.tokens, data.masks, data.scores], separators=(",", ":")).encode())
    return f"ext-{digest.hexdigest()}"


def group_message(
    data: ScoredData, sequences: list[MatchedSequence], group_id: str, name: str
) -> types_pb2.ScoredGroup:
    """The ScoredGroup the scheduler trains: the matched completions (registry tokens, logprobs and
    versions), the env's scores as rewards; prompt tokens hoisted when every sequence shares them."""
    completions = []
    for index, seq in enumerate(sequences):
        completion = types_pb2.Completion()
        completion.CopyFrom(seq.completion)
        completion.index = index
        completion.prompt_id = group_id
        completion.prompt_token_ids[:] = seq.prompt_token_ids
        completions.append(completion)
    group = types_pb2.ScoredGroup(group_id=group_id, completions=completions, rewards=data.scores)
    group.prompt.id, group.prompt.env_name = group_id, name
    first = sequences[0]
    if all(s.prompt_token_ids == first.prompt_token_ids for s in sequences):
        group.prompt_token_ids[:] = first.prompt_token_ids
        for c in group.completions:
            c.ClearField("prompt_token_ids")
    group.rollout_id = first.completion.rollout_id
    return group


def check_sampling(sequences: list[MatchedSequence]) -> None:
    """The learner scores temperature-only logprobs: a sequence sampled with top-p < 1 or top-k > 0
    cannot be trained as it was sampled."""
    for i, seq in enumerate(sequences):
        params = seq.completion.sampling_params
        if params.top_p not in (0.0, 1.0) or params.top_k > 0:
            raise Refused(
                f"sampled with top_p={params.top_p:g}, top_k={params.top_k}: the learner's logprobs are "
                "temperature-only, so only untruncated sampling (top_p 1, top_k 0) can be trained",
                i,
            )


class Trajectories:
    """The API's state: registered envs, the scheduler's last status, the submissions held."""

    def __init__(
        self, settings: TrajectoryConfig, registry: GenerationRegistry, scheduler: SchedulerClient
    ) -> None:
        self.settings, self.registry, self.scheduler = settings, registry, scheduler
        self.envs: list[EnvEntry] = []
        self.status: scheduler_pb2.GetStatusResponse | None = None
        self.held = 0
        self.counters = Counters()
        self._task: asyncio.Task[None] | None = None
        self._submitted: dict[str, None] = {}  # insertion-ordered: the answered submission ids

    # ---- the scheduler's status ----------------------------------------------------------------

    async def poll_once(self) -> None:
        try:
            self.status = await self.scheduler.status()
        except GrpoError as exc:  # keep the last answer: an env keeps its pace while the scheduler restarts
            log.warning("scheduler status unavailable", error=str(exc))

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._poll(), name="trajectories-poll")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            await self.poll_once()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.scheduler.close()

    def _external(self) -> scheduler_pb2.GetStatusResponse | None:
        s = self.status
        return s if s is not None and s.source == "external" else None

    # ---- env side ------------------------------------------------------------------------------

    def register_env(self, body: RegisterEnv) -> dict[str, Any]:
        s = self._external()
        if s is None:
            return {"status": "wait for trainer to start"}
        if body.group_size != s.group_size:
            raise invalid(
                f"this run trains groups of {s.group_size} (the scheduler's group_size); the env sends "
                f"groups of {body.group_size}: start it with --env.group_size {s.group_size}",
                "group_size",
            )
        name = body.desired_name or "env"
        same = sum(1 for e in self.envs if e.name == name)
        entry = EnvEntry(len(self.envs), name, body.group_size)
        self.envs.append(entry)
        log.info("atropos env registered", env_id=entry.env_id, name=entry.name)
        return {
            "status": "success",
            "env_id": entry.env_id,
            "wandb_name": f"{name}_{same}",
            "checkpoint_dir": "",
            "starting_step": s.step,
            "checkpoint_interval": 0,  # the env's own checkpoints: off (the ledger is the run's state)
            "num_steps": s.max_steps or -1,
        }

    def queue_size(self) -> int:
        """Groups waiting to be trained: the scheduler's queue and the submissions held here."""
        waiting = self.status.queue_depths.get("scored", 0) if self.status is not None else 0
        return int(waiting) + self.held

    def status_env(self, env_id: int | None) -> dict[str, Any]:
        s = self.status
        size = s.group_size if s is not None and s.group_size else 1
        queue = self.queue_size()
        own = queue if len(self.envs) <= 1 else 0
        return {
            "current_step": s.step if s is not None else 0,
            "queue_size": queue,
            "unallocated_fraction": 1.0,
            "self_queue_size": own,
            "max_group_size": size,
            "env_weight": 1.0,
        }

    def info(self) -> dict[str, Any]:
        s = self._external()
        if s is None:
            return {"batch_size": -1, "max_token_len": -1}
        return {"batch_size": s.groups_per_batch * s.group_size, "max_token_len": -1}

    def trainer_status(self) -> dict[str, Any]:
        s = self.status
        return {"current_step": s.step if s is not None else 0, "queue_size": self.queue_size()}

    def disconnect(self, env_id: int | None) -> dict[str, Any]:
        if env_id is not None and 0 <= env_id < len(self.envs):
            self.envs[env_id].connected = False
            return {"status": "success"}
        return {"status": "failure", "error": f"unknown env_id {env_id}"}

    # ---- submissions ---------------------------------------------------------------------------

    def _refuse(self, status: int, reason: str, code: str) -> ApiError:
        self.counters.refused += status != 409
        self.counters.reasons[code] = self.counters.reasons.get(code, 0) + 1
        log.warning("scored data refused", status=status, reason=reason)
        return ApiError(status, reason, None, code=code)

    def _match(self, groups: list[ScoredData]) -> list[tuple[str, types_pb2.ScoredGroup, tuple[bytes, ...]]]:
        matched = []
        for gi, data in enumerate(groups):
            where = f"group {gi}: " if len(groups) > 1 else ""
            n = len(data.tokens)
            if n == 0 or len(data.masks) != n or len(data.scores) != n:
                reason = f"{where}{n} token lists, {len(data.masks)} masks, {len(data.scores)} scores"
                raise self._refuse(400, f"{reason}: one of each per sequence", "malformed_group")
            if not all(math.isfinite(x) for x in data.scores):
                raise self._refuse(400, f"{where}scores must be finite numbers", "malformed_group")
            try:
                sequences = [match_sequence(self.registry, t, m, i) for i, (t, m) in
                             enumerate(zip(data.tokens, data.masks, strict=True))]  # fmt: skip
                check_sampling(sequences)
            except Refused as exc:
                raise self._refuse(400, f"{where}{exc.reason}", "not_generated") from None
            name = self._env_name(data.env_id)
            group_id = submission_id(data)
            keys = tuple(k for s in sequences for k in s.generations)
            matched.append((group_id, group_message(data, sequences, group_id, name), keys))
        return matched

    def _env_name(self, env_id: int | None) -> str:
        if env_id is not None and 0 <= env_id < len(self.envs):
            return f"atropos:{self.envs[env_id].name}"
        return "atropos"

    async def submit(self, groups: list[ScoredData]) -> dict[str, Any]:
        """Match, claim the generations, and hand the groups to the scheduler (held while it has no
        room or is away); 200 once they are durable there."""
        if self.held >= self.settings.max_held:
            self.counters.held_out += 1
            raise ApiError(503, f"{self.held} submissions are already waiting for the trainer's queue; "
                           "retry later", None, "server_error", "overloaded",
                           headers={"Retry-After": "5"})  # fmt: skip
        matched = self._match(groups)
        claimed: list[bytes] = []
        try:
            for group_id, _, keys in matched:
                reused = self.registry.claim(keys)  # all or none
                if not reused:
                    claimed += keys
                elif not self._already_submitted(group_id):  # a retry of an answered one is fine
                    reason = f"{group_id}: a generation in it was already submitted in another group"
                    raise self._refuse(400, f"{reason} (each sample is trained once)", "reused_generation")
            self.held += len(matched)
            self.counters.held_max = max(self.counters.held_max, self.held)
            try:
                answer = await self._forward([m[1] for m in matched])
            finally:
                self.held -= len(matched)
        except BaseException:
            self.registry.release(claimed)
            raise
        return self._answer(answer, matched)

    def _already_submitted(self, group_id: str) -> bool:
        return group_id in self._submitted

    def _remember(self, group_id: str) -> None:
        """Submission ids answered (bounded: the oldest are forgotten; the scheduler's ledger still
        acknowledges a forgotten one as a duplicate, the registry's claim then refuses it as reused)."""
        self._submitted[group_id] = None
        while len(self._submitted) > REMEMBERED_SUBMISSIONS:
            self._submitted.pop(next(iter(self._submitted)))

    async def _forward(self, groups: list[types_pb2.ScoredGroup]) -> scheduler_pb2.SubmitGroupsResponse:
        deadline = time.monotonic() + self.settings.hold_s
        wait = 0.2
        while True:
            try:
                return await self.scheduler.submit(groups, "atropos", self.settings.submit_timeout_s)
            except GrpoError as exc:
                if not exc.retryable:
                    status = 400 if isinstance(exc, InvalidArgument) else 409
                    reason = f"the trainer refused the group: {exc}"
                    raise self._refuse(status, reason, "refused_by_trainer") from None
                if time.monotonic() + wait > deadline:
                    self.counters.held_out += 1
                    reason = f"the trainer could not take the group within {self.settings.hold_s:g} s ({exc})"
                    raise ApiError(503, f"{reason}; retry", None, "server_error", "trainer_busy",
                                   headers={"Retry-After": "5"}) from None  # fmt: skip
            await asyncio.sleep(wait)
            wait = min(wait * 2, 2.0)

    def _answer(self, answer: scheduler_pb2.SubmitGroupsResponse, matched: list) -> dict[str, Any]:
        stale, accepted, duplicates = [], 0, 0
        for (group_id, _, _), verdict, reason in zip(matched, answer.verdicts, answer.reasons, strict=True):
            self._remember(group_id)
            if verdict == scheduler_pb2.GROUP_VERDICT_ACCEPTED:
                self.counters.accepted += 1
                accepted += 1
            elif verdict == scheduler_pb2.GROUP_VERDICT_DUPLICATE:
                self.counters.duplicates += 1
                duplicates += 1
            else:
                self.counters.stale += 1
                stale.append(f"{group_id}: {reason}")
        if stale and len(stale) == len(matched):
            raise self._refuse(409, "; ".join(stale), "stale")
        return {"status": "received", "accepted": accepted, "duplicates": duplicates, "stale": stale}

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {
            "trajectories/accepted": c.accepted,
            "trajectories/duplicates": c.duplicates,
            "trajectories/refused": c.refused,
            "trajectories/stale": c.stale,
            "trajectories/held": self.held,
            "trajectories/held_out": c.held_out,
            "trajectories/held_max": c.held_max,
        }


async def _read(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    """The body as `model`, or a list of them (/scored_data_list); no body reads as `{}`."""
    data = await read_json(request, max_bytes, empty={})
    if isinstance(data, list):
        return [validated(model, item) for item in data]
    return validated(model, data)


def add_routes(app: FastAPI, api: Trajectories, max_bytes: int) -> None:
    """The trajectory API's routes on the gateway's app (its error handlers and token guard apply)."""

    @app.post("/register-env")
    async def register_env(request: Request) -> JSONResponse:
        return JSONResponse(api.register_env(await _read(request, RegisterEnv, max_bytes)))

    @app.get("/status-env")
    async def status_env(request: Request) -> JSONResponse:
        body = await _read(request, _EnvId, max_bytes)
        return JSONResponse(api.status_env(body.env_id))

    @app.post("/scored_data")
    async def scored_data(request: Request) -> JSONResponse:
        body = await _read(request, ScoredData, max_bytes)
        if isinstance(body, list):
            raise invalid("/scored_data takes one group: send a list to /scored_data_list", None)
        return JSONResponse(await api.submit([body]))

    @app.post("/scored_data_list")
    async def scored_data_list(request: Request) -> JSONResponse:
        body = await _read(request, ScoredData, max_bytes)
        groups = body if isinstance(body, list) else [body]
        return JSONResponse(await api.submit(groups))

    @app.get("/info")
    async def info() -> JSONResponse:
        return JSONResponse(api.info())

    @app.get("/wandb_info")
    async def wandb_info() -> JSONResponse:
        return JSONResponse({"group": None, "project": None})

    @app.post("/disconnect-env")
    async def disconnect_env(request: Request) -> JSONResponse:
        return JSONResponse(api.disconnect((await _read(request, _EnvId, max_bytes)).env_id))

    @app.get("/status")
    async def trainer_status() -> JSONResponse:
        return JSONResponse(api.trainer_status())

    @app.post("/register")
    @app.get("/batch")
    async def trainer_only() -> JSONResponse:
        raise ApiError(409, "grpo-mesh's scheduler is this run's trainer: a second trainer cannot "
                       "register or take batches here", None, code="trainer_is_scheduler")  # fmt: skip


class _EnvId(BaseModel):
    model_config = ConfigDict(extra="ignore")

    env_id: int | None = None
