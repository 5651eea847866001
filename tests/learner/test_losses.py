"""Each objective against a hand-computed tiny case: values and gradients, plus edge cases.

The shared case (B=2 completions, T=2):
    row 0: π_θ = (0.5, 0.25), μ = (0.5, 0.2)  → r = (1, 1.25), Â = +1, two tokens
    row 1: π_θ = (0.5, —),    μ = (0.4, —)    → r = (1.25),   Â = −1, one token (second is padding)
"""

from __future__ import annotations

import math

import pytest
import torch

from services.learner.config import LossConfig
from services.learner.losses import LossStats, Norm, kl_per_token, policy_loss

LN = math.log


def case(dtype=torch.float64):
    logp = torch.tensor([[LN(0.5), LN(0.25)], [LN(0.5), 0.0]], dtype=dtype, requires_grad=True)
    behav = torch.tensor([[LN(0.5), LN(0.2)], [LN(0.4), 0.0]], dtype=dtype)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=dtype)
    adv = torch.tensor([1.0, -1.0], dtype=dtype)
    return logp, behav, mask, adv


NORM = Norm(num_seqs=2, num_tokens=3)


def run(cfg: LossConfig, norm: Norm = NORM, **overrides):
    logp, behav, mask, adv = case()
    tensors = {"logp": logp, "behav": behav, "mask": mask, "adv": adv, **overrides}
    out = policy_loss(tensors["logp"], tensors["behav"], tensors["mask"], tensors["adv"], cfg, norm)
    out.loss.backward()
    return out, tensors["logp"].grad


