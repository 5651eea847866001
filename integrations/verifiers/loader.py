"""Load the env function named on the command line, and its keyword arguments.

`PATH.py:FUNCTION` imports the file as a top-level module named after its stem, with its folder on
`sys.path`, so that verifiers' own loader (which imports a taskset by its id, the module name) finds
the very same module; `package.module:FUNCTION` imports an installed module.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_env_factory(spec: str) -> Callable[..., Any]:
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise SystemExit(f"--env {spec!r}: expected PATH.py:FUNCTION or module:FUNCTION")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise SystemExit(f"--env {spec!r}: no file {path}")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        module = importlib.import_module(path.stem)
        if Path(module.__file__ or "").resolve() != path:
            raise SystemExit(f"--env {spec!r}: module name {path.stem!r} is taken by {module.__file__}")
    else:
        module = importlib.import_module(target)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SystemExit(f"--env {spec!r}: {name!r} is not a function of {module.__name__}")
    return factory


def parse_env_args(pairs: list[str], factory: Callable[..., Any], seed: int | None) -> dict[str, Any]:
    """`key=value` pairs (value parsed as JSON, else kept as a string), plus `seed` when the factory
    takes one and it was not given."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env-arg {pair!r}: expected KEY=VALUE")
        try:
            kwargs[key] = json.loads(raw)
        except ValueError:
            kwargs[key] = raw
    if seed is not None and "seed" not in kwargs and "seed" in inspect.signature(factory).parameters:
        kwargs["seed"] = seed
    return kwargs
