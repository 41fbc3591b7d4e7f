"""TLS and mTLS on the listeners, over real sockets on 127.0.0.1 with a CA made here.

``trustme`` makes a CA, a server certificate for 127.0.0.1/localhost and a
client certificate per test; nothing is committed. The HTTP listener is
tailguard's own server (``trio.SSLStream`` per connection), the gRPC one
grpc's dynamic credentials; both re-read their files on reload.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import trio
import trustme

from tailguard.router.config import ConfigError, load_config, parse_config, render_config
from tailguard.server.app import Running, serve
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tests.helpers.engines import MODEL
from tests.helpers.sockets import QUICK, Backends, engines_on_sockets, eventually

CHAT = {"messages": [{"role": "user", "content": "Hello over TLS"}], "max_tokens": 8}


@dataclass
class Pki:
    """A CA and the files of a server certificate (and key) and a client's, in ``folder``."""

    ca: trustme.CA
    folder: Path

    @property
    def ca_file(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def cert_file(self) -> Path:
        return self.folder / "server.pem"

    @property
    def key_file(self) -> Path:
        return self.folder / "server.key"

    def write_server(self, organization: str) -> None:
        """A new server certificate and key, swapped in as a Secret's files are (new inodes)."""
        cert = self.ca.issue_cert("127.0.0.1", "localhost", organization_name=organization)
        for path, pem in ((self.cert_file, cert.cert_chain_pems[0].bytes()), (self.key_file, cert.private_key_pem.bytes())):
            fresh = path.with_suffix(".new")
            fresh.write_bytes(pem)
            os.replace(fresh, path)

    def client_context(self, *, with_cert: bool = False, ca: trustme.CA | None = None) -> ssl.SSLContext:
        """A client's context trusting this CA; ``with_cert``: presenting a certificate ``ca`` (default this one) signed."""
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        if with_cert:
            (ca or self.ca).issue_cert("client@example.internal", common_name="a client").configure_cert(context)
        return context

    def grpc_credentials(self, *, with_cert: bool) -> grpc.ChannelCredentials:
        if not with_cert:
            return grpc.ssl_channel_credentials(root_certificates=self.ca.cert_pem.bytes())
        client = self.ca.issue_cert("client@example.internal", common_name="a client")
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.cert_pem.bytes(),
            private_key=client.private_key_pem.bytes(),
            certificate_chain=client.cert_chain_pems[0].bytes(),
        )


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    made = Pki(trustme.CA(organization_name="tailguard test CA"), tmp_path)
    made.ca.cert_pem.write_to_path(str(made.ca_file))
    made.write_server("first")
    return made


def tls_table(name: str, pki: Pki, *, mutual: bool = False) -> str:
    ca = f'client_ca_file = "{pki.ca_file}"\n' if mutual else ""
    return f'[server.{name}]\ncert_file = "{pki.cert_file}"\nkey_file = "{pki.key_file}"\n{ca}'


def config_text(urls: list[str], tls: str, *, poll: float = 0.0, header_timeout: float = 10.0) -> str:
    """One pool over ``urls``, and the listeners' TLS tables ``tls``."""
    endpoints = ", ".join(f'{{ url = "{url}", max_concurrency = 4 }}' for url in urls)
    return f"""
[server]
http_listen = "127.0.0.1:0"
grpc_listen = "127.0.0.1:0"
reload_poll_interval = {poll}
header_timeout = {header_timeout}
{tls}
[pools.main]
max_concurrency = {4 * len(urls)}
max_queue = 16
max_model_len = 32768
models = ["{MODEL}"]
endpoints = [{endpoints}]

[classes.all]
pool = "main"
queue_timeout = 10.0
"""


@asynccontextmanager
async def running(urls: list[str], tls: str, tmp_path: Path, **options: float) -> AsyncIterator[tuple[Running, Path]]:
    """tailguard from a config file (so it reloads), HTTP and gRPC on free ports."""
    path = tmp_path / "config.toml"
    path.write_text(config_text(urls, tls, **options))
    shutdown = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:

            async def run(task_status: trio.TaskStatus[Running]) -> None:
                await serve(load_config(path), path, http_port=0, grpc=True, grpc_port=0, shutdown=shutdown, task_status=task_status)

            started: Running = await nursery.start(run)
            try:
                yield started, path
            finally:
                shutdown.set()


async def peer_organization(port: int, context: ssl.SSLContext, alpn: str = "http/1.1") -> str:
    """The organization in the certificate a new TLS connection to ``port`` is served."""
    context.set_alpn_protocols([alpn])
    stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=context, https_compatible=True)
    try:
        await stream.do_handshake()
        cert = stream.getpeercert()
    finally:
        await stream.aclose()
    assert cert is not None
    return str(next(value for rdn in cert["subject"] for name, value in rdn if name == "organizationName"))


