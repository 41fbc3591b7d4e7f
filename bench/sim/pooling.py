"""A pooling engine's routes (vLLM's ``--runner pooling --convert embed``): embeddings, rerank, score, pooling.

vLLM 0.32 serves these only from a pooling model, and then serves no
generation (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/messages`` are 404 there, as these are on a generative engine);
``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health`` and ``/metrics``
stay. Every text (an embedding's input, a rerank's query and each document)
is one request in the engine: its prompt is prefilled like a chat's, on the
same seats, step budget and KV cache, and it ends with its prefill, without
a token, so a burst of embeddings loads the engine as their prompts would.

The vectors are the simulator's own: a text's words hashed into
``embedding_size`` dimensions (the hashing trick), normalised; texts that
share words point alike, and a rerank's ``relevance_score`` (a score's
``score``) is the cosine of the query's and the document's vectors, as an
embedding model's is in vLLM. Shapes are vLLM's:

- ``POST /v1/embeddings``: ``input`` (a text, texts, token ids, lists of
  them) or ``messages`` (one chat); ``encoding_format`` "float" or "base64"
  (the float32 bytes); answers ``{"id": "embd-...", "object": "list",
  "created", "model", "data": [{"index", "object": "embedding",
  "embedding"}], "usage"}``.
- ``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``: ``query``, ``documents``,
  ``top_n`` (0: all); answers ``{"id": "score-...", "model", "usage":
  {"prompt_tokens", "total_tokens"}, "results": [{"index", "document":
  {"text", "multi_modal"}, "relevance_score"}]}``, best first.
- ``POST /score``, ``/v1/score``: ``text_1``/``text_2`` (or
  ``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2``),
  1:1, 1:N or N:N; answers ``{"id", "object": "list", "created", "model",
  "data": [{"index", "object": "score", "score"}], "usage"}``.
- ``POST /pooling``: as ``/v1/embeddings``, its items ``{"index", "object":
  "pooling", "data"}``.

A usage counts every text's prompt once (a rerank's query once, beside each
document). An unknown model is vLLM's pooling 404 ("The model `X` does not
exist.", no ``param``).
"""

from __future__ import annotations

import base64
import math
import time
import zlib
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .api_errors import ApiError, FieldError, validation_error, vllm_error
from .generation import Answer, Generation
from .request import Fields, check_input_length, load_json_object, message_contents, require_json_media, unencodable
from .sequence import Sequence
from .tokens import chat_prompt_key, count_chat_tokens, count_text_tokens
from .wire import SimResponse

DEFAULT_EMBEDDING_SIZE = 4096  # an 8B Llama's hidden size: what an embedding converted from it returns
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class _Text:
    """One text to pool: its tokens, what the prefix cache keys it by, its characters (None: token ids) and words."""

    tokens: int
    key: str
    chars: int | None
    words: tuple[str, ...]


def _text(value: str) -> _Text:
    return _Text(count_text_tokens(value), value, len(value), tuple(value.split()) or (value,))


def _ids(value: list[int]) -> _Text:
    words = tuple(map(str, value))
    return _Text(len(value), ",".join(words), None, words)


def embed(words: tuple[str, ...], size: int) -> array[float]:
    """A text's vector: each word adds ±1 at a dimension its hash picks, and the sum is normalised (float32)."""
    vector = [0.0] * size
    for word in words:
        raw = word.encode("utf-8", "surrogatepass")
        vector[zlib.crc32(raw) % size] += 1.0 if zlib.crc32(raw, 0x9E3779B9) & 1 else -1.0
    norm = math.sqrt(sum(value * value for value in vector)) or 1.0
    return array("f", [value / norm for value in vector])


def cosine(a: array[float], b: array[float]) -> float:
    """Two normalised vectors' cosine, as a float32 score."""
    return array("f", [sum(x * y for x, y in zip(a, b, strict=True))])[0]


