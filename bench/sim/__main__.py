"""``python -m tailguard.sim``: run one or several simulated vLLM engines on localhost.

``--scheduling-policy priority`` runs every engine as vLLM does with that
flag (the waiting queue by the request's ``priority``, preemption of the
lowest priority when the KV cache runs short; docs/vllm-priority.md).

``--fault MODE[:key=value,...]`` starts every engine in a fault mode (see
``bench.sim.faults``); ``--admin-port`` serves ``/_sim/faults/PORT`` for each
engine, which reaches an engine even while it is killed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial

import trio

from .app import RUNNERS
from .faults import MODES, AdminApp, Fault, FaultSwitch
from .http import KEEP_ALIVE_TIMEOUT, serve
from .params import PROFILES, SCHEDULING_POLICIES, EngineParams
from .pooling import DEFAULT_EMBEDDING_SIZE
from .request import CHARS_PER_TOKEN
from .server import DEFAULT_MODEL, EngineSpec, parse_engines, serve_engine

_PARAM_HELP = {
    "max_num_seqs": "seats in the running batch (vLLM --max-num-seqs)",
    "max_num_batched_tokens": "token budget of one step, prefill chunks included (vLLM --max-num-batched-tokens)",
    "max_model_len": "longest prompt + output, in tokens (vLLM --max-model-len)",
    "kv_cache_tokens": "KV-cache capacity in tokens",
    "base_ms": "fixed cost of one step, ms",
    "per_seq_ms": "cost of each sequence in a step, ms",
    "per_context_token_ms": "attention cost per token of context a step reads, ms",
    "prefill_tokens_per_ms": "prefill speed, tokens per ms (0 = free)",
    "eos_probability": "chance per token that a sequence stops early (seeded; 0 = always run to max_tokens)",
    "scheduling_policy": "vLLM --scheduling-policy: fcfs (vLLM's default), or priority: the queue by the request's "
    "priority field (lower first), the lowest priority preempted when the KV cache runs short",
    "max_num_queued_reqs": "vLLM --max-num-queued-reqs: a request that would put more than this many in flight "
    "(waiting + running; n choices count n) is answered 503 at once (default: unbounded)",
    "max_num_queued_tokens": "vLLM --max-num-queued-tokens: once the prompt tokens of requests without their first "
    "token reach this, a new request is answered 503 at once (default: unbounded)",
    "prefix_caching": "vLLM's automatic prefix caching, on in every profile as in vLLM V1: true or false "
    "(cached 16-token prompt blocks are not prefilled again)",
    "block_size": "vLLM --block-size: tokens per KV block, the prefix cache's unit (16 as on CUDA; vLLM's CPU "
    "backend uses 128)",
    "scheduler_reserve_full_isl": "vLLM --scheduler-reserve-full-isl, true by default as in vLLM 0.32: admit a waiting "
    "request only when free KV holds its whole prompt (plus its output so far after a preemption), less cached "
    "blocks running requests hold; false: KV for its first prefill chunk only (the older gate, which preempts "
    "long prompts in a loop on a small cache)",
}
_PARAM_CHOICES: dict[str, tuple[str, ...]] = {"scheduling_policy": SCHEDULING_POLICIES}
# EngineSpec fields set per engine (or parsed from an option); each of the others is the option of its name, alike for every engine.
_PER_ENGINE = ("port", "params", "name", "fault")


def _parse_bool(text: str) -> bool:
    """A boolean engine parameter's value (argparse's ``type=bool`` would take "false" as true)."""
    if text.lower() not in ("true", "false"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


# Fields whose default names no usable type: None, or a bool.
_PARAM_TYPES: dict[str, Callable[[str], object]] = {
    "max_num_queued_reqs": int,
    "max_num_queued_tokens": int,
    "prefix_caching": _parse_bool,
    "scheduler_reserve_full_isl": _parse_bool,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tailguard.sim",
        description="Simulated vLLM engines: OpenAI-compatible HTTP servers whose engine "
        "models continuous batching on one GPU (an 8B model on an H100 by default).",
    )
    _add_engine_options(parser)
    _add_api_options(parser)
    parser.add_argument("--log-level", default="WARNING", help="logging level (default %(default)s)")
    _add_param_options(parser)
    return parser


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Where the engines listen, what each one runs, and the fault mode they start in."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=8001, help="port of a single engine (default %(default)s)")
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), default="latency", help="engine profile of a single engine (default %(default)s)"
    )
    parser.add_argument(
        "--engines",
        metavar="PORT:PROFILE,...",
        help="run several engines, e.g. 8001:latency,8002:throughput (overrides --port/--profile)",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="served model name (default %(default)s)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="slow the simulated GPU down by this factor (10 = ten times slower) so big engines can be "
        "saturated on few cores; /metrics reports the GPU's own, unscaled, timings (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of output text and EOS draws (default %(default)s)")
    parser.add_argument(
        "--fault",
        default="none",
        metavar="MODE[:KEY=VALUE,...]",
        help=f"start every engine in this fault mode, e.g. error_rate:p=0.3 or huge:size=1000000,status=200; "
        f"modes: {', '.join(MODES)}; change it later with POST /_sim/faults (default %(default)s)",
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="also serve /_sim/faults/ENGINE_PORT here, for every engine (reaches a killed engine); 0 picks a port",
    )


def _add_api_options(parser: argparse.ArgumentParser) -> None:
    """The HTTP API's vLLM flags (and the simulator's one extra, --retry-after)."""
    parser.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY") or None,
        help="vLLM --api-key: every /v1 path needs 'Authorization: Bearer KEY', else 401; /health, /metrics and "
        "/tokenize stay open (default: $VLLM_API_KEY, as vLLM reads it; none when unset)",
    )
    parser.add_argument(
        "--retry-after",
        type=int,
        default=None,
        help="add a Retry-After of this many seconds to the 503 a full queue (--max-num-queued-reqs) answers: "
        "the simulator's extra, vLLM sends none (default: none)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="vLLM's flag: usage carries prompt_tokens_details (cached_tokens, 0 included) in every answer",
    )
    parser.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help="vLLM's flag: each answer of one sequence carries a metrics object (queue, first token, decode times; "
        "a stream's on its usage chunk)",
    )
    parser.add_argument(
        "--max-chars-per-token",
        type=int,
        default=CHARS_PER_TOKEN,
        help="the tokenizer's longest token, in characters: a text over max_model_len x this is refused before it is "
        "counted (vLLM's input_text); 4 is the simulator's own token rule, a real tokenizer's is longer (default %(default)s)",
    )
    parser.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="vLLM's flag: answers carry X-Request-Id (the caller's, else a new one); without it the caller's id "
        "only names the completion (cmpl-ID)",
    )
    parser.add_argument(
        "--enable-responses-api-store",
        action="store_true",
        default=os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "") not in ("", "0", "false", "False"),
        help="vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1 (read from the environment too): /v1/responses keeps responses "
        "asked to store, for GET /v1/responses/ID, previous_response_id, background and cancel (default: off, as in vLLM)",
    )
    parser.add_argument(
        "--runner",
        choices=("auto", *RUNNERS),
        default="auto",
        help="vLLM --runner: generate (chat, completions, responses, messages), or pooling (embeddings, rerank, score, "
        "and no generation routes); auto: pooling with --convert embed, else generate (default %(default)s)",
    )
    parser.add_argument(
        "--convert",
        choices=("auto", "embed"),
        default="auto",
        help="vLLM --convert: embed serves the model as an embedding model (vLLM's --runner pooling --convert embed; "
        "the only conversion the simulator serves, and what auto means with --runner pooling) (default %(default)s)",
    )
    parser.add_argument(
        "--embedding-size",
        type=int,
        default=DEFAULT_EMBEDDING_SIZE,
        help="dimensions of a pooling engine's vectors (a model's hidden size in vLLM; default %(default)s, an 8B Llama's)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=KEEP_ALIVE_TIMEOUT,
        help="close a keep-alive connection idle this many seconds between requests (uvicorn's timeout_keep_alive, "
        "vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE; default %(default)s)",
    )


def _add_param_options(parser: argparse.ArgumentParser) -> None:
    """One option per ``EngineParams`` field, each overriding the profile's value for every engine."""
    group = parser.add_argument_group("engine parameters (override the profile's value for every engine)")
    for field in dataclasses.fields(EngineParams):
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            type=_PARAM_TYPES.get(field.name, type(field.default)),
            default=None,
            choices=_PARAM_CHOICES.get(field.name),
            help=_PARAM_HELP[field.name],
        )


