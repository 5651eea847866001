"""The studio in a real browser (headless Chromium driven by Playwright), during a short real run.

A new user's path: open the studio, get an impossible form refused with a message, start a tiny run
from the form, watch the curves grow without reloading, survive the run's scheduler being killed
(-9) and restarted by its launcher, read a step's completions (checked against the ledger), get a
chat answer from the live policy, and see the run finish. Then: the finished run opens from its run
directory alone (a second studio, nothing live), a copy of it without its ending shows as crashed,
checkpoints answer side by side, and a run started and stopped from the studio shows as stopped.

Needs Debian's `chromium` and PyPI's `playwright` (`make integrations` installs both where it can; no
browser download: Playwright drives the system Chromium by its executable path). Screenshots go to
$GRPO_STUDIO_SCREENSHOTS when set (`GRPO_STUDIO_SCREENSHOTS=docs/images pytest tests/studio` keeps
the README's pictures current), else to the test's temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from grpo.common.v1 import types_pb2
from services.launch import liveset

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _wait(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Studio:
    def __init__(self, tmp: Path, *args: str) -> None:
        self.port_file = tmp / f"studio-{time.monotonic_ns()}.port"
        self.log = (tmp / f"{self.port_file.stem}.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services", "studio", "--port", "0", "--port-file", str(self.port_file),
             *args],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        _wait(lambda: self.port_file.exists() or self.process.poll() is not None, 60, "the studio's port")
        assert self.process.poll() is None, Path(self.log.name).read_text()
        self.url = f"http://127.0.0.1:{int(self.port_file.read_text())}"
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def close(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # it stops the runs it started, then exits
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


@pytest.fixture
def studio(tmp_path: Path) -> Iterator[Studio]:
    s = Studio(tmp_path, "--runs-root", str(tmp_path / "runs"))
    yield s
    s.close()


def _ledger_completions(run_dir: Path, step: int) -> list[types_pb2.Completion]:
    db = sqlite3.connect(f"file:{run_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        (joined,) = db.execute("SELECT group_ids FROM batches WHERE step = ?", (step,)).fetchone()
        texts = []
        for gid in json.loads(joined):
            (payload,) = db.execute("SELECT payload FROM scored WHERE group_id = ?", (gid,)).fetchone()
            texts += list(types_pb2.ScoredGroup.FromString(payload).completions)
        return texts
    finally:
        db.close()


def _kill_scheduler(run_dir: Path) -> int:
    """kill -9 the run's scheduler, found in the launcher's record (pid checked by its start time)."""
    record = liveset.read(run_dir)
    assert record is not None
    (member,) = [m for m in record.services if m.role == "scheduler"]
    assert member.running()
    os.kill(member.pid, signal.SIGKILL)
    return member.pid


def _scheduler_pid(run_dir: Path) -> int | None:
    record = liveset.read(run_dir)
    found = [m for m in (record.services if record else []) if m.role == "scheduler" and m.running()]
    return found[0].pid if found else None


def _live_step(studio: Studio) -> int:
    """The step the run's scheduler reports, -1 while it does not answer."""
    state = studio.http.get("/api/runs/browser/state").json()
    return int(state["status"]["step"]) if state["live"] else -1


def _polyline_points(page, chart: str) -> int:
    return page.evaluate(
        """(id) => { const p = document.querySelector(`#chart-${id} polyline`);
                     return p ? p.getAttribute('points').trim().split(' ').length : 0; }""",
        chart,
    )


def _form(page, values: dict[str, str]) -> None:
    for name, value in values.items():
        selector = f"#start-form [name={name}]"
        if page.eval_on_selector(selector, "e => e.tagName") == "SELECT":
            page.select_option(selector, value)
        else:
            page.fill(selector, value)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install chromium (docs/studio.md)")