class Pooling:
    """One pooling engine's routes."""

    def __init__(self, generation: Generation, answer: Answer, *, embedding_size: int = DEFAULT_EMBEDDING_SIZE) -> None:
        if embedding_size < 1:
            raise ValueError(f"embedding_size must be at least 1, got {embedding_size}")
        self._generation = generation
        self._answer = answer
        self.embedding_size = embedding_size

    async def embeddings(self, headers: Mapping[str, str], body: bytes, request_id: str, *, kind: str = "embedding") -> SimResponse:
        """``/v1/embeddings`` (``kind`` "pooling": ``/pooling``, the same vectors under ``data``)."""
        require_json_media(headers.get("content-type"))
        data = load_json_object(body)
        fields = Fields(data)
        self._common(fields)
        encoding = fields.text("encoding_format") or "float"
        if encoding not in (*ENCODING_FORMATS, "bytes", "bytes_only"):
            expected = "'float', 'base64', 'bytes' or 'bytes_only'"
            fields.errors.append(FieldError("literal_error", "body.encoding_format", f"Input should be {expected}", encoding, {"expected": expected}))
        dimensions = fields.integer("dimensions", None)
        texts = _inputs(data, fields)
        if fields.errors:
            raise validation_error(fields.errors)
        self._check_model(data)
        if encoding in ("bytes", "bytes_only"):  # vLLM's binary answer (application/octet-stream): not simulated
            raise ApiError(400, f"the simulator answers encoding_format float or base64, not {encoding!r}", param="encoding_format")
        assert texts is not None
        if not texts:
            raise ApiError(400, "You must pass at least one prompt")
        self._check_lengths(texts)
        if dimensions is not None:
            raise ApiError(
                400,
                f"Model '{self._answer.model}' does not support Matryoshka embeddings; dimensions must be unset "
                f"(received dimensions={dimensions}).",
            )
        await self._run(texts, request_id)
        items = []
        for index, text in enumerate(texts):
            vector = embed(text.words, self.embedding_size)
            value: object = base64.b64encode(vector.tobytes()).decode() if encoding == "base64" else vector.tolist()
            items.append({"index": index, "object": kind, ("data" if kind == "pooling" else "embedding"): value})
        prefix = "pooling" if kind == "pooling" else "embd"
        return SimResponse.json(200, {**self._head(f"{prefix}-{request_id}"), "data": items, "usage": _usage(texts)})

    async def rerank(self, headers: Mapping[str, str], body: bytes, request_id: str) -> SimResponse:
        """``/rerank``, ``/v1/rerank``, ``/v2/rerank``: the documents by relevance to the query, best first."""
        require_json_media(headers.get("content-type"))
        data = load_json_object(body)
        fields = Fields(data)
        self._common(fields)
        query = _score_inputs(data, "query", fields, single=True)
        documents = _score_inputs(data, "documents", fields)
        top_n = fields.integer("top_n", 0, nullable=False)
        if top_n is not None and top_n < 0:
            fields.errors.append(FieldError("greater_than_equal", "body.top_n", "Input should be greater than or equal to 0", data["top_n"], {"ge": 0}))
        if fields.errors:
            raise validation_error(fields.errors)
        assert query is not None and documents is not None
        self._check_model(data)
        _check_pairs(query, documents)
        texts = [_text(text) for text in [*query, *documents]]
        self._check_lengths(texts)
        await self._run(texts, request_id)
        vectors = [embed(text.words, self.embedding_size) for text in texts]
        results = [
            {"index": index, "document": {"text": document, "multi_modal": None}, "relevance_score": cosine(vectors[0], vectors[1 + index])}
            for index, document in enumerate(documents)
        ]
        results.sort(key=lambda result: -float(result["relevance_score"]))  # type: ignore[arg-type]
        if top_n:
            results = results[:top_n]
        prompt = sum(text.tokens for text in texts)
        return SimResponse.json(
            200,
            {"id": f"score-{request_id}", "model": self._answer.model, "usage": {"prompt_tokens": prompt, "total_tokens": prompt}, "results": results},
        )

    async def score(self, headers: Mapping[str, str], body: bytes, request_id: str) -> SimResponse:
        """``/score``, ``/v1/score``: each pair's score (one first text against every second one, or pair by pair)."""
        require_json_media(headers.get("content-type"))
        data = load_json_object(body)
        fields = Fields(data)
        self._common(fields)
        pairs = next(
            ((a, b) for a, b in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")) if a in data and b in data),
            ("text_1", "text_2"),
        )
        first = _score_inputs(data, pairs[0], fields)
        second = _score_inputs(data, pairs[1], fields)
        if fields.errors:
            raise validation_error(fields.errors)
        assert first is not None and second is not None
        self._check_model(data)
        _check_pairs(first, second)
        texts = [_text(text) for text in [*first, *second]]
        self._check_lengths(texts)
        await self._run(texts, request_id)
        vectors = [embed(text.words, self.embedding_size) for text in texts]
        left, right = vectors[: len(first)], vectors[len(first) :]
        items = [
            {"index": index, "object": "score", "score": cosine(left[index if len(left) > 1 else 0], vector)}
            for index, vector in enumerate(right)
        ]
        return SimResponse.json(200, {**self._head(f"score-{request_id}"), "data": items, "usage": _usage(texts)})

    def _common(self, fields: Fields) -> None:
        """Every pooling request's fields (``PoolingBasicRequestMixin``), checked for their types."""
        fields.text("model")
        fields.text("user")
        fields.integer("truncate_prompt_tokens", None)
        fields.integer("priority", 0, nullable=False, bounded=True)

    def _check_model(self, data: Mapping[str, Any]) -> None:
        """The pooling routes' model check (``_maybe_get_adapters``): 404 with no ``param`` and no aliases."""
        model = data.get("model")
        if model and model != self._answer.model:
            raise ApiError(404, f"The model `{model}` does not exist.")
        truncate = data.get("truncate_prompt_tokens")
        if isinstance(truncate, int) and truncate > self._generation.engine.params.max_model_len:
            raise ApiError(400, "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller truncation size.")

    def _check_lengths(self, texts: list[_Text]) -> None:
        generation = self._generation
        limit = generation.engine.params.max_model_len
        for text in texts:
            if text.chars == 0:
                raise ApiError(400, "The decoder prompt cannot be empty")
            error = unencodable([text.key]) if text.chars is not None else None
            check_input_length(text.chars, text.tokens, limit, generation.max_chars_per_token, exact=text.chars is None, encoding_error=error)

    async def _run(self, texts: list[_Text], request_id: str) -> list[Sequence]:
        """Each text as a prefill-only request in the engine (after the admission check of them all); wait for all."""
        generation = self._generation
        generation.admit(len(texts))
        sequences = [
            generation.engine.submit(text.tokens, None, prompt_key=text.key, request_id=f"{request_id}-{index}", prefill_only=True)
            for index, text in enumerate(texts)
        ]
        await generation.finish(sequences)
        return sequences

    def _head(self, response_id: str) -> dict[str, Any]:
        return {"id": response_id, "object": "list", "created": int(time.time()), "model": self._answer.model}


def _inputs(data: Mapping[str, Any], fields: Fields) -> list[_Text] | None:
    """An embedding request's texts: ``input`` (a text, texts, token ids, lists of ids, or chat messages) or
    ``messages`` (one chat, counted as a chat prompt)."""
    messages = data.get("messages")
    value = data.get("input")
    if messages is None and isinstance(value, list) and value and all(isinstance(item, dict) and "role" in item for item in value):
        messages = value
    if messages is not None:
        contents = message_contents(messages)
        key = chat_prompt_key(contents)
        return [_Text(count_chat_tokens(contents), key, sum(map(len, contents)), tuple(" ".join(contents).split()) or (key,))]
    if "input" not in data:
        fields.errors.append(FieldError("missing", "body.input", "Field required", data))
        fields.errors.append(FieldError("missing", "body.messages", "Field required", data))
        return None
    if isinstance(value, str):
        return [_text(value)]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [_text(item) for item in value]
    if isinstance(value, list) and value and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return [_ids(value)]
    if isinstance(value, list) and all(isinstance(item, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in item) for item in value):
        return [_ids(item) for item in value]
    for kind, name in (("list_type", "list"), ("list_type", "list"), ("string_type", "string"), ("list_type", "list")):
        fields.errors.append(FieldError(kind, "body.input", f"Input should be a valid {name}", value))
    return None


def _score_inputs(data: Mapping[str, Any], name: str, fields: Fields, *, single: bool = False) -> list[str] | None:
    """A score or rerank input: a text, or (unless ``single``) a list of texts (the simulator's: no multimodal parts)."""
    if name not in data:
        fields.errors.append(FieldError("missing", f"body.{name}", "Field required", data))
        return None
    value = data[name]
    if isinstance(value, str):
        return [value]
    if not single and isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    fields.errors.append(FieldError("string_type", f"body.{name}", "Input should be a valid string", value))
    return None


def _check_pairs(first: list[str], second: list[str]) -> None:
    """vLLM's ``_validate_score_input_lens``."""
    if len(first) > 1 and len(first) != len(second):
        raise vllm_error("Input lengths must be either 1:1, 1:N or N:N")
    if not first:
        raise vllm_error("At least one text element must be given")
    if not second:
        raise vllm_error("At least one text_pair element must be given")


def _usage(texts: list[_Text]) -> dict[str, Any]:
    prompt = sum(text.tokens for text in texts)
    return {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0, "prompt_tokens_details": None, "completion_tokens_details": None}
