"""``docs/limits.md``: the caller-facing limits, rendered from the code so they cannot drift.

Regenerate it with::

    python -m bench.tools.limits_doc [config.toml] > docs/limits.md

``tests/docs/test_docs.py`` fails when the committed file differs from the
rendering of the shipped ``config.toml``. The facts come from
``router.config.caller_limits.limits_of`` (what ``GET /v1/limits`` serves); every
status, error code, gRPC status and ``Retry-After`` value comes from the
error table (``router/error_spec.py``, rendered by ``server.errors_map``)
applied to the router's own error classes, so a change to the config, to the
limits document or to the error table shows up here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tailguard.router import error_spec, errors
from tailguard.router.config import ClassLimits, Config, ConfigError, Limits, limits_of, load_config
from tailguard.server import SHIPPED_CONFIG
from tailguard.server.errors_map import HttpError, http_error

REGENERATE = "python -m bench.tools.limits_doc config.toml > docs/limits.md"

# Error classes a caller never sees under their own status: a backend's 4xx is
# passed through as it came (documented as its own row).
_PASSED_THROUGH = (errors.BackendRejected,)


@dataclass(frozen=True)
class _Row:
    """One line of the error table."""

    http: str  # the status an HTTP caller sees
    error: HttpError
    grpc: str
    when: str
    advice: str
    hint: str  # its Retry-After, in words where it is computed


def http_status_shown(cls: type[errors.TailguardError]) -> str | None:
    """What the HTTP column says for ``cls`` when it is not a plain status (the README's table agrees)."""
    if issubclass(cls, errors.BackendStreamError):
        return "in stream"  # the backend's own error event, already relayed, ends the stream
    return None


# -- formatting ---------------------------------------------------------------


def _n(value: int) -> str:
    return f"{value:,}"


def _s(seconds: float) -> str:
    return f"{seconds:g} s"


def _bytes(size: int) -> str:
    if size % 2**20 == 0:
        return f"{size // 2**20} MiB ({_n(size)} bytes)"
    if size % 2**10 == 0:
        return f"{size // 2**10} KiB ({_n(size)} bytes)"
    return f"{_n(size)} bytes"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return lines


def _threshold(value: int | None) -> str:
    return "any" if value is None else f"≤ {_n(value)}"


def _names(names: Sequence[str]) -> str:
    quoted = [f"`{name}`" for name in names]
    if len(quoted) <= 1:
        return "".join(quoted)
    return ", ".join(quoted[:-1]) + " and " + quoted[-1]


# -- the error table ------------------------------------------------------------


def documented_error_classes() -> list[type[errors.TailguardError]]:
    """Every router error a caller can receive under its own row, in the error table's order.

    Read from ``router/error_spec.py``, so an error added there appears in the
    document without editing this module.
    """
    return [
        spec.error for spec in error_spec.SPECS if spec.error not in error_spec.BASES and not issubclass(spec.error, _PASSED_THROUGH)
    ]


def _instance(cls: type[errors.TailguardError], config: Config) -> errors.TailguardError:
    """An instance as the router raises it: errors with a retry hint carry the configured one."""
    if issubclass(cls, (errors.Overloaded, errors.BackendUnavailable, errors.BadBackendReply)):
        return cls("example", retry_after=config.timeouts.retry_after)
    return cls("example")


_RETRY = "retry after `Retry-After` seconds, with backoff and jitter, at most twice"


def _when_and_advice(cls: type[errors.TailguardError], doc: Limits) -> tuple[str, str]:
    """Caller-facing words for an error class; unknown classes fall back to their docstring."""
    known = _known_errors(doc)
    if cls.__name__ in known:
        return known[cls.__name__]
    summary = (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")
    return summary, _RETRY if issubclass(cls, errors.Overloaded) else "see the error message"


def _known_errors(doc: Limits) -> dict[str, tuple[str, str]]:
    """(when, what to do) by error class name, in this config's numbers."""
    input_cap = _n(doc.input_cap_tokens)
    output_cap = _n(doc.output_cap_tokens)
    deadlines = ", ".join(f"{k.name} {_s(k.queue_timeout)}" for k in doc.classes)
    retry = _RETRY
    return {
        "InvalidRequest": (
            "malformed JSON, a field of the wrong type, no messages, max_tokens < 1, an unknown class",
            "fix the request; the same request fails again",
        ),
        "PromptTooLong": (
            f"the prompt is estimated above {input_cap} tokens, or prompt + max_tokens exceeds the model's context",
            "shorten or split the prompt, or lower max_tokens; never retry as is",
        ),
        "MaxTokensTooLarge": (
            f"max_tokens above {output_cap}, when over-cap requests are rejected"
            + (" (this deployment clamps instead: never sent)" if doc.over_cap == "clamp" else ""),
            f"ask for at most {output_cap} tokens",
        ),
        "ModelNotFound": ("`model` names no model a pool serves", "use a model from `GET /v1/models`"),
        "Unauthenticated": (
            "missing or unknown API key, when the deployment requires keys",
            "send `Authorization: Bearer <key>`",
        ),
        "Forbidden": (
            "`x-tailguard-class` sent by a caller that may not force a class",
            "leave the class to tailguard",
        ),
        "QueueFull": (
            "the pool's wait queue is full, or a request served before this one (more urgent, or its caller"
            " further within its fair share) displaced it",
            retry,
        ),
        "QueueTimeout": (
            f"no seat freed within the class's queue deadline ({deadlines}; sooner for a request whose predicted service would end past the class's e2e objective), or none expected within it "
            "(refused at arrival under sustained overload)",
            retry,
        ),
        "NoBackend": ("the pool has no healthy GPU endpoint", retry),
        "CallerOverLimit": ("your API key already has its maximum number of requests in flight", retry),
        "BudgetExceeded": (
            "your API key's `tokens_per_minute` (its requests' prompts and max_tokens, settled to what they used) or"
            " `requests_per_minute` would be over for the last 60 s; a request over the whole token budget is a 400 instead",
            "retry after `Retry-After` seconds, when the window holds the request (the `x-ratelimit-*` headers"
            " of every answer to a budgeted key say what is left), or ask for fewer max_tokens",
        ),
        "Draining": ("this tailguard instance is shutting down", retry + " (the retry reaches another instance)"),
        "DeadlineExceeded": (
            f"the request ran past the {_s(doc.end_to_end_timeout)} end-to-end deadline; "
            "the generation was aborted",
            "don't retry as is: ask for fewer tokens or split the work",
        ),
        "BodyTooLarge": (
            f"the HTTP request body is over {_bytes(doc.max_body_bytes)}; refused before it is read "
            "(gRPC: a message over grpc's own limit)",
            "send less",
        ),
        "ServerBusy": ("this instance has its maximum of calls open, or sheds a caller whose calls are mostly refused (gRPC)", retry),
        "InternalError": (
            "a bug inside tailguard; it is logged with its traceback under the request id",
            "report it with the `x-request-id`; retrying the same request will likely fail the same way",
        ),
    } | _backend_errors()


def _backend_errors() -> dict[str, tuple[str, str]]:
    """(when, what to do) for the failures of the GPU servers behind tailguard."""
    retry = _RETRY
    return {
        "BackendUnavailable": (
            "the GPU server answered 5xx, broke the connection or could not be reached (after one retry on "
            "another endpoint when the failure came before any answer)",
            retry,
        ),
        "BackendTimeout": ("the GPU server sent no first byte within its pool's time-to-first-byte limit", retry),
        "BackendBusy": (
            "the GPU server's own queue is full (vLLM's 503, --max-num-queued-reqs) on every endpoint with a free "
            "seat, and your queue deadline passed while it was refused (until then the request waits in tailguard's "
            "queue); vLLM 0.32 sends no retry hint: this one is tailguard's",
            retry,
        ),
        "BackendAuthFailed": (
            "the GPU server refused tailguard's own key (401/403: the pool's api_key_env is missing or wrong); "
            "your key never reaches it",
            "don't retry: tell the operator (the endpoint is down on `/health`, with the reason)",
        ),
        "BadBackendReply": (
            "the GPU server answered something that is not a valid completion: a redirect, not the expected "
            "JSON or SSE, a stream cut before its end, a body over its cap, a broken encoding",
            retry,
        ),
        "BackendStreamError": (
            "the GPU server reported an error inside a stream that had begun; HTTP callers get its own "
            '`data: {"error": ...}` event as the last one, gRPC callers this status',
            "retry if the partial answer is of no use",
        ),
    }


def _error_rows(config: Config, doc: Limits) -> list[_Row]:
    rows = []
    for cls in documented_error_classes():
        error = _instance(cls, config)
        when, advice = _when_and_advice(cls, doc)
        rendered = http_error(error)
        shown = http_status_shown(cls) or str(rendered.status)
        rows.append(_Row(shown, rendered, error_spec.grpc_status(error), when, advice, _hint(cls, rendered)))
    return rows


# Refusals whose Retry-After is computed (router/queueing/retry_hint.py), not the configured value alone.
_COMPUTED_HINTS: dict[str, str] = {
    "QueueFull": "when a seat is expected: the queue ahead over the pool's drain rate, spread",
    "QueueTimeout": "when a seat is expected: the queue ahead over the pool's drain rate, spread",
    "NoBackend": "when an endpoint may be back: its ejection's end or the next health check, spread",
    "BudgetExceeded": "when the last minute's window holds the request, exactly",
}


def _hint(cls: type[errors.TailguardError], error: HttpError) -> str:
    """The Retry-After column: the configured value, or what a computed one is, with that value as its floor."""
    configured = _retry_after(error)
    computed = _COMPUTED_HINTS.get(cls.__name__)
    return configured if computed is None else f"{computed}; {configured} to 60 s"


def _retry_after(error: HttpError) -> str:
    values = [value.decode() for name, value in error.headers() if name == b"retry-after"]
    return f"{values[0]} s" if values else "—"


def _type_code(error: HttpError) -> str:
    body = error.body["error"]
    assert isinstance(body, dict)
    code = body.get("code")
    return f"`{body['type']}`" + (f" / `{code}`" if code else "")


# -- the document -----------------------------------------------------------------


def render_limits_markdown(config: Config) -> str:
    """The limits of ``config`` as a caller-facing Markdown page (``docs/limits.md``)."""
    doc = limits_of(config)
    rows = _error_rows(config, doc)
    out = _prompt_size(config, doc)
    out += _answer_length(doc)
    out += _classes(doc)
    out += _deadlines_and_errors(doc, rows)
    out += _retrying(rows)
    return "\n".join(out)


def _prompt_size(config: Config, doc: Limits) -> list[str]:
    """The page's head and its first section: the input cap, the estimate, the pools' contexts."""
    estimate, pools, input_cap = doc.estimate, doc.pools, doc.input_cap_tokens
    out = [
        "<!-- Generated from config.toml by bench/tools/limits_doc.py; do not edit by hand.",
        f"     Regenerate: {REGENERATE}",
        "     tests/docs/test_docs.py fails when this file is stale. -->",
        "",
        "# Limits: what tailguard accepts, and what it answers",
        "",
        "The limits below are those of the shipped `config.toml`. A running tailguard",
        "serves the ones in force as JSON at `GET /v1/limits` (gRPC: `GetLimits`);",
        "read them from there if your operator may have changed them.",
        "",
        "## Prompt size: the input cap",
        "",
        f"- A prompt estimated above **{_n(input_cap)} tokens** is refused at once with",
        "  **HTTP 400**, `code` `context_length_exceeded`. Nothing is queued and no GPU",
        "  time is spent; the same request will fail again, so shorten the prompt or",
        "  split the document.",
        "- The estimate needs no tokenizer and errs on the large side: one token per",
        f"  {estimate.chars_per_token:g} UTF-8 bytes of non-CJK text "
        f"({estimate.chars_per_token:g} ASCII characters, one emoji), one per "
        f"{estimate.cjk_chars_per_token:g} CJK character (Chinese,",
        f"  Japanese, Korean), plus {estimate.per_message_tokens} tokens per chat message and "
        f"{estimate.per_message_tokens} for the reply's turn. Tools,",
        "  tool calls and `response_format` schemas count by their JSON text.",
        *(
            [
                "- Where a model's tokenizer spends more than that on a kind of text (CJK,",
                "  digits, hex, punctuation, ...), its estimate for that kind grows once the",
                "  model's answers (`usage.prompt_tokens`) have shown it: never below the rule",
                "  above, so a prompt near a limit may be refused, or served as a longer class,",
                "  although the rule alone would have let it through.",
            ]
            if estimate.learn
            else []
        ),
        "- The prompt plus the effective `max_tokens` must also fit the model's context",
        "  (below); otherwise the answer is the same 400.",
        f"- The HTTP request body may be at most {_bytes(config.server.max_body_bytes)};",
        "  a bigger one is refused with 413 `body_too_large` before it is read.",
        "",
    ]
    out += _markdown_table(
        ["pool", "models", "context (prompt + max_tokens)"],
        [
            (f"`{p.name}`", ", ".join(f"`{m}`" for m in p.models), f"{_n(p.max_model_len)} tokens")
            for p in pools
        ],
    )
    return out


def _answer_length(doc: Limits) -> list[str]:
    """``max_tokens``: the default, the cap and what happens above it."""
    default_max, output_cap, over_cap = doc.default_max_tokens, doc.output_cap_tokens, doc.over_cap
    out = [
        "",
        "## Answer length: max_tokens",
        "",
        f"- **Always send `max_tokens`.** Without it a request gets **{_n(default_max)}**.",
        f"- The most a request may ask for is **{_n(output_cap)}**. Above it the request is",
    ]
    if over_cap == "clamp":
        out += [
            f"  **clamped**: served with `max_tokens` = {_n(output_cap)}, not refused.",
        ]
    else:
        out += [
            "  **rejected**: HTTP 400, `code` `max_tokens_too_large`.",
        ]
    out += [
        f"- `n` (choices) is at most **{doc.max_n}**. Each choice is a sequence of its own on",
        "  the engine: the request takes `n` seats, and `n` x `max_tokens` counts as its",
        "  answer length for its class and against a token budget.",
        "- The response reports the effective value in the `x-tailguard-max-tokens`",
        "  header (gRPC: metadata and `Routing.max_tokens`), and the class it fell in",
        "  in `x-tailguard-class`.",
        "",
        "## Classes: which requests are fast",
        "",
        "A request falls in the **first** class below whose thresholds both admit it:",
        "estimated prompt tokens and effective `max_tokens` (its own, or the default",
        "when it sets none, after the cap). Each class is served by its own pool and",
        "may wait for a seat at most its queue deadline; a lower priority number is",
        "served first where classes share a pool.",
        "",
    ]
    return out


def _classes(doc: Limits) -> list[str]:
    """The class table, and which classes a request without ``max_tokens`` never reaches."""
    classes = doc.classes
    out = _markdown_table(
        ["class", "prompt (estimated tokens)", "max_tokens", "pool", "queue deadline", "priority"],
        [
            (
                f"`{k.name}`",
                _threshold(k.max_prompt_tokens),
                _threshold(k.max_output_tokens),
                f"`{k.pool}`",
                _s(k.queue_timeout),
                str(k.priority),
            )
            for k in classes
        ],
    )
    out.append("")
    out += _default_max_tokens_note(classes, doc.default_max_tokens, doc.output_cap_tokens)
    out += ["What each class is promised (its objective; `attainment` in `GET /v1/limits` says how it is doing):", ""]
    out += _markdown_table(
        ["class", "first token within", "per output token", "end within", "requests that must meet it", "share of output tokens"],
        [
            (
                f"`{k.name}`",
                "-" if k.objective.ttft is None else _s(k.objective.ttft),
                "-" if k.objective.itl is None else _s(k.objective.itl),
                _s(k.objective.e2e),
                f"{k.objective.percentile:g}%",
                f"{k.objective.throughput_share:g}" if k.objective.throughput_share else "-",
            )
            for k in classes
        ],
    )
    out.append("")
    return out


def _deadlines_and_errors(doc: Limits, rows: Sequence[_Row]) -> list[str]:
    """The end-to-end and queue deadlines, then the error table."""
    e2e = doc.end_to_end_timeout
    out = [
        "## Deadlines",
        "",
        f"- **End to end: {_s(e2e)}** from arrival to the last token, queueing included.",
        "  Past it the request is cancelled (the GPU stops generating) and the caller",
        "  gets HTTP 504 `deadline_exceeded`; in a stream that already began, the error",
        '  arrives as a last `data: {"error": ...}` event. A gRPC caller\'s own, shorter',
        "  deadline wins.",
        "- **Queueing**: when a pool is busy a request waits in line, ordered by class",
        "  priority, then by callers' fair shares of the tokens served (each caller's own in arrival",
        "  order), at most its class's queue deadline, then gets 503",
        "  `queue_timeout` -- at once when the pool's measured drain rate says no seat",
        "  would come in time. A full queue answers 429 `queue_full` at once.",
        f"- Set your client's timeout **above {_s(e2e)}** (and above any proxy's), so you",
        "  receive tailguard's answer instead of cutting it off.",
        "",
        "## Errors, and what to do",
        "",
        "Every HTTP error body has OpenAI's shape, `{\"error\": {\"message\", \"type\",",
        "\"param\", \"code\"}}`. An HTTP hint is `Retry-After` (whole seconds, rounded up) and",
        "`retry-after-ms` (the same hint to the millisecond, which the openai SDK reads first); gRPC",
        "carries them as `retry-after` (seconds) and `grpc-retry-pushback-ms` in the trailing metadata.",
        "",
    ]
    out += _markdown_table(
        ["HTTP", "`type` / `code`", "gRPC", "Retry-After", "when", "what to do"],
        [
            (r.http, _type_code(r.error), r.grpc, r.hint, r.when, r.advice)
            for r in rows
        ]
        + [("4xx", "vLLM's own", "INVALID_ARGUMENT etc.", "—", "vLLM refused the request; passed through as it came", "fix the request")],
    )
    return out


def _retrying(rows: Sequence[_Row]) -> list[str]:
    """When and how to retry, with this config's overload hint."""
    overload_hint = next((_retry_after(r.error) for r in rows if r.error.status == 429), "—")
    out = [
        "",
        "## Retrying",
        "",
        "- Retry only answers that carry `Retry-After`, and wait at least that long",
        f"  ({overload_hint} under this config), with exponential backoff and random jitter; at most",
        "  **two retries**. Never retry another 4xx, and not a 504 as is.",
        "- Send an `X-Request-Id` (1 to 128 printable ASCII characters, no spaces) and",
        "  reuse it on every retry of the same request: tailguard counts repeated ids",
        "  to spot retry storms. Never reuse an id for a different request.",
        "- Reuse one HTTP client (its connection pool) for all requests.",
        "",
    ]
    return out


def _default_max_tokens_note(classes: Sequence[ClassLimits], default_max: int, output_cap: int) -> list[str]:
    """Say which classes a request without max_tokens can never reach, and how to reach them."""
    effective = min(default_max, output_cap)
    unreachable = [k for k in classes if (limit := k.max_output_tokens) is not None and effective > limit]
    if not unreachable:
        return []
    lines = [
        f"**A request without `max_tokens` gets {_n(default_max)}, so it can never be in "
        f"{_names([k.name for k in unreachable])}.**",
    ]
    for klass in unreachable:
        prompt_limit, output_limit = klass.max_prompt_tokens, klass.max_output_tokens or 0
        condition = f"set `max_tokens` ≤ {_n(output_limit)}"
        if prompt_limit is not None:
            condition += f" and keep the prompt ≤ {_n(prompt_limit)} estimated tokens"
        lines.append(f"To be served as `{klass.name}`, {condition}.")
    lines.append("An unbounded answer is not an interactive request.")
    return [" ".join(lines), ""]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.tools.limits_doc [config.toml]``: print the page to stdout."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 or any(arg.startswith("-") for arg in args):
        print(f"usage: {REGENERATE}", file=sys.stderr)
        return 2
    path = Path(args[0]) if args else SHIPPED_CONFIG
    try:
        config = load_config(path)
    except (ConfigError, OSError) as error:
        print(f"{path}: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render_limits_markdown(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
