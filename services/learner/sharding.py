"""The learner as N ranks: the process group torchrun set up, FSDP2 sharding, and what crosses ranks.

`torchrun --nproc-per-node N -m services.learner ...` (or any launcher that sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT) starts N copies of the learner. Each loads the model and
shards it with FSDP2 (`fully_shard` on each decoder layer, then on the root), so parameters, gradients
and AdamW state are split N ways. Rank 0 serves the gRPC API and hands every model operation to the
others (`ranks.py`); each rank trains its share of a batch's samples. `distributed.shard_one_rank`
shards a learner that is the only rank too (a process group of one: CPU offload on one GPU).

Same numbers as one rank: the loss of every objective is normalised by the counts of the *whole* batch
(`losses.Norm`), so the sum over ranks of their gradients is the one-rank gradient. FSDP's
reduce-scatter therefore sums (divide factor 1) instead of averaging. The ranks run the same number
of forward/backward passes (FSDP's collectives pair up across ranks): a rank with fewer micro-batches
runs empty ones, whose loss is multiplied by 0.

On CPU the collectives are Gloo's (FSDP2 needs an explicit CPU device mesh); on CUDA, NCCL's, and the
parameters are gathered in the compute dtype while gradients are reduced in fp32. Every collective has
the deadline `distributed.timeout_s`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from services.common.parent_death import die_with_parent
from services.learner.batching import Sample, plan_micro_batches
from services.learner.config import DistributedConfig
from services.learner.model import repeated_blocks

# A sample for the empty micro-batches of a rank with fewer real ones: one prompt and one completion
# token, no advantage; its loss is multiplied by 0 before backward, so it adds nothing to any gradient.
EMPTY_SAMPLE = Sample(prompt_ids=(0,), completion_ids=(0,), behav_logprobs=(0.0,), advantage=0.0)


@dataclass(frozen=True)
class Ranks:
    """This process's place among the learner's ranks."""

    rank: int
    world: int
    local_rank: int
    mesh: DeviceMesh  # FSDP's: Gloo on CPU, NCCL on CUDA
    control: dist.ProcessGroup  # Gloo, CPU tensors: rank 0's commands and the metrics' reductions
    leader_pid: int  # rank 0's process id (names the directory a sharded checkpoint is written into)

    @property
    def leader(self) -> bool:
        return self.rank == 0


def world_size() -> int:
    """Ranks torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_device(device: torch.device) -> torch.device:
    """The device of this rank: its own GPU (LOCAL_RANK) for cuda, the CPU as it is."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def join(device: torch.device, cfg: DistributedConfig) -> Ranks | None:
    """Join the process group torchrun describes (None when this is the only rank, unless
    `cfg.shard_one_rank`: then a group of one, torchrun's or, without torchrun, this process's own)."""
    world = world_size()
    if world <= 1 and not cfg.shard_one_rank:
        return None
    device = rank_device(device)
    launched = world > 1 or "TORCHELASTIC_RUN_ID" in os.environ  # by torchrun (or another launcher)
    if launched:  # torchrun's agent: a rank never outlives it (its workers get sessions of their own,
        die_with_parent(os.getppid())  # so a signal to the agent's process group would miss them)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=cfg.timeout_s)
        if launched:
            dist.init_process_group(backend, timeout=timeout)
        else:  # one rank, no rendezvous: a store inside this process
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.idle_timeout_s))
    mesh = init_device_mesh(device.type, (world,))
    leader_pid = torch.tensor([os.getpid()], dtype=torch.int64)
    dist.broadcast(leader_pid, src=0, group=control)
    rank = dist.get_rank()
    return Ranks(rank, world, int(os.environ.get("LOCAL_RANK", "0")), mesh, control, int(leader_pid))


def leave() -> None:
    """Tear the process group down (at exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def shard(model: torch.nn.Module, ranks: Ranks, compute_dtype: torch.dtype, cfg: DistributedConfig) -> None:
    """FSDP2 in place: each decoder layer a unit, the root (embeddings, final norm, head) the last."""
    if compute_dtype == torch.float32:
        mixed = MixedPrecisionPolicy()
    else:  # gathered in the compute dtype, gradients reduced in fp32; master weights stay fp32
        mixed = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if cfg.cpu_offload and ranks.mesh.device_type == "cpu":
        raise ValueError(
            "distributed.cpu_offload keeps a GPU learner's shards in host memory: on CPU they are"
        )
    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    for block in repeated_blocks(model):
        fully_shard(block, mesh=ranks.mesh, mp_policy=mixed, offload_policy=offload)
    fully_shard(model, mesh=ranks.mesh, mp_policy=mixed, offload_policy=offload)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: the loss is already normalised globally
            module.set_force_sum_reduction_for_comms(True)  # Gloo has no pre-multiplied sum


def share_indices(samples: Sequence[Sample], rank: int, world: int) -> list[int]:
    """Indices into `samples` of this rank's samples: longest first, each to the rank with the fewest
    tokens so far (ties: the lowest rank). Every rank computes the same split from the same batch,
    without communicating."""
    loads = [0] * world
    mine: list[int] = []
    for index in sorted(range(len(samples)), key=lambda i: (-samples[i].length, i)):
        owner = min(range(world), key=lambda r: (loads[r], r))
        loads[owner] += samples[index].length
        if owner == rank:
            mine.append(index)
    return mine


def share(samples: Sequence[Sample], rank: int, world: int) -> list[Sample]:
    """This rank's samples (`share_indices`), in that order."""
    return [samples[i] for i in share_indices(samples, rank, world)]


def passes(samples: Sequence[Sample], world: int, token_budget: int) -> int:
    """Forward/backward passes every rank runs for `samples`: the most micro-batches of any rank's share."""
    shares = [share(samples, r, world) for r in range(world)]
    return max(len(plan_micro_batches([s.length for s in mine], token_budget)) for mine in shares)


def reduce_sums(ranks: Ranks, sums: dict[str, float], maxima: dict[str, float]) -> tuple[dict, dict]:
    """`sums` summed and `maxima` maxed over the ranks (every rank gets the result)."""
    keys, max_keys = sorted(sums), sorted(maxima)
    total = torch.tensor([sums[k] for k in keys], dtype=torch.float64)  # [len(sums)]
    top = torch.tensor([maxima[k] for k in max_keys], dtype=torch.float64)  # [len(maxima)]
    if keys:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ranks.control)
    if max_keys:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ranks.control)
    return dict(zip(keys, total.tolist(), strict=True)), dict(zip(max_keys, top.tolist(), strict=True))


