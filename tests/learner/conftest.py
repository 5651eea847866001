"""Learner test fixtures: a micro Qwen2 (2 layers, hidden 32, vocab 64) for fast trainer tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.learner.batching import Sample


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tied-embedding Qwen2ForCausalLM saved with save_pretrained (no tokenizer)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    out = tmp_path_factory.mktemp("micro_model")
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture
def model_dir(tiny_model_dir: Path) -> Path:
    """The project's tiny model (tests/conftest.py), for the gRPC-level learner tests."""
    return tiny_model_dir


@pytest.fixture
def make_samples():
    """Factory: make_samples(n, seed=..) → random Samples for the micro model's vocabulary."""
    return random_samples


def random_samples(
    n: int, vocab: int = 64, seed: int = 0, max_prompt: int = 5, max_completion: int = 7
) -> list[Sample]:
    """Samples with random tokens, behaviour logprobs near the model's (≈ −log vocab) and advantages."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt)))
        completion = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, max_completion)))
        behav = tuple(-4.16 + rng.uniform(-0.3, 0.3) for _ in completion)
        out.append(Sample(prompt, completion, behav, rng.uniform(-1.5, 1.5), rng.choice([1.0, 0.7])))
    return out
