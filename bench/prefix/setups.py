"""The set-ups side by side: four fresh simulated engines each, and the router in front of them.

- ``round robin``: vllm-router ``--policy round_robin``;
- ``cache_aware``: vllm-router ``--policy cache_aware`` with its defaults (an
  approximate prefix tree per worker; cache threshold 0.3, balance
  thresholds 64 absolute / 1.5 relative);
- ``cache_aware 8/1.25``: cache_aware balancing at 8 requests and 1.25x,
  thresholds sized to 32-seat engines (its defaults balance only once one
  engine holds 64 requests more than another: two full batches queued);
- ``hand affinity``: vllm-router ``--policy consistent_hash`` (160 virtual
  nodes a worker), each request carrying its tenant / conversation /
  document as ``X-Session-ID``, the header that policy hashes first: each
  key pinned to one engine, no balancing;
- ``least loaded``: tailguard, one pool over the four engines,
  ``placement = "least_loaded"``;
- ``tailguard``: the same pool with tailguard's default placement (prefix
  affinity, where the router has it);
- ``tailguard + session`` (``--setup``, not in the default run): the same,
  each request carrying its key as ``X-Session-ID``, tailguard's default
  session header: the caller's hint instead of the prompt's leading blocks.

tailguard's pool has one catch-all class (no thresholds), so what differs
is placement, not a split; endpoint caps are the engines' seats.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import trio

from bench.harness.client import HOST
from bench.harness.config import server_table
from bench.harness.procs import start_process, start_tailguard
from bench.harness.serving import ready_process
from bench.harness.toml import TomlTable, TomlValue, dumps, merged
from bench.prefix.model import INPUT_CAP_TOKENS, MAX_MODEL_LEN, MODEL, SEATS

ROUND_ROBIN, CACHE_AWARE, HAND, LEAST_LOADED, TAILGUARD = "round robin", "cache_aware", "hand affinity", "least loaded", "tailguard"
CACHE_AWARE_TUNED = "cache_aware 8/1.25"
HINTED = "tailguard + session"
SETUPS = (ROUND_ROBIN, CACHE_AWARE, CACHE_AWARE_TUNED, HAND, LEAST_LOADED, TAILGUARD)  # the default run
# Two classes on the one pool (placement unchanged), "short" bounding 500 prompt tokens: counted raw, or as uncached
# (prompt_bound = "uncached"); the difference in its requests is the warm turns classification keeps interactive.
RAW_CLASSES, UNCACHED_CLASSES = "tailguard, raw classes", "tailguard, uncached classes"
PROMPT_BOUNDS = {RAW_CLASSES: "all", UNCACHED_CLASSES: "uncached"}
SHORT_CLASS_PROMPT_TOKENS = 500  # the shipped interactive class's max_prompt_tokens
# The prefix affinity load bound (pools.*.placement.affinity_load_factor, shipped 1.1) at other values: how much
# concentration a warm prefix is worth once the simulator stores its KV once (issue 33).
LOAD_BOUNDS = {"tailguard, load bound 1.25": 1.25, "tailguard, load bound 1.5": 1.5}
ALL_SETUPS = (*SETUPS, HINTED, RAW_CLASSES, UNCACHED_CLASSES, *LOAD_BOUNDS)
# vllm-router's flags per set-up. The tuned cache_aware balances once the busiest worker has 8 more requests
# (a quarter of an engine's seats) and 1.25x the idlest's, instead of its defaults' 64 and 1.5x.
PEER_POLICIES = {
    ROUND_ROBIN: ["--policy", "round_robin"],
    CACHE_AWARE: ["--policy", "cache_aware"],
    CACHE_AWARE_TUNED: ["--policy", "cache_aware", "--balance-abs-threshold", "8", "--balance-rel-threshold", "1.25"],
    HAND: ["--policy", "consistent_hash"],
}
SESSION_HEADER = "X-Session-ID"  # what vllm-router's consistent_hash hashes first
END_TO_END_TIMEOUT_S = 120.0  # GPU s; tailguard's, scaled
QUEUE_TIMEOUT_S = 60.0  # GPU s: the catch-all class waits this long for a seat


@dataclass(frozen=True)
class Setup:
    """One set-up: its name, how it was run, and whether its requests carry the pin key as a header."""

    name: str
    description: str
    pin_header: bool = False


def file_name(name: str) -> str:
    """A set-up's name as a piece of a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def vllm_router() -> Path | None:
    """The vllm-router executable beside this Python (the venv's), else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    found = beside if beside.exists() else shutil.which("vllm-router")
    return Path(found) if found else None


def placement_supported() -> bool:
    """Whether this tailguard reads a pool's ``placement`` key (issue 22's placement change adds it)."""
    with_key = pool_config(1, 2, [3, 4, 5, 6], 1.0, "least_loaded")
    check = [sys.executable, "-m", "tailguard.server", "check-config", "--config", "/dev/stdin"]
    done = subprocess.run(check, input=with_key, capture_output=True, text=True, check=False, timeout=60)
    return done.returncode == 0


def describe(name: str, placement_ok: bool) -> Setup:
    """The set-up called ``name``, as this run can build it."""
    if name in PEER_POLICIES:
        text = f"vllm-router {' '.join(PEER_POLICIES[name])}" + (f", {SESSION_HEADER} = the request's key" if name == HAND else "")
        return Setup(name, text, pin_header=name == HAND)
    if name == LEAST_LOADED:
        text = (
            'tailguard, one pool, placement = "least_loaded"'
            if placement_ok
            else "tailguard, one pool (least loaded: no placement key yet)"
        )
        return Setup(name, text)
    if name == HINTED:
        return Setup(name, f"tailguard, one pool, its default placement, {SESSION_HEADER} = the request's key", pin_header=True)
    if name in LOAD_BOUNDS:
        return Setup(name, f"tailguard, one pool, its default placement with affinity_load_factor = {LOAD_BOUNDS[name]:g}")
    if name in PROMPT_BOUNDS:
        return Setup(
            name,
            f'tailguard, one pool, its default placement, a "short" class of <= {SHORT_CLASS_PROMPT_TOKENS} prompt tokens '
            f'(prompt_bound = "{PROMPT_BOUNDS[name]}") before the catch-all, both on that pool',
        )
    return Setup(name, "tailguard, one pool, its default placement" + ("" if placement_ok else " (least loaded: no prefix affinity yet)"))


def pool_config(
    http_port: int,
    grpc_port: int,
    engines: Sequence[int],
    time_scale: float,
    placement: str | None,
    prompt_bound: str | None = None,
    load_bound: float | None = None,
) -> str:
    """tailguard over ``engines``: one pool, caps at the engines' seats, a catch-all class (after a "short" one with ``prompt_bound``); GPU-time timeouts."""
    pool: dict[str, TomlValue] = {
        "max_concurrency": SEATS * len(engines), "max_queue": 64 * SEATS * len(engines), "max_model_len": MAX_MODEL_LEN, "models": [MODEL],
    }  # fmt: skip
    if placement:
        pool["placement"] = placement
    pool["endpoints"] = [{"url": f"http://{HOST}:{port}", "max_concurrency": SEATS} for port in engines]
    if load_bound is not None:
        pool["affinity_load_factor"] = load_bound
    queue_timeout = QUEUE_TIMEOUT_S * time_scale
    short: dict[str, TomlTable] = {"short": {"max_prompt_tokens": SHORT_CLASS_PROMPT_TOKENS, "prompt_bound": prompt_bound}} if prompt_bound else {}
    sections: TomlTable = {
        "limits": {"input_cap_tokens": INPUT_CAP_TOKENS},
        "timeouts": {"end_to_end_timeout": END_TO_END_TIMEOUT_S * time_scale},
        "pools": {"all": pool},
        "classes": {name: {"pool": "all", **bounds, "queue_timeout": queue_timeout, "priority": 0} for name, bounds in (*short.items(), ("all", {}))},
    }
    return dumps(merged(server_table(http_port, grpc_port), sections))


