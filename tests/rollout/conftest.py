"""Rollout test fixtures (the tiny model itself is `tiny_model_dir` from tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path):
    """The tiny model in plain transformers (fp32, eval), for logprob references."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
