"""The documentation under docs/ is checked against the code and the shipped config.

- docs/limits.md is generated (bench/tools/limits_doc.py) and must equal the
  rendering of the shipped config.toml.
- docs/deployment.md's vLLM commands, nginx config, tailguard snippets and
  client examples must agree with config.toml and with each other.
- docs/grafana/tailguard.json must parse, and every metric it queries must be
  one tailguard exports (DASHBOARD_METRICS; the metrics tests compare it with
  the real /metrics output).
- README.md and docs/*.md: every relative link resolves (file and heading),
  the README's first screen reaches a streamed answer on the shipped port, its
  performance figures are those of the pages it links, and
  docs/performance.md's current table is the committed overhead run.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from bench.tools import limits_doc
from tailguard.router import error_spec, errors
from tailguard.router.config import Config, EndpointConfig, PoolConfig, load_config, parse_config
from tailguard.server.grpc import api as grpc_api
from tailguard.sim.params import PROFILES

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SHIPPED = ROOT / "config.toml"


@pytest.fixture(scope="module")
def shipped() -> Config:
    return load_config(SHIPPED)


def code_blocks(path: Path, language: str) -> list[str]:
    """The bodies of the fenced code blocks tagged ``language`` in a Markdown file."""
    text = path.read_text(encoding="utf-8")
    return re.findall(rf"^```{re.escape(language)}[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.M | re.S)


# -- docs/limits.md ---------------------------------------------------------------


def test_limits_md_is_the_rendering_of_the_shipped_config(shipped: Config) -> None:
    committed = (DOCS / "limits.md").read_text(encoding="utf-8")
    assert committed == limits_doc.render_limits_markdown(shipped), (
        f"docs/limits.md is stale; regenerate it: .venv/bin/{limits_doc.REGENERATE}"
    )


def test_limits_doc_main_prints_the_page(capsys: pytest.CaptureFixture[str], shipped: Config) -> None:
    assert limits_doc.main([str(SHIPPED)]) == 0
    assert capsys.readouterr().out == limits_doc.render_limits_markdown(shipped)
    assert limits_doc.main(["--help"]) == 2
    assert limits_doc.main([str(ROOT / "no-such-config.toml")]) == 2


def test_limits_doc_covers_every_router_error(shipped: Config) -> None:
    """An error added to router/errors.py gets a row (so callers learn of it)."""
    page = limits_doc.render_limits_markdown(shipped)
    table = [line for line in page.splitlines() if re.match(r"\| (\d{3}|in stream) \|", line)]
    classes = limits_doc.documented_error_classes()
    assert errors.QueueFull in classes and errors.BackendRejected not in classes
    assert errors.BackendUnavailable in classes and errors.BackendTimeout in classes and errors.BodyTooLarge in classes
    assert errors.Overloaded not in classes  # a base: its row only backs a subclass without one
    assert len(table) == len(classes)


def test_every_error_class_has_its_own_row_in_the_error_table() -> None:
    """A new error class must say how it is answered, not inherit it by accident."""

    def all_classes(cls: type[errors.TailguardError]) -> list[type[errors.TailguardError]]:
        return [cls, *(c for child in cls.__subclasses__() for c in all_classes(child))]

    rows = {spec.error for spec in error_spec.SPECS}
    missing = [cls.__name__ for cls in all_classes(errors.TailguardError)[1:] if cls not in rows]
    assert not missing, f"router/error_spec.py has no row for {missing}"
    assert len(rows) == len(error_spec.SPECS)


def _expected_cells(cls: type[errors.TailguardError]) -> tuple[str, str]:
    """(status, `type` / `code`) as the docs show the error table's row for ``cls``."""
    spec = error_spec.spec_for(cls("example") if not issubclass(cls, errors.Overloaded) else cls("x", retry_after=1))
    status = limits_doc.http_status_shown(cls) or str(spec.http_status)
    return status, f"`{spec.error_type}`" + (f" / `{spec.code}`" if spec.code else "")


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start : end if end >= 0 else len(text)]


