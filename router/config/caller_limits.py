"""The caller-facing limits document: chosen once here, served by ``GET /v1/limits``, gRPC ``GetLimits`` and docs/limits.md.

Callers size their requests from it (and learn that ``max_tokens`` must be
set to land in a fast class); endpoint URLs are internal and left out.
:func:`limits_of` picks the facts, typed; :func:`limits_document` is their
JSON shape, and the gRPC front end builds its protobuf from the same record,
so the wires cannot tell different stories.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .types import Config, OverCapMode

__all__ = ["ClassLimits", "EstimateRule", "Limits", "ObjectiveLimits", "PoolLimits", "limits_document", "limits_of"]


@dataclass(frozen=True)
class EstimateRule:
    """How a prompt's size is estimated without a tokenizer, and whether each model's engines correct it."""

    chars_per_token: float
    cjk_chars_per_token: float
    per_message_tokens: int
    learn: bool  # each model's estimate is raised by the real/estimated ratio its engines' usage taught, per kind of text


@dataclass(frozen=True)
class ObjectiveLimits:
    """What the class is promised (docs/objectives.md): seconds, None where it has no such target."""

    ttft: float | None
    itl: float | None
    e2e: float
    percentile: float
    throughput_share: float


@dataclass(frozen=True)
class ClassLimits:
    """What decides a request's class, how long it may wait there, and what the class is promised."""

    name: str
    max_prompt_tokens: int | None
    max_output_tokens: int | None
    queue_timeout: float
    priority: int
    pool: str
    objective: ObjectiveLimits


@dataclass(frozen=True)
class PoolLimits:
    """A pool as a caller sees it: its context length and the models it serves."""

    name: str
    max_model_len: int
    models: tuple[str, ...]


@dataclass(frozen=True)
class Limits:
    """Every fact of the limits document, in the document's order."""

    input_cap_tokens: int
    default_max_tokens: int
    output_cap_tokens: int
    over_cap: OverCapMode
    max_n: int
    estimate: EstimateRule
    end_to_end_timeout: float
    classes: tuple[ClassLimits, ...]
    pools: tuple[PoolLimits, ...]
    max_body_bytes: int
    retry_after: float
    auth_required: bool


def limits_of(config: Config) -> Limits:
    """The limits in force under ``config``."""
    limits = config.limits
    return Limits(
        input_cap_tokens=limits.input_cap_tokens,
        default_max_tokens=limits.default_max_tokens,
        output_cap_tokens=limits.output_cap_tokens,
        over_cap=limits.over_cap,
        max_n=limits.max_n,
        estimate=EstimateRule(
            config.estimate.chars_per_token, config.estimate.cjk_chars_per_token, config.estimate.per_message_tokens, config.estimate.learn
        ),
        end_to_end_timeout=config.timeouts.end_to_end_timeout,
        classes=tuple(
            ClassLimits(
                name=klass.name,
                max_prompt_tokens=klass.max_prompt_tokens,
                max_output_tokens=klass.max_output_tokens,
                queue_timeout=klass.queue_timeout,
                priority=klass.priority,
                pool=klass.pool,
                objective=ObjectiveLimits(
                    klass.objective.ttft, klass.objective.itl, klass.objective.e2e, klass.objective.percentile, klass.objective.throughput_share
                ),
            )
            for klass in config.classes
        ),
        pools=tuple(PoolLimits(pool.name, pool.max_model_len, pool.models) for pool in config.pools),
        max_body_bytes=config.server.max_body_bytes,
        retry_after=config.timeouts.retry_after,
        auth_required=config.auth.enabled,
    )


def limits_document(config: Config) -> dict[str, object]:
    """:func:`limits_of` as JSON-shaped data (tuples as lists): ``GET /v1/limits``."""
    document = _plain(dataclasses.asdict(limits_of(config)))
    assert isinstance(document, dict)
    return document


def _plain(value: object) -> object:
    """``value`` with every tuple a list, as JSON reads back."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
