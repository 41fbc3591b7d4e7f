from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Options(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "stop", "seed", "n", "request_id", "request_class", "extra")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    n: int
    request_id: str
    request_class: str
    extra: _struct_pb2.Struct
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., request_id: _Optional[str] = ..., request_class: _Optional[str] = ..., extra: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("model", "messages", "options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    options: Options
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., options: _Optional[_Union[Options, _Mapping]] = ...) -> None: ...

class CompletionRequest(_message.Message):
    __slots__ = ("model", "prompt", "options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    options: Options
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., options: _Optional[_Union[Options, _Mapping]] = ...) -> None: ...

class Routing(_message.Message):
    __slots__ = ("request_id", "request_class", "pool", "max_tokens", "max_tokens_clamped", "estimated_prompt_tokens", "queue_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_CLAMPED_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_class: str
    pool: str
    max_tokens: int
    max_tokens_clamped: bool
    estimated_prompt_tokens: int
    queue_ms: float
    def __init__(self, request_id: _Optional[str] = ..., request_class: _Optional[str] = ..., pool: _Optional[str] = ..., max_tokens: _Optional[int] = ..., max_tokens_clamped: _Optional[bool] = ..., estimated_prompt_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class CompletionResponse(_message.Message):
    __slots__ = ("id", "model", "content", "finish_reason", "usage", "routing")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    content: str
    finish_reason: str
    usage: Usage
    routing: Routing
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., content: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ...) -> None: ...

class CompletionChunk(_message.Message):
    __slots__ = ("content", "finish_reason", "usage", "routing")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    content: str
    finish_reason: str
    usage: Usage
    routing: Routing
    def __init__(self, content: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ...) -> None: ...

class GetLimitsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EstimateRule(_message.Message):
    __slots__ = ("chars_per_token", "cjk_chars_per_token", "per_message_tokens", "learn")
    CHARS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CJK_CHARS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PER_MESSAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEARN_FIELD_NUMBER: _ClassVar[int]
    chars_per_token: float
    cjk_chars_per_token: float
    per_message_tokens: int
    learn: bool
    def __init__(self, chars_per_token: _Optional[float] = ..., cjk_chars_per_token: _Optional[float] = ..., per_message_tokens: _Optional[int] = ..., learn: _Optional[bool] = ...) -> None: ...

class ClassLimits(_message.Message):
    __slots__ = ("name", "max_prompt_tokens", "max_output_tokens", "queue_timeout_s", "priority", "pool", "objective")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_prompt_tokens: int
    max_output_tokens: int
    queue_timeout_s: float
    priority: int
    pool: str
    objective: Objective
    def __init__(self, name: _Optional[str] = ..., max_prompt_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., queue_timeout_s: _Optional[float] = ..., priority: _Optional[int] = ..., pool: _Optional[str] = ..., objective: _Optional[_Union[Objective, _Mapping]] = ...) -> None: ...

class Objective(_message.Message):
    __slots__ = ("ttft_s", "itl_s", "e2e_s", "percentile", "throughput_share")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    ITL_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    PERCENTILE_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_SHARE_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    itl_s: float
    e2e_s: float
    percentile: float
    throughput_share: float
    def __init__(self, ttft_s: _Optional[float] = ..., itl_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., percentile: _Optional[float] = ..., throughput_share: _Optional[float] = ...) -> None: ...

class PoolLimits(_message.Message):
    __slots__ = ("name", "max_model_len", "models")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_model_len: int
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("input_cap_tokens", "default_max_tokens", "output_cap_tokens", "over_cap", "estimate", "end_to_end_timeout_s", "classes", "pools")
    INPUT_CAP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CAP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVER_CAP_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    END_TO_END_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    input_cap_tokens: int
    default_max_tokens: int
    output_cap_tokens: int
    over_cap: str
    estimate: EstimateRule
    end_to_end_timeout_s: float
    classes: _containers.RepeatedCompositeFieldContainer[ClassLimits]
    pools: _containers.RepeatedCompositeFieldContainer[PoolLimits]
    def __init__(self, input_cap_tokens: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., output_cap_tokens: _Optional[int] = ..., over_cap: _Optional[str] = ..., estimate: _Optional[_Union[EstimateRule, _Mapping]] = ..., end_to_end_timeout_s: _Optional[float] = ..., classes: _Optional[_Iterable[_Union[ClassLimits, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolLimits, _Mapping]]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("model", "input", "request_id", "request_class", "extra")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    model: str
    input: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    request_class: str
    extra: _struct_pb2.Struct
    def __init__(self, model: _Optional[str] = ..., input: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., request_class: _Optional[str] = ..., extra: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("index", "embedding")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    index: int
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, index: _Optional[int] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("model", "data", "usage", "routing")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    model: str
    data: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: Usage
    routing: Routing
    def __init__(self, model: _Optional[str] = ..., data: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ...) -> None: ...
