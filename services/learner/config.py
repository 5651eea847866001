"""Learner settings: `[learner]` and its nested tables, `GRPO_LEARNER__*` env vars, `--help`.

Each component's options are one nested model, with its defaults defined only here. Where they are
read (trainer.py hands model.py, losses.py and checkpoint.py the values or section objects they need):

    [learner]             model, device, dtype, seed, micro-batching        → trainer.py
                          strict_step                                        → learner.py
    [learner.loss]        objective and its knobs (--loss.kind dapo)         → losses.py
    [learner.optim]       AdamW and the LR schedule (--optim.lr 4e-4)        → trainer.py
    [learner.lora]        LoRA adapters (--lora.rank 8)                      → model.py
    [learner.publish]     export_format, export_dtype                        → trainer.py
                          max_prepared_versions, advertise_address           → learner.py
                          bucket_bytes, chunk_bytes, collective_*            → learner.py, which copies
                                                                               them into the transports'
                                                                               `PublishContext`
    [learner.checkpoint]  atomic checkpoints and resume (--checkpoint.dir)   → trainer.py; dir also
                                                                               learner.py (stop)
    [learner.borrow]      an idle co-located rollout's cores (--borrow.cpus)  → trainer.py
    [learner.distributed] ranks under torchrun: deadlines, CPU offload         → sharding.py, ranks.py
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.advantages import LossKind
from services.common.config import ServiceSettings
from services.common.cpus import CpuList, parse_cpu_list
from services.common.malloc import MAX_MMAP_THRESHOLD
from services.common.weights import CHUNK_BYTES, DEFAULT_BUCKET_BYTES

# What `device` may name: the devices the learner runs on, in torch's spelling
DEVICE = re.compile(r"auto|cpu|mps|(cuda|xpu)(:\d+)?")
# Padded tokens per micro-batch when `micro_batch_tokens` is 0 (by device). On CPU: a ~29M model's step over
# 32 samples of ~120 tokens took 9.3 s at 512 against 10.7-11.9 s at 8192 (docs/performance.md); since the
# head runs on completion rows only, 2048 is ~11 % faster for SmolLM2 alone, but not beside vLLM's
# generation in a run (docs/perf-notes.md). 1024 holds a whole packed group of G = 8 64-token completions
# (`shared_prefix`): SmolLM2's step alone 27.4-28.4 s at 512 against 22.5 s at 1024, whole rows 29.8 s at
# 1024 against 30.5-31.7 s at 512. On an accelerator, bigger batches fill it.
CPU_MICRO_BATCH_TOKENS = 1024
ACCELERATOR_MICRO_BATCH_TOKENS = 8192
# The malloc mmap threshold of a learner of several ranks when `malloc_mmap_threshold_bytes` is unset:
# FSDP's gathered layers and the activations are mapped, so what a rank frees goes back to the system.
SHARDED_MMAP_THRESHOLD = 8 * 1024 * 1024

Dtype = Literal["auto", "float32", "bfloat16", "float16"]

# Default (clip_eps_low, clip_eps_high) per objective. cispo: lower bound off (1 − 1 = 0), IS weight ≤ 5.
DEFAULT_EPS: dict[LossKind, tuple[float, float]] = {
    LossKind.grpo: (0.2, 0.2),
    LossKind.dr_grpo: (0.2, 0.2),
    LossKind.dapo: (0.2, 0.28),
    LossKind.gspo: (3e-4, 4e-4),
    LossKind.cispo: (1.0, 4.0),
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LossConfig(_Section):
    """The objective and its knobs (formulas in losses.py)."""

    kind: LossKind = Field(
        default=LossKind.grpo,
        description="Objective: grpo (seq-mean token-mean, symmetric clip), dr_grpo (token sum / "
        "(N·max_completion_len)), dapo (global token mean, clip-higher), gspo (sequence ratio), "
        "cispo (detached clipped IS weight × logprob).",
    )
    clip_eps_low: float | None = Field(
        default=None,
        ge=0,
        description="Lower clip ε (ratio ≥ 1−ε). Default per loss: 0.2; gspo 3e-4; cispo 1.0 (off).",
    )
    clip_eps_high: float | None = Field(
        default=None,
        ge=0,
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

    @model_validator(mode="after")
    def _check_icepop(self) -> LossConfig:
        if self.icepop_high and not self.icepop_low < self.icepop_high:
            raise ValueError("IcePop needs icepop_low < icepop_high")
        return self

    @property
    def eps(self) -> tuple[float, float]:
        """(ε_low, ε_high), the objective's defaults where unset."""
        low, high = DEFAULT_EPS[self.kind]
        return (
            low if self.clip_eps_low is None else self.clip_eps_low,
            high if self.clip_eps_high is None else self.clip_eps_high,
        )