def grpc_chat(port: int, credentials: grpc.ChannelCredentials | None) -> str:
    """One unary Chat over a fresh channel (blocking: run it in a thread)."""
    target = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(target) if credentials is None else grpc.secure_channel(target, credentials)
    with channel:
        stub = pb_grpc.CompletionsStub(channel)
        request = pb.ChatRequest(messages=[pb.Message(role="user", content="Hello over TLS")], options=pb.Options(max_tokens=8))
        reply = stub.Chat(request, timeout=10)
        return str(reply.content)


def http_port(started: Running) -> int:
    return int(started.http_url.rsplit(":", 1)[1])


# -- config ---------------------------------------------------------------------------


def test_config_reads_each_listeners_tls_and_shows_only_paths(pki: Pki) -> None:
    config = parse_config(config_text(["http://127.0.0.1:9"], tls_table("http_tls", pki) + tls_table("grpc_tls", pki, mutual=True)))
    http_tls, grpc_tls = config.server.http_tls, config.server.grpc_tls
    assert http_tls is not None and grpc_tls is not None
    assert (http_tls.cert_file, http_tls.key_file, http_tls.client_ca_file) == (str(pki.cert_file), str(pki.key_file), None)
    assert grpc_tls.client_ca_file == str(pki.ca_file)
    assert http_tls.fingerprint and http_tls.fingerprint not in repr(http_tls)
    shown = render_config(config)
    assert f"cert {pki.cert_file}, key {pki.key_file}; any client" in shown
    assert f"client certificates required, signed by {pki.ca_file}" in shown
    assert "BEGIN" not in shown and http_tls.fingerprint not in shown
    plain = parse_config(config_text(["http://127.0.0.1:9"], ""))
    assert plain.server.http_tls is None and plain.server.grpc_tls is None
    assert re.search(r"^  http_tls, grpc_tls +off \(plain TCP\)$", render_config(plain), re.MULTILINE)


def test_config_refuses_tls_files_that_cannot_serve_naming_the_key(pki: Pki, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    other = pki.ca.issue_cert("127.0.0.1")
    (tmp_path / "other.key").write_bytes(other.private_key_pem.bytes())
    key = serialization.load_pem_private_key(pki.key_file.read_bytes(), password=None)
    encrypted = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"secret"))
    (tmp_path / "encrypted.key").write_bytes(encrypted)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    cases = {
        f'[server.http_tls]\ncert_file = "{tmp_path / "missing.pem"}"\nkey_file = "{pki.key_file}"\n': "server.http_tls.cert_file: cannot read",
        f'[server.grpc_tls]\ncert_file = "{pki.cert_file}"\nkey_file = "{tmp_path / "other.key"}"\n': "server.grpc_tls.key_file:",
        f'[server.grpc_tls]\ncert_file = "{tmp_path / "junk.pem"}"\nkey_file = "{pki.key_file}"\n': "server.grpc_tls.cert_file:",
        f'[server.http_tls]\ncert_file = "{pki.cert_file}"\nkey_file = "{tmp_path / "encrypted.key"}"\n': "server.http_tls.key_file:",
        tls_table("http_tls", pki).replace(f'"{pki.key_file}"', f'"{pki.key_file}"\nclient_ca_file = "{tmp_path / "junk.pem"}"'): "server.http_tls.client_ca_file:",
        f'[server.http_tls]\ncert_file = "{pki.cert_file}"\n': "server.http_tls.key_file: missing",
        tls_table("http_tls", pki) + "certfile = 1\n": "server.http_tls.certfile: unknown key (did you mean 'cert_file'?)",
        'http_server = "other"\n' + tls_table("http_tls", pki): 'server.http_server: must be "lean" or left out',
    }
    for tls, expected in cases.items():
        with pytest.raises(ConfigError) as refused:
            parse_config(config_text(["http://127.0.0.1:9"], tls))
        assert any(problem.startswith(expected) for problem in refused.value.problems), (expected, refused.value.problems)
        assert "PRIVATE KEY" not in str(refused.value)


# -- HTTP -----------------------------------------------------------------------------


async def test_https_completion_through_the_router(pki: Pki, tmp_path: Path, one_engine: Backends) -> None:
    async with running(one_engine.urls, tls_table("http_tls", pki), tmp_path) as (started, _):
        assert started.http_url.startswith("https://127.0.0.1:")
        async with httpx.AsyncClient(base_url=started.http_url, verify=pki.client_context(), timeout=10) as client:
            reply = await client.post("/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"]
            async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as stream:
                assert stream.status_code == 200
                body = b"".join([chunk async for chunk in stream.aiter_raw()])
            assert body.rstrip().endswith(b"data: [DONE]")
            again = await client.get("/health")  # the same kept-alive connection
            assert again.status_code == 200


