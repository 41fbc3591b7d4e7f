"""The simulator as a process beside the real engines: what the differential tests compare vLLM with."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.vllm.engines import ENGINE_KEY, SERVED_MODEL, RealEngine, free_port, wait_ready

SIM_FLAGS = (
    "--profile", "latency", "--model", SERVED_MODEL, "--api-key", ENGINE_KEY, "--max-num-seqs", "4",
    "--max-model-len", "4096", "--block-size", "128", "--max-chars-per-token", "80",
)  # fmt: skip


def start_sim(log_dir: Path, name: str, flags: Sequence[str] = ()) -> RealEngine:
    """The simulator as a process, answering as the real engines do (their model name, key, seats, context, the CPU
    build's block, the tiny tokenizer's longest token) and with ``flags``; ready when this returns, stopped by its user."""
    port = free_port()
    argv = [sys.executable, "-m", "tailguard.sim", "--port", str(port), *SIM_FLAGS, *flags]
    log_path = log_dir / f"sim-{name}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    engine = RealEngine(name, port, process, log_path, tuple(flags), ENGINE_KEY)
    try:
        wait_ready([engine], timeout=30)
    except BaseException:
        engine.stop()
        raise
    return engine
