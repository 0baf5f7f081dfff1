"""The compiled (numba) XNNPACK dynamic-quantization GEMMs, sigmoid and rsqrt equal the numpy
reference bit for bit (that the reference equals ExecuTorch's runtime is
tests/test_xnnpack_nodes.py's job)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from execupy.kernels.fast import xnnpack_gemm as XG
from execupy.kernels.fast import quantized

pytestmark = pytest.mark.skipif(XG.NUMBA is None, reason="numba (the `fast` extra) is not installed")


def _activations(rng, m: int, k: int):
    q = rng.integers(-128, 128, (m, k)).astype(np.int8)
    zp = rng.integers(-128, 128, m).astype(np.int32)
    scale = (rng.random(m) * 0.1 + 1e-3).astype(np.float32)
    return q, zp, scale


# the last three share half their panels with the second thread (from quantized.SHARE_MIN_BYTES of weight)
# and from MATVEC_MAX_ROWS rows on, a prompt's kernel: with VNNI four rows at a time, then the rest one by one
@pytest.mark.parametrize("m, n, k, block", [(1, 37, 64, 32), (5, 80, 576, 32), (3, 16, 1536, 64), (2, 9, 96, 96),
                                           (4, 4000, 576, 32), (1, 1000, 576, 32), (1, 8192, 576, 32),
                                           (11, 300, 576, 32), (113, 200, 1536, 64), (6, 70, 96, 16)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("arithmetic", ["vnni", "avx2", "avx2 tiles"])  # this CPU's, the other one's compiled
def test_blockwise_numba_equals_numpy(m, n, k, block, with_bias, arithmetic, monkeypatch):  # float path; "avx2 tiles":
    from execupy.kernels.fast import xnnpack_gemm_jit as K  # a prompt's path where numba does not compile for AVX2

    monkeypatch.setattr(XG, "ARITHMETIC", arithmetic.split()[0])
    if arithmetic == "avx2 tiles":
        monkeypatch.setattr(K, "AVX2", False)
    rng = np.random.default_rng(m * n + k)
    q, zp, scale = _activations(rng, m, k)
    w = rng.integers(-8, 8, (n, k)).astype(np.int8)
    scales = (rng.random((n, k // block)) * 0.02 + 1e-4).astype(ml_dtypes.bfloat16).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    packed = XG.pack_blockwise(w, scales)
    ours = XG.NUMBA["blockwise"](q, zp, scale, packed, bias)
    reference = XG.NUMPY["blockwise"](q, zp, scale, packed, bias)
    assert ours.dtype == reference.dtype == np.float32 and ours.shape == (m, n)
    np.testing.assert_array_equal(ours, reference)
    if m < XG.MATVEC_MAX_ROWS:  # a decode step's mat-vec adds in the same order on one thread and on two
        for threads in (1,) + (2,) * 10:  # the second thread spins after the first shared call: later ones share for real
            out = XG.NUMBA["blockwise_matvec"](q, zp, scale, packed, np.zeros(n, np.float32) if bias is None else bias,
                                               np.empty((m, n), np.float32), threads=threads)
            np.testing.assert_array_equal(out, reference)


# ten panels; one panel and a half (the second thread's half is the partial one); a half of 4000
# rows that does not fit the thread's buffers (one thread then); q, k and v side by side
@pytest.mark.parametrize("m, widths, k", [(113, [640], 576), (9, [100], 64), (4000, [576], 576),
                                          (37, [576, 192, 100], 576)])
def test_a_prompts_product_shared_with_the_second_thread_equals_one_thread(m, widths, k):
    """A prompt's qb4w product gives the second half of its panels to the second core's thread
    (AVX512-VNNI); a panel's outputs depend on the panel alone, so one thread and two agree bit for
    bit, and both equal the numpy reference."""
    from execupy.kernels.fast import xnnpack_gemm_jit as K
    from execupy.kernels.fast.second_thread import SECOND_THREAD

    if not XG.NUMBA["vnni"]:
        pytest.skip("this CPU (or numba's target) has no AVX512-VNNI: prompts run on numba's own threads here")
    rng = np.random.default_rng(m + k)
    q, zp, scale = _activations(rng, m, k)
    filters = [XG.pack_blockwise(rng.integers(-8, 8, (n, k)).astype(np.int8),
                                 (rng.random((n, k // 32)) * 0.02 + 1e-4).astype(np.float32)) for n in widths]
    w = XG.side_by_side(filters)[0] if len(filters) > 1 else filters[0]
    bias = rng.standard_normal(w.n).astype(np.float32)
    args = (K.BLOCKWISE_SECOND_HALF.address, q, zp, scale, w.words, w.scales, w.ksum, bias, w.block)
    alone = np.empty((m, w.n), np.float32)
    assert not SECOND_THREAD.call(K.blockwise_rows_halves, (*args, alone), False)
    np.testing.assert_array_equal(alone, XG.gemm_blockwise_numpy(q, zp, scale, w, bias))
    for _ in range(10):  # the thread is spinning after the first: later calls are shared for real
        shared = np.full((m, w.n), np.nan, np.float32)
        assert SECOND_THREAD.call(K.blockwise_rows_halves, (*args, shared), True)
        np.testing.assert_array_equal(shared, alone)


# BERT's 128 tokens x 256 -> 1024; a partial last panel and rows left over; more panels than chunks
@pytest.mark.parametrize("m, n, k", [(128, 1024, 256), (37, 100, 64), (9, 1280, 64)])
def test_a_prompts_channelwise_product_shared_with_the_second_thread_equals_one_thread(m, n, k):
    """qd8 x qc8w through vpdpbusd in chunks of (panel, rows) taken by the caller and the second
    core's thread (from the two ends): the thread's C function rebuilds the call from the job
    block; a chunk's outputs depend on the chunk alone, so the bits are the numpy reference's."""
    from execupy.kernels.fast import xnnpack_gemm_jit as K
    from execupy.kernels.fast.second_thread import SECOND_THREAD

    if not XG.NUMBA["vnni"]:
        pytest.skip("this CPU (or numba's target) has no AVX512-VNNI")
    rng = np.random.default_rng(m + n)
    q, zp, scale = _activations(rng, m, k)
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    w_scale, bias = (rng.random(n) * 0.01).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    words, wsum = XG.channelwise_words(w)
    reference = XG.gemm_channelwise_numpy(q, zp, scale, w, w_scale, bias)
    for share in (False,) + (True,) * 10:  # the thread spins after the first shared call
        out = np.full((m, n), np.nan, np.float32)
        SECOND_THREAD.call(K.channelwise_rows, (K.CHANNELWISE_CHUNKS.address, SECOND_THREAD.job, q, zp, scale, words,
                                                wsum, w_scale, bias, out), share)
        np.testing.assert_array_equal(out, reference)


# BERT's 128 x 1024 -> 256; inputs past a multiple of 16 (one by one) and of 4 (a padded word); fewer rows than a chunk
@pytest.mark.parametrize("m, n, k", [(128, 256, 1024), (37, 100, 70), (5, 64, 33)])
def test_float_rows_quantized_straight_into_the_products_layout_on_both_cores_equal_numpy(m, n, k):
    """`bind_channelwise(from_float=True)`: the rows quantized in chunks by the caller and the second
    core's thread (its C function QUANTIZE_CHUNKS), written as the products' q + 128 bytes, then the
    products' job: quantize_rows_numpy then gemm_channelwise_numpy's bits, alone or shared."""
    from execupy.kernels.fast import xnnpack_gemm_jit as K
    from execupy.kernels.fast.second_thread import SECOND_THREAD

    if not XG.NUMBA["vnni"]:
        pytest.skip("this CPU (or numba's target) has no AVX512-VNNI")
    rng = np.random.default_rng(m + k)
    x = (rng.standard_normal((m, k)) * rng.random((m, 1)) * 4).astype(np.float32)
    x[1, :] = np.abs(x[1, :])  # a row of one sign: its zero point at an end
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    w_scale, bias = (rng.random(n) * 0.01).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    q, scale, zp = XG.quantize_rows_numpy(x)
    reference = XG.gemm_channelwise_numpy(q, zp, scale, w, w_scale, bias)
    np.testing.assert_array_equal(XG.bind_channelwise(w, w_scale, bias, from_float=True)(x), reference)
    words, wsum = XG.channelwise_words(w)
    for share in (False,) + (True,) * 10:  # the thread spins after the first shared call
        out = np.full((m, n), np.nan, np.float32)
        SECOND_THREAD.call(K.channelwise_from_float, (K.CHANNELWISE_CHUNKS.address, SECOND_THREAD.job,
                                                      K.QUANTIZE_CHUNKS.address, x, words, wsum, w_scale, bias, out),
                           share)
        np.testing.assert_array_equal(out, reference)


@pytest.mark.parametrize("variant", ["_chains_float", "_chains_vnni"])
def test_both_panel_kernels_equal_numpy(variant):
    """The decode mat-vec's panels, through vpdpbusd where the CPU has AVX512-VNNI and through
    float32 sums elsewhere: each equals the reference bit for bit (150 outputs: three panels, the
    last one padded)."""
    from execupy.kernels.fast import blockwise_jit as B

    if variant == "_chains_vnni" and not B.VNNI:
        pytest.skip("this CPU (or numba's target) has no AVX512-VNNI: the float32 variant runs here")
    rng = np.random.default_rng(11)
    n, k, block = 150, 576, 32
    q, zp, scale = _activations(rng, 1, k)
    scales = (rng.random((n, k // block)) * 0.02 + 1e-4).astype(ml_dtypes.bfloat16).astype(np.float32)
    packed = XG.pack_blockwise(rng.integers(-8, 8, (n, k)).astype(np.int8), scales)
    a = q[0].astype(np.float32) + 128
    xbytes, shifts = np.empty((k // 8, 2), np.int32), np.empty(k // block, np.float32)
    B.activation_bytes(a, block, xbytes, shifts)
    panels = packed.words.shape[0]
    v = (packed.ksum * np.float32(zp[0] + 128)).reshape(panels, B.PANEL)
    getattr(B, variant)(a, xbytes, shifts, packed.words_as("rows"), packed.scales_as("rows"), block // 8, 0, panels, v)
    ours = v.reshape(-1)[:n] * scale[0]
    np.testing.assert_array_equal(ours, XG.gemm_blockwise_numpy(q, zp, scale, packed, None, "vnni")[0])


@pytest.mark.parametrize("kernel", ["panel_outputs_bytes", "panel_outputs_float"])
@pytest.mark.parametrize("zero_point", [-128, -3, 0, 127])
@pytest.mark.parametrize("block", [16, 32, 64, 96, 128])  # 16-64 unrolled; 128: the int16 sums widened twice a block
def test_the_avx2_panel_kernels_equal_numpy(zero_point, block, kernel):
    """The decode mat-vec's panels in the "avx2" arithmetic, on words in the lanes layout: four
    lanes' chains, from AVX2's byte products (avx2_jit) or from the bytes one at a time, summed
    (v0 + v1) + (v2 + v3), then XNNPACK's fma with the row's scale and the bias, equal the
    reference bit for bit (150 outputs: three panels, the last one padded; the first block's
    terms all at their largest)."""
    from execupy.kernels.fast import blockwise_jit as B

    if kernel == "panel_outputs_bytes" and not B.AVX2:
        pytest.skip("numba does not compile for AVX2 here: the other variant runs")
    rng = np.random.default_rng(200 + zero_point)
    n, k = 150, 1152
    q, zp, scale = _activations(rng, 1, k)
    q[0, :128] = -128
    zp[:] = zero_point
    scales = (rng.random((n, k // block)) * 0.02 + 1e-4).astype(ml_dtypes.bfloat16).astype(np.float32)
    w = rng.integers(-8, 8, (n, k)).astype(np.int8)
    w[:, :128] = 7
    packed = XG.pack_blockwise(w, scales)
    bias = rng.standard_normal(n).astype(np.float32)
    shifts = np.empty((k // block, B.AVX2_LANES), np.float32)
    B.lane_shifts(q[0], block, shifts)
    panels = packed.words.shape[0]
    y = np.empty((panels, B.PANEL), np.float32)
    getattr(B, kernel)(packed.words_as("lanes"), q[0], shifts, packed.scales_as("lanes"), packed.ksum, np.float32(zero_point),
                       block, 0, panels, y)
    np.testing.assert_array_equal(XG.fma32(y.reshape(-1)[:n], scale[0], bias),
                                  XG.gemm_blockwise_numpy(q, zp, scale, packed, bias, "avx2")[0])


def test_the_two_layouts_hold_the_same_weights():
    """A filter packed in the "lanes" layout is the "rows" one's bytes and scales rearranged (and
    back), from either packing function; and each gives the same weights and scales back."""
    rng = np.random.default_rng(5)
    w = rng.integers(-8, 8, (150, 576)).astype(np.int8)
    scales = rng.random((150, 18)).astype(np.float32)
    stored = (w + 8).astype(np.uint8)
    nibbles = stored[:, 0::2] | (stored[:, 1::2] << np.uint8(4))
    for pack in (lambda: XG.pack_blockwise(w, scales), lambda: XG.pack_blockwise_stored(nibbles, scales)):
        packed = pack()
        rows, lanes = packed.words_as("rows"), packed.words_as("lanes")
        assert packed.layout == XG.packing_layout() and rows.shape == lanes.shape
        np.testing.assert_array_equal(XG.rows_layout(lanes), rows)
        np.testing.assert_array_equal(XG.lanes_layout(rows), lanes)
        assert not np.array_equal(rows, lanes)
        np.testing.assert_array_equal(quantized.unpack_nibbles(packed.column_words()).T[:150].astype(np.int8) - 8, w)
        np.testing.assert_array_equal(XG.rows_scales(packed.scales_as("lanes")), packed.scales_as("rows"))
        np.testing.assert_array_equal(XG.lanes_scales(packed.scales_as("rows")), packed.scales_as("lanes"))
        np.testing.assert_array_equal(packed.column_scales().T, scales)


@pytest.mark.parametrize("rows", [1, 3, 5])  # one compiled call below MATVEC_MAX_ROWS, the general path above
def test_a_fused_convert_quantizes_then_multiplies_as_the_two_steps(rows):
    rng = np.random.default_rng(rows)
    n, k = 200, 576
    x = rng.standard_normal((rows, k)).astype(np.float32) * 3
    packed = XG.pack_blockwise(rng.integers(-8, 8, (n, k)).astype(np.int8),
                               (rng.random((n, k // 32)) * 0.02 + 1e-4).astype(np.float32))
    bias = rng.standard_normal(n).astype(np.float32)
    q, scale, zp = XG.quantize_rows_numpy(x)
    np.testing.assert_array_equal(XG.bind_blockwise_from_float(packed, bias)(x),
                                  XG.gemm_blockwise_numpy(q, zp, scale, packed, bias))


@pytest.mark.parametrize("arithmetic", ["vnni", "avx2"])
def test_blockwise_sums_stay_exact_at_the_largest_terms(arithmetic, monkeypatch):
    """Every term at its largest over the largest block the float32 sums allow: still the integer
    sums. "vnni": the mat-vec adds (q + 128) * (w + 8), 255 * 15 at most, with zp + 128 = 0 (no
    ksum term); "avx2": each lane adds q * (w + 8), q = -128, with zp = 0."""
    monkeypatch.setattr(XG, "ARITHMETIC", arithmetic)
    block = XG.MAX_EXACT_BLOCK // XG.KSUM_CHUNK * XG.KSUM_CHUNK
    value, zero = (127, -128) if arithmetic == "vnni" else (-128, 0)
    q, zp, scale = np.full((1, block), value, np.int8), np.full(1, zero, np.int32), np.ones(1, np.float32)
    w = np.stack([np.full(block, 7), np.full(block, -8), np.tile([7, -8], block // 2)]).astype(np.int8)
    packed = XG.pack_blockwise(w, np.ones((3, 1), np.float32))
    ours = XG.NUMBA["blockwise_matvec"](q, zp, scale, packed, np.zeros(3, np.float32), np.empty((1, 3), np.float32))
    exact = (q.astype(np.int64) - zero) @ w.astype(np.int64).T
    np.testing.assert_array_equal(ours, exact.astype(np.float32))
    np.testing.assert_array_equal(XG.NUMPY["blockwise"](q, zp, scale, packed, None), exact.astype(np.float32))
    assert 255 * 15 * block > 2 ** 23  # large enough that a float32 sum past 2**24 would have shown


@pytest.mark.parametrize("m, n, k, bits", [(1, 33, 64, 8), (4, 40, 576, 8), (3, 10, 64, 4),
                                           (16, 48, 300, 8), (130, 70, 1100, 8)])  # the last two on BLAS
def test_channelwise_numba_equals_numpy(m, n, k, bits):
    rng = np.random.default_rng(m + n + k)
    q, zp, scale = _activations(rng, m, k)
    half = 1 << (bits - 1)
    w = rng.integers(-half, half, (n, k)).astype(np.int8)
    w_scale = (rng.random(n) * 0.02 + 1e-4).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    ours = XG.NUMBA["channelwise"](q, zp, scale, w, w_scale, bias)
    np.testing.assert_array_equal(ours, XG.NUMPY["channelwise"](q, zp, scale, w, w_scale, bias))


@pytest.mark.parametrize("m, n, k", [(4, 64, 64), (5, 70, 96), (13, 200, 30), (128, 1024, 256), (128, 256, 1024)])
def test_bound_channelwise_equals_numpy(m, n, k):
    """bind_channelwise: a prompt's rows through vpdpbusd where the CPU has AVX512-VNNI (four at a
    time, then the rest; N and K not whole panels and quads included); elsewhere and for fewer
    rows, gemm_channelwise."""
    rng = np.random.default_rng(m * n + k)
    q, zp, scale = _activations(rng, m, k)
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    w_scale, bias = (rng.random(n) * 0.1).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    product = XG.bind_channelwise(w, w_scale, bias)
    np.testing.assert_array_equal(product(q, zp, scale), XG.gemm_channelwise_numpy(q, zp, scale, w, w_scale, bias))
    extremes = np.full((m, k), 127, np.int8), np.full(m, -128, np.int32)  # the largest terms: (127 + 128) * -127
    w_low = np.full((n, k), -127, np.int8)
    np.testing.assert_array_equal(XG.bind_channelwise(w_low, w_scale, None)(*extremes, scale),
                                  XG.gemm_channelwise_numpy(*extremes, scale, w_low, w_scale, None))


def test_channelwise_blas_sums_stay_exact_at_the_largest_terms():
    """Every term 255 * -128 (or 255 * 127): the float32 BLAS runs must still sum exactly."""
    m, n, k = 9, 5, 1500
    q = np.full((m, k), 127, np.int8)
    zp = np.full(m, -128, np.int32)
    w = np.where(np.arange(n)[:, None] % 2 == 0, -128, 127).astype(np.int8).repeat(k, axis=1)
    sums = XG.channelwise_sums_blas(q, zp, w)
    exact = (q.astype(np.int64) - zp[:, None]) @ w.astype(np.int64).T
    np.testing.assert_array_equal(sums.astype(np.int64), exact.astype(np.float32).astype(np.int64))
    assert abs(int(exact.min())) > 2 ** 24  # the whole sum is past float32's integers; each run is not


@pytest.mark.parametrize("n", [200, 1536])  # one thread; big enough for the second core to take half
def test_the_product_bound_to_fixed_arrays_writes_what_the_step_returns(n):
    """bind_blockwise_from_float_into: a bound XNNPACK delegate's decode mat-vec, its arguments
    gathered once, writing into the output's array; the same bits as the step's own call."""
    rng = np.random.default_rng(n)
    k = 576
    packed = XG.pack_blockwise(rng.integers(-8, 8, (n, k)).astype(np.int8),
                               (rng.random((n, k // 32)) * 0.02 + 1e-4).astype(np.float32))
    bias = rng.standard_normal(n).astype(np.float32)
    x, out = np.empty((1, 1, k), np.float32), np.empty((1, 1, n), np.float32)
    run = XG.bind_blockwise_from_float_into(packed, bias, x, out)
    assert run is not None
    for _ in range(3):  # the arrays' contents change between calls, as a decode step's do
        x[...] = rng.standard_normal((1, 1, k)) * 3
        run()
        np.testing.assert_array_equal(out.reshape(1, n), XG.bind_blockwise_from_float(packed, bias)(x.reshape(1, k)))
    assert XG.bind_blockwise_from_float_into(packed, bias, x, np.empty((1, n), np.float32)) is None  # not its shape


@pytest.mark.parametrize("rows", [1, 7])
def test_filters_side_by_side_give_each_filters_own_outputs(rows):
    """side_by_side: q, k and v of one input as one product (widths not whole panels included)."""
    rng = np.random.default_rng(rows)
    k = 576
    weights = [XG.pack_blockwise(rng.integers(-8, 8, (n, k)).astype(np.int8),
                                 (rng.random((n, k // 32)) * 0.02 + 1e-4).astype(np.float32)) for n in (576, 192, 100)]
    both, starts = XG.side_by_side(weights)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    y = XG.bind_blockwise_from_float(both, None)(x)
    for w, start in zip(weights, starts):
        np.testing.assert_array_equal(y[:, start:start + w.n], XG.bind_blockwise_from_float(w, None)(x))


def test_a_row_with_inf_gives_non_finite_outputs_not_an_error():
    """An activation that overflowed: the row's scale is inf (255 / inf, then 1 / 0), as numpy and
    XNNPACK give, and the product is not finite; the compiled kernel raised ZeroDivisionError."""
    rng = np.random.default_rng(3)
    packed = XG.pack_blockwise(rng.integers(-8, 8, (64, 64)).astype(np.int8), np.ones((64, 2), np.float32))
    x = np.ones((1, 64), np.float32)
    x[0, 5] = np.inf
    with np.errstate(all="ignore"):
        assert XG.quantize_rows(x)[1][0] == np.inf
        assert not np.isfinite(XG.bind_blockwise_from_float(packed, None)(x)).any()


@pytest.mark.parametrize("width", [96, 101, 7])  # 16 inputs a step, and the rest one by one
def test_quantize_rows_numba_equals_numpy(width):
    rng = np.random.default_rng(5)
    rows = np.concatenate([rng.standard_normal((3, width)) * 3, np.zeros((1, width)), -rng.random((1, width)),
                           rng.random((1, width)), ((np.arange(width) % 255 - 127) / 127.5)[None],
                           np.eye(1, width) * 50, -np.zeros((1, width)), np.where(np.arange(width) % 3, 0.5, -0.0)[None],
                           -np.abs(rng.standard_normal((1, width))), np.abs(rng.standard_normal((1, width))),
                           np.eye(1, width, width - 1) * -50]).astype(np.float32)
    ours = XG.NUMBA["quantize_rows"](rows)  # its min and max over integer keys: -0.0 counts as 0.0
    reference = XG.NUMPY["quantize_rows"](rows)
    for a, b in zip(ours, reference):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    q, scale, zp = reference
    dequantized = (q.astype(np.float32) - zp[:, None]) * scale[:, None]
    assert scale[3] == 1 and not dequantized[3].any()  # a row of zeros: scale 1, zeros back
    np.testing.assert_allclose(dequantized, rows, atol=float(scale.max()) / 2 * 1.0001)


def _every_kind_of_float32(rng) -> np.ndarray:
    """Normal values, wide ones, the specials, and random bit patterns (subnormals, NaNs, huge)."""
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 88.0, -88.0, 104.0, -104.0, 1e30, -1e30, 3.4e38, -3.4e38]
    bits = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([(rng.standard_normal(5500) * np.repeat([6, 200], [5000, 500])).astype(np.float32),
                           np.array(specials, np.float32), bits])


def test_compiled_sigmoid_gelu_swiglu_and_rsqrt_equal_their_numpy_steps():
    from execupy.backends.xnnpack import vmath

    x = _every_kind_of_float32(np.random.default_rng(3))
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(vmath.sigmoid(x.reshape(5, -1)), vmath._sigmoid(x).reshape(5, -1))
        np.testing.assert_array_equal(vmath.gelu(x.reshape(5, -1)), vmath._gelu(x).reshape(5, -1))
        u = np.roll(x, 7)  # the SwiGLU's nodes one by one in numpy, and its one compiled call
        np.testing.assert_array_equal(vmath.swiglu(x.reshape(5, -1), u.reshape(5, -1)),
                                      np.multiply(np.multiply(x, vmath._sigmoid(x)), u).reshape(5, -1))
    if vmath._RSQRT is not None:  # the CPU's estimate (vrsqrt14ps or vrsqrtps), then XNNPACK's Newton step
        a = np.concatenate([np.abs(x), x]).reshape(2, 1, -1)
        estimate = vmath._ESTIMATE(a.reshape(-1)).reshape(a.shape)  # (denormals off in the AVX path's step)
        np.testing.assert_array_equal(vmath.rsqrt(a), vmath.newton_step(a, estimate, vmath.X86_VARIANT == "avx2"))


VMATH_PROBE = """
import types
import numpy as np
from execupy.backends.xnnpack import vmath
x = np.linspace(-8, 8, 64, dtype=np.float32)
vmath.sigmoid(x), vmath.gelu(x), vmath.swiglu(x, x)
K = types.SimpleNamespace(KERNELS={"sigmoid": vmath._SIGMOID, "gelu": vmath._GELU, "swiglu": vmath._SWIGLU})
"""  # (the sigmoid's and SwiGLU's loops are this CPU's variant's: vmath_jit.sigmoid_into or sigmoid_avx2_into)


def test_a_second_process_finds_the_compiled_sigmoid_gelu_and_swiglu_in_numbas_cache(tmp_path):
    """Module-level kernels: a sigmoid made inside a function, around an fma intrinsic, missed
    numba's disk cache and was compiled again at every XNNPACK program's load (1.1 s)."""
    from tests.numba_cache import two_processes_cache_stats

    first, second = two_processes_cache_stats(VMATH_PROBE, tmp_path)
    assert all(misses > 0 for _, misses in first.values())
    assert all(hits > 0 and misses == 0 for hits, misses in second.values())


def test_the_compiled_rms_norm_tail_equals_its_four_nodes_in_numpy():
    """vmath.rms_tail: (x * rsqrt(mean + eps)) * w in one loop where the CPU has AVX-512F, the
    bits of the Add, ReciprocalSquareRoot and two Multiply nodes (a zero mean + eps: inf times x)."""
    from execupy.backends.xnnpack import vmath

    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 7, 576)).astype(np.float32) * 3
    mean = np.concatenate([np.square(x).mean(-1, keepdims=True)[:, :6], np.zeros((1, 1, 1), np.float32)], axis=1)
    w, eps = rng.standard_normal(576).astype(np.float32), np.array([1e-5], np.float32)
    with np.errstate(all="ignore"):
        nodes = np.multiply(np.multiply(x, vmath.rsqrt(np.add(mean, eps))), w)
        np.testing.assert_array_equal(vmath.rms_tail(mean, eps, x, w), nodes)
        np.testing.assert_array_equal(vmath.rms_tail(mean, np.array([0], np.float32), x, w),
                                      np.multiply(np.multiply(x, vmath.rsqrt(mean)), w))


CACHE_PROBE = """
import numpy as np
from execupy.kernels.fast import xnnpack_gemm as XG, xnnpack_gemm_jit as K
rng = np.random.default_rng(0)
q, scale, zp = XG.NUMBA["quantize_rows"](rng.standard_normal((3, 64)).astype(np.float32))
packed = XG.pack_blockwise(rng.integers(-8, 8, (300, 64)).astype(np.int8), np.ones((300, 2), np.float32))
for threads in (1, 2):  # the mat-vec of a decode step on one thread, then on two
    XG.NUMBA["blockwise_matvec"](q, zp, scale, packed, np.zeros(300, np.float32), np.empty((3, 300), np.float32),
                                 threads=threads)
