"""The orchestrator against in-memory peers (tests/scheduler/fakes.py): whole runs in milliseconds.

What a run must survive and how: dead rollouts, env failures, hopeless prompts, stale groups,
failed syncs, misalignment, pause/resume, and rollouts that join mid-run.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.common.errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from services.scheduler.ledger.group_ledger import GroupState
from services.scheduler.pipeline.groups import MAX_ATTEMPTS
from services.scheduler.pipeline.weight_sync import AlignmentError

from .fakes import FakeRollout, cluster


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _trained(c) -> list:
    return [r for r in c.orchestrator.ledger.records() if r.state == GroupState.TRAINED]


async def test_a_run_trains_every_step_once_and_syncs_every_rollout(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeRollout("r0"), FakeRollout("r1"))
    await c.run()
    orch = c.orchestrator
    assert orch.finished and not orch.error
    assert [b.step for b in c.learner.batches] == [0, 1, 2]
    assert all(len(b.groups) == 2 and len(b.advantages) == 2 for b in c.learner.batches)
    assert [r["weight_version"] for r in _rows(tmp_path)] == [1, 2, 3]
    assert all(
        r["rollouts_synced"] == 2 and r["weight_transport"] == "shared_memory" for r in _rows(tmp_path)
    )
    assert {r.version for r in c.rollouts.values()} == {3}
    assert c.learner.prepared == set() and c.learner.released == [1, 2, 3]  # every version released
    trained = _trained(c)
    assert len(trained) == 6 == len({r.group_id for r in trained})
    status = orch.status()
    assert (status.step, status.learner_version, status.finished) == (3, 3, True)
    assert status.groups_by_state["trained"] == 6 and len(status.rollouts) == 2


async def test_an_unavailable_rollout_is_marked_unhealthy_and_its_groups_reissued(tmp_path: Path) -> None:
    doomed = FakeRollout("r0")  # "r0" sorts first: it gets work first
    original = doomed.generate

    async def generate_then_die(request_id, *args, **kwargs):
        if not request_id.startswith("probe"):
            doomed.alive = False  # dies on its first group: this and every later call fail UNAVAILABLE
        return await original(request_id, *args, **kwargs)

    doomed.generate = generate_then_die
    c = cluster(tmp_path, doomed, FakeRollout("r1"))
    await c.run()
    orch = c.orchestrator
    assert orch.finished and not orch.error
    handles = {h.address: h for h in orch.pool.handles()}
    assert not handles["r0"].healthy and handles["r1"].healthy
    records = orch.ledger.records()
    lost = [r for r in records if r.state == GroupState.DROPPED and r.rollout_id == "r0"]
    assert lost and all("UNAVAILABLE" in r.reason or "connection refused" in r.reason for r in lost)
    for dropped in lost:  # each prompt came back as a later attempt and was trained
        assert any(
            r.prompt_id == dropped.prompt_id and r.attempt > dropped.attempt and r.state == GroupState.TRAINED
            for r in records
        )
    assert len(_trained(c)) == 6


async def test_an_env_restarting_is_waited_for_and_the_completions_are_kept(tmp_path: Path) -> None:
    """Scoring a group while the env is down (UNAVAILABLE) is retried until it answers: the group is
    neither dropped nor generated again, and the rollout is not blamed."""
    down = {"calls": 12}  # the env's first 12 scoring calls find it down

    def flaky(prompt_id: str):
        if down["calls"]:
            down["calls"] -= 1
            return Unavailable("env restarting")
        return None

    # the 12 failures fall on whichever groups score first, so one group may wait several retries
    # while the others train: with the default bound it could arrive too stale and be dropped (a
    # correct outcome, but not what this test is about). A bound as long as the run keeps every
    # group trainable, whatever the order of the retries.
    c = cluster(tmp_path, FakeRollout("r0"), max_staleness=3)
    c.env.fail_score = flaky
    await c.run()
    orch = c.orchestrator
    assert orch.finished and down["calls"] == 0
    assert not [r for r in orch.ledger.records() if r.state == GroupState.DROPPED]
    assert all(h.healthy for h in orch.pool.handles())
    assert len(_trained(c)) == 6 and all(r.attempt == 0 for r in orch.ledger.records())


async def test_a_prompt_is_given_up_after_the_attempt_limit_and_a_bad_request_is_never_retried(
    tmp_path: Path,
) -> None:
    c = cluster(tmp_path, FakeRollout("r0"))
    c.env.fail_score = lambda prompt_id: {
        "p0": Aborted("always failing"),
        "p1": InvalidArgument("prompt p1 is malformed"),
    }.get(prompt_id)
    await c.run()
    records = c.orchestrator.ledger.records()
    assert [r.attempt for r in records if r.prompt_id == "p0"] == list(range(MAX_ATTEMPTS))
    assert all(r.state == GroupState.DROPPED for r in records if r.prompt_id in ("p0", "p1"))
    assert [r.attempt for r in records if r.prompt_id == "p1"] == [0]  # not retryable
    assert c.orchestrator.finished and len(_trained(c)) == 6


async def test_a_stale_group_is_dropped_and_its_prompt_reissued(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeRollout("r0", stale_groups=1), max_staleness=1)
    await c.run()
    records = c.orchestrator.ledger.records()
    stale = [r for r in records if r.state == GroupState.DROPPED]
    assert len(stale) == 1 and stale[0].reason == "stale by 2 versions"
    assert any(r.prompt_id == stale[0].prompt_id and r.state == GroupState.TRAINED for r in records)
    assert all(row["staleness_max"] <= 1 for row in _rows(tmp_path))


async def test_a_stage_failure_drops_only_that_rollout_from_the_sync(tmp_path: Path) -> None:
    flaky = FakeRollout("r1", fail_stage=[InvalidArgument("bad manifest")])
    # no health rounds: one between the steps (0.01 s apart on a loaded machine) would sync r1 first
    c = cluster(tmp_path, FakeRollout("r0"), flaky, max_steps=4, health_interval_seconds=3600)
    await c.run()
    rows = _rows(tmp_path)
    assert rows[0]["rollouts_synced"] == 1  # r1 dropped out of the first sync ...
    assert flaky.aborts == [1]  # ... after being told to drop what it had staged
    assert c.orchestrator.finished and not c.orchestrator.error
    # still reachable, so still healthy: it got no work until the next step's sync brought it back
    assert flaky.commits == [2, 3, 4] and c.rollouts["r0"].commits == [1, 2, 3, 4]


async def test_a_rollout_caught_up_while_the_learner_trains_is_not_staged_that_version_again(
    tmp_path: Path,
) -> None:
    # r1 fails the first sync (needs_sync); a health round during the next train step catches it up
    # to the learner's NEW version. The step's own sync must then leave r1 alone: staging a version
    # a rollout holds is refused, and over nccl the refusal stalls the whole group's broadcast.
    flaky = FakeRollout("r1", fail_stage=[InvalidArgument("bad manifest")])
    # the only health round is the one below: a periodic one between the failed sync and the next
    # step (0.01 s apart on a loaded machine) would sync r1 to the old version first
    c = cluster(tmp_path, FakeRollout("r0"), flaky, max_steps=3, health_interval_seconds=3600)
    train_step = c.learner.train_step

    async def train_while_a_health_round_runs(batch):
        result = await train_step(batch)
        await c.orchestrator.catch_up()  # the health monitor, between the step and its sync
        return result

    c.learner.train_step = train_while_a_health_round_runs
    await c.run()
    assert c.orchestrator.finished and not c.orchestrator.error
    assert flaky.aborts == [1]  # only the injected failure: no "not newer" refusals
    assert flaky.commits == [2, 3] and c.rollouts["r0"].commits == [1, 2, 3]
    assert [r["rollouts_synced"] for r in _rows(tmp_path)] == [1, 2, 2]


@pytest.mark.parametrize("action", ["fail", "warn"])
async def test_alignment_beyond_the_threshold_fails_or_warns(tmp_path: Path, action: str) -> None:
    c = cluster(tmp_path, FakeRollout("r0", logprob_offset=0.01), alignment_action=action)
    if action == "fail":
        with pytest.raises(AlignmentError, match="misalignment"):
            await c.run()
        assert "misalignment" in c.orchestrator.error and not c.learner.batches
    else:
        await c.run()
        assert c.orchestrator.finished
        assert all(r["logprob_abs_diff_max"] == pytest.approx(0.01) for r in _rows(tmp_path))


async def test_the_learner_trains_its_next_step_while_the_rollouts_answer_the_probe(tmp_path: Path) -> None:
    """After a step the learner waits only for its own part of the sync (packing the version, scoring
    the probe at it): a rollout that answers the probe of version v only once the learner has trained
    past v would stall a serial sync forever. Each row still carries its own version's probe."""
    learner_versions = []

    async def after_the_next_step(rollout: FakeRollout) -> float:
        if 0 < rollout.version < 4:  # not the start-of-run probe, not the last step's
            await c.learner.wait_for_version(rollout.version + 1)
            learner_versions.append(c.learner.version)
        return rollout.version * 1e-6  # a distinct, tolerated difference per version

    c = cluster(tmp_path, FakeRollout("r0", on_probe=after_the_next_step), max_steps=4)
    await c.run()
    assert c.orchestrator.finished and learner_versions == [2, 3, 4]
    rows = _rows(tmp_path)
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4]
    assert [r["logprob_abs_diff_max"] for r in rows] == pytest.approx([1e-6, 2e-6, 3e-6, 4e-6])
    assert c.rollouts["r0"].commits == [1, 2, 3, 4] and c.learner.released == [1, 2, 3, 4]