def test_grpo_per_sequence_token_mean_with_symmetric_clip():
    # ℓ00 = −1 (r=1); ℓ01 = −1.2 (r=1.25 clipped to 1.2, Â>0: no gradient); ℓ10 = +1.25 (Â<0 keeps r)
    out, grad = run(LossConfig(kind="grpo"))
    assert out.loss.item() == pytest.approx(((-1 - 1.2) / 2 + 1.25) / 2)
    # d(−r·Â)/dlogp = −r·Â, scaled by 1/(|o_i|·N)
    expected = torch.tensor([[-1 / 4, 0.0], [1.25 / 2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)
    assert out.stats["clipped"] == 1.0 and out.stats["tokens"] == 3.0


def test_dr_grpo_constant_denominator():
    out, grad = run(LossConfig(kind="dr_grpo", max_completion_len=4))
    assert out.loss.item() == pytest.approx((-1 - 1.2 + 1.25) / (2 * 4))
    torch.testing.assert_close(grad, torch.tensor([[-1 / 8, 0.0], [1.25 / 8, 0.0]], dtype=torch.float64))


def test_dapo_global_token_mean_and_clip_higher():
    # ε_high = 0.28: r = 1.25 is inside [0.8, 1.28] now, so token 01 keeps its gradient
    out, grad = run(LossConfig(kind="dapo"))
    assert out.loss.item() == pytest.approx((-1 - 1.25 + 1.25) / 3)
    torch.testing.assert_close(
        grad, torch.tensor([[-1 / 3, -1.25 / 3], [1.25 / 3, 0.0]], dtype=torch.float64)
    )
    assert out.stats["clipped"] == 0.0


def test_gspo_sequence_geometric_mean_ratio():
    # s0 = sqrt(1·1.25) ≈ 1.118 (inside [0.8, 1.2]); s1 = 1.25 with Â<0 (unclipped branch is the min)
    out, grad = run(LossConfig(kind="gspo", clip_eps_low=0.2, clip_eps_high=0.2))
    s0 = math.sqrt(1.25)
    assert out.loss.item() == pytest.approx((-s0 + 1.25) / 2)
    # ds_i/dlogp_it = s_i/|o_i|; ℓ_i = −s_i·Â_i; then / N_seq
    g0 = -s0 / 2 / 2
    torch.testing.assert_close(grad, torch.tensor([[g0, g0], [1.25 / 2, 0.0]], dtype=torch.float64))


def test_gspo_sequence_clip_zeroes_the_whole_sequence_gradient():
    out, grad = run(LossConfig(kind="gspo", clip_eps_low=0.05, clip_eps_high=0.05))
    # s0 ≈ 1.118 > 1.05 with Â>0: clipped → no gradient on either token of row 0
    assert grad[0].abs().sum().item() == 0.0
    assert out.stats["clipped"] == 2.0  # counted per token of the clipped sequence


def test_cispo_detached_is_weight_every_token_has_gradient():
    out, grad = run(LossConfig(kind="cispo"))  # default: weight = clamp(r, 0, 5) = r
    value = (-1 * LN(0.5) - 1.25 * LN(0.25) + 1.25 * LN(0.5)) / 3
    assert out.loss.item() == pytest.approx(value)
    torch.testing.assert_close(
        grad, torch.tensor([[-1 / 3, -1.25 / 3], [1.25 / 3, 0.0]], dtype=torch.float64)
    )
    out, grad = run(
        LossConfig(kind="cispo", clip_eps_low=0.2, clip_eps_high=0.2)
    )  # weight capped at 1.2, grad kept
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, -1.2 / 3], [1.2 / 3, 0.0]], dtype=torch.float64))
    assert out.stats["clipped"] == 2.0


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_zero_advantages_give_zero_loss_and_gradient(kind):
    out, grad = run(LossConfig(kind=kind), adv=torch.zeros(2, dtype=torch.float64))
    assert out.loss.item() == 0.0
    assert grad.abs().sum().item() == 0.0


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_single_token_completion(kind):
    # one token, π_θ = μ = 0.5, Â = 2: every objective reduces to −Â·r (cispo: −Â·log π) over 1 token
    logp = torch.tensor([[LN(0.5)]], dtype=torch.float64, requires_grad=True)
    behav = torch.tensor([[LN(0.5)]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.float64)
    adv = torch.tensor([2.0], dtype=torch.float64)
    cfg = LossConfig(kind=kind, max_completion_len=1)
    out = policy_loss(logp, behav, mask, adv, cfg, Norm(1, 1))
    out.loss.backward()
    expected = -2.0 * LN(0.5) if kind == "cispo" else -2.0
    assert out.loss.item() == pytest.approx(expected)
    assert logp.grad.item() == pytest.approx(-2.0)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_fully_masked_row_contributes_nothing(kind):
    logp, behav, mask, adv = case()
    mask = mask.clone()
    mask[1] = 0.0  # row 1 has no real tokens
    logp2 = logp.detach()[:1].clone().requires_grad_(True)
    cfg = LossConfig(kind=kind)
    out = policy_loss(logp, behav, mask, adv, cfg, Norm(1, 2))
    ref = policy_loss(logp2, behav[:1], mask[:1], adv[:1], cfg, Norm(1, 2))
    out.loss.backward()
    ref.loss.backward()
    assert torch.isfinite(out.loss)
    assert out.loss.item() == pytest.approx(ref.loss.item())
    assert logp.grad[1].abs().sum().item() == 0.0
    torch.testing.assert_close(logp.grad[:1], logp2.grad)


def test_ratio_exactly_at_clip_boundary_is_not_clipped_and_keeps_gradient():
    # r = exp(0) = 1 exactly and ε = 0: the ratio sits on both clip bounds
    logp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    out = policy_loss(
        logp,
        torch.zeros(1, 1, dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.float64),
        torch.tensor([1.0], dtype=torch.float64),
        LossConfig(kind="grpo", clip_eps_low=0.0, clip_eps_high=0.0),
        Norm(1, 1),
    )
    out.loss.backward()
    assert out.loss.item() == -1.0
    assert out.stats["clipped"] == 0.0
    assert logp.grad.item() == pytest.approx(-1.0)


def test_kl_estimators_hand_values():
    logp = torch.tensor([LN(0.5)], dtype=torch.float64)
    ref = torch.tensor([LN(0.25)], dtype=torch.float64)  # ρ = π_ref/π_θ = 0.5
    assert kl_per_token(logp, ref, "k1").item() == pytest.approx(LN(2))
    assert kl_per_token(logp, ref, "k2").item() == pytest.approx(0.5 * LN(2) ** 2)
    assert kl_per_token(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + LN(2))


def test_kl_term_is_added_with_beta_and_objective_normalisation():
    logp, behav, mask, adv = case()
    ref = logp.detach() - LN(2)  # ρ = 1/2 on every token → k3 = ln 2 − 1/2
    base = policy_loss(logp, behav, mask, adv, LossConfig(kind="dapo"), NORM).loss.item()
    out = policy_loss(logp, behav, mask, adv, LossConfig(kind="dapo", kl_beta=0.1), NORM, ref_logp=ref)
    assert out.loss.item() == pytest.approx(base + 0.1 * (LN(2) - 0.5))
    assert out.stats["ref_kl_sum"] == pytest.approx(3 * (LN(2) - 0.5))


def test_truncated_is_caps_the_effective_ratio():
    # r = 4 with Â = −1: PPO leaves −min(−4, −1.2) = 4; TIS cap 2 scales it by 2/4
    logp = torch.tensor([[LN(0.8)]], dtype=torch.float64, requires_grad=True)
    behav = torch.tensor([[LN(0.2)]], dtype=torch.float64)
    one = torch.ones(1, 1, dtype=torch.float64)
    out = policy_loss(
        logp,
        behav,
        one,
        torch.tensor([-1.0], dtype=torch.float64),
        LossConfig(kind="grpo", tis_cap=2.0),
        Norm(1, 1),
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(2.0)
    assert logp.grad.item() == pytest.approx(2.0)
    assert out.stats["capped"] == 1.0


def test_icepop_masks_tokens_outside_the_band():
    # r = (1, 1.25) and (1.25); band [0.5, 1.1] masks the two 1.25 tokens
    out, grad = run(LossConfig(kind="dapo", icepop_low=0.5, icepop_high=1.1))
    assert out.loss.item() == pytest.approx(-1 / 3)  # only token 00 remains; denominator unchanged
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, 0.0], [0.0, 0.0]], dtype=torch.float64))
    assert out.stats["masked"] == 2.0


