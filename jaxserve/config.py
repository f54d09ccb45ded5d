"""Engine configuration as the user asked it (flags, `LLM(...)` keyword arguments): KV cache, scheduler limits
and the shape buckets of the jitted steps. Checked here, never rewritten: what is derived from it (the model's
context, the KV blocks, the dtype `auto` picks, the buckets left unset) is computed once, before anything is
built, into a frozen `jaxserve.resolved_config.ResolvedConfig` (`jaxserve.config_resolution.resolve`).

Names follow vLLM's engine arguments where one exists (max_num_seqs, max_num_batched_tokens,
enable_prefix_caching, enable_chunked_prefill, ...), so users can carry their settings over.
"""

from __future__ import annotations

import dataclasses

from jaxserve.mooncake_store import parse_pool_url
from jaxserve.speculative.config import SpeculativeConfig

QUANTIZATIONS = ("auto", "none", "int8", "q4", "gguf")  # --quantization (checkpoints/quantize.py)
# The shape-bucket settings, in the order `ResolvedConfig` fills them in.
BUCKETS = (
    "decode_batch_buckets",
    "prefill_token_buckets",
    "prefill_seq_buckets",
    "block_table_buckets",
    "sampler_row_buckets",
)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # KV cache
    block_size: int = 16
    num_blocks: int | None = None  # if None: from kv_cache_memory
    kv_cache_memory: int = 1 << 30  # bytes for K and V of all layers (CPU default: 1 GiB)
    # auto (the weights' dtype, as vLLM's auto), float32, bfloat16, fp8 (= fp8_e4m3) or int8; fp8 and int8 rows
    # carry a scale per token and kv head (kernels_pallas/kv_quant.py)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # A model whose every attention layer slides (Mistral's sliding_window) keeps window-sized caches: blocks
    # wholly before the window are freed as a sequence grows (jaxserve/kv/window.py). False: every block kept.
    # Models mixing sliding and full layers (Gemma 3, gpt-oss) keep every block either way.
    sliding_window_kv: bool = True
    swap_space_blocks: int = 0  # host-tier capacity for swapped-out blocks (0 = no swapping)
    kv_host_bytes: int = 0  # host-tier capacity in bytes (the larger of this and swap_space_blocks wins)
    # Disk tier (off without a directory): blocks keyed by content, shared by engines on one directory
    # and found again after a restart. See jaxserve/kv/disk_tier.py.
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 16 << 30  # byte budget of the files this engine keeps
    kv_disk_write_through_hits: int = 0  # 0: write each block when cached; N: once it was hit N times
    kv_disk_min_load_tokens: int = 64  # shorter disk hits are recomputed instead of loaded
    kv_disk_max_inflight_bytes: int = 256 << 20  # bytes being read from disk at once
    # Pool tier (off without a URL): blocks keyed by content in a store every engine of a cluster shares,
    # mooncake://HOST:PORT (a Mooncake Store master). It sits below the host tier, and below the disk tier
    # when there is one too (kv_tiers.py: lookups and loads ask the disk first, writes go to both), and shares
    # kv_disk_write_through_hits, kv_disk_min_load_tokens and kv_disk_max_inflight_bytes. See
    # jaxserve/kv/pool_tier.py.
    kv_pool: str | None = None
    kv_pool_segment_bytes: int = 1 << 30  # memory this engine lends the pool
    kv_pool_local_host: str = "127.0.0.1"  # the address other pool clients reach this one at
    # Record the prefix cache's changes (KV events) for a router to place requests by: `jaxserve worker` streams
    # them over its gRPC service. Needs enable_prefix_caching (quietly off without it).
    kv_events: bool = False

    # Scheduler
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # None: the model's own context; either way lowered to what the KV cache holds for one request.
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    max_prefill_seqs: int = 4  # sequences in one ragged prefill step
    max_num_partial_prefills: int = 1  # long prompts being chunked at once
    # Images (vision tower inputs: a SmolVLM tile is one) a step may encode; encoder cache hits are free.
    # None: no limit. See jaxserve/scheduler/encoder_budget.py.
    max_num_encoder_images: int | None = None
    scheduling_policy: str = "fcfs"  # fcfs | priority | lpm
    preemption_mode: str = "recompute"  # recompute | swap
    watermark_blocks: int | None = None  # free blocks kept for running requests (None: 1%)

    # Model execution
    # The weights': float32, bfloat16, or auto (this machine's faster one: jaxserve/dtype_choice.py;
    # the command line's default).
    dtype: str = "float32"
    # Weight-only quantization of the layers' dense kernels and the output head (a tied embedding
    # table with it): none | int8 (per output channel) | q4 (4 bits, groups of 32) | gguf (a .gguf
    # file's Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K blocks as stored) | auto (gguf where a GGUF file runs on the C++
    # CPU kernels, else none: jaxserve/quantization_choice.py; the command line's default). The other
    # weights stay in `dtype`. See checkpoints/quantize.py.
    quantization: str = "none"
    attention_backend: str | None = None  # None: the platform default (pallas on GPU)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Devices a mixture-of-experts model's experts are split over (the mesh's "ep" axis; each
    # replica then runs on expert_parallel_size x tensor_parallel_size devices). 1 for dense models.
    expert_parallel_size: int = 1
    # Pipeline stages: the layers split into this many contiguous stages over the mesh's "pp" axis
    # (each replica then runs on pipeline_parallel_size x expert_parallel_size x tensor_parallel_size
    # devices); a step's rows flow through them in up to `pipeline_microbatches` micro-batches
    # (None: pipeline_parallel_size). See sharding/pipeline.py and docs/parallelism.md.
    pipeline_parallel_size: int = 1
    pipeline_microbatches: int | None = None
    compilation_cache_dir: str | None = None  # JAX's persistent compilation cache
    # Run the layers as a loop over separate per-layer weights instead of a scan over stacked
    # ones: XLA:CPU copies a scanned layer's weights before its matmuls (batch-1 decode ~1.4x
    # faster without; from batch 8 slower on CPU), but every step then compiles the layers one
    # by one (~4x the warm-up). See docs/configuration.md, "--unroll-layers".
    unroll_layers: bool = False
    seed: int = 0
    # Launch iteration N+1 before reading N's sampled tokens (they feed N+1 on the device), so the
    # host schedules and post-processes while the device computes. Off: the synchronous loop.
    async_scheduling: bool = True
    # Speculative decoding (off: None). `SpeculativeConfig.parse` reads the command line's JSON text
    # (`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`) and `LLM(...)`'s dict.
    speculative_config: SpeculativeConfig | None = None
    # Multi-step decode: up to this many decode steps of a batch in one device loop (sampling and
    # stop checks on the device, one read per loop). 1: off. Used for iterations with nothing
    # to prefill, no speculation and no structured output.
    num_scheduler_steps: int = 1
    # LoRA adapters (docs/lora.md): served from `max_loras` fixed-shape LoRA slots of rank
    # `max_lora_rank` (every step pays for all LoRA slots), with up to `max_cpu_loras` host copies
    # (None: max_loras). The adapters themselves are named at run time (`--lora-modules`, routes).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    # Shape buckets (None: derived from the limits above). Each list is sorted, finite, and
    # every jitted step is compiled for the cross product at warm-up. Block-table widths only
    # matter to the `reference` attention backend, whose work grows with the width.
    decode_batch_buckets: tuple[int, ...] | None = None
    prefill_token_buckets: tuple[int, ...] | None = None
    prefill_seq_buckets: tuple[int, ...] | None = None
    block_table_buckets: tuple[int, ...] | None = None
    # Rows of the sampler's programs: a step's logits are padded up to one of these, so the
    # sampler (costly to compile) has a few variants, not one per step shape.
    sampler_row_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Check the settings (ValueError naming the setting); nothing is changed here."""
        if not isinstance(self.speculative_config, SpeculativeConfig | None):
            raise ValueError(
                "speculative_config must be a SpeculativeConfig or None (SpeculativeConfig.parse reads its JSON "
                f"text or dict), got {type(self.speculative_config).__name__}"
            )
        _check_choices(self)
        _check_sizes(self)
        _check_pipeline(self)
        _check_lora(self)
        _check_kv_tiers(self)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_choices(c: EngineConfig) -> None:
    if c.scheduling_policy not in ("fcfs", "priority", "lpm"):
        raise ValueError(f"unknown scheduling_policy {c.scheduling_policy!r}")
    if c.quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {c.quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    if c.preemption_mode not in ("recompute", "swap"):
        raise ValueError(f"unknown preemption_mode {c.preemption_mode!r}")
    if c.preemption_mode == "swap" and c.swap_space_blocks <= 0 and c.kv_host_bytes <= 0:
        raise ValueError("preemption_mode='swap' needs swap_space_blocks > 0 or kv_host_bytes > 0")


def _check_sizes(c: EngineConfig) -> None:
    """The limits and the buckets given: whole numbers in range."""
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_seqs", "num_scheduler_steps"):
        if not _positive_int(getattr(c, name)):
            raise ValueError(f"{name} must be an integer >= 1, got {getattr(c, name)!r}")
    if c.max_num_encoder_images is not None and not _positive_int(c.max_num_encoder_images):
        raise ValueError(f"max_num_encoder_images must be an integer >= 1 or None, got {c.max_num_encoder_images!r}")
    if c.num_blocks is not None and (not _positive_int(c.num_blocks) or c.num_blocks < 2):
        raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is reserved), got {c.num_blocks!r}")
    if c.max_model_len is not None and (not _positive_int(c.max_model_len) or c.max_model_len % c.block_size):
        raise ValueError(f"max_model_len must be a positive multiple of block_size, got {c.max_model_len}")
    if c.kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory must be > 0, got {c.kv_cache_memory}")
    for name in ("swap_space_blocks", "kv_host_bytes", "kv_disk_write_through_hits", "kv_disk_min_load_tokens"):
        if getattr(c, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(c, name)}")
    for name in BUCKETS:
        given = getattr(c, name)
        if given is not None and (not given or not all(_positive_int(b) for b in given)):
            raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {given!r}")


def _check_pipeline(c: EngineConfig) -> None:
    if not _positive_int(c.pipeline_parallel_size):
        raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {c.pipeline_parallel_size!r}")
    if c.pipeline_microbatches is not None and not _positive_int(c.pipeline_microbatches):
        raise ValueError(f"pipeline_microbatches must be an integer >= 1, got {c.pipeline_microbatches!r}")
    if c.pipeline_parallel_size == 1:
        return
    # Not yet through the pipeline's stages: each needs its arrays sliced by stage (LoRA slots,
    # quantization scales, the cache's scales) and a test.
    unstaged = [
        name
        for name, on in (
            ("enable_lora", c.enable_lora),
            ("quantization", c.quantization not in ("none", "auto")),
            ("kv_cache_dtype", c.kv_cache_dtype in ("int8", "fp8", "fp8_e4m3")),
        )
        if on
    ]
    if unstaged:
        raise ValueError(f"pipeline_parallel_size > 1 does not run with {', '.join(unstaged)} yet")


def _check_lora(c: EngineConfig) -> None:
    if not c.enable_lora:
        return
    if c.max_loras < 1 or c.max_lora_rank < 1:
        raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {c.max_loras} and {c.max_lora_rank}")
    if c.max_cpu_loras is not None and c.max_cpu_loras < c.max_loras:
        raise ValueError(f"max_cpu_loras ({c.max_cpu_loras}) must be >= max_loras ({c.max_loras})")
    if c.num_scheduler_steps > 1:
        raise ValueError("enable_lora does not run multi-step decode yet: use num_scheduler_steps=1")


def _check_kv_tiers(c: EngineConfig) -> None:
    if c.kv_pool is not None:
        if not c.enable_prefix_caching:
            raise ValueError("the pool tier (kv_pool) needs enable_prefix_caching")
        if c.kv_pool_segment_bytes < 16 << 20:
            raise ValueError("kv_pool_segment_bytes must be at least 16 MiB")
        parse_pool_url(c.kv_pool)
    if c.kv_disk_dir is None:
        return
    if not c.kv_disk_dir:
        raise ValueError("kv_disk_dir must be a directory path")
    if not c.enable_prefix_caching:
        raise ValueError("the disk tier (kv_disk_dir) needs enable_prefix_caching")
    if c.kv_disk_bytes <= 0 or c.kv_disk_max_inflight_bytes <= 0:
        raise ValueError("kv_disk_bytes and kv_disk_max_inflight_bytes must be > 0")


def bucket_for(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value."""
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
