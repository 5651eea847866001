"""The studio's HTTP API and page (FastAPI). Routes only translate: the work is in runs.py (which runs,
start/stop, the live scheduler), record.py (metrics.jsonl and the ledger, read-only) and policy.py.

    GET  /                                   the page (static/index.html; `?token=` once sets a cookie)
    GET  /health                             200 while serving
    GET  /api/runs                           the runs: id, directory, started here or not
    POST /api/runs                           start one from the form (422: {"errors": {field: message}})
    GET  /api/runs/{id}/state                phase, GetStatus (live or from the record), why not live
    POST /api/runs/{id}/stop|pause|resume
    GET  /api/runs/{id}/metrics?offset=N     metrics.jsonl rows from byte N on, and the next offset
    GET  /api/runs/{id}/events               the ledger's events (starts, restarts, recoveries, ending)
    GET  /api/runs/{id}/steps                trained steps: train version, groups, mean reward
    GET  /api/runs/{id}/steps/{step}         that step's groups, tokens by version and |Δ logprob|
                                             (?min_reward=&max_reward=&failure=&min_staleness=)
    GET  /api/runs/{id}/checkpoints          what compare can load: base and step_* checkpoints
    POST /api/runs/{id}/chat                 the live policy answers one prompt
    POST /api/runs/{id}/compare              two sources (live, base, step_*) answer the same prompt

Errors are mapped in one place (`_error`): a domain error (services/common/errors.py) becomes its
HTTP status with {"error": message}: 400 bad input, 404 unknown run or step, 409 not possible in the
run's state, 503 the run's services are unreachable, 504 a deadline passed.
"""

from __future__ import annotations

import dataclasses
import hmac
import sqlite3
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    GrpoError,
    InvalidArgument,
    NotFound,
    Unauthenticated,
)
from services.env.loader import EnvLoadError, load_environment, parse_env_args
from services.studio import record
from services.studio.config import StudioSettings
from services.studio.form import StartForm, field_errors
from services.studio.policy import CheckpointModels, Question, checkpoints, live_answer, token_texts
from services.studio.runs import Runs

STATIC = Path(__file__).with_name("static")
COOKIE = "grpo_studio_token"


class Ask(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=20_000)
    chat: bool = False
    temperature: float = Field(default=1.0, ge=0, le=5)
    max_tokens: int = Field(default=32, ge=1, le=4096)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)


class Compare(Ask):
    left: str = "base"
    right: str = "live"


def _status_of(exc: GrpoError) -> int:
    if isinstance(exc, InvalidArgument):
        return 400
    if isinstance(exc, Unauthenticated):
        return 401
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, FailedPrecondition):
        return 409
    if isinstance(exc, DeadlineExceeded):
        return 504
    return 503 if exc.unreachable or exc.retryable else 502


def _error(exc: Exception) -> JSONResponse:
    """The one place an exception becomes an HTTP answer."""
    if isinstance(exc, ValidationError):
        return JSONResponse({"error": "invalid request", "errors": field_errors(exc)}, status_code=422)
    if isinstance(exc, EnvLoadError):  # before GrpoError: it is one (InvalidArgument), but of the form
        return JSONResponse({"error": "invalid request", "errors": {"env_args": str(exc)}}, status_code=422)
    if isinstance(exc, GrpoError):
        return JSONResponse({"error": " ".join(str(exc).split())}, status_code=_status_of(exc))
    if isinstance(exc, sqlite3.Error | OSError):
        return JSONResponse({"error": f"cannot read the run: {exc}"}, status_code=503)
    raise exc


def _check_env(form: StartForm) -> None:
    """The environment loads with these options (its own Options model says what is wrong)."""
    load_environment(form.env, parse_env_args(form.env_args))


