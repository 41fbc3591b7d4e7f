"""Classification: which class (and so which pool, deadline and priority) a request gets."""

from __future__ import annotations

from collections.abc import Sequence

from .config_types import ClassConfig
from .errors import InvalidRequest


def classify(prompt_tokens: int, max_tokens: int, classes: Sequence[ClassConfig]) -> ClassConfig:
    """The first class whose thresholds admit both sizes (config validation
    guarantees the last class is a catch-all)."""
    for klass in classes:
        if klass.max_prompt_tokens is not None and prompt_tokens > klass.max_prompt_tokens:
            continue
        if klass.max_output_tokens is not None and max_tokens > klass.max_output_tokens:
            continue
        return klass
    raise AssertionError("config validation guarantees a catch-all class")


def forced(name: str, classes: Sequence[ClassConfig]) -> ClassConfig:
    """The class a caller asked for by name (authorization is checked elsewhere)."""
    for klass in classes:
        if klass.name == name:
            return klass
    known = ", ".join(k.name for k in classes)
    raise InvalidRequest(f"unknown class {name!r}; classes are: {known}", param="class")
