"""The drivers' command lines: the options they share, and ``main()``'s Trio run that stops cleanly on Ctrl-C and reports."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import Field, asdict, fields
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import trio

from bench.harness.report import write_report

T = TypeVar("T")
N = TypeVar("N", int, float)


class Timed(Protocol):
    """A driver's result: a dataclass with the run's wall time in it."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    wall_s: float


R = TypeVar("R", bound=Timed)


class Dataclass(Protocol):
    """Any dataclass (the mark ``dataclasses.fields`` reads)."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]


D = TypeVar("D", bound=Dataclass)


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


def run_and_report(
    measure: Callable[..., Awaitable[R]], *args: Any, said: str, render: Callable[[R], str], out: Path, stem: str, **kwargs: Any
) -> int:
    """The end of a driver's ``main()``: ``run_trio``, the wall time into ``wall_s``, the report printed and written to ``out/STEM.{json,md}``.

    Returns the exit status: 0, or 130 on Ctrl-C (nothing written).
    """
    started = time.perf_counter()
    result = run_trio(measure, *args, said=said, **kwargs)
    if result is None:
        return 130
    result.wall_s = time.perf_counter() - started
    report = render(result)
    print(report)
    write_report(out, stem, asdict(result), report)
    return 0


def same_named(kind: type[D], source: object, **given: Any) -> D:
    """A ``kind`` whose fields are ``source``'s attributes of the same names (an argparse Namespace, a driver's options), but for those ``given``.

    Where a field is neither given nor on ``source``, its default holds (or
    the dataclass says which one is missing): the fields that differ from the
    command line, the quick run's values and the derived ones, stand out
    among the ones that are only passed on.
    """
    taken = {f.name: getattr(source, f.name) for f in fields(kind) if f.init and f.name not in given and hasattr(source, f.name)}
    return kind(**taken, **given)


def driver_parser(module: str, doc: str | None, quick: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``python -m bench NAME`` for the driver ``module`` (``bench.NAME.run``, its ``__name__``), with ``--quick`` first where given.

    The usage line names the command by the driver's folder, so a name in
    ``--help`` is always the one the registry runs; the description is the
    module's first line. ``quick`` is what the driver's smoke run shortens
    (its ``--quick``'s help).
    """
    parser = argparse.ArgumentParser(prog=f"python -m bench {module.split('.')[1]}", description=(doc or "").splitlines()[0])
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    return parser


def add_name_arg(parser: argparse.ArgumentParser, stem: str) -> None:
    """``--name``: the outputs' base name; by default ``STEM``, or ``STEM-quick`` for a ``--quick`` run (``output_name``)."""
    parser.add_argument("--name", default=None, help=f"base name of the outputs (default {stem}, or {stem}-quick)")


def output_name(args: argparse.Namespace, stem: str) -> str:
    """The outputs' base name: ``--name``, else ``STEM``, or ``STEM-quick`` after ``--quick``."""
    name: str = args.name or (f"{stem}-quick" if args.quick else stem)
    return name


def add_json_arg(parser: argparse.ArgumentParser, default: Path) -> None:
    """``--json PATH``: where a driver with one result file writes it."""
    parser.add_argument("--json", type=Path, default=default, help="where to write results (default %(default)s)")


def add_out_arg(parser: argparse.ArgumentParser, default: Path, what: str = "output folder") -> None:
    """``--out DIR``: where a driver with several result files writes them."""
    parser.add_argument("--out", type=Path, default=default, help=f"{what} (default %(default)s)")


def add_seconds_arg(parser: argparse.ArgumentParser, default: float, what: str) -> None:
    """``--seconds``: the measured window (what it bounds is the driver's, said in ``what``)."""
    parser.add_argument("--seconds", type=float, default=default, help=f"{what} (default %(default)s)")


def add_warmup_arg(parser: argparse.ArgumentParser, default: float, what: str, kind: type[float] | type[int] = float) -> None:
    """``--warmup``: unmeasured load before the window (seconds, or requests where ``kind`` is int)."""
    parser.add_argument("--warmup", type=kind, default=default, help=f"{what} (default %(default)s)")


def add_time_scale_arg(parser: argparse.ArgumentParser, default: float = 1.0, what: str = "the simulator's --time-scale") -> None:
    """``--time-scale``: passed to the simulator (GPU time runs this many times slower)."""
    parser.add_argument("--time-scale", type=float, default=default, help=f"{what} (default %(default)s)")


def add_seats_arg(parser: argparse.ArgumentParser, default: int) -> None:
    """``--seats``: where one simulated engine sits behind one pool of as many seats."""
    parser.add_argument("--seats", type=int, default=default, help="the engine's max_num_seqs and the pool's max_concurrency (default %(default)s)")


def add_full_run_arg(parser: argparse.ArgumentParser, flag: str, full: float, what: str) -> None:
    """A span that ``--quick`` shortens: None unless given, so the quick run's value holds where it was not; the help says the full run's."""
    parser.add_argument(flag, type=float, default=None, help=f"{what} (default {full:g})")


def add_seed_arg(parser: argparse.ArgumentParser, default: int, of: str) -> None:
    """``--seed``: what it seeds is the driver's (``of``)."""
    parser.add_argument("--seed", type=int, default=default, help=f"seed of {of} (default %(default)s)")


def listed(kind: Callable[[str], N]) -> Callable[[str], tuple[N, ...]]:
    """An argparse ``type=`` for ``"0.55,0.25"``: the numbers in the order given, blanks skipped (a bad one is argparse's usage error)."""

    def parse(text: str) -> tuple[N, ...]:
        return tuple(kind(part) for part in text.split(",") if part.strip())

    parse.__name__ = f"comma-separated {getattr(kind, '__name__', 'number')}"
    return parse


def comma_separated(kind: Callable[[str], N]) -> Callable[[str], list[N]]:
    """An argparse ``type=`` for ``"1,64"``: the numbers sorted, each once (a bad one is argparse's usage error)."""
    given = listed(kind)

    def parse(text: str) -> list[N]:
        return sorted(set(given(text)))

    parse.__name__ = given.__name__
    return parse