def test_stats_finalize_means_and_mismatch_kl():
    out, _ = run(LossConfig(kind="grpo"))
    stats = LossStats()
    stats.add(out.stats)
    metrics = stats.finalize()
    assert metrics["ratio_mean"] == pytest.approx((1 + 1.25 + 1.25) / 3)
    assert metrics["ratio_max"] == pytest.approx(1.25)
    assert metrics["clip_frac"] == pytest.approx(1 / 3)
    k3 = 1.25 - 1 - LN(1.25)
    assert metrics["mismatch_kl"] == pytest.approx(2 * k3 / 3)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
@pytest.mark.parametrize("kl_beta", [0.0, 0.05])
def test_micro_batches_sum_to_the_full_batch(kind, kl_beta):
    """Splitting rows into micro-batches with the global Norm gives the same loss and gradient."""
    gen = torch.Generator().manual_seed(0)
    rows, cols = 7, 5
    lengths = torch.randint(1, cols + 1, (rows,), generator=gen)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).double()
    logp = (-torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    behav = logp.detach() + 0.3 * torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    ref = logp.detach() + 0.1 * torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    adv = torch.randn(rows, generator=gen, dtype=torch.float64)
    norm = Norm(rows, int(mask.sum()))
    cfg = LossConfig(
        kind=kind, kl_beta=kl_beta, max_completion_len=cols, clip_eps_low=0.2, clip_eps_high=0.25
    )
    full = policy_loss(logp, behav, mask, adv, cfg, norm, ref)
    full.loss.backward()
    full_grad = logp.grad.clone()
    logp.grad = None
    total = 0.0
    for part in (slice(0, 2), slice(2, 3), slice(3, 7)):
        # the micro-batch is also trimmed to its own longest row, as the collator does
        width = int(lengths[part].max())
        out = policy_loss(
            logp[part, :width],
            behav[part, :width],
            mask[part, :width],
            adv[part],
            cfg,
            norm,
            ref[part, :width],
        )
        out.loss.backward()
        total += out.loss.item()
    assert total == pytest.approx(full.loss.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(logp.grad, full_grad)


def test_unknown_loss_and_bad_options_are_rejected():
    with pytest.raises(ValueError, match="'grpo', 'dr_grpo', 'dapo', 'gspo' or 'cispo'"):
        LossConfig(kind="ppo")
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        LossConfig(tis_cap=-1.0)
    with pytest.raises(ValueError, match="IcePop"):
        LossConfig(icepop_low=2.0, icepop_high=1.0)
