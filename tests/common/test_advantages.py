"""Group-relative advantages: hand-computed values and the zero-variance / scale edge cases."""

from __future__ import annotations

import math

import pytest

from services.common.advantages import compute_advantages


def test_group_std_hand_values():
    # group [0, 1, 1, 0]: mean 0.5, population std 0.5 → ±1 (ε·scale = 1e-6 in the denominator)
    adv = compute_advantages([[0.0, 1.0, 1.0, 0.0]], "group_std", eps=1e-6)
    assert adv == [pytest.approx([-1, 1, 1, -1], rel=1e-5)]


def test_group_mean_only_centres():
    adv = compute_advantages([[1.0, 2.0, 6.0], [0.0, 0.0, 3.0]], "group_mean")
    assert adv == [pytest.approx([-2.0, -1.0, 3.0]), pytest.approx([-1.0, -1.0, 2.0])]


def test_batch_std_uses_the_std_of_all_centred_rewards():
    # centred: [-1, 1] and [-3, 3] → batch std of [-1, 1, -3, 3] = sqrt(5)
    adv = compute_advantages([[0.0, 2.0], [0.0, 6.0]], "batch_std", eps=0.0)
    s = math.sqrt(5)
    assert adv == [pytest.approx([-1 / s, 1 / s]), pytest.approx([-3 / s, 3 / s])]


@pytest.mark.parametrize("mode", ["group_std", "group_mean", "batch_std"])
def test_all_equal_rewards_give_exact_zeros(mode):
    adv = compute_advantages([[0.7, 0.7, 0.7], [1.0, 0.0, 1.0]], mode)
    assert adv[0] == [0.0, 0.0, 0.0]
    assert any(a != 0 for a in adv[1])


def test_near_zero_variance_relative_to_reward_scale_gives_zero_not_noise():
    # rewards ~1e6 differing by float noise: std 0.5 is tiny relative to the scale → 0, not ±1
    big = 1e6
    adv = compute_advantages([[big, big + 1.0]], "group_std", eps=1e-6)
    assert adv == [[0.0, 0.0]]
    # the same spread at unit scale is real signal
    adv = compute_advantages([[0.0, 1.0]], "group_std", eps=1e-6)
    assert adv[0][0] < -0.99 and adv[0][1] > 0.99


def test_never_blows_up_on_tiny_variance():
    adv = compute_advantages([[0.0, 1e-5]], "group_std", eps=1e-6)
    assert all(abs(a) <= 1.0 for a in adv[0])


def test_shapes_and_errors():
    assert compute_advantages([], "group_std") == []
    assert compute_advantages([[1.0]], "group_std") == [[0.0]]
    with pytest.raises(ValueError, match="mode"):
        compute_advantages([[1.0]], "loo")
    with pytest.raises(ValueError, match="finite"):
        compute_advantages([[1.0, math.nan]], "group_std")