XG.bind_blockwise_from_float(packed, None)(rng.standard_normal((1, 64)).astype(np.float32))
for parallel_min in (10 ** 12, 0):  # a prompt's rows on one thread, then on every thread
    XG.PARALLEL_MIN_MACS = parallel_min
    XG.NUMBA["blockwise"](q.repeat(3, axis=0), zp.repeat(3), scale.repeat(3), packed, None)
for rows in (3, 8):  # the numba kernel, then BLAS sums scaled by numba
    XG.NUMBA["channelwise"](q.repeat(3, axis=0)[:rows], zp.repeat(3)[:rows], scale.repeat(3)[:rows],
                            rng.integers(-100, 100, (30, 64)).astype(np.int8), np.ones(30, np.float32), None)
XG.bind_channelwise(rng.integers(-100, 100, (30, 64)).astype(np.int8), np.ones(30, np.float32), None)(
    q.repeat(3, axis=0), zp.repeat(3), scale.repeat(3))  # a prompt's rows through vpdpbusd, where the CPU has it
XG.bind_channelwise(rng.integers(-100, 100, (30, 64)).astype(np.int8), np.ones(30, np.float32), None,
                    from_float=True)(rng.standard_normal((9, 64)).astype(np.float32))  # quantized into its layout
if XG.NUMBA["vnni"]:  # the second thread's half of a prompt's rows: a C function, compiled (or loaded) at import
    from types import SimpleNamespace as NS
    hits = K.BLOCKWISE_SECOND_HALF.cache_hits
    K.KERNELS["BLOCKWISE_SECOND_HALF"] = NS(stats=NS(cache_hits={0: hits}, cache_misses={0: 1 - hits}))
    for name in ("CHANNELWISE_CHUNKS", "QUANTIZE_CHUNKS"):
        hits = getattr(K, name).cache_hits
        K.KERNELS[name] = NS(stats=NS(cache_hits={0: hits}, cache_misses={0: 1 - hits}))
