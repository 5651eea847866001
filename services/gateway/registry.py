"""Every generation the gateway served, content-addressed by its token sequence (pure: no I/O, no awaits).

A sequence someone submits for training (the atropos trajectory API) is checked against this registry
(matching.py): its model-sampled spans must be generations of this gateway, and their behaviour
logprobs, weight versions and finish reasons come from here, never from the submitter.

    key         blake2b-128 of the prompt's ids then the completion's ids (int32, little-endian): the
                digest of `tokens[:end]` for a sequence that holds the generation at [start, end)
    prompt key  blake2b-128 of the prompt's ids alone: an index prompt → its generations (the n choices
                of one request, and every later request with the same prompt), for spans that hold
                several generations back to back (matching.py)

Bounded: at most `max_generations` entries (least recently used first out) and none unused for `ttl_s`
(used = added or matched by `get`/`continuations`); both count in `evicted`. An entry stores its
completion compactly (array('i') ids, array('f') logprobs: float32, as the proto), not the prompt.

Identical generations (the same prompt and completion, e.g. two of n choices that sampled the same
tokens) share one entry, counted: it holds the latest one's logprobs, versions and finish reason, and
can be claimed as many times as it was generated. A claim marks an entry used by a submitted
sequence, so the same generation is not trained twice; claims live as long as their entry.
"""

from __future__ import annotations

import hashlib
import sys
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from grpo.common.v1 import types_pb2

DIGEST_BYTES = 16
assert array("i").itemsize == 4 and array("f").itemsize == 4


@dataclass(frozen=True)
class Generation:
    """One completion (choice) the gateway served."""

    key: bytes  # digest of prompt ids + completion ids (int32 little-endian, blake2b-128)
    prompt_len: int
    token_ids: tuple[int, ...]  # the completion's sampled tokens
    logprobs: tuple[float, ...]  # behaviour logprobs, same length
    version_spans: tuple[tuple[int, int, int], ...]  # (version, start, end) relative to token_ids
    finish_reason: int  # types_pb2.FinishReason value
    rollout_id: str
    # what it was sampled with (the learner scores at the temperature; top-p/top-k truncate)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def _ids(ids: Sequence[int]) -> array:
    """Token ids as int32 little-endian; OverflowError / TypeError for what is not an int32 each."""
    packed = array("i", ids if isinstance(ids, list) else list(ids))  # from a list: sized exactly
    if sys.byteorder == "big":
        packed.byteswap()
    return packed


def _hasher() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=DIGEST_BYTES)


def digest(ids: Sequence[int]) -> bytes:
    """The registry's key of a token sequence (a prompt, or a prompt + completion)."""
    hasher = _hasher()
    hasher.update(_ids(ids).tobytes())
    return hasher.digest()


class _Entry:
    __slots__ = (
        "claims",
        "count",
        "finish_reason",
        "logprobs",
        "prompt_key",
        "prompt_len",
        "rollout_id",
        "spans",
        "temperature",
        "tokens",
        "top_k",
        "top_p",
        "used_at",
    )

    def __init__(self, prompt_key: bytes, prompt_len: int, tokens: array, used_at: float) -> None:
        self.prompt_key = prompt_key
        self.prompt_len = prompt_len
        self.tokens = tokens
        self.logprobs = array("f")
        self.spans: tuple[tuple[int, int, int], ...] = ()
        self.finish_reason = 0
        self.rollout_id = ""
        self.temperature, self.top_p, self.top_k = 1.0, 1.0, 0
        self.used_at = used_at
        self.count = 0
        self.claims = 0

    def fill(self, completion: types_pb2.Completion) -> None:
        self.logprobs = array("f", list(completion.logprobs))
        self.spans = tuple((s.version, s.start, s.end) for s in completion.version_spans)
        self.finish_reason = completion.finish_reason
        self.rollout_id = sys.intern(completion.rollout_id)
        params = completion.sampling_params
        self.temperature, self.top_p, self.top_k = params.temperature, params.top_p, params.top_k

    def generation(self, key: bytes) -> Generation:
        tokens = self.tokens
        if sys.byteorder == "big":
            tokens = array("i", tokens)
            tokens.byteswap()
        return Generation(key, self.prompt_len, tuple(tokens), tuple(self.logprobs), self.spans,
                          self.finish_reason, self.rollout_id, self.temperature, self.top_p,
                          self.top_k)  # fmt: skip


