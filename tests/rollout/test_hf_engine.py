"""The transformers engine directly: batching of mixed sampling params, truncated (processed)
logprobs, stop strings, and what runs between decode slices: weight loads (the rows in flight
re-prefilled under the new weights, with a new version span), scoring, and samples joining."""

from __future__ import annotations

import asyncio
import copy
import threading
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


class _Paused:
    """Holds the engine thread after the first decode slice until `go` is set: what the test queues on
    the engine meanwhile runs right after that slice (the engine's one thread takes work in order)."""

    def __init__(self, engine: HfEngine) -> None:
        self.first_slice, self.go, self.batch_sizes = threading.Event(), threading.Event(), []
        decode = engine._decode

        def paused(batch, slice_s):
            stale = decode(batch, slice_s)
            self.batch_sizes.append(len(batch.rows))
            if not self.first_slice.is_set():
                self.first_slice.set()
                self.go.wait(30)
            return stale

        engine._decode = paused

    async def after_first_slice(self) -> None:
        assert await asyncio.to_thread(self.first_slice.wait, 30)


@pytest.fixture
async def sliced(tiny_model_dir: Path):
    """An engine whose slices are one token long (slice_ms below one decode step)."""
    settings = RolloutSettings(
        model=str(tiny_model_dir),
        max_model_len=128,
        hf={"max_batch_size": 16, "num_threads": 1, "slice_ms": 1e-6},
    )
    eng = HfEngine(settings)
    await eng.start()
    yield eng
    await eng.stop()


def _load_plan(engine: HfEngine, state: dict, monkeypatch: pytest.MonkeyPatch):
    """`engine.load_weights` arguments that copy `state` in (the transport's half replaced)."""
    from contextlib import contextmanager

    from services.common import weights
    from services.rollout import hf_engine
    from services.transports import LoadPlan, TransportKind

    entries = weights.plan_layout(state)
    packed = torch.zeros(weights.packed_size(entries), dtype=torch.uint8)
    weights.pack_range(state, entries, 0, packed)

    @contextmanager
    def views(plan, tensors, worker):
        yield weights.tensor_views(packed, tensors)

    monkeypatch.setattr(hf_engine, "open_tensors", views)
    plan = LoadPlan(TransportKind.shared_memory, {"version": 1}, zero_copy=False)
    return plan, weights.build_manifest(state, memoryview(packed.numpy()))


async def test_a_weight_load_lands_between_slices_and_the_rows_continue_under_it(
    sliced: HfEngine, reference_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    new_model = copy.deepcopy(reference_model)
    with torch.no_grad():
        for parameter in new_model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    plan, manifest = _load_plan(sliced, dict(new_model.state_dict()), monkeypatch)
    paused = _Paused(sliced)
    sliced._eos = set()  # run to max_tokens: the switch must fall inside the completion
    prompt, sampling = [5, 6, 7], Sampling(n=2, temperature=1.0, top_k=5, max_tokens=12, seed=7)
    generation = asyncio.create_task(_collect(sliced, prompt, sampling, "long"))
    await paused.after_first_slice()
    load = asyncio.create_task(sliced.load_weights(plan, manifest, version=1))
    await asyncio.sleep(0.05)  # load_weights is queued on the engine's thread, behind the slice
    paused.go.set()
    await load
    assert not generation.done()  # the load did not wait for the batch
    for c in await generation:
        assert [(s.version, s.start, s.end) for s in c.version_spans] == [(0, 0, 1), (1, 1, 12)]
        old = _processed_reference(reference_model, prompt, list(c.token_ids), 1.0, 5)
        new = _processed_reference(new_model, prompt, list(c.token_ids), 1.0, 5)
        assert torch.allclose(torch.tensor(c.logprobs[:1]), old[:1], atol=1e-4)
        assert torch.allclose(torch.tensor(c.logprobs[1:]), new[1:], atol=1e-4)  # re-prefilled, then on
        assert not torch.allclose(old[1:], new[1:], atol=1e-3)  # the weights did change


async def test_scoring_waits_for_one_slice_not_for_the_batch(sliced: HfEngine) -> None:
    paused = _Paused(sliced)
    sliced._eos = set()
    generation = asyncio.create_task(_collect(sliced, [5, 6], Sampling(n=2, max_tokens=40), "long"))
    await paused.after_first_slice()
    score = asyncio.create_task(sliced.score_tokens([5, 6], [7, 8, 9], 1.0))
    await asyncio.sleep(0.05)
    paused.go.set()
    assert len(await score) == 3
    assert not generation.done()
    assert len(await generation) == 2


async def test_samples_that_arrive_mid_batch_join_it(sliced: HfEngine) -> None:
    paused = _Paused(sliced)
    sliced._eos = set()
    first = asyncio.create_task(_collect(sliced, [5, 6], Sampling(n=2, max_tokens=20), "first"))
    await paused.after_first_slice()
    second = asyncio.create_task(_collect(sliced, [9, 10, 11], Sampling(n=3, max_tokens=5), "second"))
    await asyncio.sleep(0.05)  # its samples are queued
    paused.go.set()
    done, _ = await asyncio.wait([first, second], return_when=asyncio.FIRST_COMPLETED)
    assert done == {second}  # joined the running batch instead of waiting for it to finish
    assert len(await second) == 3 and len(await first) == 2
    assert paused.batch_sizes[0] == 2 and 5 in paused.batch_sizes
