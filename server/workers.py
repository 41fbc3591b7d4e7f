"""``tailguard serve --workers N``: N processes on the same ports, one supervisor, one set of caps.

One Python process serves one core. Several worker processes bind the same
HTTP and gRPC ports with ``SO_REUSEPORT`` (the kernel spreads connections
over them) and share every cap through the ``[cluster]`` ledger; without a
``[cluster]`` in the file the supervisor starts a local ``redis-server`` on
a free loopback port for them (and says so), or refuses to start if there is
none. Each worker's static share of a cap (its fallback while Redis is away)
is 1/N.

The supervisor restarts a worker that dies (after a short pause, so a
crash loop does not spin), forwards SIGHUP (each worker reloads the file on
its own, atomically), and on SIGTERM or SIGINT forwards it and waits for the
workers to drain (a second one is forwarded too: stop at once).

With ``--simulate`` worker 0 runs the simulated engines; every worker is
given the flag, and the others wait for worker 0's engines to listen before
they ask them anything (``server/app.py``): a pool without ``max_model_len``
asks its engines at start, and a worker that asked before worker 0 had them
up exited with status 2, stopping them all.

Metrics are per process: worker ``i`` also serves the whole HTTP API on its
own port, ``http_port + 1 + i``, so Prometheus scrapes each worker there
(the shared port answers from whichever worker the kernel picked).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from tailguard.router.config import ClusterConfig, Config

log = logging.getLogger("tailguard.workers")

WORKER_ENV = "TAILGUARD_WORKER"  # "INDEX/COUNT", set for each worker process
CLUSTER_ENV = "TAILGUARD_WORKERS_REDIS"  # the supervisor's local redis URL, when the file has no [cluster]
_RESTART_PAUSE = 1.0  # seconds before a dead worker is started again
_GRACE = 15.0  # seconds a worker may take past its drain before it is killed


@dataclass(frozen=True)
class WorkerRole:
    """Which worker this process is, of how many."""

    index: int
    count: int

    @property
    def replica(self) -> str:
        return f"{socket.gethostname()}-worker-{self.index}"

    def own_port(self, http_port: int) -> int:
        """The port only this worker serves (its /metrics for Prometheus)."""
        return http_port + 1 + self.index

    @staticmethod
    def from_env() -> WorkerRole | None:
        text = os.environ.get(WORKER_ENV)
        if not text:
            return None
        index, _, count = text.partition("/")
        return WorkerRole(int(index), int(count))


def worker_config(config: Config, role: WorkerRole) -> Config:
    """The file's config as this worker runs it: the shared ledger, its replica id and share."""
    cluster = config.cluster
    if cluster is None:
        url = os.environ.get(CLUSTER_ENV)
        if url is None:
            raise RuntimeError(f"worker {role.index} started without [cluster] and without {CLUSTER_ENV}")
        cluster = ClusterConfig(redis_url=url)
    cluster = dataclasses.replace(
        cluster,
        replica_id=cluster.replica_id or role.replica,
        static_share=min(cluster.static_share, math.floor(1e6 / role.count) / 1e6),
    )
    return dataclasses.replace(config, cluster=cluster)


def supervise(config: Config, config_path: Path, workers: int, extra_args: Sequence[str]) -> int:
    """Run ``workers`` worker processes until a signal ends them; returns the exit status."""
    # What start-up made (every module the CLI imported) is left out of every later
    # collection, the interpreter's last one at exit too: collecting it was most of
    # the time an idle supervisor took to exit (workers freeze theirs in app.py).
    gc.freeze()
    return trio.run(_supervise, config, config_path.resolve(), workers, list(extra_args))


