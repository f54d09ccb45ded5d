from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("seq", "snapshot", "stored", "removed", "cleared", "seed", "block_size")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    cleared: bool
    seed: bytes
    block_size: int
    def __init__(self, seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., cleared: _Optional[bool] = ..., seed: _Optional[bytes] = ..., block_size: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("protocol_version", "instance_id", "model", "vocab_size", "max_model_len", "max_num_seqs", "block_size", "role", "tokenizer_json", "chat_template", "special_tokens", "eos_token_ids", "hidden_size", "encoder_config_json", "vision_config_json")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    VISION_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    instance_id: str
    model: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    role: str
    tokenizer_json: str
    chat_template: str
    special_tokens: _containers.ScalarMap[str, str]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    encoder_config_json: str
    vision_config_json: str
    def __init__(self, protocol_version: _Optional[int] = ..., instance_id: _Optional[str] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., block_size: _Optional[int] = ..., role: _Optional[str] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., encoder_config_json: _Optional[str] = ..., vision_config_json: _Optional[str] = ...) -> None: ...

class PromptImage(_message.Message):
    __slots__ = ("start", "length", "bidirectional", "digest", "pixels", "size")
    START_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BIDIRECTIONAL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    start: int
    length: int
    bidirectional: bool
    digest: bytes
    pixels: bytes
    size: int
    def __init__(self, start: _Optional[int] = ..., length: _Optional[int] = ..., bidirectional: _Optional[bool] = ..., digest: _Optional[bytes] = ..., pixels: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params_json", "session_id", "hold_kv", "kv_source", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_KV_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params_json: str
    session_id: str
    hold_kv: bool
    kv_source: KVSource
    images: _containers.RepeatedCompositeFieldContainer[PromptImage]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params_json: _Optional[str] = ..., session_id: _Optional[str] = ..., hold_kv: _Optional[bool] = ..., kv_source: _Optional[_Union[KVSource, _Mapping]] = ..., images: _Optional[_Iterable[_Union[PromptImage, _Mapping]]] = ...) -> None: ...

class KVLease(_message.Message):
    __slots__ = ("lease_id", "num_blocks", "last_key", "timeout_s", "transfer_address")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    num_blocks: int
    last_key: bytes
    timeout_s: float
    transfer_address: str
    def __init__(self, lease_id: _Optional[int] = ..., num_blocks: _Optional[int] = ..., last_key: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., transfer_address: _Optional[str] = ...) -> None: ...

class KVSource(_message.Message):
    __slots__ = ("address", "lease")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    address: str
    lease: KVLease
    def __init__(self, address: _Optional[str] = ..., lease: _Optional[_Union[KVLease, _Mapping]] = ...) -> None: ...

class KVTransfer(_message.Message):
    __slots__ = ("blocks_pulled", "blocks_skipped", "bytes", "seconds", "error", "transport")
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    blocks_pulled: int
    blocks_skipped: int
    bytes: int
    seconds: float
    error: str
    transport: str
    def __init__(self, blocks_pulled: _Optional[int] = ..., blocks_skipped: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("lease_id", "first_block", "num_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    first_block: int
    num_blocks: int
    def __init__(self, lease_id: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class KVBlocks(_message.Message):
    __slots__ = ("first_block", "num_blocks", "k", "v")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    num_blocks: int
    k: bytes
    v: bytes
    def __init__(self, first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ...) -> None: ...

class StageKVResponse(_message.Message):
    __slots__ = ("transfer_id", "num_chunks", "chunk_blocks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    num_chunks: int
    chunk_blocks: int
    def __init__(self, transfer_id: _Optional[int] = ..., num_chunks: _Optional[int] = ..., chunk_blocks: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "usage", "error", "lease", "transfer", "embedding")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    usage: Usage
    error: str
    lease: KVLease
    transfer: KVTransfer
    embedding: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[str] = ..., lease: _Optional[_Union[KVLease, _Mapping]] = ..., transfer: _Optional[_Union[KVTransfer, _Mapping]] = ..., embedding: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "detail", "instance_id")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    detail: str
    instance_id: str
    def __init__(self, serving: _Optional[bool] = ..., detail: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("running", "waiting", "kv_used", "kv_blocks", "kv_requests", "snapshot_json", "kv_leases")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_JSON_FIELD_NUMBER: _ClassVar[int]
    KV_LEASES_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_used: int
    kv_blocks: int
    kv_requests: int
    snapshot_json: str
    kv_leases: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_used: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_requests: _Optional[int] = ..., snapshot_json: _Optional[str] = ..., kv_leases: _Optional[int] = ...) -> None: ...

class PinHistoryRequest(_message.Message):
    __slots__ = ("session_id", "owner", "token_ids", "old_pin", "others", "lora", "cache_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OLD_PIN_FIELD_NUMBER: _ClassVar[int]
    OTHERS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    owner: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    old_pin: int
    others: _containers.RepeatedScalarFieldContainer[int]
    lora: str
    cache_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., owner: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., old_pin: _Optional[int] = ..., others: _Optional[_Iterable[int]] = ..., lora: _Optional[str] = ..., cache_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PinHistoryResponse(_message.Message):
    __slots__ = ("pin", "num_blocks", "num_tokens", "released")
    PIN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    pin: int
    num_blocks: int
    num_tokens: int
    released: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pin: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., released: _Optional[_Iterable[int]] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("pin",)
    PIN_FIELD_NUMBER: _ClassVar[int]
    pin: int
    def __init__(self, pin: _Optional[int] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndedSession(_message.Message):
    __slots__ = ("session_id", "pin")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pin: int
    def __init__(self, session_id: _Optional[str] = ..., pin: _Optional[int] = ...) -> None: ...

class EndSessionsRequest(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[EndedSession]
    def __init__(self, sessions: _Optional[_Iterable[_Union[EndedSession, _Mapping]]] = ...) -> None: ...

class EndSessionsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetPinBudgetRequest(_message.Message):
    __slots__ = ("blocks_per_owner",)
    BLOCKS_PER_OWNER_FIELD_NUMBER: _ClassVar[int]
    blocks_per_owner: int
    def __init__(self, blocks_per_owner: _Optional[int] = ...) -> None: ...

class SetPinBudgetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "digests")
    class AdaptersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class DigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.ScalarMap[str, str]
    digests: _containers.ScalarMap[str, bytes]
    def __init__(self, adapters: _Optional[_Mapping[str, str]] = ..., digests: _Optional[_Mapping[str, bytes]] = ...) -> None: ...
