"""The committed gRPC code is what grpcio-tools generates from proto/ today."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from bench.tools.protogen import COMMITTED, INSTALL_CODEGEN, PACKAGE_PREFIX, generate

# Lines that only stamp the generator's version: a newer grpcio-tools may
# change them without the contract changing.
_VERSION_STAMP = re.compile(rb"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s*\d+,\s*\d+,\s*\d+,?\s*)$", re.M)


def _normalised(data: bytes) -> bytes:
    return _VERSION_STAMP.sub(b"", data)


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "protoc generated nothing"
    package = tmp_path / PACKAGE_PREFIX
    for path in fresh:
        relative = path.relative_to(package)
        committed = COMMITTED / relative
        assert committed.exists(), f"{relative} is not committed; run: python -m bench.tools.protogen"
        assert _normalised(committed.read_bytes()) == _normalised(path.read_bytes()), (
            f"{relative} is stale; run: python -m bench.tools.protogen"
        )
    committed_files = {p.relative_to(COMMITTED) for p in COMMITTED.rglob("*_pb2*.py*")}
    assert committed_files == {p.relative_to(package) for p in fresh}


def test_without_grpcio_tools_it_says_to_install_the_codegen_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "grpc_tools", None)  # as where the extra is not installed
    with pytest.raises(SystemExit) as missing:
        generate(tmp_path)
    assert INSTALL_CODEGEN == "pip install -e '.[codegen]'" and str(missing.value).endswith(f"the codegen extra: {INSTALL_CODEGEN}")
