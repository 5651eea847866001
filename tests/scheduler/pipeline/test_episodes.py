"""Multi-turn episodes through the scheduler, against in-memory peers (tests/scheduler/fakes.py).

Each episode is one growing token sequence: every later turn is generated token-in from exactly the
previous tokens, the environment's turns are its rendered tokens (masked: logprob 0, no version span),
failures end an episode with its reason, and a single-turn task never calls Respond.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2
from services.common.errors import Unavailable

from ..fakes import FakeEnv, FakeRollout, cluster

MODEL, ENV = types_pb2.TURN_SOURCE_MODEL, types_pb2.TURN_SOURCE_ENV


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _episodes(c) -> list[types_pb2.Completion]:
    return [e for b in c.learner.batches for g in b.groups for e in g.completions]


async def test_episodes_grow_token_in_and_mask_the_environment_turns(tmp_path: Path) -> None:
    env = FakeEnv(max_turns=4, turns_per_episode=3)
    c = cluster(tmp_path, FakeRollout("r0"), env=env, max_steps=2)
    await c.run()
    assert c.orchestrator.finished and not c.orchestrator.error
    episodes = _episodes(c)
    assert len(episodes) == 2 * 2 * 2
    groups = [g for b in c.learner.batches for g in b.groups]
    # per-group facts travel once per group, not in each member
    assert all(list(g.prompt_token_ids) == [1, 2] and g.rollout_id == "r0" for g in groups)
    for e in episodes:
        # prompt [1, 2]; model [3, 4, 5]; env [9, 9]; model [3, 4, 5]; env [9, 9]; model [3, 4, 5]
        assert not e.prompt_token_ids and not e.rollout_id and not e.HasField("sampling_params")
        assert list(e.completion_token_ids) == [3, 4, 5, 9, 9, 3, 4, 5, 9, 9, 3, 4, 5]
        assert [(t.source, t.start, t.end) for t in e.turns] == [
            (MODEL, 0, 3), (ENV, 3, 5), (MODEL, 5, 8), (ENV, 8, 10), (MODEL, 10, 13),
        ]  # fmt: skip
        assert list(e.logprobs) == [-1.0] * 3 + [0.0] * 2 + [-1.0] * 3 + [0.0] * 2 + [-1.0] * 3
        spans = [(s.start, s.end) for s in e.version_spans]
        assert spans == [(0, 3), (5, 8), (10, 13)]  # model tokens only, shifted into the episode
        assert "<more 1>" in e.text and "<more 2>" in e.text
    # every later turn continued exactly the episode's tokens so far
    later = [ids for ids in c.rollouts["r0"].token_in if ids]
    assert [1, 2, 3, 4, 5, 9, 9] in later and [1, 2, 3, 4, 5, 9, 9, 3, 4, 5, 9, 9] in later
    # the env saw transcripts (messages), never tokens; and it scored what was said
    transcript = env.scored_transcripts[0][0]
    assert [m.role for m in transcript.messages] == ["assistant", "user", "assistant", "user", "assistant"]
    rows = _rows(tmp_path)
    assert rows[0]["episode/turns_mean"] == 3.0
    assert rows[0]["episode/tool_call_rate"] == 1.0 and rows[0]["episode/prefix_violations"] == 0
    assert rows[0]["episode/valid_tool_call_rate"] == 1.0  # the fake env's calls all ran


async def test_a_single_turn_task_never_calls_respond_and_keeps_one_model_turn(tmp_path: Path) -> None:
    env = FakeEnv()
    c = cluster(tmp_path, FakeRollout("r0"), env=env, max_steps=1)
    await c.run()
    assert env.responded == []
    assert all(not ids for ids in c.rollouts["r0"].token_in)
    assert all(list(e.completion_token_ids) == [3, 4, 5] for e in _episodes(c))
    assert "episode/turns_mean" not in _rows(tmp_path)[0]


async def test_a_prefix_violation_ends_the_episode_as_a_failure_and_is_counted(tmp_path: Path) -> None:
    env = FakeEnv(max_turns=3)
    env.reply = lambda t: env_pb2.EnvReply(messages=[types_pb2.ChatMessage(role="user", content="violate")])
    c = cluster(tmp_path, FakeRollout("r0"), env=env, max_steps=1)
    await c.run()
    assert c.orchestrator.finished
    for transcript in env.scored_transcripts[0]:
        assert transcript.failure.startswith("prefix violation")
    # never re-rendered: the episode keeps only the tokens it had, no env turn was appended
    assert all(list(e.completion_token_ids) == [3, 4, 5] for e in _episodes(c))
    assert _rows(tmp_path)[0]["episode/prefix_violations"] >= 4  # 2 groups x 2 episodes, run-wide


async def test_a_failed_tool_call_counts_as_a_call_but_not_a_valid_one(tmp_path: Path) -> None:
    env = FakeEnv(max_turns=2)
    message = types_pb2.ChatMessage(role="tool", content="error: unknown tool 'rm'")
    env.reply = lambda t: env_pb2.EnvReply(messages=[message], tool_calls=1, tool_errors=1)
    c = cluster(tmp_path, FakeRollout("r0"), env=env, max_steps=1)
    await c.run()
    row = _rows(tmp_path)[0]
    assert row["episode/tool_call_rate"] == 1.0 and row["episode/valid_tool_call_rate"] == 0.0
    assert row["episode/tool_errors_mean"] == 1.0


async def test_token_budget_and_env_failures_end_episodes_with_their_reason(tmp_path: Path) -> None:
    env = FakeEnv(max_turns=5, turns_per_episode=5, max_episode_tokens=9)
    c = cluster(tmp_path, FakeRollout("r0"), env=env, max_steps=1)
    await c.run()
    for transcript in env.scored_transcripts[0]:
        assert transcript.failure.startswith("token budget")
    env2 = FakeEnv(max_turns=3)
    env2.reply = lambda t: env_pb2.EnvReply(done=True, failure="exception: ValueError: boom")
    c2 = cluster(tmp_path / "2", FakeRollout("r0"), env=env2, max_steps=1)
    await c2.run()
    assert all(t.failure == "environment: exception: ValueError: boom" for t in env2.scored_transcripts[0])


async def test_an_env_down_between_turns_is_waited_for_and_the_episodes_go_on(tmp_path: Path) -> None:
    env = FakeEnv(max_turns=3)
    failures = [Unavailable("env: connection refused")] * 3
    env.fail_respond = lambda: failures.pop() if failures else None
    c = cluster(tmp_path, FakeRollout("r0"), env=env, max_steps=1)
    await c.run()
    assert c.orchestrator.finished and not failures
    assert all(len(e.turns) == 3 for e in _episodes(c))  # model, env, model: nothing lost
