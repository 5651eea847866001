"""Settings of the rollout service (`[rollout]` table, `GRPO_ROLLOUT__*` env vars, `--flags`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


class RolloutSettings(ServiceSettings):
    """Everything `python -m services.rollout` accepts; see `--help`."""

    config_table: ClassVar[str] = "rollout"
    model_config = SettingsConfigDict(env_prefix="GRPO_ROLLOUT__")

    model: str = Field(default="", description="Model directory or Hugging Face id to serve (required).")
    tokenizer: str = Field(default="", description="Tokenizer directory or id; empty = same as --model.")
    engine: Literal["auto", "vllm", "transformers"] = Field(
        default="auto", description="Inference engine: vllm, transformers, or auto (vllm if importable)."
    )
    rollout_id: str = Field(
        default="", description="Name of this worker in completions and state; empty = host-pid."
    )
    max_in_flight: int = Field(
        default=256, ge=1, description="Generate requests accepted at once; more get RESOURCE_EXHAUSTED."
    )
    max_model_len: int = Field(
        default=2048, ge=16, description="Context length (prompt + completion) in tokens."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Weight/compute dtype. Use float32 where logprobs must match the learner to 1e-4.",
    )
    seed: int = Field(default=0, description="Engine seed for unseeded requests.")
    add_special_tokens: bool = Field(
        default=True, description="Let the tokenizer add its special tokens (e.g. BOS) to plain-text prompts."
    )
    trust_remote_code: bool = Field(default=False, description="Allow model code from the model repository.")
    gpu_memory_utilization: float = Field(
        default=0.85, gt=0, le=1, description="vLLM: fraction of GPU memory for weights + KV cache."
    )
    kv_cache_space_gib: float = Field(
        default=0.0,
        ge=0,
        description="vLLM CPU backend: KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE); 0 = vLLM default.",
    )
    enforce_eager: bool = Field(default=False, description="vLLM: disable CUDA graphs / compilation.")
    enable_prefix_caching: bool = Field(
        default=True, description="vLLM: share prompt KV across a group's samples."
    )
    max_num_seqs: int = Field(default=256, ge=1, description="vLLM: sequences scheduled per step.")
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="vLLM: GPUs per replica (tensor parallel)."
    )
    pause_mode: Literal["keep", "wait", "abort"] = Field(
        default="keep",
        description=(
            "vLLM: what a weight commit does to unfinished requests: keep (freeze, re-prefill under the new "
            "weights, continue; spans record the switch), wait (drain first), abort (end them with ABORT)."
        ),
    )
    hf_device: str = Field(
        default="auto", description="transformers engine: device (auto, cpu, cuda, cuda:1, ...)."
    )
    hf_max_batch_size: int = Field(default=32, ge=1, description="transformers engine: samples per batch.")
    hf_num_threads: int = Field(
        default=0,
        ge=0,
        description="transformers engine: torch CPU threads (0 = torch default; 1 on busy hosts).",
    )
    fetch_timeout_s: float = Field(
        default=300.0, gt=0, description="Deadline for fetching one weight version over grpc_stream."
    )
    load_timeout_s: float = Field(
        default=300.0, gt=0, description="Deadline for the engine to load staged weights."
    )
    tokenize_threads: int = Field(
        default=2, ge=1, description="Threads that tokenize prompts off the event loop."
    )
