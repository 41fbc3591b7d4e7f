from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailguard.router.config import (
    ApiKeyConfig,
    AuthConfig,
    ClassConfig,
    ConfigError,
    EndpointConfig,
    LoggingConfig,
    MetricsConfig,
    ObjectiveConfig,
    limits_document,
    load_config,
    parse_config,
    render_config,
)
from tailguard.router.quotas import hash_key
from tests.helpers.config_text import BASE, edit, problems_of

SHIPPED = Path(__file__).resolve().parents[3] / "config.toml"

# --------------------------------------------------------------------------
# The shipped config.toml


def test_shipped_config_parses_with_the_documented_values() -> None:
    config = load_config(SHIPPED)

    server = config.server
    assert (server.http_host, server.http_port) == ("127.0.0.1", 8080)
    assert (server.grpc_host, server.grpc_port) == ("127.0.0.1", 50051)
    assert server.max_body_bytes == 4 * 1024 * 1024
    assert server.reload_poll_interval == 1.0

    limits = config.limits
    assert (limits.input_cap_tokens, limits.default_max_tokens) == (8192, 256)
    assert (limits.output_cap_tokens, limits.over_cap) == (1024, "clamp")

    timeouts = config.timeouts
    assert timeouts.connect_timeout == 2.0
    assert timeouts.end_to_end_timeout == 120.0
    assert timeouts.health_check_interval == 2.0
    assert timeouts.health_check_timeout == 1.0
    assert timeouts.retry_after == 1.0
    assert timeouts.front_proxy_timeout is None
    assert timeouts.drain_timeout == 30.0

    assert config.logging == LoggingConfig(level="INFO", format="json", access_log=True, log_prompts=False)
    assert config.metrics == MetricsConfig(backend_scrape_interval=5.0, duplicate_request_id_window=10.0)
    assert config.auth == AuthConfig() and not config.auth.enabled
    assert config.warnings == ()

    assert [pool.name for pool in config.pools] == ["interactive", "batch"]
    interactive, batch = config.pool("interactive"), config.pool("batch")
    # Both engines tuned alike (vLLM's H100 step budget); the router keeps short requests fast.
    assert interactive.endpoints == (EndpointConfig("http://127.0.0.1:8001", 256),)
    assert batch.endpoints == (EndpointConfig("http://127.0.0.1:8002", 256),)
    assert (interactive.max_concurrency, batch.max_concurrency) == (256, 256)
    assert (interactive.max_queue, batch.max_queue) == (1024, 4096)
    assert (interactive.simulate_profile, batch.simulate_profile) == ("throughput", "throughput")
    for pool in config.pools:
        assert pool.max_model_len == 32768
        assert pool.models == ("sim-llama-3.1-8b",)

    assert config.classes == (
        ClassConfig(
            name="interactive",
            pool="interactive",
            queue_timeout=3.0,
            priority=0,
            max_prompt_tokens=500,
            max_output_tokens=128,
            objective=ObjectiveConfig(ttft=0.5, itl=0.05, e2e=30.0, percentile=99.0),
        ),
        ClassConfig(
            name="batch",
            pool="batch",
            queue_timeout=110.0,
            priority=1,
            relay_interval=0.05,
            objective=ObjectiveConfig(ttft=None, itl=None, e2e=120.0, percentile=99.0, throughput_share=0.3),
        ),
    )


def test_shipped_config_model_name_is_what_the_simulator_serves() -> None:
    from tailguard.sim.server import DEFAULT_MODEL

    config = load_config(SHIPPED)
    assert all(pool.models[0] == DEFAULT_MODEL for pool in config.pools)


def test_shipped_config_documents_that_a_request_without_max_tokens_is_batch() -> None:
    config = load_config(SHIPPED)
    interactive = config.class_named("interactive")
    assert interactive.max_output_tokens is not None
    assert config.limits.default_max_tokens > interactive.max_output_tokens
    text = SHIPPED.read_text(encoding="utf-8")
    assert "WITHOUT max_tokens is classified as batch" in text


def test_every_module_the_shipped_config_tells_to_run_is_installed() -> None:
    """A ``python -m X`` in config.toml's comments names a module of the installed package (not a source folder)."""
    modules = set(re.findall(r"python -m ([\w.]+)", SHIPPED.read_text(encoding="utf-8")))
    assert modules
    for module in modules:
        assert module.startswith("tailguard.") and importlib.util.find_spec(module) is not None, module


def test_shipped_config_comments_every_key() -> None:
    """Each key line is preceded by a comment somewhere in its table or on the line before."""
    lines = SHIPPED.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        match = re.match(r"^([a-z_]+) = ", line)
        if match is None:
            continue
        above = lines[max(0, number - 12) : number]
        assert any(
            match.group(1) in previous or previous.startswith("#") for previous in above
        ), f"config.toml line {number + 1}: {line!r} has no comment near it"


# --------------------------------------------------------------------------
# Accepted inputs


def test_base_config_parses_and_fills_defaults() -> None:
    config = parse_config(BASE)
    assert config.server.http_port == 8080
    assert config.estimate.chars_per_token == 4.0
    assert config.limits.over_cap == "clamp"
    assert config.pool("batch").simulate_profile == "latency"
    assert config.class_named("batch").max_prompt_tokens is None


def test_integers_are_accepted_for_seconds_and_become_floats() -> None:
    config = parse_config(edit("queue_timeout = 3.0", "queue_timeout = 3"))
    queue_timeout = config.class_named("interactive").queue_timeout
    assert queue_timeout == 3.0 and isinstance(queue_timeout, float)
    assert isinstance(config.timeouts.end_to_end_timeout, float)


def test_a_class_relay_interval_is_read_and_defaults_to_each_event_as_it_comes() -> None:
    config = parse_config(edit("priority = 1", "priority = 1\nrelay_interval = 0.05"))
    assert config.class_named("batch").relay_interval == 0.05
    assert config.class_named("interactive").relay_interval == 0.0


def test_a_pool_may_have_no_endpoints() -> None:
    text = edit(
        'endpoints = [{ url = "http://127.0.0.1:8001", max_concurrency = 64 }]', "endpoints = []"
    )
    assert parse_config(text).pool("interactive").endpoints == ()


# Only the keys that have no default: one engine, one class.
MINIMAL = """\
[pools.llama]
models = ["meta-llama/Llama-3.1-8B-Instruct"]
endpoints = [{ url = "http://vllm-0:8000", max_concurrency = 256 }]

[classes.all]
pool = "llama"
queue_timeout = 10
"""


def test_a_minimal_config_needs_only_models_endpoints_and_queue_timeout() -> None:
    config = parse_config(MINIMAL)
    (pool,) = config.pools
    assert (pool.max_concurrency, pool.max_queue) == (256, 1024)
    assert not pool.max_model_len_configured  # asked of the engine at start
    assert config.class_named("all").priority == 0