async def test_plain_http_to_the_tls_port_is_told_so_and_the_port_keeps_serving(pki: Pki, tmp_path: Path, one_engine: Backends) -> None:
    async with running(one_engine.urls, tls_table("http_tls", pki), tmp_path) as (started, _):
        plain_url = started.http_url.replace("https://", "http://")
        async with httpx.AsyncClient(timeout=10) as plain:
            reply = await plain.post(f"{plain_url}/v1/chat/completions", json=CHAT)
        assert reply.status_code == 400
        assert reply.json()["error"]["code"] == "tls_required"
        assert reply.headers["connection"] == "close"
        async with httpx.AsyncClient(base_url=started.http_url, verify=pki.client_context(), timeout=10) as client:
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_a_tls_handshake_must_finish_within_the_header_timeout(pki: Pki, tmp_path: Path, one_engine: Backends) -> None:
    async with running(one_engine.urls, tls_table("http_tls", pki), tmp_path, header_timeout=0.3) as (started, _):
        stream = await trio.open_tcp_stream("127.0.0.1", http_port(started))
        async with stream:
            await stream.send_all(b"\x16\x03\x01")  # a handshake record begun, never finished
            with trio.fail_after(5):
                assert await stream.receive_some(1024) == b""  # closed by the server, no answer
        assert started.router.statistics().open_requests == 0


