"""``tailguard advise``: how many GPUs go to which pool, and whether to lend, predicted in virtual time.

The command line (``tailguard advise`` dispatches here): a trace or an
access log in; the report, the class thresholds (with an access log) and on
request the JSON of it all out. The package's docstring says what is
predicted and how.

The whole input is replayed unless ``--seconds`` bounds it, at most
``MAX_SECONDS`` of arrivals from the first and ``MAX_ARRIVALS`` requests (a
longer log is cut, and the report's first line says so): the first line
always says how much was used, so advice on 17 of 326 lines cannot pass for
advice on the log. Under ``MIN_REQUESTS`` requests to replay there is no
recommendation (exit status 2): a P99 over a few dozen requests is the
luck of one or two of them, and it turned over completely when the window
grew. The bound is on requests, not seconds: a trace's 3 GPU seconds of
239 requests is plenty, a quiet hour of 20 is not.

A long input takes minutes of replays, so progress goes to stderr
(``ProgressLine``): stdout stays the report, whole, for a file or a pipe.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from tailguard.router.config import ConfigError, load_config
from tailguard.server import SHIPPED_CONFIG

from .access_log import LogUsage, read_access_log
from .fleet import fleet_from
from .joint import search, search_json, section
from .replay.trace import MAX_ARRIVALS
from .report import advice_json, report
from .simulate import Progress
from .traffic import read_trace_window
from .verdict import advise, replayable

MAX_SECONDS = 24 * 3600.0  # of arrivals replayed: a day's cycle (virtual time costs nothing idle; requests cost, bounded apart)
MIN_REQUESTS = 50  # to replay, for a recommendation


class ProgressLine:
    """Which replays advise is in, on ``stream`` (stderr): on a terminal one line rewritten after each set-up,
    elsewhere (a log file, CI) one line as each stage starts, so a redirected stderr stays readable."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._terminal = stream.isatty()
        self._width = 0  # of the line now on the terminal, to blank it out

    def stage(self, label: str) -> Progress:
        """What hears of ``label``'s set-ups replayed (``simulate.run_all``)."""

        def show(done: int, total: int) -> None:
            if self._terminal:
                text = f"tailguard advise: {label}: replayed {done} of {total} set-ups"
                self._stream.write("\r" + text.ljust(self._width) + ("\n" if done == total else ""))
                self._width = 0 if done == total else len(text)
            elif done == 0:
                self._stream.write(f"tailguard advise: {label}: replaying {total} set-ups ...\n")
            self._stream.flush()

        return show


def default_config() -> Path:
    local = Path("config.toml")
    return local if local.exists() else SHIPPED_CONFIG


