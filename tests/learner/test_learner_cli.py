"""`python -m services.learner --help` documents the options; settings map onto the trainer options."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.learner.config import LearnerSettings

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
    for flag in (
        "--loss {grpo,dr_grpo,dapo,gspo,cispo}",
        "--lora-rank",
        "--checkpoint-dir",
        "--resume",
        "--tis-cap",
    ):
        assert flag in out.stdout


def test_settings_to_trainer_options(tmp_path):
    settings = LearnerSettings.from_cli(
        [
            "--model",
            "m",
            "--loss",
            "dapo",
            "--clip-eps-high",
            "0.3",
            "--lora-rank",
            "8",
            "--resume",
            "--checkpoint-dir",
            str(tmp_path),
            "--lr-schedule",
            "cosine",
        ]
    )
    opts = settings.trainer_options()
    assert opts.loss.kind == "dapo" and opts.loss.eps == (0.2, 0.3)
    assert opts.lora.rank == 8 and opts.resume and opts.checkpoint_dir == tmp_path
    assert opts.optim.schedule == "cosine"
