"""Placement's config: [server] session_header, and each pool's placement keys, read, refused and rendered."""

from __future__ import annotations

from tailguard.router.config import parse_config, render_config
from tests.test_config import BASE, problems_of


def server(lines: str) -> str:
    return "[server]\n" + lines + "\n" + BASE


def rendered(text: str, key: str) -> list[str]:
    """What ``tailguard config`` shows for ``key``, each line it is on."""
    return [line.split(None, 1)[1] for line in render_config(parse_config(text)).splitlines() if line.split()[:1] == [key]]


def test_the_session_header_defaults_to_x_session_id_and_is_kept_lower_case() -> None:
    assert parse_config(BASE).server.session_header == "x-session-id"
    assert parse_config(server('session_header = "X-Conversation"')).server.session_header == "x-conversation"
    assert parse_config(server('session_header = ""')).server.session_header == ""
    assert rendered(BASE, "session_header") == ["x-session-id"]
    assert rendered(server('session_header = ""'), "session_header") == ['"" (none)']


def test_a_session_header_that_is_no_header_name_is_refused_by_its_key() -> None:
    (problem,) = problems_of(server('session_header = "x session"'))
    assert "server.session_header" in problem and "header name" in problem
    (problem,) = problems_of(server("session_header = 3"))
    assert "server.session_header" in problem