def peer_command(exe: Path, policy: Sequence[str], port: int, metrics_port: int, engines: Sequence[int]) -> list[str]:
    """vllm-router in front of ``engines`` with the ``policy`` flags and its defaults otherwise, on 127.0.0.1 only (its metrics too)."""
    urls = [f"http://{HOST}:{p}" for p in engines]
    return [
        str(exe), "--host", HOST, "--port", str(port), "--worker-urls", *urls, *policy,
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port), "--log-level", "warning",
    ]  # fmt: skip


async def start_router(
    nursery: trio.Nursery,
    setup: Setup,
    engines: Sequence[int],
    router_ports: tuple[int, int],
    time_scale: float,
    placement_ok: bool,
    tmp: Path,
    log: IO[bytes],
) -> trio.Process:
    """The set-up's router process in ``nursery``: vllm-router with the set-up's policy, or tailguard with its pool's config."""
    port, second = router_ports
    if setup.name in PEER_POLICIES:
        exe = vllm_router()
        if exe is None:
            raise RuntimeError("vllm-router not found: pip install -e '.[bench]'")
        return await start_process(nursery, peer_command(exe, PEER_POLICIES[setup.name], port, second, engines), log)
    placement = "least_loaded" if setup.name == LEAST_LOADED and placement_ok else None
    config = tmp / f"tailguard-{file_name(setup.name)}.toml"
    config.write_text(pool_config(port, second, engines, time_scale, placement, PROMPT_BOUNDS.get(setup.name), LOAD_BOUNDS.get(setup.name)))
    return await start_tailguard(nursery, config, log=log)


@asynccontextmanager
async def running(
    setup: Setup, engines: Sequence[int], router_ports: tuple[int, int], time_scale: float, placement_ok: bool, tmp: Path, log: IO[bytes]
) -> AsyncIterator[tuple[int, trio.Process]]:
    """The set-up's router in front of ``engines`` on ``router_ports`` (its own, and its metrics' or gRPC's), ready; stopped on every way out."""
    start = partial(
        start_router, setup=setup, engines=engines, router_ports=router_ports, time_scale=time_scale, placement_ok=placement_ok, tmp=tmp, log=log
    )  # fmt: skip
    async with ready_process(start, router_ports[0], setup.name) as process:
        yield router_ports[0], process
