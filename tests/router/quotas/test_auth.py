from __future__ import annotations

import hashlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from tailguard.router.config import ApiKeyConfig, AuthConfig, parse_config
from tailguard.router.errors import CallerOverLimit, Overloaded, Unauthenticated
from tailguard.router.quotas import ANONYMOUS, Authenticator, Caller, auth, hash_key

KEY = "tg-live-webapp-Zq3x9"
OTHER_KEY = "tg-live-reports-88aa"

KEYS = AuthConfig(
    keys=(
        ApiKeyConfig("webapp", hash_key(KEY), frozenset({"batch"}), 8),
        ApiKeyConfig("reports", hash_key(OTHER_KEY)),
    )
)


def refusal(authenticator: Authenticator, header: str | None) -> str:
    with pytest.raises(Unauthenticated) as info:
        authenticator.authenticate(header)
    message = str(info.value)
    assert message == info.value.message
    for secret in (KEY, OTHER_KEY, "wrong-key-123"):
        assert secret not in message
    return message


def test_hash_key_is_sha256_hex() -> None:
    assert hash_key(KEY) == hashlib.sha256(KEY.encode("utf-8")).hexdigest()


def test_anonymous_may_not_force_and_has_no_cap() -> None:
    assert ANONYMOUS == Caller("anonymous", frozenset(), None)


@pytest.mark.parametrize("header", [None, "", f"Bearer {KEY}", "Basic abc", "garbage"])
def test_disabled_auth_returns_anonymous_whatever_the_header(header: str | None) -> None:
    authenticator = Authenticator(AuthConfig())
    assert not authenticator.enabled
    assert authenticator.authenticate(header) is ANONYMOUS


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"  Bearer \t {KEY}  "])
def test_a_known_key_is_its_caller_with_its_classes_and_cap(header: str) -> None:
    authenticator = Authenticator(KEYS)
    assert authenticator.enabled
    assert authenticator.authenticate(header) == Caller("webapp", frozenset({"batch"}), 8)


def test_each_key_is_its_own_caller() -> None:
    caller = Authenticator(KEYS).authenticate(f"Bearer {OTHER_KEY}")
    assert caller == Caller("reports", frozenset(), None)


@pytest.mark.parametrize("header", [None, "", "   "])
def test_a_missing_key_says_how_to_send_one(header: str | None) -> None:
    assert refusal(Authenticator(KEYS), header) == "missing API key: send Authorization: Bearer <key>"


@pytest.mark.parametrize(
    "header",
    [KEY, f"Basic {KEY}", "Bearer", "Bearer   ", f"Bearer {KEY} {KEY}", "Token wrong-key-123", f"Bearer{KEY}"],
)
def test_a_malformed_header_is_refused_without_echoing_it(header: str) -> None:
    assert refusal(Authenticator(KEYS), header).startswith("malformed Authorization header")


@pytest.mark.parametrize("header", ["Bearer wrong-key-123", f"Bearer {KEY.upper()}", f"Bearer {hash_key(KEY)}"])
def test_an_unknown_key_is_refused(header: str) -> None:
    """Including the digest itself: holding the config's digest is not holding the key."""
    assert refusal(Authenticator(KEYS), header) == "unknown API key"


def test_keys_from_config_authenticate_end_to_end() -> None:
    text = (Path(__file__).resolve().parents[3] / "config.toml").read_text(encoding="utf-8")
    text += '\n[[auth.keys]]\nname = "webapp"\nkey_env = "TG_KEY"\nmay_force_classes = ["batch"]\nmax_concurrency = 8\n'
    config = parse_config(text, environ={"TG_KEY": KEY})
    caller = Authenticator(config.auth).authenticate(f"Bearer {KEY}")
    assert caller == Caller("webapp", frozenset({"batch"}), 8)


def test_caller_over_limit_is_an_overload_with_a_retry_hint() -> None:
    error = CallerOverLimit("over", retry_after=2.0)
    assert isinstance(error, Overloaded) and error.retry_after == 2.0


# python -m router.auth


def test_main_prints_the_digest_of_its_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert auth.main([KEY]) == 0
    assert capsys.readouterr().out == hash_key(KEY) + "\n"


def test_main_reads_the_key_from_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(KEY + "\n"))
    assert auth.main([]) == 0
    assert capsys.readouterr().out == hash_key(KEY) + "\n"


def test_main_refuses_an_empty_key_or_extra_arguments(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    assert auth.main([]) == 2
    assert auth.main(["a", "b"]) == 2
    assert capsys.readouterr().out == ""


def test_python_dash_m_router_auth() -> None:
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run(
        [sys.executable, "-m", "tailguard.router.quotas.auth", KEY], cwd=root, capture_output=True, text=True, check=True
    )
    assert result.stdout == hash_key(KEY) + "\n"
