"""``POST /v1/chat/completions`` and ``POST /v1/completions``, shaped as vLLM 0.32 answers them.

A completion request goes through vLLM's stages in its order
(``request.py``): its validation, the model name, the admission queue (503),
the renderer's length checks, ``SamplingParams``; then the engine. Bodies
carry vLLM's fields, nulls included, and ``system_fingerprint`` where vLLM
puts it.

Streams are framed by concatenating precomputed bytes: one chunk of bytes per
engine step per connection, however many tokens it carries, and no JSON
encoder on the per-token path (unless logprobs are asked for).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from .engine import Engine
from .generation import Answer, Generation, timing, whole_timing
from .logprobs import chat_logprobs, completion_logprobs
from .request import CompletionRequest, check_model, parse
from .sequence import Sequence
from .tokens import TOKEN_JSON, detokenize
from .wire import SSE_HEADERS, SimResponse


class Completions:
    """The two completion routes of one engine."""

    def __init__(self, generation: Generation, answer: Answer) -> None:
        self._generation = generation
        self._answer = answer

    async def complete(self, chat: bool, headers: Mapping[str, str], body: bytes, request_id: str) -> SimResponse:
        """One chat or completion request, whole or streamed (``request_id``: the caller's X-Request-Id, else a new id)."""
        request = parse(chat, headers.get("content-type"), body)
        check_model(request, self._answer.model)
        generation = self._generation
        generation.admit(request.n)
        max_tokens = generation.render(request)
        sequences = generation.submit(request, max_tokens, request_id)
        if request.stream:
            return SimResponse(200, list(SSE_HEADERS), stream=TokenStream(generation.engine, sequences, request, self._answer, request_id))
        await generation.finish(sequences)
        return SimResponse.json(200, self._body(request, sequences, request_id))

    def _body(self, request: CompletionRequest, sequences: list[Sequence], request_id: str) -> dict[str, Any]:
        chat, top = request.chat, request.logprobs
        choices: list[dict[str, Any]] = []
        for index, sequence in enumerate(sequences):
            text = detokenize(sequence.token_ids)
            reason = sequence.finish_reason
            if chat:
                logprobs = None if top is None else chat_logprobs(sequence.token_ids, 0, top)
                message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None}
                choices.append({
                    "index": index,
                    "message": {**message, "function_call": None, "reasoning": None},
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                })
            else:
                logprobs = None if top is None else completion_logprobs(sequence.token_ids, 0, 0, top)[0]
                choices.append({
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "routed_experts": None,
                })
        body: dict[str, Any] = {
            "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self._answer.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self._answer.fingerprint,
            "usage": usage(sequences, self._answer, chat=chat, stream=False),
        }
        if chat:
            body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        metrics: dict[str, Any] | None = None
        if self._answer.per_request_metrics and len(sequences) == 1:  # pydantic's model_dump: every field, nulls too
            metrics = whole_timing(sequences[0])
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=metrics)
        return body



