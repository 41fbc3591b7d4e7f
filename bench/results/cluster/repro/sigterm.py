"""Repro: tailguard with [cluster] on SIGTERM (graceful drain) -> exit code and traceback."""
from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.procs import free_ports

e1, e2, rp, hp, gp = free_ports(5)
tmp = Path(tempfile.mkdtemp())
redis = subprocess.Popen(["redis-server", "--port", str(rp), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
sim = subprocess.Popen([sys.executable, "-m", "tailguard.sim", "--engines", f"{e1}:instant,{e2}:instant"], cwd=sys.path[0], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
cluster = [] if "--no-cluster" in sys.argv else ["[cluster]", f'redis_url = "redis://127.0.0.1:{rp}/0"', 'replica_id = "only"', ""]
(tmp / "c.toml").write_text(tailguard_config(hp, gp, PoolSpec("interactive", [(e1, 64)], 64, 64), PoolSpec("batch", [(e2, 64)], 64, 64), sections=cluster))
time.sleep(2)
tg = subprocess.Popen([sys.executable, "-m", "tailguard.server", "serve", "--config", str(tmp / "c.toml"), "--no-grpc", "--log-level", "WARNING"], cwd=sys.path[0], stderr=subprocess.PIPE, text=True)
time.sleep(6)
tg.send_signal(signal.SIGTERM)
_, err = tg.communicate(timeout=30)
print("exit code", tg.returncode)
print("\n".join(err.strip().splitlines()[-3:]))
for p in (sim, redis):
    p.kill()
