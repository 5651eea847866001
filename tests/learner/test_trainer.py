"""Training mechanics on a micro model: accumulation exactness, resume, LoRA export, scoring, schedules."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.advantages import LossKind
from services.common.cpus import BusyFile
from services.learner import checkpoint as ckpt
from services.learner.batching import Sample, collate, collate_shared, plan_micro_batches, plan_shared
from services.learner.checkpoint import list_checkpoints
from services.learner.config import (
    CPU_MICRO_BATCH_TOKENS,
    BorrowConfig,
    CheckpointConfig,
    LearnerSettings,
    LoraConfig,
    LossConfig,
    OptimConfig,
    PublishConfig,
)
from services.learner.model import repeated_blocks, token_logprobs
from services.learner.trainer import Trainer, lr_factor


def make_trainer(model_dir: Path, **kwargs) -> Trainer:
    """A Trainer on `model_dir` with LearnerSettings sections given as keyword arguments."""
    return Trainer(LearnerSettings(model=str(model_dir), device="cpu", **kwargs))


def scored(prompt: list[int], completion: list[int], temperature: float) -> Sample:
    """A Sample for Trainer.score: only the tokens and the temperature matter."""
    return Sample(tuple(prompt), tuple(completion), (0.0,) * len(completion), 0.0, temperature)


def grads(trainer: Trainer) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in trainer.params]


# ---------------------------------------------------------------- batching


def test_plan_respects_padded_budget_and_covers_every_sample():
    lengths = [3, 9, 4, 4, 8, 1, 2]
    plan = plan_micro_batches(lengths, token_budget=10)
    assert sorted(i for group in plan for i in group) == list(range(len(lengths)))
    for group in plan:
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 10


def test_collate_aligns_completion_positions_with_the_predicting_logits():
    mb = collate([Sample((5, 6), (7, 8, 9), (-1.0, -2.0, -3.0), 0.5), Sample((1,), (2,), (-0.5,), -1.0, 0.7)])
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    assert mb.positions.tolist() == [[1, 2, 3], [0, 0, 0]]  # logits at p-1+k predict completion token k
    assert mb.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert mb.behav.tolist() == [[-1, -2, -3], [-0.5, 0, 0]]
    assert mb.temperature.tolist() == pytest.approx([1.0, 0.7])


def _groups(seed: int = 3) -> list[Sample]:
    """Two prompts of 4 completions each (G = 4) and three samples whose prompts no other shares (one of
    them a one-token prompt, which is never a prefix), shuffled: the learner gets groups in any order."""
    rng = random.Random(seed)

    def sample(prompt: tuple[int, ...]) -> Sample:
        completion = tuple(rng.randrange(64) for _ in range(rng.randint(1, 7)))
        behav = tuple(-4.16 + rng.uniform(-0.3, 0.3) for _ in completion)
        return Sample(prompt, completion, behav, rng.uniform(-1.5, 1.5), 0.7)

    prompts = [(3, 9, 27, 4, 1), (8, 8, 2)]
    out = [sample(p) for p in prompts for _ in range(4)] + [sample((5, 6)), sample((7,)), sample((1, 2, 3))]
    rng.shuffle(out)
    return out


def test_collate_shared_packs_the_prompt_once_and_each_row_from_its_last_token():
    group = [
        Sample((5, 6, 4), (7, 8, 9), (-1.0, -2.0, -3.0), 0.5),
        Sample((5, 6, 4), (2,), (-0.5,), -1.0, 0.7),
    ]
    mb = collate_shared(group)
    # the prompt but its last token, then per row: the prompt's last token, the completion but its last
    assert mb.input_ids.tolist() == [[5, 6, 4, 7, 8, 4]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 2]]  # each row's positions continue the prompt's
    assert mb.attention_mask.int().tolist() == [[[
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],  # row 0: the prompt and itself, causally
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 0, 0, 0, 1],  # row 1: the prompt and itself, never row 0
    ]]]  # fmt: skip
    assert mb.positions.tolist() == [[2, 3, 4], [5, 0, 0]]  # the packed positions predicting each token
    assert mb.completion_ids.tolist() == [[7, 8, 9], [2, 0, 0]] and mb.mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_plan_shared_gives_each_shared_prompt_micro_batches_of_its_own():
    samples = _groups()
    plan = plan_shared(samples, token_budget=16)
    assert sorted(i for group in plan for i in group) == list(range(len(samples)))
    for group in plan:
        prompts = {samples[i].prompt_ids for i in group}
        if len(prompts) > 1 or len(group) == 1:
            continue
        packed = len(samples[group[0]].prompt_ids) - 1 + sum(len(samples[i].completion_ids) for i in group)
        assert packed <= 16
    shared = [g for g in plan if len(g) > 1 and len({samples[i].prompt_ids for i in g}) == 1]
    assert {samples[g[0]].prompt_ids for g in shared} == {(3, 9, 27, 4, 1), (8, 8, 2)}
    mixed = [g for g in plan if g not in shared]  # the rest, as plan_micro_batches plans them
    assert all(len(samples[i].prompt_ids) < 2 or samples[i].prompt_ids in {(5, 6), (1, 2, 3)}
               for g in mixed for i in g)  # fmt: skip


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_a_shared_prompt_gives_the_same_step_for_less_compute(micro_model_dir, kl_beta):
    samples = _groups()
    plain = make_trainer(micro_model_dir, shared_prefix=False, loss=LossConfig(kl_beta=kl_beta))
    shared = make_trainer(micro_model_dir, loss=LossConfig(kl_beta=kl_beta))
    assert shared.shared_prefix and not plain.shared_prefix
    embedded: dict[str, list[tuple[int, ...]]] = {"plain": [], "shared": []}  # every forward's input ids
    for name, trainer in (("plain", plain), ("shared", shared)):
        for model in (trainer.model, trainer.ref_model):  # the KL's reference model (full fine-tune)
            if model is not None:
                model.get_input_embeddings().register_forward_hook(
                    lambda m, args, out, name=name: embedded[name].append(tuple(args[0].shape))
                )
    for kind in LossKind:
        figures, logprobs = [], []
        for trainer in (plain, shared):
            trainer.loss_cfg = LossConfig(kind=kind, kl_beta=kl_beta, max_completion_len=7)
            trainer.optimizer.zero_grad(set_to_none=True)
            collected: dict[int, torch.Tensor] = {}
            figures.append(trainer.accumulate_gradients(samples, logprobs=collected))
            logprobs.append(collected)
        assert figures[1]["loss"] == pytest.approx(figures[0]["loss"], rel=1e-5, abs=1e-7), kind
        assert figures[1]["num_tokens"] == figures[0]["num_tokens"]
        for a, b in zip(grads(shared), grads(plain), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert logprobs[0].keys() == logprobs[1].keys() == set(range(len(samples)))
        for i, row in logprobs[0].items():
            torch.testing.assert_close(logprobs[1][i], row, rtol=0, atol=1e-5)
    # each shared prompt's rows went in packed, one sequence per micro-batch with the prompt once:
    # fewer tokens in all (the reference model's forwards too)
    packed = sorted(
        (1, len(samples[g[0]].prompt_ids) - 1 + sum(len(samples[i].completion_ids) for i in g))
        for g in plan_shared(samples, shared.token_budget)
        if len(g) > 1 and len({samples[i].prompt_ids for i in g}) == 1
    )  # fmt: skip
    assert len(packed) == 2  # one micro-batch per shared prompt (the default budget holds each)
    passes = len(LossKind) * (2 if kl_beta else 1)
    assert sorted(s for s in embedded["shared"] if s in packed) == sorted(packed * passes)
    assert sum(math.prod(s) for s in embedded["shared"]) < sum(math.prod(s) for s in embedded["plain"])


# ---------------------------------------------------------------- accumulation


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_grad_accumulation_equals_one_big_batch_for_every_objective(micro_model_dir, kl_beta, make_samples):
    trainer = make_trainer(micro_model_dir, loss=LossConfig(kl_beta=kl_beta))
    samples = make_samples(9, seed=1)
    for kind in LossKind:
        trainer.loss_cfg = LossConfig(kind=kind, kl_beta=kl_beta, max_completion_len=7)
        trainer.optimizer.zero_grad(set_to_none=True)
        big = trainer.accumulate_gradients(samples, token_budget=10_000)
        full = grads(trainer)
        trainer.optimizer.zero_grad(set_to_none=True)
        small = trainer.accumulate_gradients(samples, token_budget=12)
        assert big["micro_batches"] == 1 and small["micro_batches"] >= 4
        assert small["loss"] == pytest.approx(big["loss"], rel=1e-5, abs=1e-7), kind
        for a, b in zip(grads(trainer), full, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_the_micro_batch_budget_follows_the_device_unless_set(micro_model_dir, make_samples):
    by_device = make_trainer(micro_model_dir)
    assert by_device.token_budget == CPU_MICRO_BATCH_TOKENS
    samples = make_samples(9, seed=1)
    assert by_device.accumulate_gradients(samples)["micro_batches"] == 1  # 9 short samples fit in 1024
    small = make_trainer(micro_model_dir, micro_batch_tokens=12)
    assert small.token_budget == 12
    assert small.accumulate_gradients(samples)["micro_batches"] >= 4


def _borrowing_trainer(model_dir, tmp_path, **settings) -> tuple[Trainer, BusyFile]:
    """A trainer on one core that may borrow a second from a rollout's busy file (skips on 1 core)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    busy = BusyFile(tmp_path / "rollout-0.busy")
    borrow = BorrowConfig(cpus=str(cores[0]), busy_files=[busy.path])
    return make_trainer(model_dir, cpus=str(cores[1]), borrow=borrow, **settings), busy


