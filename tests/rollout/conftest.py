"""Rollout test fixtures: the project's tiny model (tests/conftest.py `tiny_model_dir` when present)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def rollout_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 + chat-template tokenizer: the lead's shared fixture, else built here."""
    try:
        return request.getfixturevalue("tiny_model_dir")
    except pytest.FixtureLookupError:
        from services.common.tiny_model import build_tiny_model

        return build_tiny_model(tmp_path_factory.mktemp("rollout") / "tiny")


@pytest.fixture(scope="session")
def reference_model(rollout_model_dir: Path):
    """The same model in plain transformers (fp32, eval), for logprob references."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(rollout_model_dir, dtype=torch.float32).eval()
