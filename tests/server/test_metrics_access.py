"""Who may read /metrics: a token ([metrics] token_env), a listener of its own ([server] metrics_listen), or anyone (the default).

/metrics names every tenant and its usage (issue 32, item 9). Open stays
the default, so existing scrapes keep working; either option closes it to
the API's callers, and a refusal is the error table's ``unauthenticated``
row, in OpenAI's shape.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from tailguard.router.config import Config, ConfigError, MetricsConfig, ServerConfig, parse_config, render_config
from tailguard.server.reload import restart_needed
from tests.helpers.config_text import BASE
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import Backends, tailguard

TOKEN = "scrape-me-0123456789"


def test_the_token_and_the_listener_are_read_checked_and_rendered_without_the_token() -> None:
    config = parse_config(
        '[server]\nmetrics_listen = "127.0.0.1:9100"\n[metrics]\ntoken_env = "TG_METRICS"\n' + BASE, environ={"TG_METRICS": f" {TOKEN}\n"}
    )
    assert config.server.metrics_listen == ("127.0.0.1", 9100)
    assert config.metrics.token_env == "TG_METRICS" and config.metrics.token_sha256 is not None
    shown = render_config(config) + repr(config)
    assert TOKEN not in shown and config.metrics.token_sha256 not in shown
    rendered = [line.split() for line in render_config(config).splitlines()]
    assert ["metrics_listen", "127.0.0.1:9100"] in rendered and ["token_env", "TG_METRICS", "(value", "not", "shown)"] in rendered
    default = parse_config(BASE)
    assert default.server.metrics_listen is None and default.metrics.token_sha256 is None  # open, on the API's listener, as before
    for text, environ, problem in (
        ('[metrics]\ntoken_env = "TG_METRICS"\n', {}, "metrics.token_env: environment variable TG_METRICS is not set"),
        ('[metrics]\ntoken_env = "TG_METRICS"\n', {"TG_METRICS": " "}, "metrics.token_env: environment variable TG_METRICS is empty"),
        ('[metrics]\ntoken_env = "not a name"\n', {}, "metrics.token_env: must be the name of an environment variable"),
        ('[server]\nhttp_listen = "127.0.0.1:8080"\nmetrics_listen = "0.0.0.0:8080"\n', {}, "server.metrics_listen: must not be the port"),
        ('[server]\nmetrics_listen = "nowhere"\n', {}, "server.metrics_listen:"),
    ):
        with pytest.raises(ConfigError) as refused:
            parse_config(text + BASE, environ=environ)
        assert problem in str(refused.value), str(refused.value)


def test_a_metrics_listener_is_a_restart_only_key() -> None:
    config = parse_config(BASE)
    moved = dataclasses.replace(config, server=dataclasses.replace(config.server, metrics_listen=("127.0.0.1", 9100)))
    assert restart_needed(config, moved) == ["server.metrics_listen"]


def configured(base: Config, *, token: bool = False, listener: bool = False) -> Config:
    metrics = MetricsConfig(token_env="TG_METRICS", token_sha256=parse_token_digest()) if token else MetricsConfig()
    server = ServerConfig(http_port=0, metrics_listen=("127.0.0.1", 0)) if listener else base.server
    return dataclasses.replace(base, metrics=metrics, server=server)


def parse_token_digest() -> str:
    digest = parse_config('[metrics]\ntoken_env = "TG_METRICS"\n' + BASE, environ={"TG_METRICS": TOKEN}).metrics.token_sha256
    assert digest is not None
    return digest


async def test_with_a_token_metrics_answers_only_the_bearer_of_it(two_engines: Backends) -> None:
    base = two_pool_config(interactive_urls=[two_engines.urls[0]], batch_urls=[two_engines.urls[1]])
    async with tailguard(configured(base, token=True)) as running, httpx.AsyncClient(base_url=running.http_url) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            refused = await client.get("/metrics", headers=headers)
            assert refused.status_code == 401, headers
            error = refused.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
            assert TOKEN not in refused.text and "tailguard_" not in refused.text
        page = await client.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
        assert page.status_code == 200 and "tailguard_requests_total" in page.text
        assert (await client.get("/health")).status_code == 200  # load balancers' probe stays open


async def test_without_a_token_metrics_stays_open(two_engines: Backends) -> None:
    base = two_pool_config(interactive_urls=[two_engines.urls[0]], batch_urls=[two_engines.urls[1]])
    async with tailguard(base) as running, httpx.AsyncClient(base_url=running.http_url) as client:
        assert running.metrics_url is None
        assert (await client.get("/metrics")).status_code == 200


async def test_a_metrics_listener_serves_metrics_alone_and_the_api_no_longer_does(two_engines: Backends) -> None:
    base = two_pool_config(interactive_urls=[two_engines.urls[0]], batch_urls=[two_engines.urls[1]])
    async with tailguard(configured(base, listener=True)) as running, httpx.AsyncClient() as client:
        assert running.metrics_url is not None and running.metrics_url != running.http_url
        api, scrape = running.http_url, running.metrics_url
        assert (await client.get(f"{api}/metrics")).status_code == 404  # the callers' port has no /metrics
        answer = await client.post(f"{api}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert answer.status_code == 200
        page = await client.get(f"{scrape}/metrics")
        assert page.status_code == 200 and "tailguard_requests_total" in page.text
        for path in ("/health", "/v1/models"):  # Prometheus's port serves nothing else
            assert (await client.get(f"{scrape}{path}")).status_code == 404
        chat = await client.post(f"{scrape}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 404
