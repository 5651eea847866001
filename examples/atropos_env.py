"""Integer arithmetic as an atropos environment, written only against atroposlib's public API.

Nothing here knows grpo-mesh: it is an ordinary atropos `BaseEnv`, started with atropos' own CLI,
whose inference server and trajectory API both happen to be a grpo-mesh gateway:

    python examples/atropos_env.py serve \\
        --env.rollout_server_url http://127.0.0.1:8000 --env.tokenizer_name ./model \\
        --openai.base_url http://127.0.0.1:8000/v1 --openai.server_type vllm --openai.model_name grpo-mesh \\
        --env.group_size 8

Each item is a problem such as "3+4=" (the format the tiny test model is warm-started on); the
group's completions come from `ManagedServer.completion` (the `vllm` server type: `POST /generate`
with the prompt's token ids, so tokens and masks are what was sampled), and a completion scores 1.0
when its leading integer is the exact result. With `--env.chat true` (instruct models such as
SmolLM2) the problem is asked in chat ("What is 3 + 4?" after a system message), through
`ManagedServer.chat_completion` (the tokenizer's chat template, then `/generate`), and the reply's
last integer is scored. `docs/ecosystem.md` runs both.
"""

from __future__ import annotations

import random
import re

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

LEADING_INT = re.compile(r"^\s*(-?\d+)")
INTEGER = re.compile(r"-?\d+")


class ArithmeticEnvConfig(BaseEnvConfig):
    """The env's own options (atropos' CLI: --env.digits, --env.seed, --env.temperature, ...)."""

    digits: int = 1
    seed: int = 0
    temperature: float = 1.0
    max_tokens: int = 6
    chat: bool = False
    system_prompt: str = "Answer with the number only."


class ArithmeticEnv(BaseEnv):
    name = "arithmetic"
    env_config_cls = ArithmeticEnvConfig

    @classmethod
    def config_init(cls) -> tuple[ArithmeticEnvConfig, list[APIServerConfig]]:
        env = ArithmeticEnvConfig(
            tokenizer_name="model",
            group_size=8,
            use_wandb=False,
            rollout_server_url="http://localhost:8000",
            total_steps=-1,  # the trainer's (/register-env's num_steps)
            batch_size=-1,  # the trainer's (/info)
            steps_per_eval=0,
            max_token_length=512,
            ensure_scores_are_not_same=False,
            include_messages=False,
        )
        server = APIServerConfig(
            model_name="grpo-mesh", base_url="http://localhost:8000/v1", api_key="none", server_type="vllm"
        )
        return env, [server]

    async def setup(self) -> None:
        self.rng = random.Random(self.config.seed)
        self.top = 10**self.config.digits

    async def get_next_item(self) -> tuple[str, int]:
        a, b = self.rng.randrange(self.top), self.rng.randrange(self.top)
        plus = self.rng.random() < 0.5
        if self.config.chat:
            return f"What is {a} {'+' if plus else '-'} {b}?", a + b if plus else a - b
        return (f"{a}+{b}=", a + b) if plus else (f"{a}-{b}=", a - b)

    async def collect_trajectories(self, item: tuple[str, int]) -> tuple[ScoredDataGroup, list]:
        prompt, answer = item
        sampling = {
            "n": self.config.group_size,
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
        }
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            if self.config.chat:
                system = self.config.system_prompt
                messages = [{"role": "system", "content": system}] if system else []
                messages.append({"role": "user", "content": prompt})
                await managed.chat_completion(messages=messages, **sampling)
            else:
                await managed.completion(prompt=prompt, **sampling)
            nodes = managed.get_state()["nodes"]
        group = ScoredDataGroup(tokens=[], masks=[], scores=[])
        for node in nodes:
            sampled = [t for t, m in zip(node.tokens, node.masked_tokens, strict=True) if m != -100]
            text = self.tokenizer.decode(sampled, skip_special_tokens=True)
            if self.config.chat:
                found = INTEGER.findall(text)
                value = int(found[-1]) if found else None
            else:
                leading = LEADING_INT.match(text)
                value = int(leading.group(1)) if leading else None
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["scores"].append(1.0 if value == answer else 0.0)
        return group, []

    async def evaluate(self, *args, **kwargs) -> None:
        return None


if __name__ == "__main__":
    ArithmeticEnv.cli()
