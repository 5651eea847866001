"""Sharded (DCP) checkpoints across world sizes: 2 ranks → 1, 1 → 2, 2 → 2, full model and LoRA.

The 2-rank halves run as real processes under torchrun (`python -m torch.distributed.run`, Gloo on
127.0.0.1): this file is also the worker script (its `__main__`). The 1-rank halves run in the test
process itself, a plain model without any process group, as a 1-rank learner does.

Every step is the same: one AdamW step on a fixed batch of token ids with the LM's own cross-entropy
loss. At world 2 each rank runs the whole batch with loss / 2 and FSDP2 sums the gradients
(gradient divide factor 1, sum reduction, as the learner's trainer does), which is the 1-rank
gradient exactly; so states and next steps can be compared across world sizes at 1e-6.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # as the torchrun worker script
    sys.path.insert(0, str(REPO))

from services.learner import checkpoint as ckpt  # noqa: E402
from services.learner import sharded_checkpoint as sc  # noqa: E402
from services.learner.model import repeated_blocks, trainable_state  # noqa: E402

KINDS = ("full", "lora")
TOL = 1e-6
LR, LR_AFTER = 1e-2, 4e-3
LAUNCH_TIMEOUT_S = 240  # one torchrun launch (two workers); collectives time out after 60 s


# ----------------------------------------------------------------------------- shared by both sides


def build(model_dir: Path, kind: str) -> torch.nn.Module:
    """The tiny model, with LoRA rank 4 on q/v for "lora" (adapters randomly initialised, so both A and
    B get gradients); the same on every rank and at every world size."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                            init_lora_weights=False)  # fmt: skip
        model = get_peft_model(model, config)
    return model


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters in the trainer's order (after sharding, if any)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def batch() -> torch.Tensor:
    """Fixed token ids [4, 16] in the tiny model's vocabulary (384)."""
    return torch.randint(0, 384, (4, 16), generator=torch.Generator().manual_seed(7))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: int) -> None:
    """One AdamW step; afterwards the LR drops to LR_AFTER as a schedule would (it lives in the
    optimizer's param groups, so a checkpoint must bring it back for the next step to match)."""
    optimizer.zero_grad(set_to_none=True)
    ids = batch()
    loss = model(input_ids=ids, labels=ids).loss / world  # summed over ranks: the 1-rank loss
    loss.backward()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = LR_AFTER


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full (unsharded) trainable parameters and optimizer tensors, flat: "model/<fqn>",
    "optim/<fqn>/<key>". A collective with a process group; the full tensors come to rank 0 only."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    params = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    flat = {f"model/{k}": v for k, v in params.items()}
    for fqn, entry in optim.get("state", {}).items():
        flat.update({f"optim/{fqn}/{k}": v for k, v in entry.items()})
    return {k: torch.as_tensor(v).detach().clone().contiguous() for k, v in flat.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# ----------------------------------------------------------------------------- the 2-rank worker


def _shard(model: torch.nn.Module, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in repeated_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _sharded(model_dir: Path, kind: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build(model_dir, kind)
    _shard(model, world)
    return model, adamw(model)


def _worker(scenario: str, out: Path, model_dir: Path) -> None:
    """One rank. "save": per kind, step 1 → full state (after1) → background save (ckpt) → step 2
    while it writes → wait → full state (after2); then load ckpt into a fresh sharded model (2 → 2).
    "load": per kind and per checkpoint in out/<kind>/ (written at world 1), load into a fresh sharded
    model → full state (loaded_<name>) → one step → full state (stepped_<name>)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    sc.checkpoint_group(timeout=timedelta(seconds=60))  # made up front, by every rank
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict[str, float] = {}
    for kind in KINDS:
        root = out / kind
        if scenario == "save":
            model, optimizer = _sharded(model_dir, kind, world)
            train_step(model, optimizer, world)
            after1 = full_state(model, optimizer)
            pending = sc.save_model_and_optimizer(root / "ckpt", model, optimizer)
            train_step(model, optimizer, world)  # changes the live tensors while the save is written
            assert pending.result(timeout=60) == root / "ckpt"
            after2 = full_state(model, optimizer)
            fresh, fresh_optimizer = _sharded(model_dir, kind, world)
            sc.load_model_and_optimizer(root / "ckpt", fresh, fresh_optimizer)
            reloaded = full_state(fresh, fresh_optimizer)
            if rank == 0:
                save_file(after1, str(root / "after1.safetensors"))
                save_file(after2, str(root / "after2.safetensors"))
                report[f"{kind}/2to2"] = max_diff(reloaded, after1)
        else:
            for name in sorted(p.name for p in root.iterdir() if p.is_dir()):
                model, optimizer = _sharded(model_dir, kind, world)
                sc.load_model_and_optimizer(root / name, model, optimizer)
                loaded = full_state(model, optimizer)
                train_step(model, optimizer, world)
                stepped = full_state(model, optimizer)
                if rank == 0:
                    save_file(loaded, str(root / f"loaded_{name}.safetensors"))
                    save_file(stepped, str(root / f"stepped_{name}.safetensors"))
    if rank == 0:
        (out / f"report_{scenario}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the test side


def torchrun(scenario: str, out: Path, model_dir: Path) -> None:
    """Run the 2-rank worker under torchrun; on timeout kill its whole process group (its workers)."""
    # --standalone: torchrun binds a free port itself (no port picked here and lost to a race)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, scenario, str(out), str(model_dir)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun {scenario} timed out:\n{output[-4000:]}")
    assert proc.returncode == 0, f"torchrun {scenario} failed:\n{output[-6000:]}"


@pytest.fixture(scope="module")
def saved_at_two(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Checkpoints written by 2 ranks (per kind: ckpt/, after1/after2 full states, 2 → 2 report)."""
    out = tmp_path_factory.mktemp("saved_at_two")
    torchrun("save", out, tiny_model_dir)
    return out


@pytest.fixture(scope="module")
def saved_at_one(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Per kind, after one step of a plain 1-rank model: checkpoint.py's single-file checkpoint
    (single/) and a DCP one written without a process group (dcp/), their full state (after1) and
    the next step's (after2); then 2 ranks load each and step once (loaded_*/stepped_*)."""
    out = tmp_path_factory.mktemp("saved_at_one")
    for kind in KINDS:
        root = out / kind
        model = build(tiny_model_dir, kind)
        optimizer = adamw(model)
        train_step(model, optimizer, world=1)
        root.mkdir()
        save_file(full_state(model, optimizer), str(root / "after1.safetensors"))
        state = ckpt.TrainerState(1, 1, "batch-1", "grpo", str(tiny_model_dir))
        snap = ckpt.snapshot(state, trainable_state(model), optimizer.state_dict(), {})
        written = ckpt.save_checkpoint(root / "runs", snap, keep=1)
        written.rename(root / "single")
        pending = sc.save_model_and_optimizer(root / "dcp", model, optimizer)
        train_step(model, optimizer, world=1)  # in place, while the staged copies are written
        assert pending.result(timeout=60) == root / "dcp"
        save_file(full_state(model, optimizer), str(root / "after2.safetensors"))
        (root / "runs").rmdir()
    torchrun("load", out, tiny_model_dir)
    return out


def test_format_of(tmp_path: Path) -> None:
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "model.safetensors").write_bytes(b"")
    (tmp_path / "single" / "optimizer.pt").write_bytes(b"")
    assert sc.format_of(tmp_path / "dcp") == "dcp"
    assert sc.format_of(tmp_path / "single") == "single"
    with pytest.raises(ValueError, match="no model checkpoint"):
        sc.format_of(tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_two_rank_checkpoint_resumes_on_one_rank(saved_at_two: Path, tiny_model_dir: Path, kind: str) -> None:
    """2 → 1: a plain model without a process group loads the 2-rank checkpoint (taken while the next
    step ran) with the 2-rank run's full params and AdamW moments, and its next step equals the
    2-rank run's next step."""
    root = saved_at_two / kind
    assert sc.format_of(root / "ckpt") == "dcp"
    model = build(tiny_model_dir, kind)
    optimizer = adamw(model)
    sc.load_model_and_optimizer(root / "ckpt", model, optimizer)
    assert optimizer.param_groups[0]["lr"] == LR_AFTER  # the saved LR, not this optimizer's
    loaded = full_state(model, optimizer)
    assert max_diff(loaded, load_file(str(root / "after1.safetensors"))) <= TOL
    train_step(model, optimizer, world=1)
    assert max_diff(full_state(model, optimizer), load_file(str(root / "after2.safetensors"))) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_two_rank_checkpoint_resumes_on_two_ranks(saved_at_two: Path, kind: str) -> None:
    """2 → 2: fresh sharded model + optimizer loaded from the checkpoint equal the saved full state."""
    report = json.loads((saved_at_two / "report_save.json").read_text())
    assert report[f"{kind}/2to2"] <= TOL


def test_checkpoint_holds_the_trainable_parameters(saved_at_two: Path, tiny_model_dir: Path) -> None:
    """The DCP checkpoint of a LoRA model stores the LoRA tensors only (and AdamW moments only for
    them), not the frozen base; the full model's stores the same names as checkpoint.py's."""
    import torch.distributed.checkpoint as dcp

    def keys(kind: str) -> list[str]:
        metadata = dcp.FileSystemReader(str(saved_at_two / kind / "ckpt")).read_metadata()
        stored = metadata.state_dict_metadata
        moments = [k for k in stored if k.startswith("optimizer.state.") and k.endswith(".exp_avg")]
        assert len(moments) == len([k for k in stored if k.startswith("model.")])
        return [k for k in stored if k.startswith("model.")]

    lora, full = keys("lora"), keys("full")
    assert lora and all(".lora_A." in k or ".lora_B." in k for k in lora), lora  # no tied lm_head either
    assert len(lora) == 2 * 2 * 2  # 2 layers × {q, v} × {A, B}
    plain = build(tiny_model_dir, "full")  # the keys of checkpoint.py's model.safetensors
    assert sorted(full) == sorted(f"model.{k}" for k in trainable_state(plain))  # tied lm_head once


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["single", "dcp"])
def test_one_rank_checkpoint_resumes_on_two_ranks(saved_at_one: Path, kind: str, fmt: str) -> None:
    """1 → 2: checkpoint.py's single-file checkpoint and a DCP one written without a process group
    load into 2 FSDP2 ranks with the 1-rank state, and their next step equals the 1-rank next step."""
    root = saved_at_one / kind
    assert sc.format_of(root / fmt) == fmt
    after1 = load_file(str(root / "after1.safetensors"))
    assert max_diff(load_file(str(root / f"loaded_{fmt}.safetensors")), after1) <= TOL
    after2 = load_file(str(root / "after2.safetensors"))
    assert max_diff(load_file(str(root / f"stepped_{fmt}.safetensors")), after2) <= TOL


def test_save_before_the_first_step_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Before any step the optimizer has no state; DCP would make some up (step 1), so no save."""
    model = build(tiny_model_dir, "full")
    with pytest.raises(ValueError, match="no optimizer step yet"):
        sc.save_model_and_optimizer(tmp_path / "ckpt", model, adamw(model))
    assert not (tmp_path / "ckpt").exists()


def test_mismatched_checkpoint_is_refused(saved_at_two: Path, tiny_model_dir: Path) -> None:
    """A LoRA checkpoint does not load into a full model (its parameters are missing)."""
    model = build(tiny_model_dir, "full")
    with pytest.raises(ValueError, match="does not match"):
        sc.load_model_and_optimizer(saved_at_two / "lora" / "ckpt", model, adamw(model))


if __name__ == "__main__":  # the torchrun worker: <scenario> <out dir> <model dir>
    _worker(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
