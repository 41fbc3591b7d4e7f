"""The simulated engines of one set-up: their process, their KV-cache size, and their counters read from /metrics.

Every set-up of every workload gets a simulator process of its own, so each
starts with cold caches. The KV cache is sized from the tenants workload:
one engine holds about a third of the tenants' system prompts beside the
blocks its running sequences need of their own (``kv_sizing``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.client import HOST, ProtocolError
from bench.harness.open_loop import TokenClient
from bench.harness.procs import start_process
from bench.prefix.model import LONG_MAX_TOKENS, MAX_MODEL_LEN, SEATS, SHORT_MAX_TOKENS

BLOCK = 16  # vLLM's KV-cache block, tokens


@dataclass(frozen=True)
class KvSizing:
    """How the KV cache was sized, to print and report."""

    system_prompt_tokens: int  # all tenants' together
    running_own_tokens: int  # SEATS sequences' own blocks: unshared prompt + output
    kv_cache_tokens: int

    def line(self) -> str:
        return (
            f"kv_cache_tokens {self.kv_cache_tokens:,} ({self.kv_cache_tokens // BLOCK:,} blocks) an engine = a third of the tenants' "
            f"system prompts ({self.system_prompt_tokens:,} tokens / 3) + {SEATS} running sequences' own tokens "
            f"({self.running_own_tokens:,}); max_model_len {MAX_MODEL_LEN:,}"
        )


def kv_sizing(system_prompt_tokens: int, unique_share: float) -> KvSizing:
    """A third of the system prompts plus SEATS sequences' own tokens (question and answer, or a unique document and its answer), whole blocks."""
    own = (1 - unique_share) * (48 + SHORT_MAX_TOKENS) + unique_share * (2250 + LONG_MAX_TOKENS)
    running = math.ceil(SEATS * own)
    tokens = system_prompt_tokens / 3 + running
    kv = max(BLOCK * math.ceil(tokens / BLOCK), MAX_MODEL_LEN)
    return KvSizing(system_prompt_tokens, running, kv)


async def start_engines(
    nursery: trio.Nursery, ports: Sequence[int], kv_cache_tokens: int, time_scale: float, seed: int, log: IO[bytes]
) -> trio.Process:
    """``python -m tailguard.sim``: an engine on each port, SEATS seats, the prefix cache on; cancelling ``nursery`` stops it."""
    command = [
        sys.executable, "-m", "tailguard.sim", "--engines", ",".join(f"{p}:latency" for p in ports),
        "--time-scale", f"{time_scale:g}", "--seed", str(seed), "--max-num-seqs", str(SEATS),
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", str(kv_cache_tokens), "--prefix-caching", "true",
    ]  # fmt: skip
    return await start_process(nursery, command, log)


@dataclass(frozen=True)
class EngineCounters:
    """One engine's cumulative counters: requests finished, prefix-cache tokens queried and hit, prompt tokens prefilled, preemptions."""

    requests: float = 0.0
    queries: float = 0.0
    hits: float = 0.0
    prefilled: float = 0.0
    preemptions: float = 0.0

    def minus(self, before: EngineCounters) -> EngineCounters:
        return EngineCounters(*(a - b for a, b in zip(self.astuple(), before.astuple())))

    def astuple(self) -> tuple[float, float, float, float, float]:
        return self.requests, self.queries, self.hits, self.prefilled, self.preemptions


_SAMPLES = {
    "vllm:request_success_total": "requests",
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prompt_tokens_total": "prefilled",
    "vllm:num_preemptions_total": "preemptions",
}


def parse_counters(page: str) -> EngineCounters:
    """The counters of one engine's /metrics page (Prometheus text), each summed over its labels."""
    found = dict.fromkeys(_SAMPLES.values(), 0.0)
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name in _SAMPLES:
                found[_SAMPLES[sample.name]] += sample.value
    return EngineCounters(**found)


async def scrape(port: int) -> str | None:
    """``GET /metrics`` of 127.0.0.1:``port`` (None when it does not answer 200 within 2 s)."""
    client = TokenClient(port)
    try:
        with trio.move_on_after(2.0):
            reply = await client.exchange(f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode())
            return client.last_piece.decode() if reply.status == 200 else None
    except (OSError, trio.BrokenResourceError, ProtocolError):
        pass
    finally:
        await client.aclose()
    return None


async def read_counters(ports: Sequence[int]) -> dict[int, EngineCounters]:
    """Every engine's counters now (an engine that does not answer is left out)."""
    found: dict[int, EngineCounters] = {}
    for port in ports:
        page = await scrape(port)
        if page is not None:
            found[port] = parse_counters(page)
    return found


def placements(page: str) -> dict[str, float]:
    """tailguard's ``tailguard_placements_total`` by decision (home, spilled, no_key, ...), summed over pools and endpoints."""
    return summed_by(page, "tailguard_placements_total", "decision")


def class_counts(page: str) -> dict[str, float]:
    """tailguard's finished requests by class (``tailguard_requests_total``), summed over pools and outcomes."""
    return summed_by(page, "tailguard_requests_total", "class")


def summed_by(page: str, name: str, label: str) -> dict[str, float]:
    """The samples called ``name`` on a /metrics page, summed by one label's value ("?" where it has none)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name:
                value = sample.labels.get(label, "?")
                found[value] = found.get(value, 0.0) + sample.value
    return found
