"""Isolated scoring: a small pool of worker processes, each holding its own copy of the scorer.

Why processes: reward code is user code. It may be CPU-heavy, block, hang forever or crash the
interpreter; none of that may touch the service's event loop. Each worker is a `spawn`ed process that
rebuilds the scorer (the environment, or a RewardFunctionScorer around it) from its `EnvRecipe`,
calls `setup_scorer()` once, then serves one call at a time over a pipe: a group to score (by its
completions' texts, or by its episodes' transcripts through `score_episodes`), or the live episodes of
a group to answer (`respond`, multi-turn environments: tools run here too, never in the service).

Per call the parent waits at most `timeout` seconds. A worker that times out or dies is killed through
its own process handle and replaced; the call's completions become failures ("timeout", "crash").
A hung call must not hold up the others for its whole timeout: when a call has waited `spare_after`
seconds for a free worker, the pool starts a spare one (up to `max_workers`), and spares beyond
`workers` stop again when they come back with nobody waiting.
An exception inside `score` fails the whole call ("exception"); `validate_scores` turns wrong-length
output, None, non-finite and out-of-range rewards into per-completion failures. Nothing here raises
for a scorer fault: the caller always gets one `Score` per completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import multiprocessing
import multiprocessing.connection
import signal
import traceback
from collections import Counter
from collections.abc import Sequence
from typing import Any

from services.common.errors import ResourceExhausted
from services.common.logging import get_logger
from services.env.base import Message, PromptItem, Reply, Score, as_score, failure
from services.env.loader import EnvLoadError, EnvRecipe, load_recipe

log = get_logger(__name__)


def validate_scores(raw: Any, n: int, reward_range: tuple[float, float]) -> list[Score]:
    """Exactly `n` scores: wrong shapes, None, non-finite and out-of-range rewards become failures."""
    try:
        items = list(raw)
    except TypeError:
        return [
            failure("bad_output", f"scorer returned {type(raw).__name__}, expected a list") for _ in range(n)
        ]
    if len(items) != n:
        return [
            failure("bad_output", f"scorer returned {len(items)} scores for {n} completions")
            for _ in range(n)
        ]
    low, high = reward_range
    scores: list[Score] = []
    for item in items:
        score = as_score(item)
        reward = score.reward
        if score.failure:
            score.details.setdefault("failure_kind", "scorer")
        elif reward is None:
            score = failure("no_reward", "scorer returned no reward")
        elif not math.isfinite(reward):
            score = failure("non_finite", f"reward {reward!r} is not finite")
        elif not low <= reward <= high:
            score = failure("out_of_range", f"reward {reward!r} outside [{low}, {high}]")
        scores.append(score)
    return scores


async def _respond_all(
    env: Any, prompt: PromptItem, transcripts: list[list[Message]], deadline_s: float
) -> list[Reply | str]:
    """Every episode's reply, concurrently; one that raises or runs past `deadline_s` is its failure text."""

    async def one(transcript: list[Message]) -> Reply | str:
        try:
            reply = await asyncio.wait_for(env.respond(prompt, transcript), deadline_s)
        except TimeoutError:
            return f"timeout: respond took longer than {deadline_s:g}s"
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return f"exception: {type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})"
        if not isinstance(reply, Reply):
            return f"bad_output: respond returned {type(reply).__name__}, expected a Reply"
        return reply

    return list(await asyncio.gather(*(one(t) for t in transcripts)))


def _worker_main(conn: multiprocessing.connection.Connection, recipe: EnvRecipe) -> None:
    """Entry point of a scoring worker process."""
    # The parent owns this process's lifecycle; a terminal Ctrl-C must not kill it mid-reply.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        loaded = load_recipe(recipe)
        env, scorer = loaded.env, loaded.scorer
        scorer.setup_scorer()
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", scorer.reward_range))
    loop = asyncio.new_event_loop()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        kind, prompt, texts, transcripts, timeout = message
        try:
            result: Any
            if kind == "respond":
                result = loop.run_until_complete(_respond_all(env, prompt, transcripts, timeout))
                reply: tuple[str, Any] = ("ok", result)
            else:
                if transcripts is not None and hasattr(scorer, "score_episodes"):
                    result = scorer.score_episodes(prompt, transcripts)
                else:
                    result = scorer.score(prompt, texts)
                if inspect.isawaitable(result):
                    result = loop.run_until_complete(result)
                reply = ("ok", [as_score(s) for s in result])
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            reply = ("error", f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})")
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result
            conn.send(("error", f"could not send the result back: {type(exc).__name__}: {exc}"))


