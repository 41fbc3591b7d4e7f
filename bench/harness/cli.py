"""The drivers' ``main()``: run the measurement under Trio, and stop cleanly on Ctrl-C."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

T = TypeVar("T")

def interrupted(error: BaseException) -> bool:
    """Whether ``error`` is Ctrl-C, possibly wrapped in Trio's exception groups."""
    if isinstance(error, BaseExceptionGroup):
        _, rest = error.split(KeyboardInterrupt)
        return rest is None
    return isinstance(error, KeyboardInterrupt)


def run_trio(measure: Callable[..., Awaitable[T]], *args: Any, said: str, **kwargs: Any) -> T | None:
    """``trio.run(measure, *args)``; on Ctrl-C, print ``interrupted; {said}`` (what was stopped) and return None (exit 130).

    The children started in ``measure``'s nurseries are stopped by Trio's
    cancellation on the way out; this says so instead of a traceback.
    """
    try:
        return trio.run(measure, *args, **kwargs)
    except BaseException as error:
        if not interrupted(error):
            raise
        print(f"\ninterrupted; {said}", file=sys.stderr)
        return None


def driver_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m bench NAME``: its usage line names the command, its description is the module's first line."""
    return argparse.ArgumentParser(prog=f"python -m bench {name}", description=(doc or "").splitlines()[0])


def add_json_arg(parser: argparse.ArgumentParser, default: Path) -> None:
    """``--json PATH``: where a driver with one result file writes it."""
    parser.add_argument("--json", type=Path, default=default, help="where to write results (default %(default)s)")
