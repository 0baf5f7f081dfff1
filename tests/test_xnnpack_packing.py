"""A qb4w filter is packed for the products straight from the bytes XNNPACK stores (two 4-bit
values a byte), never unpacked: the arrays equal those packed from the filter's values."""
import ml_dtypes
import numpy as np
import pytest

from execupy.kernels.fast import xnnpack_gemm as XG


# whole panels; a partial panel (padding); blocks of 64; an LLM head's 49152 outputs
@pytest.mark.parametrize("n, k, block", [(576, 576, 32), (100, 64, 32), (200, 1536, 64), (49152, 64, 32)])
def test_filters_packed_from_their_stored_bytes_equal_filters_packed_from_their_values(n, k, block):
    rng = np.random.default_rng(n + k)
    stored = rng.integers(0, 16, (n, k)).astype(np.uint8)  # signed weight + 8
    stored[0] = 15  # the largest chunk sums, then the smallest
    stored[1] = 0
    nibbles = stored[:, 0::2] | (stored[:, 1::2] << 4)  # input 2i in the low nibble, as XNNPACK stores them
    scales = (rng.random((n, k // block)) * 0.02 + 1e-4).astype(ml_dtypes.bfloat16).astype(np.float32)
    scales[2] = -scales[2]
    ours = XG.pack_blockwise_stored(nibbles, scales)
    reference = XG.pack_blockwise((stored.astype(np.int16) - 8).astype(np.int8), scales)
    assert (ours.block, ours.n) == (reference.block, reference.n) == (block, n)
    for name in ("words", "scales", "ksum"):
        a, b = getattr(ours, name), getattr(reference, name)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes(), name  # every bit, the sign of a zero ksum included
