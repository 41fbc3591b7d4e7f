"""Repro of finding 5: tailguard with [cluster] on SIGTERM (graceful drain) -> exit code and traceback.

``--no-cluster``: the same without [cluster] (exit 0).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.procs import free_ports

ROOT = Path(__file__).resolve().parents[2]  # the repository: the simulator and tailguard run from it


def main() -> None:
    e1, e2, rp, hp, gp = free_ports(5)
    tmp = Path(tempfile.mkdtemp())
    redis_args = ["redis-server", "--port", str(rp), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    redis = subprocess.Popen(redis_args, stdout=subprocess.DEVNULL)
    sim_args = [sys.executable, "-m", "tailguard.sim", "--engines", f"{e1}:instant,{e2}:instant"]
    sim = subprocess.Popen(sim_args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cluster = {} if "--no-cluster" in sys.argv else {"cluster": {"redis_url": f"redis://127.0.0.1:{rp}/0", "replica_id": "only"}}
    pools = PoolSpec("interactive", [(e1, 64)], 64, 64), PoolSpec("batch", [(e2, 64)], 64, 64)
    (tmp / "c.toml").write_text(tailguard_config(hp, gp, *pools, sections=cluster))
    time.sleep(2)
    serve = [sys.executable, "-m", "tailguard.server", "serve", "--config", str(tmp / "c.toml"), "--no-grpc", "--log-level", "WARNING"]
    tg = subprocess.Popen(serve, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    time.sleep(6)
    tg.send_signal(signal.SIGTERM)
    _, err = tg.communicate(timeout=30)
    print("exit code", tg.returncode)
    print("\n".join(err.strip().splitlines()[-3:]))
    for p in (sim, redis):
        p.kill()


if __name__ == "__main__":
    main()