def test_readme_error_table_is_the_error_table() -> None:
    section = _readme_section("### Errors, and what a caller should do")
    rows = [
        tuple(cell.strip() for cell in line.strip("|").split("|")[:2])
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| status")
    ]
    expected = [_expected_cells(cls) for cls in limits_doc.documented_error_classes()]
    assert sorted(r for r in rows if r[0] != "4xx") == sorted(expected)
    assert ("4xx", "vLLM's") in rows  # a backend's 4xx, passed through


def test_readme_grpc_errors_name_each_code_under_its_status() -> None:
    section = _readme_section("## gRPC, for internal services")
    paragraph = section[section.index("- Errors, by status") :]
    paragraph = " ".join(paragraph[: paragraph.index("\n- ")].split())
    # "STATUS (`a`, `b`, ...)" groups: the codes each gRPC status is documented for.
    groups: dict[str, set[str]] = {}
    for status, inside in re.findall(r"([A-Z_]{5,}) \(([^)]*)\)", paragraph):
        groups.setdefault(status, set()).update(re.findall(r"`([a-z_]+)`", inside))
    for cls in limits_doc.documented_error_classes():
        spec = error_spec.SPECS[[s.error for s in error_spec.SPECS].index(cls)]
        token = spec.code or spec.error_type
        assert token in groups.get(spec.grpc_status, set()), f"{cls.__name__}: `{token}` is not listed under {spec.grpc_status}"
    assert f"{grpc_api.MAX_CONCURRENT_CALLS:,}" in paragraph


def test_limits_doc_follows_the_config() -> None:
    text = SHIPPED.read_text(encoding="utf-8")
    text = text.replace('over_cap = "clamp"', 'over_cap = "reject"').replace("input_cap_tokens = 8192", "input_cap_tokens = 4000")
    text = text.replace("retry_after = 1.0", "retry_after = 2.5")
    page = limits_doc.render_limits_markdown(parse_config(text))
    assert "**rejected**: HTTP 400" in page and "clamps instead" not in page
    assert "above **4,000 tokens**" in page
    assert "| 429 | `rate_limit_error` / `caller_concurrency_limit` | RESOURCE_EXHAUSTED | 3 s |" in page
    assert "| 429 | `rate_limit_error` / `queue_full` | RESOURCE_EXHAUSTED | when a seat is expected" in page
    assert "spread; 3 s to 60 s |" in page  # the configured value is the computed one's floor


# -- docs/deployment.md: vLLM -----------------------------------------------------


def vllm_commands(language: str = "sh") -> list[dict[str, str]]:
    """Each documented ``vllm serve`` command as {flag: value} (switches map to "").

    ``"sh"``: the commands of the shipped config's engines. The optional
    latency-tuned engine's block is tagged ``sh optional-latency`` (Markdown
    highlights it by its first word), so it is not one of them.
    """
    commands = []
    for block in code_blocks(DOCS / "deployment.md", language):
        words = shlex.split(block.replace("\\\n", " "), comments=True)
        if "vllm" not in words:
            continue
        args = words[words.index("vllm") + 1 :]
        assert args[:1] == ["serve"], block
        flags: dict[str, str] = {"model": args[1]}
        rest = args[2:]
        while rest:
            flag = rest.pop(0)
            assert flag.startswith("--"), f"unexpected word {flag!r} in {block}"
            value = rest.pop(0) if rest and not rest[0].startswith("--") else ""
            flags[flag] = value
        commands.append(flags)
    return commands


def endpoint_on_port(config: Config, port: int) -> tuple[PoolConfig, EndpointConfig]:
    found = [(pool, point) for pool in config.pools for point in pool.endpoints if urlsplit(point.url).port == port]
    assert len(found) == 1, f"no single endpoint of config.toml on port {port}"
    return found[0]


def test_vllm_commands_match_the_shipped_endpoints(shipped: Config) -> None:
    commands = vllm_commands()
    documented_ports = set()
    for flags in commands:
        port = int(flags["--port"])
        documented_ports.add(port)
        pool, endpoint = endpoint_on_port(shipped, port)
        assert int(flags["--max-num-seqs"]) == endpoint.max_concurrency, f"--port {port}: --max-num-seqs"
        assert int(flags["--max-model-len"]) == pool.max_model_len, f"--port {port}: --max-model-len"
        assert flags["--served-model-name"] in pool.models, f"--port {port}: --served-model-name"
        # vLLM refuses a step budget smaller than its batch.
        assert int(flags["--max-num-batched-tokens"]) >= int(flags["--max-num-seqs"])
        for switch in ("--enable-chunked-prefill", "--enable-prefix-caching"):
            assert flags[switch] == ""
        assert 0 < float(flags["--gpu-memory-utilization"]) <= 1
    shipped_ports = {urlsplit(point.url).port for pool in shipped.pools for point in pool.endpoints}
    assert documented_ports == shipped_ports, "one vllm serve command per endpoint of config.toml"


