"""Sparse deltas over the nccl transport (services/transports/nccl_delta.py), Gloo on CPU, for real: the
learner's sender in this process, receivers as threads (`test_nccl.ThreadWorkers`). Every version a
rollout loads must equal the learner's state bit for bit, whichever way it travelled."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common import weight_delta
from services.common.errors import DataLoss, InvalidArgument
from services.transports import Receiver
from services.transports import registry as transports
from tests.transports.test_nccl import NCCL, ThreadWorkers, _ctx, _sync

pytestmark = pytest.mark.timeout(120)


def _bf16_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 48, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.randn(48, generator=generator).to(torch.bfloat16),
        "lm_head.weight": torch.randn(64, 48, generator=generator).to(torch.bfloat16),
    }


def _stepped(state: dict[str, torch.Tensor], seed: int, share: float = 0.02) -> dict[str, torch.Tensor]:
    """`state` with about `share` of its elements changed (what one small optimizer step does in bf16)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        changed = torch.rand(tensor.shape, generator=generator) < share
        out[name] = torch.where(changed, tensor * 1.5 + 0.25, tensor)
    return out


def _assert_loaded(workers: ThreadWorkers, staged, state: dict[str, torch.Tensor]) -> None:
    assert not isinstance(staged, BaseException), staged
    loaded = workers.load(staged)
    for name, tensor in state.items():
        assert torch.equal(loaded[name].view(torch.int16), tensor.view(torch.int16)), name


async def test_versions_after_the_first_travel_as_deltas_and_rebuild_the_learners_bytes_exactly() -> None:
    ctx = _ctx()
    rollouts = {"a": ThreadWorkers(1), "b": ThreadWorkers(2)}
    state = _bf16_state()
    prepared, target, staged = await _sync(ctx, state, 1, rollouts)
    assert not prepared.error and target.descriptor.bucket_deltas == ()  # nothing to diff against yet
    total = target.manifest.total_bytes
    assert [s.received_bytes for s in staged] == [total, total]

    for version in (2, 3, 4):
        state = _stepped(state, version)
        prepared, target, staged = await _sync(ctx, state, version, rollouts)
        assert not prepared.error, prepared.error
        d = target.descriptor
        assert d.delta_base.startswith(f"{version - 1}:") and len(d.bucket_deltas) == len(
            target.manifest.buckets
        )
        assert {b.encoding for b in d.bucket_deltas} - {weight_delta.Encoding.FULL}  # some bucket is a delta
        sent = sum(b.payload_bytes for b in d.bucket_deltas)
        assert 0 < sent < total / 2
        for rid, result in zip(rollouts, staged, strict=True):
            assert result.received_bytes == sent, rid
            _assert_loaded(rollouts[rid], result, state)

    # a version with nothing changed: every bucket's delta is empty, nothing crosses the group
    prepared, target, staged = await _sync(ctx, state, 5, rollouts)
    assert sum(b.payload_bytes for b in target.descriptor.bucket_deltas) == 0
    assert [s.received_bytes for s in staged] == [0, 0]
    _assert_loaded(rollouts["a"], staged[0], state)


async def test_a_member_without_the_base_gets_every_bucket_whole_and_so_does_everyone() -> None:
    ctx = _ctx()
    rollouts = {"a": ThreadWorkers(1)}
    state = _bf16_state()
    await _sync(ctx, state, 1, rollouts)
    rollouts["new"] = ThreadWorkers(1)  # holds nothing: the broadcast must be whole for the group
    state = _stepped(state, 2)
    _, target, staged = await _sync(ctx, state, 2, rollouts)
    assert target.descriptor.bucket_deltas  # the learner had deltas ready ...
    total = target.manifest.total_bytes
    assert [s.received_bytes for s in staged] == [total, total]  # ... and sent it whole
    for rid, result in zip(rollouts, staged, strict=True):
        _assert_loaded(rollouts[rid], result, state)
    state = _stepped(state, 3)  # now both hold version 2: deltas again
    _, target, staged = await _sync(ctx, state, 3, rollouts)
    assert all(0 < s.received_bytes < total for s in staged)
    _assert_loaded(rollouts["new"], staged[1], state)


async def test_a_delta_over_the_wrong_base_is_data_loss_and_the_next_broadcast_is_whole() -> None:
    ctx = _ctx()
    rollouts = {"a": ThreadWorkers(1), "b": ThreadWorkers(1)}
    state = _bf16_state()
    await _sync(ctx, state, 1, rollouts)
    # b's buffer no longer holds version 1's bytes, though it still says it does
    receiver = rollouts["b"].workers[0].state["nccl"]
    receiver.buffer[:64] += 1
    state2 = _stepped(state, 2)
    prepared, target, staged = await _sync(ctx, state2, 2, rollouts)
    assert target.descriptor.bucket_deltas and not isinstance(staged[0], BaseException)
    _assert_loaded(rollouts["a"], staged[0], state2)
    assert isinstance(staged[1], DataLoss) and "checksum mismatch" in str(staged[1]), staged[1]
    assert receiver.holds == ""  # it knows its buffer holds no version now

    # the retry (the same version prepared again): b holds nothing, so the group gets it whole
    prepared, target, staged = await _sync(ctx, state2, 2, rollouts)
    assert not prepared.error
    assert [s.received_bytes for s in staged] == [target.manifest.total_bytes] * 2
    for rid, result in zip(rollouts, staged, strict=True):
        _assert_loaded(rollouts[rid], result, state2)


async def test_fp32_versions_and_a_learner_with_deltas_off_send_whole_buckets() -> None:
    rollouts = {"a": ThreadWorkers(1)}
    fp32 = {name: t.float() for name, t in _bf16_state().items()}
    ctx = _ctx()
    for version in (1, 2):
        _, target, staged = await _sync(ctx, fp32, version, rollouts)
        assert target.descriptor.bucket_deltas == () and ctx.state["nccl"].base is None
        assert staged[0].received_bytes == target.manifest.total_bytes
    off = dataclasses.replace(_ctx(), delta=False)
    state = _bf16_state()
    for version in (1, 2):
        state = _stepped(state, version)
        _, target, staged = await _sync(off, state, version, rollouts)
        assert target.descriptor.bucket_deltas == () and off.state["nccl"].base is None
        _assert_loaded(rollouts["a"], staged[0], state)


def test_a_descriptor_whose_deltas_do_not_fit_its_buckets_is_refused() -> None:
    ctx = _ctx()
    receivers = (Receiver("a", "1", 1),)
    state = _bf16_state()
    NCCL.prepare(1, state, ctx, receivers).close()
    prepared = NCCL.prepare(2, _stepped(state, 2), ctx, receivers)
    message = transports.describe(prepared)
    prepared.close()
    assert message.delta_base_version == 1 and len(message.nccl.bucket_deltas) == len(message.buckets)
    transports.target_from_proto(message)  # as sent: accepted

    def refused(edit, match: str) -> None:
        bad = type(message).FromString(message.SerializeToString())
        edit(bad)
        with pytest.raises(InvalidArgument, match=match):
            transports.target_from_proto(bad)

    refused(lambda m: m.nccl.bucket_deltas.pop(), "entries for")
    refused(lambda m: setattr(m.nccl.bucket_deltas[0], "encoding", 9), "unknown encoding 9")
    refused(lambda m: setattr(m.nccl.bucket_deltas[0], "encoding", 0), "a whole bucket of")
    refused(lambda m: setattr(m.nccl.bucket_deltas[0], "payload_bytes", 1 << 40), "only when smaller")
    refused(lambda m: m.ClearField("delta_base_digest"), "need delta_base_version and delta_base_digest")
