"""Read ``[auth]``: API keys from config.toml and from the keys file, kept only as digests.

A key reaches the router as a digest (key_sha256), through an environment
variable (key_env), or in plaintext (key) from the keys file, which is the
secret store; config.toml may not hold a plaintext key. Whatever the route,
only the digest is kept, and no problem quotes a value that may be a key.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Mapping, Sequence

import tomli

from .table import ENV_NAME, NAME, Table, describe, kind
from .types import ApiKeyConfig, AuthConfig

_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")

# A key read cleanly: its table (to report a clash on), the key that gave it.
_KeyEntry = tuple[Table, str, ApiKeyConfig]


def hash_key(key: str) -> str:
    """The lower-case SHA-256 hex digest of ``key`` (UTF-8), as config.toml holds it."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()



def read_auth(
    table: Table,
    *,
    present: bool,
    class_names: Collection[str],
    environ: Mapping[str, str],
) -> AuthConfig:
    """The keys of config.toml, then those of the keys file, all checked unique.

    An ``[auth]`` table that ends up with no key is refused rather than read as
    "auth off": an empty keys file must not open the router by accident.
    """
    variable = table.optional_string("keys_file_env")
    entries = _read_keys(table, in_keys_file=False, class_names=class_names, environ=environ)
    keys_file: str | None = None
    file_problems: list[str] = []
    if variable is not None and table.ok("keys_file_env"):
        keys_file = _keys_file_path(table, variable, environ)
        if keys_file is not None:
            file_root = _read_keys_file(table, keys_file, variable, file_problems)
            if file_root is not None:
                entries += _read_keys(
                    file_root, in_keys_file=True, class_names=class_names, environ=environ
                )
                file_root.finish()
    _check_unique(entries)
    for problem in file_problems:  # after _check_unique, which may add to them
        table.report(table.key("keys_file_env"), f"in the keys file {keys_file}: {problem}")
    if table.finish() and present and not entries:
        where = "in [[auth.keys]]" + (f" or in the keys file {keys_file}" if keys_file else "")
        table.report(
            table.path,
            f"no API key {where}: delete [auth] to run without authentication, or add a key",
        )
    return AuthConfig(keys=tuple(key for _, _, key in entries), keys_file=keys_file)


def _keys_file_path(auth: Table, variable: str, environ: Mapping[str, str]) -> str | None:
    if not ENV_NAME.fullmatch(variable):
        auth.problem(
            "keys_file_env", f"must be the name of an environment variable ({ENV_NAME.pattern})"
        )
        return None
    path = environ.get(variable)
    if not path:
        state = "is not set" if path is None else "is empty"
        auth.problem(
            "keys_file_env",
            f"environment variable {variable} {state} (it should hold the keys file's path)",
        )
        return None
    return path


def _read_keys_file(
    auth: Table, path: str, variable: str, problems: list[str]
) -> Table | None:
    """The keys file's top-level table, its problems collected in ``problems``.

    TOML errors are reported by position only (tomli quotes no text), so a
    broken line holding a key does not print it.
    """
    try:
        with open(path, "rb") as file:
            data = file.read()
        document = tomli.loads(data.decode("utf-8"))
    except OSError as exc:
        auth.problem(
            "keys_file_env",
            f"cannot read the keys file {path} (from {variable}):"
            f" {exc.strerror or type(exc).__name__}",
        )
        return None
    except UnicodeDecodeError:
        auth.problem("keys_file_env", f"the keys file {path} (from {variable}) is not UTF-8 text")
        return None
    except tomli.TOMLDecodeError as exc:
        auth.problem(
            "keys_file_env", f"the keys file {path} (from {variable}) is not valid TOML: {exc}"
        )
        return None
    return Table(document, "", problems)


def _read_keys(
    parent: Table,
    *,
    in_keys_file: bool,
    class_names: Collection[str],
    environ: Mapping[str, str],
) -> list[_KeyEntry]:
    """The ``[[keys]]`` tables under ``parent`` that read cleanly, in file order."""
    items = parent.array("keys", f"an array of tables ([[{parent.key('keys')}]])", [])
    entries: list[_KeyEntry] = []
    for index, item in enumerate(items):
        key = f"{parent.key('keys')}[{index}]"
        table = parent.nested(key, item)
        if table is None:
            parent.report(key, f"must be a table, got {kind(item)}")
            parent.invalidate("keys")
            continue
        entry = _read_key(
            table, in_keys_file=in_keys_file, class_names=class_names, environ=environ
        )
        if entry is None:
            parent.invalidate("keys")
        else:
            entries.append(entry)
    return entries