class _Choice:
    """One of a stream's choices: its sequence, the tokens sent, and its event bytes around a token."""

    __slots__ = ("sequence", "index", "seen", "closed", "prefix", "middle", "plain", "tail", "offset")

    def __init__(self, sequence: Sequence, index: int, head: str, *, chat: bool) -> None:
        self.sequence = sequence
        self.index = index
        self.seen = 0
        self.closed = False  # its finish reason was sent
        self.offset = 0  # characters of output sent (completion logprobs' text_offset)
        if chat:
            self.prefix = f'data: {head},"choices":[{{"index":{index},"delta":{{"content":'.encode()
            self.middle = b'},"logprobs":'
            self.tail = b',"stop_reason":null,"token_ids":null}]'  # after a finish reason
            self.plain = self.middle + b'null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            self.prefix = f'data: {head},"choices":[{{"index":{index},"text":'.encode()
            self.middle = b',"logprobs":'
            self.tail = b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
            self.plain = self.middle + b'null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'

    @property
    def ready(self) -> bool:
        """It has tokens not sent yet, or an end not told yet."""
        sequence = self.sequence
        return len(sequence.token_ids) > self.seen or (sequence.finished and not self.closed)


class TokenStream:
    """SSE bytes of one streaming request (each of its ``n`` choices' events by index); closing it early aborts them.

    As vLLM 0.32 streams: a chat opens each choice with a role event; every
    token event carries the nulls vLLM's chunks carry; a choice's last
    event carries its finish reason, and ``system_fingerprint`` too unless
    a usage event follows, which then carries it.
    """

    def __init__(
        self, engine: Engine, sequences: list[Sequence], request: CompletionRequest, answer: Answer, request_id: str
    ) -> None:
        chat = request.chat
        self._engine = engine
        self._sequences = sequences
        self._include_usage = request.include_usage
        self._logprobs = request.logprobs
        self._answer = answer
        self._done = False
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": answer.model,
        }
        self._head = json.dumps(head, separators=(",", ":"))[:-1]  # without the closing brace
        self._choices = [_Choice(sequence, index, self._head, chat=chat) for index, sequence in enumerate(sequences)]
        fingerprint = json.dumps(answer.fingerprint).encode()
        self._closing_tail = b"}\n\n" if request.include_usage else b',"system_fingerprint":' + fingerprint + b"}\n\n"
        if chat:
            role = b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n'
            self._pending = b"".join(
                f'data: {self._head},"choices":[{{"index":{index},"delta":'.encode() + role for index in range(len(sequences))
            )
        else:
            self._pending = b""
        self._chat = chat

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        choices = self._choices
        waiting = next((c for c in choices if not c.closed), None)
        if waiting is not None and not any(c.ready for c in choices):
            await waiting.sequence.wait_for_tokens(waiting.seen)
        out = self._pending
        self._pending = b""
        for choice in choices:
            out += self._fresh(choice)
        if all(c.closed for c in choices):
            self._done = True
            if not any(c.sequence.finish_reason == "abort" for c in choices):
                out += self._closing()
        return out

    def _fresh(self, choice: _Choice) -> bytes:
        """One choice's new tokens as events, the last with its finish reason once it ended."""
        sequence = choice.sequence
        ids = sequence.token_ids
        first = choice.seen
        fresh = ids[first:]
        choice.seen = len(ids)
        finished = sequence.finished and sequence.finish_reason != "abort"
        # As vLLM does, the last token's chunk carries the finish reason.
        last = fresh[-1:] if finished else []
        body = fresh[: len(fresh) - len(last)]
        # vLLM sends a chat stream's role chunk with the first output, after
        # the prefill: the first byte of a stream marks its first token.
        if self._logprobs is None:
            prefix, plain = choice.prefix, choice.plain
            out = b"".join(prefix + TOKEN_JSON[i] + plain for i in body)
        else:
            out = b"".join(self._event(choice, token, first + n, None) for n, token in enumerate(body))
        if last:
            out += self._event(choice, last[0], first + len(body), sequence.finish_reason)
        if sequence.finished and not choice.closed:
            choice.closed = True
            if not last and sequence.finish_reason != "abort":  # finished without a new token: the reason goes alone
                out += self._event(choice, None, first, sequence.finish_reason)
        return out

    def _event(self, choice: _Choice, token: int | None, position: int, reason: str | None) -> bytes:
        """One token's event (or, with no token, a bare finish reason), logprobs and finish reason included."""
        text = TOKEN_JSON[token] if token is not None else b'""'
        if self._logprobs is None or token is None:
            logprobs = b"null"
        elif self._chat:
            logprobs = json.dumps(chat_logprobs([token], position, self._logprobs), separators=(",", ":")).encode()
        else:
            values, choice.offset = completion_logprobs([token], position, choice.offset, self._logprobs)
            logprobs = json.dumps(values, separators=(",", ":")).encode()
        if reason is None:
            return choice.prefix + text + choice.plain.replace(b"null", logprobs, 1)
        return choice.prefix + text + choice.middle + logprobs + b',"finish_reason":' + json.dumps(reason).encode() + choice.tail + self._closing_tail

    async def aclose(self) -> None:
        """Stop reading: a sequence still in the engine is aborted at once."""
        self._done = True
        for sequence in self._sequences:
            self._engine.abort(sequence)

    def _closing(self) -> bytes:
        out = b""
        if self._include_usage:
            counts = usage(self._sequences, self._answer, chat=self._chat, stream=True)
            fields = {"choices": [], "usage": counts, "system_fingerprint": self._answer.fingerprint}
            if self._answer.per_request_metrics and len(self._sequences) == 1:  # vLLM leaves them out for n > 1
                fields["metrics"] = timing(self._sequences[0])
            out += f"data: {self._head},{json.dumps(fields, separators=(',', ':'))[1:]}\n\n".encode()
        return out + b"data: [DONE]\n\n"


def usage(sequences: list[Sequence], answer: Answer, *, chat: bool, stream: bool) -> dict[str, Any]:
    """A response's usage, as vLLM 0.32 counts and shapes it: the prompt once, every choice's output.

    ``prompt_tokens_details`` only with ``--enable-prompt-tokens-details``,
    and then always (``cached_tokens: 0`` included); a chat adds
    ``created_cache_tokens``, the prompt's full blocks it cached anew. A
    whole response carries the nulls (``prompt_tokens_details`` without the
    flag, ``completion_tokens_details``); a stream's usage leaves them out.
    """
    first = sequences[0]
    completion = sum(len(sequence.token_ids) for sequence in sequences)
    prompt = first.prompt_tokens
    details: dict[str, Any] | None = None
    if answer.prompt_tokens_details:
        created: int | None = None
        block = answer.cache_block
        if chat and block is not None:
            created = (prompt // block - first.cached_tokens // block) * block
        details = {"cached_tokens": first.cached_tokens, "created_cache_tokens": created, "multimodal_tokens": None}
        if stream:
            details = {key: value for key, value in details.items() if value is not None}
    usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    if stream:
        if details is not None:
            usage["prompt_tokens_details"] = details
        return usage
    usage["prompt_tokens_details"] = details
    usage["completion_tokens_details"] = None
    return usage


