"""Read ``config.toml`` into the frozen objects of :mod:`router.config.types`.

The reader is written by hand rather than with a schema library because of
three promises to the operator: every problem names its dotted key
(``pools.batch.endpoints[1].max_concurrency``); an unknown key is refused (a
typo silently ignored is a cap silently not applied); and all problems come
out together, so one edit fixes the file. Parsing and validating are one pass:
each table is read through a :class:`router.config.table.Table` that collects
problems instead of raising, and a cross check runs only when the values it
compares are valid, so one mistake is reported once.

This is the entry module; the work is done by job: the table reader
(``table``), the process-wide sections (``sections``), the pools and
classes (``pools``), API keys (``keys``), the operator's rendering
(``render``) and the callers' limits document (``caller_limits``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence

import tomli

from .caller_limits import limits_document
from .keys import hash_key, read_auth
from .pools import check_pool_references, max_model_len_problem, read_classes, read_pools
from .render import render_config
from .sections import (
    read_cluster,
    read_discovery,
    read_estimate,
    read_limits,
    read_logging,
    read_metrics,
    read_rebalance,
    read_server,
    read_timeouts,
    read_tracing,
)
from .table import Table
from .types import AuthConfig, Config, PoolConfig, TimeoutsConfig

__all__ = [
    "ConfigError",
    "limits_document",
    "load_config",
    "max_model_len_problem",
    "parse_config",
    "render_config",
]


class ConfigError(Exception):
    """The configuration was refused; ``problems`` has one line per problem.

    Each line starts with the dotted key it is about, so an operator can find
    it in the file; ``str()`` lists them all under the source's name.
    """

    def __init__(self, problems: Iterable[str], *, source: str = "<string>") -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        self.source = source
        count = len(self.problems)
        header = f"{source}: configuration refused, {count} problem{'s' if count != 1 else ''}:"
        super().__init__("\n".join([header, *(f"  {line}" for line in self.problems)]))


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Config:
    """Read and validate the configuration file at ``path``.

    ``environ`` (default ``os.environ``) resolves ``key_env`` and
    ``keys_file_env``, as in :func:`parse_config`. Raises :exc:`ConfigError`
    if the file cannot be read, is not UTF-8 TOML, or fails validation.
    """
    source = os.fspath(path)
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise ConfigError([f"cannot read the file: {exc.strerror or exc}"], source=source) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"not UTF-8 text: {exc}"], source=source) from exc
    return parse_config(text, source=source, environ=environ)


def parse_config(
    text: str, *, source: str = "<string>", environ: Mapping[str, str] | None = None
) -> Config:
    """Parse and validate TOML ``text``; ``source`` names it in error messages.

    API keys named by environment variable (``key_env``) and the keys file
    (``keys_file_env``) are resolved now, from ``environ`` (default
    ``os.environ``), so a missing secret stops the load rather than a request.
    Raises :exc:`ConfigError` listing every problem found; no problem quotes a
    key or a value that might be one.
    """
    environ = os.environ if environ is None else environ
    try:
        document = tomli.loads(text)
    except tomli.TOMLDecodeError as exc:
        raise ConfigError([f"invalid TOML: {exc}"], source=source) from exc
    problems: list[str] = []
    root = Table(document, "", problems)
    server = read_server(root.table("server"))
    estimate = read_estimate(root.table("estimate"))
    limits_table, timeouts_table = root.table("limits"), root.table("timeouts")
    limits = read_limits(limits_table)
    timeouts = read_timeouts(timeouts_table)
    # Cross checks use a value only if it was valid, so one mistake is one problem.
    input_cap = limits.input_cap_tokens if limits_table.ok("input_cap_tokens") else None
    end_to_end = timeouts.end_to_end_timeout if timeouts_table.ok("end_to_end_timeout") else None
    pool_tables = root.children("pools", noun="pool")
    pools = read_pools(pool_tables, input_cap, environ)
    class_tables = root.children("classes", noun="class")
    classes = read_classes(class_tables, [name for name, _ in pool_tables], end_to_end)
    check_pool_references(pools, classes, dict(pool_tables))
    auth_table = root.table("auth")
    auth = read_auth(
        auth_table,
        present=root.has("auth") and root.ok("auth"),
        class_names=[name for name, _ in class_tables],
        environ=environ,
    )
    logging_config = read_logging(root.table("logging"))
    metrics = read_metrics(root.table("metrics"), environ)
    rebalance = read_rebalance(root.table("rebalance"))
    cluster = read_cluster(root.table("cluster"), present=root.has("cluster"))
    budgeted = [k.name for k in auth.keys if k.tokens_per_minute or k.requests_per_minute]
    if limits.anonymous_tokens_per_minute or limits.anonymous_requests_per_minute:
        budgeted.append("anonymous")
    if cluster is not None and cluster.static_share <= 0 and budgeted:
        root.table("cluster").report(
            "cluster.static_share",
            f"must be above 0 while callers have budgets ({', '.join(budgeted)}): each replica keeps that share of them",
        )
    if cluster is not None and rebalance.seat_step < 1:
        root.table("rebalance").report(
            "rebalance.seat_step",
            f"must be 1 under [cluster], got {rebalance.seat_step:g}: an engine's seats split between pools are not shared"
            " through the ledger (each replica would cap its share alone), so move whole engines there",
        )
    discovery = read_discovery(root.table("discovery"))
    tracing = read_tracing(root.table("tracing"))
    root.finish()
    if problems:
        raise ConfigError(problems, source=source)
    return Config(
        server=server,
        estimate=estimate,
        limits=limits,
        timeouts=timeouts,
        pools=pools,
        classes=classes,
        digest=_digest(text, auth, pools, metrics.token_sha256),
        auth=auth,
        logging=logging_config,
        metrics=metrics,
        rebalance=rebalance,
        cluster=cluster,
        discovery=discovery,
        tracing=tracing,
        warnings=_warnings(timeouts),
    )


def _digest(text: str, auth: AuthConfig, pools: Sequence[PoolConfig] = (), metrics_token: str | None = None) -> str:
    """A short hash of the text and of the keys it resolved from outside itself.

    The keys go in as their digests, names and rights (never a key, and not the
    keys file's text), so rotating a key in the keys file or the environment
    changes the digest and a reload applies it; the backend keys
    (``api_key_env``) and the /metrics token (``metrics.token_env``) likewise,
    as their digests. Without any this is the hash of the text alone.
    """
    digest = hashlib.sha256(text.encode("utf-8"))
    for key in auth.keys:
        classes = ",".join(sorted(key.may_force_classes))
        digest.update(f"\0{key.name}\0{key.sha256}\0{classes}\0{key.max_concurrency}".encode())
    for pool in pools:
        for access in {pool.access, *(e.access for e in pool.endpoints), *(s.access for s in pool.endpoints_dns)}:
            if access.api_key is not None:
                digest.update(f"\0{pool.name}\0{access.api_key_env}\0{hash_key(access.api_key)}".encode())
    if metrics_token is not None:
        digest.update(f"\0metrics\0{metrics_token}".encode())
    return digest.hexdigest()[:16]


def _warnings(timeouts: TimeoutsConfig) -> tuple[str, ...]:
    """Settings that tailguard can run with but that will hurt, and what to change."""
    warnings: list[str] = []
    front, end_to_end = timeouts.front_proxy_timeout, timeouts.end_to_end_timeout
    if front is not None and front <= end_to_end:
        warnings.append(
            f"timeouts.front_proxy_timeout ({front:g} s) is not above"
            f" timeouts.end_to_end_timeout ({end_to_end:g} s): the proxy in front would cut off"
            " requests tailguard is still serving (and hide its 504); raise the proxy's read"
            f" timeout (nginx proxy_read_timeout) above {end_to_end:g} s"
        )
    return tuple(warnings)