def test_each_engine_runs_the_tuning_its_pool_simulates(shipped: Config) -> None:
    """--simulate and the benchmarks model each engine by its pool's simulate_profile:
    the documented command must run that profile's seats and step budget."""
    for flags in vllm_commands():
        pool, endpoint = endpoint_on_port(shipped, int(flags["--port"]))
        profile = PROFILES[pool.simulate_profile]
        assert int(flags["--max-num-seqs"]) == profile.max_num_seqs == endpoint.max_concurrency, pool.name
        assert int(flags["--max-num-batched-tokens"]) == profile.max_num_batched_tokens, pool.name
    # Both pools' engines are tuned alike: the router, not engine flags, keeps short requests fast.
    assert {pool.simulate_profile for pool in shipped.pools} == {"throughput"}


def test_optional_latency_tuned_engine_is_the_latency_profile(shipped: Config) -> None:
    """The optional command replaces the interactive engine, changing only its seats and step budget,
    and the config it names matches: endpoint cap = --max-num-seqs, simulate_profile "latency"."""
    [optional] = vllm_commands("sh optional-latency")
    profile = PROFILES["latency"]
    assert int(optional["--max-num-seqs"]) == profile.max_num_seqs
    assert int(optional["--max-num-batched-tokens"]) == profile.max_num_batched_tokens
    pool, _ = endpoint_on_port(shipped, int(optional["--port"]))
    assert pool.name == "interactive"
    [replaced] = [flags for flags in vllm_commands() if flags["--port"] == optional["--port"]]
    assert optional.keys() == replaced.keys()
    assert {flag for flag in optional if optional[flag] != replaced[flag]} == {"--max-num-seqs", "--max-num-batched-tokens"}
    text = " ".join((DOCS / "deployment.md").read_text(encoding="utf-8").split())
    assert f"`max_concurrency = {profile.max_num_seqs}`" in text
    assert '`simulate_profile = "latency"`' in text


def test_tailguard_snippets_match_the_shipped_config(shipped: Config) -> None:
    snippets = [tomllib.loads(block) for block in code_blocks(DOCS / "deployment.md", "toml")]
    pools = [snippet["pools"] for snippet in snippets if "pools" in snippet]
    assert pools, "deployment.md shows the pools' config"
    for documented in pools:
        for name, table in documented.items():
            pool = shipped.pool(name)
            for key in ("max_concurrency", "max_queue", "max_model_len"):
                if key in table:
                    assert table[key] == getattr(pool, key), f"pools.{name}.{key}"
            assert tuple(table["models"]) == pool.models
            assert [(e["url"], e["max_concurrency"]) for e in table["endpoints"]] == [
                (e.url, e.max_concurrency) for e in pool.endpoints
            ], f"pools.{name}.endpoints"
    for snippet in snippets:
        if "timeouts" in snippet and "end_to_end_timeout" in snippet["timeouts"]:
            assert snippet["timeouts"]["end_to_end_timeout"] == shipped.timeouts.end_to_end_timeout


# -- docs/deployment.md: nginx ------------------------------------------------------


def nginx_config() -> str:
    blocks = code_blocks(DOCS / "deployment.md", "nginx")
    assert len(blocks) == 1, "one complete nginx config"
    return re.sub(r"#.*", "", blocks[0])


def directive(config: str, name: str) -> list[str]:
    return [value.strip() for value in re.findall(rf"^\s*{name}\s+([^;]+);", config, flags=re.M)]


def nginx_seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "": 1}
    match = re.fullmatch(r"(\d+)(ms|s|m|h|)", value)
    assert match, f"nginx time {value!r}"
    return int(match[1]) * units[match[2]]