def test_micro_batches_borrow_the_rollouts_cores_only_while_it_is_idle(
    micro_model_dir, make_samples, tmp_path
):
    trainer, busy = _borrowing_trainer(micro_model_dir, tmp_path, micro_batch_tokens=12)
    samples = make_samples(9, seed=1)
    counts: list[tuple[float, float]] = []

    def model_thread() -> None:  # the borrower changes the calling thread's affinity: not pytest's
        for state in (False, True):
            busy.set(state)
            out = trainer.accumulate_gradients(samples)
            counts.append((out["borrowed_micro_batches"], out["micro_batches"]))

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    (idle_borrowed, idle_total), (busy_borrowed, _) = counts
    assert idle_total >= 4 and idle_borrowed == idle_total and busy_borrowed == 0


def test_the_learner_looks_at_the_lenders_again_before_each_block(micro_model_dir, make_samples, tmp_path):
    """Not only at each pass's start: a rollout that wakes during block 0's forward has its core back
    from block 1 on; one that goes idle as the backward leaves the LM head lends it to every block's
    backward. The metric counts the share of looks that borrowed, in micro-batches."""
    trainer, busy = _borrowing_trainer(micro_model_dir, tmp_path, micro_batch_tokens=4096)
    blocks = repeated_blocks(trainer.model)
    assert len(blocks) == 2 and all(type(b).__name__ == "Qwen2DecoderLayer" for b in blocks)
    threads: list[int] = []
    out: dict[str, float] = {}

    def model_thread() -> None:  # the borrower changes the calling thread's affinity: not pytest's
        busy.set(False)
        hooks = [blocks[0].register_forward_hook(lambda *_: busy.set(True))]
        hooks += [
            b.register_forward_pre_hook(lambda *_: threads.append(torch.get_num_threads())) for b in blocks
        ]
        head = trainer.model.get_output_embeddings()
        hooks.append(head.register_full_backward_hook(lambda *_: busy.set(False)))
        out.update(trainer.accumulate_gradients(make_samples(3, seed=2)))
        for hook in hooks:
            hook.remove()

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    assert threads == [2, 1]  # block 0 on both cores, block 1 (after the rollout woke) on its own
    # looks: forward start and block 0 idle, block 1 busy, backward start busy, both blocks' backward idle
    assert out["micro_batches"] == 1 and out["borrowed_micro_batches"] == pytest.approx(4 / 6)


