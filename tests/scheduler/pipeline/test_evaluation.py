"""Evaluator: the held-out split through the rollouts and the env, and an eval split smaller than asked."""

from __future__ import annotations

from pathlib import Path

from tests.scheduler.fakes import FakeRollout, cluster


async def test_evaluation_generates_each_eval_prompt_and_reports_the_real_count(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeRollout("r0"), eval_prompts=10, eval_samples=3)
    c.env.eval_size = 4  # fewer held-out prompts than eval_prompts: each evaluated once, never repeated
    await c.orchestrator.pool.refresh_all(0)
    calls = []
    original = c.env.evaluate

    async def evaluate(groups):
        calls.append([(p.id, len(cs)) for p, cs in groups])
        return await original(groups)

    c.env.evaluate = evaluate
    metrics = await c.orchestrator.evaluator.run(version=0)
    assert calls == [[("e0", 3), ("e1", 3), ("e2", 3), ("e3", 3)]]
    assert metrics["eval/num_prompts"] == 4 and metrics["eval/prompts_requested"] == 10
    assert c.orchestrator.pool.handles()[0].in_flight == 0  # every credit returned