def nginx_bytes(value: str) -> int:
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", value)
    assert match, f"nginx size {value!r}"
    return int(match[1]) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match[2].lower()]


def test_nginx_waits_longer_than_tailguard(shipped: Config) -> None:
    config = nginx_config()
    e2e = shipped.timeouts.end_to_end_timeout
    for name in ("proxy_read_timeout", "proxy_send_timeout", "grpc_read_timeout", "grpc_send_timeout"):
        values = directive(config, name)
        assert values, f"the nginx config sets {name}"
        for value in values:
            assert nginx_seconds(value) > e2e, f"{name} {value} must be above end_to_end_timeout {e2e:g} s"


def test_nginx_accepts_the_bodies_tailguard_accepts(shipped: Config) -> None:
    sizes = directive(nginx_config(), "client_max_body_size")
    assert sizes
    for size in sizes:
        assert nginx_bytes(size) >= shipped.server.max_body_bytes


def test_nginx_points_at_tailguards_listeners(shipped: Config) -> None:
    config = nginx_config()
    servers = directive(config, "server")
    assert f"{shipped.server.http_host}:{shipped.server.http_port}" in servers
    assert f"{shipped.server.grpc_host}:{shipped.server.grpc_port}" in servers
    assert directive(config, "grpc_pass") == ["grpc://tailguard_grpc"]
    assert "off" in directive(config, "proxy_buffering")
    assert "off" in directive(config, "proxy_cache")
    assert "1.1" in directive(config, "proxy_http_version")
    assert 'Connection ""' in directive(config, "proxy_set_header")
    assert "X-Request-Id $tailguard_request_id" in directive(config, "proxy_set_header")
    assert "x-request-id $tailguard_request_id" in directive(config, "grpc_set_header")
    assert directive(config, "http2") == ["on"]


def test_nginx_drops_idle_connections_before_tailguard_does(shipped: Config) -> None:
    from tailguard.server.http.server import HttpSettings

    tailguard_idle = HttpSettings.from_config(shipped.server, grace_timeout=5.0).keep_alive_timeout
    for value in directive(nginx_config(), "keepalive_timeout"):
        assert nginx_seconds(value) < tailguard_idle


def test_front_proxy_timeout_snippet_is_nginxs_timeout(shipped: Config) -> None:
    """The documented front_proxy_timeout is nginx's, and tailguard accepts it without a warning."""
    read_timeout = nginx_seconds(directive(nginx_config(), "proxy_read_timeout")[0])
    documented = [
        snippet["timeouts"]["front_proxy_timeout"]
        for snippet in map(tomllib.loads, code_blocks(DOCS / "deployment.md", "toml"))
        if "front_proxy_timeout" in snippet.get("timeouts", {})
    ]
    assert documented == [read_timeout]
    text = SHIPPED.read_text(encoding="utf-8").replace(
        "[timeouts]\n", f"[timeouts]\nfront_proxy_timeout = {documented[0]}\n", 1
    )
    config = parse_config(text)
    assert config.timeouts.front_proxy_timeout == read_timeout
    assert not [w for w in config.warnings if "front_proxy_timeout" in w]


# -- docs/deployment.md: client rules -----------------------------------------------


def test_client_examples_are_python_and_follow_the_rules(shipped: Config) -> None:
    blocks = code_blocks(DOCS / "deployment.md", "python")
    assert len(blocks) >= 2
    proxy_timeout = nginx_seconds(directive(nginx_config(), "proxy_read_timeout")[0])
    interactive = shipped.class_named("interactive")
    assert interactive.max_output_tokens is not None
    for block in blocks:
        ast.parse(block)
        assert "X-Request-Id" in block
        max_tokens = [int(v) for v in re.findall(r"""["']?max_tokens["']?\s*[=:]\s*(\d+)""", block)]
        assert max_tokens and all(v <= interactive.max_output_tokens for v in max_tokens), "explicit, interactive"
        timeouts = [float(v) for v in re.findall(r"\btimeout\s*=\s*(?:httpx\.Timeout\()?([\d.]+)", block)]
        assert timeouts and all(v > proxy_timeout for v in timeouts), "client timeout above the proxy's"
        retries = [int(v) for v in re.findall(r"(?i)max_retries\s*=\s*(\d+)", block)]
        assert retries and all(v <= 2 for v in retries)
    models = {model for pool in shipped.pools for model in pool.models}
    for block in blocks:
        assert set(re.findall(r"""model["']?\s*[=:]\s*["']([^"']+)""", block)) <= models