def test_gradient_checkpointing_gives_the_same_gradients(micro_model_dir, make_samples):
    samples = make_samples(4, seed=3)
    results = []
    for checkpointing in (False, True):
        trainer = make_trainer(micro_model_dir, gradient_checkpointing=checkpointing, lora=LoraConfig(rank=2))
        trainer.accumulate_gradients(samples)
        results.append(grads(trainer))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b)


def test_positive_advantage_raises_the_sequence_logprob(micro_model_dir):
    trainer = make_trainer(micro_model_dir, loss=LossConfig(kind="dapo"), optim=OptimConfig(lr=1e-2))
    prompt, completion = [3, 4, 5], [6, 7, 8]
    before = sum(trainer.score(scored(prompt, completion, 1.0)))
    behav = tuple(trainer.score(scored(prompt, completion, 1.0)))
    outcomes = [
        trainer.train_step([Sample(tuple(prompt), tuple(completion), behav, 1.0)], f"b{step}")
        for step in range(3)
    ]
    after = sum(trainer.score(scored(prompt, completion, 1.0)))
    assert after > before + 0.1
    assert outcomes[-1].weight_version == 3 and trainer.step == 3
    assert outcomes[0].metrics["grad_norm"] > 0 and math.isfinite(outcomes[0].metrics["loss"])
    # the ratio against the fixed behaviour policy grows until clip-higher stops the updates
    assert outcomes[-1].metrics["ratio_mean"] > outcomes[0].metrics["ratio_mean"]