def test_a_pool_max_concurrency_left_out_is_its_endpoints_caps_sum() -> None:
    config = parse_config(edit("max_concurrency = 256\n", ""))
    assert config.pool("batch").max_concurrency == 128 + 128


def test_a_pool_max_queue_left_out_is_four_waiting_per_seat() -> None:
    config = parse_config(edit("max_queue = 256\n", ""))
    assert config.pool("interactive").max_queue == 4 * 64
    assert config.pool("batch").max_queue == 512  # written: kept
    both_left_out = edit("max_queue = 512\n", "", edit("max_concurrency = 256\n", ""))
    assert parse_config(both_left_out).pool("batch").max_queue == 4 * (128 + 128)


@pytest.mark.parametrize(
    ("pool", "fragment"),
    [
        (
            '[pools.dns]\nmodels = ["m"]\n'
            'endpoints_dns = [{ name = "vllm.default.svc.cluster.local", port = 8000, max_concurrency = 8 }]\n',
            "endpoints_dns",
        ),
        ('[pools.dns]\nmodels = ["m"]\nendpoints = []\n', "no endpoints"),
    ],
)
def test_a_pool_max_concurrency_is_required_when_its_endpoints_have_no_fixed_sum(pool: str, fragment: str) -> None:
    (problem,) = problems_of(BASE + "\n" + pool)
    assert problem.startswith("pools.dns.max_concurrency: missing: must be an integer >= 1") and fragment in problem


def test_a_bad_endpoint_is_one_problem_not_also_a_missing_pool_cap() -> None:
    text = edit("max_concurrency = 256\n", "", edit('"http://127.0.0.1:8003", max_concurrency = 128', '"http://127.0.0.1:8003", max_concurrency = 0'))
    (problem,) = problems_of(text)
    assert problem.startswith("pools.batch.endpoints[1].max_concurrency: ")


def test_a_class_priority_left_out_is_its_place_in_file_order() -> None:
    """Earlier classes (the narrower thresholds) are served first, as the shipped priorities say."""
    text = edit("priority = 0\n", "", edit("priority = 1\n", ""))
    text = '[classes.tiny]\npool = "interactive"\nmax_output_tokens = 16\nqueue_timeout = 1\n\n' + text
    assert [(klass.name, klass.priority) for klass in parse_config(text).classes] == [("tiny", 0), ("interactive", 1), ("batch", 2)]
    written = edit("queue_timeout = 30.0\n", "queue_timeout = 30.0\npriority = 7\n", text)
    assert [klass.priority for klass in parse_config(written).classes] == [0, 1, 7]


@pytest.mark.parametrize(
    ("written", "url"),
    [
        ("https://gpu-3.internal:8443/", "https://gpu-3.internal:8443"),
        ("HTTP://GPU-3:8001", "http://gpu-3:8001"),
        ("http://gpu-3", "http://gpu-3:80"),
        ("https://gpu-3/", "https://gpu-3:443"),
        ("http://[::1]:8001/", "http://[::1]:8001"),
    ],
)
def test_endpoint_urls_are_normalised(written: str, url: str) -> None:
    """One spelling per server: a reload can match endpoints by URL."""
    text = edit('"http://127.0.0.1:8001"', json.dumps(written))
    assert parse_config(text).pool("interactive").endpoints[0].url == url


@pytest.mark.parametrize(
    ("listen", "host", "port"),
    [
        ("[::1]:8080", "::1", 8080),
        ("[2001:db8::7]:443", "2001:db8::7", 443),
        ("0.0.0.0:0", "0.0.0.0", 0),
        ("localhost:9000", "localhost", 9000),
    ],
)
def test_listen_addresses(listen: str, host: str, port: int) -> None:
    config = parse_config(f'[server]\nhttp_listen = "{listen}"\ngrpc_listen = "{listen}"\n' + BASE)
    assert (config.server.http_host, config.server.http_port) == (host, port)
    assert (config.server.grpc_host, config.server.grpc_port) == (host, port)
    assert re.search(rf"http_listen +{re.escape(listen)}\n", render_config(config))


def test_classes_keep_file_order_even_when_interleaved_with_pools() -> None:
    text = (
        '[classes.tiny]\npool = "interactive"\nmax_output_tokens = 16\nqueue_timeout = 1\n'
        "priority = 0\n\n" + BASE
    )
    assert [klass.name for klass in parse_config(text).classes] == ["tiny", "interactive", "batch"]


def test_pool_and_class_names_may_hold_dots_and_dashes() -> None:
    text = BASE.replace("[pools.interactive]", '[pools."chat-8b.v2"]')
    text = text.replace("[classes.interactive]", '[classes."chat-8b.v2"]')
    text = text.replace('pool = "interactive"', 'pool = "chat-8b.v2"')
    config = parse_config(text)
    assert config.pool("chat-8b.v2").name == "chat-8b.v2"
    assert config.classes[0] == config.class_named("chat-8b.v2")
    assert config.classes[0].pool == "chat-8b.v2"
    # and a problem inside one quotes the name, as TOML would
    (problem,) = problems_of(edit("max_queue = 256", "max_queue = -1", text))
    assert problem.startswith('pools."chat-8b.v2".max_queue: ')


# --------------------------------------------------------------------------
# Every rule rejects, naming its dotted key

