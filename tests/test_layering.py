"""The tree's layering, enforced: shared code depends on no service, services do not import each
other, the scheduler's wings import only the wings below them, and no two modules import each other
(directly or through a cycle), lazy imports included.

    services/common       shared plumbing             → nothing above it
    services/transports   weight transports           → common
    services/<service>    env, learner, rollout, scheduler → common, transports
    services/launch       the launcher                → anything
    services/cli.py       the grpo-mesh command line  → anything

Inside services/scheduler (its README.md maps the files):

    peers/      the three peers: protocols, gRPC clients, the rollout pool  → peers
    observe/    metrics, trackers, timeline, status                        → observe, peers
    ledger/     group ledger, SQLite store, recovery, audit, lineage       → ledger, observe, peers
    config.py   the scheduler's settings, gathered from the wings'         → peers, observe
    pipeline/   groups, batches, weight and step sync, alignment, eval     → everything above
    orchestrator.py, server.py, servicer.py, status_view.py, __main__.py   → anything in the scheduler
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("env", "learner", "rollout", "scheduler")
ALLOWED = {
    "common": {"common"},
    "transports": {"common", "transports"},
    **{name: {"common", "transports", name} for name in SERVICES},
}


# What each part of the scheduler may import of the scheduler (a wing's own modules included).
SCHEDULER_WINGS = {
    "peers": {"peers"},
    "observe": {"observe", "peers"},
    "ledger": {"ledger", "observe", "peers"},
    "config": {"observe", "peers"},
    "pipeline": {"pipeline", "ledger", "observe", "peers", "config"},
}
SCHEDULER_TOP = {"orchestrator", "server", "servicer", "status_view", "__main__"}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(p, root): p for p in (root / "services").rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path], root: Path = ROOT) -> set[str]:
    """The project modules `path` imports, anywhere in the file (function-level imports too)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def test_every_layer_imports_only_what_it_may() -> None:
    graph = _graph()
    assert graph, "no modules found"
    problems = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if _layer(module) in ALLOWED
        for target in targets
        if _layer(target) not in ALLOWED[_layer(module)]
    ]
    assert not problems, "layering violations:\n" + "\n".join(sorted(problems))


def _wing(module: str) -> str:
    """`services.scheduler.ledger.store` → "ledger"; `services.scheduler.config` → "config"."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def test_the_scheduler_wings_import_only_the_wings_below_them() -> None:
    graph = {m: targets for m, targets in _graph().items() if m.startswith("services.scheduler.")}
    parts = {_wing(m) for m in graph}
    unplaced = parts - set(SCHEDULER_WINGS) - SCHEDULER_TOP
    assert not unplaced, f"scheduler modules or wings with no place in SCHEDULER_WINGS: {sorted(unplaced)}"
    problems = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if _wing(module) in SCHEDULER_WINGS
        for target in targets
        if target.startswith("services.scheduler.") and _wing(target) not in SCHEDULER_WINGS[_wing(module)]
    ]
    assert not problems, "sideways or upward imports inside the scheduler:\n" + "\n".join(sorted(problems))


def test_the_scheduler_readme_maps_every_module() -> None:
    """services/scheduler/README.md's tables map every module of the package, and only those."""
    package = ROOT / "services" / "scheduler"
    readme = (package / "README.md").read_text()
    files = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name != "__init__.py"}
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", readme, re.MULTILINE))  # the tables' first column
    assert not files - named, f"modules the README does not map: {sorted(files - named)}"
    assert not named - files, f"files the README names that do not exist: {sorted(named - files)}"


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import services.env.base\n", {"services.env.base"}),
        (
            "def f():\n    from services.scheduler import orchestrator\n",
            {"services.scheduler", "services.scheduler.orchestrator"},
        ),
        ("from ..env import base\n", {"services.env", "services.env.base"}),
    ],
)
def test_the_checker_sees_absolute_lazy_and_relative_imports(
    tmp_path: Path, source: str, expected: set[str]
) -> None:
    for module in ("services/__init__.py", "services/env/__init__.py", "services/env/base.py",
                   "services/scheduler/__init__.py", "services/scheduler/orchestrator.py"):  # fmt: skip
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("")
    probe = tmp_path / "services" / "common" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(source)
    imported = _imports(probe, _modules(tmp_path), tmp_path)
    assert imported == expected
    assert any(_layer(t) not in ALLOWED["common"] for t in imported)  # each would be reported


def test_the_scheduler_never_loads_torch() -> None:
    # it only coordinates: naming transports (services/transports/kinds.py) must not pull in torch,
    # which costs the scheduler seconds of start-up and hundreds of MB for nothing
    import subprocess
    import sys

    probe = "import sys, services.scheduler.server; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# The studio reads a run through the scheduler's gRPC API and the run directory: of the services it
# imports only these read-side modules (the record of a finished run, the ledger's learner logprobs,
# the run dir's scheduler address and TLS, the launcher's record of its processes, and the env loader
# to check a form's environment options before a run starts), never a service's internals.
STUDIO_READS = {
    "services.scheduler.ledger.run_record",
    "services.scheduler.ledger.token_scores",
    "services.scheduler.status_view",
    "services.launch.liveset",
    "services.env.loader",
}


def test_the_studio_imports_only_the_read_side_of_the_services() -> None:
    graph = {m: targets for m, targets in _graph().items() if m.startswith("services.studio")}
    assert graph, "no studio modules found"
    problems = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if _layer(target) not in {"common", "studio"} and target not in STUDIO_READS
        and not any(read.startswith(target + ".") for read in STUDIO_READS)  # their packages
    ]  # fmt: skip
    assert not problems, "the studio reaches into a service:\n" + "\n".join(sorted(problems))