# ---------------------------------------------------------------- scoring and export


def test_score_equals_direct_log_softmax(micro_model_dir):
    trainer = make_trainer(micro_model_dir)
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32).eval()
    prompt, completion, temperature = [1, 2, 3, 4], [5, 6, 7], 0.7
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].double()  # [L, V]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    expected = [logprobs[len(prompt) - 1 + k, tok].item() for k, tok in enumerate(completion)]
    assert trainer.score(scored(prompt, completion, temperature)) == pytest.approx(expected, abs=1e-5)


def test_batched_logprobs_use_only_completion_logits_and_match_each_row_alone(micro_model_dir, make_samples):
    # prompts of 1..9 tokens and completions of 1..7 in one right-padded micro-batch: the LM head runs
    # only on the completion-predicting rows, and every row still equals its own full forward
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32).eval()
    samples = make_samples(12, seed=5, max_prompt=9, max_completion=7)
    samples.append(Sample((1,) * 9, (2,), (-4.0,), 1.0, 1.0))
    with torch.no_grad():
        logp, entropy = token_logprobs(model, collate(samples), with_entropy=True)  # [B, T]
        for row, s in enumerate(samples):
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            full = torch.log_softmax(model(input_ids=ids).logits[0].double() / s.temperature, dim=-1)
            p = len(s.prompt_ids)
            expected = [full[p - 1 + k, tok].item() for k, tok in enumerate(s.completion_ids)]
            assert logp[row, : len(expected)].tolist() == pytest.approx(expected, abs=1e-5)
            assert torch.isfinite(entropy[row]).all()


def test_full_export_has_hf_names_and_tied_lm_head(micro_model_dir):
    trainer = make_trainer(micro_model_dir)
    state = trainer.export()
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    torch.testing.assert_close(state["lm_head.weight"], state["model.embed_tokens.weight"])


def test_lora_merged_export_equals_peft_forward(micro_model_dir, make_samples):
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    trainer = make_trainer(micro_model_dir, lora=lora, optim=OptimConfig(lr=5e-2))
    for step in range(2):  # move LoRA B away from its zero init
        trainer.train_step(make_samples(4, seed=step), f"b{step}")
    state = trainer.export()
    assert not any("lora" in k or "base_layer" in k or k.startswith("base_model") for k in state)
    plain = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32)
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state, strict=True)
    plain.eval()
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        got = plain(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32)(
            input_ids=ids
        ).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert (expected - base).abs().max() > 1e-3  # the adapter really changed the model


def test_adapter_only_export(micro_model_dir):
    trainer = make_trainer(
        micro_model_dir, lora=LoraConfig(rank=2), publish=PublishConfig(export_format="adapter")
    )
    state = trainer.export()
    assert state and all("lora_" in k for k in state)


