"""The docs describe the queue order and the placement a pool gets by default, not an older one.

The wait queue once served callers first come, first served, and placement
once took the least loaded endpoint; both defaults changed (``queue_order =
"fair"``, ``placement = "prefix_affinity"``) while the README and
docs/request-path.md still said the old ones. These tests read the defaults
from the config types and fail on a page that states the other rule as
what a pool does.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tailguard.router.config import PlacementConfig, PoolConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(path: Path) -> str:
    """A page's text, whitespace folded, so a phrase is found across line breaks."""
    return " ".join(path.read_text(encoding="utf-8").split())


def test_the_defaults_are_the_ones_these_tests_guard() -> None:
    """Should a default change back, the phrases below stop being stale: rewrite this file then."""
    assert PoolConfig.queue_order == "fair"
    assert PlacementConfig.mode == "prefix_affinity"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_says_the_queue_is_ordered_by_arrival(page: Path) -> None:
    stale = re.findall(r"ordered by \(?class priority, (?:then )?(?:by )?arrival\)?", prose(page), flags=re.I)
    assert not stale, f"{page.name}: the queue's default order is callers' fair shares (queue_order = \"fair\"): {stale}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_says_placement_is_least_loaded_by_default(page: Path) -> None:
    """"Fewest requests in flight" is right only for least_loaded (or a request without a key): it must say so."""
    text = prose(page)
    for match in re.finditer(r"fewest requests in flight", text):
        sentence = text[text.rfind(". ", 0, match.start()) + 1 : match.end()]
        assert "least_loaded" in sentence or "without a key" in sentence, (
            f"{page.name}: placement is prefix affinity by default, least loaded only where asked: {sentence!r}"
        )


def test_the_request_path_states_both_defaults() -> None:
    """The page that walks a request step by step names each default and its alternative."""
    text = prose(ROOT / "docs" / "request-path.md")
    assert "fair shares" in text and '`queue_order = "fair"`, the default' in text
    assert '`queue_order = "arrival"`' in text
    assert "prefix home" in text and 'placement = "least_loaded"' in text
