"""What tailguard does when real vLLM engines misbehave: callers who hang up, keys, full queues, priorities, hung cores.

Each test drives ``tailguard serve`` over real vLLM 0.32 engines (tests/real_vllm/conftest.py)
and reads what vLLM itself says (its /metrics) beside what callers get.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.real_vllm.conftest import TailguardFactory, pool_config
from tests.real_vllm.engines import ENGINE_KEY, SERVED_MODEL, RealEngine, start_engine, wait_ready
from tests.real_vllm.tailguard_process import Tailguard

CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Say something about routers."}], "max_tokens": 4}


def long_completion(max_tokens: int, *, prompt: str = "Once upon a time", stream: bool = False) -> dict[str, Any]:
    """A completion that generates all of ``max_tokens`` (the random model would stop at any token otherwise)."""
    return {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def running(engine: RealEngine) -> float:
    return engine.metrics().get("vllm:num_requests_running", 0.0)


def wait_for(what: Callable[[], bool], timeout: float, step: float = 0.05) -> float:
    """Seconds until ``what()`` holds (AssertionError past ``timeout``)."""
    start = time.monotonic()
    while not what():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(step)
    return time.monotonic() - start


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def in_threads(calls: Sequence[Callable[[], Any]], then: Callable[[], object] | None = None) -> list[Any]:
    """Run ``calls`` at once, each in a thread of its own, and ``then`` meanwhile here; their results in order
    (an exception is a result)."""
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except Exception as error:  # the test reads it
            results[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # in this order at the router
    if then is not None:
        then()
    for thread in threads:
        thread.join()
    return results


# -- 1. a caller who hangs up ----------------------------------------------------


def test_dropped_stream_aborts_the_generation(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """A caller that drops a long stream while reading it: vLLM stops generating for it within a second.

    (The caller keeps reading until then: vLLM 0.32 generates no further than its
    consumer reads, so a caller that merely stops reading shows no work to abort.)
    """
    engine = engines[0]
    hang_up = threading.Event()
    events = 0

    def read(tg: Tailguard) -> None:
        nonlocal events
        with httpx.stream("POST", f"{tg.url}/v1/completions", json=long_completion(3000, stream=True), timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if hang_up.is_set():
                    return  # leaving the block closes the connection

    with tailguard(pool_config([engine.url], max_model_len=4096, output_cap=3000)) as tg:
        reader = threading.Thread(target=read, args=(tg,))
        reader.start()
        wait_for(lambda: running(engine) == 1, timeout=10.0)
        hang_up.set()
        reader.join()
        took = wait_for(lambda: running(engine) == 0, timeout=1.0)
        assert tg.access_lines()[-1]["outcome"] == "cancelled"
    print(f"stream dropped after {events} events: vLLM running 0 after {took:.2f} s")


def test_caller_timing_out_on_a_whole_answer_aborts_it(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """A caller that gives up waiting for a whole (non-streaming) answer: vLLM stops within a second too."""
    engine = engines[0]
    with tailguard(pool_config([engine.url], output_cap=3000)) as tg:
        [gave_up] = in_threads(
            [lambda: httpx.post(f"{tg.url}/v1/completions", json=long_completion(3000), timeout=httpx.Timeout(30, read=3.0))],
            then=lambda: wait_for(lambda: running(engine) == 1, timeout=3.0),
        )
        assert isinstance(gave_up, httpx.ReadTimeout)
        took = wait_for(lambda: running(engine) == 0, timeout=1.0)
        assert tg.access_lines()[-1]["outcome"] == "cancelled"
    print(f"whole answer given up: vLLM running 0 after {took:.2f} s")


# -- 2. tailguard's key for the engines -------------------------------------------


def test_wrong_engine_key_is_502_upstream_auth_every_time(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """D2: every request, not only the first, gets 502 upstream_auth (not retryable), and the SDK does not retry it."""
    with tailguard(pool_config([engine.url for engine in engines]), key="not-the-engines-key") as tg:
        answers = []
        for _ in range(4):
            answers.append(httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, timeout=30))
            time.sleep(0.6)  # a health check turn between them
        for answer in answers:
            assert answer.status_code == 502, answer.text
            assert error_of(answer)["code"] == "upstream_auth"
            assert answer.headers.get("x-should-retry") == "false"
            assert "retry-after" not in answer.headers
        pools = tg.health()["pools"]
        assert set(pools["main"]["endpoints"].values()) == {"down"}
        assert all("TAILGUARD_TEST_ENGINE_KEY" in reason for reason in pools["main"]["reasons"].values())

        client = openai.OpenAI(base_url=f"{tg.url}/v1", api_key="unused")  # the SDK's own retries (2) left on
        sent = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(
                model=SERVED_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_headers={"x-request-id": "sdk-auth-1"}
            )
        assert caught.value.status_code == 502
        assert time.monotonic() - sent < 2.0  # no backoff, no second try
        tg.access("sdk-auth-1")
        assert sum(line.get("request_id") == "sdk-auth-1" for line in tg.access_lines()) == 1


def test_key_rotated_by_reload_to_another_variable(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """What an operator does when tailguard's key is not the engines' any more: point ``api_key_env`` at the
    variable holding the new key (set in tailguard's environment beside the old one) and reload. The
    environment is read again on a reload, but a running process's environment does not change: the new
    variable must be there from the start."""
    engine = engines[0]
    env = {"TG_ENGINE_KEY_OLD": "retired-key", "TG_ENGINE_KEY_NEW": ENGINE_KEY}
    with tailguard(pool_config([engine.url], api_key_env="TG_ENGINE_KEY_OLD"), env=env) as tg:
        before = httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, timeout=30)
        assert before.status_code == 502 and error_of(before)["code"] == "upstream_auth"
        tg.reload(pool_config([engine.url], api_key_env="TG_ENGINE_KEY_NEW"))
        after = httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, timeout=30)  # at once: a new key deserves a try
        assert after.status_code == 200, after.text
        health = tg.health()["pools"]["main"]
        assert health["endpoints"] == {engine.url: "up"} and "reasons" not in health


def test_engine_restarted_with_another_key_is_found_out(
    vllm_python: str, model_dir: Any, engine_logs: Any, tailguard: TailguardFactory
) -> None:
    """D3: an engine that comes back on its port with another --api-key is found refusing tailguard's key by the
    health check, before any request meets its 401: /health says why, callers get 502 upstream_auth."""
    first = start_engine(vllm_python, model_dir, engine_logs, "rekeyed", key="key-one", flags=("--max-num-seqs", "2"), core=0)
    second: RealEngine | None = None
    try:
        wait_ready([first])
        with tailguard(pool_config([first.url]), key="key-one") as tg:
            assert httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
            first.stop()
            tg.wait_endpoints("down", 1)
            second = start_engine(vllm_python, model_dir, engine_logs, "rekeyed", key="key-two", flags=("--max-num-seqs", "2"), core=0, port=first.port)
            wait_ready([second])
            took = wait_for(lambda: "reasons" in tg.health()["pools"]["main"], timeout=5.0)
            assert tg.health()["pools"]["main"]["endpoints"] == {second.url: "down"}
            answers = [httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, timeout=30) for _ in range(3)]
            assert [(a.status_code, error_of(a)["code"]) for a in answers] == [(502, "upstream_auth")] * 3
            completions_401 = _status_count(second, "/v1/chat/completions", "4xx")
        print(f"restarted engine's new key found refused {took:.2f} s after it was ready; chat calls it answered 4xx: {completions_401}")
        assert completions_401 == 0
    finally:
        first.stop()
        if second is not None:
            second.stop()


def _status_count(engine: RealEngine, handler: str, status: str) -> float:
    """vLLM's ``http_requests_total`` for one route and status class."""
    total = 0.0
    for line in engine.samples().splitlines():
        if line.startswith("http_requests_total{") and f'handler="{handler}"' in line and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- 3. vLLM's own queue full ---------------------------------------------------


def test_queue_full_503_moves_to_a_free_sibling(
    engines: tuple[RealEngine, RealEngine], busy_engine: RealEngine, tailguard: TailguardFactory
) -> None:
    """Another client fills the busy engine (vLLM takes 1 request) while tailguard thinks it has 4 seats:
    the request tailguard places there meets vLLM's queue-full 503 and is moved to the sibling, and served."""
    sibling = engines[0]
    config = pool_config([busy_engine.url, sibling.url], pool_extra='placement = "least_loaded"')
    with tailguard(config) as tg, fill(busy_engine):
        relayed = [
            lambda i=i: httpx.post(f"{tg.url}/v1/completions", json=long_completion(128), headers={"x-request-id": f"full-{i}"}, timeout=60)
            for i in range(4)  # least loaded, at once: some are placed on the busy engine
        ]
        answers = in_threads(relayed)
        assert [a.status_code for a in answers] == [200] * 4, [getattr(a, "text", a) for a in answers]
        moved = [line for line in tg.log_lines() if "busy" in str(line.get("msg", "")) and "trying again" in str(line.get("msg", ""))]
        served_by = {tg.access(f"full-{i}")["endpoint"] for i in range(4)}
    assert moved, "no request met vLLM's queue-full 503"
    assert served_by == {sibling.url}


def test_queue_full_503_without_a_sibling_waits_in_tailguards_queue(busy_engine: RealEngine, tailguard: TailguardFactory) -> None:
    """With no other engine, a request vLLM refused for a full queue waits in tailguard's queue, its class's
    deadline unchanged: served when a seat frees; refused with queue_timeout (not backend_busy) at it."""
    with tailguard(pool_config([busy_engine.url])) as tg:
        with fill(busy_engine, hold=2.0):
            answer = httpx.post(f"{tg.url}/v1/completions", json=long_completion(16), headers={"x-request-id": "wait-1"}, timeout=60)
        assert answer.status_code == 200, answer.text
        served = tg.access("wait-1")
        assert served["queue_ms"] > 1000  # back in line until vLLM had room

        tg.reload(pool_config([busy_engine.url], queue_timeout=1.0))
        with fill(busy_engine, hold=3.0):
            refused = httpx.post(f"{tg.url}/v1/completions", json=long_completion(16), headers={"x-request-id": "wait-2"}, timeout=60)
        line = tg.access("wait-2")
    assert refused.status_code == 503 and error_of(refused)["code"] == "queue_timeout", refused.text
    assert line["queue_ms"] == pytest.approx(1000, abs=50)  # its deadline: a second after it came, not when vLLM said no
    print(f"vLLM's queue full: served after {served['queue_ms']:.0f} ms in tailguard's queue; with a 1 s queue_timeout, refused at {line['queue_ms']:.0f} ms")


@contextmanager
def fill(engine: RealEngine, hold: float = 30.0) -> Iterator[None]:
    """Another client fills ``engine`` (``--max-num-seqs 1 --max-num-queued-reqs 1``: vLLM 0.32 counts running
    and waiting requests against the latter, so one request fills it) for ``hold`` seconds after it runs, or
    until the block ends: a long whole answer, never read, whose connection is then closed (vLLM aborts it).
    A whole answer keeps vLLM's API server idle meanwhile, and its probes quick, on a busy host."""
    body = json.dumps(long_completion(3000)).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{engine.port}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {engine.key}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    client = socket.create_connection(("127.0.0.1", engine.port))
    try:
        client.sendall(head.encode() + body)
        wait_for(lambda: running(engine) == 1, timeout=20)
        timer = threading.Timer(hold, lambda: client.shutdown(socket.SHUT_RDWR))
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
    finally:
        client.close()
