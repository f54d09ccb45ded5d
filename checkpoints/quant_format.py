"""How a quantized kernel is stored: the arrays that replace a declared kernel [.., K, N] (in, out).

Weight-only quantization (`--quantization`) stores a quantizable kernel (`Weight.quantizable`) as
integer codes and per-group scales along its input features K, groups of `group` rows:

- 8 bits (`int8`: one group of all K rows, a scale per output channel; GGUF Q8_0: groups of 32):
  `kernel` int8 [.., K, N] and `kernel_scale` f32 [.., K / group, N]; w = code * scale.
- 4 bits (`q4`; GGUF Q4_0, Q4_1, Q4_K: groups of 32): `kernel` uint8 [.., K / 2, N], byte i of a
  column holding rows 2i (low nibble) and 2i + 1 (high nibble), codes 0..15, and f16
  `kernel_scale` and `kernel_min` [.., K / group, N]; w = code * scale + min. An offset per group
  covers every 4-bit GGUF type: Q4_0's (code - 8) * d is min = -8 d, Q4_1's is its own min,
  Q4_K's sub-block scale and min are d * sc and -dmin * m.

The arrays keep the kernel's logical axes (the codes' and the scales' K axis is split where the
kernel's is), so they shard like the kernel under tensor parallelism.
"""

from __future__ import annotations

import dataclasses

import numpy as np

HEADS = ("embed/kernel", "lm_head/kernel")  # the codes paths of a tied and of an untied output head

CODES, SCALE, MIN = "kernel", "kernel_scale", "kernel_min"  # leaf names beside each other
Q4_GROUP = 32  # input features per 4-bit group (GGUF's blocks)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A quantized kernel's storage: `bits` 8 or 4, scales for each `group` input features."""

    bits: int
    group: int

    def __post_init__(self) -> None:
        if self.bits not in (8, 4) or self.group <= 0 or (self.bits == 4 and self.group % 2):
            raise ValueError(f"unsupported quantization: {self.bits} bits in groups of {self.group}")

    @property
    def name(self) -> str:
        return f"int{self.bits}/{self.group}"

    def arrays(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """{leaf name: (shape, dtype)} of the arrays storing a kernel of `shape` [.., K, N]."""
        *lead, k, n = shape
        if k % self.group:
            raise ValueError(f"a kernel of {k} input features does not split in groups of {self.group}")
        scales = (*lead, k // self.group, n)
        if self.bits == 8:
            return {CODES: ((*lead, k, n), np.dtype(np.int8)), SCALE: (scales, np.dtype(np.float32))}
        return {
            CODES: ((*lead, k // 2, n), np.dtype(np.uint8)),
            SCALE: (scales, np.dtype(np.float16)),
            MIN: (scales, np.dtype(np.float16)),
        }

    def kernel_shape(self, codes_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape [.., K, N] of the kernel whose codes have `codes_shape`."""
        *lead, rows, n = codes_shape
        return (*lead, rows * 8 // self.bits, n)


def format_of(leaves: dict) -> QuantFormat | None:
    """The format of a module's stored kernel (its parameter dict: `kernel`, `kernel_scale`, ...),
    or None when it is not quantized."""
    if SCALE not in leaves:
        return None
    codes, scale = leaves[CODES], leaves[SCALE]
    if np.dtype(codes.dtype) == np.int8:
        return QuantFormat(8, codes.shape[-2] // scale.shape[-2])
    return QuantFormat(4, 2 * codes.shape[-2] // scale.shape[-2])
