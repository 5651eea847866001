"""Learner settings (`[learner]` table, `GRPO_LEARNER__*` env vars, `python -m services.learner --help`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings
from services.learner.losses import LossConfig
from services.learner.model import LoraOptions
from services.learner.trainer import OptimOptions, TrainerOptions

_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LearnerSettings(ServiceSettings):
    """Everything the learner needs: model, objective, optimizer, LoRA, checkpoints, publishing."""

    config_table = "learner"
    model_config = SettingsConfigDict(env_prefix="GRPO_LEARNER__")

    # model / numerics
    model: str = Field(default="", description="HF model id or local directory of the policy (required).")
    device: str = Field(
        default="auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1'."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Compute dtype (autocast); parameters stay fp32. auto = bf16 on GPU, fp32 on CPU.",
    )
    seed: int = Field(default=0, description="Seed for torch/python RNGs (LoRA init, dropout).")
    gradient_checkpointing: bool = Field(default=False, description="Recompute activations in backward.")
    micro_batch_tokens: int = Field(
        default=8192, gt=0, description="Padded token budget per micro-batch (rows × longest row)."
    )

    # objective
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = Field(
        default="grpo",
        description="Objective: grpo (seq-mean token-mean, symmetric clip), dr_grpo (token sum / "
        "(N·max_completion_len)), dapo (global token mean, clip-higher), gspo (sequence ratio), "
        "cispo (detached clipped IS weight × logprob).",
    )
    clip_eps_low: float | None = Field(
        default=None,
        description="Lower clip ε (ratio ≥ 1−ε). Default per loss: 0.2; gspo 3e-4; cispo 1.0 (off).",
    )
    clip_eps_high: float | None = Field(
        default=None,
        description="Upper clip ε (ratio ≤ 1+ε). Default per loss: 0.2; dapo 0.28; gspo 4e-4; cispo 4.0.",
    )
    max_completion_len: int = Field(
        default=1024, gt=0, description="dr_grpo's constant denominator L (set to the rollout max_tokens)."
    )
    kl_beta: float = Field(
        default=0.0, ge=0, description="KL coefficient to the frozen initial model; 0 = off."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(default="k3", description="KL estimator (Schulman).")
    tis_cap: float = Field(
        default=0.0, ge=0, description="Truncated IS: cap C on π_θ/μ per token (0 = off; 2.0 is common)."
    )
    icepop_low: float = Field(default=0.0, ge=0, description="IcePop: mask tokens with π_θ/μ below this.")
    icepop_high: float = Field(
        default=0.0, ge=0, description="IcePop: mask tokens with π_θ/μ above this (0 = IcePop off)."
    )

    # optimizer / schedule
    lr: float = Field(default=1e-6, gt=0, description="AdamW peak learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(default=0.9, description="AdamW β1.")
    adam_beta2: float = Field(default=0.999, description="AdamW β2.")
    adam_eps: float = Field(default=1e-8, description="AdamW ε.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear LR warmup steps.")
    lr_schedule: Literal["constant", "cosine"] = Field(default="constant", description="LR after warmup.")
    total_steps: int = Field(default=1000, gt=0, description="Cosine schedule horizon (steps).")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    max_grad_norm: float = Field(default=1.0, ge=0, description="Gradient clipping norm; 0 = no clipping.")

    # LoRA
    lora_rank: int = Field(default=0, ge=0, description="LoRA rank; 0 = full fine-tune.")
    lora_alpha: float = Field(default=16.0, gt=0, description="LoRA α (scale α/r).")
    lora_dropout: float = Field(default=0.0, ge=0, lt=1, description="LoRA dropout.")
    lora_target_modules: list[str] = Field(
        default=list(_DEFAULT_TARGETS), description="Module names LoRA adapts."
    )

    # publishing weights
    export_format: Literal["full", "adapter"] = Field(
        default="full",
        description="Published weights: full state_dict (LoRA merged) or adapter tensors only.",
    )
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="dtype of published weights; auto = as trained (fp32 master weights)."
    )
    advertise_address: str = Field(
        default="",
        description="host:port rollouts use for FetchWeights; empty = host:bound port "
        "(the hostname if host is 0.0.0.0).",
    )
    max_prepared_versions: int = Field(
        default=4, gt=0, description="Prepared-but-unreleased weight versions held at once."
    )
    weight_chunk_bytes: int = Field(
        default=1 << 20, gt=0, le=1 << 20, description="FetchWeights chunk size (≤ 1 MiB)."
    )

    strict_step: bool = Field(
        default=True,
        description="Refuse (FAILED_PRECONDITION) a batch whose `step` is not the learner's current step.",
    )

    # checkpoints
    checkpoint_dir: Path | None = Field(default=None, description="Directory for checkpoints; unset = none.")
    checkpoint_every: int = Field(default=0, ge=0, description="Checkpoint every N steps (0 = only at stop).")
    checkpoint_keep: int = Field(default=3, ge=1, description="Keep the newest K checkpoints.")
    resume: bool = Field(default=False, description="Resume from the newest checkpoint in --checkpoint-dir.")

    def trainer_options(self) -> TrainerOptions:
        """The pure-logic view of these settings."""
        return TrainerOptions(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            loss=LossConfig(
                kind=self.loss,
                eps_low=self.clip_eps_low,
                eps_high=self.clip_eps_high,
                max_completion_len=self.max_completion_len,
                kl_beta=self.kl_beta,
                kl_estimator=self.kl_estimator,
                tis_cap=self.tis_cap,
                icepop_low=self.icepop_low,
                icepop_high=self.icepop_high,
            ),
            optim=OptimOptions(
                lr=self.lr,
                weight_decay=self.weight_decay,
                beta1=self.adam_beta1,
                beta2=self.adam_beta2,
                eps=self.adam_eps,
                warmup_steps=self.warmup_steps,
                schedule=self.lr_schedule,
                total_steps=self.total_steps,
                min_lr_ratio=self.min_lr_ratio,
                max_grad_norm=self.max_grad_norm,
            ),
            lora=LoraOptions(
                rank=self.lora_rank,
                alpha=self.lora_alpha,
                dropout=self.lora_dropout,
                target_modules=tuple(self.lora_target_modules),
            ),
            micro_batch_tokens=self.micro_batch_tokens,
            gradient_checkpointing=self.gradient_checkpointing,
            export_format=self.export_format,
            export_dtype=self.export_dtype,
            seed=self.seed,
            checkpoint_dir=self.checkpoint_dir,
            checkpoint_every=self.checkpoint_every,
            checkpoint_keep=self.checkpoint_keep,
            resume=self.resume,
        )
