"""deploy/compose.yaml agrees with the config it mounts, the image it builds and the docs.

No Docker here: the file is read as YAML (anchors and merge keys resolved, as
Compose resolves them) and checked for what ``docker compose up`` relies on.

- Every key a service uses is one Compose knows (a misspelt key would be
  refused by Compose, or worse, ignored by an older one).
- tailguard is built as ``docker build -f deploy/Dockerfile .`` builds it
  (tests/e2e/test_packaging.py checks that build's context): the same
  context, Dockerfile and ignore file, and every COPY source is in the
  context as it is sent.
- The mounted config.toml loads, listens where the published ports point,
  keeps the shipped config's pools and classes, and names, for each of its
  endpoints, exactly one engine service (a vLLM one by default, a simulated
  one under ``--profile sim``) with the endpoint's port, seats, context
  length and model.
- The vLLM engines run docs/deployment.md's ``vllm serve`` flags, one GPU
  each; Redis is the config's [cluster] ledger and never evicts a lease.
- docs/deployment.md shows the commands, naming files that exist.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tailguard.router.config import Config, load_config
from tailguard.server.app import _HTTP_GRACE_SECONDS
from tailguard.server.cli import build_parser
from tests.docs.test_docs import code_blocks, vllm_commands
from tests.e2e.test_packaging import DOCKERFILE, DOCKERIGNORE, build_context, dockerfile_instructions, dockerignore_patterns

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose.yaml"
DOCS_PAGE = ROOT / "docs" / "deployment.md"

Service = dict[str, Any]

# The Compose Specification's service keys this file may use (compose-spec's schema has more).
SERVICE_KEYS = frozenset({
    "build", "image", "entrypoint", "command", "environment", "volumes", "ports", "depends_on",
    "healthcheck", "stop_grace_period", "restart", "ipc", "deploy", "profiles", "networks",
})
TOP_LEVEL_KEYS = frozenset({"name", "services", "volumes", "networks"})
# Where a vLLM container's command differs from deployment.md's: the listen address (127.0.0.1
# in a container is unreachable from tailguard's) and the model (a small one, under its own name).
CONTAINER_ONLY_FLAGS = ("model", "--served-model-name", "--host")


def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return document


def services() -> dict[str, Service]:
    found: dict[str, Service] = compose()["services"]
    return found


def engines(profile: str | None) -> dict[str, Service]:
    """The engine services ``docker compose up`` starts: without a profile, those of no profile."""
    return {
        name: service for name, service in services().items()
        if name not in ("tailguard", "redis") and (service.get("profiles") or [None]) == [profile]
    }


def flags(words: list[str]) -> dict[str, str]:
    """A command's ``MODEL --flag value --switch`` words as {flag: value}, "model" the first."""
    found = {"model": words[0]} if words and not words[0].startswith("--") else {}
    rest = words[len(found):]
    while rest:
        flag = rest.pop(0)
        assert flag.startswith("--"), f"unexpected word {flag!r}"
        found[flag] = rest.pop(0) if rest and not rest[0].startswith("--") else ""
    return found


def names_on_the_network(name: str, service: Service) -> set[str]:
    aliases = (service.get("networks") or {}).get("default", {}) or {}
    return {name, *aliases.get("aliases", [])}


def mounted_config_path() -> Path:
    """The config.toml that tailguard's ``--config`` names, on this side of its bind mount."""
    tailguard = services()["tailguard"]
    args = build_parser().parse_args(tailguard["command"])
    assert args.command == "serve" and not args.simulate
    inside: Path = args.config
    volume: str
    for volume in tailguard["volumes"]:
        source, target, *mode = volume.split(":")
        if inside.is_relative_to(target):
            assert mode == ["ro"], volume
            return (COMPOSE.parent / source / inside.relative_to(target)).resolve()
    raise AssertionError(f"no volume of tailguard's holds {inside}")


@pytest.fixture(scope="module")
def config() -> Config:
    return load_config(mounted_config_path())


# -- the file itself ----------------------------------------------------------------------


def test_every_key_is_a_compose_key() -> None:
    document = compose()
    assert set(document) - TOP_LEVEL_KEYS == {k for k in document if k.startswith("x-")}, "unknown top-level key"
    assert "version" not in document, "obsolete: Compose warns about it"
    for name, service in services().items():
        assert set(service) <= SERVICE_KEYS, f"{name}: {sorted(set(service) - SERVICE_KEYS)}"
        assert "image" in service, name
    for volume in (v for s in services().values() for v in s.get("volumes", [])):
        source = volume.split(":")[0]
        assert source.startswith(".") or source in document["volumes"], f"undeclared named volume {source}"