def gather_logprobs(
    ranks: Ranks, samples: Sequence[Sample], mine: dict[int, torch.Tensor]
) -> list[torch.Tensor]:
    """Every sample's completion logprobs on rank 0 (in `samples`' order; [] on the other ranks), from
    each rank's own (`mine`: sample index → fp32 [completion tokens], every index of its share). A
    collective on the control group: every rank sends its share flattened in `share_indices` order,
    padded to the longest share (every rank knows every share's size from the batch alone)."""
    shares = [share_indices(samples, r, ranks.world) for r in range(ranks.world)]
    sizes = [sum(len(samples[i].completion_ids) for i in indices) for indices in shares]
    longest = max(sizes, default=0)
    flat = torch.zeros(longest, dtype=torch.float32)
    own = [mine[i] for i in shares[ranks.rank]]
    if own:
        flat[: sizes[ranks.rank]] = torch.cat(own)
    gathered = [torch.empty(longest, dtype=torch.float32) for _ in shares] if ranks.leader else None
    dist.gather(flat, gathered, dst=0, group=ranks.control)
    if gathered is None:
        return []
    whole: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    for indices, received in zip(shares, gathered, strict=True):
        at = 0
        for i in indices:
            length = len(samples[i].completion_ids)
            whole[i] = received[at : at + length].clone()
            at += length
    return whole


def full_norm(norm: torch.Tensor) -> float:
    """A gradient norm as a number (clip_grad_norm_ over sharded parameters returns a DTensor)."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def full_state(model: torch.nn.Module, on_cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every entry of `model.state_dict()` as a whole tensor: `on_cpu`, host copies on rank 0 ({} on
    the others); else on each rank's device, on every rank (for the transports that send device
    tensors: nccl, cuda_ipc).

    A collective: every rank gathers the same tensors in the same order (state_dict's), one at a time,
    and all of it is done before rank 0 hands anything to a transport, so gathering never interleaves
    with sending (the deadlock trl#7131 and open-instruct#1649 describe).
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=on_cpu))