if XG.ARITHMETIC == "avx2":  # the second thread's half of a decode step: a C function, compiled (or read) at first use
    from types import SimpleNamespace as NS
    hits = K.blockwise_avx2_second_half().cache_hits
    K.KERNELS["BLOCKWISE_AVX2_SECOND_HALF"] = NS(stats=NS(cache_hits={0: hits}, cache_misses={0: 1 - hits}))
"""


def test_a_second_process_finds_every_gemm_kernel_in_numbas_cache(tmp_path):
    """Compiled once per machine, not once per process (a kernel that missed the disk cache was
    compiled again inside the first forward call, 0.25-0.7 s)."""
    from tests.numba_cache import two_processes_cache_stats

    first, second = two_processes_cache_stats(CACHE_PROBE, tmp_path)
    from execupy.kernels.fast.vnni_jit import VNNI

    # a prompt's rows: through vpdpbusd (the second thread's half a C function) where the CPU has it;
    # the qb4w kernels of this CPU's arithmetic ("avx2": the decode step's second half a C function)
    channelwise_rows = {"channelwise_rows", "channelwise_from_float", "CHANNELWISE_CHUNKS", "QUANTIZE_CHUNKS"}
    from execupy.kernels.fast.avx2_jit import AVX2

    avx2_prompts = ("blockwise_rows_avx2", "blockwise_rows_avx2_parallel") if AVX2 else ("blockwise_tiles_avx2",
                                                                                        "blockwise_tiles_avx2_parallel")
    qb4w = ({"blockwise_matvec_avx2", "blockwise_matvec_from_float_avx2", *avx2_prompts,
             "BLOCKWISE_AVX2_SECOND_HALF"} if XG.ARITHMETIC == "avx2"
            else {"blockwise_matvec", "blockwise_matvec_from_float"}
            | ({"blockwise_rows_halves", "BLOCKWISE_SECOND_HALF"} if VNNI
               else {"blockwise_tiles", "blockwise_tiles_parallel"}))
    assert set(first) == {"channelwise", "scale_sums", "quantize_rows"} | qb4w | (channelwise_rows if VNNI else set())
    assert all(misses > 0 for _, misses in first.values())  # the first process compiled each one
    assert all(hits > 0 and misses == 0 for hits, misses in second.values())
