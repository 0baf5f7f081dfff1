"""The int8 XNNPACK products run as float32 BLAS over runs of inputs (backends/xnnpack/nodes.py:
_exact_float32_runs): every integer partial sum stays below 2**24, so the float32 result is
XNNPACK's int32 sum exactly, at half the bytes of a float64 filter."""
import numpy as np

from execupy.backends.xnnpack.nodes import _exact_float32_runs


def test_runs_cover_the_inputs_and_keep_every_partial_sum_exact():
    rng = np.random.default_rng(0)
    wt = rng.integers(-127, 128, (3001, 40)).astype(np.float64)
    wt[:, 0] = 127  # a worst-case output: 3001 * 127 * 128 > 2**24, so the product needs three runs or more
    runs = _exact_float32_runs(wt, "qint8")
    assert runs[0][0] == 0 and runs[-1][1] == 3001 and all(b == c for (_, b), (c, _) in zip(runs, runs[1:]))
    assert len(runs) >= 3
    assert all(np.abs(wt[a:b]).sum(axis=0).max() * 128 < 2 ** 24 for a, b in runs)
    x = np.full((2, 3001), -127.0)  # odd products: sums past 2**24 are not all float32 numbers
    x[1] = rng.integers(-128, 128, 3001)
    exact = x @ wt  # float64 holds these sums exactly
    split = sum((x[:, a:b].astype(np.float32) @ wt[a:b].astype(np.float32)).astype(np.float64) for a, b in runs)
    np.testing.assert_array_equal(split, exact)
    # one float32 product over all inputs cannot be exact here, in any order: its result itself,
    # -127 * 127 * 3001 (odd, past 2**24), is no float32 number
    assert exact[0, 0] == -127 * 127 * 3001 and np.float64(np.float32(exact[0, 0])) != exact[0, 0]


def test_a_small_filter_is_one_run():
    assert _exact_float32_runs(np.full((1280, 10), 50.0), "qint8") == [(0, 1280)]
    assert _exact_float32_runs(np.full((1280, 10), 127.0), "quint8") == [(0, 518), (518, 1036), (1036, 1280)]