async def test_a_misalignment_found_mid_run_stops_it_before_the_next_sync(tmp_path: Path) -> None:
    """The probe of version 2 disagrees: the learner may already train one step past it (its part of
    the sync was done), but version 3 is never synced and no row claims version 2 was checked."""

    async def drift_from_v2(rollout: FakeRollout) -> float:
        return 0.01 if rollout.version >= 2 else 0.0

    c = cluster(tmp_path, FakeRollout("r0", on_probe=drift_from_v2), max_steps=6)
    with pytest.raises(AlignmentError, match="after sync to v2"):
        await c.run()
    assert "misalignment" in c.orchestrator.error
    assert len(c.learner.batches) <= 3 and c.rollouts["r0"].commits == [1, 2]
    assert [r["weight_version"] for r in _rows(tmp_path)] == [1]


async def test_the_probe_comes_from_a_rollout_that_answers(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeRollout("r0", alive=True), FakeRollout("r1"))
    await c.orchestrator.pool.refresh_all(0)
    c.rollouts["r0"].alive = False  # healthy at the last poll, dead by the time the probe runs
    probe = await c.orchestrator.step_sync.alignment.make(c.env, c.orchestrator.pool)
    assert list(probe.completion_token_ids) == [3, 4, 5]
    assert [h.address for h in c.orchestrator.pool.healthy()] == ["r1"]