# -- docs/grafana/tailguard.json ------------------------------------------------------

# Every metric tailguard exports (histograms by their base name).
EXPORTED_METRICS = frozenset({
    "tailguard_request_queue_seconds",
    "tailguard_request_ttft_seconds",
    "tailguard_request_decode_seconds",
    "tailguard_request_time_per_output_token_seconds",
    "tailguard_request_e2e_seconds",
    "tailguard_request_prompt_tokens",
    "tailguard_request_completion_tokens",
    "tailguard_requests_total",
    "tailguard_rejections_total",
    "tailguard_max_tokens_clamped_total",
    "tailguard_config_reloads_total",
    "tailguard_duplicate_request_ids_total",
    "tailguard_config_info",
    "tailguard_draining",
    "tailguard_pool_in_flight",
    "tailguard_pool_max_concurrency",
    "tailguard_pool_queue_length",
    "tailguard_pool_max_queue",
    "tailguard_pool_healthy_endpoints",
    "tailguard_endpoint_in_flight",
    "tailguard_endpoint_max_concurrency",
    "tailguard_endpoint_healthy",
    "tailguard_backend_requests_running",
    "tailguard_backend_requests_waiting",
    "tailguard_backend_kv_cache_usage_ratio",
    "tailguard_backend_scrape_ok",
    "tailguard_backend_prefix_cache_hit_ratio",
    "tailguard_backend_prefix_cache_queried_tokens_total",
    "tailguard_backend_prefix_cache_hit_tokens_total",
    "tailguard_placements_total",
    "tailguard_pool_lent_seats",
    "tailguard_pool_borrowed",
    "tailguard_endpoint_moves",
    "tailguard_endpoint_assignment",
    "tailguard_endpoint_moving",
    "tailguard_gc_pause_seconds",
    "tailguard_cluster_mode",
    "tailguard_cluster_grant_seats",
})

DASHBOARD_PATH = DOCS / "grafana" / "tailguard.json"


def dashboard_metrics(dashboard: dict[str, Any]) -> frozenset[str]:
    """The metric names the dashboard's queries use, histogram suffixes stripped."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    names = {name for expr in exprs for name in re.findall(r"tailguard_[a-z0-9_]+", expr)}
    return frozenset(re.sub(r"_(bucket|sum|count)$", "", name) for name in names)


# What the metrics tests compare with the real /metrics output.
DASHBOARD_METRICS = dashboard_metrics(json.loads(DASHBOARD_PATH.read_text(encoding="utf-8")))


def test_dashboard_panels_have_titles_and_queries() -> None:
    dashboard = json.loads(DASHBOARD_PATH.read_text(encoding="utf-8"))
    assert dashboard["schemaVersion"] >= 36
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"pool", "class"}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel.get("title"), panel
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert target["expr"].count("(") == target["expr"].count(")"), panel["title"]


def test_dashboard_uses_only_exported_metrics() -> None:
    assert DASHBOARD_METRICS
    assert DASHBOARD_METRICS <= EXPORTED_METRICS, sorted(DASHBOARD_METRICS - EXPORTED_METRICS)


def test_dashboard_shows_the_tail_per_class() -> None:
    dashboard = json.loads(DASHBOARD_PATH.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for metric in ("tailguard_request_e2e_seconds", "tailguard_request_ttft_seconds"):
        quantiles = {
            q for q, m in re.findall(r"histogram_quantile\(([\d.]+), sum by \(le, class\) \(rate\((\w+)_bucket", " ".join(exprs))
            if m == metric
        }
        assert quantiles == {"0.5", "0.95", "0.99"}, metric


# -- README.md and the pages it links -----------------------------------------------


def _prose(path: Path) -> str:
    """A Markdown file without its fenced code blocks (a ``# comment`` in one is no heading)."""
    return re.sub(r"^```.*?^```[ \t]*$", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """The fragment GitHub gives each heading: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} (.+?)\s*$", _prose(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


MARKDOWN_PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", MARKDOWN_PAGES, ids=lambda p: p.name)
def test_every_relative_link_names_a_file_and_heading_that_exist(page: Path) -> None:
    """The README's detail moved to docs/: a link that points nowhere loses it again."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, fragment = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md" and fragment not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_readme_first_screen_goes_from_clone_to_a_streamed_answer(shipped: Config) -> None:
    first_screen = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:40])
    blocks = re.findall(r"^```sh\n(.*?)^```", first_screen, flags=re.M | re.S)
    assert any("pip install -e . && .venv/bin/tailguard serve --simulate" in block for block in blocks)
    (curl,) = [shlex.split(block.replace("\\\n", " ")) for block in blocks if block.startswith("curl")]
    body = json.loads(curl[curl.index("-d") + 1])
    assert body["stream"] is True and body["messages"]
    url = next(word for word in curl if "/v1/chat/completions" in word)
    assert urlsplit(f"http://{url}").port == shipped.server.http_port
    assert "data: [DONE]" in first_screen


