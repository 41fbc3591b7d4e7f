"""The Kubernetes manifests under deploy/kubernetes agree with the schemas, the code and the docs.

- Every manifest validates (strictly: an unknown field is an error) against
  the Kubernetes schemas of a pinned version, bundled with kubernetes-validate
  (no network, no cluster, no kustomize binary).
- The ConfigMap's config.toml is a valid tailguard config whose listeners,
  endpoints and drain timeout match the Deployments and Services around it.
- The vLLM Deployments run docs/deployment.md's ``vllm serve`` commands,
  but serve the model under its real name (the ConfigMap's ``models``), not
  the simulator's name the repository's config.toml uses.
- The kubelet's atomic ConfigMap update (a symlink swap) is seen by
  tailguard's config file watcher, so a ConfigMap change reloads without a
  restart.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import trio
import yaml

from tailguard.router.config import Config, parse_config
from tailguard.server.app import _HTTP_GRACE_SECONDS
from tailguard.server.cli import build_parser
from tailguard.server.reload import ConfigReloader
from tailguard.sim.server import DEFAULT_MODEL
from tests.docs.test_docs import code_blocks, vllm_commands

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
DOCS_PAGE = ROOT / "docs" / "kubernetes.md"
# The oldest Kubernetes the manifests are for (the preStop `sleep` action is on by default from 1.30).
KUBERNETES_VERSION = "1.30"
CLUSTER_DOMAIN = "svc.cluster.local"

Manifest = dict[str, Any]


def kustomization() -> Manifest:
    document: Manifest = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text(encoding="utf-8"))
    return document


def manifests() -> list[tuple[str, Manifest]]:
    """(file name, object) for every object in the files kustomization.yaml lists."""
    found = []
    for name in kustomization()["resources"]:
        for document in yaml.safe_load_all((KUBERNETES / name).read_text(encoding="utf-8")):
            if document is not None:
                found.append((name, document))
    return found


def objects(kind: str) -> dict[str, Manifest]:
    return {m["metadata"]["name"]: m for _, m in manifests() if m["kind"] == kind}


def one(kind: str, name: str) -> Manifest:
    found = objects(kind)
    assert name in found, f"no {kind} {name} in deploy/kubernetes"
    return found[name]


def container(deployment: Manifest) -> Manifest:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, deployment["metadata"]["name"]
    result: Manifest = containers[0]
    return result


def container_port(deployment: Manifest, port: int | str) -> int:
    """A Service's or probe's port (a number or a port name) as the container's port number."""
    ports = container(deployment).get("ports", [])
    for entry in ports:
        if port in (entry["containerPort"], entry.get("name")):
            return int(entry["containerPort"])
    raise AssertionError(f"{deployment['metadata']['name']} has no container port {port!r}")


