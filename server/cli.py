"""``tailguard``: serve the router, or check a config file."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import get_args

import trio

from tailguard.router.config import Config, ConfigError, LogLevel, load_config, parse_listen, render_config

from . import SHIPPED_CONFIG
from .app import ListenError, StartupError, serve
from .logs import configured_logging
from .workers import WorkerRole, supervise, worker_config

_CONFIG_HELP = "config file (default: ./config.toml if there is one, else the shipped one)"


def _default_config() -> Path:
    local = Path("config.toml")
    return local if local.exists() else SHIPPED_CONFIG


def _listen(text: str) -> tuple[str, int]:
    """A --http-listen/--grpc-listen value, checked as the config's *_listen keys are."""
    try:
        return parse_listen(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}, got {text!r}") from None


def _version() -> str:
    """The installed distribution's version: the one a bug report needs, whatever the checkout says."""
    try:
        return importlib.metadata.version("tailguard")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailguard", description="A tail-latency router in front of vLLM.")
    parser.add_argument("--version", action="version", version=f"tailguard {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="run the router")
    serve_cmd.add_argument("--config", type=Path, default=None, help=_CONFIG_HELP)
    serve_cmd.add_argument(
        "--simulate",
        action="store_true",
        help="also run a simulated vLLM engine for every endpoint in the config (no GPU needed)",
    )
    serve_cmd.add_argument(
        "--no-grpc", action="store_true", help="serve only the HTTP API (no gRPC, no asyncio thread)"
    )
    serve_cmd.add_argument(
        "--http-listen", type=_listen, default=None, metavar="HOST:PORT", help="where the HTTP API listens (overrides server.http_listen)"
    )
    serve_cmd.add_argument(
        "--grpc-listen", type=_listen, default=None, metavar="HOST:PORT", help="where the gRPC API listens (overrides server.grpc_listen)"
    )
    serve_cmd.add_argument(
        "--workers", type=int, default=None, help="processes serving the same ports, caps shared through [cluster] (default: server.workers)"
    )
    serve_cmd.add_argument(
        "--log-level", type=str.upper, choices=get_args(LogLevel), default=None, help="logging level (default: the config's logging.level)"
    )
    serve_cmd.add_argument(
        "--log-format", choices=("json", "text"), default=None, help="log line format (default: the config's logging.format)"
    )
    check = commands.add_parser("check-config", help="validate a config and print the effective settings")
    where = check.add_mutually_exclusive_group()
    where.add_argument("path", type=Path, nargs="?", default=None, help=_CONFIG_HELP)
    where.add_argument("--config", type=Path, default=None, help="the same, as serve takes it")
    commands.add_parser("init", help="write a starting config.toml from what the engines serve (see: init --help)")
    commands.add_parser("advise", help="predict the best split of engines between pools from a trace or access log (see: advise --help)")
    return parser


def _overrides(args: argparse.Namespace) -> list[str]:
    """The command line's overrides of the config, as arguments again (for worker processes)."""
    extra: list[str] = []
    for flag, value in (("--http-listen", args.http_listen), ("--grpc-listen", args.grpc_listen)):
        if value is not None:
            host, port = value
            extra += [flag, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    extra += [*(["--log-level", args.log_level] if args.log_level else []), *(["--log-format", args.log_format] if args.log_format else [])]
    return extra


def _prepared(args: argparse.Namespace, role: WorkerRole | None) -> Callable[[Config], Config]:
    """What the process does to the file's config, at start and on every reload: the flags win."""

    def prepare(config: Config) -> Config:
        server, logging = config.server, config.logging
        if args.http_listen is not None:
            server = dataclasses.replace(server, http_host=args.http_listen[0], http_port=args.http_listen[1])
        if args.grpc_listen is not None:
            server = dataclasses.replace(server, grpc_host=args.grpc_listen[0], grpc_port=args.grpc_listen[1])
        if args.log_level is not None:
            logging = dataclasses.replace(logging, level=args.log_level)
        if args.log_format is not None:
            logging = dataclasses.replace(logging, format=args.log_format)
        config = dataclasses.replace(config, server=server, logging=logging)
        return config if role is None else worker_config(config, role)

    return prepare


def _startup_error(error: BaseException) -> StartupError | None:
    """The StartupError that ``error`` is, or that an exception group holds with nothing else."""
    if isinstance(error, StartupError):
        return error
    if isinstance(error, BaseExceptionGroup):
        matched, rest = error.split(StartupError)
        if matched is not None and rest is None:
            leaf: BaseException = matched
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            return leaf if isinstance(leaf, StartupError) else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["advise"]:
        # Imported only here: the fleet model is not needed to serve.
        from .advise.cli import main as advise

        return advise(argv[1:])
    if argv[:1] == ["init"]:
        from .init_config import main as init

        return init(argv[1:])
    args = build_parser().parse_args(argv)
    path: Path = args.config or getattr(args, "path", None) or _default_config()
    try:
        config = load_config(path)
    except ConfigError as error:
        print(f"tailguard: {path}: invalid config\n{error}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        for warning in config.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        try:
            print(f"config file: {path.absolute()}\n{render_config(config)}", flush=True)
        except BrokenPipeError:  # `tailguard check-config | head`: the reader had what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    role = WorkerRole.from_env()
    prepare = _prepared(args, role)
    workers = args.workers if args.workers is not None else config.server.workers
    config = prepare(config)
    failure: StartupError | None = None
    with configured_logging(config.logging.level, config.logging.format):
        try:
            if role is None and workers > 1:
                extra = [*(["--simulate"] if args.simulate else []), *(["--no-grpc"] if args.no_grpc else []), *_overrides(args)]
                return supervise(config, path, workers, extra)
            trio.run(lambda: serve(config, path, simulate=args.simulate, grpc=not args.no_grpc, worker=role, prepare=prepare))
        except KeyboardInterrupt:
            pass
        except (StartupError, BaseExceptionGroup) as error:
            failure = _startup_error(error)
            if failure is None:
                raise
    if failure is not None:  # after the log lines before it are written
        print(f"tailguard: {_named_by_flags(failure, args)}", file=sys.stderr)
        return 2
    return 0


def _named_by_flags(error: StartupError, args: argparse.Namespace) -> str:
    """The error's line, naming the flag rather than the config key when a flag set the address."""
    if isinstance(error, ListenError):
        flag = {"server.http_listen": "--http-listen", "server.grpc_listen": "--grpc-listen"}.get(error.key)
        if flag is not None and getattr(args, flag[2:].replace("-", "_")) is not None:
            return f"cannot listen on {error.address} ({flag}): {error.reason}"
    return str(error)


if __name__ == "__main__":
    sys.exit(main())
