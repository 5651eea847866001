"""The policy model: loading (full or LoRA), token logprobs, and weight export in HF names.

Logprob convention (shared with the rollout): the logprob of completion token t is
log_softmax(logits / T) at the position that predicts it, computed in fp32, i.e. vLLM's
"processed" logprobs with temperature-only sampling.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
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


def unavailable(device: torch.device) -> str | None:
    """Why the learner cannot run on `device` on this machine (None: it can)."""
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type)  # the validated names (config.DEVICE): cuda, mps, xpu
    if not backend.is_available():
        return f"no {device.type} device is available here (torch {torch.__version__})"
    if device.index is not None and device.index >= backend.device_count():
        return f"{device} does not exist here: {backend.device_count()} {device.type} device(s)"
    return None


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


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack whose output feeds the LM head (the base model's, for a LoRA model)."""
    base = model.get_base_model() if is_lora(model) else model
    return base.get_decoder()


def _temperature_on_hidden(model: torch.nn.Module) -> bool:
    """Whether logits / T == head(hidden / T) exactly: a linear head without a bias (LoRA on the head
    keeps it linear) and no non-linear cap on the logits."""
    head = model.get_output_embeddings()
    head = getattr(head, "base_layer", head)  # a LoRA-wrapped head: its bias is the base layer's
    config = (model.get_base_model() if is_lora(model) else model).config
    return (
        isinstance(head, torch.nn.Linear)
        and head.bias is None
        and getattr(config, "final_logit_softcapping", None) is None
    )


