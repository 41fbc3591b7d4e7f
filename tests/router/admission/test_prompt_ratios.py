"""The estimate by kind of text (router/admission/estimate.py) and what the engines' usage teaches of it (router/admission/prompt_ratios.py)."""

from __future__ import annotations

import dataclasses
import math
import random
import string

import pytest
from hypothesis import given, settings, strategies as st

from tailguard.router.admission import KINDS, KindRatio, PromptRatios, PromptSize, RouterRequest, estimate_text_tokens, size_prompt
from tailguard.router.config import ConfigError, EstimateConfig, parse_config, render_config

DEFAULT = EstimateConfig()
EMOJI = "\N{GRINNING FACE}"


def completion(text: str) -> PromptSize:
    return size_prompt(RouterRequest(kind="completion", request_id="r", prompt=text), DEFAULT)


def kinds(size: PromptSize) -> dict[str, float]:
    """The kinds with some estimate, in tokens."""
    return {kind: part for kind, part in zip(KINDS, size.parts, strict=True) if part}


def dominant(size: PromptSize) -> str:
    return KINDS[max(range(len(KINDS)), key=size.parts.__getitem__)]


# -- the kinds ------------------------------------------------------------------------


def test_each_kind_of_text_is_filed_under_its_kind() -> None:
    rng = random.Random(0)
    prose = "The router keeps short requests fast when long ones share the fleet. " * 20
    code = "def handle(request: Request) -> Response:\n    return await client.send(request, timeout=5.0)\n" * 12
    samples = {
        "words": [prose, code],
        "dense": [
            "".join(rng.choice("0123456789abcdef") for _ in range(800)),  # a hash: no word breaks
            "".join(rng.choice(string.ascii_letters + "+/") for _ in range(800)),  # base64
            " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(6)) for _ in range(150)),  # random letters, spaced
            ", ".join(str(rng.randrange(10**6)) for _ in range(150)),  # numbers
        ],
        "symbols": ["".join(rng.choice(string.punctuation) for _ in range(800))],
        "cjk": ["中文字かな한국어" * 100],
        "other": [EMOJI * 200, "Привет мир, как дела " * 40],
    }
    for kind, texts in samples.items():
        for text in texts:
            size = completion(text)
            assert dominant(size) == kind, (kind, text[:40], kinds(size))
    chat = size_prompt(RouterRequest(kind="chat", request_id="r", messages=[{"role": "user", "content": "Hi"}]), DEFAULT)
    assert kinds(chat) == {"words": 0.5, "template": 8.0}


def test_every_byte_is_counted_once() -> None:
    text = "Numbers 12345, symbols {}[]!, words and spaces; 中文 and Привет " + EMOJI
    size = completion(text)
    assert sum(size.parts) == pytest.approx((len(text.encode()) - 2 * 3) / 4 + 2)  # a CJK character: 1 token, not 3 bytes
    assert size.tokens == estimate_text_tokens(text, DEFAULT) == math.ceil(sum(size.parts))


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.text(), min_size=1, max_size=4), ids=st.lists(st.integers(0, 1000), max_size=5))
def test_the_parts_add_up_to_the_rounded_estimate(texts: list[str], ids: list[int]) -> None:
    prompt: list[str] | list[int] = ids if ids else texts
    size = size_prompt(RouterRequest(kind="completion", request_id="r", prompt=prompt), DEFAULT)
    assert all(part >= 0 for part in size.parts)
    rounding = 0 if ids else len(texts)  # each text rounds up on its own
    assert size.tokens - rounding - 1e-9 <= sum(size.parts) + size.exact <= size.tokens


# -- learning -------------------------------------------------------------------------


def hex_size(tokens: float, template: float = 0.0) -> PromptSize:
    """A prompt of ``tokens`` estimated tokens of hex (and ``template`` of a chat's overhead)."""
    parts = tuple(tokens if kind == "dense" else template if kind == "template" else 0.0 for kind in KINDS)
    return PromptSize(math.ceil(tokens + template), parts)


def taught(ratios: list[float], estimate: EstimateConfig = DEFAULT, model: str = "m") -> PromptRatios:
    learnt = PromptRatios()
    for ratio in ratios:
        learnt.learn(model, hex_size(100), round(100 * ratio), estimate)
    return learnt


def test_a_kind_applies_from_learn_after_on() -> None:
    size = hex_size(1000)
    assert taught([3.0] * 7).corrected(size, ("m",), DEFAULT) == 1000
    assert taught([3.0] * 8).corrected(size, ("m",), DEFAULT) == 3000
    assert taught([3.0] * 8).corrected(size, ("another",), DEFAULT) == 1000  # per model


def test_the_factor_is_the_quantile_of_the_window_clamped_to_one_and_max_ratio() -> None:
    ratios = [2.0] * 90 + [2.5] * 9 + [7.0]  # the 95th of 100; one odd answer in a hundred moves nothing
    assert taught(ratios).statistics(DEFAULT) == (KindRatio("m", "dense", 2.5, 2.5, 100),)
    assert taught([0.5] * 20).statistics(DEFAULT)[0].ratio == 1.0  # never below the rule
    assert taught([0.5] * 20).corrected(hex_size(1000), ("m",), DEFAULT) == 1000
    assert taught([20.0] * 20).statistics(DEFAULT)[0].ratio == DEFAULT.max_ratio
    # The window: the last 128 answers only, so a model swapped under its name is followed.
    assert taught([4.0] * 200 + [2.0] * 128).statistics(DEFAULT)[0].ratio == 2.0


