"""Engine configuration: KV cache, scheduler limits and the shape buckets of the jitted steps.

Names follow vLLM's engine arguments where one exists (max_num_seqs, max_num_batched_tokens,
enable_prefix_caching, enable_chunked_prefill, ...), so users can carry their settings over.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jaxserve.speculative.config import SpeculativeConfig

QUANTIZATIONS = ("none", "int8", "q4", "gguf")  # --quantization (checkpoints/quantize.py)

logger = logging.getLogger(__name__)


def _geometric(lo: int, hi: int, factor: int) -> tuple[int, ...]:
    """lo, lo * factor, ... up to and including hi."""
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= factor
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclasses.dataclass
class EngineConfig:
    # KV cache
    block_size: int = 16
    num_blocks: int | None = None  # if None: from kv_cache_memory
    kv_cache_memory: int = 1 << 30  # bytes for K and V of all layers (CPU default: 1 GiB)
    # auto (the weights' dtype, as vLLM's auto), float32, bfloat16, fp8 (= fp8_e4m3) or int8; fp8 and int8 rows
    # carry a scale per token and kv head (kernels_pallas/kv_quant.py)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    swap_space_blocks: int = 0  # host-tier capacity for swapped-out blocks (0 = no swapping)
    kv_host_bytes: int = 0  # host-tier capacity in bytes (the larger of this and swap_space_blocks wins)
    # Disk tier (off without a directory): blocks keyed by content, shared by engines on one directory
    # and found again after a restart. See jaxserve/kv/disk_tier.py.
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 16 << 30  # byte budget of the files this engine keeps
    kv_disk_write_through_hits: int = 0  # 0: write each block when cached; N: once it was hit N times
    kv_disk_min_load_tokens: int = 64  # shorter disk hits are recomputed instead of loaded
    kv_disk_max_inflight_bytes: int = 256 << 20  # bytes being read from disk at once

    # Scheduler
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # None: the model's own context (`for_model`), lowered to what the KV cache holds for one request.
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    max_prefill_seqs: int = 4  # sequences in one ragged prefill step
    max_num_partial_prefills: int = 1  # long prompts being chunked at once
    scheduling_policy: str = "fcfs"  # fcfs | priority | lpm
    preemption_mode: str = "recompute"  # recompute | swap
    watermark_blocks: int | None = None  # free blocks kept for running requests (None: 1%)

    # Model execution
    # The weights': float32, bfloat16, or auto (this machine's faster one: jaxserve/dtype_choice.py;
    # the command line's default).
    dtype: str = "float32"
    # Weight-only quantization of the layers' dense kernels and the output head (a tied embedding
    # table with it): none | int8 (per output channel) | q4 (4 bits, groups of 32) | gguf (a .gguf
    # file's Q8_0 / Q4_0 / Q4_1 / Q4_K blocks as stored). The other weights stay in `dtype`. See
    # checkpoints/quantize.py.
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
    # N-gram speculative decoding (off: None): a SpeculativeConfig, its dict, or its JSON text
    # (`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`); parsed here.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Multi-step decode: up to this many decode steps of a batch in one device loop (sampling and
    # stop checks on the device, one read per loop). 1: off. Used for iterations with nothing
    # to prefill, no speculation and no structured output.
    num_scheduler_steps: int = 1
    # LoRA adapters (docs/lora.md): served from `max_loras` fixed-shape device slots of rank
    # `max_lora_rank` (every step pays for all slots), with up to `max_cpu_loras` host copies
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
        """Check the settings; with max_model_len known, derive the buckets left unset (without it,
        they wait for `for_model`)."""
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.scheduling_policy not in ("fcfs", "priority", "lpm"):
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption_mode {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.swap_space_blocks <= 0 and self.kv_host_bytes <= 0:
            raise ValueError("preemption_mode='swap' needs swap_space_blocks > 0 or kv_host_bytes > 0")
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {self.pipeline_parallel_size!r}")
        if self.pipeline_microbatches is not None and (
            not isinstance(self.pipeline_microbatches, int) or self.pipeline_microbatches < 1
        ):
            raise ValueError(f"pipeline_microbatches must be an integer >= 1, got {self.pipeline_microbatches!r}")
        if self.pipeline_parallel_size > 1:
            # Not yet through the pipeline's stages: each needs its arrays sliced by stage (adapter
            # slots, quantization scales, the cache's scales) and a test.
            unstaged = [
                name
                for name, on in (
                    ("enable_lora", self.enable_lora),
                    ("quantization", self.quantization != "none"),
                    ("kv_cache_dtype", self.kv_cache_dtype in ("int8", "fp8", "fp8_e4m3")),
                )
                if on
            ]
            if unstaged:
                raise ValueError(f"pipeline_parallel_size > 1 does not run with {', '.join(unstaged)} yet")
        if not isinstance(self.num_scheduler_steps, int) or self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be an integer >= 1, got {self.num_scheduler_steps!r}")
        if self.enable_lora:
            if self.max_loras < 1 or self.max_lora_rank < 1:
                raise ValueError(
                    f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}"
                )
            self.max_cpu_loras = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
            if self.num_scheduler_steps > 1:
                raise ValueError("enable_lora does not run multi-step decode yet: use num_scheduler_steps=1")
        for name in ("swap_space_blocks", "kv_host_bytes", "kv_disk_write_through_hits", "kv_disk_min_load_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_disk_dir is not None:
            if not self.kv_disk_dir:
                raise ValueError("kv_disk_dir must be a directory path")
            if not self.enable_prefix_caching:
                raise ValueError("the disk tier (kv_disk_dir) needs enable_prefix_caching")
            if self.kv_disk_bytes <= 0 or self.kv_disk_max_inflight_bytes <= 0:
                raise ValueError("kv_disk_bytes and kv_disk_max_inflight_bytes must be > 0")
        if self.max_model_len is None:
            return
        if self.max_model_len <= 0 or self.max_model_len % self.block_size:
            raise ValueError(f"max_model_len must be a positive multiple of block_size, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt must fit one step.
            self.max_num_batched_tokens = self.max_model_len
        max_blocks = self.max_model_len // self.block_size
        if self.decode_batch_buckets is None:
            self.decode_batch_buckets = _geometric(1, self.max_num_seqs, 2)
        if self.prefill_token_buckets is None:
            self.prefill_token_buckets = _geometric(
                min(32, self.max_num_batched_tokens), self.max_num_batched_tokens, 2
            )
        if self.prefill_seq_buckets is None:
            # One count: a prefill step's unused sequence slots cost a few empty attention tiles
            # and logits rows, less than compiling a variant per count would.
            self.prefill_seq_buckets = (self.max_prefill_seqs,)
        if self.block_table_buckets is None:
            # One width: the serving backends (paged_jax, Pallas) walk a block table only up to
            # each sequence's length, so a wider table costs a few bytes, not attention work.
            self.block_table_buckets = (max_blocks,)
        if self.sampler_row_buckets is None:
            rows = max(max(self.decode_batch_buckets), max(self.prefill_seq_buckets))
            self.sampler_row_buckets = _geometric(min(4, rows), rows, 2)
        for name in (
            "decode_batch_buckets",
            "prefill_token_buckets",
            "prefill_seq_buckets",
            "block_table_buckets",
            "sampler_row_buckets",
        ):
            setattr(self, name, tuple(sorted(set(getattr(self, name)))))
        if self.decode_batch_buckets[-1] < self.max_num_seqs:
            raise ValueError("decode_batch_buckets must reach max_num_seqs")
        if self.prefill_token_buckets[-1] < self.max_num_batched_tokens:
            raise ValueError("prefill_token_buckets must reach max_num_batched_tokens")
        if self.block_table_buckets[-1] < max_blocks:
            raise ValueError("block_table_buckets must reach max_model_len / block_size")
        if self.sampler_row_buckets[-1] < max(self.decode_batch_buckets[-1], self.prefill_seq_buckets[-1]):
            raise ValueError("sampler_row_buckets must reach the largest decode batch and prefill sequence buckets")

    def for_model(self, model_context: int) -> EngineConfig:
        """This configuration for a model of `model_context` tokens of context: max_model_len
        defaults to it (rounded down to whole blocks) and may not exceed it; the buckets follow.
        Returns self when there is nothing to change."""
        longest = model_context - model_context % self.block_size
        if self.max_model_len is not None and self.max_model_len <= longest:
            return self
        if self.max_model_len is not None:
            logger.warning(
                "max_model_len %d exceeds the model's context (%d tokens); lowering it",
                self.max_model_len,
                model_context,
            )
        return dataclasses.replace(self, max_model_len=longest)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative config (None: speculation off)."""
        return self.speculative_config  # type: ignore[return-value]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.max_model_len // self.block_size

    def num_host_slots(self, block_bytes: int) -> int:
        """Host-tier slots: the larger of swap_space_blocks and kv_host_bytes; with a disk tier
        and neither set, room for two requests of max_model_len (disk loads land there)."""
        slots = max(self.swap_space_blocks, self.kv_host_bytes // block_bytes)
        if self.kv_disk_dir is not None and slots == 0:
            slots = 2 * self.max_blocks_per_seq
        return slots

    def num_compiled_variants(self) -> int:
        decode = len(self.decode_batch_buckets) * len(self.block_table_buckets) * (1 + (self.num_scheduler_steps > 1))
        prefill = len(self.prefill_token_buckets) * len(self.prefill_seq_buckets) * len(self.block_table_buckets)
        return decode + prefill


def bucket_for(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value."""
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
