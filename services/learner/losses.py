"""GRPO-family policy objectives over padded tensors (pure torch, no model, no I/O).

Every objective takes completion-aligned tensors of one micro-batch

    logp      [B, T]  learner logprobs of the sampled tokens, log_softmax(logits / temperature), with grad
    behav     [B, T]  behaviour logprobs recorded by the rollout (vLLM processed logprobs)
    mask      [B, T]  1.0 on real completion tokens, 0.0 on padding
    adv       [B]     one advantage per completion (group-normalised by the scheduler)

and returns a loss that is already divided by the *global* normaliser of the whole optimizer batch
(`Norm`), so summing the micro-batch losses (and their gradients) gives exactly the full-batch
objective, whatever the micro-batching:

    grpo     1/N_seq Σ_i 1/|o_i| Σ_t ℓ_it              (per-sequence token mean, then mean over sequences)
    dr_grpo  1/(N_seq·L) Σ_i Σ_t ℓ_it                  (L = constant max completion length; Dr.GRPO)
    dapo     1/N_tok Σ_i Σ_t ℓ_it                       (token mean over the global batch; clip-higher)
    gspo     1/N_seq Σ_i ℓ_i                            (sequence-level geometric-mean ratio and clip)
    cispo    1/N_tok Σ_i Σ_t −sg(clip(r_it)) Â_i log π  (detached clipped IS weight; all tokens keep a grad)

with the PPO token surrogate ℓ = −min(r·Â, clip(r, 1−ε_low, 1+ε_high)·Â).

**The "old" policy is the behaviour policy.** r = π_θ / μ with μ the rollout's recorded logprobs; the
learner never recomputes π_old. Rollouts are asynchronous (tokens may come from older weights, even
several versions inside one completion) and we take exactly one optimizer step per batch, so the
learner's own "old" policy would equal π_θ and clip nothing; clipping against μ instead bounds the
update against what actually generated the data and covers staleness and train/inference mismatch
in one ratio (the "bypass" mode of verl's rollout correction; atropos' trainer does the same).
It costs no extra forward pass.

Mismatch corrections (both detached, applied per token to ℓ; per sequence for GSPO), with
ρ = sg(π_θ / μ):
  * truncated IS, cap C: ℓ is scaled by min(1, C/ρ), i.e. the effective ratio never exceeds C
    (this bounds the otherwise unbounded r·Â term for negative advantages);
  * IcePop: tokens with ρ outside [α, β] get zero weight (they still count in the denominator).

Optional KL to a frozen reference (β > 0): per-token k1/k2/k3 estimator of KL(π_θ‖π_ref), added
as β·KL_t and reduced with the objective's own normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.learner.config import LossConfig


@dataclass(frozen=True)
class Norm:
    """Global normalisers of the whole optimizer batch (all micro-batches together)."""

    num_seqs: int  # completions with at least one token
    num_tokens: int  # completion tokens


@dataclass
class LossOutput:
    """The micro-batch loss (already globally normalised) and detached token/sequence statistics.

    Statistics are sums (so micro-batches add up); `LossStats.finalize` turns them into means.
    """

    loss: torch.Tensor
    stats: dict[str, float]


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Schulman's estimators of KL(π_θ‖π_ref) per sampled token. [B, T] → [B, T]."""
    log_ratio = ref_logp - logp  # log ρ, ρ = π_ref / π_θ  [B, T]
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(log_ratio) - log_ratio  # k3 = ρ − 1 − log ρ ≥ 0