@pytest.mark.parametrize(("max_tokens", "probe_tokens", "asked"), [(128, 32, 32), (6, 32, 6)])
async def test_the_probe_is_no_longer_than_alignment_probe_tokens(
    tmp_path: Path, max_tokens: int, probe_tokens: int, asked: int
) -> None:
    c = cluster(
        tmp_path, FakeRollout("r0"), sampling={"max_tokens": max_tokens}, alignment_probe_tokens=probe_tokens
    )
    await c.orchestrator.pool.refresh_all(0)
    await c.orchestrator.step_sync.alignment.make(c.env, c.orchestrator.pool)
    ((request_id, sampling),) = c.rollouts["r0"].sampled
    assert request_id.startswith("probe") and (sampling.n, sampling.max_tokens) == (1, asked)


async def test_pause_stops_issuing_and_resume_continues(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeRollout("r0"))
    c.orchestrator.pause(True)
    run = asyncio.create_task(c.run())
    for _ in range(20):  # the run prepares (probe, eval) but issues nothing while paused
        await asyncio.sleep(0.005)
    assert c.orchestrator.status().paused and c.orchestrator.ledger.records() == []
    c.orchestrator.pause(False)
    await run
    assert c.orchestrator.finished and not c.orchestrator.status().paused


async def test_a_rollout_registering_mid_run_gets_the_current_weights_before_any_work(tmp_path: Path) -> None:
    first = FakeRollout("r0", max_in_flight=1)
    c = cluster(tmp_path, first, max_steps=6, max_staleness=3)
    late = FakeRollout("r1", max_in_flight=8)  # a fresh worker: version 0, lots of capacity
    run = asyncio.create_task(c.run())
    await asyncio.wait_for(c.learner.wait_for_version(2), 10)
    first.gate = asyncio.Event()  # r0 stalls from now on, so only the newcomer can make progress
    joined_at = c.orchestrator.version
    c.add_rollout(late)
    await asyncio.wait_for(late.worked.wait(), 10)
    first.gate.set()
    await run
    assert late.commits[0] >= joined_at  # synced to the run's version first (staleness 3 would allow v0) ...
    assert min(late.generated_at) >= late.commits[0]  # ... and only then given work
    assert c.orchestrator.finished and len(_trained(c)) == 12


