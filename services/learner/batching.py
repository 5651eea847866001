"""From scored completions to padded micro-batches (pure: lists in, tensors out).

A `Sample` is one completion: prompt + completion token ids, behaviour logprobs and its advantage;
for a multi-turn episode the completion is every token after the prompt, and `env_spans` are the
environment's tokens inside it (tool results, user turns, template glue): context, masked out of the
loss and of every count the loss is normalised by.
Micro-batches are planned by a *padded* token budget (rows × longest row ≤ budget): samples are
sorted by length so similar lengths share a micro-batch and little compute goes to padding. The
order of samples never changes the result, because every objective is normalised by global counts
(see `losses.Norm`).

A group's completions share their prompt. With `plan_shared`, the samples of one prompt go into
micro-batches of their own (`collate_shared`), packed into one sequence: the prompt (but its last
token) once, then each row, which attends to the prompt and to itself only. The same logprobs and
gradients as the whole rows, for fewer tokens: on `bench/vs_trl.py`'s SmolLM2 batch (40-token
prompts, G = 8, 64-token completions) 28 % fewer, and no padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument
from services.learner.losses import Norm


@dataclass(frozen=True)
class Sample:
    """One completion to train on."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    behav_logprobs: tuple[float, ...]
    advantage: float
    temperature: float = 1.0
    # [start, end) ranges of completion_ids the environment added: not trained on
    env_spans: tuple[tuple[int, int], ...] = ()

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def trained_tokens(self) -> int:
        """Completion tokens the model sampled (the ones the loss sees)."""
        return len(self.completion_ids) - sum(end - start for start, end in self.env_spans)


@dataclass
class MicroBatch:
    """Right-padded tensors of a few samples.

    input_ids      [B, L]   prompt + completion, padded with 0
    attention_mask [B, L]
    positions      [B, T]   index into the shifted logits ([B, L-1]) predicting completion token t
    completion_ids [B, T]
    mask           [B, T]   1.0 on sampled completion tokens (0 on padding and environment tokens)
    behav          [B, T]   behaviour logprobs (0 on padding)
    adv            [B]
    temperature    [B]
    position_ids   [1, N]   set for one prompt's rows packed into one sequence (`collate_shared`):
                            input_ids [1, N], attention_mask [1, 1, N, N] (which position sees which)
                            and positions index into the N; None for a micro-batch of whole rows
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    temperature: torch.Tensor
    position_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(**{k: None if v is None else v.to(device) for k, v in self.__dict__.items()})


def validate_sample(sample: Sample, vocab_size: int, where: str, max_length: int = 0) -> None:
    """InvalidArgument with a precise message if the sample cannot be trained on (max_length 0 = no limit)."""
    if max_length and sample.length > max_length:
        raise InvalidArgument(f"{where}: {sample.length} tokens exceed the model's {max_length} positions")
    if not sample.prompt_ids:
        raise InvalidArgument(f"{where}: empty prompt_token_ids")
    if not sample.completion_ids:
        raise InvalidArgument(f"{where}: empty completion_token_ids")
    if len(sample.behav_logprobs) != len(sample.completion_ids):
        raise InvalidArgument(
            f"{where}: {len(sample.behav_logprobs)} logprobs for "
            f"{len(sample.completion_ids)} completion tokens"
        )
    bad = [t for t in (*sample.prompt_ids, *sample.completion_ids) if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{where}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if not all(math.isfinite(lp) and lp <= 1e-3 for lp in sample.behav_logprobs):
        raise InvalidArgument(f"{where}: behaviour logprobs must be finite and <= 0")
    previous = 0
    for start, end in sample.env_spans:
        if not previous <= start < end <= len(sample.completion_ids):
            raise InvalidArgument(
                f"{where}: environment turn [{start}, {end}) is not an ordered range inside the "
                f"{len(sample.completion_ids)} completion tokens"
            )
        previous = end
    if sample.env_spans and sample.trained_tokens == 0:
        raise InvalidArgument(f"{where}: every completion token is the environment's: nothing to train")
    if not math.isfinite(sample.advantage):
        raise InvalidArgument(f"{where}: advantage must be finite")
    if sample.temperature <= 0:
        raise InvalidArgument(f"{where}: temperature must be > 0")


def global_norm(samples: Sequence[Sample]) -> Norm:
    """Sequence and token counts of the whole optimizer batch."""
    return Norm(
        num_seqs=sum(1 for s in samples if s.trained_tokens),
        num_tokens=sum(s.trained_tokens for s in samples),
    )


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices so that rows × longest row ≤ token_budget (a single long row may exceed it).

    Longest first, greedy: a new micro-batch starts when adding the next row would overflow.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        candidate = max(longest, lengths[index])
        if current and candidate * (len(current) + 1) > token_budget:
            batches.append(current)
            current, longest = [], 0
            candidate = lengths[index]
        current.append(index)
        longest = candidate
    if current:
        batches.append(current)
    return batches


def plan_shared(samples: Sequence[Sample], token_budget: int) -> list[list[int]]:
    """Like `plan_micro_batches`, but the samples of a prompt that several share (of at least 2 tokens)
    go into micro-batches of their own for `collate_shared`, packed tokens (P - 1 + Σ completion
    lengths) ≤ token_budget, longest first; the other samples are planned as usual."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for index, sample in enumerate(samples):
        by_prompt.setdefault(sample.prompt_ids, []).append(index)
    plan: list[list[int]] = []
    alone: list[int] = []
    for prompt, indices in by_prompt.items():
        if len(indices) < 2 or len(prompt) < 2:
            alone += indices
            continue
        current: list[int] = []
        packed = len(prompt) - 1
        for i in sorted(indices, key=lambda i: (-len(samples[i].completion_ids), i)):
            if current and packed + len(samples[i].completion_ids) > token_budget:
                plan.append(current)
                current, packed = [], len(prompt) - 1
            current.append(i)
            packed += len(samples[i].completion_ids)
        plan.append(current)
    chunks = plan_micro_batches([samples[i].length for i in alone], token_budget)
    return plan + [[alone[j] for j in chunk] for chunk in chunks]


