"""The protos: committed generated code is current, buf lint passes, enums follow the zero-value rule."""

from __future__ import annotations

import filecmp
import importlib
import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts/gen_protos.py")
gen_protos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_protos)


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    gen_protos.generate(tmp_path)
    fresh, committed = tmp_path / "grpo", ROOT / "grpo"
    fresh_files, committed_files = _files(fresh), _files(committed)
    differing = sorted(
        str(path)
        for path in fresh_files & committed_files
        if not filecmp.cmp(fresh / path, committed / path, shallow=False)
    )
    problems = {
        "differ": differing,
        "missing from grpo/": sorted(map(str, fresh_files - committed_files)),
        "stale in grpo/": sorted(map(str, committed_files - fresh_files)),
    }
    assert not any(problems.values()), f"run `make proto` and commit grpo/: {problems}"


def test_buf_lint() -> None:
    buf = ROOT / ".venv/bin/buf"
    if not buf.exists():
        pytest.fail(f"{buf} missing: run `make install`")
    done = subprocess.run(
        [str(buf), "lint"], cwd=ROOT / "protos", capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _file_descriptors():
    for proto in gen_protos.proto_files():
        module = str(proto.relative_to(gen_protos.PROTO_ROOT).with_suffix("")).replace("/", ".") + "_pb2"
        yield importlib.import_module(module).DESCRIPTOR


def _enums(container):
    yield from container.enum_types_by_name.values()
    for message in container.message_types_by_name.values():
        yield from _nested_enums(message)


def _nested_enums(message):
    yield from message.enum_types
    for nested in message.nested_types:
        yield from _nested_enums(nested)


def test_every_enum_zero_value_is_unspecified() -> None:
    enums = [enum for fd in _file_descriptors() for enum in _enums(fd)]
    assert enums, "no enums found: the descriptor walk is broken"
    bad = [
        f"{enum.full_name}: {enum.values_by_number.get(0).name if 0 in enum.values_by_number else 'no zero'}"
        for enum in enums
        if 0 not in enum.values_by_number or not enum.values_by_number[0].name.endswith("_UNSPECIFIED")
    ]
    assert not bad, bad
