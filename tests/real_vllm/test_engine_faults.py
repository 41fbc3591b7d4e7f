"""What tailguard does when real vLLM engines misbehave: callers who hang up, keys, full queues, priorities, hung cores.

Each test drives ``tailguard serve`` over real vLLM 0.32 engines (tests/real_vllm/conftest.py)
and reads what vLLM itself says (its /metrics) beside what callers get.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.vllm.engines import ENGINE_KEY, SERVED_MODEL, RealEngine, wait_ready
from tests.real_vllm.conftest import TailguardFactory, pool_config
from tests.real_vllm.tailguard_process import Tailguard

CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Say something about routers."}], "max_tokens": 4}


def long_completion(max_tokens: int, *, prompt: str = "Once upon a time", stream: bool = False) -> dict[str, Any]:
    """A completion that generates all of ``max_tokens`` (the random model would stop at any token otherwise)."""
    return {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def running(engine: RealEngine) -> float:
    return engine.metrics().get("vllm:num_requests_running", 0.0)


def waiting(engine: RealEngine) -> float:
    return engine.metrics().get("vllm:num_requests_waiting", 0.0)


STALL_S = 0.5  # one poll that took longer than its step and this: the host stalled, not the engine


def wait_for(until: Callable[[], bool], timeout: float, step: float = 0.05, what: Callable[[], str] = lambda: "") -> float:
    """Seconds until ``until()`` holds (AssertionError past ``timeout``, with ``what()`` in its message).

    ``timeout`` counts the time the host ran: a poll that took over ``step`` + ``STALL_S``
    (CI's 2 cores once froze the whole machine for ~20 s: a SIGKILLed process took over 5 s to
    go) counts as ``step`` + ``STALL_S``. The wall clock is bounded too, at ten times ``timeout``
    and a minute more. Returns the wall-clock seconds it took.
    """
    start = time.monotonic()
    counted = 0.0
    last = start
    while not until():
        now = time.monotonic()
        counted += min(now - last, step + STALL_S)
        last = now
        if counted > timeout or now - start > 10 * timeout + 60:
            raise AssertionError(f"not within {timeout} s (host time; {now - start:.1f} s wall) {what()}")
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
    outcome: list[object] = []  # what ended the reader early (a status, an exception), for the failure message

    def read(tg: Tailguard) -> None:
        nonlocal events
        try:
            with httpx.stream("POST", f"{tg.url}/v1/completions", json=long_completion(3000, stream=True), timeout=30) as response:
                if response.status_code != 200:
                    outcome.append(f"{response.status_code} {response.read()!r}")
                    return
                for line in response.iter_lines():
                    events += line.startswith("data: ")
                    if hang_up.is_set():
                        return  # leaving the block closes the connection
                outcome.append(f"the stream ended by itself after {events} events")
        except Exception as error:  # the test reads it
            outcome.append(error)

    with tailguard(pool_config([engine.url], max_model_len=4096, output_cap=3000)) as tg:
        wait_for(lambda: running(engine) == 0, timeout=30.0, what=lambda: "vLLM was still running an earlier request")
        tg.wait_endpoints("up", 1)
        generated = engine.metrics().get("vllm:generation_tokens_total", 0.0)
        reader = threading.Thread(target=read, args=(tg,))
        reader.start()
        # Tokens reaching the caller show the generation running (vLLM's gauges, read while it generates on
        # 2 cores, came seconds late: CI and a run here saw the whole stream end first).
        wait_for(lambda: events >= 20 or not reader.is_alive(), timeout=30.0, what=lambda: f"after {events} events")
        assert reader.is_alive(), f"the stream ended early: {outcome}"
        hang_up.set()
        reader.join()
        assert not outcome, outcome
        took = wait_for(lambda: running(engine) == 0, timeout=1.0)
        # vLLM's own count: a one-token request after the hang-up ends with nothing left running there, and the
        # dropped stream never generated its 3,000 tokens.
        after = httpx.post(f"{engine.url}/v1/completions", json=long_completion(1), headers=engine.headers(), timeout=60)
        assert after.status_code == 200, after.text
        assert running(engine) == 0 and waiting(engine) == 0
        spent = engine.metrics().get("vllm:generation_tokens_total", 0.0) - generated - 1
        assert spent < 2500, f"vLLM generated {spent:.0f} of the dropped stream's 3,000 tokens"
        assert tg.access_lines()[-1]["outcome"] == "cancelled"
    print(f"stream dropped after {events} events: vLLM running 0 after {took:.2f} s, {spent:.0f} tokens generated in all")


def test_caller_timing_out_on_a_whole_answer_aborts_it(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """A caller that gives up waiting for a whole (non-streaming) answer: tailguard's abort reaches vLLM, which
    drops the request instead of generating its 3,000 tokens.

    The request reaches vLLM while its core is stopped, so the caller gives up (after 2 s) before any answer
    whatever the host's speed (this one generates the 3,000 tokens in 9-12 s, and an 8 s patience here once
    saw the whole answer arrive), and vLLM's API server, with nothing generating, hears the hang-up at
    once. Resumed, the core takes the request and its abort together: a one-token request sent after them
    ends with nothing left running there, and the long one generated (almost) nothing. (A stream dropped
    while vLLM generates it is the test above.)"""
    engine = engines[0]
    with tailguard(pool_config([engine.url], output_cap=3000)) as tg:
        wait_for(lambda: running(engine) == 0, timeout=30.0, what=lambda: "vLLM was still running an earlier request")
        tg.wait_endpoints("up", 1)
        generated = engine.metrics().get("vllm:generation_tokens_total", 0.0)
        engine.hang()
        try:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{tg.url}/v1/completions", json=long_completion(3000), timeout=httpx.Timeout(30, read=2.0))
            wait_for(lambda: bool(tg.access_lines()), timeout=5.0, what=lambda: "tailguard's access line")
            assert tg.access_lines()[-1]["outcome"] == "cancelled"
        finally:
            engine.resume()
        after = httpx.post(f"{engine.url}/v1/completions", json=long_completion(1), headers=engine.headers(), timeout=60)
        assert after.status_code == 200, after.text
        assert running(engine) == 0 and waiting(engine) == 0
        spent = engine.metrics().get("vllm:generation_tokens_total", 0.0) - generated
    assert spent < 100, f"vLLM generated {spent:.0f} tokens: the given-up request ran on"
    print(f"whole answer given up: vLLM generated {spent:.0f} tokens in all, then ran nothing")


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


# -- 3. vLLM's own queue full ---------------------------------------------------


def test_queue_full_503_moves_to_a_free_sibling(
    engines: tuple[RealEngine, RealEngine], busy_engine: RealEngine, tailguard: TailguardFactory
) -> None:
    """Another client fills the busy engine (vLLM takes 1 request) while tailguard thinks it has 4 seats:
    the request tailguard places there meets vLLM's queue-full 503 and is moved to the sibling, and served."""
    sibling = engines[0]
    # Whole answers only (no byte until each ends): a probe timeout above the API server's stalls on 2 busy
    # cores (operations.md, "Health checks") keeps this test about vLLM's 503, not about a probe's verdict.
    config = pool_config([busy_engine.url, sibling.url], pool_extra='placement = "least_loaded"', health_check_timeout=5.0)
    with tailguard(config) as tg, fill(busy_engine), httpx.Client(timeout=60) as http:
        relayed = [
            lambda i=i: http.post(f"{tg.url}/v1/completions", json=long_completion(128), headers={"x-request-id": f"full-{i}"})
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
    and waiting requests against the latter, so one request fills it) for ``hold`` seconds, or until the block
    ends: a long whole answer, never read, whose connection is then closed (vLLM aborts it).

    The engine's core is stopped (SIGSTOP) before the filler is sent and until the hold ends: vLLM's API
    server counts the filler and refuses another request for a full queue (AsyncLLM's QueueOverflowError)
    with no step run. Nothing is read from vLLM while it generates: on a 2-core host its core and worker
    take both cores while they do (a core polling its worker, the worker's threads), and a /metrics read
    or a probe then waits seconds for the host (CI failed so, twice: 20 s of polls that saw nothing)."""
    # The previous test's filler may still run: vLLM notices a closed connection of a whole answer late.
    wait_for(lambda: running(engine) == 0 and waiting(engine) == 0, timeout=20)
    engine.hang()
    try:
        client = _filler(engine)

        def release() -> None:  # the hang-up first: the core, resumed, finds the filler aborted
            client.shutdown(socket.SHUT_RDWR)
            engine.resume()

        timer = threading.Timer(hold, release)
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            client.close()
    finally:
        engine.resume()


def _filler(engine: RealEngine, tries: int = 3) -> socket.socket:
    """The filler's connection, once vLLM refuses another request because of it (its core stopped: see
    :func:`fill`). A probe that vLLM took instead (it came first) waits for the stopped core: it is given up,
    which aborts it, and the filler, refused meanwhile, is sent again."""
    body = json.dumps(long_completion(3000)).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{engine.port}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {engine.key}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    seen: list[str] = []
    for _ in range(tries):
        client = socket.create_connection(("127.0.0.1", engine.port))
        client.sendall(head.encode() + body)
        full = refuses(engine, timeout=5.0)
        client.setblocking(False)
        try:  # vLLM answers a whole answer only at its end, and its core is stopped: any byte is a refusal
            answered = client.recv(4096)
        except BlockingIOError:
            answered = b""
        client.setblocking(True)
        if full and not answered:
            return client
        seen.append(f"refused another: {full}; the filler answered {answered[:80]!r}")
        client.close()
    raise AssertionError(f"vLLM never held the filler and refused another ({seen})")


def refuses(engine: RealEngine, timeout: float = 30.0) -> bool:
    """Whether ``engine`` answers a one-token request 503 now (its queue is full); not within ``timeout`` (a
    stopped core holds a request it took) is False, and the request is given up."""
    body = {"model": SERVED_MODEL, "prompt": "full?", "max_tokens": 1}
    try:
        answer = httpx.post(f"{engine.url}/v1/completions", json=body, headers=engine.headers(), timeout=timeout)
    except httpx.TimeoutException:
        return False
    return answer.status_code == 503


# -- 4. priorities in vLLM's own queue ---------------------------------------------

URGENT = """
[classes.urgent]
pool = "main"
max_output_tokens = 128
queue_timeout = 30.0
"""


# vLLM (--max-num-seqs 4) holds the four batch requests and the urgent one in its queue when its core
# resumes. By priority the urgent one is seated at once and one batch request waits for it (a short
# wait); in order the four batch requests are seated and the urgent one waits for them all (a long one).
BATCH_TOKENS = (900,) * 4
URGENT_TOKENS = 100


@pytest.mark.parametrize("vllm_priority", [True, False])
def test_vllm_priority_seats_the_urgent_class_first_in_vllms_queue(
    engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory, vllm_priority: bool
) -> None:
    """tailguard seats more than vLLM runs (16 seats, --max-num-seqs 4), so requests wait in vLLM's queue. With
    ``vllm_priority`` the urgent class's request (priority 0) is seated there before the batch ones (1) that
    wait there with it; without it (the control) vLLM seats it after them.

    Every request reaches vLLM while its core is stopped, so its queue holds them all when it resumes,
    whatever the host's speed. The verdict is vLLM's own clock: the time its requests spent queued, as a
    share of the time they ran (its histograms' sums): by priority ~1/36 (one batch request waits for 100
    tokens), in order ~1/4 (the urgent one waits for 900). The order answers reach a caller cannot tell:
    on a 2-core host vLLM's API server can hold finished answers for seconds and send them together (six
    answers generated over 3 s arrived at once here, to a caller with no router in between), and CI
    failed earlier forms that read vLLM's gauges while it generated."""
    engine = engines[1]
    # A burst of whole answers can keep vLLM's API server from answering /health for seconds on a busy
    # 2-core host, and an engine sending no byte while a probe times out is taken for a hung one: a probe
    # timeout longer than that stall keeps this test about priorities. The probe is /health alone
    # ("http"): the engine's core is held stopped while the requests are sent, which a completion
    # probe would rightly call hung.
    extra = f'vllm_priority = {str(vllm_priority).lower()}\nhealth_check = "http"'
    config = pool_config([engine.url], seats=16, classes_before=URGENT, pool_extra=extra, health_check_timeout=15.0)
    ended: dict[str, str] = {}  # a request's name: how it ended, and when (seconds into the test)
    start = time.monotonic()
    batch = [f"low-{i}" for i in range(len(BATCH_TOKENS))]

    def call(name: str, max_tokens: int) -> None:
        try:
            answer = http.post(f"{tg.url}/v1/completions", json=long_completion(max_tokens), headers={"x-request-id": name})
        except httpx.HTTPError as error:
            ended[name] = f"{error!r} at {time.monotonic() - start:.1f} s"
            raise
        ended[name] = f"{answer.status_code} at {time.monotonic() - start:.1f} s"
        assert answer.status_code == 200, answer.text

    def urgent() -> None:
        """Once tailguard has sent the batch, the urgent request; once that is sent too, the core resumes."""
        try:
            wait_for(lambda: tg_sent(tg, len(batch)), timeout=30, what=lambda: f"of the batch sent (ended: {ended}); tailguard said: {said(tg)}")
            high = threading.Thread(target=lambda: call("high", URGENT_TOKENS))
            high.start()
            wait_for(lambda: tg_sent(tg, len(batch) + 1), timeout=30, what=lambda: f"of all sent (ended: {ended}); tailguard said: {said(tg)}")
            assert not ended, f"requests ended while vLLM's core was stopped: {ended}"
        finally:
            engine.resume()
        high.join()

    # One client for all: httpx.post builds a client, and its TLS context, per call (100s of ms on a busy host).
    with tailguard(config) as tg, httpx.Client(timeout=180) as http:
        wait_for(lambda: running(engine) == 0 and waiting(engine) == 0, timeout=30, what=lambda: "an idle engine")
        before = engine.metrics()
        engine.hang()
        try:
            results = in_threads([functools.partial(call, name, tokens) for name, tokens in zip(batch, BATCH_TOKENS, strict=True)], then=urgent)
        finally:
            engine.resume()
        assert not [result for result in results if result is not None], ended
        assert ended.get("high", "").startswith("200"), ended
        after = engine.metrics()
        lines = {name: tg.access(name) for name in ["high", *batch]}
    assert lines["high"]["class"] == "urgent" and lines["low-0"]["class"] == "all"

    def spent(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert spent("vllm:request_queue_time_seconds_count") == len(batch) + 1
    queued, ran = spent("vllm:request_queue_time_seconds_sum"), spent("vllm:request_inference_time_seconds_sum")
    print(f"vllm_priority = {vllm_priority}: vLLM's requests queued {queued:.2f} s, ran {ran:.2f} s (a share of {queued / ran:.3f})")
    if vllm_priority:
        assert queued / ran < 0.1
    else:
        assert queued / ran > 0.15


def said(tg: Tailguard, last: int = 12) -> list[str]:
    """The last lines tailguard logged, each cut to what a failure message can carry."""
    return [f"{line.get('msg', '')} {line.get('status', '')} {line.get('request_id', '')}"[:160] for line in tg.log_lines()[-last:]]


def tg_sent(tg: Tailguard, count: int) -> bool:
    """Whether tailguard has ``count`` requests in flight to its engines (its /metrics)."""
    text = httpx.get(f"{tg.url}/metrics", timeout=5).text
    return any(line.startswith("tailguard_pool_in_flight") and float(line.rsplit(" ", 1)[1]) >= count for line in text.splitlines())


# -- 5. prefix affinity, read from vLLM's own prefix cache ----------------------------


def shared_prefix(seed: str, chars: int = 3000) -> str:
    """A prompt start no engine has seen (``seed`` first), long enough for several of vLLM's 128-token CPU blocks
    and past the 1,024 characters tailguard's prefix key covers."""
    words = random.Random(seed).choices(["router", "engine", "prefix", "cache", "tail", "queue", "seat", "pool", "token", "block"], k=chars)
    return (seed + " " + " ".join(f"{word}{i % 97}" for i, word in enumerate(words)))[:chars]


def cache_counters(engines: tuple[RealEngine, RealEngine]) -> list[tuple[float, float]]:
    """Each engine's (prefix cache hits, queries) so far, in tokens."""
    counters = [engine.metrics() for engine in engines]
    return [(m.get("vllm:prefix_cache_hits_total", 0.0), m.get("vllm:prefix_cache_queries_total", 0.0)) for m in counters]


def test_prefix_affinity_keeps_a_shared_prefix_on_one_engines_cache(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """20 requests sharing a ~700-token prefix, one after another, over two engines: with prefix affinity (the
    default) one engine serves them all and its vLLM prefix cache hits grow, the other's do not; placed by load
    alone (``least_loaded``, round robin's equal on one-at-a-time traffic) both engines prefill it and cache it."""
    urls = [engine.url for engine in engines]
    found: dict[str, list[tuple[float, float]]] = {}
    cold: dict[str, int] = {}  # answers whose usage says under 4 blocks were cached: the prefix prefilled afresh
    with tailguard(pool_config(urls)) as tg, httpx.Client(timeout=60) as http:
        for placement in ("prefix_affinity", "least_loaded"):
            tg.reload(pool_config(urls, pool_extra=f'placement = "{placement}"'))
            prefix = shared_prefix(f"{placement}-{time.time_ns()}")
            before = cache_counters(engines)
            cold[placement] = 0
            for i in range(20):
                body = {"model": SERVED_MODEL, "prompt": f"{prefix} question {i}:", "max_tokens": 2, "temperature": 0}
                answer = http.post(f"{tg.url}/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
                cold[placement] += (answer.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) < 512
            time.sleep(0.5)  # the last step's counters
            after = cache_counters(engines)
            found[placement] = [(hits - hits0, queries - queries0) for (hits, queries), (hits0, queries0) in zip(after, before, strict=True)]
    for placement, deltas in found.items():
        print(f"{placement}: per engine (prefix cache hit tokens, query tokens) = {deltas}")
    affinity = sorted(found["prefix_affinity"], reverse=True)
    assert affinity[1] == (0.0, 0.0)  # the other engine saw none of them
    assert affinity[0][0] >= 19 * 512  # every request but the first found 4+ blocks of 128 tokens cached
    spread = found["least_loaded"]
    assert all(hits > 0 for hits, _ in spread)  # both engines prefilled and cached the prefix
    # One more cold prefill, and the cache holds it twice. (Counted per answer: the two runs' prefixes differ in
    # length, so their totals of cached tokens are not comparable: a prefix ending mid-block caches a block less.)
    assert (cold["prefix_affinity"], cold["least_loaded"]) == (1, 2), cold


# -- 6. an engine core that hangs while vLLM's /health stays 200 -------------------------

HUNG_WINDOW = 10.0  # seconds of traffic after the core stops, at most (2.5 s past the verdict is enough to see)
FIRST_BYTE = 8.0  # the pools' first_byte_timeout here (60 s shipped): what a call waits on a hung engine the health check missed


@pytest.mark.parametrize("kind", ["auto", "completion", "http"])
def test_hung_engine_core_is_found_by_the_health_check(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory, kind: str) -> None:
    """SIGSTOP an engine's core (and its worker): vLLM's API server answers /health 200 and takes requests that
    never get a byte. With the shipped probe timing (every 2 s, 1 s to answer), ``health_check`` decides how long
    tailguard keeps sending there: "auto" and "completion" find it and move its waiting streams to the sibling;
    "http" never does, and each stream placed there waits out first_byte_timeout before it is tried elsewhere.

    Also measured, on the idle pool before the hang: the probes' cost in vLLM requests per second per engine.
    """
    hung, sibling = engines
    config = pool_config(
        [hung.url, sibling.url],
        health_check_interval=2.0,
        health_check_timeout=1.0,
        pool_extra=f'health_check = "{kind}"\nfirst_byte_timeout = {FIRST_BYTE}',
    )
    results: dict[str, tuple[float, float, int]] = {}  # request id -> (sent after the hang, seconds, status)

    def ask(name: str, sent: float) -> None:
        body = {**long_completion(4, prompt=f"{name} is a question of its own", stream=True)}
        start = time.monotonic()
        with http.stream("POST", f"{tg.url}/v1/completions", json=body, headers={"x-request-id": name}) as answer:
            answer.read()
        results[name] = (sent, time.monotonic() - start, answer.status_code)

    with tailguard(config) as tg, httpx.Client(timeout=60) as http:
        tg.wait_endpoints("up", 2)
        counted = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
        before = [engine.metrics() for engine in engines]
        idle = 4.0  # two probe turns
        time.sleep(idle)
        after = [engine.metrics() for engine in engines]
        # Per engine, per second: requests, prompt tokens, generated tokens (the probes' work; nothing else is sent).
        cost = [[(a.get(name, 0.0) - b.get(name, 0.0)) / idle for name in counted] for a, b in zip(after, before, strict=True)]
        probes_per_second = [requests for requests, _, _ in cost]

        threads: list[threading.Thread] = []
        down_after: float | None = None
        stopped = time.monotonic()
        hung.hang()
        try:
            # Until 2.5 s past the verdict (what "nothing waits on it" needs to see), or HUNG_WINDOW without one.
            while (elapsed := time.monotonic() - stopped) < (HUNG_WINDOW if down_after is None else down_after + 2.5):
                thread = threading.Thread(target=ask, args=(f"{kind}-{len(threads)}", elapsed))
                thread.start()
                threads.append(thread)
                if down_after is None and tg.health()["pools"]["main"]["endpoints"][hung.url] == "down":
                    down_after = elapsed
                time.sleep(0.5)
            for thread in threads:
                thread.join()
        finally:
            hung.resume()
        lines = {name: tg.access(name) for name in results}
    served_by_hung = [name for name, line in lines.items() if line["endpoint"] == hung.url]
    slow = sorted(round(seconds, 1) for _, seconds, _ in results.values() if seconds > 2.0)
    failed = [name for name, (_, _, status) in results.items() if status != 200]
    print(
        f"health_check = {kind!r}: on the idle pool, per engine per second, (requests, prompt tokens, generated tokens)"
        f" {cost}; hung core down on /health {down_after} s after it stopped (the first call it left unanswered"
        f" was sent at {min((sent for sent, seconds, _ in results.values() if seconds > 2.0), default=None)} s); {len(results)} streams sent over {elapsed:.1f} s,"
        f" {len(failed)} failed, {len(slow)} waited over 2 s ({slow}), {len(served_by_hung)} served by the hung engine"
    )
    assert not failed and not served_by_hung
    if kind == "http":
        assert down_after is None  # /health is all it asks
        assert slow and min(slow) >= FIRST_BYTE  # each stream placed there waited out first_byte_timeout
        assert probes_per_second == [0.0, 0.0]
    else:
        assert down_after is not None
        # "completion" probes whether or not a call waits; "auto" once a call has waited a whole turn unanswered.
        stuck = [sent for sent, seconds, _ in results.values() if seconds > 2.0]
        found_in = down_after - (0.0 if kind == "completion" or not stuck else min(stuck))
        assert found_in <= 6.0, found_in
        assert all(seconds < FIRST_BYTE for _, seconds, _ in results.values())  # moved when it was found, not timed out
        late = [seconds for sent, seconds, _ in results.values() if sent > down_after + 1.0]
        assert late and max(late) < 2.0  # once it is down, nothing waits on it
        # A probe every 2 s: 1 to 3 in the 4 s window, by where its edges fall ("auto": none on an idle pool).
        assert all(0.25 <= probes <= 0.75 for probes in probes_per_second) if kind == "completion" else probes_per_second == [0.0, 0.0]


# -- 7. tailguard init against a real engine ---------------------------------------------


def test_init_says_it_assumed_the_engines_max_num_seqs(engines: tuple[RealEngine, RealEngine], tmp_path: Path) -> None:
    """D9: vLLM 0.32 reports its context (GET /v1/models) but not its --max-num-seqs (4 here): not in /v1/models,
    not in /metrics (vllm:cache_config_info carries the cache's fields only), /server_info only in its dev mode.
    So ``tailguard init`` writes the context it read and says loudly, in the file and on stdout, that the seats
    per engine are assumed."""
    engine = engines[0]
    written = tmp_path / "init.toml"
    argv = [sys.executable, "-m", "tailguard.server", "init", "--endpoint", engine.url, "--api-key-env", "TG_INIT_KEY", "--output", str(written)]
    run = subprocess.run(argv, env={**os.environ, "TG_INIT_KEY": ENGINE_KEY}, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    text = written.read_text()
    assert "max_model_len = 4096" in text
    [seats] = re.findall(r"max_concurrency = (\d+) }", text)
    assert "--max-num-seqs" not in engine.samples()  # nothing to read it from
    assert "ASSUMED" in text and "--max-num-seqs" in text
    assert f"max_concurrency {seats} per engine ASSUMED" in run.stdout
    print(run.stdout)


# -- last, as it restarts the busy engine: an engine back on its port with another key ---------


def test_engine_restarted_with_another_key_is_found_out(busy_engine: RealEngine, tailguard: TailguardFactory) -> None:
    """D3: an engine that comes back on its port with another --api-key is found refusing tailguard's key by the
    health check, before any request meets its 401: /health says why, callers get 502 upstream_auth.

    (The busy engine is the one restarted: the ``busy_engine`` fixture gives the next test that asks for it
    its key back.)"""
    engine = busy_engine
    with tailguard(pool_config([engine.url]), key=ENGINE_KEY) as tg:
        assert httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        engine.stop()
        tg.wait_endpoints("down", 1)
        engine.restart(key="engine-key-2")
        wait_ready([engine])
        took = wait_for(lambda: "reasons" in tg.health()["pools"]["main"], timeout=5.0)
        assert tg.health()["pools"]["main"]["endpoints"] == {engine.url: "down"}
        answers = [
            httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": f"rekeyed-{i}"}, timeout=30) for i in range(3)
        ]
        assert [(a.status_code, error_of(a)["code"]) for a in answers] == [(502, "upstream_auth")] * 3
        sent = [tg.access(f"rekeyed-{i}")["endpoint"] for i in range(3)]
    print(f"restarted engine's new key found refused {took:.2f} s after it was ready")
    assert sent == [None] * 3  # answered by tailguard: none was sent to meet the 401 (vLLM does not count its 401s)