async def _run(specs: Sequence[EngineSpec], admin_port: int | None) -> None:
    switches: dict[int, FaultSwitch] = {}
    async with trio.open_nursery() as nursery:
        for spec in specs:
            switch = FaultSwitch(spec.fault, seed=spec.seed)
            port = await nursery.start(partial(serve_engine, spec, switch=switch))
            switches[port] = switch
            fault = "" if spec.fault.mode == "none" else f"  fault={spec.fault.to_json()}"
            print(f"{spec.name}: http://{spec.host}:{port}/v1  model={spec.model}  {spec.params}{fault}", flush=True)
        if admin_port is not None:
            host = specs[0].host
            port = await nursery.start(serve, AdminApp(switches).handle, host, admin_port)
            print(f"admin: http://{host}:{port}/_sim/faults", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    overrides = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(EngineParams)
        if getattr(args, field.name) is not None
    }
    if args.retry_after is not None and args.retry_after < 0:
        parser.error(f"--retry-after must not be negative, got {args.retry_after}")
    if args.keep_alive_timeout < 0:
        parser.error(f"--keep-alive-timeout must not be negative, got {args.keep_alive_timeout}")
    if args.runner == "auto":  # vLLM's _get_runner_type: a conversion asked for makes a pooling model
        args.runner = "pooling" if args.convert == "embed" else "generate"
    if args.convert == "embed" and args.runner != "pooling":
        parser.error("--convert embed makes a pooling model: it does not go with --runner generate")
    if args.embedding_size < 1:
        parser.error(f"--embedding-size must be at least 1, got {args.embedding_size}")
    try:
        pairs = parse_engines(args.engines) if args.engines else [(args.port, args.profile)]
        fault = Fault.parse(args.fault)
        alike = {field.name: getattr(args, field.name) for field in dataclasses.fields(EngineSpec) if field.name not in _PER_ENGINE}
        specs = [
            EngineSpec(port=port, params=PROFILES[profile].replace(**overrides), name=f"{profile}@{port}", fault=fault, **alike)
            for port, profile in pairs
        ]
    except ValueError as error:
        parser.error(str(error))
    try:
        trio.run(_run, specs, args.admin_port)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
