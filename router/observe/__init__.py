"""What happened to each request (its record, its trace) and how late the event loop runs.

``tracing`` is left out here on purpose: it imports the OpenTelemetry SDK, which a
process loads only once ``[tracing]`` is enabled (``server/trace_switch.py``
imports the module itself, then).
"""

from __future__ import annotations

from .attainment import (
    Attainment as Attainment,
    ClassAttainment as ClassAttainment,
    attainment_document as attainment_document,
    judge as judge,
)
from .loop_lag import LoopLag as LoopLag, noticed_late as noticed_late
from .service_time import ServiceTime as ServiceTime
from .telemetry import (
    Api as Api,
    RepeatedIds as RepeatedIds,
    RequestRecord as RequestRecord,
    Telemetry as Telemetry,
    anthropic_prompt_tokens as anthropic_prompt_tokens,
    is_valid_request_id as is_valid_request_id,
    outcome_of as outcome_of,
)
