"""An atropos environment, unmodified, trains on grpo-mesh: `examples/atropos_env.py` started with
atropos' own CLI (`serve`), its inference server and trajectory API both the gateway.

- A run of 24 steps with the scheduler killed (-9) while the env submits: it resumes, versions
  advance by one, every measured probe is within 1e-4, the audit passes, nothing the env sent is lost.
- The trajectory API against a live run (no harness, this test is the client): a group of tokens the
  gateway never generated is refused with the reason; a flood of concurrent producers is held back by
  the trainer's bounded queue and every submission is accounted for (accepted and trained, or
  refused as stale), none lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.runs import audit, kill_what_is_left, rows, run_killing

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 24
B = 4
RUN_LIMIT_S = 600  # hard bounds: the tests can never hang CI

HARNESS = (
    "{python} examples/atropos_env.py serve --env.rollout_server_url {gateway} --env.tokenizer_name {model} "
    "--openai.base_url {gateway}/v1 --openai.server_type vllm --openai.model_name grpo-mesh "
    "--openai.tokenizer_name {model} --openai.api_key none --env.group_size {group_size} "
    "--env.seed {seed} --env.max_tokens {max_tokens} --env.temperature {temperature} "
    "--env.max_batches_offpolicy {batches_ahead}"
)


def _demo(run_dir: Path, model: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "services", "demo", "--run-dir", str(run_dir), "--model", str(model),
        "--engine", "vllm", "--groups-per-batch", str(B), "--checkpoint-every", "4", *extra,
    ]  # fmt: skip


def test_an_atropos_env_trains_and_survives_kill_9_of_the_scheduler(
    tmp_path: Path, warm_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    command = _demo(run_dir, warm_model_dir, "--steps", str(STEPS), "--harness", HARNESS)
    run = run_killing(command, run_dir, tmp_path / "launcher.log", [(8, "scheduler")], RUN_LIMIT_S)
    assert run.returncode == 0, run.output[-4000:]
    assert [name for name, _ in run.killed] == ["scheduler"], run.killed

    steps = [r for r in rows(run_dir) if "reward_mean" in r]
    assert [r["weight_version"] for r in steps] == list(range(1, STEPS + 1))
    measured = [r["logprob_abs_diff_max"] for r in steps if r.get("logprob_abs_diff_max") is not None]
    assert measured and max(measured) <= 1e-4, measured
    _, counts = audit(run_dir)
    assert counts["steps"] == STEPS and counts["groups_trained"] == STEPS * B
    assert counts["scheduler_starts"] == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == {"scheduler": 1}, summary

    harness_log = (run_dir / "logs" / "harness.log").read_text()
    # every group it sent was answered (held while the scheduler was away, never dropped unsent)
    assert "Failed to send" not in harness_log
    gateway_log = (run_dir / "logs" / "gateway.log").read_text()
    assert "atropos env registered" in gateway_log  # through /register-env
    refused = [line for line in gateway_log.splitlines() if "scored data refused" in line]
    # the env keeps at most max_staleness + 1 batches ahead: only a few groups can still go stale;
    # and what it sends once the last step has trained is refused as such
    assert all('"status": 409' in line and ("stale by" in line or "the run is over" in line)
               for line in refused), refused[:3]  # fmt: skip
    print(f"{len(refused)} groups refused as stale, {STEPS * B} trained")
    rewards = [r["reward_mean"] for r in steps]
    print(f"reward first 5 {sum(rewards[:5]) / 5:.3f}, last 5 {sum(rewards[-5:]) / 5:.3f}")


@contextlib.contextmanager
def _external_run(run_dir: Path, model: Path, log: Path, *extra: str):
    """A run with source = external and no harness: yields the gateway's URL."""
    command = _demo(run_dir, model, "--source", "external", *extra)
    with log.open("w") as out:
        launcher = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        url_file = run_dir / "gateway.url"
        while not url_file.exists():
            assert launcher.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the gateway did not come up"
            time.sleep(0.5)
        yield url_file.read_text().strip(), launcher
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        finally:
            kill_what_is_left(launcher, set())