def mismatch_weights(
    log_rho: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Detached correction weight per element, and the capped / masked indicator. [...] → 3 × [...]."""
    rho = log_rho.detach().exp()
    weight = torch.ones_like(rho)
    capped = torch.zeros_like(rho, dtype=torch.bool)
    masked = torch.zeros_like(rho, dtype=torch.bool)
    if cfg.tis_cap > 0:
        capped = rho > cfg.tis_cap
        weight = torch.where(capped, cfg.tis_cap / rho, weight)
    if cfg.icepop_high > 0:
        masked = (rho < cfg.icepop_low) | (rho > cfg.icepop_high)
        weight = torch.where(masked, torch.zeros_like(weight), weight)
    return weight, capped, masked


def _ppo_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float):
    """−min(r·Â, clip(r)·Â) and whether the clipped branch was taken (zero gradient). Shapes broadcast."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).detach()
    return loss, was_clipped


def policy_loss(
    logp: torch.Tensor,
    behav: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    cfg: LossConfig,
    norm: Norm,
    ref_logp: torch.Tensor | None = None,
) -> LossOutput:
    """The micro-batch contribution of `cfg.kind` to the batch objective (to be minimised)."""
    mask = mask.to(logp.dtype)  # [B, T]
    adv = adv.to(logp.dtype)  # [B]
    behav = behav.to(logp.dtype)  # [B, T]
    eps_low, eps_high = cfg.eps
    lengths = mask.sum(dim=1)  # [B]
    safe_len = lengths.clamp(min=1.0)  # fully masked rows contribute 0, never NaN
    log_ratio = (logp - behav) * mask  # [B, T]
    num_seqs = max(norm.num_seqs, 1)
    num_tokens = max(norm.num_tokens, 1)

    if cfg.kind == "gspo":
        seq_log_ratio = log_ratio.sum(dim=1) / safe_len  # [B] log of the geometric-mean ratio s_i
        seq_ratio = seq_log_ratio.exp()  # [B]
        per_seq, was_clipped = _ppo_surrogate(seq_ratio, adv, eps_low, eps_high)  # [B]
        weight, capped, masked = mismatch_weights(seq_log_ratio, cfg)  # [B]
        has_tokens = (lengths > 0).to(logp.dtype)  # [B]
        per_seq = per_seq * weight * has_tokens
        if ref_logp is not None and cfg.kl_beta > 0:
            kl_seq = (kl_per_token(logp, ref_logp, cfg.kl_estimator) * mask).sum(dim=1) / safe_len  # [B]
            per_seq = per_seq + cfg.kl_beta * kl_seq
        loss = per_seq.sum() / num_seqs
        # sequence-level events counted per token so all stats share one denominator
        token_clipped = was_clipped.to(logp.dtype)[:, None] * mask
        token_capped = capped.to(logp.dtype)[:, None] * mask
        token_masked = masked.to(logp.dtype)[:, None] * mask
    else:
        ratio = log_ratio.exp()  # [B, T]
        adv_t = adv[:, None]  # [B, 1]
        if cfg.kind == "cispo":
            is_weight = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)  # [B, T]
            per_token = -is_weight * adv_t * logp  # [B, T]
            was_clipped = (is_weight != ratio.detach()) & (mask > 0)
        else:
            per_token, was_clipped = _ppo_surrogate(ratio, adv_t, eps_low, eps_high)  # [B, T]
        weight, capped, masked = mismatch_weights(log_ratio, cfg)  # [B, T]
        per_token = per_token * weight
        if ref_logp is not None and cfg.kl_beta > 0:
            per_token = per_token + cfg.kl_beta * kl_per_token(logp, ref_logp, cfg.kl_estimator)
        per_token = per_token * mask  # [B, T]
        if cfg.kind == "grpo":
            loss = (per_token.sum(dim=1) / safe_len).sum() / num_seqs
        elif cfg.kind == "dr_grpo":
            loss = per_token.sum() / (num_seqs * cfg.max_completion_len)
        else:  # dapo, cispo
            loss = per_token.sum() / num_tokens
        token_clipped = was_clipped.to(logp.dtype) * mask
        token_capped = capped.to(logp.dtype) * mask
        token_masked = masked.to(logp.dtype) * mask

    return LossOutput(
        loss,
        _token_stats(logp, behav, mask, log_ratio, token_clipped, token_capped, token_masked, ref_logp, cfg),
    )


def _token_stats(
    logp: torch.Tensor,
    behav: torch.Tensor,
    mask: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor,
    capped: torch.Tensor,
    masked: torch.Tensor,
    ref_logp: torch.Tensor | None,
    cfg: LossConfig,
) -> dict[str, float]:
    """Detached sums over real tokens (all [B, T]); see LossStats for the means."""
    with torch.no_grad():
        ratio = log_ratio.exp()
        real = mask > 0
        log_rho = log_ratio  # log π_θ/μ, zero on padding
        # KL(μ‖π_θ) on samples from μ, k3 form: ρ − 1 − log ρ with ρ = π_θ/μ.
        mismatch_kl = (torch.expm1(log_rho) - log_rho) * mask
        stats = {
            "tokens": float(mask.sum()),
            "ratio_sum": float((ratio * mask).sum()),
            "ratio_max": float(ratio[real].max()) if bool(real.any()) else 1.0,
            "clipped": float(clipped.sum()),
            "capped": float(capped.sum()),
            "masked": float(masked.sum()),
            "mismatch_kl_sum": float(mismatch_kl.sum()),
            "logp_sum": float((logp.detach() * mask).sum()),
            "behav_logp_sum": float((behav * mask).sum()),
        }
        if ref_logp is not None and cfg.kl_beta > 0:
            stats["ref_kl_sum"] = float(
                (kl_per_token(logp.detach(), ref_logp, cfg.kl_estimator) * mask).sum()
            )
        return stats


class LossStats:
    """Accumulates micro-batch statistics into per-step metrics (token means, max)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.ratio_max = 0.0

    def add(self, stats: dict[str, float]) -> None:
        for key, value in stats.items():
            if key == "ratio_max":
                self.ratio_max = max(self.ratio_max, value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value

    def finalize(self) -> dict[str, float]:
        tokens = max(self.sums.get("tokens", 0.0), 1.0)
        metrics = {
            "ratio_mean": self.sums.get("ratio_sum", 0.0) / tokens,
            "ratio_max": self.ratio_max,
            "clip_frac": self.sums.get("clipped", 0.0) / tokens,
            "tis_capped_frac": self.sums.get("capped", 0.0) / tokens,
            "icepop_masked_frac": self.sums.get("masked", 0.0) / tokens,
            "mismatch_kl": self.sums.get("mismatch_kl_sum", 0.0) / tokens,
            "logp_mean": self.sums.get("logp_sum", 0.0) / tokens,
            "behav_logp_mean": self.sums.get("behav_logp_sum", 0.0) / tokens,
        }
        if "ref_kl_sum" in self.sums:
            metrics["ref_kl"] = self.sums["ref_kl_sum"] / tokens
        return metrics
