"""``tailguard advise``: how many GPUs go to which pool, and whether to lend, predicted in virtual time.

The command line (``tailguard advise`` dispatches here): a trace or an
access log in; the report, the class thresholds (with an access log) and on
request the JSON of it all out. The package's docstring says what is
predicted and how.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tailguard.router.config import ConfigError, load_config
from tailguard.server import SHIPPED_CONFIG

from .access_log import LogUsage, read_access_log
from .fleet import fleet_from
from .joint import search, search_json, section
from .report import advice_json, report
from .traffic import arrivals_from_trace, seen_in_trace
from .verdict import advise

DEFAULT_SECONDS = 120.0  # of arrivals replayed, by default
MAX_SECONDS = 3600.0


def default_config() -> Path:
    local = Path("config.toml")
    return local if local.exists() else SHIPPED_CONFIG


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailguard advise", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="a bench tail --record-trace JSONL (at in GPU s, prompt_tokens, max_tokens, class)")
    source.add_argument("--access-log", type=Path, help="tailguard's own JSON log; its tailguard.access lines are replayed")
    add = parser.add_argument
    add("--config", type=Path, default=None, help="the pools, endpoints and caps (default: ./config.toml, else the shipped one)")
    add("--engines", type=int, default=None, help="engines to split (default: the endpoints of the config's two pools)")
    add("--seconds", type=float, default=DEFAULT_SECONDS, help=f"replay at most this many seconds of arrivals (default %(default)g, at most {MAX_SECONDS:g})")
    add("--jobs", type=int, default=1, help="processes to simulate candidates in (default %(default)s)")
    add("--json", type=Path, default=None, help="also write every prediction as JSON here")
    add("--no-prefix-cache", action="store_true", help="replay every prompt unique, ignoring the log's prefix_group and cached_tokens (for comparison)")
    add("--keep-thresholds", action="store_true", help="with --access-log: do not search class thresholds (keep the file's)")
    add("--assume-shared-tokens", type=int, default=0, help="a prefix group's shared tokens where no line reported cached_tokens (default %(default)s: none)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= MAX_SECONDS or args.jobs < 1 or args.assume_shared_tokens < 0:
        parser.error(f"--seconds must be in (0, {MAX_SECONDS:g}], --jobs positive, --assume-shared-tokens not negative")
    path: Path = args.config or default_config()
    try:
        config = load_config(path)
    except ConfigError as error:
        print(f"tailguard: {path}: invalid config\n{error}", file=sys.stderr)
        return 2
    usage: LogUsage | None = None
    try:
        fleet = fleet_from(config, args.engines)
        if args.trace is not None:
            arrivals, source = arrivals_from_trace(args.trace, args.seconds), str(args.trace)
            seen = seen_in_trace(args.trace, args.seconds)
        else:
            arrivals, seen, usage = read_access_log(args.access_log, fleet.short_class, args.seconds)
            source = str(args.access_log)
            print(usage.summary(source), file=sys.stderr if len(arrivals) < 2 else sys.stdout)
        if len(arrivals) < 2:
            raise ValueError(f"{source}: fewer than two requests to replay")
        modelled = None if args.no_prefix_cache else seen
        result = advise(
            fleet, arrivals, seen=modelled, assume_tokens=args.assume_shared_tokens, jobs=args.jobs, seconds=args.seconds, source=source
        )
    except (OSError, ValueError) as error:
        print(f"tailguard advise: {error}", file=sys.stderr)
        return 2
    print(("\n" if usage is not None else "") + report(result), end="")
    thresholds = None
    if usage is not None and not args.keep_thresholds:
        thresholds = search(fleet, arrivals, seen=modelled, assume_tokens=args.assume_shared_tokens, jobs=args.jobs, seconds=args.seconds, file_advice=result)
        print("\n" + section(thresholds), end="")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = advice_json(result)
        if usage is not None:
            document["access_log"] = usage.as_json()
        if thresholds is not None:
            document["thresholds"] = search_json(thresholds)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