ONE_PROBLEM = [
    # (old, new, the problem line starts with this dotted key, and contains this)
    (
        '"http://127.0.0.1:8003", max_concurrency = 128',
        '"http://127.0.0.1:8003", max_concurrency = 0',
        "pools.batch.endpoints[1].max_concurrency",
        "must be an integer >= 1, got 0",
    ),
    ("max_concurrency = 64\n", "max_concurrency = 0\n", "pools.interactive.max_concurrency", ">= 1"),
    ("max_queue = 256", "max_queue = -1", "pools.interactive.max_queue", ">= 0, got -1"),
    ("max_queue = 256", 'max_queue = "256"', "pools.interactive.max_queue", 'got "256"'),
    ("max_queue = 256", "max_queue = true", "pools.interactive.max_queue", "got true"),
    ("max_queue = 256", "max_queue = 2.5", "pools.interactive.max_queue", "integer"),
    ("max_concurrency = 256", "max_concurrency = 257", "pools.batch.max_concurrency", "256"),
    ("max_concurrency = 64\n", "max_concurrency = 65\n", "pools.interactive.max_concurrency", "64"),
    (
        'models = ["m"]\nendpoints = [{',
        'models = []\nendpoints = [{',
        "pools.interactive.models",
        "non-empty",
    ),
    (
        'models = ["m"]\nendpoints = [{',
        'models = ["m", ""]\nendpoints = [{',
        "pools.interactive.models[1]",
        "non-empty string",
    ),
    (
        'models = ["m"]\nendpoints = [{',
        'models = "m"\nendpoints = [{',
        "pools.interactive.models",
        "array",
    ),
    (
        "max_concurrency = 256",
        'max_concurrency = 256\nsimulate_profile = "fast"',
        "pools.batch.simulate_profile",
        '"latency", "throughput", "instant"',
    ),
    ("max_model_len = 32768\nmodels = [\"m\"]\nendpoints = [{", "max_model_len = 0\nmodels = [\"m\"]\nendpoints = [{",
     "pools.interactive.max_model_len", ">= 1"),
    ('"http://127.0.0.1:8001"', '"ftp://127.0.0.1:8001"', "pools.interactive.endpoints[0].url", "http"),
    ('"http://127.0.0.1:8001"', '"127.0.0.1:8001"', "pools.interactive.endpoints[0].url", "http"),
    ('"http://127.0.0.1:8001"', '"http://:8001"', "pools.interactive.endpoints[0].url", "base URL"),
    ('"http://127.0.0.1:8001"', '"http://127.0.0.1:8001/v1"', "pools.interactive.endpoints[0].url", "path"),
    ('"http://127.0.0.1:8001"', '"http://127.0.0.1:8001/?a=1"', "pools.interactive.endpoints[0].url", "base URL"),
    ('"http://127.0.0.1:8001"', '"http://127.0.0.1:99999"', "pools.interactive.endpoints[0].url", "base URL"),
    ('"http://127.0.0.1:8001"', '"http://127.0.0.1:0"', "pools.interactive.endpoints[0].url", "base URL"),
    ('"http://127.0.0.1:8001"', '"http://u:p@127.0.0.1:8001"', "pools.interactive.endpoints[0].url", "base URL"),
    ('"http://127.0.0.1:8001"', "8001", "pools.interactive.endpoints[0].url", "string"),
    (
        '{ url = "http://127.0.0.1:8001", max_concurrency = 64 }',
        '{ max_concurrency = 64 }',
        "pools.interactive.endpoints[0].url",
        "missing",
    ),
    (
        '{ url = "http://127.0.0.1:8002", max_concurrency = 128 },',
        '"http://127.0.0.1:8002",',
        "pools.batch.endpoints[0]",
        "must be a table",
    ),
    ('pool = "interactive"', 'pool = "chat"', "classes.interactive.pool", '"chat"'),
    ("queue_timeout = 3.0", "queue_timeout = 0", "classes.interactive.queue_timeout", "> 0"),
    ("queue_timeout = 3.0", "queue_timeout = nan", "classes.interactive.queue_timeout", "> 0"),
    ("queue_timeout = 30.0", "queue_timeout = inf", "classes.batch.queue_timeout", "> 0"),
    ("queue_timeout = 30.0", "queue_timeout = 120", "classes.batch.queue_timeout", "end_to_end_timeout"),
    ("priority = 1", "priority = 1.5", "classes.batch.priority", "integer"),
    ("priority = 1", "priority = 1\nrelay_interval = -0.1", "classes.batch.relay_interval", ">= 0"),
    ("priority = 1", "priority = 1\nrelay_interval = 2", "classes.batch.relay_interval", "stall"),
    ("[timeouts]", "server = 3\n[timeouts]", "server", "must be a table, got 3"),
    ("max_prompt_tokens = 500", "max_prompt_tokens = 0", "classes.interactive.max_prompt_tokens", ">= 1"),
    ("max_output_tokens = 128", "max_output_tokens = -5", "classes.interactive.max_output_tokens", ">= 1"),
    ('pool = "batch"', 'pool = "batch"\nmax_output_tokens = 9999', "classes.batch", "catch-all"),
    ("[classes.batch]", '[classes."bulk jobs"]', 'classes."bulk jobs"', "[A-Za-z0-9_.-]+"),
    ("end_to_end_timeout = 120", "end_to_end_timeout = 0", "timeouts.end_to_end_timeout", "> 0"),
    ("end_to_end_timeout = 120", 'end_to_end_timeout = "2m"', "timeouts.end_to_end_timeout", '"2m"'),
    ("end_to_end_timeout = 120", "connect_timeout = -1", "timeouts.connect_timeout", "> 0"),
    ("end_to_end_timeout = 120", "health_check_timeout = 0", "timeouts.health_check_timeout", "> 0"),
    ("end_to_end_timeout = 120", "health_check_interval = 0", "timeouts.health_check_interval", "> 0"),
    ("end_to_end_timeout = 120", "retry_after = 0", "timeouts.retry_after", "> 0"),
]

APPENDED = [
    # (TOML added at the end of BASE, key, fragment)
    ("[limits]\ndefault_max_tokens = 2048\n", "limits.default_max_tokens", "limits.output_cap_tokens 1024"),
    ("[limits]\noutput_cap_tokens = 0\n", "limits.output_cap_tokens", ">= 1"),
    ("[limits]\ninput_cap_tokens = 0\n", "limits.input_cap_tokens", ">= 1"),
    ('[limits]\nover_cap = "truncate"\n', "limits.over_cap", '"clamp", "reject"'),
    ("[estimate]\nchars_per_token = 0\n", "estimate.chars_per_token", "> 0"),
    ("[estimate]\ncjk_chars_per_token = -1.0\n", "estimate.cjk_chars_per_token", "> 0"),
    ("[estimate]\nper_message_tokens = -1\n", "estimate.per_message_tokens", ">= 0"),
    ('[server]\nhttp_listen = "localhost"\n', "server.http_listen", "host:port"),
    ('[server]\nhttp_listen = "::1:8080"\n', "server.http_listen", "brackets"),
    ('[server]\ngrpc_listen = "[localhost]:80"\n', "server.grpc_listen", "IPv6"),
    ('[server]\ngrpc_listen = "127.0.0.1:65536"\n', "server.grpc_listen", "65535"),
    ('[server]\ngrpc_listen = "127.0.0.1:http"\n', "server.grpc_listen", "port"),
    ('[server]\ngrpc_listen = ":50051"\n', "server.grpc_listen", "host:port"),
    ("[server]\nmax_body_bytes = 0\n", "server.max_body_bytes", ">= 1"),
    ("[server]\nreload_poll_interval = -1\n", "server.reload_poll_interval", ">= 0"),
    (
        '[pools."gpu 7"]\nmax_concurrency = 1\nmax_queue = 0\nmax_model_len = 32768\n'
        'models = ["m"]\nendpoints = []\n',
        'pools."gpu 7"',
        "[A-Za-z0-9_.-]+",
    ),
    ("[pools.spare]\n", "pools.spare.endpoints", "missing"),
    (
        '[classes.late]\npool = "batch"\nmax_prompt_tokens = 10\nqueue_timeout = 1\npriority = 0\n',
        "classes.late",
        "unreachable: classes.batch",
    ),
    ("[limits]\ninput_cap_tokens = 32768\n", "pools.interactive.max_model_len", "limits.input_cap_tokens 32768"),
    ('[logging]\nlevel = "verbose"\n', "logging.level", '"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"'),
    ("[logging]\nlevel = 10\n", "logging.level", "a string, got 10"),
    ('[logging]\nformat = "xml"\n', "logging.format", '"json", "text"'),
    ('[logging]\naccess_log = "yes"\n', "logging.access_log", 'true or false, got "yes"'),
    ("[logging]\nlog_prompts = 1\n", "logging.log_prompts", "true or false, got 1"),
    ("[logging]\nlog_prompt = true\n", "logging.log_prompt", "did you mean 'log_prompts'?"),
    ("[metrics]\nbackend_scrape_interval = -1\n", "metrics.backend_scrape_interval", ">= 0"),
    ("[metrics]\nduplicate_request_id_window = -0.5\n", "metrics.duplicate_request_id_window", ">= 0"),
    ("[metrics]\nscrape_interval = 5\n", "metrics.scrape_interval", "unknown key"),
]

