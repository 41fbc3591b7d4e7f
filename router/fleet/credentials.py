"""What tailguard learns of an engine taking its API key: from a probe, or from a request's answer."""

from __future__ import annotations

import logging

from .endpoint import Endpoint

log = logging.getLogger("tailguard.router")


def key_refused(endpoint: Endpoint, status: int) -> None:
    """The engine refuses tailguard's key: down until it accepts it (logged once, as ERROR: the operator must act)."""
    variable = endpoint.access.api_key_env
    reason = (
        f"upstream_auth: the engine answered {status} to tailguard's key (the environment variable {variable})"
        if variable is not None
        else f"upstream_auth: the engine answered {status}: it wants an API key (set api_key_env on the pool)"
    )
    if endpoint.auth_failure is None:
        log.error("endpoint %s takes no requests: %s", endpoint.url, reason)
    endpoint.auth_failure = reason


def note_credentials(endpoint: Endpoint, status: int | None) -> None:
    """What a probe of a /v1 route says of tailguard's key (None: no answer, nothing learnt)."""
    if status in (401, 403):
        key_refused(endpoint, status)
    elif status is not None:
        endpoint.credentials_checked = True
        if endpoint.auth_failure is not None:
            endpoint.auth_failure = None
            log.info("endpoint %s accepts tailguard's key again", endpoint.url)


def key_unproven(endpoint: Endpoint) -> bool:
    """Whether a probe that found ``/health`` fine must also ask a /v1 route (``ask_key``).

    vLLM leaves ``/health`` open under ``--api-key``, so a passing health
    check says nothing of the key. It is asked of an endpoint never proven,
    of a refused one every turn until it takes the key again, and of one
    coming back from down: an engine restarted on its port may have come
    back with another key, and its first requests would meet that key's 401
    (``Endpoint.judged`` forgets the proof on the way down).
    """
    return not endpoint.credentials_checked or endpoint.auth_failure is not None


async def ask_key(endpoint: Endpoint) -> None:
    """``GET /v1/models`` with tailguard's key (cheap), and what its answer says of the key."""
    note_credentials(endpoint, await endpoint.probe.status("GET", "/v1/models"))
