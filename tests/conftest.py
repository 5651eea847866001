"""Fixtures shared by all test packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.launch.demo import DemoSettings, default_model_dir
from services.launch.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"
DEMO_WARM_START = DemoSettings.model_fields["warm_start_steps"].default

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen2 model with random weights (built once, cached under .cache/)."""
    return build_tiny_model(CACHE / "tiny-model-random")


@pytest.fixture(scope="session")
def warm_model_dir() -> Path:
    """The demo's tiny model: a short supervised warm start on the demo arithmetic task (shared cache)."""
    return build_tiny_model(default_model_dir(DEMO_WARM_START), warm_start_steps=DEMO_WARM_START)
