"""A simulated vLLM: a continuous-batching engine in Trio time behind an OpenAI API.

Public surface; the modules behind it are small and private in spirit.
"""

from __future__ import annotations

from .app import DropConnection as DropConnection
from .app import SimApp as SimApp
from .app import SimResponse as SimResponse
from .engine import Engine as Engine
from .engine import EngineRequestError as EngineRequestError
from .engine import EngineStatistics as EngineStatistics
from .engine import Sequence as Sequence
from .faults import MODES as FAULT_MODES  # noqa: F401 (public, under the package's name)
from .faults import AdminApp as AdminApp
from .faults import Fault as Fault
from .faults import FaultError as FaultError
from .faults import FaultInjector as FaultInjector
from .faults import FaultSwitch as FaultSwitch
from .params import PROFILES as PROFILES
from .params import VLLM_SERVER_DEFAULTS as VLLM_SERVER_DEFAULTS
from .params import EngineParams as EngineParams
from .params import VllmDefaults as VllmDefaults
from .server import DEFAULT_MODEL as DEFAULT_MODEL
from .server import EngineSpec as EngineSpec
from .server import serve_engine as serve_engine
from .transport import SimTransport as SimTransport
