"""Tenant isolation in the engines' prefix caches: the ``cache_salt`` a pool with ``cache_salt = "caller"`` sends.

vLLM hashes a request's ``cache_salt`` into its first KV block's hash (V1
prefix caching, ``kv_cache_utils``: the salt is an extra key of the block at
token 0), so requests with different salts share no cached block, and a
caller cannot tell from its own time to first token what another caller's
prompts were. The salt is a digest of the caller's identity (its API key's
name in ``[auth]``) mixed with any ``cache_salt`` the caller sent: a caller
may split its own traffic further, but never pick another caller's salt,
since it cannot choose what its name is mixed into.
"""

from __future__ import annotations

import hashlib
import json

_DOMAIN = b"tailguard cache_salt v1\x00"


def caller_salt(caller: str, sent: object = None) -> str:
    """The salt for ``caller``'s requests: 64 hex digits (256 bits, as vLLM advises), the same on every worker and replica."""
    # Tagged, so a string never equals a non-string's JSON ("7" and 7 mix apart).
    mixed = "" if sent is None else "s" + sent if isinstance(sent, str) else "j" + json.dumps(sent, sort_keys=True)
    data = _DOMAIN + caller.encode("utf-8", "surrogatepass") + b"\x00" + mixed.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=32).hexdigest()
