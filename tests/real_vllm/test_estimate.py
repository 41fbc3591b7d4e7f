"""Issue 33, item 3: in front of real vLLM, the estimate learns the model's tokenizer from its usage.

The tiny model's byte-level BPE spends ~2.8 tokens where the rule counts one
on hex. Before any answer, a hex prompt the rule sizes under the input cap
goes through and vLLM refuses it over its context; after eight hex answers
(whole and streamed) tailguard refuses the same prompt itself, at once, with
its own input-cap 400, and /metrics shows the ratio it learnt.
"""

from __future__ import annotations

import re

import httpx

from bench.vllm.engines import SERVED_MODEL, RealEngine
from tests.real_vllm.conftest import TailguardFactory, pool_config

BIG = "deadbeef" * 1300  # 2,608 tokens by the rule (under the cap of 3,072), ~5,200 by the engine's tokenizer


def chat(content: str, *, stream: bool = False) -> dict[str, object]:
    return {"model": SERVED_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0, "stream": stream}


def hex_text(n: int) -> str:
    return "".join(f"{(n * 7919 + i * 104729) % 65536:04x}" for i in range(250))  # 1,000 hex digits, unlike any other


def test_tailguard_learns_hex_from_vllms_usage_and_then_refuses_what_vllm_would(
    engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory
) -> None:
    engine = engines[0]
    with tailguard(pool_config([engine.url], max_model_len=4096, input_cap=3072)) as tg:
        before = httpx.post(f"{tg.url}/v1/chat/completions", json=chat(BIG), timeout=60)
        assert before.status_code == 400 and before.json()["error"]["param"] == "input_tokens"  # vLLM's refusal, relayed
        for n in range(8):
            taught = httpx.post(f"{tg.url}/v1/chat/completions", json=chat(hex_text(n), stream=n % 2 == 1), timeout=60)
            assert taught.status_code == 200, taught.text
        after = httpx.post(f"{tg.url}/v1/chat/completions", json=chat(BIG), timeout=60)
        metrics = httpx.get(f"{tg.url}/metrics", timeout=10).text
    error = after.json()["error"]
    assert after.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "messages" and "over this service's input cap of 3072" in error["message"]  # tailguard's own
    [ratio] = re.findall(rf'^tailguard_prompt_estimate_ratio{{kind="dense",model="{SERVED_MODEL}"}} (\S+)$', metrics, re.M)
    assert 2.0 < float(ratio) < 3.5  # the tiny tokenizer's hex, as bench/results/estimate/ measured it (2.7-2.9)
