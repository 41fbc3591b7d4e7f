"""The log line's format: what the process writes and the planner reads back.

JSON lines (``ts``, ``level``, ``logger``, ``msg``, then the record's
``fields``) or human text lines; the access log is the ``tailguard.access``
logger's. Here, apart from ``logs`` (the queue, the handlers, the access
sink), so that ``tailguard advise`` reads and writes access lines without
importing the serving process's logging.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

ACCESS_LOGGER = "tailguard.access"


def iso_time(created: float) -> str:
    """A wall-clock time as a line's ``ts``: UTC, to the millisecond."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def read_iso_time(text: str) -> float:
    """A line's ``ts`` back as a wall-clock time; raises ValueError on any other text."""
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """Human lines; ``extra`` fields appended as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            text += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        return text


def _text_value(value: object) -> str:
    text = "-" if value is None else str(value)
    return json.dumps(text) if (" " in text or not text) else text
