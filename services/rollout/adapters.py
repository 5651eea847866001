"""LoRA adapter versions on a transformers model, with peft (the transformers engine's side).

A weight version whose manifest carries `adapter` (WeightVersion.adapter) holds only peft's adapter
tensors (`base_model.model.<module>.lora_A.weight`, `.lora_B.weight`), as the learner exports them.
The engine keeps the base model it started with and serves the adapter over it: the first adapter
version wraps the model in a peft LoRA model of that rank, alpha and target modules, and each version
then overwrites the adapter's tensors in place (the base weights never change). A version with another
rank or other modules re-wraps; a whole (merged) version after adapters unwraps first, so the names
are the base model's again. Nothing here awaits: the engine calls it on its model thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from services.common.errors import FailedPrecondition
from services.common.weights import LoraSpec, Manifest

ADAPTER_NAME = "default"  # peft's; the learner's export drops it from the names
PEFT_PREFIX = "base_model.model."  # a peft model's names: this + the base model's


def is_wrapped(model: Any) -> bool:
    """Whether `model` is a peft model (an adapter version is loaded)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def base_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """The base model's state_dict names and shapes, as a whole version names them (for a wrapped
    model: without the LoRA tensors and peft's `.base_layer` infix)."""
    base = model.get_base_model() if is_wrapped(model) else model
    return {
        name.replace(".base_layer.", "."): tuple(t.shape)
        for name, t in base.state_dict().items()
        if ".lora_" not in name
    }


def unwrapped(model: Any) -> Any:
    """The base model with the LoRA layers removed (nothing merged): what a whole version loads into."""
    return model.unload() if is_wrapped(model) else model


def wrapped(model: Any, spec: LoraSpec) -> Any:
    """`model` as a peft LoRA model of `spec` (B = 0: it computes as the base until a version loads)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=list(spec.target_modules)
    )
    return get_peft_model(unwrapped(model), config, adapter_name=ADAPTER_NAME).eval()


def adapter_shapes(model: Any, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """The adapter tensors of `spec` over `model` (wrapped or not; nothing is changed), in the
    learner's export names, with their shapes: lora_A [rank, in] and lora_B [out, rank] for every
    linear layer whose name is a target module or ends with `.` + one (peft's rule for a list)."""
    base = model.get_base_model() if is_wrapped(model) else model
    shapes: dict[str, tuple[int, ...]] = {}
    for name, module in base.named_modules():
        layer = getattr(module, "base_layer", module)  # a wrapped model's LoRA layer holds the linear
        if ".lora_" in name or name.endswith(".base_layer") or not isinstance(layer, torch.nn.Linear):
            continue
        if any(name == t or name.endswith(f".{t}") for t in spec.target_modules):
            shapes[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (spec.rank, layer.in_features)
            shapes[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (layer.out_features, spec.rank)
    return shapes


def check_adapter(model: Any, manifest: Manifest, version: int) -> None:
    """The version's tensors are exactly its adapter's over `model`, shape for shape
    (FailedPrecondition before any weight is touched)."""
    assert manifest.adapter is not None
    expected = adapter_shapes(model, manifest.adapter)
    if not expected:
        modules = list(manifest.adapter.target_modules)
        raise FailedPrecondition(f"adapter v{version}: none of its target modules {modules} is a linear "
                                 "layer of this model")  # fmt: skip
    check_layout(manifest, expected, f"adapter v{version}")


def check_layout(manifest: Manifest, expected: dict[str, tuple[int, ...]], label: str) -> None:
    """The version's tensors are exactly `expected`'s names, shape for shape (FailedPrecondition)."""
    names = {t.name for t in manifest.tensors}
    if names != set(expected):
        raise FailedPrecondition(
            f"{label} does not match the model: missing {sorted(set(expected) - names)[:5]}, "
            f"unexpected {sorted(names - set(expected))[:5]}"
        )
    for t in manifest.tensors:
        if tuple(t.shape) != expected[t.name]:
            raise FailedPrecondition(
                f"{label}: {t.name} has shape {list(t.shape)}, the model {list(expected[t.name])}"
            )


def load_adapter(model: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy the adapter tensors into the wrapped `model`'s LoRA layers (cast to their dtype)."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, dict(tensors), adapter_name=ADAPTER_NAME)
    missed = [k for k in result.unexpected_keys if ".lora_" in k]
    if missed:  # `check_adapter` ran first: only a peft that names its tensors otherwise gets here
        raise FailedPrecondition(f"peft did not take adapter tensors {missed[:5]}")