def test_a_new_user_starts_watches_and_inspects_a_run_in_the_browser(studio: Studio, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs PyPI playwright (make integrations)")
    shots = Path(os.environ.get("GRPO_STUDIO_SCREENSHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    run_dir = tmp_path / "runs" / "browser"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(studio.url)

        # an impossible form is refused with a message per field, and nothing starts
        _form(page, {"steps": "0", "group_size": "1", "env_args": "digits=77"})
        page.click("[data-testid=start-button]")
        errors = page.locator("[data-testid=form-errors]")
        sync_api.expect(errors).to_contain_text("steps: Input should be greater than or equal to 1")
        sync_api.expect(errors).to_contain_text("group_size: Input should be greater than or equal to 2")
        _form(page, {"steps": "12", "group_size": "4"})
        page.click("[data-testid=start-button]")
        sync_api.expect(errors).to_contain_text("digits: Input should be less than or equal to 9")
        assert studio.http.get("/api/runs").json()["runs"] == []

        # a tiny run from the form
        _form(page, {
            "name": "browser", "engine": "transformers", "steps": "300", "group_size": "8",
            "groups_per_batch": "16", "eval_every": "150", "env_args": "digits=1", "seed": "0",
        })  # fmt: skip
        page.click("[data-testid=start-button]")
        phase = page.locator("[data-testid=run-phase]")
        sync_api.expect(phase).to_have_text("running", timeout=240_000)

        # the curves grow as steps land, without a reload
        page.click("header nav button[data-tab=watch]")
        first = _wait(
            lambda: _polyline_points(page, "reward") >= 2 and _polyline_points(page, "reward"), 180, "2 steps"
        )
        _wait(lambda: _polyline_points(page, "reward") > first, 180, "the curve to grow")

        # the scheduler dies; its launcher restarts it; the same page keeps following the run
        died_at = _live_step(studio)
        killed = _kill_scheduler(run_dir)
        _wait(lambda: _scheduler_pid(run_dir) not in (None, killed), 120, "the scheduler's restart")
        # the restarted scheduler answers and trains past the step it died at (asked of the API: the
        # page may still show the phase of its last poll before the kill, and the curve rows the dead
        # scheduler wrote last)
        _wait(lambda: _live_step(studio) > died_at, 240, "the restarted scheduler to train")
        sync_api.expect(phase).to_have_text("running", timeout=120_000)
        grown = _polyline_points(page, "reward")
        _wait(lambda: _polyline_points(page, "reward") > grown, 240, "steps after the scheduler's restart")
        page.screenshot(path=str(shots / "studio-watch.png"), full_page=True)

        # paused from the page (no new prompts), the run stays for the reading below
        page.click("header nav button[data-tab=run]")
        page.click("[data-testid=pause]")
        sync_api.expect(phase).to_have_text("paused", timeout=30_000)

        # the live policy answers
        page.click("header nav button[data-tab=policy]")
        page.fill("[data-testid=chat-prompt]", "3+4=")
        page.click("[data-testid=chat-send]")
        answer = page.locator("[data-testid=chat-answer]").first
        sync_api.expect(answer).to_contain_text("(v", timeout=60_000)
        page.screenshot(path=str(shots / "studio-policy.png"), full_page=True)

        # a step's completions, as the ledger holds them
        page.click("header nav button[data-tab=trajectories]")
        page.select_option("[data-testid=step-select]", "1")
        page.wait_for_selector(
            "[data-testid=groups][data-step='1']", timeout=60_000
        )  # step 1's, not the last's
        completions = page.locator("[data-testid=completion]")
        sync_api.expect(completions.first).to_be_visible(timeout=30_000)
        shown = completions.all_inner_texts()
        stored = _ledger_completions(run_dir, 1)
        assert len(shown) == len(stored) == 8 * 16
        # one span per sampled token, and the text as the ledger has it (a token that is part of a
        # UTF-8 character shows as U+FFFD on its own; the ledger's text has the special tokens dropped)
        spans = page.eval_on_selector_all(
            "[data-testid=completion]", "els => els.map(e => e.children.length)"
        )
        assert sorted(spans) == sorted(len(c.completion_token_ids) for c in stored)
        texts = {c.text for c in stored}
        plain = [re.sub(r"<\|[^|]*\|>", "", text) for text in shown if "\ufffd" not in text]
        assert plain and all(text in texts for text in plain), (plain, texts)
        # sampled tokens carry the learner's logprob beside the rollout's (the |Δ| shading)
        assert page.locator("[data-testid=completion] .tok[title*='|Δ|']").count() >= len(stored)
        page.screenshot(path=str(shots / "studio-trajectories.png"))

        page.click("header nav button[data-tab=run]")
        page.click("[data-testid=resume]")
        sync_api.expect(phase).to_have_text("finished", timeout=400_000)
        page.screenshot(path=str(shots / "studio-run.png"), full_page=True)
        browser.close()

    # checkpoints answer the same prompt side by side
    sources = studio.http.get("/api/runs/browser/checkpoints").json()["sources"]
    assert sources[:2] == ["live", "base"] and len(sources) > 2, sources
    reply = studio.http.post(
        "/api/runs/browser/compare",
        json={"prompt": "3+4=", "left": "base", "right": sources[-1], "max_tokens": 4},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["left"]["source"] == "base" and reply.json()["right"]["tokens"] >= 1

    _reopen_from_the_run_dir(run_dir, tmp_path)


def _reopen_from_the_run_dir(run_dir: Path, tmp_path: Path) -> None:
    """A second studio, given only the finished run's directory: its state, curves and trajectories;
    a copy whose record lacks an ending (the launcher was killed) shows as crashed."""
    crashed = tmp_path / "crashed"
    shutil.copytree(run_dir, crashed, ignore=shutil.ignore_patterns("ledger.sqlite*", "live.json"))
    source, target = sqlite3.connect(run_dir / "ledger.sqlite"), sqlite3.connect(crashed / "ledger.sqlite")
    source.backup(target)
    target.execute("DELETE FROM events WHERE kind LIKE 'run_%'")
    target.commit()
    source.close(), target.close()
    other = Studio(
        tmp_path, "--runs-root", str(tmp_path / "empty"), "--run-dir", str(run_dir), "--run-dir", str(crashed)
    )
    try:
        state = other.http.get("/api/runs/browser/state").json()
        assert (state["live"], state["phase"]) == (False, "finished"), state
        assert int(state["status"]["step"]) == 300
        assert other.http.get("/api/runs/crashed/state").json()["phase"] == "crashed"
        rows = other.http.get("/api/runs/browser/metrics").json()["rows"]
        assert sum(1 for r in rows if "reward_mean" in r and r.get("step", 0) > 0) == 300
        groups = other.http.get("/api/runs/browser/steps/299").json()["groups"]
        assert len(groups) == 16 and all(len(g["completions"]) == 8 for g in groups)
    finally:
        other.close()


def test_a_run_started_from_the_studio_stops_from_it(studio: Studio) -> None:
    reply = studio.http.post(
        "/api/runs",
        json={"name": "stopme", "engine": "transformers", "steps": 500, "group_size": 4,
              "groups_per_batch": 2, "env_args": ["digits=1"], "eval_every": 0},
    )  # fmt: skip
    assert reply.status_code == 201, reply.text
    _wait(lambda: studio.http.get("/api/runs/stopme/state").json()["phase"] == "running", 240, "running")
    running = studio.http.get("/api/runs/stopme/state").json()["services"]
    assert {m["role"] for m in running} >= {"env", "learner", "rollout-0", "scheduler"}
    assert all(m["running"] for m in running)
    assert studio.http.post("/api/runs/stopme/pause").json() == {"paused": True}
    assert studio.http.get("/api/runs/stopme/state").json()["phase"] == "paused"
    assert studio.http.post("/api/runs/stopme/resume").json() == {"paused": False}
    assert studio.http.post("/api/runs/stopme/stop").json() == {"stopping": True}
    state = _wait(
        lambda: (s := studio.http.get("/api/runs/stopme/state").json())["phase"] == "stopped" and s,
        120,
        "stopped",
    )
    assert state["process"]["exit_code"] is not None and not state["live"]
