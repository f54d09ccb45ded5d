"""The engine interface: everything the public server (`server/`) and the cluster (`server/cluster/`)
may ask of an engine, and the types they exchange with it.

Two implementations: `jaxserve.async_engine.AsyncEngine` runs the engine loop of this process (one
replica, or several data-parallel ones behind `jaxserve.data_parallel.DataParallelEngine`), and
`server.cluster.router.RemoteEngine` gives the same API over worker processes. The server and the
cluster import this module and the public types below, nothing else of the engine
(`tests/test_layering.py` checks it), so either engine can stand behind the same routes.

The public types: `SamplingParams` (`jaxserve.sampling_params`), `Delta`, `Usage`, `TokenLogprob`,
`FinishReason` (`jaxserve.outputs`), `EngineSnapshot` and its parts (`jaxserve.engine_snapshot`),
`Tokenizer`, `GuidedDecoding` (`jaxserve.structured.spec`), `TextStream` (detokenizing and stop
strings, which the router applies itself), `jaxserve.placement` (the one placement policy, which
the router applies to its workers), and the handles `Pin` (a session's pinned
history) and `KVHold` (KV blocks held for a transfer), which callers pass back but never look into.
No JAX here.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import numpy as np

from jaxserve.engine_snapshot import EngineSnapshot
from jaxserve.image_prompt import MultimodalPrompt
from jaxserve.kv.leases import Hold as KVHold
from jaxserve.kv.leases import Pin
from jaxserve.outputs import Delta
from jaxserve.sampling_params import SamplingParams, encodes_as_utf8
from jaxserve.tokenizer import Tokenizer

__all__ = [
    "BlockLayout",
    "DuplicateRequestError",
    "EngineClient",
    "EngineDeadError",
    "EngineInfo",
    "KVHold",
    "KVTransferEngine",
    "Pin",
    "PromptTooLongError",
    "RequestFailedError",
    "StagedKV",
    "TransferError",
    "check_prompt_ids",
    "encode_prompt",
    "merge_choices",
]


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it failed or was shut down)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (its part of a step raised); others go on."""


class UnknownAdapterError(ValueError):
    """A request named a LoRA adapter this engine does not serve (a 404, like an unknown model)."""


class DuplicateRequestError(ValueError):
    """A request id that is already running."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"duplicate request id {request_id!r}")


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate within max_model_len."""


def check_prompt_ids(ids: Sequence[int], vocab_size: int, max_model_len: int) -> list[int]:
    """The one check of a prompt's token ids (the engine's, and the server's before it formats
    the error): not empty, in the vocabulary, and leaving room for one generated token."""
    if not ids:
        raise ValueError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, and the prompt has "
            f"{len(ids)} tokens (at least one token must be left to generate)"
        )
    return list(ids)


def encode_prompt(
    prompt: str | list[int] | MultimodalPrompt, tokenizer: Tokenizer, vocab_size: int, max_model_len: int
) -> list[int]:
    """Token ids of a prompt, or ValueError when it cannot be served (the engine's and the
    router's). Text is a completion prompt: it gets what the tokenizer adds (a BOS for Llama 2 /
    Mistral), as in vLLM; a rendered chat, whose template writes its own BOS, comes as ids (with
    its images' rows: `MultimodalPrompt`)."""
    if isinstance(prompt, MultimodalPrompt):
        prompt = prompt.token_ids
    if isinstance(prompt, str):
        if not encodes_as_utf8(prompt):
            raise ValueError("the prompt must be valid Unicode (no lone surrogates)")
        prompt = tokenizer.encode(prompt, add_special_tokens=True)
    return check_prompt_ids(prompt, vocab_size, max_model_len)


