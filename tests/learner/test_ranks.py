"""Two learner ranks (FSDP2 over Gloo, under torchrun) train exactly as one.

`ranks_worker.py` runs two optimizer steps on fixed batches for grpo, dapo and gspo, each as a full
fine-tune and with LoRA, once alone and once as two ranks under torchrun (rank 0 announcing every
operation, rank 1 following: ranks.py). The batches are split unevenly between the ranks and into
micro-batches of different counts (rank 1 runs an empty pass), one sample has an environment span.
Loss, gradient norm and every exported weight must agree within 1e-6, and the learner logprobs
each step returns (rank 1's share gathered to rank 0) within 1e-5. So must one rank sharded with
FSDP2 (`distributed.shard_one_rank`: a process group of one, no torchrun) and one rank unsharded.

Checkpoints move between numbers of ranks: a checkpoint written after the first step at one rank
(checkpoint.py's files) resumes at two, one written at two (torch.distributed.checkpoint's sharded
files) resumes at one; the second step after the resume equals the uninterrupted run's, within 1e-6.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.learner.ranks_worker import CASES, RESUMED

WORKER = Path(__file__).with_name("ranks_worker.py")
TOLERANCE = 1e-6


def _run(command: list[str], out: Path, *names: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert all((out / f"{name}.json").exists() for name in names), sorted(out.iterdir())


def _name(loss: str, lora: int) -> str:
    return f"{loss}-lora{lora}"


@pytest.fixture(scope="module")
def runs(micro_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    one, two = tmp_path_factory.mktemp("one-rank"), tmp_path_factory.mktemp("two-ranks")
    sharded = tmp_path_factory.mktemp("one-sharded-rank")
    alone = [sys.executable, str(WORKER), "--model", str(micro_model_dir)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    ranked = [*torchrun, str(WORKER), "--model", str(micro_model_dir)]
    trained = [_name(*case) for case in CASES]
    resumed = [f"{_name(*case)}-resumed" for case in RESUMED]
    _run([*alone, "--out", str(one)], one, *trained)
    _run([*ranked, "--out", str(two)], two, *trained)
    _run([*alone, "--out", str(one), "--resume-from", str(two)], one, *resumed)  # 2 ranks → 1
    _run([*ranked, "--out", str(two), "--resume-from", str(one)], two, *resumed)  # 1 rank → 2
    _run([*alone, "--out", str(sharded), "--shard-one-rank"], sharded, *trained)
    return one, two, sharded


def _same(steps_a: dict, steps_b: dict, weights_a: Path, weights_b: Path) -> None:
    assert steps_a["num_tokens"] == steps_b["num_tokens"]
    assert abs(steps_a["loss"] - steps_b["loss"]) <= TOLERANCE, (steps_a, steps_b)
    assert abs(steps_a["grad_norm"] - steps_b["grad_norm"]) <= TOLERANCE, (steps_a, steps_b)
    assert steps_a["grad_norm"] > 1e-3  # a real gradient
    # the step's learner logprobs, gathered to rank 0 in the batch's order: one list per sample
    logprobs_a, logprobs_b = steps_a["logprobs"], steps_b["logprobs"]
    assert [len(x) for x in logprobs_a] == [len(x) for x in logprobs_b] and len(logprobs_a) == 11
    assert all(logprobs_a), "every sample has its logprobs"
    worst = max(
        abs(x - y) for a, b in zip(logprobs_a, logprobs_b, strict=True) for x, y in zip(a, b, strict=True)
    )
    assert worst <= 1e-5, worst
    a, b = load_file(weights_a), load_file(weights_b)
    assert a.keys() == b.keys()
    assert not any(".lora_" in key or ".base_layer." in key for key in b)  # merged, in HF names
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= TOLERANCE, (weights_b, worst)


@pytest.mark.parametrize(("loss", "lora"), CASES)
def test_two_ranks_train_as_one(runs: tuple[Path, Path, Path], loss: str, lora: int) -> None:
    one, two, _ = runs
    name = _name(loss, lora)
    steps_one, steps_two = (json.loads((run / f"{name}.json").read_text()) for run in (one, two))
    assert len(steps_one) == len(steps_two) == 2
    assert steps_two[0]["micro_batches"] > steps_one[0]["micro_batches"]  # the shares split differently
    _same(steps_one[0], steps_two[0], one / f"{name}.safetensors", two / f"{name}.safetensors")  # loss, norm
    _same(steps_one[1], steps_two[1], one / f"{name}.safetensors", two / f"{name}.safetensors")


@pytest.mark.parametrize(("loss", "lora"), RESUMED)
@pytest.mark.parametrize("direction", ["2 ranks → 1", "1 rank → 2"])
def test_a_checkpoint_resumes_at_another_number_of_ranks(
    runs: tuple[Path, Path, Path], loss: str, lora: int, direction: str
) -> None:
    one, two, _ = runs
    written, resumed = (two, one) if direction == "2 ranks → 1" else (one, two)
    name = _name(loss, lora)
    assert (written / "checkpoints" / name / "step_00000001" / "state.json").exists()
    sharded = (written / "checkpoints" / name / "step_00000001" / ".metadata").exists()
    assert sharded == (written == two)  # two ranks write torch.distributed.checkpoint's files
    uninterrupted = json.loads((written / f"{name}.json").read_text())[1]
    after_resume = json.loads((resumed / f"{name}-resumed.json").read_text())[0]
    _same(
        uninterrupted, after_resume, written / f"{name}.safetensors", resumed / f"{name}-resumed.safetensors"
    )


@pytest.mark.parametrize(("loss", "lora"), CASES)
def test_one_sharded_rank_trains_as_one_unsharded(
    runs: tuple[Path, Path, Path], loss: str, lora: int
) -> None:
    one, _, sharded = runs
    name = _name(loss, lora)
    steps_one, steps_sharded = (json.loads((run / f"{name}.json").read_text()) for run in (one, sharded))
    assert [s["micro_batches"] for s in steps_one] == [s["micro_batches"] for s in steps_sharded]
    for a, b in zip(steps_one, steps_sharded, strict=True):
        _same(a, b, one / f"{name}.safetensors", sharded / f"{name}.safetensors")