# ---------------------------------------------------------------- checkpoints


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("lora", [LoraConfig(), LoraConfig(rank=4, dropout=0.2)])
def test_resume_equals_uninterrupted_run(micro_model_dir, tmp_path, lora, make_samples):
    batches = [make_samples(5, seed=10 + i) for i in range(4)]
    opts = {
        "lora": lora,
        "loss": LossConfig(kind="dapo"),
        "optim": OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", total_steps=6, weight_decay=0.01),
    }
    straight = make_trainer(micro_model_dir, **opts)
    for i, batch in enumerate(batches):
        straight.train_step(batch, f"b{i}")

    first = make_trainer(micro_model_dir, checkpoint=CheckpointConfig(dir=tmp_path), **opts)
    for i, batch in enumerate(batches[:2]):
        first.train_step(batch, f"b{i}")
    first.save_checkpoint()  # what Learner.stop does on SIGTERM
    del first
    resumed = make_trainer(micro_model_dir, checkpoint=CheckpointConfig(dir=tmp_path, resume=True), **opts)
    assert (resumed.step, resumed.weight_version, resumed.last_batch_id) == (2, 2, "b1")
    for i, batch in enumerate(batches[2:], start=2):
        outcome = resumed.train_step(batch, f"b{i}")

    assert outcome.weight_version == straight.weight_version == 4
    expected = _state(straight)
    for name, value in _state(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7, msg=name)
    assert resumed.scheduler.get_last_lr() == pytest.approx(straight.scheduler.get_last_lr())


def test_periodic_checkpoints_are_atomic_and_pruned(micro_model_dir, tmp_path, make_samples):
    trainer = make_trainer(micro_model_dir, checkpoint=CheckpointConfig(dir=tmp_path, every=1, keep=2))
    for i in range(3):
        trainer.train_step(make_samples(2, seed=i), f"b{i}")
    trainer.writer.wait()  # the last one is written in the background
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_00000002", "step_00000003"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert trainer.save_checkpoint() is None  # this step is already saved