def build_parser() -> argparse.ArgumentParser:
    """The options; the help is plain text (a terminal shows it, not a markdown viewer), its numbers the constants'."""
    parser = argparse.ArgumentParser(
        prog="tailguard advise",
        description=(
            "Predict how many GPUs go to which pool, and whether to lend, by replaying a trace\n"
            "or tailguard's own access log in virtual time over every split and lending rule."
        ),
        epilog=(
            "The whole input is replayed, from its first arrival, unless --seconds bounds it.\n"
            f"advise replays at most {MAX_SECONDS:,.0f} s of arrivals (a day) and {MAX_ARRIVALS:,} requests;\n"
            "a longer input is cut, and the report says so. The report's first line says how\n"
            "many lines and seconds of arrivals were used.\n"
            "\n"
            f"With fewer than {MIN_REQUESTS} requests to replay advise recommends nothing and exits with\n"
            "status 2, as it does for an input or config it cannot read: a P99 over fewer\n"
            "requests is the luck of one or two of them.\n"
            "\n"
            "The report goes to stdout (every layout's predictions, the recommendation, and a\n"
            "config snippet to merge into config.toml); progress on stderr."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="a bench tail --record-trace JSONL (at in GPU s, prompt_tokens, max_tokens, class)")
    source.add_argument("--access-log", type=Path, help="tailguard's own JSON log; its tailguard.access lines are replayed")
    add = parser.add_argument
    add("--config", type=Path, default=None, help="the pools, endpoints and caps (default: ./config.toml, else the shipped one)")
    add("--engines", type=int, default=None, help="engines to split (default: the endpoints of the config's two pools)")
    add("--seconds", type=float, default=None, help=f"replay at most this many seconds of arrivals from the first (default: the whole input, up to {MAX_SECONDS:,.0f} s)")
    add("--jobs", type=int, default=1, help="processes to simulate candidates in (default %(default)s)")
    add("--json", type=Path, default=None, help="also write every prediction as JSON here")
    add("--no-prefix-cache", action="store_true", help="replay every prompt unique, ignoring the log's prefix_group and cached_tokens (for comparison)")
    add("--keep-thresholds", action="store_true", help="with --access-log: do not search class thresholds (keep the file's)")
    add("--assume-shared-tokens", type=int, default=0, help="a prefix group's shared tokens where no line reported cached_tokens (default %(default)s: none)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.seconds is not None and not 0 < args.seconds <= MAX_SECONDS or args.jobs < 1 or args.assume_shared_tokens < 0:
        parser.error(f"--seconds must be in (0, {MAX_SECONDS:g}], --jobs positive, --assume-shared-tokens not negative")
    window = MAX_SECONDS if args.seconds is None else args.seconds
    path: Path = args.config or default_config()
    try:
        config = load_config(path)
    except ConfigError as error:
        print(f"tailguard: {path}: invalid config\n{error}", file=sys.stderr)
        return 2
    try:
        fleet = fleet_from(config, args.engines)
        if args.trace is not None:
            source = str(args.trace)
            arrivals, seen, usage = read_trace_window(args.trace, window)
        else:
            source = str(args.access_log)
            arrivals, seen, usage = read_access_log(args.access_log, fleet.short_class, window)
        heading = _heading(usage, source, args.seconds is None)
        count = len(replayable(fleet, arrivals)[0])
        if count < MIN_REQUESTS:
            print(heading, file=sys.stderr)
            print(_too_few(source, count, len(arrivals), args.seconds), file=sys.stderr)
            return 2
        print(heading)
        modelled = None if args.no_prefix_cache else seen
        progress = ProgressLine(sys.stderr)
        searching = args.access_log is not None and not args.keep_thresholds
        result = advise(
            fleet,
            arrivals,
            seen=modelled,
            assume_tokens=args.assume_shared_tokens,
            jobs=args.jobs,
            seconds=window,
            source=source,
            progress=progress.stage("layouts under the file's thresholds" if searching else "layouts"),
        )
    except (OSError, ValueError) as error:
        print(f"tailguard advise: {error}", file=sys.stderr)
        return 2
    print("\n" + report(result), end="")
    thresholds = None
    if searching:
        thresholds = search(
            fleet,
            arrivals,
            seen=modelled,
            assume_tokens=args.assume_shared_tokens,
            jobs=args.jobs,
            seconds=window,
            file_advice=result,
            progress=progress.stage,
        )
        print("\n" + section(thresholds), end="")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = advice_json(result)
        document["access_log" if args.access_log is not None else "trace"] = usage.as_json()
        if thresholds is not None:
            document["thresholds"] = search_json(thresholds)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


def _heading(usage: LogUsage, source: str, whole: bool) -> str:
    """How much of the input the advice rests on; where the input outran advise's own bounds (not --seconds), that it was cut."""
    line = usage.summary(source)
    if usage.cut and whole:
        line += (
            f"\nCut: advise replays at most {MAX_SECONDS:,.0f} s of arrivals from the first and {MAX_ARRIVALS:,} requests;"
            " the rest of this input was not replayed (--seconds chooses a shorter window)."
        )
    return line


def _too_few(source: str, count: int, read: int, seconds: float | None) -> str:
    """The refusal: how many requests there were, how many a recommendation needs, and where more come from."""
    dropped = f" ({read - count} of the {read} read are over the router's caps)" if read > count else ""
    more = (
        f"replay a longer window (a larger --seconds than {seconds:g}, or none: the whole input)"
        if seconds is not None
        else "give it a longer log or trace"
    )
    return (
        f"tailguard advise: {source}: {count} requests to replay{dropped}; a recommendation needs at least {MIN_REQUESTS}"
        f" (a P99 over fewer is the luck of one or two requests): no recommendation. To get one, {more}."
    )


if __name__ == "__main__":
    sys.exit(main())
