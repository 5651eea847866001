"""Digit hunt: a small multi-turn game written only against OpenEnv 0.10.0's public server API.

It runs from the OpenEnv virtualenv (`bash scripts/venv_openenv.sh` creates `.venvs/openenv`), never
from grpo-mesh's own `.venv`, whose vLLM needs an `mcp` that openenv's pins refuse:

    .venvs/openenv/bin/python examples/openenv_game/server.py --port 8000
    .venvs/openenv/bin/python -m uvicorn --app-dir examples/openenv_game server:app --port 8000

`--port 0` picks a free port; the chosen one is printed (`listening on http://127.0.0.1:PORT`) and,
with `--port-file`, written to that file. grpo-mesh trains on it through its OpenEnv adapter:
`--env services.env.integrations.openenv:OpenEnvEnvironment --env-arg url=http://127.0.0.1:PORT
--env-arg action_field=guess`.

The game: `reset(seed)` draws a hidden digit in 1..9 from the seed (the same seed, the same digit;
the opening message never reveals it). Each `step` takes a `GuessAction` whose text is the player's
message; its first digit is the guess. A right guess earns 1.0 and ends the game; a wrong one earns
its closeness, max(0, 1 - |guess - digit| / 8), with "Higher." or "Lower." as the next message; a
message with no digit earns 0. The game ends after 3 guesses. The episode's return is the sum of its
step rewards. The closeness part is what a tiny model can climb within a few steps: naming digits
near the middle of 1..9 already earns more than naming 1.

`GET /stats` (a route of this example, not of OpenEnv) counts the resets and steps the server has
served, so a test can tell that rewards really came from here.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import threading
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

HIGH = 9
MAX_GUESSES = 3
OPENING = f"I am thinking of a digit from 1 to {HIGH}. Guess it!"


class GuessAction(Action):
    """One player turn: free text whose first digit is the guess."""

    guess: str = Field(description="The player's message; its first digit is the guess.")


class HuntObservation(Observation):
    """What the player reads next."""

    message: str = Field(default="", description="The game's message to the player.")


class HuntState(State):
    """The session's game: the hidden digit and the guesses so far."""

    target: int = 0
    guesses: list[int | None] = Field(default_factory=list)


class _Counters:
    """Resets and steps served by this process, over all sessions (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.resets = 0
        self.steps = 0

    def add(self, resets: int = 0, steps: int = 0) -> None:
        with self._lock:
            self.resets += resets
            self.steps += steps

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"resets": self.resets, "steps": self.steps}


COUNTERS = _Counters()


def first_digit(text: str) -> int | None:
    """The first decimal digit in `text`, or None."""
    for char in text:
        if char.isdigit() and char.isascii():
            return int(char)
    return None


class DigitHuntEnvironment(Environment[GuessAction, HuntObservation, HuntState]):
    """Guess a hidden digit in 1..9 in at most 3 tries, with Higher/Lower feedback."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own instance and no shared state

    def __init__(self) -> None:
        super().__init__()
        self._state = HuntState(episode_id=str(uuid.uuid4()), step_count=0)
        self._done = True

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> HuntObservation:
        target = random.Random(seed).randint(1, HIGH)
        self._state = HuntState(episode_id=episode_id or str(uuid.uuid4()), step_count=0, target=target)
        self._done = False
        COUNTERS.add(resets=1)
        return HuntObservation(message=OPENING, done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> HuntObservation:
        if self._done:
            raise ValueError("the game is over: reset to play again")
        COUNTERS.add(steps=1)
        guess = first_digit(action.guess)
        self._state.step_count += 1
        self._state.guesses.append(guess)
        target = self._state.target
        if guess is None:
            reward, message = 0.0, f"Say one digit from 1 to {HIGH}."
        elif guess == target:
            reward, message = 1.0, "Right!"
        else:
            reward = max(0.0, 1.0 - abs(guess - target) / (HIGH - 1))
            message = "Higher." if guess < target else "Lower."
        self._done = guess == target or self._state.step_count >= MAX_GUESSES
        return HuntObservation(message=message, done=self._done, reward=reward)

    @property
    def state(self) -> HuntState:
        return self._state


def build_app(max_sessions: int = 256) -> FastAPI:
    """OpenEnv's app (HTTP /reset, /step, /state, /health, /schema and the /ws session protocol)
    around the game, plus this example's GET /stats."""
    app = create_app(
        DigitHuntEnvironment,
        GuessAction,
        HuntObservation,
        env_name="digit_hunt",
        max_concurrent_envs=max_sessions,
        state_cls=HuntState,
    )

    @app.get("/stats")
    def stats() -> dict[str, int]:
        return COUNTERS.snapshot()

    return app


app = build_app()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the digit-hunt OpenEnv environment.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 = a free port (printed)")
    parser.add_argument("--port-file", default="", help="write the port here once listening")
    parser.add_argument("--max-sessions", type=int, default=256, help="concurrent WebSocket sessions")
    args = parser.parse_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(args.max_sessions), log_level="warning"))
    if args.port_file:
        with open(args.port_file, "w") as f:
            f.write(str(port))
    print(f"listening on http://{args.host}:{port}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1:])
