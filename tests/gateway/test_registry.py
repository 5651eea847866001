"""The generation registry: exact lookups, its bounds (LRU, TTL), claims, identical generations."""

from __future__ import annotations

import tracemalloc

import pytest

from grpo.common.v1 import types_pb2
from services.gateway.registry import GenerationRegistry, digest

PROMPT = [5, 6, 7]


class Clock:
    """A settable clock (the registry's TTL reads it instead of the machine's)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def completion(ids: list[int], version: int = 3, finish=types_pb2.FINISH_REASON_STOP, rollout="r0"):
    return types_pb2.Completion(
        completion_token_ids=ids,
        logprobs=[-0.5 - i for i in range(len(ids))],
        finish_reason=finish,
        version_spans=[types_pb2.WeightVersionSpan(version=version, start=0, end=len(ids))],
        rollout_id=rollout,
    )


def test_get_is_exact() -> None:
    registry = GenerationRegistry(10, 60)
    registry.add(
        PROMPT, [completion([1, 2, 3]), completion([4, 5], version=4, finish=types_pb2.FINISH_REASON_LENGTH)]
    )
    assert registry.size == 2 and registry.added == 2
    got = registry.get([*PROMPT, 1, 2, 3, 99], 3, 6)
    assert got is not None
    assert got.key == digest([*PROMPT, 1, 2, 3])
    assert (got.prompt_len, got.token_ids, got.finish_reason, got.rollout_id) == (3, (1, 2, 3), 1, "r0")
    assert got.logprobs == (-0.5, -1.5, -2.5)
    assert got.version_spans == ((3, 0, 3),)
    other = registry.get([*PROMPT, 4, 5], 3, 5)
    assert other is not None and other.version_spans == ((4, 0, 2),)
    assert other.finish_reason == types_pb2.FINISH_REASON_LENGTH
    # a prefix, an extension, another prompt, a split at the wrong place: none is a generation
    assert registry.get([*PROMPT, 1, 2], 3, 5) is None
    assert registry.get([*PROMPT, 1, 2, 3, 4], 3, 7) is None
    assert registry.get([5, 6, 8, 1, 2, 3], 3, 6) is None
    assert registry.get([*PROMPT, 1, 2, 3], 2, 6) is None
    assert registry.get([*PROMPT, 1, 2, 3], 4, 6) is None
    # out of range or not int32: None, never an exception
    assert registry.get([*PROMPT, 1, 2, 3], 3, 9) is None
    assert registry.get([5, 6, 7, 2**40], 3, 4) is None


def test_continuations_are_prefixes_longest_first() -> None:
    registry = GenerationRegistry(10, 60)
    registry.add(PROMPT, [completion([1]), completion([1, 2]), completion([1, 3]), completion([1, 2, 3, 4])])
    found = registry.continuations([*PROMPT, 1, 2, 3], 3, 6)
    assert [g.token_ids for g in found] == [(1, 2), (1,)]
    assert registry.continuations([*PROMPT, 9], 3, 4) == []


def test_lru_bound_evicts_the_least_recently_used() -> None:
    registry = GenerationRegistry(2, 60)
    registry.add(PROMPT, [completion([1])])
    registry.add(PROMPT, [completion([2])])
    assert registry.get([*PROMPT, 1], 3, 4) is not None  # [1] is now the most recently used
    registry.add(PROMPT, [completion([3])])
    assert registry.size == 2 and registry.evicted == 1
    assert registry.get([*PROMPT, 2], 3, 4) is None
    assert registry.get([*PROMPT, 1], 3, 4) is not None
    assert registry.get([*PROMPT, 3], 3, 4) is not None
    # the prompt index forgets evicted generations too
    assert [g.token_ids for g in registry.continuations([*PROMPT, 2], 3, 4)] == []


def test_ttl_forgets_what_was_not_used() -> None:
    clock = Clock()
    registry = GenerationRegistry(10, 60, clock=clock)
    registry.add(PROMPT, [completion([1])])
    registry.add(PROMPT, [completion([2])])
    clock.now += 40
    assert registry.get([*PROMPT, 1], 3, 4) is not None  # used: its 60 s start again
    clock.now += 30
    assert registry.get([*PROMPT, 2], 3, 4) is None  # 70 s unused
    assert registry.get([*PROMPT, 1], 3, 4) is not None  # 30 s since its use
    assert registry.size == 1 and registry.evicted == 1
    clock.now += 50
    assert registry.continuations([*PROMPT, 1], 3, 4) != []  # a match through the prompt index uses it too
    clock.now += 50
    assert registry.get([*PROMPT, 1], 3, 4) is not None
    clock.now += 61
    registry.add([9], [completion([9])])
    assert registry.size == 1 and registry.evicted == 2


def test_claim_and_release() -> None:
    registry = GenerationRegistry(10, 60)
    registry.add(PROMPT, [completion([1]), completion([2])])
    one, two = digest([*PROMPT, 1]), digest([*PROMPT, 2])
    assert registry.claim([one]) == []
    assert registry.claimed == 1
    # a claim of one claimed key claims nothing of the others
    assert registry.claim([two, one]) == [one]
    assert registry.claimed == 1
    assert registry.claim([two]) == []
    registry.release([one])
    assert registry.claimed == 1
    assert registry.claim([one]) == []
    # a key the registry does not hold cannot be claimed
    assert registry.claim([digest([1, 2, 3])]) == [digest([1, 2, 3])]


def test_identical_generations_share_an_entry_and_count() -> None:
    registry = GenerationRegistry(10, 60)
    registry.add(PROMPT, [completion([1, 2]), completion([1, 2]), completion([3])])
    assert registry.size == 2 and registry.added == 3
    key = digest([*PROMPT, 1, 2])
    assert registry.claim([key, key]) == []  # generated twice: two sequences may use it
    assert registry.claim([key]) == [key]
    registry.add(PROMPT, [completion([1, 2], version=7)])  # generated again, later: latest data
    got = registry.get([*PROMPT, 1, 2], 3, 5)
    assert got is not None and got.version_spans == ((7, 0, 2),)
    assert registry.claim([key]) == []


def test_claims_live_as_long_as_their_entry() -> None:
    registry = GenerationRegistry(1, 60)
    registry.add(PROMPT, [completion([1])])
    key = digest([*PROMPT, 1])
    assert registry.claim([key]) == []
    registry.add(PROMPT, [completion([2])])  # evicts the claimed one
    assert registry.claimed == 0
    assert registry.claim([key]) == [key]


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        GenerationRegistry(0, 60)
    with pytest.raises(ValueError):
        GenerationRegistry(1, 0)


def test_storage_is_compact() -> None:
    """2,000 generations of 300 tokens: 8 bytes a token (int32 id, float32 logprob) and under 1 kB of
    bookkeeping each (keys, indexes, versions), so the default 100,000 stay within ~350 MB."""
    prompt = list(range(100))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        registry = GenerationRegistry(100_000, 3600)
        for i in range(2000):
            registry.add([*prompt, i], [completion(list(range(i, i + 300)))])
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert registry.size == 2000
    assert used / 2000 < 8 * 300 + 1000, used / 2000
