"""The simulator's tokenizer rule and its deterministic output text.

Token counting ("the backend's truth", deliberately not the router's
estimate): every CJK character is one token; all other text costs one token
per 4 UTF-8 bytes, rounded up per text. A chat prompt adds 4 tokens per
message (role and separators) and 3 for the assistant's turn, like Llama-3's
template. Output tokens come from a fixed vocabulary of words, each a token
that decodes to " word", drawn from a generator seeded by the request.

Prompt token ids (for the prefix cache) are stable functions of the prompt's
successive 4-character chunks, so texts that share a beginning share leading
ids; their number is always the counted tokens (the chunks are cut or padded
with ids that hash the whole text).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import zlib
from array import array
from collections.abc import Sequence

PER_MESSAGE_TOKENS = 4
ASSISTANT_PRIMING_TOKENS = 3

_CJK_RANGES = (
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x3400, 0x4DBF),  # CJK Extension A
    (0x4E00, 0x9FFF),  # CJK Unified Ideographs
    (0xAC00, 0xD7AF),  # Hangul syllables
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF00, 0xFFEF),  # full-width forms
    (0x20000, 0x2FA1F),  # Extensions B..F and supplements
)


def is_cjk(char: str) -> bool:
    """Whether the tokenizer rule counts this character as a whole token."""
    code = ord(char)
    return any(low <= code <= high for low, high in _CJK_RANGES)


def count_text_tokens(text: str) -> int:
    """Tokens of one text: CJK characters one each, the rest 4 UTF-8 bytes each."""
    if text.isascii():
        return (len(text) + 3) // 4
    cjk = 0
    other_bytes = 0
    for char in text:
        if is_cjk(char):
            cjk += 1
        else:
            other_bytes += len(char.encode("utf-8"))
    return cjk + (other_bytes + 3) // 4


def count_chat_tokens(contents: Sequence[str]) -> int:
    """Tokens of a chat prompt given its messages' contents, template included."""
    return sum(count_text_tokens(c) + PER_MESSAGE_TOKENS for c in contents) + ASSISTANT_PRIMING_TOKENS


VOCABULARY: tuple[str, ...] = tuple(
    """the of and to in is that for it as with was on be by at this are from or
    an but not have which one all their were they has been more when will there
    would can its into time only new some could than other these two may first
    then do any like my now over such our man me even most made after also did
    many before must through back years where much your way well down should
    because each just those people how too little state good very make world
    still own see men work long get here between both life being under never day
    same another know while last might us great old year off come since against
    go came right used take three""".split()
)
VOCABULARY_SIZE = len(VOCABULARY)

# Each token decodes to " word"; the JSON string literal is precomputed so the
# server can frame SSE events by concatenating bytes.
TOKEN_TEXT: tuple[str, ...] = tuple(" " + word for word in VOCABULARY)
TOKEN_JSON: tuple[bytes, ...] = tuple(json.dumps(text).encode() for text in TOKEN_TEXT)


def output_rng(seed: int, prompt_key: str) -> random.Random:
    """The generator behind one request's output: same seed and prompt, same text."""
    return random.Random((seed << 32) ^ zlib.crc32(prompt_key.encode("utf-8", "surrogatepass")))


def detokenize(token_ids: Sequence[int]) -> str:
    """The text of a run of output tokens."""
    return "".join(TOKEN_TEXT[i] for i in token_ids)


def chat_prompt_key(contents: Sequence[str]) -> str:
    """The text a chat prompt's token ids come from: its messages' contents joined by NUL."""
    return "\x00".join(contents)


def _chunk_id(chunk: str) -> int:
    """One 4-character chunk's id: its ASCII bytes as a number (a partial chunk tagged with its length), else CRC-32 apart."""
    if chunk.isascii():
        value = int.from_bytes(chunk.encode("ascii"), sys.byteorder)
        return value if len(chunk) == 4 else value | len(chunk) << 32
    return zlib.crc32(chunk.encode("utf-8", "surrogatepass")) | 1 << 35


def _widened(raw: bytes) -> array[int]:
    """Each 4 bytes of ``raw`` as the 64-bit number a native 32-bit read gives (``_chunk_id``'s value), in C.

    Four strided copies into a zeroed buffer: ~10x faster than
    ``array("q", array("I", raw))``, which converts number by number.
    """
    wide = bytearray(2 * len(raw))
    low = 0 if sys.byteorder == "little" else 4
    for byte in range(4):
        wide[low + byte :: 8] = raw[byte::4]
    ids = array("q")
    ids.frombytes(wide)
    return ids


def prompt_token_ids(prompt_key: str, count: int) -> list[int]:
    """``count`` deterministic ids of a prompt: the same text gives the same ids, a shared beginning shared ones."""
    return prompt_token_array(prompt_key, count).tolist()


def prompt_token_array(prompt_key: str, count: int) -> array[int]:
    """``prompt_token_ids`` as an array of 64-bit ids (what the prefix cache hashes, without a list between).

    Each 4-character chunk's id is ``_chunk_id``; an ASCII text's full chunks
    are read at once (``_widened``, the same values), so a 2,000-token
    prompt's ids cost ~15 µs. Ids need only be stable within
    a process (never Python's salted ``hash``).
    """
    text = prompt_key[: 4 * count]
    if text.isascii():
        full = len(text) // 4
        ids = _widened(text[: 4 * full].encode("ascii"))
        if len(text) > 4 * full:
            ids.append(_chunk_id(text[4 * full :]))
    else:
        ids = array("q", [_chunk_id(text[i : i + 4]) for i in range(0, len(text), 4)])
    if len(ids) < count:  # padding: ids that hash the whole text
        whole = zlib.crc32(hashlib.blake2b(prompt_key.encode("utf-8", "surrogatepass"), digest_size=16).digest())
        ids.extend(zlib.crc32(i.to_bytes(4, "little"), whole) for i in range(len(ids), count))
    return ids


def token_text(token_id: int) -> str:
    """What one token id decodes to: an output token's word, or a prompt chunk's text (``prompt_token_ids``' ids of
    ASCII text decode to it); any other id (a chunk of other text, a padding id, an id of no token) to ""."""
    if 0 <= token_id < VOCABULARY_SIZE:
        return TOKEN_TEXT[token_id]
    length, value = token_id >> 32, token_id & 0xFFFFFFFF
    if length == 0:
        length = 4
    elif length > 3:
        return ""
    raw = value.to_bytes(4, sys.byteorder)
    raw = raw[:length] if sys.byteorder == "little" else raw[4 - length :]
    return raw.decode("ascii") if _printable(raw) else ""


def _printable(raw: bytes) -> bool:
    return all(32 <= byte < 127 or byte in (9, 10, 13) for byte in raw)
