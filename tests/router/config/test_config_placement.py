"""Placement's config: [server] session_header, and each pool's placement keys, read, refused and rendered."""

from __future__ import annotations

from pathlib import Path

from tailguard.router.config import parse_config, render_config
from tests.helpers.config_text import BASE, problems_of


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


def pool(lines: str) -> str:
    """BASE with ``lines`` in the interactive pool's table."""
    return BASE.replace('endpoints = [{ url = "http://127.0.0.1:8001", max_concurrency = 64 }]\n', 'endpoints = [{ url = "http://127.0.0.1:8001", max_concurrency = 64 }]\n' + lines + "\n", 1)


def test_every_pool_places_by_prefix_affinity_unless_told_otherwise() -> None:
    config = parse_config(BASE)
    for each in config.pools:
        assert (each.placement.mode, each.placement.load_factor, each.placement.blocks, each.placement.cache_salt) == (
            "prefix_affinity", 1.1, 16, "none",
        )
    text = pool('placement = "least_loaded"\naffinity_load_factor = 2\naffinity_blocks = 4\ncache_salt = "caller"')
    placement = parse_config(text).pool("interactive").placement
    assert (placement.mode, placement.load_factor, placement.blocks, placement.cache_salt) == ("least_loaded", 2.0, 4, "caller")
    assert rendered(BASE, "placement") == [
        "prefix_affinity (affinity_load_factor 1.1, affinity_blocks 16: the key covers 256 leading tokens)"
    ] * 2
    assert rendered(text, "placement")[0] == "least_loaded (load alone); cache_salt caller (callers share no cached prefix)"


def test_placement_mistakes_are_named_by_their_keys() -> None:
    for lines, needle in [
        ('placement = "round_robin"', "pools.interactive.placement"),
        ("affinity_load_factor = 0.9", "pools.interactive.affinity_load_factor"),
        ('affinity_load_factor = "high"', "pools.interactive.affinity_load_factor"),
        ("affinity_blocks = 0", "pools.interactive.affinity_blocks"),
        ("affinity_blocks = 257", "at most 256"),
        ('cache_salt = "tenant"', "pools.interactive.cache_salt"),
    ]:
        (problem,) = problems_of(pool(lines))
        assert needle in problem, (lines, problem)


def test_the_shipped_file_documents_each_placement_key() -> None:
    shipped = (Path(__file__).resolve().parents[3] / "config.toml").read_text()
    for key in ("session_header", "placement", "affinity_load_factor", "affinity_blocks", "cache_salt"):
        assert f"# {key} = " in shipped or f"\n{key} = " in shipped, key
