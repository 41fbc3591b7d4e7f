"""A simulated vLLM: a continuous-batching engine in Trio time behind an OpenAI API.

Public surface; the modules behind it are small and private in spirit.
"""

from __future__ import annotations

from .app import DropConnection as DropConnection, SimApp as SimApp, SimResponse as SimResponse
from .engine import Engine as Engine, EngineRequestError as EngineRequestError, EngineStatistics as EngineStatistics
from .faults import (
    MODES as FAULT_MODES,  # noqa: F401 (public, under the package's name)
    AdminApp as AdminApp,
    Fault as Fault,
    FaultError as FaultError,
    FaultInjector as FaultInjector,
    FaultSwitch as FaultSwitch,
)
from .params import (
    PROFILES as PROFILES,
    VLLM_SERVER_DEFAULTS as VLLM_SERVER_DEFAULTS,
    EngineParams as EngineParams,
    VllmDefaults as VllmDefaults,
)
from .sequence import Sequence as Sequence
from .server import DEFAULT_MODEL as DEFAULT_MODEL, EngineSpec as EngineSpec, serve_engine as serve_engine
from .transport import SimTransport as SimTransport
