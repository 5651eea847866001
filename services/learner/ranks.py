"""Rank 0 leads, the other ranks follow: every model operation runs on every rank, in one order.

Rank 0 serves the gRPC API (`Learner`); the others serve nothing. Each operation rank 0 runs on its
trainer (a train step, a scoring, an export, a checkpoint, a rebuild) it first announces on the
control group (Gloo, CPU tensors), with what the operation needs (the batch's samples), and the other
ranks run the same operation on theirs (`follow`). So FSDP's collectives always pair up.

On the wire: a header [3] int64 (operation, bytes of the JSON fields, samples), the JSON fields, and
for samples the packed tensors of `pack` (token ids, behaviour logprobs, per-sample figures,
environment spans). No pickle.

A rank that fails mid-operation leaves the others waiting in a collective until its deadline
(`distributed.timeout_s`), or failing at once when the failed process is gone; either way the learner
cannot go on in step, so any failure once an operation is announced ends the process (exit code 1)
and torchrun takes the other ranks down: the learner restarts as one, from its checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from services.common.cpus import apply_cpu_affinity
from services.common.logging import configure_logging, get_logger
from services.learner import sharding
from services.learner.batching import Sample
from services.learner.config import LearnerSettings
from services.learner.model import resolve_device
from services.learner.sharding import Ranks
from services.learner.trainer import StepOutcome, Trainer

log = get_logger(__name__)

OPERATIONS = ("heartbeat", "train", "score", "export", "checkpoint", "close", "build", "stop")
FAILED_EXIT = 1


def pack(samples: list[Sample]) -> list[torch.Tensor]:
    """Samples as four tensors (every rank rebuilds exactly the same samples from them)."""
    sizes = torch.tensor(  # [N, 3]: prompt tokens, completion tokens, environment spans
        [[len(s.prompt_ids), len(s.completion_ids), len(s.env_spans)] for s in samples], dtype=torch.int64
    ).reshape(-1, 3)
    ids = torch.tensor([t for s in samples for t in (*s.prompt_ids, *s.completion_ids)], dtype=torch.int64)
    behav = torch.tensor([lp for s in samples for lp in s.behav_logprobs], dtype=torch.float64)
    figures = torch.tensor([[s.advantage, s.temperature] for s in samples], dtype=torch.float64).reshape(
        -1, 2
    )
    spans = torch.tensor([list(span) for s in samples for span in s.env_spans], dtype=torch.int64).reshape(
        -1, 2
    )
    return [sizes, ids, behav, figures, spans]


def unpack(sizes: torch.Tensor, ids: torch.Tensor, behav: torch.Tensor, figures, spans) -> list[Sample]:
    """The inverse of `pack`."""
    samples, at, at_behav, at_span = [], 0, 0, 0
    id_list, behav_list, span_list = ids.tolist(), behav.tolist(), spans.tolist()
    for (prompt, completion, n_spans), (advantage, temperature) in zip(
        sizes.tolist(), figures.tolist(), strict=True
    ):
        samples.append(
            Sample(
                prompt_ids=tuple(id_list[at : at + prompt]),
                completion_ids=tuple(id_list[at + prompt : at + prompt + completion]),
                behav_logprobs=tuple(behav_list[at_behav : at_behav + completion]),
                advantage=advantage,
                temperature=temperature,
                env_spans=tuple((a, b) for a, b in span_list[at_span : at_span + n_spans]),
            )
        )
        at, at_behav, at_span = at + prompt + completion, at_behav + completion, at_span + n_spans
    return samples


class Channel:
    """Rank 0's announcements to the other ranks over the control group."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def send(self, operation: str, fields: dict[str, Any] | None = None, samples: list[Sample] = ()) -> None:
        payload = torch.frombuffer(bytearray(json.dumps(fields or {}).encode()), dtype=torch.uint8)
        header = torch.tensor([OPERATIONS.index(operation), payload.numel(), len(samples)], dtype=torch.int64)
        self._broadcast(header)
        if payload.numel():
            self._broadcast(payload)
        if samples:
            tensors = pack(list(samples))
            self._broadcast(torch.tensor([t.numel() for t in tensors], dtype=torch.int64))  # [5]
            for tensor in tensors:
                self._broadcast(tensor)

    def receive(self) -> tuple[str, dict[str, Any], list[Sample]]:
        header = torch.zeros(3, dtype=torch.int64)
        self._broadcast(header)
        operation, size, count = (int(v) for v in header)
        fields: dict[str, Any] = {}
        if size:
            payload = torch.zeros(size, dtype=torch.uint8)
            self._broadcast(payload)
            fields = json.loads(bytes(payload.numpy()).decode())
        samples: list[Sample] = []
        if count:
            numels = torch.zeros(5, dtype=torch.int64)
            self._broadcast(numels)
            n = [int(v) for v in numels]
            sizes = torch.zeros(n[0], dtype=torch.int64)
            ids = torch.zeros(n[1], dtype=torch.int64)
            behav = torch.zeros(n[2], dtype=torch.float64)
            figures = torch.zeros(n[3], dtype=torch.float64)
            spans = torch.zeros(n[4], dtype=torch.int64)
            for tensor in (sizes, ids, behav, figures, spans):
                self._broadcast(tensor)
            samples = unpack(sizes.reshape(-1, 3), ids, behav, figures.reshape(-1, 2), spans.reshape(-1, 2))
        return OPERATIONS[operation], fields, samples

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if tensor.numel():
            dist.broadcast(tensor, src=0, group=self.ranks.control)