def token_logprobs(
    model: torch.nn.Module, mb: MicroBatch, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of the completion tokens [B, T] (and entropies [B, T], detached) under `model`.

    The LM head runs only on the hidden states of the positions that predict completion tokens: a
    forward hook on the decoder stack replaces its output's `last_hidden_state` [B, L, H] by those
    rows [B, T, H] (divided by the temperature when the head is bias-free and linear, so that
    head(h / T) = logits / T; else the logits are divided), and the model's own forward, with
    `logits_to_keep=0`, maps all of them to [B, T, V]. The head is thus called inside the root
    module's forward (as FSDP2 needs, which un-shards the root's parameters only there), and no
    prompt position's logits are computed. logp = logit[token] - logsumexp(logits), a selective
    log-softmax (`_SelectiveLogSoftmax`): no [B, T, V] log_softmax or gather graph is built.

    A packed micro-batch (`batching.collate_shared`: one prompt's rows in one sequence [1, N]) goes in
    with its position ids and its [1, 1, N, N] attention mask; the hook picks each row's positions out
    of the one sequence.
    """
    positions, temperature = mb.positions, mb.temperature  # [B, T], [B]
    on_hidden = _temperature_on_hidden(model)
    packed = {} if mb.position_ids is None else {"position_ids": mb.position_ids}  # [1, N]

    def gather_rows(module: torch.nn.Module, args: object, output: object) -> object:
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state  # [B, L, H]
        hidden = hidden.expand(positions.shape[0], -1, -1)  # packed: [1, N, H] -> [B, N, H], a view
        index = positions[..., None].expand(-1, -1, hidden.shape[-1])  # [B, T, H]
        picked = hidden.gather(1, index)  # [B, T, H]; padding slots pick position 0 (masked later)
        if on_hidden:
            picked = picked / temperature[:, None, None].to(picked.dtype)
        if isinstance(output, tuple):
            return (picked, *output[1:])
        output.last_hidden_state = picked
        return output

    handle = _decoder(model).register_forward_hook(gather_rows)
    try:
        logits = model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            use_cache=False,
            logits_to_keep=0,
            **packed,
        ).logits  # [B, T, V]: logits[:, t] at positions[:, t]
    finally:
        handle.remove()
    logits = logits.float()  # [B, T, V]
    if not on_hidden:
        logits = logits / temperature[:, None, None]
    logp, entropy = _SelectiveLogSoftmax.apply(logits, mb.completion_ids, with_entropy)  # [B, T]
    return logp, entropy if with_entropy else None


class _SelectiveLogSoftmax(torch.autograd.Function):
    """logp = logits[token] - logsumexp(logits) per row [B, T] (and, if asked, the entropy [B, T],
    not differentiable) without a [B, T, V] log_softmax: the only [B, T, V] tensor kept for backward
    is softmax(logits), and backward is one pass, d logp / d logits = onehot(token) - softmax."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool):
        peak = logits.amax(-1, keepdim=True)  # [B, T, 1]
        shifted = logits - peak  # [B, T, V], <= 0
        picked = shifted.gather(-1, ids[..., None]).squeeze(-1)  # [B, T]
        probs = shifted.exp() if with_entropy else shifted.exp_()  # [B, T, V], not yet normalised
        total = probs.sum(-1, keepdim=True)  # [B, T, 1]
        probs.div_(total)  # [B, T, V]
        log_total = total.log().squeeze(-1)  # [B, T]
        logp = picked - log_total  # [B, T]
        entropy = log_total.new_empty(0)  # unless asked
        if with_entropy:  # H = log Σ exp(shifted) - E_p[shifted]: no cancellation of large logits
            entropy = log_total - torch.linalg.vecdot(probs, shifted)  # [B, T]
        ctx.save_for_backward(probs, ids)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        probs, ids = ctx.saved_tensors
        grad = probs * -grad_logp[..., None]  # [B, T, V]
        grad.scatter_add_(-1, ids[..., None], grad_logp[..., None])  # + onehot(token) · grad
        return grad, None, None


def _exported(tensor: torch.Tensor, dtype: torch.dtype | None, snapshot: bool) -> torch.Tensor:
    """A CPU copy (snapshot), or the tensor itself where it lives (dtype-converted only if asked)."""
    out = tensor.detach().to("cpu", copy=True) if snapshot else tensor.detach()
    return out.to(dtype) if dtype is not None and out.is_floating_point() else out


@torch.no_grad()
def export_state(
    model: torch.nn.Module,
    fmt: str = "full",
    dtype: torch.dtype | None = None,
    snapshot: bool = True,
    state: Mapping[str, torch.Tensor] | None = None,
) -> OrderedDict:
    """Weights to send to rollouts: CPU copies (a stable snapshot), or with `snapshot=False` the model's
    own tensors on their device without a copy (merged LoRA weights are new tensors either way).
    `state`: the model's `state_dict()` entries as whole tensors when the model's own are shards (a
    sharded learner gathers them first: `sharding.full_state`); the model then only names its layers.

    full:    every `state_dict()` entry in HF names (tied lm_head included); for a LoRA model the
             adapters are merged into their base weights (W + B·A·α/r) without touching the model,
             and the `base_model.model.` prefix / `.base_layer` infix / lora tensors are dropped.
    adapter: only the LoRA tensors, in PEFT's adapter-file names.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}")
    tensors = model.state_dict() if state is None else state
    if fmt == "adapter":
        if not is_lora(model):
            raise ValueError("adapter export needs a LoRA model")
        from peft import get_peft_model_state_dict

        adapter_state = get_peft_model_state_dict(model, state_dict=dict(tensors))
        return OrderedDict((k, _exported(v, dtype, snapshot)) for k, v in adapter_state.items())
    if not is_lora(model):
        return OrderedDict((k, _exported(v, dtype, snapshot)) for k, v in tensors.items())
    base = model.get_base_model()
    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for full_key, value in tensors.items():
        key = full_key.removeprefix(PEFT_PREFIX)
        if ".lora_" in key:
            continue
        if ".base_layer." not in key:
            out[key] = _exported(value, dtype, snapshot)
            continue
        module_name, _, leaf = key.partition(".base_layer.")
        name = f"{module_name}.{leaf}"
        if leaf == "weight":
            delta = _lora_delta(base.get_submodule(module_name), adapter, tensors, PEFT_PREFIX + module_name)
            out[name] = _exported((value.float() + delta).to(value.dtype), dtype, snapshot)
        else:
            out[name] = _exported(value, dtype, snapshot)
    return out


PEFT_PREFIX = "base_model.model."  # a PEFT model's state_dict names: this + the base model's


def _lora_delta(
    layer: torch.nn.Module, adapter: str, tensors: Mapping[str, torch.Tensor], name: str
) -> torch.Tensor:
    """B·A·scaling of LoRA layer `name` (PEFT's `get_delta_weight`, from `tensors`), in fp32."""
    lora_a = tensors[f"{name}.lora_A.{adapter}.weight"].float()  # [r, in]
    lora_b = tensors[f"{name}.lora_B.{adapter}.weight"].float()  # [out, r]
    delta = (lora_b @ lora_a) * layer.scaling[adapter]  # [out, in]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


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