def _read_key(
    table: Table,
    *,
    in_keys_file: bool,
    class_names: Collection[str],
    environ: Mapping[str, str],
) -> _KeyEntry | None:
    name = table.string("name")
    if table.ok("name") and not NAME.fullmatch(name):
        table.problem("name", f"must match {NAME.pattern}, got {json.dumps(name)}")
    source, digest = _read_key_digest(table, in_keys_file=in_keys_file, environ=environ)
    classes = _read_force_classes(table, class_names)
    max_concurrency = table.optional_integer("max_concurrency", minimum=1)
    weight = table.number("weight", ApiKeyConfig.weight, minimum=0.0)
    tokens_per_minute = table.optional_integer("tokens_per_minute", minimum=1)
    requests_per_minute = table.optional_integer("requests_per_minute", minimum=1)
    if not table.finish() or digest is None:
        return None
    return table, source, ApiKeyConfig(name, digest, classes, max_concurrency, weight, tokens_per_minute, requests_per_minute)


def _read_key_digest(
    table: Table, *, in_keys_file: bool, environ: Mapping[str, str]
) -> tuple[str, str | None]:
    """(the key that gave it, the lower-case hex digest), or a problem and None."""
    written = {name: table.secret(name) for name in ("key_sha256", "key_env", "key")}
    if written["key"] is not None and not in_keys_file:
        table.problem(
            "key",
            "a plaintext key does not belong in config.toml: write its SHA-256 as key_sha256"
            " (python -m router.auth prints it), name an environment variable with key_env,"
            " or move it to the keys file (auth.keys_file_env)",
        )
        return "key", None
    allowed = ("key_sha256", "key_env", "key") if in_keys_file else ("key_sha256", "key_env")
    given = [name for name in allowed if table.has(name)]
    if len(given) != 1:
        table.report(
            table.path,
            f"needs exactly one of {', '.join(allowed)}"
            + (f", got {' and '.join(given)}" if given else ""),
        )
        return (given or allowed)[0], None
    (source,) = given
    value = written[source]
    if value is None:  # of the wrong type, reported
        return source, None
    if source == "key_sha256":
        if not _HEX_DIGEST.fullmatch(value):
            table.problem(
                source,
                "must be the key's SHA-256 as 64 hex digits (python -m router.auth <key>"
                " prints it); the value is not shown, in case it is the key itself",
            )
            return source, None
        return source, value.lower()
    if source == "key_env":
        if not ENV_NAME.fullmatch(value):
            table.problem(
                source,
                f"must be the name of an environment variable ({ENV_NAME.pattern});"
                " the value is not shown, in case it is the key itself",
            )
            return source, None
        return source, env_digest(table, source, value, environ)
    return source, _key_digest(table, source, value, "the key")


def env_digest(table: Table, source: str, variable: str, environ: Mapping[str, str]) -> str | None:
    """The digest of the secret in the environment variable ``variable`` (named by the key ``source``), or a problem and None."""
    from_env = environ.get(variable)
    if from_env is None:
        table.problem(source, f"environment variable {variable} is not set")
        return None
    return _key_digest(table, source, from_env, f"environment variable {variable}")


def _key_digest(table: Table, source: str, key: str, what: str) -> str | None:
    """The digest of ``key`` (surrounding whitespace dropped), if a header can carry it."""
    key = key.strip()  # a trailing newline in a secret store is a classic
    if not key:
        table.problem(source, f"{what} is empty")
        return None
    if not all("!" <= char <= "~" for char in key):
        table.problem(
            source,
            f"{what} holds characters an Authorization header cannot carry"
            " (printable ASCII without spaces only)",
        )
        return None
    return hash_key(key)


def _read_force_classes(table: Table, class_names: Collection[str]) -> frozenset[str]:
    items = table.array("may_force_classes", "an array of class names", [])
    classes: set[str] = set()
    for index, item in enumerate(items):
        key = f"{table.key('may_force_classes')}[{index}]"
        if not isinstance(item, str):
            table.report(key, f"must be a class name, got {describe(item)}")
        elif item not in class_names:
            defined = ", ".join(json.dumps(name) for name in class_names) or "none"
            table.report(key, f"names no defined class: {json.dumps(item)} (defined: {defined})")
        else:
            classes.add(item)
            continue
        table.invalidate("may_force_classes")
    return frozenset(classes)


def _check_unique(entries: Sequence[_KeyEntry]) -> None:
    """One name per caller and one caller per key, across config.toml and the keys file."""
    names: dict[str, str] = {}
    digests: dict[str, tuple[str, str]] = {}
    for table, source, key in entries:
        first_name = names.setdefault(key.name, table.key("name"))
        if first_name != table.key("name"):
            table.problem("name", f"{json.dumps(key.name)} is already {first_name}")
        first_path, holder = digests.setdefault(key.sha256, (table.path, key.name))
        if first_path != table.path:
            table.problem(
                source,
                f"the same key as {first_path} ({json.dumps(holder)}): a key must name one caller",
            )
