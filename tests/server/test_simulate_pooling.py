"""``serve --simulate`` with the shipped file's embeddings block: the embedding pool's engine is a pooling one.

The shipped config.toml carries ``[pools.embeddings]`` and ``[classes.embeddings]``
commented out; uncommented, a newcomer's simulated fleet answers embeddings
and rerank beside chat, each in its own class and pool.
"""

from __future__ import annotations

import re
from functools import partial

import httpx
import trio

from tailguard.router.config import Config, parse_config
from tailguard.server.app import Running, serve
from tailguard.server.simulate import pooling_pool
from tests.helpers.process import ROOT, free_port


def shipped_with_embeddings(http: int) -> Config:
    """The shipped config on free ports, its commented embeddings pool and class switched on."""
    text = (ROOT / "config.toml").read_text()
    block = text[text.index("# [pools.embeddings]") : text.index("# priority = 0", text.index("# [classes.embeddings]")) + len("# priority = 0")]
    text = text.replace(block, re.sub(r"(?m)^# ?", "", block))
    for port in (":8001", ":8002", ":8003"):
        text = text.replace(port, f":{free_port()}")
    return parse_config(text.replace("127.0.0.1:8080", f"127.0.0.1:{http}"))


async def test_the_shipped_embeddings_block_serves_embeddings_and_rerank_beside_chat() -> None:
    http = free_port()
    config = shipped_with_embeddings(http)
    assert [pool.name for pool in config.pools if pooling_pool(config, pool.name)] == ["embeddings"]
    shutdown = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(partial(serve, config, None, simulate=True, http_port=http, shutdown=shutdown))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http}", timeout=10) as client:
                embedded = await client.post("/v1/embeddings", json={"model": "sim-embed", "input": ["a text", "another"]})
                assert embedded.status_code == 200, embedded.text
                assert len(embedded.json()["data"]) == 2 and embedded.headers["x-tailguard-class"] == "embeddings"
                ranked = await client.post("/v1/rerank", json={"model": "sim-embed", "query": "q", "documents": ["x", "y"]})
                assert ranked.status_code == 200 and len(ranked.json()["results"]) == 2
                chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                assert chat.status_code == 200 and chat.headers["x-tailguard-class"] == "interactive"
            assert running.router.pool("embeddings").statistics().in_flight == 0
            shutdown.set()
