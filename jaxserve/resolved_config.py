"""The engine configuration as served: `EngineConfig` with everything derived from it computed once, before
anything is built, and frozen. The runner, the scheduler, the KV manager and the engine read this one object.

`resolve_limits` is the arithmetic, from the few facts of the served model it needs (`ServedModel`); it imports
no JAX, so host-only code and tests can resolve a config. `jaxserve.config_resolution.resolve` finds those facts
for a model (the dtype `auto` picks, the KV bytes of a block under tensor and pipeline parallelism) and calls it.
"""

from __future__ import annotations

import dataclasses
import logging

from jaxserve.config import BUCKETS, EngineConfig, bucket_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What resolution needs to know of the model as this engine serves it."""

    context: int  # tokens of context the model was trained for (max_position_embeddings)
    dtype: str  # the weights' dtype (float32 or bfloat16: "auto" chosen)
    attention_backend: str  # the one asked for, or the platform's default
    kv_storage_dtype: str  # numpy name of the KV cache's storage dtype (kernels_pallas/kv_quant.py)
    kv_block_bytes: int  # K and V of one block, all layers and kv heads as served (all devices), scales included
    kv_devices: int  # devices a block's bytes are split over (tp x pp): kv_cache_memory is per device
    # A hybrid's (Gated DeltaNet layers): bytes of one sequence's linear-attention state (its state slot), all
    # devices; 0: the model keeps no per-sequence state.
    state_slot_bytes: int = 0
    # The window of a model whose every attention layer slides (None: a layer attends to all its tokens).
    sliding_window: int | None = None
    # EAGLE-3 speculation: the target layers whose input states the head reads (() without it).
    aux_hidden_layers: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedConfig(EngineConfig):
    """Every setting of `EngineConfig` under its own name, the ones left to the engine filled in, plus what
    the served model decides. Built by `resolve_limits`; never changed afterwards. The settings it narrows
    are required (`field()`: no default inherited from the user-facing `EngineConfig`)."""

    dtype: str = dataclasses.field()  # the weights': float32 or bfloat16
    attention_backend: str = dataclasses.field()
    num_blocks: int = dataclasses.field()  # block 0 reserved: as given, or kv_cache_memory's worth
    max_model_len: int = dataclasses.field()  # the model's context or less, and what the KV cache holds for one
    max_num_batched_tokens: int = dataclasses.field()  # >= max_model_len without chunked prefill
    watermark_blocks: int = dataclasses.field()
    pipeline_microbatches: int = dataclasses.field()
    max_cpu_loras: int = dataclasses.field()
    decode_batch_buckets: tuple[int, ...] = dataclasses.field()
    prefill_token_buckets: tuple[int, ...] = dataclasses.field()
    prefill_seq_buckets: tuple[int, ...] = dataclasses.field()
    block_table_buckets: tuple[int, ...] = dataclasses.field()
    sampler_row_buckets: tuple[int, ...] = dataclasses.field()
    # Speculative decoding's verify programs: the decode batch buckets up to the first that holds the largest
    # batch that speculates (none without speculation).
    verify_batch_buckets: tuple[int, ...]
    model_context: int  # the model's own context (max_position_embeddings)
    kv_storage_dtype: str  # numpy name of the KV cache's storage dtype
    kv_block_bytes: int  # bytes of one KV block over all devices, scales included
    num_host_slots: int  # host-tier blocks (0: no host tier)
    num_state_slots: int = 0  # a hybrid's state slots, slot 0 reserved (jaxserve/kv/state_slots.py); 0: none
    num_state_snapshots: int = 0  # of those, kept as snapshots for prefix hits at most (jaxserve/kv/state_snapshots.py)
    # Sequences hold only the blocks of this window (jaxserve/kv/window.py); None: every block.
    kv_window: int | None = None
    # EAGLE-3 speculation: the model sows the residual stream entering these layers (`DecoderModel.aux_layers`).
    aux_hidden_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_buckets(self)

    @property
    def max_blocks_per_seq(self) -> int:
        return self.max_model_len // self.block_size

    def num_compiled_variants(self) -> int:
        """Model-step programs compiled at warm-up: decode and prefill, for every bucket combination."""
        widths = len(self.block_table_buckets)
        decode = len(self.decode_batch_buckets) * widths * (1 + (self.num_scheduler_steps > 1))
        prefill = len(self.prefill_token_buckets) * len(self.prefill_seq_buckets) * widths
        return decode + prefill


def resolve_limits(config: EngineConfig, served: ServedModel) -> ResolvedConfig:
    """`config` served for `served`: the KV blocks, the context, the budgets and buckets, the host slots."""
    bs = config.block_size
    config, state_slots, snapshots = hybrid_settings(config, served)
    # One budget for every layer group: the state slots' bytes first, the paged blocks in the rest.
    budget = config.kv_cache_memory * served.kv_devices - state_slots * served.state_slot_bytes
    num_blocks = config.num_blocks or max(2, budget // served.kv_block_bytes)
    usable = num_blocks - 1  # block 0 is reserved (jaxserve/kv/block_pool.py)
    watermark = usable // 100 if config.watermark_blocks is None else config.watermark_blocks
    if not 0 <= watermark < usable:
        raise ValueError(f"watermark_blocks must be in [0, {usable}), got {config.watermark_blocks}")
    max_model_len = _max_model_len(config, served.context, (usable - watermark) * bs)
    batched = config.max_num_batched_tokens
    if not config.enable_chunked_prefill:  # a whole prompt must fit one step
        batched = max(batched, max_model_len)
    buckets = _buckets(config, max_model_len, batched)
    derived = dict(
        dtype=served.dtype,
        attention_backend=served.attention_backend,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
        watermark_blocks=watermark,
        pipeline_microbatches=config.pipeline_microbatches or config.pipeline_parallel_size,
        max_cpu_loras=config.max_loras if config.max_cpu_loras is None else config.max_cpu_loras,
        model_context=served.context,
        kv_storage_dtype=served.kv_storage_dtype,
        kv_block_bytes=served.kv_block_bytes,
        num_host_slots=_num_host_slots(config, served.kv_block_bytes, max_model_len // bs),
        num_state_slots=state_slots,
        num_state_snapshots=snapshots,
        kv_window=_kv_window(config, served, max_model_len, state_slots),
        aux_hidden_layers=served.aux_hidden_layers,
        **buckets,
        verify_batch_buckets=_verify_batches(config, buckets["decode_batch_buckets"]),
    )
    asked = {f.name: getattr(config, f.name) for f in dataclasses.fields(EngineConfig)}
    return ResolvedConfig(**{**asked, **derived})


def hybrid_settings(config: EngineConfig, served: ServedModel) -> tuple[EngineConfig, int, int]:
    """`config` as a hybrid model (per-sequence state) runs it, its state slots (0: not a hybrid) and how many
    of them may keep snapshots of the state for prefix hits: one per sequence with prefix caching, else none.
    ValueError naming the settings that do not run with a hybrid yet."""
    if not served.state_slot_bytes:
        return config, 0, 0
    refused = [
        name
        for name, on in (
            ("pipeline_parallel_size > 1", config.pipeline_parallel_size > 1),
            ("enable_lora", config.enable_lora),
            ("speculative_config", config.speculative_config is not None),
            ("unroll_layers", config.unroll_layers),
            ("kv_disk_dir", config.kv_disk_dir is not None),
            ("kv_pool", config.kv_pool is not None),
        )
        if on
    ]
    if refused:
        raise ValueError(f"a Gated DeltaNet hybrid model does not run with {', '.join(refused)} yet")
    snapshots = config.max_num_seqs if config.enable_prefix_caching else 0
    return dataclasses.replace(config, kv_events=False), config.max_num_seqs + 1 + snapshots, snapshots


def _kv_window(config: EngineConfig, served: ServedModel, max_model_len: int, state_slots: int) -> int | None:
    """The window sequences' caches are cut to: the model's, when every attention layer slides, the config
    asks for it, the model keeps no per-sequence state besides (a hybrid) and a sequence can outgrow it."""
    window = served.sliding_window
    if window is None or not config.sliding_window_kv or state_slots or window >= max_model_len:
        return None
    return window


def _max_model_len(config: EngineConfig, context: int, capacity: int) -> int:
    """The model's context in whole blocks, or max_model_len if shorter; lowered (with a warning) to the
    `capacity` tokens the KV cache holds above its watermark (a block at least), so that a lone request always
    fits the pool (or it could be preempted forever)."""
    bs = config.block_size
    longest = context - context % bs
    if longest < bs:
        raise ValueError(f"the model's context ({context} tokens) is shorter than one block ({bs} tokens)")
    if config.max_model_len is not None and config.max_model_len > longest:
        logger.warning(
            "max_model_len %d exceeds the model's context (%d tokens); lowering it", config.max_model_len, context
        )
    length = longest if config.max_model_len is None else min(config.max_model_len, longest)
    if length <= capacity:
        return length
    logger.warning(
        "max_model_len %d needs %d KV blocks for one request, and the KV cache holds %d above its watermark "
        "(--kv-cache-memory %d bytes, or --num-blocks): lowering max_model_len to %d tokens; give the KV "
        "cache more memory to serve longer requests",
        length,
        length // bs,
        capacity // bs,
        config.kv_cache_memory,
        capacity,
    )
    return capacity


def _num_host_slots(config: EngineConfig, block_bytes: int, max_blocks_per_seq: int) -> int:
    """Host slots: the larger of swap_space_blocks and kv_host_bytes; with a disk or pool tier and
    neither set, room for two requests of max_model_len (disk loads land there)."""
    host_slots = max(config.swap_space_blocks, config.kv_host_bytes // block_bytes)
    if (config.kv_disk_dir is not None or config.kv_pool is not None) and host_slots == 0:
        host_slots = 2 * max_blocks_per_seq
    return host_slots


def _geometric(lo: int, hi: int, factor: int) -> tuple[int, ...]:
    """lo, lo * factor, ... up to and including hi."""
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= factor
    out.append(hi)
    return tuple(sorted(set(out)))


def _buckets(config: EngineConfig, max_model_len: int, batched: int) -> dict[str, tuple[int, ...]]:
    """The shape buckets given (sorted, without repeats), and the ones left unset derived from the limits."""
    given = {name: tuple(sorted(set(getattr(config, name) or ()))) for name in BUCKETS}
    decode = given["decode_batch_buckets"] or _geometric(1, config.max_num_seqs, 2)
    # One count: a prefill step's unused sequence entries cost a few empty attention tiles and logits rows,
    # less than compiling a variant per count would.
    seqs = given["prefill_seq_buckets"] or (config.max_prefill_seqs,)
    rows = max(decode[-1], seqs[-1])
    return dict(
        decode_batch_buckets=decode,
        prefill_token_buckets=given["prefill_token_buckets"] or _geometric(min(32, batched), batched, 2),
        prefill_seq_buckets=seqs,
        # One width: the serving backends (paged_jax, Pallas) walk a block table only up to each sequence's
        # length, so a wider table costs a few bytes, not attention work.
        block_table_buckets=given["block_table_buckets"] or (max_model_len // config.block_size,),
        sampler_row_buckets=given["sampler_row_buckets"] or _geometric(min(4, rows), rows, 2),
    )


def _verify_batches(config: EngineConfig, decode: tuple[int, ...]) -> tuple[int, ...]:
    """The decode batch buckets up to the first that holds the largest batch that speculates."""
    spec = config.speculative_config
    if spec is None:
        return ()
    largest = bucket_for(min(spec.disable_by_batch_size, config.max_num_seqs), decode)
    return tuple(b for b in decode if b <= largest)


def _check_buckets(c: ResolvedConfig) -> None:
    if c.decode_batch_buckets[-1] < c.max_num_seqs:
        raise ValueError("decode_batch_buckets must reach max_num_seqs")
    if c.prefill_token_buckets[-1] < c.max_num_batched_tokens:
        raise ValueError("prefill_token_buckets must reach max_num_batched_tokens")
    if c.block_table_buckets[-1] < c.max_blocks_per_seq:
        raise ValueError("block_table_buckets must reach max_model_len / block_size")
    if c.sampler_row_buckets[-1] < max(c.decode_batch_buckets[-1], c.prefill_seq_buckets[-1]):
        raise ValueError("sampler_row_buckets must reach the largest decode batch and prefill sequence buckets")
