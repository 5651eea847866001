"""MetricsLog: what GetStatus reads from the last step row."""

from __future__ import annotations

from pathlib import Path

from services.scheduler.observe.metrics import MetricsLog


def test_status_after_a_recovered_row_has_no_loss_yet(tmp_path: Path) -> None:
    """A restarted scheduler writes the row of a step the learner trained but it never recorded from
    the ledger (`recovered`), without a loss: GetStatus must answer (it raised KeyError: INTERNAL)."""
    metrics = MetricsLog(tmp_path)
    metrics.write({"step": 7, "weight_version": 7, "recovered": True, "reward_mean": 0.5})
    fields = metrics.status_fields()
    assert fields["loss"] == 0.0 and fields["reward_mean"] == 0.5
    metrics.write({"step": 8, "weight_version": 8, "reward_mean": 0.6, "loss": 0.25})
    assert metrics.status_fields()["loss"] == 0.25
    metrics.write({"step": 9, "weight_version": 9, "reward_mean": 0.6, "loss": float("nan")})
    assert metrics.status_fields()["loss"] == 0.0
    metrics.close()
