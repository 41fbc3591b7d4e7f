"""The tailguard process: the CLI, the HTTP and gRPC front ends, reload, workers."""

from __future__ import annotations

from pathlib import Path

# The shipped reference config, installed as package data (a link to the
# repository's top-level config.toml, so there is one copy of it; resolved,
# so the log names the real file).
SHIPPED_CONFIG = (Path(__file__).parent / "config.toml").resolve()