async def test_a_group_without_weight_versions_is_never_trained_and_its_prompt_reissued(
    tmp_path: Path,
) -> None:
    rollout = FakeRollout("r0")
    original = rollout.generate
    broken = {"left": 1}

    async def generate_one_unstamped_group(request_id, *args, **kwargs):
        completions = await original(request_id, *args, **kwargs)
        if not request_id.startswith("probe") and broken["left"]:
            broken["left"] -= 1
            for c in completions:
                del c.version_spans[:]  # tokens no version produced: must never reach the learner
        return completions

    rollout.generate = generate_one_unstamped_group
    c = cluster(tmp_path, rollout)
    await c.run()
    assert c.orchestrator.finished and not c.orchestrator.error
    dropped = [r for r in c.orchestrator.ledger.records() if r.state == GroupState.DROPPED]
    assert len(dropped) == 1 and "weight-version spans" in dropped[0].reason
    trained_again = [r for r in _trained(c) if r.prompt_id == dropped[0].prompt_id]
    assert trained_again and trained_again[0].attempt == 1
    trained = [x for b in c.learner.batches for g in b.groups for x in g.completions]
    assert trained and all(x.version_spans for x in trained)  # every trained token carries its version


async def test_prompts_are_fetched_ahead_up_to_the_buffer_and_no_further(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeRollout("r0"), prompt_buffer=5, groups_per_batch=2)
    c.orchestrator.pause(True)  # nothing is consumed: the feeder fills the buffer and stops
    run = asyncio.create_task(c.run())
    # wait for the feeder (its start depends on the machine's load), then give it time to overfill
    for _ in range(5000):
        if c.orchestrator.groups.prompts.qsize() >= 5 - 2:
            break
        await asyncio.sleep(0.001)
    for _ in range(20):
        await asyncio.sleep(0.002)
    assert c.orchestrator.groups.prompts.qsize() <= 5 and c.env.cursor <= 5
    assert c.orchestrator.groups.prompts.qsize() >= 5 - 2  # refilled a chunk (B prompts) at a time
    c.orchestrator.pause(False)
    await run
    assert c.orchestrator.finished and len(_trained(c)) == 6


async def test_a_learner_that_cannot_publish_now_defers_the_sync_not_the_run(tmp_path: Path) -> None:
    """cuda_ipc's fence refuses PrepareWeights while a cut-off rollout may still read every buffer:
    training goes on and a later sync brings the rollouts up."""
    c = cluster(tmp_path, FakeRollout("r0"), max_steps=4, max_staleness=2)
    c.learner.fail_prepare = [FailedPrecondition("every staging buffer may still be read by rollout-9")]
    await c.run()
    assert c.orchestrator.finished and not c.orchestrator.error
    rows = _rows(tmp_path)
    assert rows[0]["rollouts_synced"] == 0 and rows[-1]["rollouts_synced"] == 1
    assert c.rollouts["r0"].commits[-1] == 4


async def test_a_probe_missed_at_start_does_not_hold_the_first_evaluation(tmp_path: Path) -> None:
    """The first probe times out: its rollout is taken out of work before the step-0 evaluation. The
    health rounds must be running by then to bring it back, or the evaluation waits forever."""
    missed = []

    async def first_probe_misses(rollout: FakeRollout) -> float:
        if not missed:
            missed.append(True)
            raise DeadlineExceeded(f"rollout {rollout.address}: DEADLINE_EXCEEDED: Deadline Exceeded")
        return 0.0

    c = cluster(
        tmp_path, FakeRollout("r0", on_probe=first_probe_misses), eval_every=1, eval_prompts=2, max_steps=2
    )
    await c.run()
    assert missed and c.orchestrator.finished
    rows = _rows(tmp_path)
    assert rows[0]["eval_only"] and [r["step"] for r in rows if "reward_mean" in r] == [1, 2]


async def test_a_probe_no_rollout_answers_at_first_waits_for_one(tmp_path: Path) -> None:
    """A restarted scheduler whose only rollout misses the probe generation (restarting, or too busy to
    answer in time) waits for it to be ready again instead of failing the run."""
    c = cluster(tmp_path, FakeRollout("r0"))
    await c.orchestrator.pool.refresh_all(0)
    rollout = c.rollouts["r0"]
    rollout.alive = False  # healthy at the last poll, unreachable when the probe is asked
    asyncio.get_running_loop().call_later(0.2, setattr, rollout, "alive", True)
    probe = await asyncio.wait_for(c.orchestrator.step_sync.alignment.make(c.env, c.orchestrator.pool), 5)
    assert list(probe.completion_token_ids) == [3, 4, 5]
    assert [h.address for h in c.orchestrator.pool.healthy()] == ["r0"]
