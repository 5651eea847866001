"""The run's timeline (`[scheduler] trace`): trace events Perfetto reads, lanes that never overlap,
one span per step, sync phase and group, and nothing recorded when it is off."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

from services.scheduler.observe.timeline import EVALUATE, LEARNER, SCORE, SYNC, Timeline
from tests.scheduler.fakes import FakeRollout, cluster


def load(path: Path) -> tuple[dict[int, str], list[dict]]:
    """Track names by tid, and the non-metadata events."""
    events = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    return names, [e for e in events if e["ph"] != "M"]


def test_spans_become_trace_events_and_the_file_is_json_once_closed(tmp_path: Path) -> None:
    timeline = Timeline()
    timeline.span(LEARNER, "ignored", 0.0, 1.0)  # not open: nothing recorded
    assert timeline.recorded == 0 and not timeline.enabled
    path = tmp_path / "trace.json"
    timeline.open(path)
    t0 = timeline._origin
    timeline.span(LEARNER, "train step", t0 + 0.5, t0 + 1.25, step=1)
    timeline.async_span("generate r0", "generate", "g1", t0 + 0.25, t0 + 1.0, tokens=16)
    timeline.async_span("generate r0", "generate", "g2", t0 + 0.5, t0 + 0.75)
    with timeline.timed(SYNC, "probe", version=1, rollouts=2):
        pass
    timeline.close()
    timeline.close()  # idempotent
    names, events = load(path)
    assert sorted(names.values()) == sorted([LEARNER, "generate r0", SYNC])
    (train,) = [e for e in events if e["name"] == "train step"]
    assert (train["ph"], train["ts"], train["dur"], train["args"]) == ("X", 500000.0, 750000.0, {"step": 1})
    assert names[train["tid"]] == LEARNER
    begins = {e["id2"]["local"]: e for e in events if e["ph"] == "b"}
    ends = {e["id2"]["local"]: e for e in events if e["ph"] == "e"}
    assert begins.keys() == ends.keys() == {"g1", "g2"}  # overlapping groups: one slice each
    assert (begins["g1"]["ts"], ends["g1"]["ts"], begins["g1"]["args"]) == (
        250000.0,
        1000000.0,
        {"tokens": 16},
    )
    (probe,) = [e for e in events if e["name"] == "probe"]
    assert probe["args"] == {"version": 1, "rollouts": 2} and probe["dur"] >= 0


def test_recording_stops_at_the_event_limit(tmp_path: Path) -> None:
    timeline = Timeline(max_events=3)
    timeline.open(tmp_path / "trace.json")
    for i in range(5):
        timeline.span(LEARNER, f"s{i}", 0.0, 0.0)
    timeline.close()
    assert timeline.recorded == 3
    assert [e["name"] for e in load(tmp_path / "trace.json")[1]] == ["s0", "s1", "s2"]


async def test_a_traced_run_shows_every_step_sync_phase_and_group_on_lanes_that_never_overlap(
    tmp_path: Path,
) -> None:
    c = cluster(tmp_path, FakeRollout("r0"), FakeRollout("r1"), trace=True, max_steps=4, eval_every=2)
    await c.run()
    assert c.orchestrator.finished
    names, events = load(tmp_path / "trace.json")
    lanes: dict[str, list[dict]] = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            lanes[names[event["tid"]]].append(event)
    steps = [e for e in lanes[LEARNER] if e["name"] == "train step"]
    assert [(e["args"]["step"], e["args"]["version"]) for e in steps] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    for phase in ("prepare", "stage", "commit", "probe"):
        versions = [e["args"]["version"] for e in lanes[SYNC] if e["name"] == phase]
        assert versions == [1, 2, 3, 4], phase
    assert [e["args"]["version"] for e in lanes[EVALUATE]] == [2, 4]
    for lane, spans in lanes.items():  # a lane is one thing at a time: Perfetto nests, never overlaps
        spans.sort(key=lambda e: e["ts"])
        for before, after in itertools.pairwise(spans):
            assert before["ts"] + before["dur"] <= after["ts"] + 1.0, (lane, before, after)
    trained = {r.group_id for r in c.orchestrator.ledger.records() if r.state.name == "TRAINED"}
    generated = {e["id2"]["local"] for e in events if e["ph"] == "b" and e["name"] == "generate"}
    scored = {e["id2"]["local"] for e in events if e["ph"] == "b" and names[e["tid"]] == SCORE}
    assert trained <= scored <= generated and len(trained) == 8
    ledger = c.orchestrator.ledger
    for event in (e for e in events if e["ph"] == "b" and e["name"] == "generate"):  # its rollout's track
        assert names[event["tid"]] == f"generate {ledger.get(event['id2']['local']).rollout_id}"


async def test_no_trace_file_without_the_setting(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeRollout("r0"))
    await c.run()
    assert c.orchestrator.finished and not (tmp_path / "trace.json").exists()
    assert c.orchestrator.timeline.recorded == 0
