"""Each model's learnt ratio of real to estimated prompt tokens, by kind of text.

The raw estimate (router/admission/estimate.py) is a rule; a model's tokenizer is not:
a small byte-level BPE spends 3 tokens on a rare CJK character the rule
counts as 1, and a token on each punctuation mark the rule counts as a
quarter. Every answer whose usage gives ``prompt_tokens`` (the router asks
for usage on every stream) is one observation of the model's truth, and
admission multiplies each kind's share of the estimate by what was learnt.

- **Attribution.** An observation teaches the kind that holds more than half
  of its estimate (and ``_MIN_TOKENS`` of it): its ratio is what is left of
  the real count, once the other kinds' typical ratios (their medians so
  far, 1 for a kind never seen: counting an unseen kind at once, not waiting
  for ``learn_after``, keeps the first observations from charging its
  tokens to the dominant kind for a whole window: English prose, sized
  1.52 times its real count that way, is 1.07 times it so in
  ``python -m bench estimate``) and the prompt's token ids are taken off, over the kind's
  estimate. A prompt of many kinds teaches none; a chat of a few words
  teaches ``template``.
- **Statistic.** The ``learn_quantile`` (0.95) of the kind's last
  ``learn_window`` (128) ratios: an upper bound for all but 1 in 20 recent
  prompts of the kind, robust to a few odd ones (an observation misjudged
  by the attribution moves it only if 1 in 20 are), quick to follow a model
  swapped under the same name (a window), and nothing to tune for a bias,
  unlike a mean plus k deviations, which one outlier inflates.
- **Applied.** From ``learn_after`` (8) observations on, a kind's factor is
  that quantile clamped to [1, ``max_ratio``]: never below 1, so learning
  only makes admission stricter than the raw rule (which callers read as
  the documented cap: a model whose tokenizer merges better keeps the
  rule's margin), and never above ``max_ratio`` (8), so an engine's wrong
  usage cannot make every prompt eight times too big. The corrected
  estimate is the raw one plus ``ceil(sum((factor - 1) * part))``: at least
  the raw, equal to it until something is learnt.

Which model: the request's ``model``, or when it names none, each kind's
largest factor over the models it may be given (each pool's first): its
class, hence its pool, is decided by this very estimate. Per process (a
worker or replica learns on its own, from its own answers) and bounded:
``_MAX_MODELS`` models, the least recently taught forgotten first.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass

from ..config import EstimateConfig
from .estimate import KINDS, PromptSize

__all__ = ["KindRatio", "PromptRatios"]

_MAX_MODELS = 64  # a fleet serves a few; more would be a config of many names for one model
_MIN_TOKENS = 8.0  # a kind's estimate below this is rounding noise (a token more or less is 1/8)
_UNIT = (1.0,) * len(KINDS)


@dataclass(frozen=True)
class KindRatio:
    """One model's learning for one kind of text, as /metrics shows it."""

    model: str
    kind: str
    ratio: float  # the factor admission applies now
    learnt: float  # the quantile itself, before the clamp to [1, max_ratio]
    observations: int  # answers that taught this kind, ever


class _Window:
    """One kind's last ratios, in arrival order and sorted: a quantile is an index, an update a bisect."""

    __slots__ = ("arrived", "observations", "ordered")

    def __init__(self) -> None:
        self.arrived: deque[float] = deque()
        self.ordered: list[float] = []
        self.observations = 0

    def add(self, ratio: float, window: int) -> None:
        while len(self.arrived) >= window:
            del self.ordered[bisect_left(self.ordered, self.arrived.popleft())]
        self.arrived.append(ratio)
        insort(self.ordered, ratio)
        self.observations += 1

    def quantile(self, q: float) -> float:
        ordered = self.ordered
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Model:
    """One model's windows, and the factors they give under the settings they were last read with."""

    __slots__ = ("factors", "settings", "typical", "windows")

    def __init__(self) -> None:
        self.windows = tuple(_Window() for _ in KINDS)
        self.settings: tuple[float, int, float] | None = None  # what ``factors`` and ``typical`` were made under
        self.factors = _UNIT
        self.typical = _UNIT

    def refresh(self, estimate: EstimateConfig) -> None:
        settings = (estimate.learn_quantile, estimate.learn_after, estimate.max_ratio)
        if settings == self.settings:
            return
        ready = [len(w.ordered) >= estimate.learn_after for w in self.windows]
        self.factors = tuple(
            min(estimate.max_ratio, max(1.0, w.quantile(estimate.learn_quantile))) if ok else 1.0
            for w, ok in zip(self.windows, ready, strict=True)
        )
        self.typical = tuple(w.quantile(0.5) if w.ordered else 1.0 for w in self.windows)
        self.settings = settings


class PromptRatios:
    """What each model's engines taught about the estimate (the module docstring says how)."""

    def __init__(self) -> None:
        self._models: OrderedDict[str, _Model] = OrderedDict()

    def corrected(self, size: PromptSize, models: Collection[str], estimate: EstimateConfig) -> int:
        """``size.tokens`` raised by the factors of whichever of ``models`` has the largest for each kind."""
        if not estimate.learn:
            return size.tokens
        factors: tuple[float, ...] | None = None
        for name in models:
            model = self._models.get(name)
            if model is None:
                continue
            model.refresh(estimate)
            factors = model.factors if factors is None else tuple(map(max, factors, model.factors))
        if factors is None:
            return size.tokens
        extra = sum((factor - 1.0) * part for factor, part in zip(factors, size.parts, strict=True) if factor > 1.0)
        return size.tokens + math.ceil(extra)

    def learn(self, model_name: str, size: PromptSize, real: int, estimate: EstimateConfig) -> None:
        """One answer's ``usage.prompt_tokens`` (``real``) for a prompt of ``size`` served by ``model_name``."""
        if not estimate.learn or not size.measurable:
            return
        parts = size.parts
        dominant = max(range(len(parts)), key=parts.__getitem__)
        main = parts[dominant]
        if main < _MIN_TOKENS or 2 * main <= sum(parts):
            return
        model = self._models.get(model_name)
        if model is None:
            model = self._models[model_name] = _Model()
            if len(self._models) > _MAX_MODELS:
                self._models.popitem(last=False)
        else:
            self._models.move_to_end(model_name)
        model.refresh(estimate)
        rest = sum(t * p for kind, (t, p) in enumerate(zip(model.typical, parts, strict=True)) if kind != dominant)
        model.windows[dominant].add(max(0.0, (real - size.exact - rest) / main), estimate.learn_window)
        model.settings = None  # the factors are made again when next read

    def statistics(self, estimate: EstimateConfig) -> tuple[KindRatio, ...]:
        """Every kind some answer taught, per model (nothing while learning is off: nothing is applied)."""
        if not estimate.learn:
            return ()
        rows = []
        for name, model in self._models.items():
            model.refresh(estimate)
            for kind, window, factor in zip(KINDS, model.windows, model.factors, strict=True):
                if window.observations:
                    rows.append(KindRatio(name, kind, factor, window.quantile(estimate.learn_quantile), window.observations))
        return tuple(rows)