def test_background_checkpoint_is_the_state_at_its_step(micro_model_dir, tmp_path, make_samples, monkeypatch):
    """Training goes on while the step-2 checkpoint is written; what is written is step 2's state (the
    optimizer's moments change in place), so resuming from it equals the uninterrupted run."""
    batches = [make_samples(5, seed=20 + i) for i in range(4)]
    opts = {"optim": OptimConfig(lr=1e-2, warmup_steps=1, weight_decay=0.01)}
    straight = make_trainer(micro_model_dir, **opts)
    for i, batch in enumerate(batches):
        straight.train_step(batch, f"b{i}")

    release = threading.Event()
    real_save = ckpt.save_checkpoint

    def held_save(*args, **kwargs):
        assert release.wait(timeout=30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", held_save)
    first = make_trainer(micro_model_dir, checkpoint=CheckpointConfig(dir=tmp_path, every=2), **opts)
    for i, batch in enumerate(batches[:3]):
        first.train_step(batch, f"b{i}")  # step 3 trains while step 2's write is held
    assert list_checkpoints(tmp_path) == []
    release.set()
    assert first.writer.wait() == tmp_path / "step_00000002"
    del first

    resumed = make_trainer(micro_model_dir, checkpoint=CheckpointConfig(dir=tmp_path, resume=True), **opts)
    assert (resumed.step, resumed.last_batch_id) == (2, "b1")
    for i, batch in enumerate(batches[2:], start=2):
        resumed.train_step(batch, f"b{i}")
    expected = _state(straight)
    for name, value in _state(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7, msg=name)


def test_checkpoint_at_stop_writes_again_after_a_failed_background_write(
    micro_model_dir, tmp_path, make_samples, monkeypatch
):
    real_save = ckpt.save_checkpoint
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(args[1].state.step)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", failing_once)
    trainer = make_trainer(micro_model_dir, checkpoint=CheckpointConfig(dir=tmp_path, every=1))
    trainer.train_step(make_samples(2, seed=0), "b0")  # its background write fails (and is logged)
    with pytest.raises(OSError, match="No space"):
        trainer.writer.wait()
    assert trainer.save_checkpoint() == tmp_path / "step_00000001"  # what Learner.stop does
    assert calls == [1, 1]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert trainer.save_checkpoint() is None  # on disk now


def test_half_written_checkpoints_of_dead_writers_are_removed_at_start(micro_model_dir, tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    live = os.getppid()  # a live process that might be writing there: left alone
    for pid in (int(gone.stdout), os.getpid(), live):
        (tmp_path / f".tmp-step_00000007-{pid}").mkdir()
        (tmp_path / f".tmp-step_00000007-{pid}" / "model.safetensors").write_bytes(b"partial")
    make_trainer(micro_model_dir, checkpoint=CheckpointConfig(dir=tmp_path))
    assert [p.name for p in tmp_path.glob(".tmp-step_*")] == [f".tmp-step_00000007-{live}"]


_WRITER_KILLED_MID_WRITE = """
import os, sys, threading
from pathlib import Path
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/tests/learner"]
from conftest import random_samples
from services.learner import checkpoint as ckpt
from services.learner.config import CheckpointConfig, LearnerSettings
from services.learner.trainer import Trainer

real_save = ckpt.save_checkpoint


def say(*words):  # one write(2) per line: print() from two threads interleaves its pieces
    os.write(1, (" ".join(map(str, words)) + "\\n").encode())


def stalled_save(root, snap, keep):  # a disk that stalls for ever in the middle of step 2's write
    if snap.state.step < 2:
        return real_save(root, snap, keep)
    tmp = root / f".tmp-{ckpt.PREFIX}{snap.state.step:08d}-{os.getpid()}"
    tmp.mkdir()
    ckpt.save_file(snap.params, str(tmp / "model.safetensors"))
    say("stalled", snap.state.step)
    threading.Event().wait()


ckpt.save_checkpoint = stalled_save
trainer = Trainer(LearnerSettings(model=sys.argv[1], device="cpu",
                                  checkpoint=CheckpointConfig(dir=Path(sys.argv[2]), every=1)))
for i in range(2):
    trainer.train_step(random_samples(3, seed=i), f"b{i}")  # step 2 returns; its write stalls
say("trained", trainer.step)
threading.Event().wait()
"""


def test_a_learner_killed_mid_write_resumes_from_the_checkpoint_before(micro_model_dir, tmp_path):
    """A real process, SIGKILLed while its background writer is inside step 2's checkpoint (a stalled
    disk): step 1's checkpoint is intact, a new learner resumes from it and removes the half-written one."""
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER_KILLED_MID_WRITE, str(micro_model_dir), str(tmp_path), str(root)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(300, child.kill)  # a child that never says both ends the loop below
    watchdog.start()
    try:
        seen = set()
        for line in child.stdout:  # from its two threads in either order
            seen.add(line.strip())
            if {"trained 2", "stalled 2"} <= seen:
                break
        assert {"trained 2", "stalled 2"} <= seen, seen  # the step returned while its write was under way
        assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
        (half,) = tmp_path.glob(".tmp-step_00000002-*")
        assert (half / "model.safetensors").exists() and not (half / "state.json").exists()
    finally:
        watchdog.cancel()
        child.kill()  # SIGKILL
        child.wait(timeout=30)
    resumed = make_trainer(micro_model_dir, checkpoint=CheckpointConfig(dir=tmp_path, resume=True))
    assert (resumed.step, resumed.last_batch_id) == (1, "b0")
    assert not list(tmp_path.glob(".tmp-step_*"))


def test_resume_without_checkpoint_starts_fresh(micro_model_dir, tmp_path):
    trainer = make_trainer(micro_model_dir, checkpoint=CheckpointConfig(dir=tmp_path, resume=True))
    assert trainer.weight_version == 0


# ---------------------------------------------------------------- schedule


def test_lr_schedule_warmup_then_cosine():
    optim = OptimConfig(warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    factors = [lr_factor(s, optim) for s in range(7)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == pytest.approx(1.0)
    assert factors[4] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert factors[6] == pytest.approx(0.1)
    assert lr_factor(5, optim.model_copy(update={"schedule": "constant"})) == 1.0
