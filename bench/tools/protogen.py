"""Regenerate the gRPC Python code from ``proto/`` with grpcio-tools.

    pip install -e '.[codegen]'               # grpcio-tools: a developer's tool, not a dependency
    python -m bench.tools.protogen            # rewrites server/grpc/gen/

The generated modules live next to their one user (``server/grpc/api.py``)
under ``server/grpc/gen/``; the proto path is mapped so that their imports
read ``tailguard.server.grpc.gen.tailguard.v1``. A test regenerates into a temporary
folder and fails if the committed code is stale.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PROTO_ROOT = ROOT / "proto"
# tailguard's contract, and the v1 reflection service grpcio-reflection lacks (server/grpc/api.py).
PROTO_FILES = ("tailguard/v1/tailguard.proto", "grpc/reflection/v1/reflection.proto")
PACKAGE_PREFIX = "tailguard/server/grpc/gen"  # the installed name: what the modules import
COMMITTED = ROOT / "server" / "grpc" / "gen"  # where that package's source lives in the repository


INSTALL_CODEGEN = "pip install -e '.[codegen]'"  # what brings grpcio-tools


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules under ``out_dir/tailguard/server/grpc/gen``; returns them.

    Without grpcio-tools (the ``codegen`` extra) raises SystemExit with the
    line that says how to install it.
    """
    try:
        from grpc_tools import protoc
    except ImportError as error:
        raise SystemExit(f"bench.tools.protogen needs grpcio-tools ({error}), the codegen extra: {INSTALL_CODEGEN}") from None
    include = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_PREFIX}={PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(f"{PACKAGE_PREFIX}/{name}" for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    generated = sorted((out_dir / PACKAGE_PREFIX).rglob("*_pb2*.py*"))
    package_root = out_dir / PACKAGE_PREFIX
    for path in generated:
        folder = path.parent
        while True:
            (folder / "__init__.py").touch()
            if folder == package_root:
                break
            folder = folder.parent
    return generated


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        package = Path(scratch) / PACKAGE_PREFIX
        for path in generate(Path(scratch)):
            target = COMMITTED / path.relative_to(package)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            (target.parent / "__init__.py").touch()
            print(target.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