class OptimConfig(_Section):
    """AdamW and the learning-rate schedule."""

    lr: float = Field(default=1e-6, gt=0, description="AdamW peak learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW β1.")
    beta2: float = Field(default=0.999, ge=0, lt=1, description="AdamW β2.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW ε.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear LR warmup steps.")
    schedule: Literal["constant", "cosine"] = Field(default="constant", description="LR after warmup.")
    total_steps: int = Field(default=1000, gt=0, description="Cosine schedule horizon (steps).")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    max_grad_norm: float = Field(default=1.0, ge=0, description="Gradient clipping norm; 0 = no clipping.")


class LoraConfig(_Section):
    """LoRA adapters via peft; rank 0 = full fine-tune."""

    rank: int = Field(default=0, ge=0, description="LoRA rank; 0 = full fine-tune.")
    alpha: float = Field(default=16.0, gt=0, description="LoRA α (scale α/r).")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: tuple[str, ...] = Field(
        default=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        description="Module names LoRA adapts.",
    )


class PublishConfig(_Section):
    """How weight versions are exported and handed to rollouts."""

    export_format: Literal["full", "adapter"] = Field(
        default="full",
        description="Published weights: full state_dict (LoRA merged) or, with LoRA, the adapter tensors "
        "only, which rollouts serve as a LoRA adapter per version (weight-sync.md).",
    )
    export_dtype: Dtype = Field(
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
    chunk_bytes: int = Field(
        default=CHUNK_BYTES, gt=0, le=CHUNK_BYTES, description="FetchWeights chunk size (≤ 1 MiB)."
    )
    collective_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="nccl transport: seconds for every receiver to join each broadcast (and a new group's "
        "connections), and the floor of the buckets' transfer deadline (plus the bytes at "
        "collective_min_rate_mb_s); past either the version fails for every member and the group is rebuilt.",
    )
    collective_min_rate_mb_s: float = Field(
        default=20.0,
        gt=0,
        description="nccl transport: the slowest broadcast rate accepted; the buckets together may take "
        "collective_timeout_s + the version's bytes at this rate.",
    )
    collective_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="nccl transport: the rendezvous port; 0 = any free port.",
    )
    delta: bool = Field(
        default=True,
        description="bf16/fp16 export: keep the last packed version and send the next one as sparse "
        "deltas to rollouts that hold it (grpc_stream: per rollout; nccl: when every member does, the "
        "copy kept on the learner's device). services/transports/grpc_stream.py, nccl_delta.py.",
    )
    bucket_bytes: int = Field(
        default=DEFAULT_BUCKET_BYTES,
        gt=0,
        multiple_of=64,
        description="Bucket size of the packed weights: the unit of checksums and of collective broadcasts.",
    )


