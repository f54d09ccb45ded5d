"""GGUF quantized blocks as the arrays of a quantized kernel (`checkpoints.quant_format`), read
from the blocks' bytes without dequantizing: the codes and the scales the file stores, regrouped.

Block layouts (llama.cpp's, per row of the `[out, in]` tensor, 32 or 256 inputs a block; all
scales f16):

- Q8_0, 34 bytes / 32: d, then 32 int8 codes; w = d * q. -> 8 bits, groups of 32, scale d.
- Q4_0, 18 bytes / 32: d, then 16 bytes: input j in the low nibble of byte j, input 16 + j in its
  high nibble; w = d * (q - 8). -> 4 bits, scale d, min -8 d.
- Q4_1, 20 bytes / 32: d, m, then the nibbles as Q4_0; w = d * q + m. -> scale d, min m.
- Q5_0, 22 bytes / 32: d, 4 bytes of fifth bits (input j's in bit j, little-endian), then the
  nibbles as Q4_0; w = d * (q - 16). -> 8 bits (the code q - 16 in [-16, 15]), scale d: as Q8_0,
  exactly (the Q4_K_M files of models whose hidden size is not a multiple of 256 store most
  kernels so, and mix it with Q8_0 across layers).
- Q4_K, 144 bytes / 256: d, dmin, 12 bytes of eight 6-bit scales sc and mins m (one per 32
  inputs), 128 bytes of nibbles: each 64 inputs are 32 bytes, the first 32 inputs in the low
  nibbles, the next 32 in the high ones; w = d * sc * q - dmin * m. -> scale d * sc, min
  -dmin * m, each rounded to f16 once (the only rounding: every other type's scales are stored
  exactly).
"""

from __future__ import annotations

import gguf
import numpy as np

from checkpoints.quant_format import CODES, MIN, Q4_GROUP, SCALE, QuantFormat

Q = gguf.GGMLQuantizationType
GROUP = 32
FORMATS = {
    Q.Q8_0: QuantFormat(8, GROUP),
    Q.Q5_0: QuantFormat(8, GROUP),
    Q.Q4_0: QuantFormat(4, Q4_GROUP),
    Q.Q4_1: QuantFormat(4, Q4_GROUP),
    Q.Q4_K: QuantFormat(4, Q4_GROUP),
}


def _half(raw: np.ndarray) -> np.ndarray:
    """f16 values from their 2 bytes (the last axis), as f32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """[.., 16] bytes -> [.., 32] codes: the low nibbles, then the high ones."""
    return np.concatenate([raw & 15, raw >> 4], axis=-1)


def _q4_k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of Q4_K blocks from their 12 bytes [.., 12]."""
    s = raw.astype(np.uint8)
    low = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return low.astype(np.float32), mins.astype(np.float32)


def block_arrays(data: np.ndarray, qtype: Q) -> dict[str, np.ndarray]:
    """The blocks of a tensor [out, bytes of a row] of `qtype` as `[out, in]`-oriented codes
    (one per input, int8 for 8 bits, 0..15 for 4) and scales (and mins) [out, in / 32]."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = data.shape[0]
    blocks = np.asarray(data, np.uint8).reshape(rows, -1, block_bytes)
    if qtype == Q.Q8_0:
        codes = blocks[..., 2:].view(np.int8).reshape(rows, -1)
        return {CODES: codes, SCALE: _half(blocks[..., 0:2])}
    if qtype == Q.Q5_0:
        fifth = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [rows, blocks, 32]
        codes = (_nibbles(blocks[..., 6:]) | (fifth << 4)).astype(np.int8) - 16
        return {CODES: codes.reshape(rows, -1), SCALE: _half(blocks[..., 0:2])}
    if qtype in (Q.Q4_0, Q.Q4_1):
        d = _half(blocks[..., 0:2])
        m = -8.0 * d if qtype == Q.Q4_0 else _half(blocks[..., 2:4])
        codes = _nibbles(blocks[..., block_bytes - 16 :]).reshape(rows, -1)
        return {CODES: codes, SCALE: d.astype(np.float16), MIN: m.astype(np.float16)}
    if qtype == Q.Q4_K:
        d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
        sc, m = _q4_k_scales(blocks[..., 4:16])  # [rows, blocks, 8]
        qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # four runs of 64 inputs
        codes = np.stack([qs & 15, qs >> 4], axis=-2).reshape(rows, -1)
        scale = (d[..., None] * sc).reshape(rows, -1).astype(np.float16)
        minimum = (-dmin[..., None] * m).reshape(rows, -1).astype(np.float16)
        return {CODES: codes, SCALE: scale, MIN: minimum}
    raise ValueError(f"no quantized storage for GGUF type {qtype.name}")


def stored_arrays(arrays: dict[str, np.ndarray], fmt: QuantFormat) -> dict[str, np.ndarray]:
    """`block_arrays` ([out, ..]) as a kernel's stored arrays ([in, out]; 4-bit codes two a byte)."""
    out = {name: np.ascontiguousarray(a.T) for name, a in arrays.items()}
    if fmt.bits == 4:
        codes = out[CODES].astype(np.uint8)
        out[CODES] = codes[0::2] | (codes[1::2] << 4)
    return out
