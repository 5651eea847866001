"""The OpenEnv adapter against a real OpenEnv server process (examples/openenv_game, from
`.venvs/openenv`): reset → prompt, step → reply and per-turn reward, the final step at scoring, replay
after a lost session, a non-deterministic server caught, and an unreachable or silent server failing
cleanly under the deadline."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.env.base import Message, Score
from services.env.integrations.openenv import OpenEnvEnvironment, OpenEnvError
from services.env.loader import EnvLoadError, load_environment
from tests.env.integrations.openenv_server import OpenEnvServer, openenv_server

OPENING = "I am thinking of a digit from 1 to 9. Guess it!"
SPEC = "services.env.integrations.openenv:OpenEnvEnvironment"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenEnvServer]:
    with openenv_server(tmp_path_factory.mktemp("openenv")) as running:
        yield running


def _env(url: str, **options: object) -> OpenEnvEnvironment:
    env = load_environment(SPEC, {"url": url, "action_field": "guess", **options})
    assert isinstance(env, OpenEnvEnvironment)
    return env


def target_of(seed: int) -> int:
    """The game's hidden digit for a reset seed (its documented rule: random.Random(seed).randint(1, 9))."""
    return random.Random(seed).randint(1, 9)


def closeness(guess: int, target: int) -> float:
    return 1.0 if guess == target else max(0.0, 1.0 - abs(guess - target) / 8)


def _wrong(target: int) -> int:
    return 5 if target != 5 else 4


async def test_reset_observation_is_the_prompt_and_prompts_are_deterministic(server: OpenEnvServer) -> None:
    env = _env(server.url, system_prompt="Play.")
    prompts = await env.sample(6, "train", 10)
    assert prompts == await _env(server.url, system_prompt="Play.").sample(6, "train", 10)
    assert [p.id for p in prompts] == [f"openenv-train-{i}" for i in range(10, 16)]
    assert prompts[0].messages == (
        {"role": "system", "content": "Play."},
        {"role": "user", "content": OPENING},
    )
    assert len({p.metadata["seed"] for p in prompts}) == 6  # one game per position
    other = await _env(server.url, seed=1).sample(6, "train", 10)
    assert [p.metadata["seed"] for p in other] != [p.metadata["seed"] for p in prompts]
    assert env.split_size("train") == 0 and env.split_size("eval") == 32 and env.turn_limit == 4


async def test_steps_map_to_replies_rewards_and_done(server: OpenEnvServer) -> None:
    env = _env(server.url, max_turns=3)
    [prompt] = await env.sample(1, "train", 0)
    target = target_of(int(prompt.metadata["seed"]))
    wrong = _wrong(target)
    before = server.stats()["steps"]
    transcript: list[Message] = [{"role": "assistant", "content": f"I say {wrong}, then 7"}]
    reply = await env.respond(prompt, transcript)
    assert not reply.done and reply.reward == pytest.approx(closeness(wrong, target))
    assert reply.messages == [{"role": "user", "content": "Higher." if wrong < target else "Lower."}]
    transcript += [*reply.messages, {"role": "assistant", "content": str(target)}]
    reply = await env.respond(prompt, transcript)
    assert reply.done and reply.reward == 1.0 and not reply.messages
    assert env.sessions.hits == 1  # the second turn went on in the first turn's session
    assert server.stats()["steps"] - before == 2  # no replay
    assert len(env.sessions) == 0  # a finished episode's session is closed
    # it ended on done, before max_turns: every reward came per turn, the score adds nothing
    assert [s.reward for s in await env.score_episodes(prompt, [transcript])] == [0.0]  # type: ignore[union-attr]


async def test_score_plus_turn_rewards_is_the_episode_return(server: OpenEnvServer) -> None:
    """Played as the scheduler plays it: respond after turns 1 .. max_turns-1, then score."""
    env = _env(server.url, max_turns=2)
    prompts = await env.sample(4, "eval", 0)
    for prompt in prompts:
        target = target_of(int(prompt.metadata["seed"]))
        guesses = [_wrong(target), 9 if target != 9 else 1]
        transcript: list[Message] = [{"role": "assistant", "content": str(guesses[0])}]
        reply = await env.respond(prompt, transcript)
        transcript += [*reply.messages, {"role": "assistant", "content": str(guesses[1])}]
        [score] = await env.score_episodes(prompt, [transcript])
        assert isinstance(score, Score) and score.details["stepped_at_scoring"] == "1"
        total = (reply.reward or 0.0) + (score.reward or 0.0)
        assert total == pytest.approx(sum(closeness(g, target) for g in guesses))
    assert len(env.sessions) == 0  # the scoring step closes its session


