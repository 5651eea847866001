"""The learner logprobs a TrainStep returns: those of the weights the step started from, per completion
in the batch's order, for every completion token (environment turns included), and collecting them
changes nothing in the loss or the gradients."""

from __future__ import annotations

import pytest
import torch

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.clients import open_channel
from services.common.serve import start_server
from services.learner.config import LearnerSettings
from services.learner.server import LearnerApp
from services.learner.trainer import Trainer
from tests.learner.test_learner_grpc import make_batch, vocab_of

TIMEOUT = 30.0
MODEL, ENV = types_pb2.TURN_SOURCE_MODEL, types_pb2.TURN_SOURCE_ENV


@pytest.fixture
async def stub(model_dir):
    # a small token budget: the batch's six completions go in several micro-batches, sorted by length
    settings = LearnerSettings.load(
        model=str(model_dir), device="cpu", dtype="float32", port=0, optim={"lr": 1e-2},
        micro_batch_tokens=16, grace_seconds=1.0,
    )  # fmt: skip
    running = await start_server(LearnerApp(settings), settings)
    channel = open_channel(running.address)
    try:
        yield learner_pb2_grpc.LearnerServiceStub(channel)
    finally:
        await channel.close()
        await running.close()


def _multi_turn(batch: types_pb2.TrainBatch, vocab: int) -> None:
    """The last completion becomes an episode: model 0-2, environment 2-4 (logprobs 0), model 4-6, at
    temperature 0.7."""
    completion = batch.groups[-1].completions[-1]
    completion.completion_token_ids[:] = [(11 * j + 3) % vocab for j in range(6)]
    completion.logprobs[:] = [-5.0, -5.0, 0.0, 0.0, -5.0, -5.0]
    completion.sampling_params.temperature = 0.7
    for source, start, end in ((MODEL, 0, 2), (ENV, 2, 4), (MODEL, 4, 6)):
        completion.turns.add(source=source, start=start, end=end)


async def test_train_step_returns_the_logprobs_of_the_weights_it_started_from(stub, model_dir):
    vocab = vocab_of(model_dir)
    batch = make_batch(vocab)
    _multi_turn(batch, vocab)
    completions = [(g, c) for g in batch.groups for c in g.completions]
    before = []
    for _, c in completions:  # the current weights' scores, before the step changes them
        sequence = types_pb2.TokenSequence(
            prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.completion_token_ids,
            temperature=c.sampling_params.temperature,
        )  # fmt: skip
        scores = await stub.ScoreTokens(learner_pb2.ScoreTokensRequest(sequence=sequence), timeout=TIMEOUT)
        before.append(list(scores.logprobs))

    response = await stub.TrainStep(learner_pb2.TrainStepRequest(batch=batch), timeout=TIMEOUT)
    assert response.result.metrics["micro_batches"] >= 2  # rows come back from several passes, unsorted
    returned = [list(c.logprobs) for c in response.completion_logprobs]
    assert [len(lp) for lp in returned] == [len(c.completion_token_ids) for _, c in completions]
    assert len(returned[-1]) == 6  # the episode's environment tokens have theirs too
    for expected, got in zip(before, returned, strict=True):
        assert got == pytest.approx(expected, abs=1e-5)
    # the step changed the weights: a score now differs, so the comparison above is not vacuous
    c = completions[0][1]
    sequence = types_pb2.TokenSequence(
        prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.completion_token_ids, temperature=1.0
    )
    after = list((await stub.ScoreTokens(learner_pb2.ScoreTokensRequest(sequence=sequence))).logprobs)
    assert max(abs(a - b) for a, b in zip(after, returned[0], strict=True)) > 1e-4

    # a retry of the batch is answered with the same step's logprobs
    again = await stub.TrainStep(learner_pb2.TrainStepRequest(batch=batch), timeout=TIMEOUT)
    assert again.result.weight_version == 1
    assert [list(c.logprobs) for c in again.completion_logprobs] == returned


def test_collecting_the_logprobs_leaves_loss_and_gradients_bit_identical(micro_model_dir, make_samples):
    settings = LearnerSettings(model=str(micro_model_dir), device="cpu", micro_batch_tokens=24)
    trainer = Trainer(settings)
    samples = make_samples(9, seed=3)
    runs = []
    for collect in (None, {}):
        trainer.optimizer.zero_grad(set_to_none=True)
        metrics = trainer.accumulate_gradients(samples, logprobs=collect)
        grads = [p.grad.clone() for p in trainer.params]
        runs.append((metrics, grads, collect))
    (plain, plain_grads, _), (collected, grads, logprobs) = runs
    assert plain["micro_batches"] >= 3
    assert plain == collected  # every figure, the loss included, exactly
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))
    assert sorted(logprobs) == list(range(len(samples)))
    for index, sample in enumerate(samples):
        assert logprobs[index].dtype == torch.float32
        assert logprobs[index].shape == (len(sample.completion_ids),)
        assert logprobs[index].tolist() == pytest.approx(trainer.score(sample), abs=1e-5)


def test_train_step_outcome_lists_one_tensor_per_sample_in_batch_order(micro_model_dir, make_samples):
    trainer = Trainer(LearnerSettings(model=str(micro_model_dir), device="cpu", micro_batch_tokens=24))
    samples = make_samples(7, seed=5)
    expected = [trainer.score(s) for s in samples]
    outcome = trainer.train_step(samples, "b0")
    assert len(outcome.logprobs) == len(samples)
    for got, want in zip(outcome.logprobs, expected, strict=True):
        assert got.tolist() == pytest.approx(want, abs=1e-5)
