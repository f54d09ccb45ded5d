"""KV cache precision (`--kv-cache-dtype`): how K and V rows are stored, written and read back.

A cache's storage dtype says its format, so every backend reads any cache the same way:

- float32, bfloat16, float16: the values (no scales); `auto` is the model's compute dtype.
- uint16 (bfloat16 on CPU): bf16 bits. XLA:CPU runs a scatter into a bf16 array by converting the
  whole array to f32 and back (jaxlib 0.10.2), so a bf16 cache on the CPU is stored as its bits,
  which scatter at memory speed; on other platforms a bf16 cache is plain bfloat16.
- int8: symmetric int8 values, scale = max|row| / 127.
- uint8: fp8 e4m3 (`float8_e4m3fn`) bits, scale = max|row| / 448. Stored as bits on every
  platform: XLA:CPU has the same scatter problem with fp8, and a uint8 row is one layout for all.

Scales (int8 and fp8): one f32 per (layer, kv head, token), stored in the token's own row after its
`head_dim` values as 4 more elements of the cache's dtype (their bytes are the f32's, little-endian):
a row is [head_dim + 4]. Why per token and head: a token's K/V is written once, when it is computed
(decode writes one token of a block at a time), so its scale is known then and never changes; a
per-block scale would have to grow as the block fills and re-quantize the rows already written.
Per (token, head) also follows the outliers that differ between heads. Why in the row: every
move of blocks (swap to the host tier, the disk tier's files, the KV handed between
workers) moves whole rows, so the scales travel with their values with no extra array, and a block
is still one contiguous run of bytes. The price is 4 bytes per 64-128 (6% / 3%).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "int8")
SCALE_ELEMENTS = 4  # a row's f32 scale, as 4 one-byte elements after its values
_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.uint8): 448.0}  # largest int8 / fp8 e4m3 magnitude
_TINY = 1e-30  # a row of zeros gets this scale (any positive one decodes it to zeros)


def storage_dtype(kv_cache_dtype: str, auto_dtype: Any, platform: str) -> jnp.dtype:
    """The cache's storage dtype for `--kv-cache-dtype` (`KV_CACHE_DTYPES`; auto: `auto_dtype`, the
    weights' dtype where the runner calls it)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose from: {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return jnp.dtype(jnp.uint8)
    if kv_cache_dtype == "int8":
        return jnp.dtype(jnp.int8)
    dtype = jnp.dtype(auto_dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
    if dtype == jnp.bfloat16 and platform == "cpu":
        return jnp.dtype(jnp.uint16)
    return dtype


def format_name(dtype: Any) -> str:
    """What a cache of storage dtype `dtype` holds: float32, bfloat16, float16, int8 or fp8."""
    dtype = jnp.dtype(dtype)
    return {"uint16": "bfloat16", "uint8": "fp8"}.get(dtype.name, dtype.name)


def is_scaled(dtype: Any) -> bool:
    """Whether rows of this storage dtype carry a scale (int8, fp8)."""
    return jnp.dtype(dtype) in _MAX


def row_width(head_dim: int, dtype: Any) -> int:
    """Elements of one stored K or V row: its values, then its scale where it has one."""
    return head_dim + (SCALE_ELEMENTS if is_scaled(dtype) else 0)


def value_dtype(dtype: Any) -> jnp.dtype:
    """The dtype `dequantize` gives for a cache of storage dtype `dtype` (what kernels compute in)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.uint16:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32) if is_scaled(dtype) else dtype


def quantize(x: jax.Array, dtype: Any) -> jax.Array:
    """Rows x [..., D] (any float dtype) as stored in a cache of `dtype`: [..., row_width(D)]."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.uint16:
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    if not is_scaled(dtype):
        return x.astype(dtype)
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), _TINY) / _MAX[dtype]
    scaled = xf / scale[..., None]
    if dtype == jnp.int8:
        values = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    else:
        values = f32_to_fp8_bits(scaled)
    return jnp.concatenate([values, lax.bitcast_convert_type(scale, dtype)], axis=-1)


def dequantize(rows: jax.Array) -> jax.Array:
    """Stored rows [..., row_width(D)] -> their values [..., D]: as they are for a float cache,
    bf16 for bf16 bits, f32 (values times scale) for int8 and fp8."""
    dtype = rows.dtype
    if dtype == jnp.uint16:
        return lax.bitcast_convert_type(rows, jnp.bfloat16)
    if not is_scaled(dtype):
        return rows
    d = rows.shape[-1] - SCALE_ELEMENTS
    scale = lax.bitcast_convert_type(rows[..., d:], jnp.float32)
    return values_to_f32(rows[..., :d]) * scale[..., None]


def scale_from_bytes(b0: jax.Array, b1: jax.Array, b2: jax.Array, b3: jax.Array) -> jax.Array:
    """A row's f32 scale from its 4 scale elements (any 8-bit integer dtype), composed with shifts:
    the form a GPU kernel can lower (it loads them as 4 columns; Triton has no bitcast that changes
    the element count)."""
    word = b0.astype(jnp.uint8).astype(jnp.uint32)
    for i, b in enumerate((b1, b2, b3), start=1):
        word = word | (b.astype(jnp.uint8).astype(jnp.uint32) << (8 * i))
    return lax.bitcast_convert_type(word, jnp.float32)


def values_to_f32(values: jax.Array) -> jax.Array:
    """The unscaled values of stored elements (bf16 bits, int8, fp8 bits or a float dtype) as f32."""
    if values.dtype == jnp.uint16:
        values = lax.bitcast_convert_type(values, jnp.bfloat16)
    elif values.dtype == jnp.uint8:
        return fp8_bits_to_f32(values)
    return values.astype(jnp.float32)


def f32_to_fp8_bits(x: jax.Array) -> jax.Array:
    """f32 values within +-448 as fp8 e4m3 bits, rounded to nearest even (what XLA's conversion
    gives there), with integer ops: XLA:CPU converts to float8 element by element in software,
    ~8x slower than the int8 path at a decode step's cache writes."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    magnitude = bits & 0x7FFFFFFF
    # Normal numbers (|x| >= 2^-6): keep 3 mantissa bits, rounding to nearest even, and rebias
    # the exponent (127 -> 7).
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals: multiples of 2^-9 (rounding half to even; 8 of them is the smallest normal).
    subnormal = jnp.round(lax.bitcast_convert_type(magnitude, jnp.float32) * 512.0).astype(jnp.uint32)
    code = jnp.where(magnitude < 0x3C800000, subnormal, normal)  # 0x3C800000: 2^-6
    return (code | ((bits >> 24) & 0x80)).astype(jnp.uint8)


def fp8_bits_to_f32(bits: jax.Array) -> jax.Array:
    """fp8 e4m3 bits as f32, from their fields with integer ops (what the C++ kernels do too):
    Triton's lowering casts from float8 only on GPUs with fp8 conversions (not Ampere). Normal
    numbers rebias the exponent (7 -> 127), subnormals are m * 2^-9; 0x7f / 0xff (NaN) would read
    as +-480, and `quantize` never writes them."""
    x = bits.astype(jnp.int32)
    magnitude = x & 0x7F
    normal = lax.bitcast_convert_type((magnitude << 20) + (120 << 23), jnp.float32)
    f = jnp.where(magnitude < 8, magnitude.astype(jnp.float32) * (1.0 / 512.0), normal)
    return jnp.where((x & 0x80) != 0, -f, f)