class _Worker:
    """One scoring process and the parent's end of its pipe. All methods block: call them in a thread."""

    def __init__(self, recipe: EnvRecipe, startup_timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, recipe), daemon=True, name="env-scorer")
        self.process.start()
        child.close()
        if not self.conn.poll(startup_timeout):
            self.kill()
            raise EnvLoadError(f"scoring worker did not start within {startup_timeout:g}s")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            self.kill()
            raise EnvLoadError("scoring worker died while loading the environment") from None
        if status != "ready":
            self.kill()
            raise EnvLoadError(f"scoring worker could not load the environment: {payload}")
        self.reward_range: tuple[float, float] = payload

    def call(self, message: tuple[Any, ...], timeout: float) -> tuple[str, Any]:
        """("ok", result) | ("error", message) | ("timeout", message) | ("crash", message)."""
        try:
            self.conn.send(message)
            if not self.conn.poll(timeout):
                self.kill()
                return "timeout", f"the call took longer than {timeout:g}s; worker killed and replaced"
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            self.kill()
            return "crash", f"scoring worker died (exit code {self.process.exitcode}): {type(exc).__name__}"

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and not self.conn.closed

    def kill(self) -> None:
        """Kill this worker through its own process handle."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()

    def stop(self) -> None:
        """Ask the worker to exit, then make sure it did."""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.process.join(2)
        self.kill()


class ScoringPool:
    """`workers` scoring processes behind an async interface; at most `max_pending` calls wait for one."""

    def __init__(
        self,
        recipe: EnvRecipe,
        *,
        workers: int = 1,
        max_workers: int | None = None,
        spare_after: float = 1.0,
        timeout: float = 10.0,
        startup_timeout: float = 120.0,
        max_pending: int = 256,
        reward_range: tuple[float | None, float | None] = (None, None),
    ) -> None:
        self.recipe = recipe
        self.size = workers
        self.max_size = max(workers, max_workers or workers)
        self.spare_after = spare_after
        self._starting = 0  # spares being started
        self._waiting = 0  # calls waiting for a free worker
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.max_pending = max_pending
        self.reward_range: tuple[float, float] = (-math.inf, math.inf)
        self._range_override = reward_range
        self.counters: Counter[str] = Counter()
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._pending = 0
        self._tasks: set[asyncio.Task[list[Score]]] = set()

    @property
    def running(self) -> int:
        """Worker processes running now (spares included)."""
        return len(self._workers)

    async def start(self) -> None:
        """Start every worker (they load the environment); raises EnvLoadError if they cannot."""
        workers = await asyncio.gather(
            *(asyncio.to_thread(_Worker, self.recipe, self.startup_timeout) for _ in range(self.size)),
            return_exceptions=True,
        )
        errors = [w for w in workers if isinstance(w, BaseException)]
        for worker in workers:
            if isinstance(worker, _Worker):
                self._workers.add(worker)
                self._idle.put_nowait(worker)
                low, high = worker.reward_range
                override_low, override_high = self._range_override
                self.reward_range = (
                    low if override_low is None else override_low,
                    high if override_high is None else override_high,
                )
        if errors:
            await self.close()
            raise errors[0]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(asyncio.to_thread(w.stop) for w in self._workers))
        self._workers.clear()

    async def score(
        self,
        prompt: PromptItem,
        completions: Sequence[str],
        transcripts: Sequence[list[Message]] | None = None,
    ) -> list[Score]:
        """One validated Score per completion (per episode, with `transcripts`); scorer faults come
        back as failures, never as exceptions."""
        if not completions:
            return []
        return await self._submit(self._run(prompt, list(completions), transcripts))

    async def respond(
        self, prompt: PromptItem, transcripts: Sequence[list[Message]], deadline_s: float
    ) -> list[Reply | str]:
        """The environment's reply to each live episode (a failure text where it could not answer):
        `deadline_s` per episode inside the worker, and the worker killed a little after it."""
        if not transcripts:
            return []
        return await self._submit(self._respond(prompt, list(transcripts), deadline_s))

    async def _submit(self, work: Any) -> Any:
        if self._pending >= self.max_pending:
            work.close()
            raise ResourceExhausted(
                f"{self._pending} calls already waiting for a worker (max {self.max_pending})"
            )
        self._pending += 1
        # The call owns its worker until the worker is free again, even if our caller is cancelled.
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(task)
        finally:
            self._pending -= 1

    async def _acquire(self) -> _Worker:
        """A free worker; after `spare_after` s of waiting, start a spare (a hung call holds one)."""
        if not self._idle.empty():
            return self._idle.get_nowait()
        self._waiting += 1
        getter = asyncio.ensure_future(self._idle.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=self.spare_after)
                if done:
                    return getter.result()
                if len(self._workers) + self._starting < self.max_size:
                    self._starting += 1
                    spare = asyncio.ensure_future(self._start_spare())
                    self._tasks.add(spare)  # type: ignore[arg-type]
                    spare.add_done_callback(self._tasks.discard)  # type: ignore[arg-type]
        except BaseException:
            if getter.done() and not getter.cancelled():
                self._idle.put_nowait(getter.result())  # got one just as we were cancelled: give it back
            getter.cancel()
            raise
        finally:
            self._waiting -= 1

    async def _start_spare(self) -> None:
        try:
            worker = await asyncio.to_thread(_Worker, self.recipe, self.startup_timeout)
        except EnvLoadError as exc:
            log.error("spare scoring worker failed to start", error=str(exc))
            return
        finally:
            self._starting -= 1
        self._workers.add(worker)
        self.counters["spare_workers_started"] += 1
        log.info("spare scoring worker started: a call waited for a free one", workers=len(self._workers))
        self._idle.put_nowait(worker)

    async def _release(self, worker: _Worker) -> None:
        if not worker.alive and len(self._workers) > self.size:
            self._workers.discard(worker)  # a dead spare is not replaced
        elif not worker.alive:
            await self._replace(worker)
        elif len(self._workers) > self.size and self._waiting == 0:
            self._workers.discard(worker)  # a spare nobody waits for: stop it
            await asyncio.to_thread(worker.stop)
        else:
            self._idle.put_nowait(worker)

    async def _call(self, message: tuple[Any, ...], deadline_s: float) -> tuple[str, Any]:
        worker = await self._acquire()
        try:
            return await asyncio.to_thread(worker.call, message, deadline_s)
        except BaseException:
            worker.kill()
            raise
        finally:
            await self._release(worker)

    async def _respond(
        self, prompt: PromptItem, transcripts: list[list[Message]], deadline_s: float
    ) -> list[Reply | str]:
        # The worker's own per-episode deadline answers first; this one catches a worker stuck in
        # code that never yields (a CPU-bound tool) and replaces it.
        message = ("respond", prompt, None, transcripts, deadline_s)
        status, payload = await self._call(message, deadline_s + 5.0)
        self.counters["responded_episodes"] += len(transcripts)
        if status != "ok":
            kind = "exception" if status == "error" else status
            log.warning("respond failed", kind=kind, error=payload, prompt_id=prompt.id)
            self.counters[f"respond_failures.{kind}"] += len(transcripts)
            return [f"{kind}: {payload}"] * len(transcripts)
        replies: list[Reply | str] = list(payload)
        for reply in replies:
            if isinstance(reply, str):
                self.counters[f"respond_failures.{reply.split(':', 1)[0]}"] += 1
        return replies

    async def _run(
        self, prompt: PromptItem, completions: list[str], transcripts: Sequence[list[Message]] | None = None
    ) -> list[Score]:
        message = ("score", prompt, completions, None if transcripts is None else list(transcripts), None)
        status, payload = await self._call(message, self.timeout)
        n = len(completions)
        if status == "ok":
            scores = validate_scores(payload, n, self.reward_range)
        else:
            kind = "exception" if status == "error" else status
            log.warning("scoring failed", kind=kind, error=payload, prompt_id=prompt.id)
            scores = [failure(kind, payload) for _ in range(n)]
        self.counters["scored_completions"] += n
        for score in scores:
            if score.failure:
                self.counters[f"failures.{score.details.get('failure_kind', 'exception')}"] += 1
        return scores

    async def _replace(self, dead: _Worker) -> None:
        """Swap a killed/dead worker for a fresh one; retried until it starts (the pool never shrinks)."""
        self._workers.discard(dead)
        self.counters["worker_restarts"] += 1
        while True:
            try:
                worker = await asyncio.to_thread(_Worker, self.recipe, self.startup_timeout)
            except EnvLoadError as exc:
                log.error("scoring worker restart failed; retrying", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            self._workers.add(worker)
            self._idle.put_nowait(worker)
            return
