"""``tailguard init``: a starting config.toml written from what the engines report.

A first config is mostly facts the engines already know: the served model
names and the context length, both in vLLM's ``GET /v1/models``. Asking for
them (with the engines' ``--api-key`` when ``--api-key-env`` names it) spares
a newcomer copying them by hand, and a typo in a model name that would 404
every request. What vLLM does not report, its ``--max-num-seqs`` (vLLM 0.32:
not in ``/v1/models``, not in ``/metrics``, whose ``vllm:cache_config_info``
has the cache's fields only; ``/server_info`` only in its dev mode), comes
from ``--max-concurrency``; without it, vLLM's default on most GPUs (256) is
written and marked ASSUMED, in the file and on stdout: a cap above the
engine's lets requests queue unseen in vLLM, one below it idles GPUs, and
a guess must not pass for a fact.

The file is one pool serving every engine and two classes sharing it (short
requests first in its queue), every line commented. It is validated with
:func:`tailguard.router.config.load.parse_config` before it is written, so what
``init`` writes always loads; an existing file is never overwritten without
``--force``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from tailguard.router.config import ConfigError, LimitsConfig, normalise_url, parse_config

__all__ = ["EngineReport", "InitError", "ask_engines", "main", "starting_config", "write_config"]

# vLLM's --max-num-seqs when not given, on GPUs under 70 GiB and A100s (1,024 on
# larger ones, 128 on CPUs: tailguard.sim.params.VLLM_SERVER_DEFAULTS): written,
# marked ASSUMED, when --max-concurrency does not say.
DEFAULT_MAX_NUM_SEQS = 256
_MODELS_BODY_LIMIT = 1024 * 1024  # a model list is a few hundred bytes; LoRA adapters add a few each
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
POOL = "main"


class InitError(Exception):
    """Nothing was written; ``problems`` has one line each (an engine, the file), all found at once."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class EngineReport:
    """What one engine said in ``GET /v1/models``."""

    url: str  # normalised base URL, as the config spells it
    models: tuple[str, ...]  # base models first, then LoRA adapters, in the engine's order
    max_model_len: int | None  # the smallest any model reports; None: none does (not vLLM?)


async def ask_engines(urls: Sequence[str], *, api_key: str | None, timeout: float) -> list[EngineReport]:
    """Ask every engine at once, each within ``timeout`` seconds.

    Raises :exc:`InitError` naming every engine that could not be asked or
    gave no model list (a bad URL, unreachable, a status other than 200, a
    body that is not vLLM's list), so one run shows every mistake.
    """
    problems: list[str] = []
    bases: list[str] = []
    for url in urls:
        try:
            bases.append(normalise_url(url))
        except ValueError as error:
            problems.append(f"--endpoint {url}: {error}")
    if problems:
        raise InitError(problems)
    answers: dict[str, EngineReport | str] = {}
    headers = {"accept-encoding": "identity", **({"authorization": f"Bearer {api_key}"} if api_key is not None else {})}
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), headers=headers) as client:

        async def ask(base: str) -> None:
            answers[base] = f"{base}: no answer to GET /v1/models in {timeout:g} s"
            with trio.move_on_after(timeout):
                answers[base] = await _ask(client, base, api_key is not None)

        async with trio.open_nursery() as nursery:
            for base in dict.fromkeys(bases):
                nursery.start_soon(ask, base)
    problems = [answer for answer in answers.values() if isinstance(answer, str)]
    if problems:
        raise InitError(problems)
    return [answer for base in dict.fromkeys(bases) if isinstance(answer := answers[base], EngineReport)]


async def _ask(client: httpx.AsyncClient, base: str, keyed: bool) -> EngineReport | str:
    """The engine's report, or the line saying why there is none."""
    try:
        async with client.stream("GET", f"{base}/v1/models") as response:
            body = bytearray()
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > _MODELS_BODY_LIMIT:
                    return f"{base}: GET /v1/models answered more than {_MODELS_BODY_LIMIT} bytes"
            status = response.status_code
    except httpx.HTTPError as error:
        return f"{base}: cannot reach it ({type(error).__name__}: {str(error) or 'no detail'}); is vLLM running there?"
    if status == 401:
        hint = "the key in --api-key-env is not the engine's --api-key" if keyed else "it wants an API key: --api-key-env NAME"
        return f"{base}: GET /v1/models answered 401 ({hint})"
    if status != 200:
        return f"{base}: GET /v1/models answered {status}, not 200 (is it an OpenAI-compatible server?)"
    return _report(base, bytes(body))


