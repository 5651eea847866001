"""Pure rollout helpers: request validation, version spans, processed logprobs (hand-computed)."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.errors import InvalidArgument
from services.rollout.engine import Sampling, VersionSpan
from services.rollout.hf_engine import processed_logprobs
from services.rollout.spans import check_spans, spans_from_labels
from services.rollout.validation import (
    PromptInput,
    normalize_sampling,
    validate_prompt,
    validate_sampling,
    validate_score_request,
)


def test_prompt_needs_exactly_one_of_text_or_messages() -> None:
    validate_prompt(PromptInput("p", text="1+1="))
    validate_prompt(PromptInput("p", messages=(("system", "be brief"), ("user", "1+1?"))))
    with pytest.raises(InvalidArgument, match="neither"):
        validate_prompt(PromptInput("p"))
    with pytest.raises(InvalidArgument, match="both"):
        validate_prompt(PromptInput("p", text="x", messages=(("user", "y"),)))
    with pytest.raises(InvalidArgument, match=r"messages\[0\].role"):
        validate_prompt(PromptInput("p", messages=(("robot", "y"),)))
    with pytest.raises(InvalidArgument, match=r"messages\[1\].content"):
        validate_prompt(PromptInput("p", messages=(("user", "y"), ("assistant", ""))))


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (Sampling(n=0), "n"),
        (Sampling(max_tokens=0), "max_tokens"),
        (Sampling(temperature=0.0), "temperature"),
        (Sampling(temperature=-1.0), "temperature"),
        (Sampling(temperature=math.nan), "temperature"),
        (Sampling(top_p=1.5), "top_p"),
        (Sampling(top_k=-2), "top_k"),
        (Sampling(stop=("",)), "stop"),
    ],
)
def test_invalid_sampling_names_the_field(sampling: Sampling, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field):
        validate_sampling(sampling)


def test_normalize_sampling_turns_unset_top_p_into_off() -> None:
    assert normalize_sampling(Sampling(top_p=0.0)).top_p == 1.0
    assert normalize_sampling(Sampling(top_p=0.9)).top_p == 0.9
    validate_sampling(normalize_sampling(Sampling(n=4, temperature=0.7, top_p=0.0, max_tokens=8)))


def test_score_request_checks() -> None:
    validate_score_request([1, 2], [3], 1.0, vocab_size=10, max_len=8)
    with pytest.raises(InvalidArgument, match="completion_token_ids is empty"):
        validate_score_request([1], [], 1.0, 10, 8)
    with pytest.raises(InvalidArgument, match="prompt_token_ids is empty"):
        validate_score_request([], [1], 1.0, 10, 8)
    with pytest.raises(InvalidArgument, match="temperature"):
        validate_score_request([1], [1], 0.0, 10, 8)
    with pytest.raises(InvalidArgument, match=r"completion_token_ids\[1\] = 10"):
        validate_score_request([1], [1, 10], 1.0, 10, 8)
    validate_score_request([1] * 4, [1] * 3, 1.0, 10, 8)
    with pytest.raises(InvalidArgument, match="max_model_len"):
        validate_score_request([1] * 4, [1] * 4, 1.0, 10, 8)


def test_spans_merge_adjacent_labels_and_parse_versions() -> None:
    spans = spans_from_labels([("3", 0, 2), ("3", 2, 5), ("4", 5, 7)], 7, fallback_version=9)
    assert spans == (VersionSpan(3, 0, 5), VersionSpan(4, 5, 7))


def test_spans_without_labels_use_the_fallback_version() -> None:
    assert spans_from_labels(None, 4, fallback_version=2) == (VersionSpan(2, 0, 4),)
    assert spans_from_labels(None, 0, fallback_version=2) == ()
    assert spans_from_labels([], 0, fallback_version=2) == ()


def test_spans_skip_empty_labels() -> None:
    assert spans_from_labels([("1", 0, 0), ("2", 0, 3)], 3, 0) == (VersionSpan(2, 0, 3),)


@pytest.mark.parametrize(
    "labels",
    [
        [("1", 0, 2)],  # short
        [("1", 0, 2), ("2", 3, 4)],  # gap
        [("1", 0, 3), ("2", 2, 4)],  # overlap
        [("2", 0, 2), ("1", 2, 4)],  # backwards
    ],
)
def test_bad_spans_are_rejected(labels: list[tuple[str, int, int]]) -> None:
    with pytest.raises(ValueError):
        spans_from_labels(labels, 4, 0)


def test_non_integer_version_label_is_rejected() -> None:
    with pytest.raises(ValueError, match="default"):
        spans_from_labels([("default", 0, 3)], 3, 0)


def test_check_spans_accepts_exact_tiling() -> None:
    check_spans([VersionSpan(0, 0, 2), VersionSpan(1, 2, 3)], 3)


def test_processed_logprobs_temperature_only() -> None:
    logits = torch.tensor([[0.0, math.log(2.0), math.log(4.0)]])  # [1, 3]: p ∝ 1, 2, 4 at T=1
    out = processed_logprobs(logits.clone(), torch.tensor([1.0]), [0], [1.0])
    assert torch.allclose(out.exp(), torch.tensor([[1 / 7, 2 / 7, 4 / 7]]))
    # T = 0.5 squares the odds: p ∝ 1, 4, 16
    out = processed_logprobs(logits.clone(), torch.tensor([0.5]), [0], [1.0])
    assert torch.allclose(out.exp(), torch.tensor([[1 / 21, 4 / 21, 16 / 21]]))


def test_processed_logprobs_top_k_and_top_p_renormalise() -> None:
    logits = torch.tensor(
        [[0.0, math.log(2.0), math.log(4.0)], [0.0, math.log(2.0), math.log(4.0)]]
    )  # [2, 3]
    out = processed_logprobs(logits.clone(), torch.tensor([1.0, 1.0]), [2, 0], [1.0, 0.5]).exp()
    # row 0, top_k=2 keeps {2, 4} → 1/3, 2/3; row 1, top_p=0.5: 4/7 ≥ 0.5 alone → only the top token
    assert torch.allclose(out[0], torch.tensor([0.0, 1 / 3, 2 / 3]))
    assert torch.allclose(out[1], torch.tensor([0.0, 0.0, 1.0]))
    out = processed_logprobs(logits[:1].clone(), torch.tensor([1.0]), [0], [0.6]).exp()
    # top_p=0.6: 4/7 < 0.6 so the next token (2/7) joins → 1/3, 2/3
    assert torch.allclose(out[0], torch.tensor([0.0, 1 / 3, 2 / 3]))