class BorrowConfig(_Section):
    """Cores a co-located rollout lends while it is idle (services/common/cpus.py explains the scheme)."""

    cpus: CpuList = Field(
        default="",
        description="Cores the learner may use besides its own `cpus` after each look (at every forward and "
        "backward pass and every decoder layer's) that finds every busy_files idle, e.g. the rollout's "
        "'0'; empty = never.",
    )
    busy_files: list[Path] = Field(
        default_factory=list,
        description="The `busy_file` of each rollout on those cores (the demo sets both sides).",
    )

    @model_validator(mode="after")
    def _complete(self) -> BorrowConfig:
        if bool(parse_cpu_list(self.cpus)) != bool(self.busy_files):
            raise ValueError("borrow.cpus and borrow.busy_files go together: set both or neither")
        return self


class CheckpointConfig(_Section):
    """Atomic checkpoints (also written on SIGTERM) and exact resume."""

    dir: Path | None = Field(default=None, description="Directory for checkpoints; unset = none.")
    every: int = Field(default=0, ge=0, description="Checkpoint every N steps (0 = only at stop).")
    keep: int = Field(default=3, ge=1, description="Keep the newest K checkpoints.")
    background: bool = Field(
        default=True,
        description="Write periodic checkpoints on a background thread: the train step waits only for a "
        "host copy of the state. The checkpoint at stop is always waited for.",
    )
    resume: bool = Field(default=False, description="Resume from the newest checkpoint in --checkpoint.dir.")

    @model_validator(mode="after")
    def _resume_needs_dir(self) -> CheckpointConfig:
        if self.resume and self.dir is None:
            raise ValueError("checkpoint.resume needs checkpoint.dir")
        return self


class DistributedConfig(_Section):
    """The learner as N ranks under torchrun (sharding.py): read when WORLD_SIZE > 1 or `shard_one_rank`."""

    timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Deadline of every collective between the learner's ranks (FSDP's all-gathers and "
        "reduce-scatters, the metrics' reductions): past it the rank fails and torchrun takes the learner "
        "down, to be restarted.",
    )
    idle_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="How long ranks other than 0 wait for rank 0's next command; rank 0 sends a heartbeat "
        "after a quarter of it without work, so only a hung rank 0 reaches it.",
    )
    cpu_offload: bool = Field(
        default=False,
        description="Keep sharded parameters, gradients and optimizer state in host memory (GPU learners).",
    )
    shard_one_rank: bool = Field(
        default=False,
        description="Shard with FSDP2 also as the only rank (WORLD_SIZE 1, with or without torchrun): "
        "with cpu_offload, a GPU learner keeps parameters, gradients and AdamW state in host memory; "
        "otherwise it runs the sharded path (gathered exports, sharded checkpoints) on one device.",
    )


