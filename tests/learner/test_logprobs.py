"""`model.token_logprobs` against a straightforward reference: full-length logits → log_softmax(logits / T)
→ gather, for logprobs, entropies and parameter gradients (full model, LoRA, a head with a bias), and
under FSDP2 (one rank, Gloo, CPU) where the head's parameters exist only inside the root's forward.
A micro-batch of one prompt's rows packed into one sequence (`collate_shared`: the prompt once) gives
what the whole rows give, for the same three models."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.learner.batching import MicroBatch, Sample, collate, collate_shared
from services.learner.config import LoraConfig
from services.learner.model import load_policy, token_logprobs


def samples() -> list[Sample]:
    """Rows of different prompt and completion lengths (right padding), temperatures 1, 0.7 and 1.6."""
    rows = [
        ((5, 9, 2), (7, 1, 33, 4, 8), 1.0),
        ((3, 4, 12, 60, 2, 11, 9), (21, 2), 0.7),
        ((40,), (6, 6, 50, 13, 2, 8, 19), 1.6),
        ((1, 2, 3, 4, 5, 6, 7, 8, 9), (63,), 0.7),
    ]
    return [Sample(p, c, (-4.0,) * len(c), 1.0, t) for p, c, t in rows]


def shared_samples() -> list[Sample]:
    """One prompt's completions: different lengths (one of a single token), temperatures 1 and 0.7, an
    environment span (context, masked)."""
    prompt = (5, 9, 2, 17, 30, 8)
    rows = [
        ((7, 1, 33, 4, 8), 1.0, ()),
        ((21, 2), 0.7, ()),
        ((6, 6, 50, 13, 2, 8, 19), 1.0, ((2, 4),)),
        ((63,), 0.7, ()),
    ]
    return [Sample(prompt, c, (-4.0,) * len(c), 1.0, t, spans) for c, t, spans in rows]


def reference(model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropies [B, T] from every position's logits, the textbook way."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    rows = torch.arange(logits.shape[0])[:, None]  # [B, 1]
    picked = logits.float()[rows, mb.positions] / mb.temperature[:, None, None]  # [B, T, V]
    logprobs_all = torch.log_softmax(picked, dim=-1)  # [B, T, V]
    logp = logprobs_all.gather(-1, mb.completion_ids[..., None]).squeeze(-1)  # [B, T]
    entropy = -(logprobs_all.exp() * logprobs_all).sum(-1).detach()  # [B, T]
    return logp, entropy


def run(fn, model: torch.nn.Module, mb: MicroBatch, weights: torch.Tensor):
    """Logprobs, entropies (masked) and the gradients of a weighted logprob sum, by trainable name."""
    model.zero_grad(set_to_none=True)
    logp, entropy = fn(model, mb)
    (logp * weights * mb.mask).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return logp.detach() * mb.mask, entropy * mb.mask, grads


def assert_matches_reference(model: torch.nn.Module) -> None:
    assert_rows_match_reference(model, collate(samples()), collate(samples()))
    # the prompt once, its keys and values every row's past: the whole rows' logprobs and gradients
    group = shared_samples()
    shared, whole = collate_shared(group), collate(group)
    assert shared.position_ids is not None and shared.mask.tolist() == whole.mask.tolist()
    assert_rows_match_reference(model, shared, whole)


def assert_rows_match_reference(model: torch.nn.Module, mb: MicroBatch, rows: MicroBatch) -> None:
    """token_logprobs on `mb` against the reference on `rows` (the same samples as whole rows)."""
    weights = torch.randn(mb.mask.shape, generator=torch.Generator().manual_seed(0))  # [B, T]
    logp, entropy, grads = run(lambda m, b: token_logprobs(m, b, with_entropy=True), model, mb, weights)
    ref_logp, ref_entropy, ref_grads = run(reference, model, rows, weights)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name  # every trainable parameter is reached
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-5, msg=name)


def test_logprobs_entropies_and_gradients_match_the_reference(micro_model_dir):
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32).train()
    assert_matches_reference(model)


def test_lora_logprobs_entropies_and_gradients_match_the_reference(micro_model_dir):
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    model = load_policy(str(micro_model_dir), torch.device("cpu"), lora)
    with torch.no_grad():  # LoRA B starts at zero: move it so the adapters change the logits
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
    assert_matches_reference(model.train())


def test_a_head_with_a_bias_divides_the_logits_and_matches_the_reference(micro_model_dir):
    # head(h / T) = logits / T only without a bias: a biased head must still give log_softmax(logits / T)
    model = AutoModelForCausalLM.from_pretrained(
        micro_model_dir, dtype=torch.float32, tie_word_embeddings=False
    ).train()
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.get_input_embeddings().weight)
        head.bias.normal_(0.0, 3.0, generator=torch.Generator().manual_seed(2))
    model.set_output_embeddings(head)
    assert_matches_reference(model)


def test_the_head_runs_only_on_completion_predicting_rows_and_the_hook_is_removed(micro_model_dir):
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32).eval()
    mb = collate(samples())
    seen: list[tuple[int, ...]] = []
    model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: seen.append(tuple(args[0].shape))
    )
    with torch.no_grad():
        token_logprobs(model, mb)
    assert seen == [(*mb.positions.shape, model.config.hidden_size)]  # [B, T, H], not [B, K, H]
    assert not model.get_decoder()._forward_hooks
    # the hook goes even when the forward fails
    with pytest.raises(IndexError), torch.no_grad():
        token_logprobs(model, collate([Sample((1,), (64,), (-1.0,), 1.0)]))  # id 64 ∉ vocab 64
    assert not model.get_decoder()._forward_hooks


def test_fsdp2_sharded_model_gives_the_unsharded_logprobs(micro_model_dir, tmp_path):
    # one rank: every parameter (the root's embeddings / tied head too) is a DTensor outside the
    # forward, so calling the head or the decoder outside the root's forward would fail here
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32).train()
    mb = collate(samples())
    weights = torch.randn(mb.mask.shape, generator=torch.Generator().manual_seed(0))  # [B, T]
    ref_logp, ref_entropy, ref_grads = run(reference, model, mb, weights)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        logp, entropy, grads = run(lambda m, b: token_logprobs(m, b, with_entropy=True), model, mb, weights)
        torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad.full_tensor(), ref_grads[name], rtol=0, atol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()
