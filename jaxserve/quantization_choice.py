"""The weights' quantization that `quantization="auto"` (the command line's default, `--quantization
auto`) picks for a model on this machine, by what was measured (docs/performance.md, "Quantized
weights"):

- a GGUF file (a registry model or a `.gguf` path) whose layers' kernels are mostly (`MIN_KEPT_SHARE`
  of their weights) in types the kernels read (Q8_0, Q5_0, Q4_0, Q4_1, Q4_K), on one CPU device with the
  C++ kernels (`cpu` attention backend, scanned layers, a C++ compiler): `gguf`, its blocks as stored.
  The C++ matmuls read the blocks in place: a one-row decode step reads a quarter of bf16's weight
  bytes (0.45x bf16 weights' time), and from 12-24 rows the blocks are dequantized to bf16 panels
  (0.75-0.80x bf16 weights' time at 128-512 rows on the 2-core Intel VM). Accuracy against f32 on
  real text: top-1 agreement 0.9955, perplexity +0.1% (`jaxserve bench accuracy`, the default model).
- anything else: `none`, the checkpoint's weights in the weights' dtype. A Hugging Face directory or a
  converted checkpoint stores full precision; a file whose kernels are in other types (the Q4_K_M files
  of models whose hidden size is not a multiple of 256 store Q5_0 and Q6_K: Qwen2.5-0.5B, Gemma 3 270M)
  would be dequantized at every start, where `none` restores a converted checkpoint once made.
  Quantizing full-precision weights is a choice left to `--quantization int8|q4`; off that CPU set-up
  the quantized kernels are XLA's dequantize-then-dot, not measured faster; pipeline stages, MTP and
  EAGLE-3 drafting do not run quantized weights.

The choice is logged once at start; `--quantization none` (or any other mode) overrides it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from checkpoints.loaded import LoadedModel
from jaxserve.config import EngineConfig

AUTO = "auto"
MIN_KEPT_SHARE = 0.5  # of the layers' kernel weights kept as blocks, for auto to pick gguf
logger = logging.getLogger(__name__)


def _gguf_path(model: str | LoadedModel) -> Path | None:
    """The GGUF file `model` names (a registry model's, fetched), or None."""
    from checkpoints.registry import REGISTERED_GGUF, fetch_gguf

    if isinstance(model, LoadedModel):  # loaded by the caller: its weights are what they are
        return None
    if model in REGISTERED_GGUF:
        return fetch_gguf(model)
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def kept_share(path: Path) -> float:
    """`checkpoints.gguf.kept_layer_share(path)`, remembered in the cache directory by the file's path, size
    and modification time and the types read as stored (reading a GGUF header parses its whole vocabulary:
    seconds)."""
    from checkpoints.gguf import kept_layer_share
    from checkpoints.gguf_blocks import FORMATS
    from checkpoints.registry import cache_dir

    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{','.join(sorted(q.name for q in FORMATS))}"
    memo_file = cache_dir() / "gguf_kept_share.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if key not in memo:
        memo = {k: v for k, v in memo.items() if Path(k.rsplit(":", 3)[0]).exists()}  # files since removed go
        memo[key] = kept_layer_share(path)
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        partial = memo_file.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(memo))
        os.replace(partial, memo_file)
    return float(memo[key])


def choose_quantization(config: EngineConfig, model: str | LoadedModel) -> tuple[str, str]:
    """(the quantization for `model` under `config` on this machine, why), by the module docstring's rules."""
    import jax

    from kernels_pallas import cpu_build, default_attention_backend

    path = _gguf_path(model)
    if path is None:
        return "none", "the checkpoint is not a GGUF file (its weights are served in the weights' dtype)"
    platform = jax.default_backend()
    if platform != "cpu":
        return "none", f"platform {platform}: the GGUF blocks' fast kernels are the C++ CPU ones"
    backend = config.attention_backend or default_attention_backend()
    devices = config.tensor_parallel_size * config.pipeline_parallel_size * config.expert_parallel_size
    if backend != "cpu" or devices != 1 or config.unroll_layers:
        return "none", (
            "the C++ kernels read GGUF blocks only with the cpu attention backend, one device a replica "
            "and scanned layers"
        )
    if not cpu_build.available():
        return "none", "no C++ compiler for the quantized kernels"
    spec = config.speculative_config
    if spec is not None and spec.method in ("mtp", "eagle3"):
        return "none", f"{spec.method} drafting runs full-precision weights"
    share = kept_share(path)
    if share < MIN_KEPT_SHARE:
        return "none", (
            f"only {share:.0%} of the file's layer weights are in types the kernels read as stored "
            "(Q8_0, Q5_0, Q4_0, Q4_1, Q4_K): the rest would be dequantized at every start"
        )
    return "gguf", (
        f"a GGUF file on the C++ CPU kernels, {share:.0%} of its layer weights read as stored (4 bits: a quarter "
        "of bf16's bytes; 8 bits: half)"
    )


def weights_quantization(config: EngineConfig, model: str | LoadedModel) -> str:
    """The quantization `config` asks for: "auto" replaced by `choose_quantization`'s choice (logged)."""
    if config.quantization != AUTO:
        return config.quantization
    mode, why = choose_quantization(config, model)
    logger.info("quantization auto: %s (%s); --quantization overrides it", mode, why)
    return mode