# Timeouts are added to BASE's [timeouts] table (TOML allows a table only once).
TIMEOUT_PROBLEMS = [
    ("front_proxy_timeout = 0", "timeouts.front_proxy_timeout", "> 0"),
    ('front_proxy_timeout = "60s"', "timeouts.front_proxy_timeout", '"60s"'),
    ("drain_timeout = -1", "timeouts.drain_timeout", ">= 0"),
    ("drain_timeout = inf", "timeouts.drain_timeout", ">= 0"),
]


@pytest.mark.parametrize(("old", "new", "key", "fragment"), ONE_PROBLEM)
def test_each_rule_rejects_with_its_dotted_key(old: str, new: str, key: str, fragment: str) -> None:
    problems = problems_of(edit(old, new))
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{key}: "), problems
    assert fragment in problems[0]


@pytest.mark.parametrize(("added", "key", "fragment"), APPENDED)
def test_each_added_mistake_rejects_with_its_dotted_key(added: str, key: str, fragment: str) -> None:
    problems = problems_of(BASE + "\n" + added)
    matching = [line for line in problems if line.startswith(f"{key}: ")]
    assert matching, problems
    assert any(fragment in line for line in matching), problems


@pytest.mark.parametrize(("line", "key", "fragment"), TIMEOUT_PROBLEMS)
def test_each_timeout_mistake_rejects_with_its_dotted_key(line: str, key: str, fragment: str) -> None:
    (problem,) = problems_of(edit("end_to_end_timeout = 120", f"end_to_end_timeout = 120\n{line}"))
    assert problem.startswith(f"{key}: ") and fragment in problem


def test_queue_timeout_message_names_both_values() -> None:
    (problem,) = problems_of(edit("queue_timeout = 30.0", "queue_timeout = 150"))
    assert problem.startswith("classes.batch.queue_timeout: ")
    assert "150" in problem and "timeouts.end_to_end_timeout 120" in problem


def test_input_cap_over_max_model_len_is_reported_for_every_pool() -> None:
    problems = problems_of(BASE + "\n[limits]\ninput_cap_tokens = 32768\n")
    assert [line.split(":")[0] for line in problems] == [
        "pools.interactive.max_model_len",
        "pools.batch.max_model_len",
    ]
    # max_model_len == input cap + 1 is just enough
    parse_config(BASE + "\n[limits]\ninput_cap_tokens = 32767\n")


def test_max_model_len_left_out_is_asked_of_the_endpoints() -> None:
    """Optional: the pool's value is 0 (refuses everything) until router/fleet/model_len.py asks; check-config says so."""
    config = parse_config(edit('max_model_len = 32768\nmodels = ["m"]\nendpoints = [{', 'models = ["m"]\nendpoints = [{'))
    left_out, written = config.pool("interactive"), config.pool("batch")
    assert (left_out.max_model_len, left_out.max_model_len_configured) == (0, False)
    assert (written.max_model_len, written.max_model_len_configured) == (32768, True)
    shown = render_config(config)
    assert "asked of the endpoints at start and on every reload (GET /v1/models" in shown


@pytest.mark.parametrize(
    ("old", "new", "first", "second"),
    [
        (  # across pools
            '"http://127.0.0.1:8002"',
            '"http://127.0.0.1:8001"',
            "pools.batch.endpoints[0].url",
            "pools.interactive.endpoints[0].url",
        ),
        (  # twice in one pool
            '"http://127.0.0.1:8003"',
            '"http://127.0.0.1:8002"',
            "pools.batch.endpoints[1].url",
            "pools.batch.endpoints[0].url",
        ),
        (  # the same server written differently
            '"http://127.0.0.1:8003"',
            '"HTTP://127.0.0.1:8002/"',
            "pools.batch.endpoints[1].url",
            "pools.batch.endpoints[0].url",
        ),
    ],
)
def test_an_endpoint_url_may_appear_only_once(old: str, new: str, first: str, second: str) -> None:
    (problem,) = problems_of(edit(old, new))
    assert problem.startswith(f"{first}: ")
    assert second in problem


def test_default_ports_make_urls_equal() -> None:
    text = edit('"http://127.0.0.1:8001"', '"http://gpu"')
    text = edit('"http://127.0.0.1:8002"', '"http://GPU:80"', text)
    (problem,) = problems_of(text)
    assert problem.startswith("pools.batch.endpoints[0].url: ")


def test_a_class_after_the_catch_all_is_unreachable_even_without_thresholds() -> None:
    problems = problems_of(
        BASE + '\n[classes.extra]\npool = "batch"\nqueue_timeout = 1\npriority = 0\n'
    )
    assert problems == (
        "classes.extra: unreachable: classes.batch before it has no thresholds"
        " and takes every request",
    )


def test_a_single_class_with_thresholds_is_not_a_catch_all() -> None:
    text = BASE[: BASE.index("[classes.batch]")]
    (problem,) = problems_of(text)
    assert problem.startswith("classes.interactive: ") and "catch-all" in problem


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (BASE[: BASE.index("[pools.interactive]")] + BASE[BASE.index("[classes.interactive]") :], "pools"),
        (BASE[: BASE.index("[classes.interactive]")], "classes"),
        (BASE[: BASE.index("[classes.interactive]")] + "classes = {}\n", "classes"),
        (BASE[: BASE.index("[classes.interactive]")] + "classes = []\n", "classes"),
    ],
)
def test_pools_and_classes_are_required(text: str, key: str) -> None:
    problems = problems_of(text)
    assert any(line.startswith(f"{key}: ") and "at least one" in line for line in problems)


