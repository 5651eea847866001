"""A verifiers (0.4.0, `verifiers.v1`) environment written only against verifiers' public API.

It is what `integrations/verifiers/run.py` trains on grpo-mesh in the tests and the docs. The task is
the one the tiny test model learns in `make demo` (services/env/builtins/arithmetic.py): an
integer expression with no spaces followed by "=" (e.g. "37+45="), answered with the integer.

- `ArithmeticTaskset` (a `vf.Taskset`, exported through `__all__` as verifiers' loader requires)
  yields seeded problems forever; `ArithmeticTask.correct` is its `@vf.reward`: the fraction of the
  right-aligned characters of the reply's leading integer that match the answer (1.0 = exact), so a
  small model gets a graded signal to climb.
- `chat=True` (instruct models such as SmolLM2, as `examples/atropos_env.py`'s chat option) asks "What
  is 3 + 4?" after the system prompt "Answer with the number only." and scores the reply's last
  integer the same way.
- `load_environment(...)` builds the env: `SingleAgentEnv` over the taskset with verifiers' `null`
  harness (a plain chat loop, no tools) in the local `subprocess` runtime (the single-turn case),
  or, with `turns > 1`, `RetryEnv`: a multi-turn `vf.Env` that, while the reply is wrong, answers
  "Wrong, try again: <problem>" as the user and lets the model answer again, up to `turns` replies;
  its reward is the best reply's score discounted by 0.5 per retry.

Run it through grpo-mesh with the runner (in `.venvs/verifiers`):

    .venvs/verifiers/bin/python -m integrations.verifiers.run \\
        --env examples/verifiers_env.py:load_environment \\
        --gateway http://127.0.0.1:8000 --model .cache/tiny-model-random --group-size 4 --steps 20
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf
from verifiers.v1.envs.single_agent import SingleAgentEnv, SingleAgentEnvConfig

_LEADING_INT = re.compile(r"^-?\d+")
_INTEGER = re.compile(r"-?\d+")
SYSTEM_PROMPT = "Answer with the number only."

__all__ = ["ArithmeticTaskset"]


def make_problem(rng: random.Random, digits: int, terms: int, operators: str) -> tuple[str, int]:
    """A problem "<a><op><b>...=" and its value (left to right; only + and - by default)."""
    operands = [rng.randint(0, 10**digits - 1) for _ in range(terms)]
    ops = [rng.choice(operators) for _ in range(terms - 1)]
    value = operands[0]
    text = str(operands[0])
    for op, operand in zip(ops, operands[1:], strict=True):
        value = value + operand if op == "+" else value - operand
        text += f"{op}{operand}"
    return text + "=", value


def score_reply(reply: str, answer: int, chat: bool = False) -> float:
    """Partial credit: the fraction of right-aligned characters (sign included) of the reply's leading
    integer (its last one in chat) that match the answer's; 1.0 on an exact match, 0.0 when there is
    no such integer."""
    if chat:
        found = _INTEGER.findall(reply)
        got = found[-1] if found else None
    else:
        match = _LEADING_INT.match(reply.strip())
        got = match.group(0) if match else None
    if got is None:
        return 0.0
    want = str(answer)
    if got == want:
        return 1.0
    width = max(len(got), len(want))
    same = sum(a == b for a, b in zip(got.rjust(width), want.rjust(width), strict=True))
    return same / width


class ArithmeticConfig(vf.TasksetConfig):
    """The taskset's knobs (the runner's `--env-arg key=value` sets them through `load_environment`)."""

    digits: int = 1
    terms: int = 2
    operators: str = "+"
    seed: int = 0
    chat: bool = False


class ArithmeticData(vf.TaskData):
    answer: int
    chat: bool = False


class ArithmeticTask(vf.Task[ArithmeticData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ArithmeticData, trace: vf.Trace) -> float:
        return score_reply(trace.last_reply, task.answer, task.chat)


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    INFINITE = True

    def load(self) -> Iterator[ArithmeticTask]:
        rng = random.Random(self.config.seed)
        for i in itertools.count():
            prompt, answer = make_problem(rng, self.config.digits, self.config.terms, self.config.operators)
            chat = self.config.chat
            if chat:
                prompt = "What is " + re.sub(r"([+-])", r" \1 ", prompt[:-1]) + "?"
            data = ArithmeticData(
                name=f"arith#{i}", prompt=prompt, answer=answer, chat=chat,
                system_prompt=SYSTEM_PROMPT if chat else None,
            )  # fmt: skip
            yield ArithmeticTask(data, self.config.task)


class RetryEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    turns: int = 2


class RetryEnv(vf.Env[RetryEnvConfig]):
    """Multi-turn: the env plays the user, telling the model to try again while it is wrong."""

    async def run(self, task, agents) -> None:
        best = 0.0
        async with agents.solver.interaction(task) as interaction:
            segment = await interaction.turn()
            for retry in range(self.config.turns):
                score = score_reply(segment.last_reply, task.data.answer, task.data.chat) * 0.5**retry
                best = max(best, score)
                if score == 0.5**retry or retry + 1 == self.config.turns or segment.terminated:
                    break
                segment = await interaction.turn(f"Wrong, try again: {task.data.prompt}")
        interaction.trace.record_reward("correct", best, 1.0)


def load_environment(
    digits: int = 1,
    terms: int = 2,
    operators: str = "+",
    seed: int = 0,
    turns: int = 1,
    max_turns: int | None = None,
    chat: bool = False,
) -> vf.Env:
    """The env: single-turn `SingleAgentEnv` (turns=1) or the multi-turn `RetryEnv` (turns>1)."""
    taskset = {"id": __name__, "digits": digits, "terms": terms, "operators": operators, "seed": seed,
               "chat": chat}  # fmt: skip
    agent = vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=max_turns)
    if turns <= 1:
        return SingleAgentEnv(SingleAgentEnvConfig.model_validate({"taskset": taskset, "agent": agent}))
    return RetryEnv(RetryEnvConfig.model_validate({"taskset": taskset, "solver": agent, "turns": turns}))
