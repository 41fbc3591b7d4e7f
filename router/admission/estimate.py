"""Size estimate of a prompt without a tokenizer, split by kind of text.

The raw rule is an upper bound of the simulator's tokenizer rule
(``bench/sim/tokens.py``) for any Unicode text, checked by a property test
(tests/router/admission/test_estimate.py). With the defaults:

- a CJK character (the ranges below) is ``1 / cjk_chars_per_token`` token;
- all other text is one token per ``chars_per_token`` UTF-8 *bytes*: for
  ASCII that is the familiar 4 characters a token, while 2-, 3- and 4-byte
  characters (Cyrillic, Thai, emoji) cost 2, 3 and 4 times as much, since a
  byte-level tokenizer may spend a token per few bytes of them;
- every text rounds up on its own; a chat adds ``per_message_tokens`` per
  message and once more for the assistant's reply that the template opens;
- every field vLLM renders into the prompt counts: message content (text
  parts of a list too), a non-standard role, every other message field
  (``name``, ``tool_calls``, ``tool_call_id``, ...) and the prompt-shaping
  parameters in _PROMPT_PARAMS (``tools``, schemas, ...), structured ones by
  their JSON text.

A real model's tokenizer is no such rule: a small byte-level BPE spends a
token per byte on what it never learned to merge (3 a CJK character, 1 a
punctuation mark or hex digit). So the estimate is also split by *kind* of
text (:data:`KINDS`), for :mod:`router.admission.prompt_ratios` to learn each model's
real-to-estimated ratio per kind from the engines' usage and correct it.
The kinds are what tokenizers treat differently, told apart by C-speed
passes over the bytes (one ``bytes.translate`` to a class a byte, then
``bytes.count`` per class and chunk), never a loop per character:

- ``words``: ASCII letters and whitespace of text with word breaks (prose,
  code): what every tokenizer merges best;
- ``dense``: ASCII digits anywhere (tokenizers split numbers into digits or
  short groups), and the letters that do not read as words, judged 1 KiB at
  a time: those beyond ``_WORD`` per space or symbol (hex, base64, keys),
  or the share of random ones that the vowels give (a fifth of random
  letters are vowels; of English, code and JSON a third or more);
- ``symbols``: ASCII punctuation, symbols and control characters (code,
  markup, JSON): often a token each;
- ``cjk``: the CJK characters, by count;
- ``other``: every other non-ASCII character, by UTF-8 bytes (accented
  Latin, Cyrillic, Arabic, Thai, emoji): merged well by a model trained on
  them, a token a byte by one that was not;
- ``template``: the ``per_message_tokens`` of a chat: the chat template's
  role markers, which a model may spell as one special token or many.

The backend's tokenizer is the truth, and vLLM still refuses what does not
fit; the estimate only has to be cheap (an ASCII fast path) and, corrected,
rarely low.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import NamedTuple

from ..config import EstimateConfig
from .request import POOLING, RouterRequest

__all__ = ["KINDS", "PromptSize", "estimate_prompt_tokens", "estimate_text_tokens", "size_prompt"]

KINDS: tuple[str, ...] = ("words", "dense", "symbols", "cjk", "other", "template")
WORDS, DENSE, SYMBOLS, CJK, OTHER, TEMPLATE = range(len(KINDS))

_CJK = re.compile(
    "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef\U00020000-\U0002fa1f]"
)

# Each byte's class, as one byte: a text is translated once, then each class
# is counted per chunk with bytes.count over a range (no copies).
_SPACE, _DIGIT, _SYMBOL, _VOWEL, _CONSONANT, _NON_ASCII = b"sdyvco"
_SPACES = b" \t\n\r\x0b\x0c"


def _byte_class(byte: int) -> int:
    if byte >= 128:
        return _NON_ASCII
    char = chr(byte)
    if byte in _SPACES:
        return _SPACE
    if char.isdigit():
        return _DIGIT
    if not char.isalpha():
        return _SYMBOL
    return _VOWEL if char in "aeiouAEIOU" else _CONSONANT


_CLASSES = bytes(_byte_class(byte) for byte in range(256))
# Letters that read as words: at most _WORD of them per word break (a space or
# symbol: English prose has ~3 to 4, code ~2), and about as many vowels as
# natural text (0.33-0.45 of the letters of English prose, Python, C and JSON
# are vowels, 0.17-0.22 of base64's or random letters': ``python -m bench
# estimate``'s texts). The rest are dense: the letters beyond _WORD per break
# (a hex dump, base64, a key), or the share of random letters that would pull
# the vowels from _WORDS_VOWELS down to what they are, whichever is more;
# graded, so a blob in half of a chunk counts half. Vowels are judged from
# _VOWEL_MIN letters on (fewer say little). On the benchmark's mixes of prose
# and base64 or random letters, _WORDS_VOWELS at English's typical 0.36
# rather than the low 0.33 left 10-30% of them under the engine's count
# after learning, not 40-50%, and code 1.23 times its count, not 1.20.
_WORD = 6
_WORDS_VOWELS = 0.36
_RANDOM_VOWELS = 0.19
_VOWEL_MIN = 32
# Bytes judged at a time: a pasted key, hash or base64 image in a long
# message is judged apart from most of the prose around it; the Python work
# per chunk (~1 µs) stays small beside the C passes over its bytes.
_CHUNK = 1024

# Parameters vLLM turns into prompt tokens (tools and documents are rendered
# by the chat template, a template is text itself) or that cost like them
# (a structured-output schema is compiled per request). Counted by JSON text.
_PROMPT_PARAMS = frozenset({
    "tools", "functions", "tool_choice", "function_call", "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "documents", "chat_template", "chat_template_kwargs", "suffix",
})

# What a chat template's ``tojson`` prints (transformers' filter keeps
# non-ASCII as is); one encoder, built once, saves ~1.5 µs a call.
_TO_JSON = json.JSONEncoder(ensure_ascii=False).encode

# Roles whose names the per-message overhead already covers; any other role
# string is counted as text (a template prints it).
_PLAIN_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "developer"})


class PromptSize(NamedTuple):
    """A prompt's raw estimate and its parts by kind of text.

    ``tokens`` is the rule's rounded total (what admission used before any
    learning); ``parts`` are the unrounded estimated tokens of each kind, in
    :data:`KINDS` order (their sum is at most ``tokens``); ``exact`` counts
    token ids the prompt gave as such (no estimate, nothing to learn).
    ``measurable`` is False where the engine adds tokens the estimate cannot
    see (an image or audio part): its usage then teaches nothing.
    """

    tokens: int
    parts: tuple[float, ...]
    exact: int = 0
    measurable: bool = True


def estimate_text_tokens(text: str, estimate: EstimateConfig) -> int:
    """Estimated tokens of one text: CJK characters by count, the rest by UTF-8 bytes."""
    if text.isascii():
        return math.ceil(len(text) / estimate.chars_per_token)
    rest = _CJK.sub("", text)
    cjk = len(text) - len(rest)
    other_bytes = len(rest.encode("utf-8", "surrogatepass"))
    return math.ceil(cjk / estimate.cjk_chars_per_token + other_bytes / estimate.chars_per_token)


def estimate_prompt_tokens(request: RouterRequest, estimate: EstimateConfig) -> int:
    """Estimated prompt tokens of a request (the raw rule: :func:`size_prompt`'s ``tokens``)."""
    return size_prompt(request, estimate).tokens


def size_prompt(request: RouterRequest, estimate: EstimateConfig) -> PromptSize:
    """The request's raw estimate, chat template overhead, tools and schemas included, split by kind."""
    tally = _Tally(estimate)
    conversation = request.conversation()
    if conversation is not None:
        messages = conversation
        overhead = estimate.per_message_tokens * (len(messages) + 1)
        tally.tokens += overhead
        tally.parts[TEMPLATE] += overhead
        for message in messages:
            tally.message(message)
    else:
        for text in request.texts():
            tally.text(text)
        tally.exact = request.prompt_token_ids()
        tally.tokens += tally.exact
    if request.kind not in POOLING:  # a rerank's documents are its inputs, counted above: once
        for key, value in request.params.items():
            if key in _PROMPT_PARAMS and value is not None:
                tally.value(value)
    tally.flush()
    return PromptSize(max(1, tally.tokens), tuple(tally.parts), tally.exact, tally.measurable)


class _Tally:
    """The running sums of one request's estimate: the rounded total and the parts by kind.

    Texts shorter than ``_CHUNK`` wait in ``_pending`` and are judged together
    once ``_CHUNK`` bytes have gathered (``flush``): the C passes cost a call
    each, and a chat of many short messages would pay them per message.
    """

    __slots__ = ("_pending", "_pending_size", "cjk_per", "exact", "measurable", "parts", "per", "tokens")

    def __init__(self, estimate: EstimateConfig) -> None:
        self.per = estimate.chars_per_token
        self.cjk_per = estimate.cjk_chars_per_token
        self.tokens = 0
        self.parts = [0.0] * len(KINDS)
        self.exact = 0
        self.measurable = True
        self._pending: list[bytes] = []
        self._pending_size = 0

    def text(self, text: str) -> None:
        """One text: rounded up on its own into the total; its bytes judged by kind ``_CHUNK`` at a time."""
        per = self.per
        if text.isascii():
            data = text.encode("ascii")
            self.tokens += math.ceil(len(data) / per)
        else:
            rest = _CJK.sub("", text)
            cjk = len(text) - len(rest)
            data = rest.encode("utf-8", "surrogatepass")
            self.parts[CJK] += cjk / self.cjk_per
            self.tokens += math.ceil(cjk / self.cjk_per + len(data) / per)
        if len(data) < _CHUNK:
            self._pending.append(data)
            self._pending_size += len(data)
            if self._pending_size >= _CHUNK:
                self.flush()
            return
        self.flush()
        classes = data.translate(_CLASSES)
        for start in range(0, len(data), _CHUNK):  # a blob inside prose (a key, a base64 image, a hex dump) is judged apart
            self._chunk(classes, start, min(start + _CHUNK, len(data)))

    def flush(self) -> None:
        """Judge the short texts gathered so far, as one chunk."""
        if self._pending:
            classes = b"".join(self._pending).translate(_CLASSES)
            self._chunk(classes, 0, len(classes))
            self._pending.clear()
            self._pending_size = 0

    def _chunk(self, classes: bytes, start: int, end: int) -> None:
        """``classes[start:end]``, text as a class a byte (a multi-byte character cut in two is still two
        non-ASCII bytes): a C pass per count, over the range, with no copy."""
        per, parts = self.per, self.parts
        other = classes.count(_NON_ASCII, start, end)
        digits = classes.count(_DIGIT, start, end)
        spaces = classes.count(_SPACE, start, end)
        symbols = classes.count(_SYMBOL, start, end)
        letters = end - start - other - digits - spaces - symbols
        dense: float = letters - _WORD * (spaces + symbols + 1)  # beyond the word breaks: hex, base64, a key
        if letters >= _VOWEL_MIN:  # too few vowels: random letters
            vowels = classes.count(_VOWEL, start, end)
            dense = max(dense, letters * (_WORDS_VOWELS - vowels / letters) / (_WORDS_VOWELS - _RANDOM_VOWELS))
        dense = min(letters, max(0, dense))
        parts[DENSE] += (digits + dense) / per
        parts[WORDS] += (letters - dense + spaces) / per
        parts[SYMBOLS] += symbols / per
        parts[OTHER] += other / per

    def message(self, message: Mapping[str, object]) -> None:
        """One chat message's own tokens (the per-message overhead is added by the caller)."""
        for key, value in message.items():
            if key == "content":
                if isinstance(value, str):
                    self.text(value)
                elif isinstance(value, list):
                    for part in value:
                        self.part(part)
            elif key == "role":
                if value not in _PLAIN_ROLES:
                    self.value(value)
            elif value is not None:
                self.value(value)

    def part(self, part: object) -> None:
        """One content part: its text; an Anthropic tool_result's content and a tool_use's input (an agent's
        file reads and edits ride there), a text document's data. An image or audio part's tokens depend on
        the model's processor, which the router cannot know: the estimate leaves them out."""
        if not isinstance(part, Mapping):
            self.measurable = False
            return
        text = part.get("text")
        if isinstance(text, str):
            self.text(text)
            return
        kind = part.get("type")
        if kind == "tool_result":
            content = part.get("content")
            if isinstance(content, str):
                self.text(content)
            elif isinstance(content, list):
                for inner in content:
                    self.part(inner)
            return
        if kind == "tool_use":
            self.value(part.get("name"))
            self.value(part.get("input"))
            return
        source = part.get("source")
        if kind == "document" and isinstance(source, Mapping) and source.get("type") == "text" and isinstance(source.get("data"), str):
            self.text(source["data"])
            return
        self.measurable = False  # tokens the estimate cannot see: the engine's usage teaches nothing

    def value(self, value: object) -> None:
        """A string as text; anything else as the JSON text a template's ``tojson`` prints."""
        if isinstance(value, str):
            self.text(value)
        elif isinstance(value, (int, float)):  # a number's JSON text is as long as its str() (a bool's too): no encoder call
            length = len(str(value))
            self.parts[DENSE] += length / self.per
            self.tokens += math.ceil(length / self.per)
        else:
            self.text(_TO_JSON(value))