# --------------------------------------------------------------------------
# Unknown keys


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ("[timeouts]", "colour = 1\n[timeouts]", "colour"),
        ("[timeouts]", "[timeout]\nconnect_timeout = 1\n[timeouts]", "timeout"),
        ("end_to_end_timeout = 120", "end_to_end_timeout = 120\nread_timeout = 5", "timeouts.read_timeout"),
        (
            '{ url = "http://127.0.0.1:8002", max_concurrency = 128 }',
            '{ url = "http://127.0.0.1:8002", max_concurrency = 128, weight = 2 }',
            "pools.batch.endpoints[0].weight",
        ),
        ("max_queue = 512", "max_queue = 512\nmax_queued = 5", "pools.batch.max_queued"),
        ("priority = 1", "priority = 1\nmax_tokens = 5", "classes.batch.max_tokens"),
        ("[timeouts]", '[server]\n"http port" = 1\n[timeouts]', 'server."http port"'),
    ],
)
def test_unknown_keys_are_rejected_by_dotted_name(old: str, new: str, key: str) -> None:
    (problem,) = problems_of(edit(old, new))
    assert problem.startswith(f"{key}: unknown key")


def test_a_misspelt_key_is_unknown_with_a_suggestion_and_the_real_one_missing() -> None:
    problems = problems_of(edit("queue_timeout = 30.0", "queue_timeuot = 30.0"))
    assert sorted(problems) == [
        "classes.batch.queue_timeout: missing: must be a number > 0",
        "classes.batch.queue_timeuot: unknown key (did you mean 'queue_timeout'?)",
    ]


def test_a_misspelt_optional_key_is_unknown_with_a_suggestion_and_no_default_hides_it() -> None:
    (problem,) = problems_of(edit("max_queue = 512", "max_queeu = 512"))
    assert problem == "pools.batch.max_queeu: unknown key (did you mean 'max_queue'?)"


# --------------------------------------------------------------------------
# Many problems at once


def test_all_problems_are_reported_together() -> None:
    text = edit("max_queue = 256", "max_queue = -1")
    text = edit('pool = "batch"', 'pool = "bulk"', text)
    text = edit('"http://127.0.0.1:8003", max_concurrency = 128', '"http://127.0.0.1:8003", max_concurrency = 0', text)
    text = "zone = 'eu'\n" + text + "\n[limits]\nover_cap = 'drop'\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="many.toml")
    keys = sorted(line.split(": ")[0] for line in info.value.problems)
    assert keys == sorted(
        [
            "zone",
            "limits.over_cap",
            "pools.interactive.max_queue",
            "pools.batch.endpoints[1].max_concurrency",
            "classes.batch.pool",
        ]
    )
    message = str(info.value)
    assert message.startswith("many.toml: ")
    assert "5 problems" in message
    assert all(line in message for line in info.value.problems)


def test_one_mistake_is_one_problem() -> None:
    """A bad value does not also fail the cross checks that would use it."""
    assert len(problems_of(edit("end_to_end_timeout = 120", "end_to_end_timeout = -1"))) == 1
    assert len(problems_of(BASE + "\n[limits]\ninput_cap_tokens = 'many'\n")) == 1
    text = edit('"http://127.0.0.1:8002", max_concurrency = 128', '"http://127.0.0.1:8002", max_concurrency = "x"')
    assert len(problems_of(text)) == 1  # no "pool cap over endpoints' sum" on top


# --------------------------------------------------------------------------
# Loading files, digest


def test_load_config_reads_a_file_and_digests_its_text(tmp_path: Path) -> None:
    path = tmp_path / "tailguard.toml"
    path.write_text(BASE, encoding="utf-8")
    config = load_config(path)
    assert config == parse_config(BASE)
    assert re.fullmatch(r"[0-9a-f]{16}", config.digest)
    assert load_config(str(path)).digest == config.digest


def test_digest_changes_when_the_text_changes() -> None:
    first = parse_config(BASE).digest
    assert parse_config(BASE).digest == first
    assert parse_config(BASE + "# a comment\n").digest != first
    assert parse_config(edit("max_queue = 256", "max_queue = 255")).digest != first


def test_load_config_of_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert len(info.value.problems) == 1


