"""A submitted sequence matched against the gateway's generations (pure: no I/O).

An atropos group (ScoredData) carries, per sequence, `tokens` (the whole sequence) and `masks`
(-100 where the model did not sample, the token id where it did). Its model-sampled tokens are
trained on only if this gateway generated them: every maximal unmasked span [s, e) must be one
generation whose prompt was exactly tokens[:s] and whose completion is exactly tokens[s:e], or
several generations back to back (the first's prompt tokens[:s], each next one's prompt everything
before it). Behaviour logprobs, weight versions and finish reasons come from the registry, never
from the submitter. Masked tokens between model spans are environment tokens (in the context,
masked out of the loss); masked tokens after the last model span are dropped (they train nothing).

**Why exact spans, and why back to back.** Decided from atroposlib 0.4.0's own code, the path by
which an atropos env gets sampled tokens at all (`ManagedServer` over `VLLMServer`'s `/generate`):
`ManagedServer._create_sequence_node` writes `tokens = prompt + output_tokens` and
`masked_tokens = [-100] * len(prompt) + output_tokens` with the *whole* sampled output (its EOS
included; nothing is stripped or cut), and a later turn that extends a node keeps that node's
`masked_tokens` and appends `[-100] * len(new suffix) + output_tokens`, its prompt being the node's
tokens + the suffix: so each unmasked run is exactly what one `/generate` call sampled after exactly
that prefix. When the suffix is empty (a `completion()` that continues the previous text), two
generations sit back to back in one unmasked run, hence the second form. The shipped envs
(e.g. `environments/gsm8k_server.py`) submit `node.tokens` / `node.masked_tokens` unchanged, and
`BaseEnv.handle_send_to_api` drops an over-long group rather than cutting it. A strict *prefix* of
a generation is therefore not accepted: no real env path submits one (the only trimming in
atroposlib, `tokenize_for_trainer` dropping an EOS after a "length" finish, applies to chats it
re-tokenizes, whose tokens are not the sampled ones anyway), and a cut completion would carry a
finish reason it did not have. Re-tokenized sequences (`tokenize_for_trainer`, `track_tree=True`,
which rebuilds prompts from its parent node's tokens rather than what was sent) match only where
they reproduce the sampled tokens exactly; otherwise they are refused, which is the point: their
tokens are not what the model sampled.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from grpo.common.v1 import types_pb2
from services.gateway.registry import Generation, GenerationRegistry

NOT_SAMPLED = -100
MAX_TOKEN_ID = 2**31 - 1
MODEL, ENV = types_pb2.TURN_SOURCE_MODEL, types_pb2.TURN_SOURCE_ENV


class Refused(Exception):
    """A sequence that cannot be trained on, with the reason (naming the sequence and positions)."""

    def __init__(self, reason: str, sequence: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.sequence = sequence


@dataclass(frozen=True)
class MatchedSequence:
    """A submitted sequence as the trainer's prompt + one completion (an episode when it has several
    model spans), with the registry keys of the generations it used, in order."""

    prompt_token_ids: list[int]
    completion: types_pb2.Completion
    generations: tuple[bytes, ...]


def _shown(value: object) -> str:
    return repr(value)[:40]


def model_spans(tokens: Sequence[int], mask: Sequence[int], index: int) -> list[tuple[int, int]]:
    """The maximal unmasked spans [s, e) of a well-formed sequence; `Refused` for a malformed one."""
    if len(tokens) != len(mask):
        raise Refused(f"sequence {index}: tokens has {len(tokens)} entries but masks has {len(mask)}", index)
    spans: list[tuple[int, int]] = []
    start = -1
    for position, (token, flag) in enumerate(zip(tokens, mask, strict=True)):
        if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
            raise Refused(f"sequence {index}: tokens[{position}] = {_shown(token)} is not a token id", index)
        if type(flag) is int and flag == NOT_SAMPLED:
            if start >= 0:
                spans.append((start, position))
                start = -1
            continue
        if type(flag) is not int or flag != token:
            raise Refused(
                f"sequence {index}: masks[{position}] = {_shown(flag)}; a mask entry is -100 (not sampled) "
                f"or the token id at that position ({token}), where the model sampled it",
                index,
            )
        if start < 0:
            start = position
    if start >= 0:
        spans.append((start, len(tokens)))
    if not spans:
        raise Refused(
            f"sequence {index} has no sampled tokens (every mask entry is -100): nothing to train", index
        )
    return spans


def _cover(
    registry: GenerationRegistry, tokens: Sequence[int], start: int, end: int, index: int
) -> list[tuple[int, Generation]]:
    """The generations that make up the span [start, end), with where each starts: one generation
    (the common case), else generations back to back (a search over the positions they reach)."""
    exact = registry.get(tokens, start, end)
    if exact is not None:
        return [(start, exact)]
    came_from: dict[int, tuple[int, Generation]] = {}
    queue = [start]
    while queue:
        position = heapq.heappop(queue)
        if position == end:
            break
        for generation in registry.continuations(tokens, position, end):
            reached = position + len(generation.token_ids)
            if reached not in came_from:
                came_from[reached] = (position, generation)
                heapq.heappush(queue, reached)
    if end not in came_from:
        raise Refused(
            f"tokens [{start}, {end}) of sequence {index} were not generated by this gateway (no "
            f"generation it holds has tokens[:{start}] as its prompt and tokens[{start}:{end}] as its "
            "completion, alone or with others back to back; or it is no longer held)",
            index,
        )
    pieces = []
    position = end
    while position != start:
        previous, generation = came_from[position]
        pieces.append((previous, generation))
        position = previous
    return pieces[::-1]


def match_sequence(
    registry: GenerationRegistry, tokens: Sequence[int], mask: Sequence[int], index: int
) -> MatchedSequence:
    """Sequence `index` of a group as a prompt + completion built from the registry's generations;
    `Refused` (naming the sequence and token positions) when it is malformed or any model span is
    not this gateway's."""
    pieces = [
        piece for s, e in model_spans(tokens, mask, index) for piece in _cover(registry, tokens, s, e, index)
    ]
    first = pieces[0][0]
    last_start, last = pieces[-1]
    end = last_start + len(last.token_ids)
    logprobs = [0.0] * (end - first)
    spans: list[types_pb2.WeightVersionSpan] = []
    turns: list[types_pb2.Turn] = []
    cursor = first
    for position, generation in pieces:
        offset = position - first
        size = len(generation.token_ids)
        logprobs[offset : offset + size] = generation.logprobs
        spans.extend(
            types_pb2.WeightVersionSpan(version=v, start=offset + a, end=offset + b)
            for v, a, b in generation.version_spans
        )
        if position > cursor:
            turns.append(types_pb2.Turn(source=ENV, start=cursor - first, end=offset))
        turns.append(
            types_pb2.Turn(
                source=MODEL, start=offset, end=offset + size, finish_reason=generation.finish_reason
            )
        )
        cursor = position + size
    temperatures = {g.temperature for _, g in pieces}
    if len(temperatures) > 1:
        shown = ", ".join(f"{t:g}" for t in sorted(temperatures))
        raise Refused(
            f"sequence {index}: its turns were sampled at different temperatures ({shown}); an episode "
            "is trained at one temperature",
            index,
        )
    top_p, top_k = min(g.top_p for _, g in pieces), max(g.top_k for _, g in pieces)
    sampling = types_pb2.SamplingParams(temperature=last.temperature, top_p=top_p, top_k=top_k)
    completion = types_pb2.Completion(
        completion_token_ids=tokens[first:end],
        sampling_params=sampling,
        logprobs=logprobs,
        finish_reason=last.finish_reason,
        version_spans=spans,
        rollout_id=last.rollout_id,
        turns=turns if len(pieces) > 1 else (),
    )
    return MatchedSequence(list(tokens[:first]), completion, tuple(g.key for _, g in pieces))