def selected_deployment(service: Manifest) -> Manifest:
    """The one Deployment whose pods a Service selects."""
    selector = service["spec"]["selector"]
    chosen = [
        d for d in objects("Deployment").values()
        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(chosen) == 1, f"Service {service['metadata']['name']} selects {len(chosen)} Deployments"
    return chosen[0]


def shipped_config_text() -> str:
    return str(one("ConfigMap", "tailguard-config")["data"]["config.toml"])


@pytest.fixture(scope="module")
def config() -> Config:
    return parse_config(shipped_config_text(), source="tailguard-configmap.yaml")


def vllm_flags(deployment: Manifest) -> dict[str, str]:
    """A vLLM container's ``vllm serve`` words as {flag: value}, as tests/docs/test_docs.py reads the docs."""
    words = [*container(deployment)["command"], *container(deployment)["args"]]
    assert words[:2] == ["vllm", "serve"], deployment["metadata"]["name"]
    flags = {"model": words[2]}
    rest = words[3:]
    while rest:
        flag = rest.pop(0)
        assert flag.startswith("--"), f"unexpected word {flag!r}"
        flags[flag] = rest.pop(0) if rest and not rest[0].startswith("--") else ""
    return flags


def vllm_deployments() -> dict[str, Manifest]:
    return {name: d for name, d in objects("Deployment").items() if container(d)["name"] == "vllm"}


# -- the manifests themselves ---------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    listed = kustomization()["resources"]
    on_disk = sorted(p.name for p in KUBERNETES.iterdir() if p.name != "kustomization.yaml")
    assert len(listed) == len(set(listed)), "a file listed twice"
    assert sorted(listed) == on_disk, "kustomization.yaml must list every file beside it, and only those"
    assert kustomization()["kind"] == "Kustomization"


@pytest.mark.parametrize("name", kustomization()["resources"])
def test_manifest_validates_against_the_kubernetes_schemas(name: str) -> None:
    documents = [d for d in yaml.safe_load_all((KUBERNETES / name).read_text(encoding="utf-8")) if d is not None]
    assert documents, name
    for document in documents:
        # Raises ValidationError (naming the field) on a wrong type or an unknown field.
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        assert "namespace" not in document["metadata"], "kustomization.yaml sets the namespace"


def test_the_validator_refuses_a_broken_manifest() -> None:
    """The check above can fail: a misspelt probe field is refused."""
    deployment = yaml.safe_load((KUBERNETES / "tailguard-deployment.yaml").read_text(encoding="utf-8"))
    container(deployment)["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_every_service_selects_one_deployment_and_its_ports() -> None:
    for name, service in objects("Service").items():
        deployment = selected_deployment(service)
        for port in service["spec"]["ports"]:
            assert container_port(deployment, port["targetPort"]), f"Service {name}"


# -- tailguard: config, ports, probes, shutdown ------------------------------------------


def test_configmap_config_parses_and_listens_on_the_pod(config: Config) -> None:
    assert not config.warnings
    assert config.server.http_host == "0.0.0.0" and config.server.grpc_host == "0.0.0.0"
    assert config.server.reload_poll_interval > 0, "a ConfigMap change must reload"


def test_tailguard_serves_the_mounted_config() -> None:
    deployment = one("Deployment", "tailguard")
    words = [*container(deployment)["command"], *container(deployment)["args"]]
    assert words[0] == "tailguard"
    args = build_parser().parse_args(words[1:])
    assert args.command == "serve" and not args.simulate and not args.no_grpc
    mounts = {m["name"]: m for m in container(deployment)["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    [(volume_name, mount)] = [(n, m) for n, m in mounts.items() if "configMap" in volumes[n]]
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
    assert volumes[volume_name]["configMap"]["name"] == "tailguard-config"
    assert "items" not in volumes[volume_name]["configMap"]
    assert Path(mount["mountPath"]) / "config.toml" == args.config


def test_services_ports_are_the_listeners(config: Config) -> None:
    deployment = one("Deployment", "tailguard")
    ports = {p["name"]: p for s in objects("Service").values() for p in s["spec"]["ports"] if selected_deployment(s)["metadata"]["name"] == "tailguard"}
    assert ports["http"]["port"] == container_port(deployment, ports["http"]["targetPort"]) == config.server.http_port
    assert ports["grpc"]["port"] == container_port(deployment, ports["grpc"]["targetPort"]) == config.server.grpc_port


def test_probes_ready_on_health_alive_while_draining(config: Config) -> None:
    deployment = one("Deployment", "tailguard")
    tailguard = container(deployment)
    readiness = tailguard["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/health"
    assert container_port(deployment, readiness["port"]) == config.server.http_port
    # /health answers 503 while draining: a liveness probe there would kill a draining pod.
    liveness = tailguard["livenessProbe"]["httpGet"]
    assert liveness["path"] == "/metrics" and config.server.metrics_listen is not None
    assert container_port(deployment, liveness["port"]) == config.server.metrics_listen[1]  # where /metrics is served
    assert tailguard["livenessProbe"]["failureThreshold"] * tailguard["livenessProbe"]["periodSeconds"] >= 30


def test_grace_period_covers_prestop_drain_and_last_bytes(config: Config) -> None:
    deployment = one("Deployment", "tailguard")
    pre_stop = container(deployment)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 5, "time for the endpoints to de-register before SIGTERM"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + config.timeouts.drain_timeout + _HTTP_GRACE_SECONDS


def test_rolling_update_and_disruption_budget_keep_a_replica_serving() -> None:
    deployment = one("Deployment", "tailguard")
    replicas = deployment["spec"]["replicas"]
    assert replicas >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    [budget] = objects("PodDisruptionBudget").values()
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert 1 <= budget["spec"]["maxUnavailable"] < replicas


def test_prometheus_scrapes_the_metrics_ports(config: Config) -> None:
    for name, deployment in {"tailguard": one("Deployment", "tailguard"), **vllm_deployments()}.items():
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/path"] == "/metrics", name
        assert container_port(deployment, int(annotations["prometheus.io/port"])), name
    tailguard = one("Deployment", "tailguard")["spec"]["template"]["metadata"]["annotations"]
    assert config.server.metrics_listen is not None
    assert int(tailguard["prometheus.io/port"]) == config.server.metrics_listen[1]


def test_metrics_are_on_a_port_of_their_own_that_no_service_exposes(config: Config) -> None:
    """/metrics names every tenant and its usage: the callers' Service reaches the API, never the metrics port."""
    assert config.server.metrics_listen is not None, "the API's port would serve /metrics to every caller"
    deployment = one("Deployment", "tailguard")
    metrics_port = config.server.metrics_listen[1]
    assert metrics_port not in (config.server.http_port, config.server.grpc_port)
    for service in objects("Service").values():
        if selected_deployment(service)["metadata"]["name"] == "tailguard":
            for port in service["spec"]["ports"]:
                assert container_port(deployment, port["targetPort"]) != metrics_port, service["metadata"]["name"]


def test_redis_never_evicts_a_lease() -> None:
    redis = one("Deployment", "redis")
    args = container(redis)["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    service = one("Service", "redis")
    assert selected_deployment(service)["metadata"]["name"] == "redis"


# -- vLLM: the documented commands, behind the config's endpoints -------------------------


# Where a pod's command differs from deployment.md's: the listen address (127.0.0.1 in a pod is
# unreachable from tailguard's pods) and the served name (the real model's, not the simulator's).
POD_ONLY_FLAGS = ("--host", "--served-model-name")


def test_vllm_deployments_run_the_documented_commands() -> None:
    documented = {int(flags["--port"]): flags for flags in vllm_commands()}
    deployments = vllm_deployments()
    assert len(deployments) == len(documented) == 2
    for name, deployment in deployments.items():
        flags = vllm_flags(deployment)
        doc = documented[int(flags["--port"])]
        assert doc["--host"] == "127.0.0.1" and flags["--host"] == "0.0.0.0", name
        assert {k: v for k, v in flags.items() if k not in POD_ONLY_FLAGS} == {k: v for k, v in doc.items() if k not in POD_ONLY_FLAGS}, name
        assert container_port(deployment, "http") == int(flags["--port"])
        assert container(deployment)["resources"]["limits"]["nvidia.com/gpu"] == "1", name
        # One pod behind the endpoint's one cap; Recreate: no second GPU for a surge.
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate", name


def test_the_example_serves_the_model_under_its_real_name(config: Config) -> None:
    """A cluster's clients send the model's own name: every engine serves the model it loads
    under that name, and every pool lists it, never the simulator's stand-in."""
    for name, deployment in vllm_deployments().items():
        flags = vllm_flags(deployment)
        assert flags["--served-model-name"] == flags["model"] == "meta-llama/Llama-3.1-8B-Instruct", name
    for pool in config.pools:
        assert pool.models == ("meta-llama/Llama-3.1-8B-Instruct",), pool.name
        assert DEFAULT_MODEL not in pool.models, pool.name


def test_config_endpoints_are_the_engines_headless_services(config: Config) -> None:
    namespace = kustomization()["namespace"]
    services = objects("Service")
    used = set()
    for pool in config.pools:
        for endpoint in pool.endpoints:
            url = urlsplit(endpoint.url)
            match = re.fullmatch(rf"([a-z0-9-]+)\.{re.escape(namespace)}\.{re.escape(CLUSTER_DOMAIN)}", url.hostname or "")
            assert match, f"{endpoint.url}: not <service>.{namespace}.{CLUSTER_DOMAIN}"
            service = services[match[1]]
            used.add(match[1])
            assert service["spec"].get("clusterIP") == "None", f"{match[1]} must be headless"
            # Headless: the URL's port is the pod's own, so Service port = container port = vllm --port.
            [port] = service["spec"]["ports"]
            deployment = selected_deployment(service)
            flags = vllm_flags(deployment)
            assert url.port == port["port"] == container_port(deployment, port["targetPort"]) == int(flags["--port"])
            assert int(flags["--max-num-seqs"]) == endpoint.max_concurrency, endpoint.url
            assert int(flags["--max-model-len"]) == pool.max_model_len, endpoint.url
            assert flags["--served-model-name"] in pool.models, endpoint.url
    engines = {name for name, s in services.items() if selected_deployment(s)["metadata"]["name"] in vllm_deployments()}
    assert used == engines, "one endpoint per engine Service"


# -- docs/kubernetes.md ----------------------------------------------------------------


def test_documented_cluster_table_parses_and_names_the_redis_service() -> None:
    """The [cluster] table, as the page shows it, is the ConfigMap's, and fits its config."""
    snippets = [block for block in code_blocks(DOCS_PAGE, "toml") if "[cluster]" in block]
    assert len(snippets) == 1
    without = shipped_config_text().split("\n    [cluster]")[0].split("\n[cluster]")[0]
    config = parse_config(without + "\n" + snippets[0])
    assert config.cluster is not None
    url = urlsplit(config.cluster.redis_url)
    redis = one("Service", "redis")
    assert url.hostname == f"redis.{kustomization()['namespace']}.{CLUSTER_DOMAIN}"
    assert url.port == redis["spec"]["ports"][0]["port"]
    replicas = one("Deployment", "tailguard")["spec"]["replicas"]
    assert config.cluster.static_share * replicas <= 1, "the fallback shares must not add up past a cap"
    assert parse_config(shipped_config_text()).cluster == config.cluster  # the ConfigMap has the same table


def test_documented_commands_name_real_files() -> None:
    commands = " ".join(code_blocks(DOCS_PAGE, "sh"))
    for path in re.findall(r"(?:-k|-f) (deploy/\S*)", commands):
        assert (ROOT / path).exists(), path
    assert "kubectl apply -k deploy/kubernetes" in commands


# -- the kubelet's ConfigMap update, as tailguard's watcher sees it -----------------------


def kubelet_write(volume: Path, files: dict[str, str], generation: int) -> None:
    """Write a ConfigMap volume as the kubelet's AtomicWriter does.

    The files go into a new hidden directory; ``..data`` is re-pointed at it
    by renaming a fresh symlink over it (atomic); each visible name is a
    symlink through ``..data``, made once. The old directory is removed.
    """
    new = volume / f"..2025_01_01_00_00_0{generation}.{generation:09d}"
    new.mkdir()
    for name, text in files.items():
        (new / name).write_text(text, encoding="utf-8")
        # The kubelet writes each version when it syncs, seconds or minutes after the last.
        os.utime(new / name, ns=(generation * 10**11, generation * 10**11))
    old = os.readlink(volume / "..data") if (volume / "..data").is_symlink() else None
    os.symlink(new.name, volume / "..data_tmp")
    os.rename(volume / "..data_tmp", volume / "..data")
    for name in files:
        if not (volume / name).is_symlink():
            os.symlink(f"..data/{name}", volume / name)
    if old is not None:
        for child in (volume / old).iterdir():
            child.unlink()
        (volume / old).rmdir()


async def test_a_configmap_update_reloads_tailguard(tmp_path: Path) -> None:
    text = shipped_config_text()
    kubelet_write(tmp_path, {"config.toml": text}, generation=1)
    path = tmp_path / "config.toml"
    applied: list[Config] = []
    changed = trio.Event()

    async def apply(new: Config) -> None:
        applied.append(new)
        changed.set()

    reloader = ConfigReloader(path, parse_config(text), apply)
    edited = text.replace("queue_timeout = 3.0", "queue_timeout = 2.0")
    assert edited != text
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reloader.watch_file, 0.01)
        kubelet_write(tmp_path, {"config.toml": edited}, generation=2)
        with trio.fail_after(10):
            await changed.wait()
        nursery.cancel_scope.cancel()
    [new] = applied
    assert new.class_named("interactive").queue_timeout == 2.0
    assert reloader.reloads_ok == 1 and reloader.reloads_failed == 0
