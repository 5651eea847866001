"""`python -m services.learner --help` documents the nested options; the CLI fills the nested sections."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.learner.config import SHARDED_MMAP_THRESHOLD, LearnerSettings

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_losses_and_key_options():
    out = subprocess.run(
        [sys.executable, "-m", "services.learner", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps long lines
    for flag in (
        "--loss.kind {grpo,dr_grpo,dapo,gspo,cispo}",
        "--loss.tis-cap",
        "--optim.lr",
        "--lora.rank",
        "--publish.advertise-address",
        "--checkpoint.dir",
        "--checkpoint.resume",
    ):
        assert flag in text, flag
    assert "AdamW peak learning rate." in text


def test_cli_fills_the_nested_sections(tmp_path):
    settings = LearnerSettings.from_cli(
        [
            "--model",
            "m",
            "--loss.kind",
            "dapo",
            "--loss.clip-eps-high",
            "0.3",
            "--lora.rank",
            "8",
            "--checkpoint.resume",
            "--checkpoint.dir",
            str(tmp_path),
            "--optim.schedule",
            "cosine",
        ]
    )
    assert settings.loss.kind == "dapo" and settings.loss.eps == (0.2, 0.3)
    assert settings.lora.rank == 8 and settings.checkpoint.resume and settings.checkpoint.dir == tmp_path
    assert settings.optim.schedule == "cosine"


def test_missing_model_is_a_one_line_cli_error():
    out = subprocess.run(
        [sys.executable, "-m", "services.learner", "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "error: --model: required: HF model id or local directory of the policy." in out.stderr
    assert "Traceback" not in out.stderr


def test_a_device_unknown_or_absent_is_a_one_line_cli_error():
    """A name torch does not spell, and a device this machine lacks (a CUDA index past the last), each end
    in one line and exit 2, before any model is loaded."""
    import torch

    absent = f"cuda:{torch.cuda.device_count()}"
    for device, says in (
        ("garbage", "error: --device: Value error, a device is 'auto', 'cpu', 'cuda', 'cuda:N'"),
        (absent, "error: --device: "),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "services.learner", "--model", "m", "--device", device, "--port", "0"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and f"(got '{device}')" in lines[0], lines


def test_the_malloc_threshold_is_fixed_for_several_ranks_unless_set():
    """Unset: glibc's own threshold for one rank, SHARDED_MMAP_THRESHOLD for several (config.py); a value
    given on the command line (0 included: glibc's own) wins for any number of ranks."""
    default = LearnerSettings.from_cli(["--model", "m"])
    assert default.mmap_threshold(1) == 0
    assert default.mmap_threshold(2) == SHARDED_MMAP_THRESHOLD == 8 << 20
    for given in ("0", "1048576"):
        settings = LearnerSettings.from_cli(["--model", "m", "--malloc-mmap-threshold-bytes", given])
        assert settings.mmap_threshold(1) == settings.mmap_threshold(4) == int(given)


def test_one_rank_keeps_freed_memory_unless_told_otherwise():
    """auto (the default): the heap keeps freed blocks for one rank on the CPU (no page faults for each step's
    activations), not for several ranks nor on an accelerator; a threshold given turns it off; both
    together are refused."""
    default = LearnerSettings.from_cli(["--model", "m"])
    assert default.keeps_freed(1, "cpu")
    assert not default.keeps_freed(2, "cpu") and not default.keeps_freed(1, "cuda")
    threshold = LearnerSettings.from_cli(["--model", "m", "--malloc-mmap-threshold-bytes", "1048576"])
    assert not threshold.keeps_freed(1, "cpu")
    off = LearnerSettings.from_cli(["--model", "m", "--malloc-keep-freed", "off"])
    assert not off.keeps_freed(1, "cpu") and off.mmap_threshold(1) == 0
    on = LearnerSettings.from_cli(["--model", "m", "--malloc-keep-freed", "on"])
    assert on.keeps_freed(1, "cuda")
    with pytest.raises(ValueError, match="malloc_keep_freed"):
        LearnerSettings(model="m", malloc_keep_freed="on", malloc_mmap_threshold_bytes=1 << 20)
    both = ["--malloc-keep-freed", "on", "--malloc-mmap-threshold-bytes", "1"]
    for refused in (["--malloc-keep-freed", "true"], both):
        with pytest.raises(SystemExit) as exit_:
            LearnerSettings.from_cli(["--model", "m", *refused])
        assert exit_.value.code == 2
