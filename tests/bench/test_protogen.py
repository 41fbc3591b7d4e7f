"""The committed gRPC code is what grpcio-tools generates from proto/ today."""

from __future__ import annotations

import re
from pathlib import Path

from bench.tools.protogen import COMMITTED, PACKAGE_PREFIX, generate

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
