"""Multi-turn episodes in the learner: environment tokens are context, never trained on.

An episode's completion is model turn + environment turn + model turn; the environment's tokens must
get mask 0, be left out of the normalisers, and leave the loss and its gradient exactly as if the
loss only saw the model's tokens (hand-computed below).
"""

from __future__ import annotations

import math

import pytest

from grpo.common.v1 import types_pb2
from services.common.errors import InvalidArgument
from services.learner.batching import Sample, collate, global_norm, validate_sample
from services.learner.config import LossConfig
from services.learner.losses import policy_loss
from services.learner.servicer import env_spans

# prompt [1, 2]; model turn [3, 4]; environment turn [5, 6, 7]; model turn [8]
EPISODE = Sample(
    prompt_ids=(1, 2),
    completion_ids=(3, 4, 5, 6, 7, 8),
    behav_logprobs=(-0.5, -1.0, 0.0, 0.0, 0.0, -2.0),
    advantage=1.5,
    env_spans=((2, 5),),
)


def test_collate_masks_the_environment_turn_and_counts_only_sampled_tokens():
    mb = collate([EPISODE])
    assert mb.mask.tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0, 1.0]]
    assert mb.num_tokens == 3
    norm = global_norm([EPISODE])
    assert (norm.num_seqs, norm.num_tokens) == (1, 3)
    assert EPISODE.trained_tokens == 3


@pytest.mark.parametrize("kind", ["grpo", "dapo", "dr_grpo", "cispo", "gspo"])
def test_the_loss_ignores_environment_tokens(kind):
    """GRPO per-sequence mean by hand: -(A/|model tokens|) Σ_model r_t with r_t = 1 at θ = behaviour;
    changing the environment tokens' logprobs (any value) changes neither the loss nor its gradient."""
    mb = collate([EPISODE])
    norm = global_norm([EPISODE])
    cfg = LossConfig(kind=kind, max_completion_len=8)

    def run(env_logp: float) -> tuple[float, list[float]]:
        logp = mb.behav.clone().double()
        logp[0, 2:5] = env_logp  # what the policy thinks of the env's tokens must not matter
        logp.requires_grad_(True)
        out = policy_loss(logp, mb.behav.double(), mb.mask, mb.adv, cfg, norm)
        out.loss.backward()
        return out.loss.item(), logp.grad[0].tolist()

    loss_a, grad_a = run(-0.1)
    loss_b, grad_b = run(-7.0)
    assert loss_a == pytest.approx(loss_b, abs=1e-12)
    assert grad_a == pytest.approx(grad_b, abs=1e-12)
    assert grad_a[2:5] == [0.0, 0.0, 0.0]
    assert all(g != 0.0 for g in (grad_a[0], grad_a[1], grad_a[5]))
    if kind == "grpo":
        assert loss_a == pytest.approx(-1.5, abs=1e-9)  # -(A / 3) * (1 + 1 + 1)
        assert grad_a[0] == pytest.approx(-1.5 / 3, abs=1e-9)


def test_bad_environment_spans_are_refused():
    with pytest.raises(InvalidArgument, match="not an ordered range"):
        validate_sample(Sample((1,), (2, 3), (-1.0, 0.0), 1.0, env_spans=((1, 3),)), 100, "s")
    with pytest.raises(InvalidArgument, match="nothing to train"):
        validate_sample(Sample((1,), (2, 3), (0.0, 0.0), 1.0, env_spans=((0, 2),)), 100, "s")
    validate_sample(EPISODE, 100, "s")


def _completion(turns: list[tuple[int, int, int]], length: int) -> types_pb2.Completion:
    c = types_pb2.Completion(completion_token_ids=list(range(length)), logprobs=[0.0] * length)
    for source, start, end in turns:
        c.turns.add(source=source, start=start, end=end)
    return c


def test_turns_become_environment_spans_and_must_tile_the_completion():
    model, env = types_pb2.TURN_SOURCE_MODEL, types_pb2.TURN_SOURCE_ENV
    assert env_spans(_completion([(model, 0, 2), (env, 2, 5), (model, 5, 6)], 6), "c") == ((2, 5),)
    assert env_spans(_completion([], 6), "c") == ()
    with pytest.raises(InvalidArgument, match="does not continue"):
        env_spans(_completion([(model, 0, 2), (env, 3, 5)], 6), "c")
    with pytest.raises(InvalidArgument, match="cover 5 of 6"):
        env_spans(_completion([(model, 0, 2), (env, 2, 5)], 6), "c")
    assert math.isfinite(EPISODE.advantage)
