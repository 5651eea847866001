"""Settings of the rollout service: `[rollout]` and its nested tables, `GRPO_ROLLOUT__*`, `--flags`.

    [rollout]        model, engine choice, capacity, context length, dtype, weight-sync deadlines
    [rollout.vllm]   vLLM engine arguments (--vllm.max-num-seqs 128)         → vllm_engine.py
    [rollout.hf]     transformers engine (--hf.max-batch-size 16)            → hf_engine.py
    [rollout.limits] request bounds (--limits.max-n 256)                     → validation.py

The engines read these models directly; nothing is copied into a second set of options.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings
from services.common.cpus import CpuList
from services.common.deadlines import TransferDeadline


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VllmConfig(_Section):
    """Arguments of vLLM's AsyncLLM (the CPU build here, the CUDA build on GPU hosts)."""

    gpu_memory_utilization: float = Field(
        default=0.85, gt=0, le=1, description="Fraction of GPU memory for weights + KV cache."
    )
    kv_cache_space_gib: float = Field(
        default=0.0,
        ge=0,
        description="CPU backend: KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE); 0 = vLLM default.",
    )
    enforce_eager: bool = Field(default=False, description="Disable CUDA graphs / compilation.")
    enable_prefix_caching: bool = Field(default=True, description="Share prompt KV across a group's samples.")
    max_num_seqs: int = Field(default=256, ge=1, description="Sequences scheduled per engine step.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per replica (tensor parallel).")
    executor: Literal["auto", "uni", "mp"] = Field(
        default="auto",
        description=(
            "Where vLLM runs its model worker: uni (inside the engine-core process), mp (a process per "
            "worker, vLLM's CPU default), auto (uni for one worker, mp for tensor parallel). An mp worker "
            "and its engine core busy-poll their shared-memory queue for 1 s after every message, so on "
            "a rollout's few cores they take CPU from the model (tiny model: 16 % of generation time)."
        ),
    )
    max_lora_rank: int = Field(
        default=0,
        ge=0,
        le=512,
        description="Serve LoRA adapter versions (the learner's --publish.export-format adapter) up to this "
        "rank: vLLM's LoRA support with the policy as one in-memory adapter, replaced in place per "
        "version (vllm_adapters.py); 0 = off: adapter versions are refused, merged weights only.",
    )
    pause_mode: Literal["keep", "wait", "abort"] = Field(
        default="keep",
        description=(
            "What a weight commit does to unfinished requests: keep (freeze, re-prefill under the new "
            "weights, continue; spans record the switch), wait (drain first), abort (end them with ABORT)."
        ),
    )


class HfConfig(_Section):
    """The plain-transformers engine, for machines without vLLM."""

    device: str = Field(default="auto", description="Device (auto, cpu, cuda, cuda:1, ...).")
    max_batch_size: int = Field(
        default=64,
        ge=1,
        description="Samples decoded together in one batch. The scheduler keeps groups_per_batch × "
        "group_size × (max_staleness + 1) samples in flight; on a GPU a decode step costs about the same "
        "for 32 rows as for 64 (64 instead of 32: 1.20× → 1.71× TRL on a 0.5B shape, H200).",
    )
    slice_ms: float = Field(
        default=50.0,
        gt=0,
        description="Longest stretch of decoding before a weight load or ScoreTokens waiting on the engine "
        "gets its turn, finished samples go back and new ones join the batch.",
    )
    num_threads: int = Field(
        default=0, ge=0, description="torch CPU threads (0 = torch default; 1 on busy hosts)."
    )


