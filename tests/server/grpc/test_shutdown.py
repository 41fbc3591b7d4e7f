"""Stopping with gRPC health watchers connected (server/grpc/health.py): they are told NOT_SERVING and let go.

A client with client-side health checking holds a ``Health.Watch`` stream
open all the time; grpc's ``stop(grace)`` waited its whole grace (5 s) for
it, so an idle tailguard took 5 s to exit on SIGTERM.
"""

from __future__ import annotations

from functools import partial

import grpc
import trio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tailguard.server.app import Running, serve
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, engines_on_sockets

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SLOW = QUICK.replace(base_ms=10.0)  # 120 tokens: ~1.2 s


async def test_an_idle_server_with_a_health_watcher_stops_at_once() -> None:
    async with engines_on_sockets([QUICK, QUICK]) as backends:
        config = two_pool_config(interactive_urls=[backends.urls[0]], batch_urls=[backends.urls[1]])
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(partial(serve, config, None, http_port=0, grpc=True, grpc_port=0))
            with grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
                assert (await trio.to_thread.run_sync(next, watch)).status == SERVING
                asked = trio.current_time()
                running.drain.set()  # what SIGTERM does
                rest = await trio.to_thread.run_sync(list, watch)  # to its end
        took = trio.current_time() - asked  # serve() has returned: the nursery is done
    assert took < 0.5, f"an idle server took {took:.2f} s to stop"  # grpc's whole grace before: 5 s
    assert [answer.status for answer in rest] == [NOT_SERVING] and watch.code() == grpc.StatusCode.OK


async def test_a_watcher_is_let_go_while_a_call_in_flight_drains() -> None:
    async with engines_on_sockets([SLOW, QUICK]) as backends:
        config = two_pool_config(interactive_urls=[backends.urls[0]], batch_urls=[backends.urls[1]])
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(partial(serve, config, None, http_port=0, grpc=True, grpc_port=0))
            with grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
                assert (await trio.to_thread.run_sync(next, watch)).status == SERVING
                request = pb.ChatRequest(messages=[pb.Message(role="user", content="hi")], options=pb.Options(max_tokens=120))
                stream = pb_grpc.CompletionsStub(channel).ChatStream(request)
                chunks = [await trio.to_thread.run_sync(next, stream)]
                running.drain.set()  # what SIGTERM does
                rest = await trio.to_thread.run_sync(list, watch)
                assert [answer.status for answer in rest] == [NOT_SERVING] and watch.code() == grpc.StatusCode.OK
                assert not stream.done()  # the call still runs: the watcher was let go without waiting for it
                chunks.extend(await trio.to_thread.run_sync(list, stream))
    assert stream.code() == grpc.StatusCode.OK and chunks[-1].usage.completion_tokens == 120  # drained, not cut
