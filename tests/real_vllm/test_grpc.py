"""The gRPC front end in front of real vLLM: the same answer as HTTP, and vLLM's 400 in gRPC's words."""

from __future__ import annotations

import grpc
import httpx

from bench.vllm.engines import SERVED_MODEL, RealEngine
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tests.real_vllm.conftest import TailguardFactory, pool_config

PROMPT = "Tell me about the sea."


def test_grpc_unary_and_stream_match_vllms_answer(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    engine = engines[0]
    direct = httpx.post(
        f"{engine.url}/v1/chat/completions",
        json={"model": SERVED_MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0},
        headers=engine.headers(),
        timeout=60,
    ).json()
    request = pb.ChatRequest(model=SERVED_MODEL, messages=[pb.Message(role="user", content=PROMPT)], options=pb.Options(max_tokens=6, temperature=0))
    with tailguard(pool_config([engine.url]), grpc=True) as tg, grpc.insecure_channel(str(tg.grpc_target)) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        whole = stub.Chat(request, timeout=60)
        chunks = list(stub.ChatStream(request, timeout=60))
        try:
            stub.Chat(pb.ChatRequest(model=SERVED_MODEL, messages=[pb.Message(role="user", content=PROMPT)], options=pb.Options(max_tokens=6, temperature=-1)), timeout=30)
            refused = None
        except grpc.RpcError as error:
            refused = error
    assert whole.content == direct["choices"][0]["message"]["content"]
    assert whole.usage.prompt_tokens == direct["usage"]["prompt_tokens"] and whole.usage.completion_tokens == 6
    assert "".join(chunk.content for chunk in chunks) == whole.content
    assert [chunk.finish_reason for chunk in chunks if chunk.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 6
    assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature must be non-negative" in str(refused.details())
