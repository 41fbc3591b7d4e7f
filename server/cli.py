"""``tailguard``: serve the router, or check a config file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from router.config import ConfigError, load_config, render_config

from .app import serve
from .logs import configured_logging
from .workers import WorkerRole, supervise, worker_config

# The shipped reference config, used when no --config is given and the
# working directory has none (e.g. `tailguard serve --simulate` anywhere).
_SHIPPED_CONFIG = Path(__file__).resolve().parent.parent / "config.toml"


def _default_config() -> Path:
    local = Path("config.toml")
    return local if local.exists() else _SHIPPED_CONFIG


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailguard", description="A tail-latency router in front of vLLM.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="run the router")
    serve_cmd.add_argument("--config", type=Path, default=None, help="config file (default: ./config.toml, else the shipped one)")
    serve_cmd.add_argument(
        "--simulate",
        action="store_true",
        help="also run a simulated vLLM engine for every endpoint in the config (no GPU needed)",
    )
    serve_cmd.add_argument(
        "--no-grpc", action="store_true", help="serve only the HTTP API (no gRPC, no asyncio thread)"
    )
    serve_cmd.add_argument(
        "--workers", type=int, default=None, help="processes serving the same ports, caps shared through [cluster] (default: server.workers)"
    )
    serve_cmd.add_argument("--log-level", default=None, help="logging level (default: the config's logging.level)")
    serve_cmd.add_argument(
        "--log-format", choices=("json", "text"), default=None, help="log line format (default: the config's logging.format)"
    )
    check = commands.add_parser("check-config", help="validate a config and print the effective settings")
    check.add_argument("path", type=Path, nargs="?", default=None, help="config file (default: ./config.toml, else the shipped one)")
    commands.add_parser("advise", help="predict the best split of engines between pools from a trace or access log (see: advise --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["advise"]:
        from bench.advise import main as advise  # imported only here: the simulator is not needed to serve

        return advise(argv[1:])
    args = build_parser().parse_args(argv)
    path: Path = args.config if getattr(args, "config", None) else (args.path if getattr(args, "path", None) else _default_config())
    try:
        config = load_config(path)
    except ConfigError as error:
        print(f"tailguard: {path}: invalid config\n{error}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        print(render_config(config))
        for warning in config.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        return 0
    level = args.log_level or config.logging.level
    log_format = args.log_format or config.logging.format
    role = WorkerRole.from_env()
    workers = args.workers if args.workers is not None else config.server.workers
    with configured_logging(level, log_format):
        try:
            if role is None and workers > 1:
                extra = [*(["--simulate"] if args.simulate else []), *(["--no-grpc"] if args.no_grpc else [])]
                extra += [*(["--log-level", args.log_level] if args.log_level else []), *(["--log-format", args.log_format] if args.log_format else [])]
                return supervise(config, path, workers, extra)
            if role is not None:
                config = worker_config(config, role)
            trio.run(lambda: serve(config, path, simulate=args.simulate, grpc=not args.no_grpc, worker=role))
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