async def test_mtls_refuses_a_client_without_a_good_certificate_and_serves_one_with_it(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tailguard.http_server")
    stranger = trustme.CA(organization_name="someone else")
    async with engines_on_sockets([QUICK]) as backends, running(backends.urls, tls_table("http_tls", pki, mutual=True), tmp_path) as (started, _):
        for context in (pki.client_context(), pki.client_context(with_cert=True, ca=stranger)):
            async with httpx.AsyncClient(base_url=started.http_url, verify=context, timeout=10) as client:
                with pytest.raises(httpx.TransportError):
                    await client.post("/v1/chat/completions", json=CHAT)
        failures = [r.getMessage() for r in caplog.records if "TLS handshake" in r.getMessage()]
        assert len(failures) == 2, failures
        assert started.metrics is not None and started.router.statistics().open_requests == 0
        async with httpx.AsyncClient(base_url=started.http_url, verify=pki.client_context(with_cert=True), timeout=10) as client:
            reply = await client.post("/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200, reply.text


# -- gRPC -----------------------------------------------------------------------------


async def test_grpc_over_tls_and_mtls(pki: Pki, tmp_path: Path) -> None:
    tls = tls_table("grpc_tls", pki, mutual=True)
    async with engines_on_sockets([QUICK]) as backends, running(backends.urls, tls, tmp_path) as (started, _):
        port = started.grpc_port
        assert port is not None
        assert started.http_url.startswith("http://")  # each listener its own: HTTP stays plain
        assert await trio.to_thread.run_sync(grpc_chat, port, pki.grpc_credentials(with_cert=True))
        for credentials in (pki.grpc_credentials(with_cert=False), None):  # no client certificate; plaintext
            with pytest.raises(grpc.RpcError) as refused:
                await trio.to_thread.run_sync(grpc_chat, port, credentials)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_grpc_over_tls_without_client_certificates(pki: Pki, tmp_path: Path, one_engine: Backends) -> None:
    async with running(one_engine.urls, tls_table("grpc_tls", pki), tmp_path) as (started, _):
        assert started.grpc_port is not None
        assert await trio.to_thread.run_sync(grpc_chat, started.grpc_port, pki.grpc_credentials(with_cert=False))


# -- reload ---------------------------------------------------------------------------


async def test_a_rotated_certificate_serves_new_connections_after_a_reload(pki: Pki, tmp_path: Path) -> None:
    """SIGHUP's reload, then the poll of the TLS files alone (the config file untouched), on both listeners."""
    tls = tls_table("http_tls", pki) + tls_table("grpc_tls", pki, mutual=True)
    async with engines_on_sockets([QUICK]) as backends, running(backends.urls, tls, tmp_path) as (started, path):
        reloader = started.reloader
        assert reloader is not None and started.grpc_port is not None
        ports = {"http/1.1": http_port(started), "h2": started.grpc_port}
        for alpn, port in ports.items():
            assert await peer_organization(port, pki.client_context(with_cert=True), alpn) == "first"

        pki.write_server("second")
        assert await reloader.reload()
        for alpn, port in ports.items():
            assert await peer_organization(port, pki.client_context(with_cert=True), alpn) == "second", alpn
        assert await trio.to_thread.run_sync(grpc_chat, started.grpc_port, pki.grpc_credentials(with_cert=True))
        async with httpx.AsyncClient(base_url=started.http_url, verify=pki.client_context(), timeout=10) as client:
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200

        # The files' poll: only the certificate changes, and it is picked up.
        path.write_text(config_text(backends.urls, tls, poll=0.02))
        assert await reloader.reload()
        pki.write_server("third")
        await eventually(lambda: reloader.reloads_ok == 3, timeout=5)
        for alpn, port in ports.items():
            assert await peer_organization(port, pki.client_context(with_cert=True), alpn) == "third", alpn


async def test_reload_turns_http_tls_off_live_and_keeps_grpc_tls_until_a_restart(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tls = tls_table("http_tls", pki) + tls_table("grpc_tls", pki)
    async with engines_on_sockets([QUICK]) as backends, running(backends.urls, tls, tmp_path) as (started, path):
        assert started.reloader is not None and started.grpc_port is not None
        path.write_text(config_text(backends.urls, ""))
        assert await started.reloader.reload()
        async with httpx.AsyncClient(timeout=10) as plain:
            reply = await plain.post(f"{started.http_url.replace('https://', 'http://')}/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200
        warnings = [r.getMessage() for r in caplog.records if r.name == "tailguard.reload" and r.levelno == logging.WARNING]
        assert any("server.grpc_tls" in w and "restart" in w for w in warnings), warnings
        assert started.router.config.server.grpc_tls is not None  # as it runs
        assert await peer_organization(started.grpc_port, pki.client_context(), "h2") == "first"
        path.write_text(config_text(backends.urls, tls))  # and on again, live
        assert await started.reloader.reload()
        assert await peer_organization(http_port(started), pki.client_context()) == "first"


async def test_a_reload_whose_key_no_longer_matches_is_refused_and_the_old_certificate_serves(pki: Pki, tmp_path: Path, one_engine: Backends) -> None:
    async with running(one_engine.urls, tls_table("http_tls", pki), tmp_path) as (started, _):
        assert started.reloader is not None
        pki.key_file.write_bytes(pki.ca.issue_cert("127.0.0.1").private_key_pem.bytes())  # half a rotation
        assert not await started.reloader.reload()
        assert await peer_organization(http_port(started), pki.client_context()) == "first"


# -- docs/deployment.md's TLS section -------------------------------------------------

DEPLOYMENT = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
SHIPPED = Path(__file__).resolve().parents[2] / "config.toml"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", DEPLOYMENT.read_text(encoding="utf-8"), flags=re.M | re.S)


def test_the_documented_tls_tables_are_what_tailguard_reads(pki: Pki) -> None:
    """The deployment page's [server.*_tls] snippet, its paths pointed at real files, loads beside the shipped file."""
    import tomllib

    (snippet,) = [block for block in code_blocks("toml") if "[server.http_tls]" in block]
    tables = tomllib.loads(snippet)["server"]
    assert set(tables) == {"http_tls", "grpc_tls"}
    files = {"cert_file": pki.cert_file, "key_file": pki.key_file, "client_ca_file": pki.ca_file}
    text = SHIPPED.read_text(encoding="utf-8").replace("\n[estimate]\n", "\n" + "".join(
        f"[server.{name}]\n" + "".join(f'{key} = "{files[key]}"\n' for key in table) for name, table in tables.items()
    ) + "\n[estimate]\n", 1)
    config = parse_config(text)
    assert config.server.http_tls is not None and config.server.http_tls.client_ca_file is None
    assert config.server.grpc_tls is not None and config.server.grpc_tls.client_ca_file == str(pki.ca_file)


def test_the_documented_envoy_config_waits_longer_than_tailguard_and_idles_less() -> None:
    import yaml

    shipped = load_config(SHIPPED)
    (block,) = code_blocks("yaml")
    envoy = yaml.safe_load(block)["static_resources"]

    def seconds(value: str) -> float:
        assert value.endswith("s"), value
        return float(value[:-1])

    routes = [
        route["route"]
        for listener in envoy["listeners"]
        for chain in listener["filter_chains"]
        for network_filter in chain["filters"]
        for host in network_filter["typed_config"]["route_config"]["virtual_hosts"]
        for route in host["routes"]
    ]
    assert len(routes) == 2 and all(seconds(r["timeout"]) > shipped.timeouts.end_to_end_timeout for r in routes)
    assert all("retry_policy" not in route for route in routes)
    ports = {}
    for cluster in envoy["clusters"]:
        options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert seconds(options["common_http_protocol_options"]["idle_timeout"]) < shipped.server.keep_alive_timeout
        (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        ports[cluster["name"]] = endpoint["endpoint"]["address"]["socket_address"]["port_value"]
    assert ports == {"tailguard_http": shipped.server.http_port, "tailguard_grpc": shipped.server.grpc_port}
    for listener in envoy["listeners"]:
        for chain in listener["filter_chains"]:
            assert chain["transport_socket"]["name"] == "envoy.transport_sockets.tls"