def test_load_config_of_a_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(BASE.encode("utf-8") + b"# caf\xe9\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(path)


def test_toml_syntax_error_names_the_source_and_the_position(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[pools\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.startswith("invalid TOML: ")
    assert "line 1" in problem or "end of document" in problem
    assert str(path) in str(info.value)


# --------------------------------------------------------------------------
# render_config and limits_document


def test_render_config_shows_every_pool_endpoint_and_class() -> None:
    config = parse_config(BASE)
    text = render_config(config)
    for pool in config.pools:
        assert f"pool {pool.name}" in text
        for endpoint in pool.endpoints:
            assert re.search(rf"{re.escape(endpoint.url)}\s+max_concurrency {endpoint.max_concurrency}\b", text)
    for klass in config.classes:
        assert re.search(rf"^  {klass.name}\s", text, re.MULTILINE)
    assert re.search(r"^  interactive\s+generation\s+<= 500\s+<= 128\s+interactive\s+3 s\s+0\s+off\s+all$", text, re.MULTILINE)
    assert re.search(r"^  batch\s+generation\s+any\s+any\s+batch\s+30 s\s+1\s+off\s+all$", text, re.MULTILINE)
    assert config.digest in text


def test_render_config_of_the_shipped_file_is_a_readable_page() -> None:
    text = render_config(load_config(SHIPPED))
    # [cluster] (or its absence), server.workers and each pool's queue_order are on it too.
    assert 30 <= len(text.splitlines()) <= 110
    for expected in ("objectives (what each class is promised", "127.0.0.1:8080", "127.0.0.1:50051", "8192", "1024 (over the cap: clamp)", "120 s"):
        assert expected in text


def test_render_config_of_an_empty_pool_says_so() -> None:
    text = edit('endpoints = [{ url = "http://127.0.0.1:8001", max_concurrency = 64 }]', "endpoints = []")
    assert "(none" in render_config(parse_config(text))


def test_limits_document_is_json_and_has_no_endpoint_urls() -> None:
    config = load_config(SHIPPED)
    document = limits_document(config)
    encoded = json.dumps(document)
    assert "http" not in encoded and "127.0.0.1" not in encoded
    assert json.loads(encoded) == document
    assert document["input_cap_tokens"] == 8192
    assert document["default_max_tokens"] == 256
    assert document["output_cap_tokens"] == 1024
    assert document["over_cap"] == "clamp"
    assert document["end_to_end_timeout"] == 120.0
    assert (document["max_body_bytes"], document["retry_after"], document["auth_required"]) == (4194304, 1.0, False)
    assert document["estimate"] == {"chars_per_token": 4.0, "cjk_chars_per_token": 1.0, "per_message_tokens": 4, "learn": True}
    assert document["classes"] == [
        {"name": "interactive", "max_prompt_tokens": 500, "max_output_tokens": 128,
         "queue_timeout": 3.0, "priority": 0, "pool": "interactive",
         "objective": {"ttft": 0.5, "itl": 0.05, "e2e": 30.0, "percentile": 99.0, "throughput_share": 0.0}},
        {"name": "batch", "max_prompt_tokens": None, "max_output_tokens": None,
         "queue_timeout": 110.0, "priority": 1, "pool": "batch",
         "objective": {"ttft": None, "itl": None, "e2e": 120.0, "percentile": 99.0, "throughput_share": 0.3}},
    ]
    assert document["pools"] == [
        {"name": "interactive", "max_model_len": 32768, "models": ["sim-llama-3.1-8b"]},
        {"name": "batch", "max_model_len": 32768, "models": ["sim-llama-3.1-8b"]},
    ]


def test_config_error_str_lists_every_problem() -> None:
    error = ConfigError(["a.b: one", "c: two"], source="x.toml")
    assert error.problems == ("a.b: one", "c: two")
    assert str(error).splitlines() == ["x.toml: configuration refused, 2 problems:", "  a.b: one", "  c: two"]


def test_a_parsed_config_is_frozen_all_the_way_down() -> None:
    """The loader's contract (router/config/types.py): frozen, so a reload swaps a Config whole
    and never edits one a request still reads. No list, dict or set anywhere in it either."""

    def mutable_parts(value: object, path: str) -> Iterator[str]:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                part = getattr(value, field.name)
                try:
                    setattr(value, field.name, part)  # the same value: harmless where it is allowed
                    yield f"{path}.{field.name} can be assigned"
                except dataclasses.FrozenInstanceError:
                    pass
                yield from mutable_parts(part, f"{path}.{field.name}")
        elif isinstance(value, (tuple, frozenset)):
            for i, item in enumerate(value):
                yield from mutable_parts(item, f"{path}[{i}]")
        elif not isinstance(value, (str, int, float, type(None))):
            yield f"{path} is a {type(value).__name__}"

    config = parse_config(BASE)
    assert config.pools and config.pools[0].endpoints  # the walk reaches the nested sections
    assert list(mutable_parts(config, "config")) == []


# --------------------------------------------------------------------------
# [logging], [metrics], the new [timeouts] keys and warnings


def test_logging_and_metrics_are_read_and_the_level_is_any_case() -> None:
    text = BASE + (
        '\n[logging]\nlevel = "debug"\nformat = "text"\naccess_log = false\nlog_prompts = true\n'
        "\n[metrics]\nbackend_scrape_interval = 0\nduplicate_request_id_window = 2.5\n"
    )
    config = parse_config(text)
    assert config.logging == LoggingConfig(level="DEBUG", format="text", access_log=False, log_prompts=True)
    assert config.metrics == MetricsConfig(backend_scrape_interval=0.0, duplicate_request_id_window=2.5)
    rendered = render_config(config)
    assert re.search(r"^  backend_scrape_interval\s+off$", rendered, re.MULTILINE)
    assert re.search(r"^  log_prompts\s+on$", rendered, re.MULTILINE)


def test_drain_timeout_may_be_zero_and_front_proxy_timeout_is_read() -> None:
    config = parse_config(
        edit("end_to_end_timeout = 120", "end_to_end_timeout = 120\ndrain_timeout = 0\nfront_proxy_timeout = 300")
    )
    assert config.timeouts.drain_timeout == 0.0
    assert config.timeouts.front_proxy_timeout == 300.0
    assert config.warnings == ()
    assert re.search(r"^  front_proxy_timeout\s+300 s$", render_config(config), re.MULTILINE)


@pytest.mark.parametrize("front", ["60", "120"])
def test_a_front_proxy_timeout_not_above_end_to_end_is_a_warning(front: str) -> None:
    config = parse_config(edit("end_to_end_timeout = 120", f"end_to_end_timeout = 120\nfront_proxy_timeout = {front}"))
    (warning,) = config.warnings
    assert warning.startswith(f"timeouts.front_proxy_timeout ({front} s) is not above timeouts.end_to_end_timeout (120 s)")
    assert "proxy_read_timeout" in warning and "above 120 s" in warning
    # check-config shows it under its heading (which line that lands on is the layout's business)
    assert f"\nwarnings (tailguard runs, but fix these)\n  {warning}\n" in render_config(config)


def test_without_a_front_proxy_timeout_there_is_no_warning() -> None:
    config = parse_config(BASE)
    assert config.timeouts.front_proxy_timeout is None and config.warnings == ()
    assert "warnings" not in render_config(config)
    assert re.search(r"^  front_proxy_timeout\s+unknown$", render_config(config), re.MULTILINE)


# --------------------------------------------------------------------------
# [auth]

KEY = "tg-live-webapp-Zq3x9"  # a plaintext key: must never show in output
OTHER_KEY = "tg-live-reports-88aa"
DIGEST = hashlib.sha256(KEY.encode()).hexdigest()


def with_keys(*tables: str, auth: str = "") -> str:
    """BASE with an [auth] table (``auth`` lines) and these [[auth.keys]] bodies."""
    text = BASE + "\n[auth]\n" + auth
    for body in tables:
        text += "\n[[auth.keys]]\n" + body
    return text


def auth_problems(text: str, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, environ=environ or {})
    assert KEY not in str(info.value) and OTHER_KEY not in str(info.value)
    return info.value.problems


def test_hash_key_is_the_sha256_hex_digest() -> None:
    assert hash_key(KEY) == DIGEST


def test_auth_is_off_without_an_auth_table() -> None:
    config = parse_config(BASE, environ={})
    assert config.auth == AuthConfig() and not config.auth.enabled
    assert "off (no keys" in render_config(config)


def test_a_key_by_digest_is_kept_lower_case_with_its_rights() -> None:
    text = with_keys(
        f'name = "webapp"\nkey_sha256 = "{DIGEST.upper()}"\nmay_force_classes = ["batch", "interactive"]\n'
        "max_concurrency = 8\n",
        f'name = "cron"\nkey_sha256 = "{hash_key(OTHER_KEY)}"\n',
    )
    config = parse_config(text, environ={})
    assert config.auth.enabled
    assert config.auth.keys == (
        ApiKeyConfig("webapp", DIGEST, frozenset({"batch", "interactive"}), 8),
        ApiKeyConfig("cron", hash_key(OTHER_KEY), frozenset(), None),
    )


def test_a_key_from_the_environment_is_hashed_and_its_whitespace_dropped() -> None:
    text = with_keys('name = "webapp"\nkey_env = "TG_KEY_WEBAPP"\n')
    config = parse_config(text, environ={"TG_KEY_WEBAPP": f"  {KEY}\n"})
    (key,) = config.auth.keys
    assert key.sha256 == DIGEST


def test_load_config_resolves_keys_from_the_given_environ(tmp_path: Path) -> None:
    path = tmp_path / "tailguard.toml"
    path.write_text(with_keys('name = "webapp"\nkey_env = "TG_KEY_WEBAPP"\n'), encoding="utf-8")
    assert load_config(path, environ={"TG_KEY_WEBAPP": KEY}).auth.keys[0].sha256 == DIGEST
    with pytest.raises(ConfigError, match="TG_KEY_WEBAPP is not set"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    ("body", "environ", "key", "fragment"),
    [
        ('name = "w"\nkey_env = "TG_KEY_X"\n', {}, "auth.keys[0].key_env",
         "environment variable TG_KEY_X is not set"),
        ('name = "w"\nkey_env = "TG_KEY_X"\n', {"TG_KEY_X": " \n"}, "auth.keys[0].key_env",
         "environment variable TG_KEY_X is empty"),
        ('name = "w"\nkey_env = "TG_KEY_X"\n', {"TG_KEY_X": "two words"}, "auth.keys[0].key_env",
         "cannot carry"),
        ('name = "w"\nkey_env = "TG_KEY_X"\n', {"TG_KEY_X": "clé"}, "auth.keys[0].key_env", "printable ASCII"),
        (f'name = "w"\nkey_env = "{KEY}"\n', {}, "auth.keys[0].key_env", "name of an environment variable"),
        (f'name = "w"\nkey_sha256 = "{KEY}"\n', {}, "auth.keys[0].key_sha256", "64 hex digits"),
        (f'name = "w"\nkey_sha256 = "{DIGEST[:-1]}g"\n', {}, "auth.keys[0].key_sha256", "64 hex digits"),
        (f'name = "w"\nkey = "{KEY}"\n', {}, "auth.keys[0].key", "plaintext key does not belong in config.toml"),
        ('name = "w"\n', {}, "auth.keys[0]", "exactly one of key_sha256, key_env"),
        (f'name = "w"\nkey_sha256 = "{DIGEST}"\nkey_env = "TG_KEY_X"\n', {"TG_KEY_X": KEY}, "auth.keys[0]",
         "got key_sha256 and key_env"),
        ("name = \"w\"\nkey_sha256 = 12345\n", {}, "auth.keys[0].key_sha256", "must be a string, got an integer"),
        (f'key_sha256 = "{DIGEST}"\n', {}, "auth.keys[0].name", "missing"),
        (f'name = "web app"\nkey_sha256 = "{DIGEST}"\n', {}, "auth.keys[0].name", "[A-Za-z0-9_.-]+"),
        (f'name = "w"\nkey_sha256 = "{DIGEST}"\nmay_force_classes = ["bulk"]\n', {},
         "auth.keys[0].may_force_classes[0]", 'names no defined class: "bulk" (defined: "interactive", "batch")'),
        (f'name = "w"\nkey_sha256 = "{DIGEST}"\nmay_force_classes = "batch"\n', {},
         "auth.keys[0].may_force_classes", "array"),
        (f'name = "w"\nkey_sha256 = "{DIGEST}"\nmax_concurrency = 0\n', {}, "auth.keys[0].max_concurrency", ">= 1"),
        (f'name = "w"\nkey_sha256 = "{DIGEST}"\nmax_inflight = 3\n', {}, "auth.keys[0].max_inflight", "unknown key"),
    ],
)
def test_each_key_rule_rejects_with_its_dotted_key_and_never_shows_a_key(
    body: str, environ: dict[str, str], key: str, fragment: str
) -> None:
    (problem,) = auth_problems(with_keys(body), environ)
    assert problem.startswith(f"{key}: "), problem
    assert fragment in problem, problem


def test_a_good_key_next_to_a_bad_one_still_refuses_the_file() -> None:
    problems = auth_problems(
        with_keys(f'name = "ok"\nkey_sha256 = "{DIGEST}"\n', 'name = "bad"\nkey_env = "TG_ABSENT"\n')
    )
    assert problems == ("auth.keys[1].key_env: environment variable TG_ABSENT is not set",)


def test_names_and_keys_are_each_used_once() -> None:
    same_name = with_keys(f'name = "w"\nkey_sha256 = "{DIGEST}"\n', f'name = "w"\nkey_sha256 = "{hash_key(OTHER_KEY)}"\n')
    assert auth_problems(same_name) == ('auth.keys[1].name: "w" is already auth.keys[0].name',)
    same_key = with_keys(f'name = "a"\nkey_sha256 = "{DIGEST}"\n', 'name = "b"\nkey_env = "TG_KEY_B"\n')
    (problem,) = auth_problems(same_key, {"TG_KEY_B": KEY})
    assert problem.startswith("auth.keys[1].key_env: the same key as auth.keys[0] (\"a\")")


def test_an_auth_table_without_keys_is_refused_rather_than_read_as_auth_off() -> None:
    assert auth_problems(BASE + "\n[auth]\n") == (
        "auth: no API key in [[auth.keys]]: delete [auth] to run without authentication, or add a key",
    )
    assert any(line.startswith("auth.keys: ") for line in auth_problems(BASE + "\n[auth]\nkeys = 3\n"))
    (problem,) = auth_problems("auth = 3\n" + BASE)
    assert problem == "auth: must be a table, got 3"
    (problem,) = auth_problems(BASE + "\n[auth]\nkeys_files_env = 'X'\n")
    assert problem.startswith("auth.keys_files_env: unknown key (did you mean 'keys_file_env'?)")


# Keys file

def keys_file(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "keys.toml"
    path.write_text(text, encoding="utf-8")
    return {"TG_KEYS": str(path)}


def test_keys_file_adds_keys_in_plaintext_by_digest_or_by_environment(tmp_path: Path) -> None:
    environ = keys_file(
        tmp_path,
        f'[[keys]]\nname = "reports"\nkey = "{OTHER_KEY}"\nmay_force_classes = ["batch"]\nmax_concurrency = 2\n'
        f'[[keys]]\nname = "ops"\nkey_env = "TG_KEY_OPS"\n'
        f'[[keys]]\nname = "hashed"\nkey_sha256 = "{"ab" * 32}"\n',
    )
    environ["TG_KEY_OPS"] = "ops-key-1"
    text = with_keys(f'name = "webapp"\nkey_sha256 = "{DIGEST}"\n', auth='keys_file_env = "TG_KEYS"\n')
    config = parse_config(text, environ=environ)
    assert config.auth.keys == (
        ApiKeyConfig("webapp", DIGEST),
        ApiKeyConfig("reports", hash_key(OTHER_KEY), frozenset({"batch"}), 2),
        ApiKeyConfig("ops", hash_key("ops-key-1")),
        ApiKeyConfig("hashed", "ab" * 32),
    )
    assert config.auth.keys_file == environ["TG_KEYS"]
    # the keys file alone is enough
    alone = parse_config(BASE + '\n[auth]\nkeys_file_env = "TG_KEYS"\n', environ=environ)
    assert [key.name for key in alone.auth.keys] == ["reports", "ops", "hashed"]


def test_the_digest_follows_a_key_rotated_outside_the_text(tmp_path: Path) -> None:
    text = BASE + '\n[auth]\nkeys_file_env = "TG_KEYS"\n'
    first = parse_config(text, environ=keys_file(tmp_path, f'[[keys]]\nname = "r"\nkey = "{KEY}"\n')).digest
    again = parse_config(text, environ=keys_file(tmp_path, f'# rotated never\n[[keys]]\nname = "r"\nkey = "{KEY}"\n'))
    rotated = parse_config(text, environ=keys_file(tmp_path, f'[[keys]]\nname = "r"\nkey = "{OTHER_KEY}"\n'))
    assert again.digest == first  # same keys: a reload would be a no-op
    assert rotated.digest != first
    # with auth off the digest is the text's alone, as before
    assert parse_config(BASE).digest == hashlib.sha256(BASE.encode()).hexdigest()[:16]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "cannot read the keys file"),
        (f'[[keys]]\nname = "r"\nkey = {KEY}\n', "is not valid TOML"),  # unquoted: a TOML error
        ("[[keys]]\nname = \"r\"\nkey = 12345\n", "keys[0].key: must be a string, got an integer"),
        (f'[[keys]]\nname = "r"\nkey = "{KEY}"\ncolour = 1\n', "keys[0].colour: unknown key"),
        (f'[[keys]]\nname = "r"\nkey = "{KEY}"\nkey_env = "TG_X"\n', "keys[0]: needs exactly one of key_sha256, key_env, key"),
        (f'[[keys]]\nname = "webapp"\nkey = "{OTHER_KEY}"\n', 'keys[0].name: "webapp" is already auth.keys[0].name'),
        (f'[[keys]]\nname = "r"\nkey = "{KEY}"\n', 'keys[0].key: the same key as auth.keys[0] ("webapp")'),
        (f'[[keys]]\nname = "r"\nkey = "{KEY}"\nmay_force_classes = ["gold"]\n', 'keys[0].may_force_classes[0]: names no defined class: "gold"'),
        (f'key = "{KEY}"\n', "key: unknown key (did you mean 'keys'?)"),
    ],
)
def test_keys_file_problems_name_the_file_and_the_key_in_it(
    tmp_path: Path, content: str | None, fragment: str
) -> None:
    environ = {"TG_KEYS": str(tmp_path / "keys.toml")} if content is None else keys_file(tmp_path, content)
    text = with_keys(f'name = "webapp"\nkey_sha256 = "{DIGEST}"\n', auth='keys_file_env = "TG_KEYS"\n')
    (problem,) = auth_problems(text, environ)
    assert problem.startswith("auth.keys_file_env: "), problem
    assert environ["TG_KEYS"] in problem
    assert fragment in problem, problem


def test_keys_file_env_must_be_set_and_name_a_variable() -> None:
    text = with_keys(f'name = "w"\nkey_sha256 = "{DIGEST}"\n', auth='keys_file_env = "TG_KEYS"\n')
    assert auth_problems(text) == (
        "auth.keys_file_env: environment variable TG_KEYS is not set (it should hold the keys file's path)",
    )
    (problem,) = auth_problems(text, {"TG_KEYS": ""})
    assert "TG_KEYS is empty" in problem
    (problem,) = auth_problems(edit('"TG_KEYS"', '"/etc/keys.toml"', text))
    assert problem.startswith("auth.keys_file_env: must be the name of an environment variable")


def test_an_empty_keys_file_does_not_turn_auth_off(tmp_path: Path) -> None:
    environ = keys_file(tmp_path, "# every key was revoked\n")
    (problem,) = auth_problems(BASE + '\n[auth]\nkeys_file_env = "TG_KEYS"\n', environ)
    assert problem.startswith("auth: no API key in [[auth.keys]] or in the keys file ")


def test_no_key_shows_in_repr_render_or_errors(tmp_path: Path) -> None:
    environ = keys_file(tmp_path, f'[[keys]]\nname = "reports"\nkey = "{OTHER_KEY}"\nmax_concurrency = 3\n')
    environ["TG_KEY_WEBAPP"] = KEY
    text = with_keys(
        'name = "webapp"\nkey_env = "TG_KEY_WEBAPP"\nmay_force_classes = ["batch"]\n',
        auth='keys_file_env = "TG_KEYS"\n',
    )
    config = parse_config(text, environ=environ)
    rendered, shown = render_config(config), repr(config)
    for secret in (KEY, OTHER_KEY, DIGEST, hash_key(OTHER_KEY)):
        assert secret not in rendered and secret not in shown and secret not in str(config)
    assert "sha256=" not in shown
    assert re.search(rf"^  webapp\s+{DIGEST[:8]}\s+batch\s+no cap\s+1\s+none\s+none$", rendered, re.MULTILINE)
    assert re.search(rf"^  reports\s+{hash_key(OTHER_KEY)[:8]}\s+none\s+3\s+1\s+none\s+none$", rendered, re.MULTILINE)
    assert f"keys_file  {environ['TG_KEYS']}" in rendered


def test_hardening_keys_have_defaults_and_are_checked() -> None:
    config = parse_config(BASE)
    assert config.server.grpc_max_calls == 1000 and config.server.max_backend_body_bytes == 16 * 1024 * 1024
    pool = config.pools[0]
    assert (pool.first_byte_timeout, pool.health_check, pool.outlier_detection.consecutive_failures) == (60.0, "auto", 5)
    with pytest.raises(ConfigError) as refused:
        parse_config("[server]\ngrpc_max_calls = 0\n" + BASE)
    assert "server.grpc_max_calls: must be an integer >= 1, got 0" in refused.value.problems
    name = config.pools[0].name
    bad = BASE.replace(f"[pools.{name}]", f'[pools.{name}.outlier_detection]\nconsecutive_failures = 1\nmax_ejection_percent = 120\n\n[pools.{name}]\nhealth_check = "tcp"\n', 1)
    with pytest.raises(ConfigError) as refused:
        parse_config(bad)
    problems = "\n".join(refused.value.problems)
    assert f"pools.{name}.outlier_detection.consecutive_failures: must be an integer >= 2, got 1" in problems
    assert f"pools.{name}.outlier_detection.max_ejection_percent: must be at most 100, got 120" in problems
    assert f'pools.{name}.health_check: must be one of "auto", "http", "completion", got "tcp"' in problems


def test_http_server_lean_is_accepted_with_no_effect_and_any_other_server_is_refused() -> None:
    """The key of files from when there was a choice: "lean" still loads, the same config as without it."""
    lean = parse_config('[server]\nhttp_server = "lean"\n' + BASE)
    assert lean.server == parse_config(BASE).server
    assert "http_server" not in render_config(lean)
    for old in ("hypercorn", "nginx"):  # the one that was a choice, and one that never was
        assert problems_of(f'[server]\nhttp_server = "{old}"\n' + BASE) == (
            f'server.http_server: must be "lean" or left out (tailguard serves HTTP itself, no other server), got "{old}"',
        )
