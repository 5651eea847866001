"""The post-sync alignment check: after every weight sync, learner and rollouts score one fixed probe
sequence and must agree on its logprobs (max |Δ| ≤ `alignment_threshold`; fp32 keeps it ≤ 1e-4).

The probe is made once per scheduler start: one seeded completion (at most `alignment_probe_tokens`
long) of the env's first eval prompt, from the first rollout that answers, scored at
`alignment_probe_temperature` (1.0: vLLM answers in one prompt-logprobs request; the temperature
scaling of behaviour logprobs is held to 1e-4 by the engines' own tests). For a multi-turn env it is
an episode in token space, exactly as training builds them: that completion, an environment turn
appended as tokens (`render_bridge` of a user message) and a second model turn generated token-in, so
the check covers the long mixed sequences that are trained. A row's `logprob_abs_diff_max` is the
max over the tokens a model sampled (the ones training reads); `logprob_abs_diff_max_env` is the max
over the environment's tokens of a multi-turn probe, context the model never sampled and the loss
never reads (`bench/alignment.py` measures both parts apart). Every token is held to
`alignment_threshold`; `alignment_action` decides
what a disagreement does: `fail` stops the run (AlignmentError), `warn` logs it.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from functools import partial

from grpo.common.v1 import types_pb2
from services.common.errors import GrpoError
from services.common.logging import get_logger
from services.scheduler.config import SchedulerSettings
from services.scheduler.peers.clients import EnvClient, Sampling, ScoredGroup, TokenScores
from services.scheduler.peers.patience import patiently
from services.scheduler.peers.rollouts import RolloutHandle, RolloutPool
from services.scheduler.pipeline.weight_sync import AlignmentError, WeightSyncer

log = get_logger(__name__)


# Completion tokens of an external group's sequence the probe keeps (a multi-turn episode's first turns).
EXTERNAL_PROBE_TOKENS = 256


def _max(values: list[float]) -> float:
    return max(values) if values else math.nan


@dataclass(frozen=True)
class Alignment:
    """One probe's max |learner − rollout| logprob over the tokens a model sampled (`sampled`: the ones
    training reads, `logprob_abs_diff_max`) and over the environment's tokens of a multi-turn probe
    (`env`: context only, masked out of the loss); NaN where there were none or no rollout answered."""

    sampled: float = math.nan
    env: float = math.nan

    @property
    def worst(self) -> float:
        return _max([v for v in (self.sampled, self.env) if not math.isnan(v)])


class AlignmentProbe:
    """Makes the probe sequence and judges each sync by it."""

    def __init__(self, settings: SchedulerSettings, syncer: WeightSyncer) -> None:
        self.settings = settings
        self._syncer = syncer
        self.sequence: types_pb2.TokenSequence | None = None
        self.env_spans: list[tuple[int, int]] = []  # [start, end) of the environment's completion tokens
        self.multi_turn = False  # set from the env's description before `make`

    async def make(self, env: EnvClient, pool: RolloutPool, version: int = 0) -> types_pb2.TokenSequence:
        """A fixed probe: one seeded completion of the env's first eval prompt, no longer than
        `alignment_probe_tokens`, from the first rollout that answers (unreachable ones are marked
        unhealthy). When none answers (all restarting, or too busy to answer in time), the rollouts
        are polled until one is ready again and asked again, up to `recovery.peer_restart_timeout`."""
        recovery = self.settings.recovery
        prompt = (await patiently(recovery, "env", partial(env.sample, 1, "eval", start=0)))[0]
        cfg = self.settings.sampling
        max_tokens = min(cfg.max_tokens, self.settings.alignment_probe_tokens)
        sampling = Sampling(n=1, temperature=cfg.temperature, max_tokens=max_tokens, seed=1234)
        deadline = time.monotonic() + recovery.peer_restart_timeout
        while True:
            for handle in pool.healthy():
                try:
                    completions = await handle.client.generate(
                        f"probe-{uuid.uuid4().hex[:8]}", prompt, sampling
                    )
                except GrpoError as exc:
                    if not exc.unreachable:
                        raise
                    await pool.mark(handle, healthy=False)
                    continue
                if not completions:
                    raise RuntimeError("probe generation returned nothing")
                return await self._sequence(handle, prompt, sampling, completions[0])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError("no rollout answered the probe generation")
            log.warning("no rollout answered the probe generation: waiting for one to be ready")
            await pool.wait_for_healthy(version, remaining, recovery.retry_interval)

    async def _sequence(
        self, handle: RolloutHandle, prompt: types_pb2.Prompt, sampling: Sampling, first: types_pb2.Completion
    ) -> types_pb2.TokenSequence:
        prompt_ids = list(first.prompt_token_ids)
        tokens = list(first.completion_token_ids)
        if self.multi_turn:
            bridge, second = await self._second_turn(handle, prompt, sampling, prompt_ids, tokens)
            self.env_spans = [(len(tokens), len(tokens) + len(bridge))]
            tokens += bridge + second
        self.sequence = types_pb2.TokenSequence(
            prompt_token_ids=prompt_ids,
            completion_token_ids=tokens,
            temperature=self._temperature(sampling.temperature),
        )
        return self.sequence

    def _temperature(self, sampled_at: float) -> float:
        """What the probe is scored at: `alignment_probe_temperature`, or (0) the sampling one."""
        return self.settings.alignment_probe_temperature or sampled_at

    def make_from(self, group: ScoredGroup) -> types_pb2.TokenSequence:
        """The probe for source = external: the first sequence of a submitted group (its prompt and at
        most `EXTERNAL_PROBE_TOKENS` of its completion, environment turns marked), at its temperature."""
        first = group.completions[0]
        prompt_ids = list(first.prompt_token_ids or group.prompt_token_ids)
        tokens = list(first.completion_token_ids)[:EXTERNAL_PROBE_TOKENS]
        sampling = first.sampling_params if first.HasField("sampling_params") else group.sampling_params
        temperature = sampling.temperature if sampling is not None and sampling.temperature > 0 else 1.0
        self.env_spans = [
            (t.start, min(t.end, len(tokens)))
            for t in first.turns
            if t.source == types_pb2.TURN_SOURCE_ENV and t.start < len(tokens)
        ]
        self.sequence = types_pb2.TokenSequence(
            prompt_token_ids=prompt_ids,
            completion_token_ids=tokens,
            temperature=self._temperature(temperature),
        )
        return self.sequence

    async def _second_turn(
        self,
        handle: RolloutHandle,
        prompt: types_pb2.Prompt,
        sampling: Sampling,
        prompt_ids: list[int],
        tokens: list[int],
    ) -> tuple[list[int], list[int]]:
        """An environment turn (as tokens) and a second model turn (token-in) after the first."""
        message = types_pb2.ChatMessage(role="user", content="Go on.")
        bridge = (await handle.client.render_bridge([message], tokens[-8:], prompt.tools_json)).token_ids
        request_id = f"probe-{uuid.uuid4().hex[:8]}"
        second = await handle.client.generate(request_id, prompt, sampling, prompt_ids + tokens + bridge)
        return bridge, list(second[0].completion_token_ids)

    async def score_learner(self) -> TokenScores:
        """The learner's side of the next check, taken now (while it holds the version to check)."""
        assert self.sequence is not None, "make() the probe first"
        return await self._syncer.score_learner(self.sequence)

    async def check(
        self, rollouts: list[RolloutHandle], version: int, learner: TokenScores | None = None
    ) -> Alignment:
        """Max |learner − rollout| logprob on the probe across `rollouts` (all at `version`), NaN when
        none answered (the step's row then reads null: skipped, not agreed); the learner scores now
        unless its `score_learner` answer at `version` is given. Every token is held to the threshold."""
        assert self.sequence is not None, "make() the probe first"
        diffs = await self._syncer.probe(self.sequence, rollouts, learner)
        if diffs is None:
            log.info("alignment probe skipped: no rollout answered", version=version, rollouts=len(rollouts))
            return Alignment()
        from_env = {i for start, end in self.env_spans for i in range(start, end)}
        result = Alignment(
            sampled=_max([d for i, d in enumerate(diffs) if i not in from_env]),
            env=_max([d for i, d in enumerate(diffs) if i in from_env]),
        )
        if result.worst > self.settings.alignment_threshold:
            on_env = "" if math.isnan(result.env) else f", {result.env:.3g} on environment tokens"
            message = (
                f"logprob misalignment after sync to v{version}: max |Δ| = {result.sampled:.3g} on "
                f"sampled tokens{on_env} > threshold {self.settings.alignment_threshold:g}"
            )
            if self.settings.alignment_action == "fail":
                raise AlignmentError(message)
            log.warning(message)
        return result
