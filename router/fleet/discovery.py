"""Endpoints from DNS: each pool's ``endpoints_dns`` names, resolved again and again.

A Kubernetes headless Service answers its name with one A (or AAAA) record
per ready pod. Every ``[discovery] interval`` seconds, and at once after a
reload, each name is resolved for A and AAAA records with dnspython's async
resolver (it runs under Trio, found through sniffio; the backend is named
here all the same). Each pool's whole DNS-derived set then goes to
``replace_discovered`` (``Router``), which applies the difference the way a
reload does: a new address becomes an endpoint, a vanished one retires (its
running requests finish and still count against its cap).

A name whose answer fails (timeout, SERVFAIL, refused, no resolver
configuration) or is empty (NXDOMAIN, no records) keeps its last good set,
and the change of state is logged: a DNS outage never empties a pool. A pod
that went away meanwhile fails its health checks instead. So scaling a
Service to zero leaves its last addresses in the pool, marked down.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import dns.asyncbackend
import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver
import trio

from ..config import Config, DiscoveryConfig, DnsEndpointsConfig

__all__ = ["Discovery", "DiscoveryStatistics", "Found", "NameStatistics", "resolve_once"]

log = logging.getLogger("tailguard.discovery")

# One address of one ``endpoints_dns`` entry: the endpoint ``source.endpoint(address)``.
Found = tuple[DnsEndpointsConfig, str]

_RECORD_TYPES = (dns.rdatatype.A, dns.rdatatype.AAAA)


class DiscoveryTarget(Protocol):
    """What discovery feeds: the router (``router.dispatch.Router``)."""

    @property
    def config(self) -> Config: ...

    def replace_discovered(self, pool: str, found: Sequence[Found]) -> None: ...


@dataclass(frozen=True)
class NameStatistics:
    """One pool's DNS name as discovery sees it."""

    addresses: tuple[str, ...]  # the last good answer: the pool's endpoints from this name
    answers: int  # resolutions that gave addresses
    failures: int  # resolutions that failed or gave none (the last set was kept)
    failing: bool  # the latest resolution was one of those


@dataclass(frozen=True)
class DiscoveryStatistics:
    turns: int  # rounds of resolution done
    names: dict[str, NameStatistics]  # "pool/name:port" -> its state


@dataclass
class _Name:
    addresses: tuple[str, ...] = ()
    answers: int = 0
    failures: int = 0
    failing: bool = False


class _Failed(Exception):
    """A resolution that gave no usable answer; the message says why."""


class Discovery:
    """Resolves every pool's ``endpoints_dns`` in rounds and hands the results to the router."""

    def __init__(self, target: DiscoveryTarget) -> None:
        self._target = target
        self._names: dict[tuple[str, tuple[str, int, str]], _Name] = {}
        self._wanted = trio.Event()
        self._resolver: tuple[DiscoveryConfig, dns.asyncresolver.Resolver] | None = None
        self._turns = 0

    def wake(self) -> None:
        """Resolve again now, not at the next interval (a reload calls this)."""
        self._wanted.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Rounds forever: the first before ``started``, then every interval or when woken.

        A round that fails is logged and the loop goes on, as the router's other loops do.
        """
        started = False
        while True:
            self._wanted = trio.Event()  # a wake from now on asks for one more round
            try:
                await self.turn()
            except Exception:
                log.exception("a DNS discovery round failed; the pools keep their endpoints")
            if not started:
                task_status.started()
                started = True
            with trio.move_on_after(self._target.config.discovery.interval):
                await self._wanted.wait()

    async def turn(self) -> None:
        """One round: resolve every name at once, then give each pool its set."""
        config = self._target.config
        sources = [(pool.name, source) for pool in config.pools for source in pool.endpoints_dns]
        if sources:
            answers: dict[tuple[str, tuple[str, int, str]], tuple[str, ...] | _Failed] = {}
            try:
                resolver = await self._resolver_for(config.discovery)
            except dns.exception.DNSException as error:  # no /etc/resolv.conf, or a broken one
                failure = _Failed(f"no resolver: {error}")
                answers = {(pool, source.key): failure for pool, source in sources}
            else:

                async def resolve(pool: str, source: DnsEndpointsConfig) -> None:
                    try:
                        answers[(pool, source.key)] = await _resolve(resolver, source.name, config.discovery)
                    except _Failed as error:
                        answers[(pool, source.key)] = error

                async with trio.open_nursery() as nursery:
                    for pool, source in sources:
                        nursery.start_soon(resolve, pool, source)
            for pool, source in sources:
                self._record(pool, source, answers[(pool, source.key)])
        self._turns += 1
        self._hand_over()

    def _record(self, pool: str, source: DnsEndpointsConfig, answer: tuple[str, ...] | _Failed) -> None:
        """Keep a good answer; on a bad one keep the last set, and log each change of state."""
        state = self._names.setdefault((pool, source.key), _Name())
        where = f"pool {pool}: {source.name}"
        if isinstance(answer, tuple) and answer:
            if state.failing:
                log.info("%s answers again: %d addresses", where, len(answer))
            state.addresses, state.failing = answer, False
            state.answers += 1
            return
        why = "no address" if isinstance(answer, tuple) else str(answer)
        state.failures += 1
        if not state.failing:
            log.warning("%s: %s; keeping its last %d addresses", where, why, len(state.addresses))
        state.failing = True

    def _hand_over(self) -> None:
        """Each pool's addresses, under the config as it is now (a reload may have come meanwhile)."""
        config = self._target.config
        present = {(pool.name, source.key) for pool in config.pools for source in pool.endpoints_dns}
        self._names = {key: state for key, state in self._names.items() if key in present}
        for pool in config.pools:
            found: list[Found] = []
            for source in pool.endpoints_dns:
                state = self._names.get((pool.name, source.key))
                found += [(source, address) for address in (state.addresses if state else ())]
            self._target.replace_discovered(pool.name, found)

    async def _resolver_for(self, config: DiscoveryConfig) -> dns.asyncresolver.Resolver:
        """A resolver for ``[discovery]``, made again only when that table changes."""
        if self._resolver is not None and self._resolver[0] == config:
            return self._resolver[1]
        resolver = await _new_resolver(config)
        self._resolver = (config, resolver)
        return resolver

    def statistics(self) -> DiscoveryStatistics:
        names = {
            f"{pool}/{key[0]}:{key[1]}": NameStatistics(state.addresses, state.answers, state.failures, state.failing)
            for (pool, key), state in self._names.items()
        }
        return DiscoveryStatistics(turns=self._turns, names=names)


