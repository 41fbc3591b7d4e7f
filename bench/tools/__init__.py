"""Generators run from a checkout, never installed: docs/limits.md from config.toml, the gRPC code from proto/."""
