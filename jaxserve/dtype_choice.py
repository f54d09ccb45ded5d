"""The weights' dtype that `dtype="auto"` (the command line's default, `--dtype auto`) picks on
this machine, by what was measured (docs/performance.md, "bf16 on CPU"):

- CPU, with the C++ kernels that take bf16 (`cpu` attention backend, one device a replica,
  scanned layers) built with AVX512-BF16 (`kernels_pallas.cpu_matmul.bf16_dot()`): bfloat16.
  Its layer matmul and tied head are faster than f32's at every row count there (half the
  weight bytes, two multiply-adds an instruction), and the engine is faster offline and served.
- any other CPU set-up: float32. Without AVX512-BF16 the bf16 kernels widen to f32 in registers
  (half the bytes, but no faster arithmetic), and without the kernels XLA:CPU's bf16 dots are
  slower than its f32 ones.
- other platforms: float32, as before `auto` (bf16 there is a choice left to `--dtype`).

The choice is logged once at start; `--dtype float32` or `--dtype bfloat16` overrides it.
"""

from __future__ import annotations

import logging

from jaxserve.config import EngineConfig

AUTO = "auto"
logger = logging.getLogger(__name__)


def choose_dtype(config: EngineConfig) -> tuple[str, str]:
    """(the weights' dtype for `config` on this machine, why), by the rules of the module docstring."""
    import jax

    from kernels_pallas import cpu_build, cpu_matmul, default_attention_backend

    platform = jax.default_backend()
    if platform != "cpu":
        return "float32", f"platform {platform}"
    backend = config.attention_backend or default_attention_backend()
    one_device = config.tensor_parallel_size == config.pipeline_parallel_size == 1
    if backend != "cpu" or not one_device or config.unroll_layers:
        return "float32", (
            "bf16 is fast on CPU only on the C++ matmuls: the cpu attention backend, "
            "tensor_parallel_size and pipeline_parallel_size 1 and scanned layers"
        )
    if not cpu_build.available():
        return "float32", "no C++ compiler for the bf16 kernels"
    if not cpu_matmul.bf16_dot():
        return "float32", "this CPU has no AVX512-BF16 (the bf16 kernels would only halve the weight bytes)"
    return "bfloat16", "this CPU has AVX512-BF16 and the C++ matmuls use it"


def weights_dtype(config: EngineConfig) -> str:
    """The weights' dtype `config` asks for: "auto" replaced by `choose_dtype`'s choice (logged)."""
    if config.dtype != AUTO:
        return config.dtype
    dtype, why = choose_dtype(config)
    logger.info("dtype auto: %s (%s); --dtype overrides it", dtype, why)
    return dtype


def load_dtype(quantization: str, dtype: str) -> str:
    """The dtype a checkpoint is loaded in for weights of `dtype`: float32 when the kernels are quantized
    from it (`--quantization int8 / q4`: from full precision; the runner casts the other weights to
    `dtype`), else `dtype`."""
    return "float32" if quantization in ("int8", "q4") else dtype
