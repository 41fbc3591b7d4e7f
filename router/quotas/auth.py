"""API keys: who is calling, and what they may do.

Keys are configured as SHA-256 digests (``[[auth.keys]]`` in config.toml), so
neither the file nor the process's memory holds a key the router could leak;
a request's key is hashed and the digest looked up. With no keys configured
auth is off and every caller is :data:`ANONYMOUS`.

To get the digest of a key for config.toml::

    python -m tailguard.router.quotas.auth <key>       # or with no argument: read it from stdin,
                                      # keeping it out of shell history and ps
"""

from __future__ import annotations

import getpass
import hmac
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import AuthConfig, hash_key
from ..errors import Unauthenticated

__all__ = ["ANONYMOUS", "Authenticator", "Caller", "bearer", "check_token", "hash_key", "one_authorization"]


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the router needs to know it: never the key itself."""

    name: str
    may_force_classes: frozenset[str]
    max_concurrency: int | None  # requests in flight at most; None = no cap
    weight: float = 1.0  # its fair share against other callers waiting for the same pool (router/queueing/fair_share.py)
    tokens_per_minute: int | None = None  # its budgets over any 60 s (router/quotas/budgets.py); None: none
    requests_per_minute: int | None = None


ANONYMOUS = Caller("anonymous", frozenset(), None)
"""The caller when auth is off: it may not force a class and has no cap of its own."""


class _Ambiguous(str):
    """What a request that sent more than one ``Authorization`` value carries instead of one."""


def one_authorization(values: Sequence[str]) -> str | None:
    """The request's one ``Authorization`` value (None: it sent none).

    Two or more are ambiguous: which one names the caller depends on which a
    proxy or a server keeps (the first, the last, both joined), so the router
    picks none, and :meth:`Authenticator.authenticate` refuses the request
    while keys are configured. The value returned then holds no key.
    """
    if len(values) <= 1:
        return values[0] if values else None
    return _Ambiguous(f"{len(values)} values")


class Authenticator:
    """Maps an ``Authorization`` header to its :class:`Caller`.

    Built from one :class:`AuthConfig`; a reload builds a new one. Messages of
    the errors it raises never contain what the caller sent, since a mistyped
    header may still hold a real key.
    """

    def __init__(self, auth: AuthConfig) -> None:
        self._callers: dict[str, Caller] = {
            key.sha256: Caller(
                key.name, frozenset(key.may_force_classes), key.max_concurrency, key.weight, key.tokens_per_minute, key.requests_per_minute
            )
            for key in auth.keys
        }
        # Every caller a request may be now: the keys' names, or the anonymous caller when auth is off.
        self.names = frozenset(caller.name for caller in self._callers.values()) or frozenset((ANONYMOUS.name,))

    @property
    def enabled(self) -> bool:
        return bool(self._callers)

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller whose key ``Authorization: Bearer <key>`` carries.

        Returns :data:`ANONYMOUS` when auth is off, whatever the header says.
        Raises :exc:`Unauthenticated` when the header is missing, sent more
        than once (:func:`one_authorization`), is not ``Bearer <key>`` (scheme
        in any case), or carries an unknown key.
        """
        if not self._callers:
            return ANONYMOUS
        caller = self._callers.get(hash_key(bearer(authorization, "API key", "<key>")))
        if caller is None:
            raise Unauthenticated("unknown API key")
        return caller


def bearer(authorization: str | None, what: str, placeholder: str) -> str:
    """The token of ``Authorization: Bearer <token>`` (scheme in any case).

    Raises :exc:`Unauthenticated`, naming ``what`` is missing and how to send
    it (``placeholder``), when the header is missing, sent more than once
    (:func:`one_authorization`) or not of that shape; never quoting it.
    """
    if isinstance(authorization, _Ambiguous):
        raise Unauthenticated(f"ambiguous credentials: the request sent {authorization} of Authorization; send exactly one")
    if authorization is None or not authorization.strip():
        raise Unauthenticated(f"missing {what}: send Authorization: Bearer {placeholder}")
    parts = authorization.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        raise Unauthenticated(f"malformed Authorization header: expected Authorization: Bearer {placeholder}")
    return parts[1]


def check_token(authorization: str | None, sha256: str) -> None:
    """Pass a request whose ``Authorization: Bearer <token>`` carries the token of digest ``sha256`` (GET /metrics).

    Raises :exc:`Unauthenticated` otherwise (the digests compared in constant time).
    """
    token = bearer(authorization, "metrics token", "<metrics token>")
    if not hmac.compare_digest(hash_key(token), sha256):
        raise Unauthenticated("wrong metrics token (metrics.token_env)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tailguard.router.quotas.auth [KEY]``: print the digest to paste as ``key_sha256``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 or any(arg in ("-h", "--help") for arg in args):
        print(__doc__.strip() if __doc__ else "", file=sys.stderr)
        return 2
    if args:
        key = args[0]
    elif sys.stdin.isatty():
        key = getpass.getpass("API key (not echoed): ")
    else:
        key = sys.stdin.readline()
    key = key.strip()  # as config does for key and key_env
    if not key:
        print("tailguard.router.quotas.auth: empty key", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
