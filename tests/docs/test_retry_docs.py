"""docs/deployment.md says which answers the openai SDK retries: exactly what tailguard's headers make it do."""

from __future__ import annotations

import re
from pathlib import Path

from tailguard.router import error_spec
from tailguard.server.errors_map import HttpError

DEPLOYMENT = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
_SDK_RETRIES = {408, 409, 429}  # and every 5xx, unless x-should-retry says otherwise


def sdk_retries(answer: HttpError) -> bool:
    """The openai SDK's rule (``_should_retry``): the header first, then the status."""
    header = dict(answer.headers()).get(b"x-should-retry")
    if header is not None:
        return header == b"true"
    return answer.status in _SDK_RETRIES or answer.status >= 500


def test_the_deployment_guide_names_the_answers_the_sdk_does_not_retry() -> None:
    text = " ".join(DEPLOYMENT.read_text().split())
    paragraph = text[text.index("The SDK retries") :]
    paragraph = paragraph[: paragraph.index("as below.")]
    assert "x-should-retry: false" in paragraph
    not_retried = paragraph[paragraph.index("does **not** retry") : paragraph.index("It does retry")]
    retried = paragraph[paragraph.index("It does retry") :]
    named_not = set(re.findall(r"(\d{3}) `(\w+)`", not_retried))
    named_retried = set(re.findall(r"\b(\d{3})\b", retried))
    answers = [(spec, HttpError(spec.http_status, {}, 1.0 if spec.retry_after else None, spec.retryable)) for spec in error_spec.SPECS]
    sdk_candidates = [(spec, a) for spec, a in answers if a.status in _SDK_RETRIES or a.status >= 500]
    assert named_not == {(str(a.status), spec.code) for spec, a in sdk_candidates if not sdk_retries(a)}
    assert named_retried == {str(a.status) for spec, a in sdk_candidates if sdk_retries(a)}
    assert "504 included" not in text
