"""The compiled layer norm and softmax rows (kernels/fast/rows_jit.py) give the numpy kernels' bits.

Both portable kernels take the compiled path for C-ordered float32 rows when numba is
installed; each test runs the same call with the compiled path switched off and compares
every output bit for bit, over row lengths that cover each branch of numpy's pairwise sum
(under 8, up to 128, one split, several), and rows with NaN, inf and all -inf.
"""
from __future__ import annotations

import numpy as np
import pytest

from execupy.kernels.fast import compiled_rows
from execupy.kernels.portable import norm, softmax

pytestmark = pytest.mark.skipif(compiled_rows(1 << 20) is None, reason="numba is not installed")

LENGTHS = list(range(1, 300)) + [384, 512, 768, 1000, 1024, 2048, 3000, 5000]


def _both(monkeypatch, module, call):
    compiled = call()
    with monkeypatch.context() as m:
        m.setattr(module, "compiled_rows", lambda size: None)
        plain = call()
    return compiled, plain


def _layer_norm(x, shape, weight, bias):
    stats = x.shape[:x.ndim - len(shape)] + (1,) * len(shape)
    return norm.native_layer_norm(x, shape, weight, bias, 1e-5, np.empty_like(x), np.empty(stats, np.float32),
                                  np.empty(stats, np.float32))


@pytest.mark.parametrize("affine", ["weight and bias", "weight", "none"])
def test_compiled_layer_norm_equals_numpy_bit_for_bit(monkeypatch, affine):
    rng = np.random.default_rng(0)
    for n in LENGTHS:
        x = (rng.standard_normal((3, n)) * rng.uniform(0.1, 100) + rng.uniform(-5, 5)).astype(np.float32)
        weight = rng.standard_normal(n).astype(np.float32) if affine != "none" else None
        bias = rng.standard_normal(n).astype(np.float32) if affine == "weight and bias" else None
        compiled, plain = _both(monkeypatch, norm, lambda: _layer_norm(x, (n,), weight, bias))
        for name, a, b in zip(("out", "mean", "rstd"), compiled, plain):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}, rows of {n}")


def test_compiled_layer_norm_over_two_trailing_dims_and_in_a_program_layout(monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 6, 7)).astype(np.float32)
    weight = rng.standard_normal((6, 7)).astype(np.float32)
    weight.flags.writeable = False  # a program's constant
    compiled, plain = _both(monkeypatch, norm, lambda: _layer_norm(x, (6, 7), weight, weight))
    assert compiled[1].shape == (2, 5, 1, 1)
    for a, b in zip(compiled, plain):
        np.testing.assert_array_equal(a, b)


def test_compiled_softmax_equals_numpy_bit_for_bit_with_nan_inf_and_empty_rows(monkeypatch):
    rng = np.random.default_rng(2)
    with np.errstate(all="ignore"):
        for n in LENGTHS:
            x = (rng.standard_normal((4, n)) * rng.uniform(0.1, 30)).astype(np.float32)
            x[1, n // 2] = np.nan
            x[2, :] = -np.inf
            x[3, n - 1] = np.inf
            compiled, plain = _both(monkeypatch, softmax, lambda: softmax.softmax(x, -1, False, np.empty_like(x)))
            np.testing.assert_array_equal(compiled, plain, err_msg=f"rows of {n}")
            assert np.isnan(compiled[1]).all() and np.isnan(compiled[2]).all()


def test_compiled_softmax_of_an_attention_score_tensor_in_place(monkeypatch):
    """[batch, heads, queries, keys] scores, the output written over the input, as a planned
    program may; zeros of both signs in the max."""
    x = (np.random.default_rng(3).standard_normal((1, 4, 128, 128)) * 3).astype(np.float32)
    x[0, 0, 0, :] = -1.0
    x[0, 0, 0, 5], x[0, 0, 0, 9] = -0.0, 0.0
    expected = _both(monkeypatch, softmax, lambda: softmax.softmax(x, -1, False, np.empty_like(x)))[1]
    same = x.copy()
    assert softmax.softmax(same, 3, False, same) is same
    np.testing.assert_array_equal(same, expected)
