"""verifiers (0.4.0) environments through the gateway: the runner as a real process in `.venvs/verifiers`,
a real rollout (the tiny model) and a real gateway, the runner's sequences checked against the
gateway's own call record: every sampled span is one recorded call's choice of that rollout's session,
whose prompt is everything before the span."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from gateway.support import ListRecorder, gateway, rollout_settings

from services.common.serve import start_server
from services.launch.processes import die_with
from services.rollout.server import RolloutApp

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venvs" / "verifiers" / "bin" / "python"
EXAMPLE = "examples/verifiers_env.py:load_environment"
RUN_DEADLINE_S = 420

pytestmark = pytest.mark.skipif(
    not VENV_PYTHON.exists(), reason=".venvs/verifiers is missing: run scripts/venv_verifiers.sh to create it"
)


async def run_runner(gateway_url: str, model_dir: Path, *args: str) -> tuple[int, dict, str]:
    """The runner as a subprocess (awaited, so this event loop keeps serving the gateway)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process = await asyncio.create_subprocess_exec(
        str(VENV_PYTHON), "-m", "integrations.verifiers.run", "--env", EXAMPLE, "--gateway", gateway_url,
        "--model", str(model_dir), "--max-tokens", "6", "--concurrency", "4", *args,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=die_with(os.getpid()),  # gone with this test process, whatever ends it
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), RUN_DEADLINE_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    lines = out.decode().strip().splitlines()
    summary = json.loads(lines[-1]) if lines else {}
    return process.returncode, summary, err.decode()[-4000:]


@pytest.fixture
async def served(tiny_model_dir: Path):
    settings = rollout_settings(tiny_model_dir, "r0", max_model_len=512)
    rollout = await start_server(RolloutApp(settings), settings)
    recorder = ListRecorder()
    try:
        async with gateway([rollout.address], recorder=recorder) as (running, _client):
            yield running.url, recorder
    finally:
        await rollout.close()


def check_against_record(group: dict, recorder: ListRecorder) -> int:
    """Every sampled span of every sequence is exactly one recorded call's choice, of the sequence's own
    session, whose prompt is the sequence before the span; masks are the token ids there, -100 elsewhere.
    Returns the number of spans checked."""
    checked = 0
    for tokens, masks, session, spans in zip(
        group["tokens"], group["masks"], group["session_ids"], group["spans"], strict=True
    ):
        calls = [c for c in recorder.calls if c.session_id == session]
        assert calls and all(c.episode_broken == "" for c in calls), calls
        sampled = {i for s, e in spans for i in range(s, e)}
        assert masks == [t if i in sampled else -100 for i, t in enumerate(tokens)]
        assert len(spans) == len(calls)
        for (s, e), call in zip(spans, calls, strict=True):
            assert list(call.prompt_token_ids) == tokens[:s]
            assert [list(choice.token_ids) for choice in call.choices].count(tokens[s:e]) == 1
            checked += 1
    return checked


async def test_single_turn_groups_match_the_gateway_record(
    served, tiny_model_dir: Path, tmp_path: Path
) -> None:
    url, recorder = served
    out = tmp_path / "groups.jsonl"
    code, summary, err = await run_runner(
        url, tiny_model_dir, "--group-size", "3", "--max-groups", "2", "--no-submit", "--groups-out", str(out)
    )
    assert code == 0, err
    assert summary["groups_built"] == 2 and summary["rollouts"] == 6 and summary["rollouts_refused"] == {}, (
        summary
    )
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) == 2
    for group in groups:
        assert len(group["tokens"]) == 3 and all(0.0 <= s <= 1.0 for s in group["scores"])
        assert check_against_record(group, recorder) == 3
    # every rollout was its own session, with one call (a group still in flight at the end may add more)
    sessions = [sid for group in groups for sid in group["session_ids"]]
    assert len(set(sessions)) == 6
    assert all(sum(c.session_id == sid for c in recorder.calls) == 1 for sid in sessions)


