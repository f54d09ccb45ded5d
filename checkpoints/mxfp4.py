"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their experts' kernels.

A kernel `W` [.., out, in] is stored as `*_blocks` uint8 [.., out, in / 32, 16] and `*_scales`
uint8 [.., out, in / 32]: each block of 32 consecutive inputs is 16 bytes of e2m1 codes (input 2j
in the low nibble of byte j, input 2j + 1 in the high one) and one e8m0 scale byte s, the power of
two 2^(s - 127) that multiplies the block's values. An e2m1 code is a sign bit (8) over three bits
indexing 0, 0.5, 1, 1.5, 2, 3, 4, 6.

The model reads the blocks and scales as stored and dequantizes one expert's kernel at a time
inside the experts' grouped matmul (`jaxserve.model.experts`); `quantize` makes such blocks from a
float kernel (the tests' tiny checkpoints).
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # inputs per block (one scale)
BLOCK_BYTES = BLOCK // 2
SCALE_BIAS = 127  # e8m0: the scale byte s stands for 2^(s - 127)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "blocks", "scales"  # the leaves of a stored kernel (`*_blocks`, `*_scales`)


def shapes(kernel_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """{leaf: shape} of the blocks and scales storing a kernel [.., in, out] (ours: [in, out])."""
    *lead, k, n = kernel_shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs inputs in blocks of {BLOCK}, not {k}")
    return {BLOCKS: (*lead, n, k // BLOCK, BLOCK_BYTES), SCALES: (*lead, n, k // BLOCK)}


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [.., G, 16] and scales [.., G] -> f32 values [.., G * 32], inputs in order."""
    lut = np.asarray(E2M1, np.float32)
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    values = np.ldexp(lut[codes], scales.astype(np.int32)[..., None] - SCALE_BIAS)
    return values.reshape(*blocks.shape[:-2], -1)


def quantize(kernel: np.ndarray) -> dict[str, np.ndarray]:
    """A kernel [.., in, out] as MXFP4 blocks and scales (`shapes`): each block's scale the least
    power of two that brings its largest magnitude within 6, each value its nearest code."""
    w = np.swapaxes(np.asarray(kernel, np.float32), -1, -2)  # [.., out, in]
    groups = w.reshape(*w.shape[:-1], -1, BLOCK)
    top = np.max(np.abs(groups), axis=-1)
    exponent = np.where(top > 0, np.ceil(np.log2(np.maximum(top, 1e-38) / 6.0)), -SCALE_BIAS)
    exponent = np.clip(exponent, -SCALE_BIAS, 254 - SCALE_BIAS).astype(np.int32)
    scaled = np.ldexp(groups, -exponent[..., None])
    codes = np.argmin(np.abs(scaled[..., None] - np.asarray(E2M1, np.float32)), axis=-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return {BLOCKS: blocks, SCALES: (exponent + SCALE_BIAS).astype(np.uint8)}
