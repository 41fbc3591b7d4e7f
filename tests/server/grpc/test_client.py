"""What a gRPC client author meets: reflection v1 (as grpcurl asks), and the README's generated client.

- Server reflection answers under ``grpc.reflection.v1`` (current grpcurl and
  Postman ask for it first) as well as ``v1alpha``: the services listed, and
  each one's file descriptors, from which a client builds the service without
  the proto.
- The README's ``python -m grpc_tools.protoc -I proto ...`` command, run as
  written in a temporary folder, generates a client; the README's example,
  run with that client in a process of its own (none of tailguard's code
  imported), gets a reply and a stream from a real tailguard.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2, reflection_pb2_grpc as v1alpha_pb2_grpc

from tailguard.router.config import Config
from tailguard.server.grpc.gen.grpc.reflection.v1 import reflection_pb2 as v1_pb2, reflection_pb2_grpc as v1_pb2_grpc
from tests.helpers.grpc_service import Service, grpc_service
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK

ROOT = Path(__file__).resolve().parents[3]
SERVICES = {"tailguard.v1.Completions", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}


def make_config(urls: list[str]) -> Config:
    return two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[0]])


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    with grpc_service([QUICK], make_config) as running:
        yield running


def reflect_v1(target: str, requests: list[v1_pb2.ServerReflectionRequest]) -> list[v1_pb2.ServerReflectionResponse]:
    """One reflection stream over v1, as grpcurl opens it."""
    with grpc.insecure_channel(target) as channel:
        return list(v1_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter(requests), timeout=10))


def test_reflection_v1_lists_every_service(service: Service) -> None:
    (reply,) = reflect_v1(service.grpc_target, [v1_pb2.ServerReflectionRequest(list_services="")])
    assert {s.name for s in reply.list_services_response.service} == SERVICES


def test_reflection_v1alpha_still_answers(service: Service) -> None:
    with grpc.insecure_channel(service.grpc_target) as channel:
        stub = v1alpha_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = stub.ServerReflectionInfo(iter([v1alpha_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    assert {s.name for s in reply.list_services_response.service} == SERVICES


def test_reflection_v1_describes_each_listed_service(service: Service) -> None:
    """``grpcurl describe``: every listed service resolves to descriptors a client can build."""
    replies = reflect_v1(service.grpc_target, [v1_pb2.ServerReflectionRequest(file_containing_symbol=name) for name in sorted(SERVICES)])
    pool = descriptor_pool.DescriptorPool()
    for name, reply in zip(sorted(SERVICES), replies, strict=True):
        assert reply.WhichOneof("message_response") == "file_descriptor_response", (name, reply.error_response)
        assert reply.original_request.file_containing_symbol == name
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw) for raw in reply.file_descriptor_response.file_descriptor_proto]
        # Dependencies before their users: add in an order the pool accepts.
        pending = {f.name: f for f in files}
        while pending:
            ready = [f for f in pending.values() if all(d not in pending for d in f.dependency)]
            assert ready, f"{name}: a dependency cycle or a missing file"
            for file in ready:
                try:
                    pool.Add(file)
                except TypeError:  # already added for an earlier service (the same file)
                    pass
                del pending[file.name]
    completions = pool.FindServiceByName("tailguard.v1.Completions")
    assert {"Chat", "ChatStream", "Complete", "CompleteStream", "GetLimits"} <= set(completions.methods_by_name)
    assert pool.FindServiceByName("grpc.reflection.v1.ServerReflection").methods_by_name["ServerReflectionInfo"].client_streaming


def test_reflection_v1_reports_an_unknown_symbol_as_not_found(service: Service) -> None:
    (reply,) = reflect_v1(service.grpc_target, [v1_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Service")])
    assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def _grpc_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## gRPC, for internal services")
    return text[start : text.index("\n## ", start + 1)]


def test_the_readme_example_runs_on_a_client_generated_as_the_readme_says(service: Service, tmp_path: Path) -> None:
    section = _grpc_section()
    commands = [line for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S) for line in block.splitlines()]
    (protoc,) = [line for line in commands if "grpc_tools.protoc" in line]
    assert protoc.startswith("python -m grpc_tools.protoc -I proto ")
    (example,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert "server" not in re.findall(r"^(?:from|import) (\w+)", example, flags=re.M)
    assert "127.0.0.1:50051" in example

    # The client author's folder: a copy of proto/, then the command as written.
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    argv = shlex.split(protoc)
    subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, check=True, timeout=60)
    assert (tmp_path / "tailguard/v1/tailguard_pb2_grpc.py").is_file()

    script = tmp_path / "example.py"
    script.write_text(example.replace("127.0.0.1:50051", service.grpc_target), encoding="utf-8")
    # The generated package is the one imported (from the script's folder), and none of tailguard's code.
    probe = "import sys, tailguard.v1.tailguard_pb2 as m; assert 'server' not in sys.modules; print(m.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    assert Path(where.stdout.strip()).is_relative_to(tmp_path)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    reply_fields = lines[0].split()
    assert reply_fields[-3:] == ["interactive", "interactive", "64"]  # class, pool, max_tokens
    assert len(reply_fields) > 3 and "".join(lines[1:]).strip()  # the reply's text, then the streamed text