async def test_a_lost_session_is_replayed_from_the_transcript(server: OpenEnvServer) -> None:
    env = _env(server.url)
    [prompt] = await env.sample(1, "train", 3)
    target = target_of(int(prompt.metadata["seed"]))
    first: list[Message] = [{"role": "assistant", "content": str(_wrong(target))}]
    reply = await env.respond(prompt, first)
    transcript = [*first, *reply.messages, {"role": "assistant", "content": "x"}]
    # another worker process (a fresh adapter) answers the next turn: it replays turn 1, then steps
    before = server.stats()["steps"]
    elsewhere = _env(server.url)
    again = await elsewhere.respond(prompt, transcript)
    assert (
        again.messages == [{"role": "user", "content": "Say one digit from 1 to 9."}] and again.reward == 0.0
    )
    assert elsewhere.sessions.misses == 1 and server.stats()["steps"] - before == 2
    # the same process after its session died on the server side: replayed too, same answer
    for sessions in env.sessions._live.values():
        for session in sessions:
            await session.ws.close()
    assert await env.respond(prompt, transcript) == again
    assert env.sessions.hits == 0 and env.sessions.misses == 2


async def test_a_transcript_the_server_does_not_reproduce_is_refused(server: OpenEnvServer) -> None:
    env = _env(server.url)
    [prompt] = await env.sample(1, "train", 5)
    target = target_of(int(prompt.metadata["seed"]))
    wrong = _wrong(target)
    lie = "Lower." if wrong < target else "Higher."  # not what the game answered
    transcript: list[Message] = [
        {"role": "assistant", "content": str(wrong)},
        {"role": "user", "content": lie},
        {"role": "assistant", "content": "3"},
    ]
    with pytest.raises(OpenEnvError, match="not deterministic"):
        await env.respond(prompt, transcript)
    moved = prompt.__class__(**{**prompt.__dict__, "metadata": {**prompt.metadata, "observation": "other"}})
    with pytest.raises(OpenEnvError, match="not deterministic"):
        await env.respond(moved, transcript[:1])


async def test_an_action_the_server_refuses_fails_the_turn(server: OpenEnvServer) -> None:
    env = _env(server.url, action_field="message")  # the game's action has `guess`, not `message`
    [prompt] = await env.sample(1, "train", 0)
    with pytest.raises(OpenEnvError, match=r"refused.*VALIDATION_ERROR"):
        await env.respond(prompt, [{"role": "assistant", "content": "4"}])
    [score] = await env.score_episodes(prompt, [[{"role": "assistant", "content": "4"}] * 4])
    assert isinstance(score, Score) and score.reward is None and score.details["failure_kind"] == "openenv"


async def test_an_unreachable_server_fails_cleanly(server: OpenEnvServer, tmp_path: Path) -> None:
    [prompt] = await _env(server.url).sample(1, "train", 0)
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = _env(f"http://127.0.0.1:{port}", timeout=2.0)
    with pytest.raises(OpenEnvError, match="cannot open an OpenEnv session"):
        await env.respond(prompt, [{"role": "assistant", "content": "4"}])
    with pytest.raises(OpenEnvError, match="cannot open an OpenEnv session"):
        await env.sample(1, "train", 0)
    [score] = await env.score_episodes(prompt, [[{"role": "assistant", "content": "4"}] * 4])
    assert isinstance(score, Score) and score.reward is None and "cannot open" in score.failure


async def test_a_silent_server_runs_into_the_deadline(server: OpenEnvServer) -> None:
    """A server that accepts the WebSocket but never answers, and one that never finishes the handshake."""
    from websockets.asyncio.server import serve

    [prompt] = await _env(server.url).sample(1, "train", 0)
    forever = asyncio.Event()

    async def silent(ws: object) -> None:
        await forever.wait()

    async with serve(silent, "127.0.0.1", 0) as ws_server:
        port = next(iter(ws_server.sockets)).getsockname()[1]
        env = _env(f"http://127.0.0.1:{port}", timeout=0.5)
        with pytest.raises(OpenEnvError, match=r"reset took longer than 0\.5s"):
            await env.respond(prompt, [{"role": "assistant", "content": "4"}])
        forever.set()  # the server's close waits for its handlers

    forever.clear()

    async def never_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await forever.wait()

    tcp = await asyncio.start_server(never_handshake, "127.0.0.1", 0)
    async with tcp:
        port = tcp.sockets[0].getsockname()[1]
        env = _env(f"http://127.0.0.1:{port}", timeout=0.5)
        with pytest.raises(OpenEnvError, match="cannot open an OpenEnv session"):
            await env.respond(prompt, [{"role": "assistant", "content": "4"}])
        forever.set()


def test_options_are_validated() -> None:
    with pytest.raises(EnvLoadError, match="url"):
        load_environment(SPEC, {"url": "localhost:8000"})
    with pytest.raises(EnvLoadError, match="unknown option 'nope'"):
        load_environment(SPEC, {"nope": 1})
    env = load_environment(SPEC, {"url": "https://example.org/env/", "max_turns": 6})
    assert isinstance(env, OpenEnvEnvironment) and env.turn_limit == 6
    assert env._url == "wss://example.org/env/ws"