def _fatal(operation: str, exc: BaseException) -> NoReturn:
    """An operation failed after it was announced: the ranks are out of step for good."""
    log.error("a learner rank failed: the learner stops (torchrun takes every rank down)",
              operation=operation, rank=dist.get_rank(), error=f"{type(exc).__name__}: {exc}")  # fmt: skip
    for stream in (sys.stdout, sys.stderr):  # os._exit skips Python's own flushing
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(FAILED_EXIT)


class Leader:
    """Rank 0's trainer: what `Learner` calls, announced to the other ranks, then run here too.
    Everything else (step, weight version, writer, ...) is the trainer's own."""

    def __init__(self, trainer: Trainer, channel: Channel) -> None:
        self.trainer, self.channel = trainer, channel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)

    def _lead(self, operation: str, run, fields: dict[str, Any] | None = None, samples: list[Sample] = ()):
        try:
            self.channel.send(operation, fields, samples)
            return run()
        except Exception as exc:
            _fatal(operation, exc)

    def train_step(
        self, samples: list[Sample], batch_id: str, rewards: list[float] | None = None
    ) -> StepOutcome:
        return self._lead(
            "train",
            lambda: self.trainer.train_step(samples, batch_id, rewards),
            {"batch_id": batch_id, "rewards": rewards},
            samples,
        )

    def score(self, sample: Sample) -> list[float]:
        return self._lead("score", lambda: self.trainer.score(sample), samples=[sample])

    def export(self, snapshot: bool = True) -> dict[str, torch.Tensor]:
        return self._lead("export", lambda: self.trainer.export(snapshot), {"snapshot": snapshot})

    def save_checkpoint(self, background: bool = False):
        return self._lead(
            "checkpoint", lambda: self.trainer.save_checkpoint(background), {"background": background}
        )

    def heartbeat(self) -> None:
        """Tell the other ranks rank 0 is alive (sent when rank 0 has had nothing to announce)."""
        self._lead("heartbeat", lambda: None)

    def close(self) -> None:
        self._lead("close", self.trainer.close)

    def stop(self) -> None:
        """The learner is stopping: the other ranks leave the group and exit."""
        self._lead("stop", lambda: None)


def build(settings: LearnerSettings, ranks: Ranks | None) -> Trainer | Leader:
    """The learner's trainer: a plain one for one rank; on rank 0 of several, one whose operations every
    rank runs (the others are told to build theirs first: `follow`)."""
    if ranks is None:
        return Trainer(settings)
    channel = Channel(ranks)
    try:
        channel.send("build", {"resume": settings.checkpoint.resume})
        return Leader(Trainer(settings, ranks), channel)
    except Exception as exc:
        _fatal("build", exc)


def run_follower(settings: LearnerSettings) -> None:
    """The process of a rank other than 0 (server.py's `main` under torchrun): no server, only `follow`."""
    configure_logging(settings.log_level, service=f"learner-rank{os.environ.get('RANK', '?')}")
    apply_cpu_affinity(settings.cpus)
    # SIGTERM (torchrun forwards its own to every rank) is rank 0's to act on: it writes the final
    # checkpoint, which needs this rank, then announces stop. A dead rank 0 ends this one anyway.
    signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: stopping when rank 0 says so"))
    ranks = sharding.join(resolve_device(settings.device), settings.distributed)
    assert ranks is not None and not ranks.leader, "run_follower is for the ranks other than 0"
    follow(settings, ranks)
    sharding.leave()


def follow(settings: LearnerSettings, ranks: Ranks) -> None:
    """The loop of every rank but 0: run what rank 0 announces, until it says stop."""
    channel = Channel(ranks)
    trainer: Trainer | None = None
    operation = "receive"
    try:
        while True:
            operation, fields, samples = channel.receive()
            if operation == "build":
                checkpoint = settings.checkpoint.model_copy(update={"resume": fields["resume"]})
                trainer = Trainer(settings.model_copy(update={"checkpoint": checkpoint}), ranks)
            elif operation == "stop":
                return
            elif operation == "heartbeat":
                continue
            elif trainer is None:
                raise RuntimeError(f"rank 0 announced {operation} before build")
            elif operation == "train":
                trainer.train_step(samples, fields["batch_id"], fields["rewards"])
            elif operation == "score":
                trainer.score(samples[0])
            elif operation == "export":
                trainer.export(fields["snapshot"])
            elif operation == "checkpoint":
                trainer.save_checkpoint(fields["background"])
            elif operation == "close":
                trainer.close()
                trainer = None
    except Exception as exc:
        _fatal(operation, exc)
