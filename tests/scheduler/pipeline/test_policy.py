"""Pure scheduling policy: staleness, the admission bound, a step's batch."""

from __future__ import annotations

import pytest

from grpo.common.v1 import types_pb2
from services.scheduler.peers.clients import ScoredGroup
from services.scheduler.pipeline.policy import (
    build_train_batch,
    expected_train_version,
    group_staleness,
    oldest_version,
)


def _completion(*spans: tuple[int, int, int]) -> types_pb2.Completion:
    c = types_pb2.Completion()
    for version, start, end in spans:
        c.version_spans.add(version=version, start=start, end=end)
    return c


def test_staleness_uses_the_oldest_token_of_the_group() -> None:
    group = [_completion((4, 0, 3), (5, 3, 6)), _completion((5, 0, 2))]
    assert oldest_version(group) == 4
    assert group_staleness(group, train_version=6) == 2
    with pytest.raises(ValueError, match="no weight-version spans"):
        oldest_version([types_pb2.Completion()])


@pytest.mark.parametrize(
    ("learner_version", "in_pipeline", "batch", "expected"),
    [(0, 0, 4, 0), (0, 3, 4, 0), (0, 4, 4, 1), (5, 9, 4, 7), (2, 31, 16, 3)],
)
def test_expected_train_version(learner_version: int, in_pipeline: int, batch: int, expected: int) -> None:
    assert expected_train_version(learner_version, in_pipeline, batch) == expected


def test_build_train_batch_computes_advantages_over_the_batch() -> None:
    groups = [
        ScoredGroup("g0", types_pb2.Prompt(id="p0"), [], rewards=[1.0, 0.0, 1.0, 0.0]),
        ScoredGroup("g1", types_pb2.Prompt(id="p1"), [], rewards=[1.0, 1.0, 1.0, 1.0]),
    ]
    batch = build_train_batch(groups, step=7, batch_id="b7", advantage_mode="group_std")
    assert (batch.step, batch.batch_id, batch.groups) == (7, "b7", groups)
    assert batch.advantages[0] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert batch.advantages[1] == [0.0, 0.0, 0.0, 0.0]  # zero variance: no signal, no blow-up
    dr = build_train_batch(groups, step=0, batch_id="b", advantage_mode="group_mean")
    assert dr.advantages[0] == pytest.approx([0.5, -0.5, 0.5, -0.5])
