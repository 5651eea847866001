"""The transformers engine directly: batching of mixed sampling params, truncated (processed)
logprobs, stop strings, and that loads happen between batches."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.common.errors import FailedPrecondition
from services.rollout.config import RolloutSettings
from services.rollout.engine import FINISH_LENGTH, FINISH_STOP, Sampling
from services.rollout.hf_engine import HfEngine, _Row


@pytest.fixture
async def engine(tiny_model_dir: Path):
    settings = RolloutSettings(
        model=str(tiny_model_dir), max_model_len=128, hf={"max_batch_size": 16, "num_threads": 1}
    )
    eng = HfEngine(settings)
    await eng.start()
    yield eng
    await eng.stop()


async def _collect(eng: HfEngine, prompt: list[int], sampling: Sampling, rid: str):
    return [c async for finished in eng.generate(prompt, sampling, rid) for c in finished]


@torch.inference_mode()
def _processed_reference(model, prompt: list[int], completion: list[int], temperature: float, top_k: int):
    """log_softmax over the top-k of logits / T, at each completion position. [C]"""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # [C, V]
    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [C, 1]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


async def test_mixed_requests_batch_together_with_their_own_params(engine: HfEngine, reference_model) -> None:
    requests = [
        ([5, 6, 7], Sampling(n=2, temperature=0.7, top_k=5, max_tokens=9)),
        ([8, 9, 10, 11, 12, 13, 14], Sampling(n=3, temperature=1.3, top_k=3, max_tokens=6)),
        ([20], Sampling(n=1, temperature=1.0, top_k=8, max_tokens=12)),
    ]
    results = await asyncio.gather(*(_collect(engine, p, s, f"r{i}") for i, (p, s) in enumerate(requests)))
    for (prompt, sampling), completions in zip(requests, results, strict=True):
        assert sorted(c.index for c in completions) == list(range(sampling.n))
        for c in completions:
            assert len(c.token_ids) <= sampling.max_tokens
            assert c.finish_reason == (
                FINISH_LENGTH if len(c.token_ids) == sampling.max_tokens else FINISH_STOP
            )
            ref = _processed_reference(
                reference_model, prompt, list(c.token_ids), sampling.temperature, sampling.top_k
            )
            assert torch.isfinite(ref).all()  # every sampled token is inside the top-k
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


async def test_completions_finished_by_one_batch_arrive_in_one_list(engine: HfEngine) -> None:
    sampling = Sampling(n=4, temperature=1.0, max_tokens=5, seed=3)
    messages = [finished async for finished in engine.generate([5, 6, 7], sampling, "together")]
    assert [sorted(c.index for c in finished) for finished in messages] == [[0, 1, 2, 3]]


async def test_stop_strings_end_the_completion_and_trim_the_text(engine: HfEngine) -> None:
    tokenizer = engine._tokenizer
    row = _Row([1], Sampling(stop=("+",), max_tokens=50), 0, asyncio.Queue(), None)
    for token in tokenizer("12+34", add_special_tokens=False)["input_ids"]:
        row.tokens.append(token)
        if engine._check_stop(row):
            break
    assert row.finish == FINISH_STOP and row.text == "12"
    assert tokenizer.decode(row.tokens) == "12+"


async def test_seeded_samples_differ_by_index_and_repeat_across_calls(engine: HfEngine) -> None:
    sampling = Sampling(n=3, temperature=1.0, max_tokens=10, seed=42)
    first = {c.index: c.token_ids for c in await _collect(engine, [3, 4], sampling, "a")}
    second = {c.index: c.token_ids for c in await _collect(engine, [3, 4], sampling, "b")}
    assert first == second
    assert len(set(first.values())) > 1


async def test_context_length_defaults_to_the_models_own_limit(tiny_model_dir: Path) -> None:
    derived = HfEngine(RolloutSettings(model=str(tiny_model_dir), hf={"num_threads": 1}))
    await derived.start()
    try:
        assert derived.max_model_len == 512  # the tiny model's max_position_embeddings
    finally:
        await derived.stop()
    too_long = HfEngine(RolloutSettings(model=str(tiny_model_dir), max_model_len=2048))
    with pytest.raises(FailedPrecondition, match="exceeds the model's 512 positions"):
        await too_long.start()
    await too_long.stop()


async def test_borrowed_weights_are_copied_out_before_the_lender_reuses_its_buffer(
    engine: HfEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cuda_ipc's zero-copy load makes the parameters views of the learner's staging buffer, which the
    # learner rewrites two versions later. cuda_ipc needs a GPU, so here the engine's real adopt path
    # gets views of a CPU "lender" buffer (same dtype and device as the model, as cuda_ipc guarantees):
    # writes to it show through until own_weights() copies the weights out.
    from contextlib import contextmanager

    from services.common import weights
    from services.rollout import hf_engine
    from services.transports import LoadPlan, TransportKind

    state = {k: v.detach().clone() for k, v in engine._model.state_dict().items()}
    entries = weights.plan_layout(state)
    lender = torch.zeros(weights.packed_size(entries), dtype=torch.uint8)
    weights.pack_range(state, entries, 0, lender)
    manifest = weights.build_manifest(state, memoryview(lender.numpy()))

    @contextmanager
    def lend(plan, tensors, worker):
        yield weights.tensor_views(lender, tensors)

    monkeypatch.setattr(hf_engine, "open_tensors", lend)
    plan = LoadPlan(TransportKind.cuda_ipc, {"version": 1}, zero_copy=True)
    await engine.load_weights(plan, manifest, version=1)
    entry = next(e for e in manifest.tensors if e.name.endswith("q_proj.weight"))
    first = lender[entry.offset : entry.offset + 4].view(torch.float32)
    live = lambda: engine._model.state_dict()[entry.name].flatten()[0].item()  # noqa: E731
    first[0] = 123.0  # the learner packing version 3 into the same buffer
    assert live() == 123.0  # borrowed: the rollout's weights changed under it

    await engine.own_weights()
    first[0] = -7.0
    assert live() == 123.0  # its own copy now
    for key, tensor in engine._model.state_dict().items():
        if key != entry.name:
            assert torch.equal(tensor, state[key]), key
    await engine.own_weights()  # idempotent: nothing borrowed any more
    assert live() == 123.0