class GenerationRegistry:
    """The gateway's generations, bounded by count (LRU) and age since last use (TTL)."""

    def __init__(
        self, max_generations: int, ttl_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_generations < 1 or not ttl_s > 0:
            raise ValueError("max_generations must be >= 1 and ttl_s > 0")
        self.max_generations = max_generations
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._by_prompt: dict[bytes, list[bytes]] = {}
        self.evicted = 0  # entries dropped by the bound or the TTL, ever
        self.claimed = 0  # claims held now (on entries still here)
        self.added = 0  # generations added, ever (identical ones each count)

    @property
    def size(self) -> int:
        return len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ bounds
    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.evicted += 1
        self.claimed -= entry.claims
        siblings = self._by_prompt.get(entry.prompt_key)
        if siblings is not None:
            siblings.remove(key)
            if not siblings:
                del self._by_prompt[entry.prompt_key]

    def _expire(self, now: float) -> None:
        horizon = now - self.ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.used_at > horizon:
                return
            self._drop(key)

    def _touch(self, key: bytes, entry: _Entry) -> None:
        entry.used_at = self._clock()
        self._entries.move_to_end(key)

    # ------------------------------------------------------------------ write
    def add(self, prompt_ids: Sequence[int], completions: Sequence[types_pb2.Completion]) -> None:
        """One generation per completion (choice) of a request whose prompt was `prompt_ids` (a choice
        with no tokens is skipped)."""
        now = self._clock()
        self._expire(now)
        base = _hasher()
        base.update(_ids(prompt_ids).tobytes())
        prompt_key = base.digest()
        for completion in completions:
            if not completion.completion_token_ids:
                continue  # nothing sampled (an aborted choice): no span can ever match it
            tokens = _ids(completion.completion_token_ids)
            hasher = base.copy()
            hasher.update(tokens.tobytes())
            key = hasher.digest()
            entry = self._entries.get(key)
            if entry is None:
                entry = _Entry(prompt_key, len(prompt_ids), tokens, now)
                self._entries[key] = entry
                self._by_prompt.setdefault(prompt_key, []).append(key)
            else:
                entry.used_at = now
                self._entries.move_to_end(key)
            entry.fill(completion)
            entry.count += 1
            self.added += 1
        while len(self._entries) > self.max_generations:
            self._drop(next(iter(self._entries)))

    # ------------------------------------------------------------------ read
    def get(self, tokens: Sequence[int], start: int, end: int) -> Generation | None:
        """The generation whose prompt is exactly tokens[:start] and whose completion is exactly
        tokens[start:end]; None when there is none (never generated here, or no longer held)."""
        if not 0 <= start < end <= len(tokens):
            return None
        self._expire(self._clock())
        try:
            key = digest(tokens[:end])
            window = _ids(tokens[start:end])
        except (OverflowError, TypeError):
            return None
        entry = self._entries.get(key)
        if entry is None or entry.prompt_len != start or entry.tokens != window:
            return None
        self._touch(key, entry)
        return entry.generation(key)

    def continuations(self, tokens: Sequence[int], start: int, end: int) -> list[Generation]:
        """The generations whose prompt is exactly tokens[:start] and whose (non-empty) completion is
        a prefix of tokens[start:end], longest first."""
        if not 0 <= start < end <= len(tokens):
            return []
        self._expire(self._clock())
        try:
            prompt_key = digest(tokens[:start])
            window = _ids(tokens[start:end])
        except (OverflowError, TypeError):
            return []
        found = []
        for key in self._by_prompt.get(prompt_key, ()):
            entry = self._entries[key]
            size = len(entry.tokens)
            if entry.prompt_len == start and 0 < size <= len(window) and entry.tokens == window[:size]:
                self._touch(key, entry)
                found.append(entry.generation(key))
        return sorted(found, key=lambda g: -len(g.token_ids))

    # ------------------------------------------------------------------ claims
    def claim(self, keys: Iterable[bytes]) -> list[bytes]:
        """Mark these generations used (a key listed k times takes k claims). Returns the keys that
        cannot be claimed (already claimed as many times as generated, or no longer held), each once;
        then nothing is claimed."""
        wanted = Counter(keys)
        refused = [
            key
            for key, times in wanted.items()
            if (entry := self._entries.get(key)) is None or entry.claims + times > entry.count
        ]
        if refused:
            return refused
        for key, times in wanted.items():
            self._entries[key].claims += times
        self.claimed += sum(wanted.values())
        return []

    def release(self, keys: Iterable[bytes]) -> None:
        """Undo claims (a submission that failed downstream); keys no longer held are skipped."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.claims > 0:
                entry.claims -= 1
                self.claimed -= 1
