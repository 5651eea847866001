"""Generate the Python code for protos/ into the `grpo` package (committed; `make proto` runs this).

The proto directory mirrors the Python package (`protos/grpo/env/v1/env.proto` → `grpo.env.v1.env_pb2`),
so generated imports work without rewriting. `tests/test_protos.py` regenerates into a temporary
directory and fails if the committed code differs.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Run protoc for every proto into `out_dir` and add the package `__init__.py` files."""
    include = str(resources.files("grpc_tools") / "_proto")
    files = [str(path.relative_to(PROTO_ROOT)) for path in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    package_root = out_dir / "grpo"
    for directory in [package_root, *[p for p in package_root.rglob("*") if p.is_dir()]]:
        if directory.name != "__pycache__":
            (directory / "__init__.py").touch()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="Directory to write the grpo/ package into.")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