async def test_multi_turn_groups_bridge_turns_and_match_the_gateway_record(
    served, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The env's `RetryEnv` (2 turns: "Wrong, try again" while the reply is wrong; 3 digits, so the tiny
    model is mostly wrong) through the runner's default renderer for a model renderers does not know
    (`bridging.py`): turn two's prompt is turn one's prompt + completion + the new tokens, so every
    rollout is token-exact, each sampled span is a recorded call of its session, and the gateway saw
    no broken episode."""
    url, recorder = served
    out = tmp_path / "groups.jsonl"
    code, summary, err = await run_runner(
        url, tiny_model_dir, "--env-arg", "turns=2", "--env-arg", "digits=3", "--group-size", "2",
        "--concurrency", "2", "--max-groups", "2", "--no-submit", "--groups-out", str(out),
    )  # fmt: skip
    assert code == 0, err
    assert summary["groups_built"] == 2 and summary["rollouts_refused"] == {}, summary
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum(check_against_record(group, recorder) for group in groups) >= 5  # some second turns
    two_turns = [spans for group in groups for spans in group["spans"] if len(spans) == 2]
    assert two_turns, groups
    assert not [c for c in recorder.calls if c.episode_broken]


async def test_multi_turn_that_is_not_token_exact_is_refused_and_counted(
    served, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """verifiers' `default` renderer (`--renderer default`) cannot bridge turns, so turn two re-renders
    the history, which tokenizes the sampled completion differently: the runner refuses every such
    rollout as not token-exact (and drops its group); the gateway saw the same thing."""
    url, recorder = served
    out = tmp_path / "groups.jsonl"
    code, summary, err = await run_runner(
        url, tiny_model_dir, "--env-arg", "turns=2", "--env-arg", "digits=3", "--group-size", "2",
        "--concurrency", "2", "--max-groups", "1", "--max-dropped", "1", "--no-submit",
        "--groups-out", str(out), "--renderer", "default",
    )  # fmt: skip
    assert code == 3, err  # gave up after --max-dropped groups in a row
    refused = summary["rollouts_refused"]
    assert summary["groups_built"] == 0 and summary["groups_dropped"] == 1, summary
    assert refused.get("not_token_exact", 0) >= 1 and sum(refused.values()) <= 2, summary
    assert not out.exists() or out.read_text() == ""
    # the gateway agrees: a session with a second call is a prefix violation there
    two_call_sessions = {c.session_id for c in recorder.calls if c.episode_broken}
    assert len(two_call_sessions) == refused["not_token_exact"]


async def test_sigterm_stops_the_runner_with_its_summary(served, tiny_model_dir: Path) -> None:
    """What a launcher does at the end of a run: SIGTERM mid-run. The runner stops its rollouts and
    exits 0 with its summary as the last stdout line."""
    url, _ = served
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process = await asyncio.create_subprocess_exec(
        str(VENV_PYTHON), "-m", "integrations.verifiers.run", "--env", EXAMPLE, "--gateway", url,
        "--model", str(tiny_model_dir), "--max-tokens", "6", "--group-size", "2", "--concurrency", "2",
        "--max-groups", "10000", "--no-submit",
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=die_with(os.getpid()),  # gone with this test process, whatever ends it
    )  # fmt: skip
    assert process.stderr is not None
    async with asyncio.timeout(RUN_DEADLINE_S):
        while b'"event": "group"' not in await process.stderr.readline():  # a group was built: mid-run
            pass
        process.terminate()
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()[-3000:]
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert summary["groups_built"] >= 1, summary


BRIDGE_CHECK = """
import json, sys
from renderers.base import create_renderer, load_tokenizer
from renderers.configs import CustomRendererConfig
from integrations.verifiers.run import BRIDGING
refusing = "{% if messages[-1]['role'] == 'assistant' %}{{ raise_exception('no') }}{% endif %}"
tok = load_tokenizer(sys.argv[1])
out = {}
for name, extra in (("chatml", {}), ("refusing", {"chat_template": refusing})):
    r = create_renderer(tok, CustomRendererConfig(name="custom", import_path=BRIDGING, **extra))
    first = [{"role": "user", "content": "12+7="}]
    prompt = r.render(first, add_generation_prompt=True).token_ids
    new = [{"role": "user", "content": "Wrong, try again: 12+7="}]
    whole = tok.encode("19", add_special_tokens=False)
    answered = r.bridge_to_next_turn(prompt, whole + r.close_ids, new)
    cut = r.bridge_to_next_turn(prompt, whole[:1], new)
    history = first + [{"role": "assistant", "content": "19"}] + new
    full = r.render(history, add_generation_prompt=True) if answered else None
    out[name] = {
        "close": tok.decode(r.close_ids), "stops": r.get_stop_token_ids(), "close_ids": r.close_ids,
        "answered": answered and answered.token_ids, "full": full.token_ids if answered else None,
        "cut": cut and cut.token_ids, "prompt": prompt, "whole": whole,
    }
print(json.dumps(out))
"""


async def test_the_bridging_renderer_extends_the_sampled_tokens_as_the_template_renders(
    tiny_model_dir: Path,
) -> None:
    """`bridging.BridgingRenderer` on the tiny model's ChatML template: the bridge after a reply that
    ended with `<|im_end|>` is the full render of the conversation, token for token; after a reply cut
    short, the sampled tokens stay verbatim and the close is added; `<|im_end|>` is a stop token. A
    template that refuses the probe conversation gets no bridge (verifiers then re-renders)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process = await asyncio.create_subprocess_exec(
        str(VENV_PYTHON), "-c", BRIDGE_CHECK, str(tiny_model_dir), cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=die_with(os.getpid()),
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), RUN_DEADLINE_S)
    assert process.returncode == 0, err.decode()[-3000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    chatml = result["chatml"]
    assert chatml["close"] == "<|im_end|>" and chatml["close_ids"][0] in chatml["stops"]
    assert chatml["answered"] == chatml["full"]
    cut, whole, close = chatml["cut"], chatml["whole"], chatml["close_ids"]
    kept = chatml["prompt"] + whole[:1] + close  # the sampled token verbatim, then the close
    assert cut[: len(kept)] == kept
    assert cut[len(kept) :] == chatml["full"][len(chatml["prompt"]) + len(whole) + len(close) :]
    refusing = result["refusing"]
    assert refusing["answered"] is None and refusing["cut"] is None and refusing["close"] == ""
