"""A pooling engine (vLLM's ``--runner pooling --convert embed``): embeddings, rerank, score, and no generation
(against a running vLLM: tests/real_vllm/test_routes_differential.py)."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import pytest
import trio
import trio.testing

from tailguard.sim.__main__ import build_parser, main
from tailguard.sim.tokens import count_text_tokens
from tests.helpers.engines import MODEL
from tests.sim.apps import FAST, app_client

POOLING: dict[str, Any] = {"runner": "pooling", "embedding_size": 64}


async def test_embeddings_are_deterministic_unit_vectors_and_cost_prefill_only(autojump_clock: trio.testing.MockClock) -> None:
    texts = ["hello there", "general kenobi", "hello there"]
    async with app_client(**POOLING) as (engine, client):
        start = trio.current_time()
        reply = await client.post("/v1/embeddings", json={"model": MODEL, "input": texts}, headers={"x-request-id": "e-1"})
        took = trio.current_time() - start
        encoded = (await client.post("/v1/embeddings", json={"input": "hello there", "encoding_format": "base64"})).json()
        stats = engine.statistics()
    body = reply.json()
    assert reply.status_code == 200 and (body["id"], body["object"], body["model"]) == ("embd-e-1", "list", MODEL)
    vectors = [item["embedding"] for item in body["data"]]
    assert [item["index"] for item in body["data"]] == [0, 1, 2] and {item["object"] for item in body["data"]} == {"embedding"}
    assert all(len(vector) == 64 and math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-5) for vector in vectors)
    assert vectors[0] == vectors[2] != vectors[1]
    prompt = sum(count_text_tokens(text) for text in texts)
    assert body["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0, "prompt_tokens_details": None, "completion_tokens_details": None}
    assert list(struct.unpack("64f", base64.b64decode(encoded["data"][0]["embedding"]))) == vectors[0]
    # each text a request of the engine: its prompt prefilled in a step, no token generated
    assert (stats.prompt_tokens_total, stats.generation_tokens_total, stats.finished_total, stats.running) == (prompt + 3, 0, 4, 0)
    assert 0 < took < 0.05


async def test_rerank_sorts_by_cosine_and_score_pairs_texts(autojump_clock: trio.testing.MockClock) -> None:
    documents = ["nothing at all", "hello there", "hello"]
    async with app_client(**POOLING) as (_, client):
        ranked = {path: (await client.post(path, json={"query": "hello", "documents": documents})).json() for path in ("/rerank", "/v1/rerank", "/v2/rerank")}
        top = (await client.post("/rerank", json={"query": "hello", "documents": documents, "top_n": 1})).json()
        scored = (await client.post("/score", json={"text_1": "hello", "text_2": documents})).json()
        paired = (await client.post("/v1/score", json={"queries": ["hello", "x"], "documents": ["hello", "x"]})).json()
    results = ranked["/rerank"]["results"]
    assert [r["index"] for r in results] == [2, 1, 0] and results[0]["relevance_score"] == pytest.approx(1.0)
    assert results[1]["relevance_score"] == pytest.approx(1 / math.sqrt(2)) and results[0]["document"] == {"text": "hello", "multi_modal": None}
    assert all(answer["results"] == results for answer in ranked.values())
    prompt = sum(count_text_tokens(text) for text in ["hello", *documents])
    assert ranked["/rerank"]["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt}
    assert ranked["/rerank"]["id"].startswith("score-") and top["results"] == results[:1]
    assert [item["score"] for item in scored["data"]] == [r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])]
    assert [item["score"] for item in paired["data"]] == pytest.approx([1.0, 1.0])


async def test_a_pooling_engine_serves_no_generation_and_a_generating_one_no_pooling(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM registers each route set by the model's runner: the others are FastAPI's 404."""
    async with app_client(**POOLING) as (_, pooling), app_client() as (_, generating):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
            reply = await pooling.post(path, json={"input": "x"})
            assert (reply.status_code, reply.json()) == (404, {"detail": "Not Found"}), path
        for path in ("/v1/embeddings", "/pooling", "/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score"):
            reply = await generating.post(path, json={"input": "x"})
            assert (reply.status_code, reply.json()) == (404, {"detail": "Not Found"}), path
        assert (await pooling.post("/tokenize", json={"prompt": "hello"})).json()["count"] == 2


@pytest.mark.parametrize(
    ("path", "body", "status", "message", "param"),
    [
        ("/v1/embeddings", {"model": "x", "input": "a"}, 404, "The model `x` does not exist.", None),
        ("/v1/embeddings", {"input": ""}, 400, "The decoder prompt cannot be empty", None),
        ("/v1/embeddings", {"input": []}, 400, "You must pass at least one prompt", None),
        ("/v1/embeddings", {"input": "a", "dimensions": 8}, 400, f"Model '{MODEL}' does not support Matryoshka embeddings; dimensions must be unset (received dimensions=8).", None),
        ("/v1/embeddings", {"input": list(range(4097))}, 400, "This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=4097)", "input_tokens"),
        ("/rerank", {"query": "a", "documents": []}, 400, "At least one text_pair element must be given", None),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "Input lengths must be either 1:1, 1:N or N:N", None),
    ],
)  # fmt: skip
async def test_pooling_refusals_are_vllms(
    autojump_clock: trio.testing.MockClock, path: str, body: dict[str, object], status: int, message: str, param: str | None
) -> None:
    async with app_client(**POOLING) as (engine, client):
        reply = await client.post(path, json=body)
        assert engine.statistics().prompt_tokens_total == 0
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    assert (reply.status_code, reply.json()) == (status, {"error": {"message": message, "type": kind, "param": param, "code": status}})


async def test_missing_fields_are_pydantics_errors(autojump_clock: trio.testing.MockClock) -> None:
    async with app_client(**POOLING) as (_, client):
        embeddings = await client.post("/v1/embeddings", json={"model": MODEL})
        rerank = await client.post("/rerank", json={"query": "q"})
    assert (embeddings.json()["error"]["type"], embeddings.json()["error"]["param"]) == ("Bad Request", "body.input")
    assert (rerank.json()["error"]["type"], rerank.json()["error"]["param"]) == ("Bad Request", "body.documents")


async def test_a_burst_of_embeddings_takes_seats_and_steps(autojump_clock: trio.testing.MockClock) -> None:
    """Prefill-only requests share the batch as chats do: 8 texts of 1,000 tokens on 2 seats take 4 steps' turns."""
    texts = [f"{number:04d}" + "abcd" * 999 for number in range(8)]  # unique: no prefix-cache hit
    params = FAST.replace(max_num_seqs=2, max_num_batched_tokens=4096)
    async with app_client(params, **POOLING) as (engine, client):
        start = trio.current_time()
        reply = await client.post("/v1/embeddings", json={"input": texts})
        took = trio.current_time() - start
        stats = engine.statistics()
    assert reply.status_code == 200 and stats.max_running_seen == 2 and stats.steps == 4
    assert took == pytest.approx(4 * params.step_ms(2, 2000, 2000) / 1000)


def test_the_cli_takes_vllms_runner_and_convert_flags() -> None:
    assert build_parser().parse_args(["--runner", "pooling", "--convert", "embed"]).runner == "pooling"
    with pytest.raises(SystemExit):
        main(["--runner", "generate", "--convert", "embed", "--port", "1"])