def test_readme_own_vllm_config_is_a_whole_config_that_loads() -> None:
    """The "Your own vLLM" file is complete as shown: only keys without a default, and it loads."""
    (block,) = code_blocks_in(_section(ROOT / "README.md", "## Your own vLLM"), "toml")
    config = parse_config(block, source="README.md (Your own vLLM)")
    (pool,) = config.pools
    assert pool.models == ("meta-llama/Llama-3.1-8B-Instruct",) and [e.url for e in pool.endpoints] == ["http://vllm-0:8000"]
    assert not pool.max_model_len_configured  # asked of vLLM, as the text says
    assert [klass.priority for klass in config.classes] == [0, 1]
    for key in ("max_queue", "max_model_len", "priority", "max_concurrency = ", "[server]", "[limits]"):
        assert not re.search(rf"^{re.escape(key)}", block, flags=re.M), f"{key} has a default: the minimal file leaves it out"


def test_readme_says_the_python_and_redis_the_tests_need() -> None:
    set_up = _section(ROOT / "README.md", "## Set-up: two commands")
    python = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["requires-python"]
    assert python.startswith(">=") and f"Python >= {python.removeprefix('>=')}" in set_up
    assert "`redis-server` on `PATH`" in set_up and "`apt-get install redis-server`" in set_up