def test_tailguard_is_built_as_the_dockerfile_says() -> None:
    """The compose build is deploy/Dockerfile's: context the repository's root, the Dockerfile's own ignore file."""
    for name, service in services().items():
        if "build" not in service:
            continue
        build = service["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT, name
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE, name
        assert service["image"] == services()["tailguard"]["image"], "one image, tailguard's"
    # BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile; a .dockerignore in the
    # context would be the one an older builder reads instead.
    assert DOCKERIGNORE.exists() and not (ROOT / ".dockerignore").exists()
    sent = build_context(ROOT, dockerignore_patterns(DOCKERIGNORE))
    for instruction, arguments in dockerfile_instructions(DOCKERFILE):
        if instruction == "COPY":
            for source in shlex.split(arguments)[:-1]:
                assert source.rstrip("/") in sent, f"COPY {source}: not in the context compose sends"


# -- tailguard's config --------------------------------------------------------------------


def test_the_mounted_config_loads_and_listens_where_the_ports_point(config: Config) -> None:
    assert not config.warnings
    assert config.server.reload_poll_interval > 0, "an edit of the mounted file reloads"
    published = {int(port.rsplit(":", 1)[1]) for port in services()["tailguard"]["ports"]}
    assert config.server.http_host == "0.0.0.0" and config.server.grpc_host == "0.0.0.0"
    assert published == {config.server.http_port, config.server.grpc_port}
    health = " ".join(services()["tailguard"]["healthcheck"]["test"])
    assert f"127.0.0.1:{config.server.http_port}/health" in health


def test_the_mounted_config_keeps_the_shipped_pools_and_classes(config: Config) -> None:
    """Only the engines' addresses, the model and the listeners differ from the shipped config.toml."""
    shipped = load_config(ROOT / "config.toml")
    assert [p.name for p in config.pools] == [p.name for p in shipped.pools]
    for pool in config.pools:
        reference = shipped.pool(pool.name)
        for field in ("max_concurrency", "max_queue", "max_model_len", "simulate_profile", "lend", "placement", "queue_order"):
            assert getattr(pool, field) == getattr(reference, field), f"pools.{pool.name}.{field}"
    assert config.classes == shipped.classes


def test_every_endpoint_is_one_engine_service_in_each_setup(config: Config) -> None:
    for profile in (None, "sim"):
        running = engines(profile)
        assert len(running) == 2, profile
        used = set()
        for pool in config.pools:
            for endpoint in pool.endpoints:
                url = urlsplit(endpoint.url)
                [name] = [n for n, s in running.items() if url.hostname in names_on_the_network(n, s)]
                used.add(name)
                service = running[name]
                command = flags(service["command"])
                assert url.port == int(command["--port"]), endpoint.url
                assert int(command["--max-num-seqs"]) == endpoint.max_concurrency, endpoint.url
                assert int(command["--max-model-len"]) == pool.max_model_len, endpoint.url
                served = command.get("--served-model-name") or command["--model"]
                assert served in pool.models, endpoint.url
                assert command["--host"] == "0.0.0.0", endpoint.url
                if profile == "sim":
                    assert service["entrypoint"] == ["python", "-m", "tailguard.sim"]
                    assert command["--profile"] == pool.simulate_profile, endpoint.url
        assert used == set(running), f"{profile}: an engine no endpoint names"


# -- the engines ----------------------------------------------------------------------------


def test_vllm_engines_run_the_documented_flags_one_gpu_each() -> None:
    documented = {int(f["--port"]): f for f in vllm_commands()}
    running = engines(None)
    kubernetes = (ROOT / "deploy" / "kubernetes" / "vllm-interactive-deployment.yaml").read_text(encoding="utf-8")
    gpus = []
    for name, service in running.items():
        assert service["entrypoint"] == ["vllm", "serve"], name
        assert service["image"].startswith("vllm/vllm-openai:") and f"image: {service['image']}" in kubernetes, name
        command = flags(service["command"])
        doc = documented[int(command["--port"])]
        assert command["--served-model-name"] == command["model"], name
        strip = {k: v for k, v in command.items() if k not in CONTAINER_ONLY_FLAGS}
        assert strip == {k: v for k, v in doc.items() if k not in CONTAINER_ONLY_FLAGS}, name
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        assert "count" not in device, f"{name}: count: 1 gives every engine the first GPU; name it"
        gpus += device["device_ids"]
    assert len(gpus) == len(set(gpus)) == len(running), "one GPU each"


# -- Redis, shutdown ------------------------------------------------------------------------


def test_redis_is_the_ledger_and_never_evicts_a_lease(config: Config) -> None:
    assert config.cluster is not None
    url = urlsplit(config.cluster.redis_url)
    redis = services()["redis"]
    assert url.hostname == "redis" and url.port == 6379
    assert re.fullmatch(r"redis:[\w.-]+", redis["image"]), "the official image"
    command = redis["command"]
    assert command[0] == "redis-server" and "--port" not in command
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert services()["tailguard"]["depends_on"]["redis"]["condition"] == "service_healthy"
    workers = config.server.workers
    assert workers >= 2, "one process shares its caps with nobody"
    assert config.cluster.static_share * workers <= 1, "the fallback shares must not add up past a cap"


def test_the_stop_grace_period_covers_the_drain(config: Config) -> None:
    grace = services()["tailguard"]["stop_grace_period"]
    match = re.fullmatch(r"(\d+)s", grace)
    assert match, grace
    assert int(match[1]) > config.timeouts.drain_timeout + _HTTP_GRACE_SECONDS


# -- docs/deployment.md ----------------------------------------------------------------------


def test_the_deployment_guide_shows_the_commands() -> None:
    commands = [line for block in code_blocks(DOCS_PAGE, "sh") for line in block.splitlines() if "docker compose" in line]
    assert any(line.startswith("docker compose -f deploy/compose.yaml up") for line in commands)
    assert any("--profile sim" in line for line in commands)
    for line in commands:
        words = shlex.split(line)
        assert (ROOT / words[words.index("-f") + 1]).is_file(), line
        for target in words[words.index("up") + 1 :]:
            if not target.startswith("-"):
                assert target in services(), f"{line}: no service {target}"