class LearnerSettings(ServiceSettings):
    """Everything the learner needs: model, objective, optimizer, LoRA, publishing, checkpoints."""

    config_table = "learner"
    model_config = SettingsConfigDict(env_prefix="GRPO_LEARNER__")

    model: str = Field(description="HF model id or local directory of the policy.")
    device: str = Field(
        default="auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1'."
    )

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Compute dtype (autocast); parameters stay fp32. auto = bf16 on GPU, fp32 on CPU.",
    )
    seed: int = Field(default=0, description="Seed for torch/python RNGs (LoRA init, dropout).")
    gradient_checkpointing: bool = Field(default=False, description="Recompute activations in backward.")
    shared_prefix: bool = Field(
        default=True,
        description="Pack the completions of one prompt into one sequence per micro-batch, the prompt "
        "once (each row attends to it and to itself): the same logprobs and gradients for fewer tokens. "
        "A learner of one rank with sdpa or eager attention; otherwise every row is run whole.",
    )
    micro_batch_tokens: int = Field(
        default=0,
        ge=0,
        description="Padded token budget per micro-batch (rows × longest row); 0 = by device "
        f"({CPU_MICRO_BATCH_TOKENS} on CPU, {ACCELERATOR_MICRO_BATCH_TOKENS} on an accelerator).",
    )
    malloc_mmap_threshold_bytes: int | None = Field(
        default=None,
        ge=0,
        le=MAX_MMAP_THRESHOLD,
        description="glibc's malloc: blocks of at least this many bytes get a mapping of their own, returned "
        "to the system on free (services/common/malloc.py). 0 = glibc's own threshold, which grows with the "
        f"blocks freed and lets the heap keep them; unset = {SHARDED_MMAP_THRESHOLD} for a learner of "
        "several ranks (SmolLM2-135M, 2 ranks: peak 4.25 -> 3.0 GB per rank, step +4 %); one rank: glibc's.",
    )
    malloc_keep_freed: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="glibc's malloc: one heap that keeps what is freed (one arena, no block mapped on its "
        "own, no trimming), so each step's big activations reuse the last step's memory instead of "
        "pages the kernel faults in and zeroes (services/common/malloc.py; SmolLM2-135M: ~0.9 million "
        "page faults per step -> 0, resident memory +4 %, never given back). auto = on for a learner of "
        "one rank on the CPU without malloc_mmap_threshold_bytes, off otherwise (an accelerator's "
        "activations are not the host's, and its host copies, e.g. checkpoints, are better given back).",
    )
    strict_step: bool = Field(
        default=True,
        description="Refuse (FAILED_PRECONDITION) a batch whose `step` is not the learner's current step.",
    )
    loss: LossConfig = Field(
        default_factory=LossConfig, description="Objective ([learner.loss], e.g. --loss.kind dapo)."
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer ([learner.optim]).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA ([learner.lora]).")
    publish: PublishConfig = Field(
        default_factory=PublishConfig, description="Weight publishing ([learner.publish])."
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints ([learner.checkpoint])."
    )
    borrow: BorrowConfig = Field(
        default_factory=BorrowConfig, description="Borrowing an idle rollout's cores ([learner.borrow])."
    )
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig,
        description="Ranks under torchrun ([learner.distributed]; used when WORLD_SIZE > 1).",
    )

    @model_validator(mode="after")
    def _adapter_needs_lora(self) -> LearnerSettings:
        if self.publish.export_format == "adapter" and self.lora.rank == 0:
            raise ValueError("publish.export_format adapter needs LoRA (--lora.rank > 0): a full "
                             "fine-tune has no adapter to publish")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _borrow_needs_own_cores(self) -> LearnerSettings:
        if self.borrow.cpus and not self.cpus:
            raise ValueError(
                "borrow.cpus needs the learner's own cpus: without them it already uses every core"
            )
        if self.borrow.cpus and parse_cpu_list(self.borrow.cpus) <= parse_cpu_list(self.cpus):
            raise ValueError(f"borrow.cpus {self.borrow.cpus} adds no core to the learner's cpus {self.cpus}")
        return self

    @field_validator("device")
    @classmethod
    def _a_torch_device(cls, value: str) -> str:
        if not DEVICE.fullmatch(value):
            raise ValueError("a device is 'auto', 'cpu', 'cuda', 'cuda:N', 'mps', 'xpu' or 'xpu:N'")
        return value

    @model_validator(mode="after")
    def _one_malloc_policy(self) -> LearnerSettings:
        if self.malloc_keep_freed == "on" and self.malloc_mmap_threshold_bytes:
            raise ValueError(
                "malloc_keep_freed=on maps no block on its own: it cannot go with malloc_mmap_threshold_bytes"
            )
        return self

    def keeps_freed(self, world: int, device_type: str) -> bool:
        """Whether a learner of `world` ranks on `device_type` ("cpu", "cuda", ...: the resolved device)
        runs malloc with a heap that keeps what is freed."""
        if self.malloc_keep_freed != "auto":
            return self.malloc_keep_freed == "on"
        return world == 1 and device_type == "cpu" and self.malloc_mmap_threshold_bytes is None

    def mmap_threshold(self, world: int) -> int:
        """The malloc mmap threshold a learner of `world` ranks runs with (0: glibc's own)."""
        if self.malloc_mmap_threshold_bytes is not None:
            return self.malloc_mmap_threshold_bytes
        return SHARDED_MMAP_THRESHOLD if world > 1 else 0
