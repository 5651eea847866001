"""Fixtures shared by all test packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen2 model with random weights (built once, cached under .cache/)."""
    return build_tiny_model(CACHE / "tiny-model-random")


@pytest.fixture(scope="session")
def warm_model_dir() -> Path:
    """The tiny model after a short supervised warm start on the demo arithmetic task."""
    return build_tiny_model(CACHE / "tiny-model-warm", warm_start_steps=120)
