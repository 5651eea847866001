"""The demo's summary and plot of a run, from rows as metrics.jsonl holds them."""

from __future__ import annotations

from pathlib import Path

from services.launch.report import plot_reward, summarize


def _row(step: int, reward: float, **extra) -> dict:
    base = {
        "step": step, "weight_version": step, "reward_mean": reward, "tokens_per_s": 10.0, "sync_ms": 1.0,
        "logprob_abs_diff_max": 1e-5, "staleness_mean": 0.5, "weight_transport": "grpc_stream",
    }  # fmt: skip
    return base | extra


def test_a_single_turn_run_has_no_episode_figures() -> None:
    summary = summarize([_row(i, 0.1 * i) for i in range(1, 11)])
    assert summary["reward_first"] < summary["reward_last"] and "tool_call_rate_first" not in summary


def test_a_multi_turn_run_reports_tool_call_rates_and_plots_them(tmp_path: Path) -> None:
    rows = [
        _row(i, 0.1 * i, **{"episode/tool_call_rate": i / 10, "episode/turns_mean": 2.0,
                            "episode/prefix_violations": 0, "episode/valid_tool_call_rate": i / 20,
                            "logprob_abs_diff_max_env": 1e-5 * i if i > 1 else None})
        for i in range(1, 11)
    ]  # fmt: skip
    rows.append({"step": 10, "eval/accuracy": 0.8, "eval/tool_call_rate": 0.9})
    summary = summarize(rows)
    assert summary["tool_call_rate_first"] == 0.3 and summary["tool_call_rate_last"] == 0.8
    assert summary["valid_tool_call_rate_first"] == 0.15 and summary["valid_tool_call_rate_last"] == 0.4
    assert summary["turns_mean"] == 2.0 and summary["prefix_violations"] == 0
    assert summary["logprob_abs_diff_max_env"] == 1e-4
    plot_reward(rows, tmp_path / "reward.png")
    assert (tmp_path / "reward.png").stat().st_size > 0


def test_a_skipped_probe_is_counted_not_read_as_agreement() -> None:
    rows = [_row(1, 0.1), _row(2, 0.2, logprob_abs_diff_max=None), _row(3, 0.3, logprob_abs_diff_max=3e-5)]
    summary = summarize(rows)
    assert summary["logprob_abs_diff_max"] == 3e-5 and summary["alignment_probes_skipped"] == 1
    none = summarize([_row(1, 0.1, logprob_abs_diff_max=None)])
    assert none["logprob_abs_diff_max"] is None and none["alignment_probes_skipped"] == 1