def _report(base: str, body: bytes) -> EngineReport | str:
    """vLLM's ``{"object": "list", "data": [{"id", "max_model_len", "parent"}, ...]}`` read, or why not."""
    try:
        document = json.loads(body)
    except ValueError:
        return f"{base}: GET /v1/models answered something other than JSON"
    data = document.get("data") if isinstance(document, dict) else None
    cards = [card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str) and card["id"]] if isinstance(data, list) else []
    if not cards:
        return f"{base}: GET /v1/models named no model"
    cards.sort(key=lambda card: card.get("parent") is not None)  # stable: base models first, in order
    lens = [n for card in cards if isinstance(n := card.get("max_model_len"), int) and not isinstance(n, bool) and n > 0]
    return EngineReport(base, tuple(dict.fromkeys(card["id"] for card in cards)), min(lens) if lens else None)


def starting_config(
    reports: Sequence[EngineReport],
    *,
    max_concurrency: int,
    api_key_env: str | None,
    environ: Mapping[str, str] | None = None,
    assumed: bool = False,
) -> str:
    """The commented config.toml for these engines, checked to load (``environ`` resolves ``api_key_env``).

    ``assumed``: ``max_concurrency`` is a default, not the engines' ``--max-num-seqs``; the file says so.

    Raises :exc:`InitError` when the engines do not serve the same models:
    every engine of a pool must serve every model of it.
    """
    first = reports[0]
    different = [report for report in reports if set(report.models) != set(first.models)]
    if different:
        served = "; ".join(f"{report.url} serves {', '.join(report.models)}" for report in reports)
        raise InitError([f"the engines serve different models ({served}): the engines of one pool must serve the same;"
                         " run init for each group and put their pools in one file"])
    text = _render(reports, max_concurrency=max_concurrency, api_key_env=api_key_env, assumed=assumed)
    try:
        parse_config(text, source="the generated config", environ=environ)
    except ConfigError as error:  # a bug here, or values no config can hold (a context of 1 token)
        raise InitError([f"the config for what the engines report would not load:\n{error}"]) from None
    return text


# The two classes init writes, in match order, both on the one pool.
_CLASSES = (
    "# Classes, in match order: a request falls in the first whose thresholds",
    "# admit it; the last takes the rest. Both use the one pool, and in its queue",
    "# the earlier class goes first (priority: its place in this file).",
    "[classes.interactive]",
    f'pool = "{POOL}"',
    "# A prompt of at most 500 estimated tokens and max_tokens of at most 128 (a",
    f"# request that sets none gets {LimitsConfig.default_max_tokens}, limits.default_max_tokens: batch).",
    "max_prompt_tokens = 500",
    "max_output_tokens = 128",
    "# Seconds it may wait for a seat; then 503 with Retry-After (fail fast).",
    "queue_timeout = 3.0",
    "",
    "[classes.batch]",
    "# Everything else.",
    f'pool = "{POOL}"',
    "queue_timeout = 30.0",
)


