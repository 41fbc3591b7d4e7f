"""The drivers' ``main()``: run the measurement under Trio, and stop cleanly on Ctrl-C."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")

def interrupted(error: BaseException) -> bool:
    """Whether ``error`` is Ctrl-C, possibly wrapped in Trio's exception groups."""
    if isinstance(error, BaseExceptionGroup):
        _, rest = error.split(KeyboardInterrupt)
        return rest is None
    return isinstance(error, KeyboardInterrupt)


def run_trio(measure: Callable[..., Awaitable[T]], *args: Any, stopped: str, **kwargs: Any) -> T | None:
    """``trio.run(measure, *args)``; on Ctrl-C, say that ``stopped`` were stopped and return None (exit 130)."""
    try:
        return trio.run(measure, *args, **kwargs)
    except BaseException as error:
        if not interrupted(error):
            raise
        print(f"\ninterrupted; {stopped} stopped", file=sys.stderr)
        return None