PROMPTS = [[21, 25, 13, 22, 23, 31], [23, 15, 21, 21, 31], [24, 20, 15, 23, 19, 31]]  # "37+45=", ...


async def _generate(client: httpx.AsyncClient, url: str, prompt: list[int], n: int, **extra: float) -> dict:
    for _ in range(600):  # 429 (the run's staleness bound) and 503 (the rollout not ready: a sync, a
        # missed health poll): wait and retry, as atropos' server client does
        body = {"prompt": {"prompt_token_ids": prompt}, "n": n, "max_tokens": 4, "temperature": 1.0, **extra}
        answer = await client.post(f"{url}/generate", json=body)
        if answer.status_code not in (429, 503):
            assert answer.status_code == 200, answer.text
            return answer.json()
        await asyncio.sleep(0.1)
    raise AssertionError("the gateway never admitted a generation")


def _group(prompt: list[int], generated: dict, scores: list[float]) -> dict:
    tokens = [prompt + ids for ids in generated["token_ids"]]
    masks = [[-100] * len(prompt) + ids for ids in generated["token_ids"]]
    return {"tokens": tokens, "masks": masks, "scores": scores, "env_id": 0}


async def _flood(url: str, producers: int, until_step: int) -> tuple[list[tuple[int, dict]], dict]:
    """`producers` concurrent loops, each: generate a group (n = 8), submit it; until the run's step.
    The answers, and the gateway's /metrics as last read during the flood (the run may end right after)."""
    answers: list[tuple[int, dict]] = []
    metrics: dict = {}
    timeout = httpx.Timeout(300.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        registered = (
            await client.post(f"{url}/register-env", json={"group_size": 8, "desired_name": "flood"})
        ).json()
        assert registered["status"] == "success", registered

        async def producer(k: int) -> None:
            i = 0
            while (await client.get(f"{url}/status")).json()["current_step"] < until_step:
                prompt = PROMPTS[(k + i) % len(PROMPTS)]
                generated = await _generate(client, url, prompt, 8)
                scores = [float((j + k + i) % 2) for j in range(8)]
                answer = await client.post(f"{url}/scored_data", json=_group(prompt, generated, scores))
                answers.append((answer.status_code, answer.json()))
                i += 1

        async def monitor() -> None:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    metrics.update((await client.get(f"{url}/metrics")).json())
                await asyncio.sleep(0.25)

        watching = asyncio.create_task(monitor())
        await asyncio.gather(*(producer(k) for k in range(producers)))
        with contextlib.suppress(httpx.HTTPError):
            metrics.update((await client.get(f"{url}/metrics")).json())
        watching.cancel()
    return answers, metrics


async def _one_by_one(url: str) -> int:
    """atropos' wire details and the refusals beyond atropos: a gzip body (atropos compresses from
    1 KiB), a retried group (acknowledged, not trained twice), a generation reused in another group, a
    truncated-sampling group, /scored_data_list. The groups accepted."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        first = _group(PROMPTS[0], await _generate(client, url, PROMPTS[0], 8), [1.0, 0.0] * 4)
        body = gzip.compress(json.dumps(first).encode())
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        answer = await client.post(f"{url}/scored_data", content=body, headers=headers)
        assert answer.status_code == 200 and answer.json()["accepted"] == 1, answer.text
        again = await client.post(f"{url}/scored_data", json=first)  # a retry: acknowledged only
        assert again.status_code == 200 and again.json()["duplicates"] == 1, again.text
        reused = dict(first, scores=[0.0, 1.0] * 4)  # the same samples in "another" group
        answer = await client.post(f"{url}/scored_data", json=reused)
        assert answer.status_code == 400 and "already submitted" in answer.json()["error"]["message"]
        truncated = await _generate(client, url, PROMPTS[1], 8, top_p=0.9)
        answer = await client.post(f"{url}/scored_data", json=_group(PROMPTS[1], truncated, [1.0, 0.0] * 4))
        assert answer.status_code == 400 and "top_p=0.9" in answer.json()["error"]["message"], answer.text
        groups = [_group(p, await _generate(client, url, p, 8), [0.0, 1.0] * 4) for p in PROMPTS[1:]]
        answer = await client.post(f"{url}/scored_data_list", json=groups)
        assert answer.status_code == 200 and answer.json()["accepted"] == 2, answer.text
    return 3


def test_the_trajectory_api_refuses_what_it_never_generated_and_holds_back_a_flood(
    tmp_path: Path, warm_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    # more steps than the flood feeds: the run is still there when the flood ends (stopped after)
    with _external_run(run_dir, warm_model_dir, tmp_path / "launcher.log", "--steps", "40",
                       "--max-staleness", "1") as (url, launcher):  # fmt: skip
        # an env whose group size is not the run's is told so at registration
        wrong = httpx.post(f"{url}/register-env", json={"group_size": 3}, timeout=30)
        assert wrong.status_code == 400 and "--env.group_size 8" in wrong.json()["error"]["message"]
        # a group of tokens the gateway never generated: refused, with the reason
        forged = {"tokens": [PROMPTS[0] + [20, 0]] * 8, "masks": [[-100] * 6 + [20, 0]] * 8,
                  "scores": [1.0, 0.0] * 4}  # fmt: skip
        refused = httpx.post(f"{url}/scored_data", json=forged, timeout=30)
        assert refused.status_code == 400, refused.text
        assert "were not generated by this gateway" in refused.json()["error"]["message"]
        # a second trainer cannot drain the run's queue
        assert httpx.get(f"{url}/batch", timeout=30).status_code == 409
        before = asyncio.run(_one_by_one(url))

        answers, metrics = asyncio.run(_flood(url, producers=12, until_step=8))
        deadline = time.monotonic() + 120  # the queue drains (a part batch may stay collecting)
        while httpx.get(f"{url}/status", timeout=30).json()["queue_size"] and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]

    statuses = [status for status, _ in answers]
    assert set(statuses) <= {200, 409}, answers  # taken, or refused as stale with a reason: never a 5xx
    refusals = [body["error"]["message"] for status, body in answers if status == 409]
    assert all("stale" in m for m in refusals), refusals  # recorded as dropped
    assert metrics["trajectories/held_max"] > 0  # the bounded queue held submissions back
    assert metrics["trajectories/refused"] == 3  # the forged, the reused and the truncated group
    _, counts = audit(run_dir)
    # every submission is in the ledger: accepted ones trained or still waiting, stale ones dropped
    accepted = before + sum(body["accepted"] for status, body in answers if status == 200)
    # a submission id is a digest of the group's content: two producers whose 8 samples came out the
    # same (the warm model is peaked; scores repeat by design) submit one group twice, and the second
    # is answered from the ledger (DUPLICATE, or the first one's STALE): count stale groups by id
    stale = len({group_id for m in refusals for group_id in re.findall(r"ext-[0-9a-f]{24}", m)})
    assert stale <= len(refusals) and all(re.search(r"ext-[0-9a-f]{24}", m) for m in refusals)
    assert counts["groups"] == accepted + stale, (counts, accepted, stale)
    # what was accepted is trained (or still waits when the run ended): the intake refuses what would
    # be stale by the time it trains, instead of dropping it later
    assert counts["groups_trained"] == counts["steps"] * B and counts["groups_dropped"] == stale, counts
    assert counts["groups_trained"] + counts["groups_scored"] == accepted, counts
    print(f"flood: {len(answers)} submissions, {accepted} taken, {stale} stale, held at most "
          f"{metrics['trajectories/held_max']}")  # fmt: skip
