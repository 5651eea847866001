"""Talking to a run's policy: a chat answer from the live policy, and the same prompt answered by two
versions side by side.

- **Live**: the run's rollout serves the policy at the learner's latest committed version. The
  studio finds a healthy rollout in the scheduler's GetStatus and calls its `Generate` (its own chat
  template renders a chat message; a plain text prompt is continued as is), under a deadline, with the
  run's TLS and token. The answer says which weight version wrote it. A training run keeps its
  rollout at its most requests in flight, so the chat asks again every 0.25 s until a slot frees
  (pausing the run frees them all), within its deadline.
- **Checkpoints**: a run's checkpoints (`checkpoints/step_*/model.safetensors`, the learner's full
  weights) and the base model (`[learner] model` in run.toml) are loaded with transformers in a
  worker thread (never on the event loop), at most two at a time, and answer with the same seed.
  A LoRA run's checkpoints hold adapters, not full weights: compare refuses them by name.
"""

from __future__ import annotations

import asyncio
import threading
import time
import tomllib
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import GrpcClient
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.scheduler.status_view import run_security

CHECKPOINTS = "checkpoints"
BUSY_RETRY_S = 0.25  # a rollout at its max in flight (RESOURCE_EXHAUSTED): ask again this much later


def model_path(run_dir: Path) -> str:
    """The run's model (`[learner] model` of run.toml): the base of its checkpoints and its tokenizer."""
    config = run_dir / "run.toml"
    if not config.exists():
        raise FailedPrecondition(f"{config} does not exist: no model to load")
    model = tomllib.loads(config.read_text()).get("learner", {}).get("model", "")
    if not model:
        raise FailedPrecondition(f"{config} names no [learner] model")
    return model


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def token_texts(run_dir: Path):
    """`decode(ids) → one string per token` with the run's tokenizer."""
    tokenizer = _tokenizer(model_path(run_dir))

    def decode(ids: list[int]) -> list[str]:
        return [tokenizer.decode([i]) for i in ids]

    return decode


def checkpoints(run_dir: Path) -> list[str]:
    """The run's checkpoints with full weights, oldest first (their directory names)."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir() if p.name.startswith("step_") and (p / "model.safetensors").exists()
    )


@dataclass(frozen=True)
class Question:
    prompt: str
    chat: bool  # ask it as a user message, through the model's chat template (else continue the text)
    temperature: float
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class Answer:
    source: str
    text: str
    version: int | None  # the weight version (live), None for a checkpoint
    tokens: int


async def live_answer(run_dir: Path, rollout_address: str, q: Question, timeout_s: float) -> Answer:
    """One completion of `q.prompt` by the run's live policy (its rollout at `rollout_address`)."""
    message = types_pb2.Prompt(id=f"studio-{uuid.uuid4().hex[:12]}", env_name="studio")
    if q.chat:
        message.messages.append(types_pb2.ChatMessage(role="user", content=q.prompt))
    else:
        message.text = q.prompt
    params = types_pb2.SamplingParams(
        n=1, temperature=q.temperature, top_p=1.0, max_tokens=q.max_tokens, seed=q.seed
    )
    request = rollout_pb2.GenerateRequest(request_id=message.id, prompt=message, sampling_params=params)
    client = GrpcClient(rollout_address, rollout_pb2_grpc.RolloutServiceStub, security=run_security(run_dir))
    deadline = time.monotonic() + timeout_s
    try:
        while True:  # a training run keeps its rollout busy: wait for a free slot until the deadline
            left = deadline - time.monotonic()
            try:
                completions = [
                    c
                    async for reply in client.stream("Generate", request, timeout=left)
                    for c in reply.completions
                ]
                break
            except ResourceExhausted:
                if left < BUSY_RETRY_S:
                    raise
                await asyncio.sleep(BUSY_RETRY_S)
    finally:
        await client.close()
    if not completions:
        raise FailedPrecondition(f"rollout {rollout_address} answered no completion")
    c = completions[0]
    versions = sorted({s.version for s in c.version_spans})
    return Answer("live", c.text, versions[-1] if versions else None, len(c.completion_token_ids))


class CheckpointModels:
    """Models loaded from a run's base and checkpoints, two at most, for side-by-side answers."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._models: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # one generation at a time: they share this machine's cores

    def _load(self, base: str, checkpoint: Path | None) -> Any:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        key = (base, str(checkpoint or ""))
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        if checkpoint is not None:
            state = load_file(str(checkpoint / "model.safetensors"))
            if any("lora_" in name for name in state):
                raise FailedPrecondition(
                    f"{checkpoint.name} holds LoRA adapters, not full weights: compare needs a full fine-tune"
                )
            missing, unexpected = model.load_state_dict(state, strict=False)
            tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
            if set(missing) - tied or unexpected:
                raise FailedPrecondition(
                    f"{checkpoint.name} does not fit {base}: missing {sorted(missing)[:3]}, "
                    f"unexpected {sorted(unexpected)[:3]}"
                )
        model.eval()
        self._models[key] = model
        while len(self._models) > self.keep:
            self._models.popitem(last=False)
        return model

    def _answer(self, run_dir: Path, source: str, q: Question) -> Answer:
        import torch

        base = model_path(run_dir)
        if source == "base":
            checkpoint = None
        elif source in checkpoints(run_dir):
            checkpoint = run_dir / CHECKPOINTS / source
        else:
            raise NotFound(
                f"no checkpoint {source!r} in {run_dir / CHECKPOINTS} "
                f"(have: base, {', '.join(checkpoints(run_dir)) or 'none'})"
            )
        tokenizer = _tokenizer(base)
        if q.chat:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": q.prompt}], add_generation_prompt=True
            )
        else:
            ids = tokenizer(q.prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise InvalidArgument("the prompt is empty once tokenized")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        with self._lock:
            model = self._load(base, checkpoint)
            torch.manual_seed(q.seed)
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]), max_new_tokens=q.max_tokens, do_sample=q.temperature > 0,
                    temperature=q.temperature if q.temperature > 0 else None, top_p=None, top_k=None,
                    pad_token_id=pad,
                )  # fmt: skip
        new = out[0, len(ids) :].tolist()
        return Answer(source, tokenizer.decode(new, skip_special_tokens=True), None, len(new))

    async def answer(self, run_dir: Path, source: str, q: Question) -> Answer:
        return await asyncio.to_thread(self._answer, run_dir, source, q)