def shares_prefix(samples: Sequence[Sample]) -> bool:
    """Whether `collate_shared` applies: two rows or more, one prompt of at least 2 tokens."""
    first = samples[0].prompt_ids
    return len(samples) > 1 and len(first) > 1 and all(s.prompt_ids == first for s in samples)


def collate_shared(samples: Sequence[Sample]) -> MicroBatch:
    """Samples of one prompt (`shares_prefix`) packed into one sequence (CPU tensors): the prompt but
    its last token once, then each row: the prompt's last token and the completion but its last token.
    A row attends to the prefix and to itself (causally), never to another row, and its positions
    continue the prefix's, so every logit is the one its whole row gives.

    input_ids      [1, N]        N = P-1 + Σ completion lengths: no padding
    position_ids   [1, N]        0..P-2 for the prefix, then P-1.. again for each row
    attention_mask [1, 1, N, N]  True where query i may attend to key j
    positions      [B, T]        index into the N packed positions predicting completion token t
    """
    rows, prompt = len(samples), samples[0].prompt_ids
    max_comp = max(len(s.completion_ids) for s in samples)
    start = len(prompt) - 1  # the shared prefix: prompt[:-1]
    tokens, segment, position = list(prompt[:-1]), [0] * start, list(range(start))
    positions = torch.zeros(rows, max_comp, dtype=torch.long)  # [B, T]
    completion = torch.zeros(rows, max_comp, dtype=torch.long)  # [B, T]
    mask = torch.zeros(rows, max_comp, dtype=torch.float32)  # [B, T]
    behav = torch.zeros(rows, max_comp, dtype=torch.float32)  # [B, T]
    for row, s in enumerate(samples):
        c = len(s.completion_ids)
        positions[row, :c] = torch.arange(len(tokens), len(tokens) + c)
        tokens += (prompt[-1], *s.completion_ids[:-1])
        segment += [row + 1] * c
        position += range(start, start + c)
        completion[row, :c] = torch.tensor(s.completion_ids, dtype=torch.long)
        mask[row, :c] = 1.0
        for first, end in s.env_spans:  # the environment's tokens: context only
            mask[row, first:end] = 0.0
        behav[row, :c] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
    seg = torch.tensor(segment)  # [N]: 0 the prefix, r + 1 row r
    index = torch.arange(len(tokens))  # [N]
    causal = index[None, :] <= index[:, None]  # [N, N]: key j at or before query i
    visible = (seg[None, :] == 0) | (seg[None, :] == seg[:, None])  # the prefix, or the query's own row
    attention = (causal & visible)[None, None]  # [1, 1, N, N]
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)  # [B]
    temperature = torch.tensor([s.temperature for s in samples], dtype=torch.float32)  # [B]
    return MicroBatch(
        torch.tensor([tokens], dtype=torch.long), attention, positions, completion, mask, behav, adv,
        temperature, torch.tensor([position], dtype=torch.long),
    )  # fmt: skip


def collate(samples: Sequence[Sample]) -> MicroBatch:
    """Right-pad `samples` into one MicroBatch (CPU tensors)."""
    rows = len(samples)
    max_len = max(s.length for s in samples)
    max_comp = max(len(s.completion_ids) for s in samples)
    input_ids = torch.zeros(rows, max_len, dtype=torch.long)  # [B, L]
    attention = torch.zeros(rows, max_len, dtype=torch.long)  # [B, L]
    positions = torch.zeros(rows, max_comp, dtype=torch.long)  # [B, T]
    completion = torch.zeros(rows, max_comp, dtype=torch.long)  # [B, T]
    mask = torch.zeros(rows, max_comp, dtype=torch.float32)  # [B, T]
    behav = torch.zeros(rows, max_comp, dtype=torch.float32)  # [B, T]
    for row, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[row, : p + c] = torch.tensor((*s.prompt_ids, *s.completion_ids), dtype=torch.long)
        attention[row, : p + c] = 1
        # logits at position j predict token j+1, so completion token k is predicted at p-1+k
        positions[row, :c] = torch.arange(p - 1, p - 1 + c)
        completion[row, :c] = torch.tensor(s.completion_ids, dtype=torch.long)
        mask[row, :c] = 1.0
        for start, end in s.env_spans:  # the environment's tokens: context only
            mask[row, start:end] = 0.0
        behav[row, :c] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)  # [B]
    temperature = torch.tensor([s.temperature for s in samples], dtype=torch.float32)  # [B]
    return MicroBatch(input_ids, attention, positions, completion, mask, behav, adv, temperature)


def micro_batches(samples: Sequence[Sample], token_budget: int) -> list[MicroBatch]:
    """Plan and collate: the micro-batches of one optimizer step."""
    plan = plan_micro_batches([s.length for s in samples], token_budget)
    return [collate([samples[i] for i in group]) for group in plan]