async def merge_choices(out: asyncio.Queue, n: int) -> AsyncIterator[Delta]:
    """The deltas of a request's `n` choices as they arrive in `out`, until each has its final
    one; an exception put in `out` ends the stream with it."""
    remaining = n
    while remaining:
        item = await out.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            remaining -= 1
        yield item


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What a client reads of an engine once, at start-up. The tokenizer is thread-safe for
    encoding, decoding and chat templates, so the asyncio side uses it directly."""

    model_name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    max_num_seqs: int  # sequences all replicas (or workers) run at once
    block_size: int
    hidden_size: int  # the length of an embedding (a pooling request's `Delta.embedding`)
    # An encoder-only embedding model's `checkpoints.encoders.EncoderConfig` (its pooling,
    # normalisation, Matryoshka dimensions); None for a decoder LM.
    encoder: Any = None
    # A vision-language model's vision tower (`checkpoints.architectures.gemma3_vision.VisionConfig` or
    # `idefics3_vision.VisionConfig`: its image size, tiling and image tokens); None: no images.
    vision: Any = None


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """One KV block's K (or V) array: [layers, kv_heads, block_size, head_dim] of `dtype`."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def block_bytes(self) -> int:
        """K and V of one block."""
        return 2 * int(np.prod(self.shape)) * self.dtype.itemsize

    def arrays(self, k: bytes, v: bytes, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of `num_blocks` blocks from their bytes (block i on axis 2); ValueError when
        the sizes do not fit."""
        layers, heads, bs, dim = self.shape
        shape = (layers, heads, num_blocks, bs, dim)
        want = self.block_bytes // 2 * num_blocks
        if len(k) != want or len(v) != want:
            raise ValueError(f"{num_blocks} blocks need {want} bytes each of K and V, got {len(k)} and {len(v)}")
        return np.frombuffer(k, self.dtype).reshape(shape), np.frombuffer(v, self.dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class StagedKV:
    """Blocks one engine offers to one device-to-device pull by another (`stage_kv`)."""

    address: str  # the offering engine's transfer server
    transfer_id: int
    num_blocks: int
    num_chunks: int  # the blocks travel in chunks of `chunk_blocks` (the last one padded)
    chunk_blocks: int


class TransferError(Exception):
    """A pull of KV blocks that did not bring them (the message says why)."""


class EngineClient(Protocol):
    """An engine as the server sees it. Every method may be called from the asyncio thread; the
    awaitable ones return None once the engine has stopped."""

    info: EngineInfo
    # Called with each engine-loop iteration's seconds (the server's step-time histogram); an
    # engine with no loop of its own (the router) never calls it.
    on_step: Callable[[float], None] | None

    @property
    def is_alive(self) -> bool:
        """The engine can serve (its loop runs; for a router: some worker serves)."""

    @property
    def last_step_at(self) -> float:
        """`time.monotonic()` of the engine loop's last iteration (a stuck loop stops advancing it)."""

    def health_details(self) -> dict[str, Any]:
        """What `/health` adds to its status (a router lists its workers)."""

    def running_capacity(self) -> int:
        """Sequences it can run at once now: `info.max_num_seqs` for one engine; for a router, the sum of
        the workers that are up (what the server admits against)."""

    def generate(
        self,
        request_id: str,
        prompt: str | list[int] | MultimodalPrompt,
        params: SamplingParams,
        session_id: str | None = None,
        hold_kv: bool = False,
    ) -> AsyncIterator[Delta]:
        """Stream the request's deltas (`params.n` sequences, each ending with a finished delta).
        Raises ValueError for a request the engine cannot serve, `EngineDeadError` when it has
        stopped, `RequestFailedError` when this request failed alone. Leaving the iteration early
        aborts the request. A `session_id` keeps a session's turns where its KV is cached.
        `hold_kv` (n = 1, engines that export KV): when the sequence ends by length, its prompt's
        cached blocks are held and the final delta carries the `KVHold` (`Delta.kv_hold`).
        Embeddings: with `params.pooling` (`SamplingParams.for_pooling`) nothing is generated and
        the final delta carries the prompt's pooled final hidden states (`Delta.embedding`)."""

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish reason "abort"."""

    async def snapshot(self) -> EngineSnapshot | None:
        """A consistent picture of the engine's state (for `/metrics` and leak checks)."""

    async def pin_history(
        self,
        session_id: str,
        owner: str,
        token_ids: list[int],
        old: Pin | None,
        others: list[Pin],
        lora: str | None = None,
    ) -> tuple[Pin | None, list[Pin]] | None:
        """Pin the cached blocks of a session's history (replacing `old`) within the owner's block
        budget, releasing pins of `others` (least recently used first) when it does not fit; the
        blocks computed with LoRA adapter `lora` when given (the base model's otherwise).
        Returns the new pin (None when it cannot fit) and the pins released."""

    async def unpin(self, pin: Pin) -> None:
        """Release a pin (nothing if it is no longer held)."""

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as model `name` (ValueError when it cannot be served)."""

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (`UnknownAdapterError` if it is not served)."""

    async def lora_adapters(self) -> dict[str, str] | None:
        """The adapters served: model name -> the directory it was loaded from."""

    async def end_sessions(self, ended: list[tuple[str, Pin | None]]) -> None:
        """Sessions that are gone: release each one's pin and its place on a replica or worker."""

    async def set_pin_budget(self, blocks_per_owner: int) -> None:
        """KV blocks one owner's sessions may pin."""


class KVEventSource(Protocol):
    """A replica's KV events (`jaxserve.kv.kv_events.KVEventLog`), read from any thread: the content
    keys (chained from `seed`) of the blocks its prefix cache holds, and their changes numbered."""

    seed: bytes

    def snapshot(self) -> tuple[int, frozenset[bytes]]:
        """(sequence number, the keys cached as of it)."""

    def since(self, seq: int) -> list[Any] | None:
        """Batches (`seq`, `stored`, `removed`, `cleared`) after `seq`; None when some are no
        longer kept (take a snapshot)."""


class KVTransferEngine(EngineClient, Protocol):
    """An engine that exports and imports KV blocks (a worker of prefill/decode disaggregation).

    The prefill side: `generate(..., hold_kv=True)`, then `read_kv` of the final delta's hold,
    then `release_kv`. The decode side: `hold_kv` of what its own cache has of the prompt, then
    `write_kv` of the pulled rest (the hold grows), held until the request is admitted. Device to
    device: `stage_kv` offers held blocks to one pull of another engine's transfer server,
    `pull_staged_kv` brings them onto this engine's devices and writes them as `write_kv` does.
    Blocks are keyed by content (`kv_key`), so KV from other weights or layouts is never used."""

    kv_layout: BlockLayout

    def kv_key(self, token_ids: Sequence[int], num_blocks: int) -> bytes:
        """Content key of the prompt's first `num_blocks` blocks on this engine (weights, dtype,
        layout and the tokens)."""

    @property
    def transfer_address(self) -> str | None:
        """Where this engine's device transfer server listens (None: bytes only)."""

    def kv_events(self) -> KVEventSource | None:
        """The prefix cache's changes (KV events) of its one replica, for a router (None: not recorded)."""

    def lora_adapter_digests(self) -> dict[str, bytes]:
        """The adapters served: name -> weights digest, the salt of the content keys of their requests'
        blocks in the KV events (`ChainKeys.salted`)."""

    async def hold_kv(self, token_ids: Sequence[int], max_blocks: int | None = None) -> KVHold | None:
        """Hold the cached device blocks of the prompt's longest cached prefix."""

    async def read_kv(self, hold: KVHold, first: int, count: int) -> tuple[np.ndarray, np.ndarray] | None:
        """K and V of held blocks [first, first + count), block i on axis 2; LookupError when the
        hold was released meanwhile."""

    async def write_kv(self, hold: KVHold, token_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> KVHold | None:
        """Write the prompt's blocks from `hold.num_blocks` on into fresh blocks and add them to
        the prefix cache; returns the longer hold, which replaces `hold` (fewer blocks are taken
        when the pool is short: the request recomputes the rest)."""

    async def stage_kv(self, hold: KVHold, first: int, count: int, timeout: float) -> StagedKV | None:
        """Offer held blocks [first, first + count) to one device pull for `timeout` seconds.
        LookupError when the hold was released or this engine has no transfer server."""

    async def pull_staged_kv(
        self, staged: StagedKV, hold: KVHold, token_ids: Sequence[int], timeout: float
    ) -> KVHold | None:
        """Pull another engine's staged blocks (the prompt's blocks from `hold.num_blocks` on)
        onto this engine's devices and write them as `write_kv` does. TransferError when the
        pull fails or does not fit."""

    async def release_kv(self, hold: KVHold) -> None:
        """Release a hold (nothing if it is no longer active)."""
