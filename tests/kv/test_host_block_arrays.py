"""The host tier's arrays are slot-major, so a tier reads a block straight into its host slot: each
slot's part of an array is one contiguous range of the array's memory."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.kv import HostBlockArrays


def test_a_slot_is_one_contiguous_range_and_its_parts_write_through():
    shape = (3, 2, 5, 4, 8)  # layers, kv heads, host slots, block size, head dim
    k, v = HostBlockArrays.allocate(shape, np.float32), HostBlockArrays.allocate(shape, np.float32)
    assert k.shape == shape and not k.any()
    host = HostBlockArrays([k, v])
    (k_address, k_bytes), _ = host.memory()
    slot_bytes = 3 * 2 * 4 * 8 * 4
    assert k_bytes == 5 * slot_bytes and host.payload_bytes == 2 * slot_bytes
    parts = host.slot_parts(2)
    assert [p.ctypes.data for p in parts][0] == k_address + 2 * slot_bytes
    block = np.arange(slot_bytes // 4, dtype=np.float32)
    parts[0][:] = block.view(np.uint8)
    np.testing.assert_array_equal(k[:, :, 2].reshape(-1), block)
    assert not k[:, :, [0, 1, 3, 4]].any() and not v.any()


def test_arrays_not_laid_out_slot_major_are_refused():
    with pytest.raises(ValueError, match="slot-major"):
        HostBlockArrays([np.zeros((3, 2, 5, 4, 8), np.float32)])