async def _supervise(config: Config, config_path: Path, workers: int, extra_args: list[str]) -> int:
    env = dict(os.environ)
    async with trio.open_nursery() as nursery:
        redis: trio.Process | None = None
        if config.cluster is None:
            redis, url = await _local_redis(nursery)
            env[CLUSTER_ENV] = url
            log.info("workers: no [cluster] in %s: started redis-server at %s for the shared caps", config_path, url)
        grace = config.timeouts.drain_timeout + _GRACE
        supervisor = _Supervisor(config_path, workers, extra_args, env, grace)
        try:
            await supervisor.run()
            status = supervisor.exit_status
        finally:
            if redis is not None:
                redis.terminate()
                with trio.move_on_after(5):
                    await redis.wait()
        nursery.cancel_scope.cancel()
    return status


async def _local_redis(nursery: trio.Nursery) -> tuple[trio.Process, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "tailguard: --workers needs a shared ledger: add [cluster] redis_url to the config, "
            "or install redis-server (apt-get install redis-server) so tailguard can start one"
        )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process: trio.Process = await nursery.start(
        functools.partial(trio.run_process, command, stdout=subprocess.DEVNULL, check=False)
    )
    with trio.fail_after(10):
        while True:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.05)
                continue
            await stream.aclose()
            break
    return process, f"redis://127.0.0.1:{port}/0"


class _Supervisor:
    def __init__(self, config_path: Path, workers: int, extra_args: list[str], env: dict[str, str], grace: float) -> None:
        self._config_path = config_path
        self._count = workers
        self._extra = extra_args
        self._env = env
        self._grace = grace  # a drain's longest time, and then some: past it, workers are killed
        self._processes: dict[int, trio.Process] = {}
        self._stopping = False
        self._none_left = trio.Event()  # set once stopping and the last worker has exited
        self.exit_status = 0
        self._nursery: trio.Nursery | None = None

    async def run(self) -> None:
        with trio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for index in range(self._count):
                    nursery.start_soon(self._keep_running, index)
                async for signum in signals:
                    self._forward(signum)
                    if signum != signal.SIGHUP and not self._stopping:
                        self._stopping = True
                        nursery.start_soon(self._stop, nursery.cancel_scope)

    def _nursery_scope_stop(self) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._stop, self._nursery.cancel_scope)

    def _forward(self, signum: int) -> None:
        name = signal.Signals(signum).name
        log.info("workers: forwarding %s to %d workers", name, len(self._processes))
        for process in self._processes.values():
            if process.returncode is None:
                process.send_signal(signum)

    async def _keep_running(self, index: int) -> None:
        """Start worker ``index``; start it again whenever it dies, until the supervisor stops."""
        while not self._stopping:
            command = [sys.executable, "-m", "tailguard.server", "serve", "--config", str(self._config_path), *self._extra]
            env = {**self._env, WORKER_ENV: f"{index}/{self._count}"}
            process = await trio.lowlevel.open_process(command, env=env)
            self._processes[index] = process
            log.info("workers: worker %d started (pid %d)", index, process.pid)
            try:
                status = await process.wait()
            finally:
                self._processes.pop(index, None)
                if self._stopping and not self._processes:
                    self._none_left.set()
            if self._stopping:
                log.info("workers: worker %d exited (%d)", index, status)
                return
            if status == 2:  # a config or listen error: starting it again would fail the same way
                log.error("workers: worker %d could not start (status 2); stopping the others", index)
                self.exit_status = 2
                self._stopping = True
                self._forward(signal.SIGTERM)
                self._nursery_scope_stop()
                return
            log.warning("workers: worker %d died (status %d); starting it again in %g s", index, status, _RESTART_PAUSE)
            await trio.sleep(_RESTART_PAUSE)

    async def _stop(self, scope: trio.CancelScope) -> None:
        """Wait for every worker to drain and exit; kill the ones still there after the grace."""
        with trio.move_on_after(self._grace):
            # Each worker's watcher is already in its Process.wait() (a second waiter on
            # the same process would contend for its pidfd); the last one to see its
            # worker exit says so, at once rather than at a poll's next tick.
            if self._processes:
                await self._none_left.wait()
        for index, process in list(self._processes.items()):
            log.warning("workers: worker %d did not stop within %g s; killing it", index, self._grace)
            process.kill()
            await process.wait()
        scope.cancel()
