"""Calls to one inference server: transports, the stream checked on the way, its load, its errors."""

from __future__ import annotations

from .client import METRICS_BODY_LIMIT as METRICS_BODY_LIMIT, BackendClient as BackendClient, BackendResponse as BackendResponse
from .events import MAX_EVENT_BYTES as MAX_EVENT_BYTES, EventFilter as EventFilter
from .lean_transport import (
    KEEPALIVE_EXPIRY as KEEPALIVE_EXPIRY,
    BackendStream as BackendStream,
    Connector as Connector,
    ConnectorTransport as ConnectorTransport,
    LeanTransport as LeanTransport,
    ResponseBody as ResponseBody,
    SleepingStream as SleepingStream,
)
from .load import BackendLoad as BackendLoad, parse_vllm_metrics as parse_vllm_metrics, scrape as scrape
from .probe import REFUSED as REFUSED, Answer as Answer, BackendProbe as BackendProbe, ModelLenUnknown as ModelLenUnknown
from .transport import HttpxTransport as HttpxTransport
from .whole_answer import assemblable as assemblable, assemble as assemble, sse_objects as sse_objects