def build_app(settings: StudioSettings) -> FastAPI:
    runs = Runs(settings.runs_root, settings.run_dir, settings.call_timeout_s, settings.control_wait_s)
    models = CheckpointModels()
    app = FastAPI(title="grpo-mesh studio", docs_url=None, redoc_url=None)
    app.state.runs = runs

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if not settings.token or request.url.path == "/health":
            return await call_next(request)
        given = request.query_params.get("token") or request.cookies.get(COOKIE, "")
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            given = header[7:]
        if not hmac.compare_digest(given.encode(), settings.token.encode()):
            return JSONResponse({"error": "a token is required (open /?token=...)"}, status_code=401)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(COOKIE, settings.token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(GrpoError)
    async def grpo_error(_: Request, exc: GrpoError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(sqlite3.Error)
    async def ledger_error(_: Request, exc: sqlite3.Error) -> JSONResponse:
        return _error(exc)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # Routes that read files (the run dir, the ledger, a tokenizer) are plain functions: FastAPI runs
    # them in its thread pool, off the event loop.
    @app.get("/api/runs")
    def list_runs() -> dict[str, Any]:
        found = runs.all()
        return {
            "runs": [{"id": k, "dir": str(v), "started_here": k in runs.launched} for k, v in found.items()]
        }

    @app.post("/api/runs")
    async def start(request: Request) -> JSONResponse:
        try:
            form = StartForm.model_validate(await request.json())
        except ValueError as exc:  # ValidationError, or a body that is not JSON
            if isinstance(exc, ValidationError):
                return _error(exc)
            return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
        try:
            _check_env(form)
        except EnvLoadError as exc:
            return _error(exc)
        return JSONResponse({"id": runs.start(form)}, status_code=201)

    @app.get("/api/runs/{run_id}/state")
    async def state(run_id: str) -> dict[str, Any]:
        return await runs.state(run_id)

    @app.post("/api/runs/{run_id}/stop")
    async def stop(run_id: str) -> dict[str, Any]:
        runs.stop(run_id)
        return {"stopping": True}

    @app.post("/api/runs/{run_id}/pause")
    async def pause(run_id: str) -> dict[str, Any]:
        return {"paused": await runs.pause(run_id, True)}

    @app.post("/api/runs/{run_id}/resume")
    async def resume(run_id: str) -> dict[str, Any]:
        return {"paused": await runs.pause(run_id, False)}

    @app.get("/api/runs/{run_id}/metrics")
    def metrics(run_id: str, offset: int = 0) -> dict[str, Any]:
        rows = record.read_rows(runs.path(run_id), max(0, offset))
        return {"rows": rows.rows, "offset": rows.offset}

    @app.get("/api/runs/{run_id}/events")
    def events(run_id: str) -> dict[str, Any]:
        return {"events": record.events(runs.path(run_id))}

    @app.get("/api/runs/{run_id}/steps")
    def steps(run_id: str) -> dict[str, Any]:
        found = record.list_steps(runs.path(run_id))
        return {
            "steps": [{**dataclasses.asdict(s), "reward_mean": record.finite(s.reward_mean)} for s in found]
        }

    @app.get("/api/runs/{run_id}/steps/{step}")
    def step_groups(
        run_id: str, step: int, min_reward: float | None = None, max_reward: float | None = None,
        failure: str = "", min_staleness: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        run_dir = runs.path(run_id)
        loss, mode = _objective(run_dir)
        groups = record.step_groups(run_dir, step, token_texts(run_dir), loss, mode)
        if not groups and step not in {s.step for s in record.list_steps(run_dir)}:
            raise NotFound(f"run {run_id!r} has no trained step {step}")
        shown = []
        for group in groups:
            kept = [
                c for c in group.completions
                if (min_reward is None or c.reward >= min_reward)
                and (max_reward is None or c.reward <= max_reward)
                and (not failure or c.failure == failure) and c.staleness >= min_staleness
            ]  # fmt: skip
            if kept:
                shown.append(
                    {**dataclasses.asdict(group), "completions": [dataclasses.asdict(c) for c in kept]}
                )
        return {"step": step, "groups": shown, "total_groups": len(groups)}

    @app.get("/api/runs/{run_id}/checkpoints")
    def list_checkpoints(run_id: str) -> dict[str, Any]:
        return {"sources": ["live", "base", *checkpoints(runs.path(run_id))]}

    async def _answer(run_id: str, source: str, ask: Ask) -> dict[str, Any]:
        run_dir = runs.path(run_id)
        if ask.max_tokens > settings.max_chat_tokens:
            raise InvalidArgument(
                f"max_tokens {ask.max_tokens} is over the studio's {settings.max_chat_tokens}"
            )
        question = Question(ask.prompt, ask.chat, ask.temperature, ask.max_tokens, ask.seed)
        if source == "live":
            status = await runs.status(run_id)
            healthy = [r for r in status.rollouts if r.healthy] or list(status.rollouts)
            if not healthy:
                raise FailedPrecondition(f"run {run_id!r} has no rollout to answer")
            answer = await live_answer(run_dir, healthy[0].address, question, settings.generate_timeout_s)
        else:
            answer = await models.answer(run_dir, source, question)
        return dataclasses.asdict(answer)

    @app.post("/api/runs/{run_id}/chat")
    async def chat(run_id: str, ask: Ask) -> dict[str, Any]:
        return await _answer(run_id, "live", ask)

    @app.post("/api/runs/{run_id}/compare")
    async def compare(run_id: str, ask: Compare) -> dict[str, Any]:
        return {"left": await _answer(run_id, ask.left, ask), "right": await _answer(run_id, ask.right, ask)}

    return app


def _objective(run_dir: Path) -> tuple[str, str]:
    """The run's loss and advantage mode (run.toml), to recompute the advantages it trained with."""
    import tomllib

    config = run_dir / "run.toml"
    if not config.exists():
        return "grpo", "auto"
    table = tomllib.loads(config.read_text())
    loss = table.get("learner", {}).get("loss", {}).get("kind", "grpo")
    return loss, str(table.get("scheduler", {}).get("advantage_mode", "auto"))
