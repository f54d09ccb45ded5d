"""Settings of the HTTP layer (the engine has its own `EngineConfig`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxserve.sampling_params import POOLING_KINDS
from server.reasoning import REASONING_PARSERS


@dataclasses.dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 0  # `jaxserve serve` serves the gRPC API on this port too; 0 = no gRPC
    served_model_name: str = "smollm2-135m-instruct"

    # Security. No keys = an open server (a warning is printed at start).
    ssl_certfile: str | None = None  # serve HTTPS with this certificate and ssl_keyfile (PEM files)
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # and require client certificates signed by these CAs
    api_keys: tuple[str, ...] = ()
    rate_limit_rpm: int = 0  # requests per minute per key; 0 = unlimited
    rate_limit_tpm: int = 0  # generated tokens per minute per key; 0 = unlimited

    # Admission and input limits.
    max_waiting_seqs: int = 256  # sequences queued beyond the engine's max_num_seqs -> 503
    max_queue_wait: float = 0.0  # seconds a request may wait for a running slot, then 503; 0 = no server queue
    max_body_bytes: int = 1 << 20
    max_n: int = 8
    max_tokens_limit: int | None = None  # None: the model's context length
    max_prompts: int = 64  # prompts in one /v1/completions request
    # Images of a vision-language model's chats (server/image_parts.py); each limit is a 400.
    max_images_per_request: int = 8
    max_image_bytes: int = 10 << 20  # of one image, encoded (a data: URL also counts in max_body_bytes)
    max_image_pixels: int = 4096 * 4096  # of one image, decoded
    allowed_local_media_path: Path | None = None  # file:// image URLs are read inside it only (None: refused)
    request_timeout: float = 600.0  # seconds from arrival to the last token; 0 = none
    body_timeout: float = 30.0  # seconds a client may take to send a request body (then 408)
    keepalive_timeout: float = 75.0  # seconds an idle keep-alive connection stays open

    # Sessions.
    session_dir: Path | None = None  # persist sessions as JSON files here
    session_ttl: float = 3600.0  # idle seconds before a session expires
    max_sessions_per_key: int = 64
    max_session_messages: int = 256
    session_pin_blocks_per_key: int | None = None  # None: the KV manager's default budget

    # Stored responses of the Responses API (sessions too: --session-dir keeps them).
    response_ttl: float = 30 * 24 * 3600.0  # idle seconds before a stored response expires (OpenAI keeps 30 days)
    max_stored_responses_per_key: int = 1000  # beyond it, a key's least recently used idle ones are deleted

    # Embeddings: which final hidden states of a decoder LM's prompt /v1/embeddings pools
    # ("last", "mean" or "cls": `jaxserve.pooling.POOLERS`); an encoder pools as its config says.
    embedding_pooling: str = "last"

    # The agent-facing API (server.tools, server.reasoning).
    strict_schemas: bool = True  # tool parameters and json_schema formats: no properties they do not list
    reasoning_parser: str | None = None  # vLLM's names: "qwen3", "deepseek_r1", "openai_gptoss"
    chat_template: str | None = None  # jinja text used instead of the model's own chat template

    # Lifecycle.
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGINT/SIGTERM

    def __post_init__(self) -> None:
        for name in ("rate_limit_rpm", "rate_limit_tpm", "max_waiting_seqs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in (
            "max_body_bytes",
            "max_n",
            "max_prompts",
            "max_images_per_request",
            "max_image_bytes",
            "max_image_pixels",
            "max_sessions_per_key",
            "max_session_messages",
            "max_stored_responses_per_key",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_queue_wait < 0:
            raise ValueError("max_queue_wait must be >= 0")
        if self.request_timeout < 0 or self.session_ttl <= 0 or self.response_ttl <= 0 or self.shutdown_timeout < 0:
            raise ValueError("request_timeout and shutdown_timeout must be >= 0, session_ttl and response_ttl > 0")
        if self.body_timeout <= 0 or self.keepalive_timeout <= 0:
            raise ValueError("body_timeout and keepalive_timeout must be > 0")
        if not 0 <= self.grpc_port <= 65535 or (self.grpc_port and self.grpc_port == self.port):
            raise ValueError("grpc_port must be in [0, 65535] and differ from port")
        if self.embedding_pooling not in POOLING_KINDS:
            raise ValueError(f"embedding_pooling must be one of {list(POOLING_KINDS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}")
        if any(not key or any(c.isspace() for c in key) for key in self.api_keys):
            raise ValueError("API keys must be non-empty and contain no whitespace")