class RequestLimits(_Section):
    """Bounds on what one request may ask for (beyond them: INVALID_ARGUMENT, never an engine error)."""

    max_n: int = Field(
        default=256, ge=1, description="Largest n (completions per prompt) a Generate request may ask for."
    )
    max_temperature: float = Field(
        default=2.0, gt=0, le=2.0, description="Highest sampling temperature (vLLM's own limit is 2)."
    )
    max_stop_strings: int = Field(default=16, ge=0, description="Most stop strings per request.")
    max_stop_chars: int = Field(default=256, ge=1, description="Longest stop string, in characters.")
    max_id_chars: int = Field(default=256, ge=1, description="Longest request or prompt id, in characters.")
    max_render_messages: int = Field(
        default=256, ge=1, description="Most chat messages in one RenderMessages request."
    )
    max_render_chars: int = Field(
        default=500_000,
        ge=1,
        description="Most characters one RenderMessages request renders (contents, tool calls, tools, text).",
    )
    max_previous_tail: int = Field(
        default=64, ge=1, description="Most tokens of previous_tail a RenderMessages bridge request may send."
    )


class RegistrationConfig(_Section):
    """Joining a scheduler by itself (services/rollout/registration.py), for scaled rollout replicas."""

    scheduler_address: str = Field(
        default="", description="Scheduler host:port to register with; empty = do not register."
    )
    advertise_address: str = Field(
        default="",
        description="host:port the scheduler dials this rollout at; empty = this host's name and the "
        "bound port (set it where the hostname does not resolve, e.g. to the pod IP).",
    )
    interval_s: float = Field(
        default=30.0, gt=0, description="Seconds between registrations (a restarted scheduler relearns it)."
    )
    timeout_s: float = Field(default=10.0, gt=0, description="Deadline of one RegisterWorker call.")


class RolloutSettings(ServiceSettings):
    """Everything `python -m services.rollout` accepts; see `--help`."""

    config_table: ClassVar[str] = "rollout"
    model_config = SettingsConfigDict(env_prefix="GRPO_ROLLOUT__")

    model: str = Field(description="Model directory or Hugging Face id to serve.")
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
        default=0,
        ge=0,
        description="Context length (prompt + completion) in tokens; 0 = the model's own limit "
        "(max_position_embeddings).",
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
    fetch_deadline: TransferDeadline = Field(
        default_factory=TransferDeadline,
        description="Deadline of fetching one weight version over grpc_stream ([rollout.fetch_deadline]): "
        "floor_s + the version's total_bytes at min_rate_mb_s (defaults: 10 s + 1 s per 20 MB).",
    )
    load_deadline: TransferDeadline = Field(
        default_factory=TransferDeadline,
        description="Deadline of the vLLM engine's load of a staged version ([rollout.load_deadline]): "
        "floor_s + its total_bytes at min_rate_mb_s. A load that misses it leaves the engine unusable: "
        "this rollout then refuses work (UNAVAILABLE) until it is restarted.",
    )
    tokenize_threads: int = Field(
        default=2, ge=1, description="Threads that tokenize prompts off the event loop."
    )
    service_cpus: CpuList = Field(
        default="",
        description="Cores this rollout's own process moves to once its vLLM engine has started (gRPC, "
        "tokenization, vLLM's output processing), e.g. '0-3'; the engine-core process keeps `cpus`. Empty "
        "= stay on `cpus`. The demo's split lets it float over every core, so the front end does not take "
        "the engine's core. Ignored by the transformers engine, which computes in this process.",
    )
    busy_file: Path | None = Field(
        default=None,
        description="A host-local file this rollout keeps at '1' while it works (Generate requests in "
        "flight, scoring, staging or committing weights; and 20 ms after) and '0' otherwise, so a learner "
        "on the same host borrows its cores while it is idle (the learner's [learner.borrow]; the demo "
        "sets both); unset = none.",
    )
    limits: RequestLimits = Field(
        default_factory=RequestLimits, description="Request bounds ([rollout.limits])."
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="vLLM engine ([rollout.vllm]).")
    hf: HfConfig = Field(default_factory=HfConfig, description="transformers engine ([rollout.hf]).")
    registration: RegistrationConfig = Field(
        default_factory=RegistrationConfig,
        description="Registering with a scheduler ([rollout.registration]).",
    )