def code_blocks_in(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{re.escape(language)}[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.M | re.S)


def _section(path: Path, title: str) -> str:
    text = path.read_text(encoding="utf-8")
    start = text.index(f"\n{title}\n")
    end = text.find("\n## ", start + len(title) + 2)
    return text[start : end if end >= 0 else len(text)]


def test_readme_performance_headline_is_what_the_linked_pages_say() -> None:
    """Every figure the README quotes is one of docs/performance.md's or docs/results.md's."""
    headline = _section(ROOT / "README.md", "## Performance")
    pages = " ".join(" ".join((DOCS / name).read_text(encoding="utf-8").split()) for name in ("performance.md", "results.md"))
    figures = set(re.findall(r"(?<![\w.])\d[\d,]*\.?\d*(?=\s|x|-|\)|,|$)", headline)) - {"2", "4"}
    assert len(figures) > 10
    missing = sorted(f for f in figures if not re.search(rf"(?<![\d,.]){re.escape(f.rstrip('.,'))}(?![\d])", pages))
    assert not missing, f"README's performance figures not in docs/performance.md or docs/results.md: {missing}"


def test_performance_pages_slower_host_table_is_the_two_committed_runs() -> None:
    """The slower host's before and after in docs/performance.md are bench/results/overhead/slow-host/, rounded."""
    section = _section(DOCS / "performance.md", "## Where it stands (issue 11, commit b6b2e40)")
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:5]]
        for line in section.splitlines()
        if line.startswith("| slower host: ")
    }
    runs = [
        json.loads((ROOT / "bench" / "results" / "overhead" / "slow-host" / f"overhead-{code}.json").read_text(encoding="utf-8"))
        for code in ("f058a34", "78e5be4")
    ]
    assert [run["code"][:7] for run in runs] == ["f058a34", "78e5be4"]
    saturation = [{entry["target"]: entry for entry in run["saturation"]} for run in runs]
    streams = [{entry["target"]: entry for entry in run["streams"] if entry["streams"] == 256} for run in runs]
    paced = [{entry["target"]: entry for entry in run["paced"]} for run in runs]
    peer, ours = "vllm-router HTTP", "tailguard HTTP"

    def ratio(mine: float, theirs: float) -> str:
        return f"({mine / theirs:.2f}x)"

    assert rows["slower host: saturation, concurrency 64"] == [
        f"{saturation[0][peer]['req_per_s']:,.0f} / {saturation[1][peer]['req_per_s']:,.0f} req/s",
        *(f"{s[ours]['req_per_s']:,.0f} req/s {ratio(s[ours]['req_per_s'], s[peer]['req_per_s'])}" for s in saturation),
    ]
    cpu = "router_cpu_ms_per_request"
    assert rows["slower host: router CPU per request"] == [
        f"{saturation[0][peer][cpu] * 1000:.0f} / {saturation[1][peer][cpu] * 1000:.0f} µs",
        *(f"{s[ours][cpu] * 1000:.0f} µs {ratio(s[ours][cpu], s[peer][cpu])}" for s in saturation),
    ]
    assert rows["slower host: SSE relay, 256 streams"] == [
        f"{streams[0][peer]['chunks_per_s']:,.0f} / {streams[1][peer]['chunks_per_s']:,.0f} events/s",
        *(f"{s[ours]['chunks_per_s']:,.0f} events/s {ratio(s[ours]['chunks_per_s'], s[peer]['chunks_per_s'])}" for s in streams),
    ]
    event = "tailguard_cpu_us_per_chunk"
    assert rows["slower host: CPU an SSE event at an engine's pace"] == [
        f"{paced[0][peer][event]:.1f} / {paced[1][peer][event]:.1f} µs",
        *(f"{p[ours][event]:.1f} µs {ratio(p[ours][event], p[peer][event])}" for p in paced),
    ]


def test_performance_pages_overhead_table_is_the_committed_run() -> None:
    """docs/performance.md's current table is bench/results/overhead/overhead.json, rounded."""
    run = json.loads((ROOT / "bench" / "results" / "overhead" / "overhead.json").read_text(encoding="utf-8"))
    section = _section(DOCS / "performance.md", "## Where it stands (issue 11, commit b6b2e40)")
    assert run["code"].startswith("b6b2e40")
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:5]]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| |")
    }
    saturation = {entry["target"]: entry for entry in run["saturation"]}
    columns = ["vllm-router HTTP", "tailguard HTTP", "tailguard gRPC"]
    assert rows["saturation, concurrency 64"] == [
        f"{saturation[target]['req_per_s']:,.0f} {'calls' if 'gRPC' in target else 'req'}/s" for target in columns
    ]
    assert rows["router CPU per request"] == [f"{saturation[target]['router_cpu_ms_per_request'] * 1000:.0f} µs" for target in columns]
    added = {entry["path"]: entry for entry in run["added"] if entry["rate"] == 100.0}
    assert rows["added P50 / P99 at 100 req/s"] == [
        f"{added[target]['added_p50_ms']:.2f} / {added[target]['added_p99_ms']:.2f} ms" for target in columns
    ]
    streams = {entry["target"]: entry for entry in run["streams"] if entry["streams"] == 256}
    peer, ours = streams["vllm-router HTTP"], streams["tailguard HTTP"]
    assert rows["SSE relay, 256 streams"][:2] == [
        f"{peer['chunks_per_s']:,.0f} events/s ({peer['tailguard_cpu_us_per_chunk']:.1f} µs CPU each)",
        f"{ours['chunks_per_s']:,.0f} events/s ({ours['tailguard_cpu_us_per_chunk']:.1f} µs)",
    ]
    paced = {entry["target"]: entry for entry in run["paced"]}
    assert rows["SSE relay at engine pace, 64 streams"][:2] == [
        f"{paced['vllm-router HTTP']['tailguard_cpu_us_per_chunk']:.1f} µs CPU an event",
        f"{paced['tailguard HTTP']['tailguard_cpu_us_per_chunk']:.1f} µs",
    ]