async def resolve_once(config: DiscoveryConfig, names: Collection[str]) -> dict[str, tuple[str, ...]]:
    """Each name's addresses now, at once; a name that fails or has none is left out.

    One round outside the loop, for start-up and reloads: router/fleet/model_len.py
    asks the engines found this way for their ``max_model_len``.
    """
    try:
        resolver = await _new_resolver(config)
    except dns.exception.DNSException as error:
        log.warning("DNS names cannot be resolved: no resolver: %s", error)
        return {}
    found: dict[str, tuple[str, ...]] = {}

    async def resolve(name: str) -> None:
        try:
            addresses = await _resolve(resolver, name, config)
        except _Failed as error:
            log.warning("%s: %s", name, error)
            return
        if addresses:
            found[name] = addresses

    async with trio.open_nursery() as nursery:
        for name in set(names):
            nursery.start_soon(resolve, name)
    return found


async def _new_resolver(config: DiscoveryConfig) -> dns.asyncresolver.Resolver:
    """A resolver as ``[discovery]`` says: the system's, or the nameserver it names."""
    if config.nameserver is None:
        # Reads /etc/resolv.conf (its search domains too): a file, so off the event loop.
        return await trio.to_thread.run_sync(dns.asyncresolver.Resolver)
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [config.nameserver]
    resolver.port = config.nameserver_port
    return resolver


async def _resolve(resolver: dns.asyncresolver.Resolver, name: str, config: DiscoveryConfig) -> tuple[str, ...]:
    """The sorted A and AAAA addresses of ``name`` (both asked at once, ``config.timeout`` for both).

    NXDOMAIN or no record is an empty answer; any other failure of either
    query raises _Failed, so half an answer never passes for the whole. The
    system's search domains apply as getaddrinfo applies them (a trailing
    dot skips them); with a nameserver of its own the name is taken as is.
    """
    search = config.nameserver is None
    backend = dns.asyncbackend.get_backend("trio")
    addresses: set[str] = set()
    failures: list[str] = []

    async def query(rdtype: dns.rdatatype.RdataType) -> None:
        try:
            answer = await resolver.resolve(
                name, rdtype, search=search, raise_on_no_answer=False, lifetime=config.timeout, backend=backend
            )
        except dns.resolver.NXDOMAIN:
            return
        except (dns.exception.DNSException, OSError) as error:
            failures.append(f"{dns.rdatatype.to_text(rdtype)} query failed: {error}")
            return
        for record in answer:
            addresses.add(ipaddress.ip_address(record.address).compressed)

    async with trio.open_nursery() as nursery:
        for rdtype in _RECORD_TYPES:
            nursery.start_soon(query, rdtype)
    if failures:
        raise _Failed("; ".join(failures))
    return tuple(sorted(addresses))