def _render(reports: Sequence[EngineReport], *, max_concurrency: int, api_key_env: str | None, assumed: bool) -> str:
    models = reports[0].models
    lens = {report.url: report.max_model_len for report in reports if report.max_model_len is not None}
    max_model_len = min(lens.values()) if lens else None
    today = datetime.date.today().isoformat()
    out = [
        f"# tailguard configuration, written by `tailguard init` on {today} from what",
        "# the engines reported in GET /v1/models. Every key left out has a default:",
        "# `tailguard check-config --config THIS_FILE` prints them all, and tailguard's",
        "# shipped config.toml documents every key. Edit this file while tailguard runs:",
        "# it is reloaded when it changes (and on SIGHUP).",
        "",
        "[server]",
        '# Where the OpenAI-compatible API listens ("0.0.0.0:8080" for every',
        '# interface). Default "127.0.0.1:8080".',
        'http_listen = "127.0.0.1:8080"',
        "",
    ]
    input_cap = LimitsConfig.input_cap_tokens
    if max_model_len is not None and max_model_len <= input_cap:
        input_cap = max(max_model_len // 2, max_model_len - LimitsConfig.output_cap_tokens)
        out += [
            "[limits]",
            "# Prompts over this many estimated tokens are refused with 400. The default,",
            f"# {LimitsConfig.input_cap_tokens}, does not fit the engines' context of {max_model_len} tokens:",
            "# this leaves room for the answer.",
            f"input_cap_tokens = {input_cap}",
            "",
        ]
    out += [
        f"[pools.{POOL}]",
        "# The served model names (vllm serve --served-model-name); the first is the",
        "# default when a request names none.",
        f"models = [{', '.join(json.dumps(model) for model in models)}]",
    ]
    if max_model_len is None:
        out += ["# max_model_len: no engine reported one; tailguard asks them again at start."]
    else:
        reported = f" ({', '.join(f'{url} {n}' for url, n in lens.items())}: the smallest)" if len(set(lens.values())) > 1 else ""
        out += [
            f"# The context length (vllm serve --max-model-len), as the engines report it{reported}.",
            "# Leave it out to have tailguard ask them at every start and reload instead.",
            f"max_model_len = {max_model_len}",
        ]
    if api_key_env is not None:
        out += [
            "# The environment variable holding the engines' key (vllm serve --api-key):",
            "# tailguard sends it to them; callers' keys stop at tailguard.",
            f"api_key_env = {json.dumps(api_key_env)}",
        ]
    if assumed:
        out += [
            f"# ASSUMED: max_concurrency = {max_concurrency} below is not read from the engines. vLLM does not",
            "# report its --max-num-seqs (not in GET /v1/models, not in /metrics), so init wrote",
            f"# vLLM's default on GPUs under 70 GiB and A100s ({DEFAULT_MAX_NUM_SEQS}; 1024 on H100s, H200s and",
            "# B200s, 128 on CPUs). Set it to each engine's vllm serve --max-num-seqs, or run",
            "# init again with --max-concurrency N: above it, requests queue unseen in vLLM;",
            "# below it, the GPUs idle.",
        ]
    else:
        out += ["# max_concurrency: each engine's vllm serve --max-num-seqs, as --max-concurrency said."]
    out += [
        "# Each engine and the requests it may run at once. Excess requests wait here,",
        "# short ones first, instead of in vLLM's first-come-first-served queue. The",
        "# pool runs at most their sum (max_concurrency) and lets 4 x that wait",
        "# (max_queue): write either key to change it.",
        "endpoints = [",
        *(f'    {{ url = "{report.url}", max_concurrency = {max_concurrency} }},' for report in reports),
        "]",
        "",
        *_CLASSES,
    ]
    return "\n".join(out) + "\n"


def write_config(text: str, path: Path, *, force: bool) -> None:
    """Write ``text`` to ``path``; an existing file only with ``force`` (else :exc:`InitError`, nothing changed)."""
    try:
        with open(path, "w" if force else "x", encoding="utf-8") as file:
            file.write(text)
    except FileExistsError:
        raise InitError([f"{path} exists; --force replaces it, or --output names another file"]) from None
    except OSError as error:
        raise InitError([f"cannot write {path}: {error.strerror or error}"]) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailguard init", description="Write a starting config.toml from what the engines report in GET /v1/models.")
    add = parser.add_argument
    add("--endpoint", action="append", required=True, metavar="URL", help="an engine's base URL, e.g. http://vllm-0:8000 (repeat for each)")
    add("--output", type=Path, default=Path("config.toml"), metavar="PATH", help="where to write the config (default: %(default)s)")
    add("--force", action="store_true", help="replace the output file if it exists")
    add("--api-key-env", default=None, metavar="NAME", help="the environment variable holding the engines' --api-key")
    add("--max-concurrency", type=int, default=None, metavar="N",
        help=f"each engine's vllm serve --max-num-seqs, which vLLM does not report (left out: {DEFAULT_MAX_NUM_SEQS},"
             " vLLM's default on GPUs under 70 GiB, written and marked ASSUMED; 1024 on H100/H200, 128 on CPUs)")
    add("--timeout", type=float, default=10.0, metavar="SECONDS", help="how long each engine has to answer (default: %(default)g)")
    return parser


def main(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None) -> int:
    """Ask, render, write; every failure is one ``tailguard init:`` message and exit status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    assumed = args.max_concurrency is None
    seats = DEFAULT_MAX_NUM_SEQS if assumed else args.max_concurrency
    if seats < 1 or args.timeout <= 0:
        parser.error("--max-concurrency must be at least 1 and --timeout positive")
    api_key = None
    if args.api_key_env is not None:
        if not _ENV_NAME.fullmatch(args.api_key_env):
            parser.error(f"--api-key-env must name an environment variable, got {args.api_key_env!r}")
        api_key = environ.get(args.api_key_env)
        if api_key is None:
            parser.error(f"--api-key-env {args.api_key_env}: that variable is not set")
        api_key = api_key.strip()
    try:
        reports = trio.run(lambda: ask_engines(args.endpoint, api_key=api_key, timeout=args.timeout))
        text = starting_config(reports, max_concurrency=seats, api_key_env=args.api_key_env, environ=environ, assumed=assumed)
        write_config(text, args.output, force=args.force)
    except InitError as error:
        print("tailguard init: nothing written\n" + "\n".join(f"  {line}" for line in error.problems), file=sys.stderr)
        return 2
    lens = sorted({report.max_model_len for report in reports if report.max_model_len is not None})
    print(
        f"wrote {args.output}: pool {POOL}, {len(reports)} engine{'s' if len(reports) != 1 else ''},"
        f" models {', '.join(reports[0].models)}, max_model_len {lens[0] if lens else 'not reported'}\n"
        + (
            f"max_concurrency {seats} per engine ASSUMED: vLLM does not report its --max-num-seqs;"
            f" set it in {args.output}, or run init with --max-concurrency N\n"
            if assumed
            else f"max_concurrency {seats} per engine, as --max-concurrency said\n"
        )
        + f"check it: tailguard check-config --config {args.output}\n"
        f"run it:   tailguard serve --config {args.output}"
    )
    return 0
