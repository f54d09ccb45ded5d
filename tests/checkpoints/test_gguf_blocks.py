"""GGUF blocks read as a quantized kernel's arrays (`checkpoints.gguf_blocks.block_arrays`): codes times
scales (plus mins) are exactly the weights gguf-py dequantizes, for every type kept as stored."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from checkpoints.gguf_blocks import FORMATS, block_arrays
from checkpoints.quant_format import CODES, MIN, SCALE


@pytest.mark.parametrize("qtype", sorted(FORMATS, key=lambda q: q.name), ids=lambda q: q.name)
def test_block_arrays_give_the_dequantized_weights(qtype):
    weights = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    try:
        data = quantize(weights, qtype)
    except NotImplementedError:
        pytest.skip(f"gguf-py cannot write {qtype.name}")  # read elsewhere from real files
    arrays = block_arrays(data, qtype)
    fmt = FORMATS[qtype]
    codes = arrays[CODES].astype(np.float32)
    assert codes.shape == weights.shape and codes.min() >= -(2 ** (fmt.bits - 1)) and codes.max() < 2**fmt.bits
    per_group = codes.reshape(6, -1, fmt.group) * arrays[SCALE].astype(np.float32)[..., None]
    if MIN in arrays:
        per_group += arrays[MIN].astype(np.float32)[..., None]
    np.testing.assert_allclose(per_group.reshape(weights.shape), dequantize(data, qtype), rtol=1e-6, atol=1e-6)