def test_a_mixed_prompt_is_corrected_kind_by_kind() -> None:
    learnt = taught([3.0] * 8)
    for _ in range(8):  # English at 1.5, its hex part subtracted at hex's median
        learnt.learn("m", PromptSize(120, (100.0, 20.0, 0.0, 0.0, 0.0, 0.0)), round(1.5 * 100 + 3.0 * 20), DEFAULT)
    [words] = [row for row in learnt.statistics(DEFAULT) if row.kind == "words"]
    assert words.ratio == pytest.approx(1.5)
    mixed = PromptSize(400, (200.0, 100.0, 50.0, 0.0, 0.0, 0.0))  # symbols not learnt: at the rule's 1
    assert learnt.corrected(mixed, ("m",), DEFAULT) == 400 + math.ceil(0.5 * 200 + 2.0 * 100)


def test_only_a_prompt_dominated_by_one_kind_and_measurable_teaches() -> None:
    learnt = PromptRatios()
    even = PromptSize(200, (100.0, 100.0, 0.0, 0.0, 0.0, 0.0))
    tiny = hex_size(5)
    image = hex_size(100)._replace(measurable=False)
    for size in (even, tiny, image):
        for _ in range(10):
            learnt.learn("m", size, 10 * size.tokens, DEFAULT)
    assert learnt.statistics(DEFAULT) == ()
    content = [{"type": "text", "text": "a" * 400}, {"type": "image_url", "image_url": {"url": "data:"}}]
    chat = size_prompt(RouterRequest(kind="chat", request_id="r", messages=[{"role": "user", "content": content}]), DEFAULT)
    assert not chat.measurable


def test_a_request_naming_no_model_takes_each_kinds_largest_factor_of_its_candidates() -> None:
    learnt = taught([3.0] * 8, model="a")
    for _ in range(8):
        learnt.learn("b", PromptSize(100, (100.0, 0.0, 0.0, 0.0, 0.0, 0.0)), 200, DEFAULT)
    mixed = PromptSize(200, (100.0, 100.0, 0.0, 0.0, 0.0, 0.0))
    assert learnt.corrected(mixed, ("a",), DEFAULT) == 200 + 200
    assert learnt.corrected(mixed, ("b",), DEFAULT) == 200 + 100
    assert learnt.corrected(mixed, ("a", "b"), DEFAULT) == 200 + 300


def test_learning_off_applies_and_keeps_nothing() -> None:
    off = dataclasses.replace(DEFAULT, learn=False)
    learnt = taught([3.0] * 8, off)
    assert learnt.corrected(hex_size(1000), ("m",), DEFAULT) == 1000 and learnt.statistics(DEFAULT) == ()
    assert taught([3.0] * 8).corrected(hex_size(1000), ("m",), off) == 1000


def test_the_table_keeps_at_most_64_models() -> None:
    learnt = PromptRatios()
    for n in range(100):
        for _ in range(8):
            learnt.learn(f"model-{n}", hex_size(100), 300, DEFAULT)
    models = {row.model for row in learnt.statistics(DEFAULT)}
    assert len(models) == 64 and "model-99" in models and "model-0" not in models


@settings(max_examples=200, deadline=None)
@given(
    observations=st.lists(st.tuples(st.integers(0, len(KINDS) - 1), st.floats(8, 500), st.integers(0, 5000)), max_size=40),
    text=st.text(),
)
def test_the_corrected_estimate_is_never_below_the_rule(observations: list[tuple[int, float, int]], text: str) -> None:
    learnt = PromptRatios()
    estimate = dataclasses.replace(DEFAULT, learn_after=1)
    for kind, tokens, real in observations:
        parts = tuple(tokens if k == kind else 0.0 for k in range(len(KINDS)))
        learnt.learn("m", PromptSize(math.ceil(tokens), parts), real, estimate)
    size = size_prompt(RouterRequest(kind="chat", request_id="r", messages=[{"role": "user", "content": text}]), estimate)
    corrected = learnt.corrected(size, ("m",), estimate)
    assert size.tokens <= corrected <= size.tokens + math.ceil((estimate.max_ratio - 1) * sum(size.parts))


# -- the settings ---------------------------------------------------------------------

BASE = """
[pools.main]
max_concurrency = 4
max_queue = 8
max_model_len = 16384
models = ["m"]
endpoints = [{ url = "http://127.0.0.1:8001", max_concurrency = 4 }]

[classes.all]
pool = "main"
queue_timeout = 2.0
"""


def test_the_learning_settings_are_read_checked_and_rendered() -> None:
    config = parse_config("[estimate]\nlearn_window = 64\nlearn_quantile = 0.9\nlearn_after = 4\nmax_ratio = 5\n" + BASE)
    assert (config.estimate.learn_window, config.estimate.learn_quantile, config.estimate.learn_after, config.estimate.max_ratio) == (64, 0.9, 4, 5.0)
    assert "learn_quantile 0.9 of the last learn_window 64, from learn_after 4, in [1, max_ratio 5]" in render_config(config)
    assert "off: the rule alone" in render_config(parse_config("[estimate]\nlearn = false\n" + BASE))
    with pytest.raises(ConfigError) as refused:
        parse_config("[estimate]\nlearn_window = 4\nlearn_after = 8\nlearn_quantile = 1.5\nmax_ratio = 0.5\nlearn = 1\n" + BASE)
    problems = "\n".join(refused.value.problems)
    for key in ("estimate.learn_after: must be at most learn_window (4)", "estimate.learn_quantile: must be a number > 0 and <= 1",
                "estimate.max_ratio: must be a number >= 1", "estimate.learn: must be true or false"):  # fmt: skip
        assert key in problems, problems
