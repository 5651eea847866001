"""The policy model: loading (full or LoRA), token logprobs, and weight export in HF names.

Logprob convention (shared with the rollout): the logprob of completion token t is
log_softmax(logits / T) at the position that predicts it, computed in fp32, i.e. vLLM's
"processed" logprobs with temperature-only sampling.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext

import torch
from transformers import AutoModelForCausalLM

from services.common.weights import dtype_from_name
from services.learner.batching import MicroBatch
from services.learner.config import LoraConfig

EXPORT_FORMATS = ("full", "adapter")


def resolve_device(device: str) -> torch.device:
    """'auto' → cuda if available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' → bf16 autocast on GPU, fp32 on CPU. Parameters (and optimizer state) stay fp32."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype_from_name(dtype)


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def load_policy(
    path: str, device: torch.device, lora: LoraConfig, gradient_checkpointing: bool = False
) -> torch.nn.Module:
    """Load the causal LM in fp32 (master weights), optionally wrapped with a PEFT LoRA adapter."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora.rank > 0:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        if gradient_checkpointing:
            model.enable_input_require_grads()
        config = PeftLoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
    return model.to(device)


def load_reference(path: str, device: torch.device) -> torch.nn.Module:
    """A frozen copy of the initial policy for the KL term (full fine-tune only)."""
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def vocab_size(model: torch.nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (decoder layers): the classes transformers names in
    `_no_split_modules`, else the children of its longest ModuleList; [] if it has neither."""
    base = model.get_base_model() if is_lora(model) else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def token_logprobs(
    model: torch.nn.Module, mb: MicroBatch, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of the completion tokens [B, T] (and entropies [B, T], detached) under `model`.

    The LM head runs only from the first position that predicts a completion token on (transformers'
    `logits_to_keep`): prompt positions' logits are never needed, and for a real vocabulary the head
    and its [B, L, V] output are a large share of the step.
    """
    first = int(mb.positions[:, 0].min())  # earliest position predicting a completion token
    keep = torch.arange(first, mb.input_ids.shape[1] - 1, device=mb.input_ids.device)  # [K]
    logits = model(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False, logits_to_keep=keep
    ).logits  # [B, K, V], logits[:, k] at position first + k
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None]  # [B, 1]
    picked = logits[rows, (mb.positions - first).clamp(min=0)].float()  # [B, T, V] (padding: any row)
    picked = picked / mb.temperature[:, None, None]
    logprobs_all = torch.log_softmax(picked, dim=-1)  # [B, T, V]
    logp = logprobs_all.gather(-1, mb.completion_ids[..., None]).squeeze(-1)  # [B, T]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)  # [B, T]
    return logp, entropy


def _exported(tensor: torch.Tensor, dtype: torch.dtype | None, snapshot: bool) -> torch.Tensor:
    """A CPU copy (snapshot), or the tensor itself where it lives (dtype-converted only if asked)."""
    out = tensor.detach().to("cpu", copy=True) if snapshot else tensor.detach()
    return out.to(dtype) if dtype is not None and out.is_floating_point() else out


@torch.no_grad()
def export_state(
    model: torch.nn.Module, fmt: str = "full", dtype: torch.dtype | None = None, snapshot: bool = True
) -> OrderedDict:
    """Weights to send to rollouts: CPU copies (a stable snapshot), or with `snapshot=False` the model's
    own tensors on their device without a copy (merged LoRA weights are new tensors either way).

    full:    every `state_dict()` entry in HF names (tied lm_head included); for a LoRA model the
             adapters are merged into their base weights (W + B·A·α/r) without touching the model,
             and the `base_model.model.` prefix / `.base_layer` infix / lora tensors are dropped.
    adapter: only the LoRA tensors, in PEFT's adapter-file names.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}")
    if fmt == "adapter":
        if not is_lora(model):
            raise ValueError("adapter export needs a LoRA model")
        from peft import get_peft_model_state_dict

        return OrderedDict(
            (k, _exported(v, dtype, snapshot)) for k, v in get_peft_model_state_dict(model).items()
        )
    if not is_lora(model):
        return OrderedDict((k, _exported(v, dtype, snapshot)) for k, v in model.state_dict().items())
    base = model.get_base_model()
    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        if ".base_layer." not in key:
            out[key] = _exported(value, dtype, snapshot)
            continue
        module_name, _, leaf = key.partition(".base_layer.")
        name = f"{module_name}.{leaf}"
        if leaf == "weight":
            layer = base.get_submodule(module_name)
            merged = value.float() + layer.get_delta_weight(adapter).float()
            out[name] = _exported(merged.to(value.dtype), dtype, snapshot)
        else:
            out[name] = _exported(value, dtype, snapshot)
    return out


def trainable_state(model: torch.nn.Module) -> OrderedDict:
    """Trainable parameters by name (deduplicated: tied weights once), for checkpoints."""
    return OrderedDict((n, p.detach()) for n, p in model.named_parameters() if p.requires_grad)


@torch.no_grad()
def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a `trainable_state` snapshot back in place; names must match exactly."""
    params = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    missing, unexpected = set(params) - set(state), set(state) - set(params)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    for name, param in params.items():
        param.copy_(state[name].to(param.device, param.dtype))
