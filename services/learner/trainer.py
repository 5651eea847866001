"""Training mechanics: one optimizer step per TrainBatch, logprob scoring, export and checkpoints.

Synchronous and single-threaded by design: the service runs every method on one dedicated executor
thread, so the model is never used by two calls at once and the event loop never blocks. The one
other thread is the checkpoint writer's: it writes host snapshots, never touching the live model.

A step: plan micro-batches by padded token budget → for each, forward (bf16 autocast on GPU, fp32 on
CPU) → loss normalised by the *global* sequence/token counts → backward (gradients accumulate, so
N micro-batches give exactly the one-big-batch gradient for every objective) → clip → AdamW → LR
schedule → weight version + 1.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.cpus import CoreBorrower, parse_cpu_list
from services.common.logging import get_logger
from services.common.weights import dtype_from_name
from services.learner import checkpoint as ckpt
from services.learner import sharded_checkpoint, sharding
from services.learner.batching import (
    MicroBatch,
    Sample,
    collate,
    collate_shared,
    global_norm,
    plan_micro_batches,
    plan_shared,
    shares_prefix,
)
from services.learner.config import (
    ACCELERATOR_MICRO_BATCH_TOKENS,
    CPU_MICRO_BATCH_TOKENS,
    LearnerSettings,
    OptimConfig,
)
from services.learner.losses import LossStats, policy_loss
from services.learner.model import (
    autocast,
    export_state,
    is_lora,
    load_policy,
    load_reference,
    load_trainable_state,
    repeated_blocks,
    resolve_compute_dtype,
    resolve_device,
    token_logprobs,
    trainable_state,
    vocab_size,
)
from services.learner.sharding import EMPTY_SAMPLE, Ranks

log = get_logger(__name__)


def lr_factor(step: int, optim: OptimConfig) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based): linear warmup, then constant/cosine."""
    if optim.warmup_steps > 0 and step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    span = max(1, optim.total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class StepOutcome:
    step: int
    weight_version: int
    metrics: dict[str, float]
    # per sample of the batch, in its order: the learner's fp32 logprob of each completion token under
    # the weights the step started from (its forward, before the update); [] on ranks other than 0
    logprobs: list[torch.Tensor] = field(default_factory=list)


class Trainer:
    """Owns the model, optimizer, LR schedule and weight version.

    With `ranks` (the learner under torchrun) every rank holds one: the model is sharded (sharding.py)
    and every method is called on every rank in the same order (ranks.py sees to it): each trains its
    share of a batch, and the metrics are those of the whole batch on every rank.
    """

    def __init__(self, settings: LearnerSettings, ranks: Ranks | None = None) -> None:
        self.settings = settings
        self.ranks = ranks
        self.loss_cfg = settings.loss
        torch.manual_seed(settings.seed)
        random.seed(settings.seed)
        self.device = resolve_device(settings.device)
        if ranks is not None:
            self.device = sharding.rank_device(self.device)
            if settings.borrow.cpus:
                raise ValueError("borrow.cpus is for a learner of one rank (its cores are the rollouts')")
        self.compute_dtype = resolve_compute_dtype(settings.dtype, self.device)
        self.token_budget = settings.micro_batch_tokens or (
            CPU_MICRO_BATCH_TOKENS if self.device.type == "cpu" else ACCELERATOR_MICRO_BATCH_TOKENS
        )
        self.borrower = None
        if settings.borrow.cpus and self.device.type == "cpu":
            own = parse_cpu_list(settings.cpus)  # validated: borrow.cpus adds at least one core
            self.borrower = CoreBorrower(
                own, parse_cpu_list(settings.borrow.cpus) - own, settings.borrow.busy_files
            )
        export_dtype = settings.publish.export_dtype
        self.export_dtype = None if export_dtype == "auto" else dtype_from_name(export_dtype)
        self.model = load_policy(settings.model, self.device, settings.lora, settings.gradient_checkpointing)
        # ranks: each rank plans its own share of the batch, in which a group may be split
        self.shared_prefix = settings.shared_prefix and ranks is None and packs(self.model.config)
        if ranks is not None:
            sharding.shard(self.model, ranks, self.compute_dtype, settings.distributed)
        self.model.eval()
        self._looks = [0, 0]  # [times the lenders were looked at, times they were idle] this step
        if self.borrower:
            self._watch_blocks()
        self.vocab_size = vocab_size(self.model)
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.ref_model = None
        if settings.loss.kl_beta > 0 and not is_lora(self.model):
            self.ref_model = load_reference(settings.model, self.device)  # LoRA: the base with adapters off
            if ranks is not None:
                sharding.shard(self.ref_model, ranks, self.compute_dtype, settings.distributed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = settings.optim
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=_fused_adamw(self.params),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, o))
        self.weight_version = 0
        self.step = 0
        self.last_batch_id = ""
        self.last_outcome: StepOutcome | None = None
        self._saved_step = 0  # newest step checkpointed or being written; 0 is the model as loaded
        root = settings.checkpoint.dir
        leads = ranks is None or ranks.leader  # rank 0 alone owns the directory's files
        self.lineage_id = ckpt.ensure_lineage(root) if root is not None and leads else ""
        self.writer: ckpt.CheckpointWriter | None = None
        self._files: sharded_checkpoint.PendingSave | None = None  # another rank's newest sharded save
        if root is not None and leads:
            self.writer = ckpt.CheckpointWriter(root, settings.checkpoint.keep)
            ckpt.remove_stale_tmp(root)
        if settings.checkpoint.resume:
            self._resume()

    # ------------------------------------------------------------------ training

    def accumulate_gradients(
        self,
        samples: list[Sample],
        token_budget: int | None = None,
        logprobs: dict[int, torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Forward/backward every micro-batch of `samples`; gradients end up in `.grad` (not zeroed first).

        Each micro-batch loss is divided by the global counts of `samples`, so the accumulated gradient
        equals the one-big-batch gradient of the objective whatever `token_budget` is. With a borrower,
        what follows a look that finds the co-located rollouts idle (at each forward and backward, and at
        each decoder layer's) also runs on their cores. `logprobs`, when given, receives the forward's
        logprobs of each sample this rank trains (index into `samples` → fp32 CPU [completion tokens],
        detached: the loss is computed exactly as without it).
        """
        norm = global_norm(samples)
        stats = LossStats()
        loss_total, entropy_sum = 0.0, 0.0
        budget = token_budget or self.token_budget
        mine = self._share(samples)  # indices into samples
        if self.shared_prefix:  # a prompt several samples share runs once per micro-batch
            plan = plan_shared(samples, budget)  # one rank: mine is every sample
            mbs = [_collate([samples[i] for i in group]) for group in plan]
        else:
            plan = [
                [mine[i] for i in group]
                for group in plan_micro_batches([samples[i].length for i in mine], budget)
            ]
            mbs = [collate([samples[i] for i in group]) for group in plan]
        real = len(mbs)
        if self.ranks is not None:  # as many passes as the rank with the most: FSDP's collectives pair up
            mbs += [collate([EMPTY_SAMPLE])] * (sharding.passes(samples, self.ranks.world, budget) - real)
        self._looks = [0, 0]
        forwards: list[torch.Tensor] = []  # each real micro-batch's logprobs, when collected
        self.model.train()
        try:
            for index, mb in enumerate(mbs):
                self._borrow()
                mb = mb.to(self.device)
                with autocast(self.device, self.compute_dtype):
                    logp, entropy = token_logprobs(self.model, mb, with_entropy=True)  # [B, T]
                ref_logp = self._ref_logprobs(mb) if self.loss_cfg.kl_beta > 0 else None
                out = policy_loss(logp, mb.behav, mb.mask, mb.adv, self.loss_cfg, norm, ref_logp)
                if logprobs is not None and index < real:  # to the host after the loop: no sync here
                    forwards.append(logp.detach().float())  # [B, T]
                self._borrow()  # backward is ~2/3 of a micro-batch: look again before it
                if index >= real:  # an empty pass: FSDP's collectives only, no gradient, no statistics
                    (out.loss * 0.0).backward()
                    continue
                out.loss.backward()
                loss_total += float(out.loss.detach())
                entropy_sum += float((entropy * mb.mask).sum())
                stats.add(out.stats)
        finally:
            self.model.eval()
            if self.borrower:
                self.borrower.give_back()
        if logprobs is not None:  # every real pass's rows, back to their samples
            for group, forward in zip(plan, forwards, strict=True):
                rows = forward.cpu()  # [B, T]
                for row, i in enumerate(group):
                    logprobs[i] = rows[row, : len(samples[i].completion_ids)].clone()
        if self.ranks is not None:  # the whole batch's figures, on every rank
            sums, maxima = sharding.reduce_sums(
                self.ranks,
                {**stats.sums, "loss": loss_total, "entropy": entropy_sum, "micro_batches": float(real)},
                {"ratio_max": stats.ratio_max},
            )
            loss_total, entropy_sum = sums.pop("loss"), sums.pop("entropy")
            real = int(sums.pop("micro_batches"))
            stats.sums, stats.ratio_max = sums, maxima["ratio_max"]
        return {
            "loss": loss_total,
            "entropy": entropy_sum / max(norm.num_tokens, 1),
            "num_seqs": float(norm.num_seqs),
            "num_tokens": float(norm.num_tokens),
            "micro_batches": float(real),  # over every rank
            # micro-batches' worth on borrowed cores: the share of looks that found the lenders idle
            "borrowed_micro_batches": real * self._looks[1] / max(1, self._looks[0]),
            **stats.finalize(),
        }

    def _share(self, samples: list[Sample]) -> list[int]:
        """Indices of the samples this rank trains on (all of them for a learner of one rank)."""
        if self.ranks is None:
            return list(range(len(samples)))
        return sharding.share_indices(samples, self.ranks.rank, self.ranks.world)

    def _borrow(self) -> None:
        """Take the lent cores for what follows if the lenders are idle now, else give them back."""
        if self.borrower and self.model.training:
            self._looks[0] += 1
            self._looks[1] += self.borrower.borrow()

    @contextlib.contextmanager
    def on_idle_cores(self) -> Iterator[None]:
        """Run the block on the lenders' cores too if they are idle as it starts (one look; with no
        borrower, on the learner's own cores). Call it on the model thread."""
        if self.borrower:
            self.borrower.borrow()
        try:
            yield
        finally:
            if self.borrower:
                self.borrower.give_back()

    def _watch_blocks(self) -> None:
        """Look at the lenders again before each repeated block's forward and backward, not only at
        each pass's start: a pass of a ~30M model takes 0.3–0.7 s on one core, and a rollout that goes
        idle (or wakes) mid-pass would otherwise leave its core unused (or shared) for the rest of it."""

        def before_forward(module: torch.nn.Module, args: object) -> None:
            self._borrow()

        def after_forward(module: torch.nn.Module, args: object, output: object) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(lambda grad: self._borrow())  # runs as the block's backward starts

        for block in repeated_blocks(self.model):
            block.register_forward_pre_hook(before_forward)
            block.register_forward_hook(after_forward)

    def train_step(
        self, samples: list[Sample], batch_id: str, rewards: list[float] | None = None
    ) -> StepOutcome:
        """One optimizer step on `samples` (already validated)."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        collected: dict[int, torch.Tensor] = {}
        loss_metrics = self.accumulate_gradients(samples, logprobs=collected)
        if self.ranks is not None:  # every rank's share, on rank 0
            logprobs = sharding.gather_logprobs(self.ranks, samples, collected)
        else:
            logprobs = [collected[i] for i in range(len(samples))]
        clip = self.settings.optim.max_grad_norm
        max_norm = clip if clip > 0 else float("inf")
        with self.on_idle_cores():  # the update too
            grad_norm = sharding.full_norm(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            lr = self.scheduler.get_last_lr()[0]
            finite = math.isfinite(grad_norm)
            if finite:
                self.optimizer.step()
            else:
                log.warning(
                    "non-finite gradient norm: update skipped", grad_norm=grad_norm, batch_id=batch_id
                )
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.weight_version += 1
        self.last_batch_id = batch_id
        elapsed = time.perf_counter() - started
        num_tokens = loss_metrics["num_tokens"]
        metrics = {
            **loss_metrics,
            "grad_norm": grad_norm,
            "lr": lr,
            "update_skipped": 0.0 if finite else 1.0,
            "step_time_s": elapsed,
            "tokens_per_s": num_tokens / elapsed if elapsed > 0 else 0.0,
            "adv_mean": sum(s.advantage for s in samples) / max(len(samples), 1),
            "completion_len_mean": num_tokens / max(loss_metrics["num_seqs"], 1.0),
        }
        if rewards:
            metrics["reward_mean"] = sum(rewards) / len(rewards)
        self.last_outcome = StepOutcome(self.step, self.weight_version, metrics, logprobs)
        every = self.settings.checkpoint.every
        if self.settings.checkpoint.dir and every > 0 and self.step % every == 0:
            self.save_checkpoint(background=self.settings.checkpoint.background)
        return self.last_outcome

    @torch.no_grad()
    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        with autocast(self.device, self.compute_dtype):
            if self.ref_model is not None:
                return token_logprobs(self.ref_model, mb)[0]
            with self.model.disable_adapter():
                return token_logprobs(self.model, mb)[0]

    # ------------------------------------------------------------------ scoring / export

    @torch.no_grad()
    def score(self, sample: Sample) -> list[float]:
        """Logprob of each completion token of `sample` (already validated) at its temperature under
        the current weights (eval mode)."""
        mb = collate([sample]).to(self.device)
        with autocast(self.device, self.compute_dtype):
            logp, _ = token_logprobs(self.model, mb)
        return logp[0].float().cpu().tolist()

    def export(self, snapshot: bool = True) -> dict[str, torch.Tensor]:
        """The weights to publish (see model.export_state): a CPU snapshot, or the live tensors. Sharded:
        a collective that gathers every tensor first (host copies, or with `snapshot=False` device
        tensors); rank 0 returns them, the others {}."""
        fmt = self.settings.publish.export_format
        if self.ranks is None:
            return export_state(self.model, fmt, self.export_dtype, snapshot)
        state = sharding.full_state(self.model, on_cpu=snapshot)  # gathered: new tensors, but a rank
        if not self.ranks.leader:  # alone holds whole shards, which it returns as they are: the live ones
            return {}
        copy = snapshot and self.ranks.world == 1
        return export_state(self.model, fmt, self.export_dtype, snapshot=copy, state=state)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, background: bool = False) -> Path | None:
        """Checkpoint the current state atomically, unless this step is already saved.

        `background`: return once the state is snapshotted; the writer thread puts it on disk (periodic
        checkpoints, `checkpoint.background`). Otherwise wait until it is on disk (stop), also for a
        background write of this step, and write again if that one failed. Returns the path written
        now, or None.
        """
        if self.ranks is not None:
            return self._save_sharded(background)
        if self.writer is None:  # no checkpoint directory
            return None
        if not background:
            with contextlib.suppress(Exception):  # logged by the writer; this step is written again below
                self.writer.wait()
            if self.writer.durable_step == self.step:
                return None
        elif self._saved_step == self.step:
            return None
        state = ckpt.TrainerState(
            self.weight_version,
            self.step,
            self.last_batch_id,
            self.loss_cfg.kind,
            self.settings.model,
            self.lineage_id,
        )
        snap = ckpt.snapshot(
            state, trainable_state(self.model), self.optimizer.state_dict(), self.scheduler.state_dict()
        )
        self.writer.submit(snap)
        self._saved_step = self.step
        return None if background else self.writer.wait()

    def _save_sharded(self, background: bool) -> Path | None:
        """`save_checkpoint` of a learner of several ranks, on every rank: each writes its shards of the
        model and optimizer into one directory (sharded_checkpoint.py); rank 0's writer thread adds the
        schedule, RNG and state and renames it into place once every rank's files are complete. The
        ranks decide alike whether there is anything to save (`_saved_step`), as every rank saves."""
        root = self.settings.checkpoint.dir
        if root is None or self.ranks is None:
            return None
        # no optimizer state yet (every update so far skipped): nothing a checkpoint would add
        if self._saved_step != self.step and self.optimizer.state:
            tmp = ckpt.sharded_tmp(root, self.step, self.ranks.leader_pid)
            tmp.mkdir(parents=True, exist_ok=True)
            files = sharded_checkpoint.save_model_and_optimizer(tmp, self.model, self.optimizer)
            self._saved_step = self.step
            if self.writer is not None:  # rank 0
                state = ckpt.TrainerState(
                    self.weight_version, self.step, self.last_batch_id, self.loss_cfg.kind,
                    self.settings.model, self.lineage_id,
                )  # fmt: skip
                schedule = copy.deepcopy(self.scheduler.state_dict())
                self.writer.submit(ckpt.ShardedSnapshot(state, schedule, ckpt.rng_state(), tmp, files))
            self._files = files
        if background:
            return None
        if self.writer is not None:
            return self.writer.wait()
        if self._files is not None:
            self._files.result()
        return None

    def close(self) -> None:
        """Finish a checkpoint under way and stop the writer thread (the trainer is being replaced)."""
        if self._files is not None:
            with contextlib.suppress(Exception):  # rank 0's writer logs a failed write
                self._files.result()
        if self.writer is not None:
            self.writer.wait_quietly()
            self.writer.close()

    def _resume(self) -> None:
        root = self.settings.checkpoint.dir
        assert root is not None  # resume needs a directory (CheckpointConfig)
        loaded = ckpt.load_latest(root, tensors=self.ranks is None)
        if loaded is None:
            log.info("no checkpoint to resume from; starting fresh", dir=str(root))
            return
        if self.lineage_id and loaded.state.lineage_id and loaded.state.lineage_id != self.lineage_id:
            raise ValueError(
                f"checkpoint {loaded.path} is of lineage {loaded.state.lineage_id}, but {root} is of "
                f"{self.lineage_id} ({ckpt.LINEAGE_FILE}): checkpoints of two runs are mixed"
            )
        if loaded.state.loss != self.loss_cfg.kind or loaded.state.model != self.settings.model:
            log.warning("resuming with a different loss/model", checkpoint=loaded.state.__dict__)
        if loaded.params is not None and loaded.optimizer is not None:  # one rank, checkpoint.py's format
            load_trainable_state(self.model, loaded.params)
            self.optimizer.load_state_dict(loaded.optimizer)
        else:  # sharded, or written by several ranks: any number of ranks reads it
            sharded_checkpoint.load_model_and_optimizer(loaded.path, self.model, self.optimizer)
        self.scheduler.load_state_dict(loaded.scheduler)
        ckpt.set_rng_state(loaded.rng)
        self.weight_version = loaded.state.weight_version
        self.step = loaded.state.step
        self.last_batch_id = loaded.state.last_batch_id
        self._saved_step = self.step
        if self.writer is not None:
            self.writer.durable_step = self.step
        log.info("resumed", path=str(loaded.path), step=self.step, weight_version=self.weight_version)


def _collate(samples: list[Sample]) -> MicroBatch:
    return collate_shared(samples) if shares_prefix(samples) else collate(samples)


def packs(config: object) -> bool:
    """Whether one prompt's rows may go packed into one sequence under a [1, 1, N, N] mask: an attention
    that takes such a mask (sdpa or eager, not flash-attention 2), and no sliding window (the mask would
    not say it)."""
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return attention in ("sdpa", "eager") and not sliding


def _fused_adamw(params: list[torch.nn.Parameter]) -> bool:
    """AdamW's fused kernel (one pass over each parameter, its gradient and both moments) wherever it
    runs: floating-point parameters on the CPU or CUDA. SmolLM2-135M's update on one core: 0.16 s
    fused against 0.67 s for the default per-tensor loop (1.07 s `foreach`)."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
