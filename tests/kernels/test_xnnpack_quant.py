"""The compiled 8-bit quantize and quantized add / subtract / multiply of the XNNPACK backend
(backends/xnnpack/quant_jit.py) give the numpy steps' bits: the storer's clip and quantize, and
the loaders' dequantize, the op and the storer (that those steps are ExecuTorch's is
tests/test_xnnpack_nodes.py's and the conformance corpus's job)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from execupy.backends.xnnpack import quant as Q

pytestmark = pytest.mark.skipif(Q._COMPILED is None, reason="numba (the `fast` extra) is not installed")

F32 = np.float32
BOUNDS = {"none": (-np.inf, np.inf), "relu6": (0.0, 6.0), "below": (-0.5, np.inf), "above": (-np.inf, 0.75)}


def _floats(rng, n: int) -> np.ndarray:
    """Values over and beyond the 8-bit range, exact halves (ties to even), zeros of both signs, infinities."""
    x = (rng.standard_normal(n) * 4).astype(F32)
    x[:8] = [0.0, -0.0, np.inf, -np.inf, 1e30, -1e30, 0.25, -0.75]
    x[8:40] = (rng.integers(-300, 300, 32) + 0.5) * F32(0.05)  # halves of the scale below
    return x


def _numpy_store(y: np.ndarray, lo: float, hi: float, scale: float, zero: int, datatype: str) -> np.ndarray:
    clamp = lo != -np.inf or hi != np.inf
    return Q.quantize(np.clip(y, F32(lo), F32(hi)) if clamp else y, scale, zero, datatype)


@pytest.mark.parametrize("datatype, zero", [("qint8", -3), ("qint8", 0), ("quint8", 128), ("quint8", 7)])
@pytest.mark.parametrize("bounds", BOUNDS)
def test_quantize_clamped_compiled_equals_numpy(datatype, zero, bounds):
    rng = np.random.default_rng(zero + 1000)
    x = _floats(rng, 5000).reshape(50, 100)
    lo, hi = BOUNDS[bounds]
    ours = Q.quantize_clamped(x, lo, hi, 0.05, zero, datatype)
    reference = _numpy_store(x, lo, hi, 0.05, zero, datatype)
    assert ours.dtype == reference.dtype == Q.STORAGE[datatype] and ours.shape == x.shape
    np.testing.assert_array_equal(ours, reference)
    # a transposed (non-contiguous) input too
    np.testing.assert_array_equal(Q.quantize_clamped(x.T, lo, hi, 0.05, zero, datatype),
                                  _numpy_store(x.T, lo, hi, 0.05, zero, datatype))


@pytest.mark.parametrize("op, fn", [(Q.ADD, np.add), (Q.SUBTRACT, np.subtract), (Q.MULTIPLY, np.multiply)])
@pytest.mark.parametrize("datatype", ["qint8", "quint8"])
@pytest.mark.parametrize("bounds", BOUNDS)
def test_quantized_binary_compiled_equals_the_numpy_steps(op, fn, datatype, bounds):
    rng = np.random.default_rng(op * 10 + len(datatype))
    storage, (qlo, qhi) = Q.STORAGE[datatype], Q.QRANGE[datatype]
    qa = rng.integers(qlo, qhi + 1, (3, 40, 41)).astype(storage)
    qb = rng.integers(qlo, qhi + 1, (3, 40, 41)).astype(storage)
    a_params, b_params = (int(rng.integers(qlo, qhi)), 0.031), (int(rng.integers(qlo, qhi)), 0.0173)
    out_scale, out_zero = (0.047, int(rng.integers(qlo, qhi))) if op != Q.MULTIPLY else (0.2, (qlo + qhi + 1) // 2)
    out_value = SimpleNamespace(datatype=datatype, quant=SimpleNamespace(scale=[out_scale], zero_point=out_zero))
    lo, hi = BOUNDS[bounds]
    run = Q.binary_quantized(op, a_params, b_params, lo, hi, out_value)
    ours = run(qa, qb)
    y = fn(Q.dequantize(qa, a_params[1], a_params[0]), Q.dequantize(qb, b_params[1], b_params[0]))
    reference = _numpy_store(y, lo, hi, out_scale, out_zero, datatype)
    assert ours is not None and ours.dtype == storage
    np.testing.assert_array_equal(ours, reference)
    assert len(np.unique(reference)) > 20  # the case spans many output levels, not a saturated block
    # a broadcast (other shapes) or a tiny tensor is left to the numpy steps
    assert run(qa, qb[:1]) is None and run(qa[0, 0, :5], qb[0, 0, :5]) is None
