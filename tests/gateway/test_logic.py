"""The gateway's pure parts: the session table (LRU, TTL, prefix rule) and the JSONL call recorder."""

from __future__ import annotations

import json
from pathlib import Path

from services.gateway.recorder import CallRecord, ChoiceRecord, JsonlRecorder
from services.gateway.sessions import SessionTable


def test_session_table_lru_ttl_and_prefix_rule() -> None:
    now = [0.0]
    table = SessionTable(max_sessions=2, ttl_s=10.0, clock=lambda: now[0])
    a = table.open("a", "r0")
    table.open("b", "r1")
    assert table.get("a") is a  # a is now the most recently used
    table.open("c", "r0")  # full: b (least recently used) goes
    assert table.get("b") is None and table.evicted == 1
    now[0] = 11.0
    assert table.get("a") is None  # expired
    s = table.open("s", "r0")
    assert table.check_prefix(s, [1, 2]) == ""  # the first call extends nothing
    SessionTable.advance(s, [1, 2], [[3], [4, 5]], None)
    assert table.check_prefix(s, [1, 2, 4, 5, 6]) == "" and table.check_prefix(s, [1, 2, 3]) == ""
    assert "token 2" in table.check_prefix(s, [1, 2, 9]) and table.prefix_violations == 1
    assert s.broken


async def test_jsonl_recorder_writes_off_the_loop_and_bounds_its_queue(tmp_path: Path) -> None:
    path = tmp_path / "calls.jsonl"
    recorder = JsonlRecorder(path, max_pending=4)
    choice = ChoiceRecord(0, (1, 2), (-0.5, -0.25), ((3, 0, 2),), "stop")
    for index in range(3):
        recorder.record(CallRecord("s", f"r{index}", "chat", "r0", (7,), (choice,)))
    await recorder.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["request_id"] for line in lines] == ["r0", "r1", "r2"]
    assert lines[0]["choices"][0] == {
        "index": 0, "token_ids": [1, 2], "logprobs": [-0.5, -0.25], "version_spans": [[3, 0, 2]],
        "finish_reason": "stop",
    }  # fmt: skip
    assert recorder.written == 3 and recorder.dropped == 0
