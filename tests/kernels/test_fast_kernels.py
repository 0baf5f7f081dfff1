"""The compiled kernels of the `fast` extra (numba) and their numpy counterparts give the
same results on the same inputs, and the numpy ones agree with the registered portable
quantized kernels they stand in for. The numba half runs where numba is installed (CI
installs the `fast` extra); the numpy half always runs."""
import os

import numpy as np
import pytest

from execupy.kernels import cores as cores_module
from execupy.kernels.cores import SecondCore
from execupy.kernels.fast import quantized as Q
from execupy.kernels.quantized.quant import dequantize_per_channel_group

needs_numba = pytest.mark.skipif(Q.NUMBA is None, reason="numba (the `fast` extra) is not installed")

# (bits, with zero points): int4 values are held one per int8, as the quantized ops take them.
WEIGHTS = [(4, False), (4, True), (8, False), (8, True)]


def grouped_weight(rng, n: int, k: int, group: int, bits: int, with_zeros: bool):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = rng.integers(lo, hi + 1, (n, k)).astype(np.int8)
    scales = (rng.random((n, k // group)) * 0.05 + 1e-3).astype(np.float32)
    zeros = rng.integers(lo // 4, hi // 4 + 1, (n, k // group)).astype(np.int8) if with_zeros else None
    return q, scales, zeros, lo, hi


def dequantized(q, scales, zeros, lo, hi, group):
    """The weight as the registered dequantize_per_channel_group kernel makes it."""
    out = np.empty(q.shape, np.float32)
    return dequantize_per_channel_group(q, scales, zeros, lo, hi, 1, group, 6, out)


def packed_grouped(rng, n: int, k: int, group: int, bits: int, with_zeros: bool):
    """(packed weight, its dequantization by the registered kernel)."""
    q, s, z, lo, hi = grouped_weight(rng, n, k, group, bits, with_zeros)
    return Q.pack(q, s, z, group), dequantized(q, s, z, lo, hi, group)


@pytest.mark.parametrize("bits,with_zeros", WEIGHTS)
@pytest.mark.parametrize("m", [1, 5])
def test_numpy_qlinear_is_x_times_the_dequantized_weight(bits, with_zeros, m):
    rng = np.random.default_rng(bits * 10 + m)
    packed, w = packed_grouped(rng, 48, 96, 32, bits, with_zeros)
    x = rng.standard_normal((m, 96)).astype(np.float32)
    np.testing.assert_allclose(Q.qlinear_numpy(x, packed), x @ w.T, rtol=1e-5, atol=1e-5)


def assert_within_float32_rounding(got, expected):
    assert got.shape == expected.shape and got.dtype == np.float32
    scale = np.abs(expected).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - expected) <= 1e-5 * scale + 1e-6)


@needs_numba
@pytest.mark.parametrize("bits,with_zeros", WEIGHTS)
@pytest.mark.parametrize("m", [1, 3, Q.BLAS_MIN_ROWS, 7])  # the mat-vec path, then dequantize + BLAS
def test_numba_qlinear_equals_numpy_within_float32_rounding(bits, with_zeros, m):
    rng = np.random.default_rng(bits + m)
    packed, _ = packed_grouped(rng, 130, 256, 64, bits, with_zeros)
    x = rng.standard_normal((m, 256)).astype(np.float32)
    assert_within_float32_rounding(Q.NUMBA["qlinear"](x, packed), Q.NUMPY["qlinear"](x, packed))


@pytest.mark.parametrize("impl", ["numpy", "numba"])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_window_of_columns_is_those_columns_of_the_product(impl, bits):
    """qlinear_columns(x, w, j0, j1, out) fills out [M, j1 - j0] with columns j0..j1 of x @ w.T
    (what one of a layer's q, k, v projections takes from their weights side by side)."""
    if impl == "numba" and Q.NUMBA is None:
        pytest.skip("numba (the `fast` extra) is not installed")
    rng = np.random.default_rng(bits)
    packed, w = packed_grouped(rng, 960, 96, 32, bits, False)
    x = rng.standard_normal((6, 96)).astype(np.float32)
    for j0, j1 in [(0, 576), (576, 768), (700, 960)]:
        out = np.full((6, j1 - j0), np.nan, np.float32)
        (Q.NUMBA if impl == "numba" else Q.NUMPY)["qlinear_columns"](x, packed, j0, j1, out)
        np.testing.assert_allclose(out, x @ w[j0:j1].T, rtol=1e-5, atol=1e-5)


@needs_numba
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [130, 1000, 4200])  # narrow, wider, wide (four words per pass)
def test_mat_vec_shared_with_the_second_thread_equals_one_thread(monkeypatch, bits, n):
    """From SHARE_MIN_BYTES on, with a core free (or when asked), decode offers the second half
    of the weight's rows to the second core's thread; both halves are summed the same way
    whoever runs them, so one thread and two agree bit for bit."""
    rng = np.random.default_rng(n)
    packed, _ = packed_grouped(rng, n, 512, 32, bits, True)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    monkeypatch.setattr(Q, "SHARE_MIN_BYTES", 0)
    monkeypatch.setattr(cores_module, "SECOND_CORE", SecondCore())  # no back-off left by other tests
    assert np.array_equal(Q.NUMBA["qlinear"](x, packed), Q.NUMBA["qlinear"](x, packed, threads=1))
    for _ in range(20):  # the thread is spinning after the first: later calls are shared for real
        two, one = Q.NUMBA["qlinear"](x, packed, threads=2), Q.NUMBA["qlinear"](x, packed, threads=1)
        assert np.array_equal(two, one)
    assert_within_float32_rounding(one, Q.NUMPY["qlinear"](x, packed))


@needs_numba
@pytest.mark.parametrize("n", [7, 130, 1000])
def test_float32_mat_vec_shared_with_the_second_thread_equals_one_thread(n):
    """A float32 decode mat-vec gives half of the weight's rows to the second core's thread; each
    output row is summed by the same code whoever runs it, so one thread and two agree bit for bit."""
    from execupy.kernels.fast.second_thread import SECOND_THREAD

    rng = np.random.default_rng(n)
    w, x = rng.standard_normal((n, 300)).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    one, two = np.empty(n, np.float32), np.empty(n, np.float32)
    SECOND_THREAD.dense_matvec(x, w, one, False)
    for _ in range(20):  # the thread is spinning after the first: later calls are shared for real
        SECOND_THREAD.dense_matvec(x, w, two, True)
        assert np.array_equal(two, one)
    assert_within_float32_rounding(one[None], (w.astype(np.float64) @ x).astype(np.float32)[None])


@needs_numba
@pytest.mark.parametrize("bits", [4, 8])
def test_two_mat_vecs_of_one_row_on_the_two_cores_equal_each_alone(bits):
    """Two weights too small to split that read the same row (an LLM's k and v projections) run
    at once, the second on the second core's thread, each summed as it is alone: the same bits."""
    from execupy.kernels.fast.second_thread import SECOND_THREAD
    from execupy.kernels.fast.second_thread_jit import matvec_pair

    rng = np.random.default_rng(bits)
    (a, _), (b, _) = packed_grouped(rng, 192, 576, 32, bits, True), packed_grouped(rng, 130, 576, 32, bits, True)
    x = rng.standard_normal((1, 576)).astype(np.float32)
    first, second = np.empty((1, 192), np.float32), np.empty((1, 130), np.float32)
    step = Q.NUMBA["bind_matvec"](x, a, first)
    pair = step.pair_with(Q.NUMBA["bind_matvec"](x.reshape(1, 576), b, second))  # another view of the same row
    assert pair is not None and pair.__name__ == "matvec_pair"
    alone = [Q.NUMBA["qlinear"](x, w, threads=1) for w in (a, b)]
    for _ in range(20):  # the thread is spinning after the first: later calls are shared for real
        first[:], second[:] = np.nan, np.nan
        SECOND_THREAD.call(matvec_pair, (x, a.qt, a.scales, a.offsets, b.qt, b.scales, b.offsets, a.group_size,
                                         a.bits, first, second), True)
        assert np.array_equal(first, alone[0]) and np.array_equal(second, alone[1])
    pair()
    assert np.array_equal(first, alone[0]) and np.array_equal(second, alone[1])
    assert step.pair_with(Q.NUMBA["bind_matvec"](x.copy(), b, second)) is None  # another row: no pair


def attention_in_float64(q, k, v, kv_len: int, scale: float) -> np.ndarray:
    """softmax(q k^T * scale) v per query head (head h reads KV head h // (H / Hkv)), in float64."""
    rep = q.shape[0] // k.shape[1]
    out = np.empty(q.shape)
    for h in range(q.shape[0]):
        keys, values = k[:kv_len, h // rep].astype(np.float64), v[:kv_len, h // rep].astype(np.float64)
        p = np.exp(keys @ q[h] * scale - (keys @ q[h] * scale).max())
        out[h] = p @ values / p.sum()
    return out


@needs_numba
@pytest.mark.parametrize("heads, kv_heads, kv_len", [(9, 3, 151), (9, 3, 601), (4, 1, 7), (1, 1, 3), (5, 5, 40)])
def test_decode_attention_shared_with_the_second_thread_equals_one_thread(heads, kv_heads, kv_len):
    """A decode step's attention gives its last query heads (half, the odd one kept) to the
    second core's thread; each head is computed alone, so one thread and two agree bit for bit."""
    from execupy.kernels.fast import second_thread_jit as S
    from execupy.kernels.fast.second_thread import SECOND_THREAD

    rng = np.random.default_rng(heads + kv_len)
    q = rng.standard_normal((heads, 64), dtype=np.float32)
    k, v = (2 * rng.standard_normal((700, kv_heads, 64), dtype=np.float32) for _ in range(2))
    alone, shared = np.empty_like(q), np.empty_like(q)
    assert not SECOND_THREAD.call(S.attention_halves, (q, k, v, kv_len, np.float32(0.125), 512, alone), False)
    assert_within_float32_rounding(alone, attention_in_float64(q, k, v, kv_len, 0.125))
    for _ in range(20):  # the thread is spinning after the first: later calls are shared for real
        shared[:] = np.nan
        assert SECOND_THREAD.call(S.attention_halves, (q, k, v, kv_len, np.float32(0.125), 512, shared), True)
        assert np.array_equal(shared, alone)


CACHE_PROBE = """
import json, time, numpy as np
start = time.monotonic()
from execupy.kernels.fast import quantized as Q, quantized_jit as K
rng = np.random.default_rng(0)
for values in ((-100, 100), (0, 15)):  # int8 words, then 4-bit words
    packed = Q.pack(rng.integers(*values, (64, 1024)).astype(np.int8), np.ones((64, 32), np.float32), None, 32)
    for m, threads in ((1, 1), (1, 2), (5, None)):  # decode on one thread and on two, then prefill
        Q.NUMBA["qlinear"](np.ones((m, 1024), np.float32), packed, threads=threads)
Q.NUMBA["fake_quantize_per_token"](np.ones((2, 64), np.float32))
from execupy.kernels.fast.second_thread import SECOND_THREAD
for share in (False, True):  # a float32 decode mat-vec, alone and shared
    SECOND_THREAD.dense_matvec(np.ones(1024, np.float32), np.ones((64, 1024), np.float32), np.empty(64, np.float32), share)
from execupy.kernels.fast import second_thread_jit as S
cache = np.ones((8, 1, 16), np.float32)
for share in (False, True):  # two small mat-vecs of one row, alone and at once
    w = Q.pack(rng.integers(0, 15, (64, 1024)).astype(np.int8), np.ones((64, 32), np.float32), None, 32)
    SECOND_THREAD.call(S.matvec_pair, (np.ones((1, 1024), np.float32), w.qt, w.scales, w.offsets, w.qt, w.scales,
                                       w.offsets, 32, w.bits, np.empty((1, 64), np.float32), np.empty((1, 64), np.float32)),
                       share)
for share in (False, True):  # a decode attention, alone and shared
    SECOND_THREAD.call(S.attention_halves, (np.ones((3, 16), np.float32), cache, cache, 5, np.float32(0.5), 512,
                                            np.empty((3, 16), np.float32)), share)
from execupy.kernels.fast import decode_jit as D  # a decode step's add + RMSNorm and RoPE
row = np.ones(16, np.float32)
D.add_rms_norm_row(row, row, np.float32(1e-5), row, np.empty(16, np.float32), np.empty(16, np.float32))
D.rope_swapped_rows(np.ones((3, 16), np.float32), row, row, np.empty((3, 16), np.float32))
D.rms_norm_rows(np.ones((2, 16), np.float32), np.float32(1e-5), row, np.empty((2, 16), np.float32))
while not S.second_thread_loop.signatures and time.monotonic() < start + 60:  # the thread loads its loop
    time.sleep(0.01)
kernels = {**K.KERNELS, **S.KERNELS, "add_rms_norm_row": D.add_rms_norm_row, "rope_swapped_rows": D.rope_swapped_rows,
           "rms_norm_rows": D.rms_norm_rows}
counts = {name: [sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())] for name, k in kernels.items()}
for c in (S._grouped_half_c, S._dense_rows_c, S._attention_heads_c):  # the halves' one copies (compiled at import)
    counts[c.__name__] = [c.cache_hits, 1 - c.cache_hits]
print(json.dumps(counts))
"""


@needs_numba
def test_a_second_process_finds_every_compiled_kernel_in_numbas_cache(tmp_path):
    """Compiled once per machine, not once per process (a kernel that misses the disk cache
    is compiled again inside the first forward call, half a second each)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(root)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", CACHE_PROBE], env=env, capture_output=True, text=True,
                                      check=True, timeout=600).stdout) for _ in range(2)]
    assert all(misses > 0 for _, misses in runs[0].values())  # the first process compiled each one
    assert all(hits > 0 and misses == 0 for hits, misses in runs[1].values())


@pytest.mark.parametrize("values,nibbles", [((-8, 7), True), ((0, 15), True), ((-9, 7), False), ((0, 16), False)])
@pytest.mark.parametrize("m", [1, 6])
def test_4bit_weights_pack_eight_to_a_word_and_compute_the_same(values, nibbles, m):
    """int4 (Q4_0-like, -8..7) and uint4 (Q4_1-like, 0..15 with a minimum) weights are stored
    eight rows to a 32-bit word; anything wider stays one per byte. Either way qlinear is x @ w.T."""
    rng = np.random.default_rng(m)
    q = rng.integers(values[0], values[1] + 1, (70, 128)).astype(np.int8)
    scales = (rng.random((70, 4)) * 0.05 + 1e-3).astype(np.float32)
    mins = (rng.random((70, 4)) * -0.1).astype(np.float32)
    packed = Q.pack(q, scales, None, 32, mins)
    assert packed.nibbles is nibbles and packed.shape == (70, 128)
    x = rng.standard_normal((m, 128)).astype(np.float32)
    w = (q.reshape(70, 4, 32) * scales[:, :, None] + mins[:, :, None]).reshape(70, 128)
    expected = x @ w.T
    for impl in [Q.NUMPY] + ([Q.NUMBA] if Q.NUMBA is not None else []):
        got = impl["qlinear"](x, packed)
        assert np.all(np.abs(got - expected) <= 1e-5 * np.abs(expected).max(axis=1, keepdims=True) + 1e-6)


@pytest.mark.parametrize("group", [32, 6, 96])
@pytest.mark.parametrize("n", [70, 4200])  # a partial last panel; many panels
@pytest.mark.parametrize("m", [1, 6])
def test_8bit_weights_are_stored_in_panels_of_64_outputs_and_compute_the_same(group, n, m):
    """int8 weights are stored input-major in panels of 64 output columns, [P, K, 64] (a panel's
    row one cache line), whatever the group size; qlinear is x @ w.T, decode and prompt."""
    rng = np.random.default_rng(n + m)
    q = rng.integers(-128, 128, (n, 96)).astype(np.int8)
    scales = (rng.random((n, 96 // group)) * 0.05 + 1e-3).astype(np.float32)
    zeros = rng.integers(-8, 8, (n, 96 // group)).astype(np.int8)
    packed = Q.pack(q, scales, zeros, group)
    assert packed.bits == 8 and not packed.nibbles and packed.shape == (n, 96)
    assert packed.qt.shape == (-(-n // 64), 96, 64) and packed.qt.dtype == np.int8
    assert np.array_equal(packed.qt[1, :, 5], q[64 + 5])  # output 69's weights: panel 1, lane 5
    x = rng.standard_normal((m, 96)).astype(np.float32)
    w = dequantized(q, scales, zeros, -128, 127, group)
    np.testing.assert_allclose(Q.dequantize_columns(packed, 0, n), w.T, rtol=1e-6, atol=1e-6)  # q * s + (-z * s)
    expected = x @ w.T
    for impl in [Q.NUMPY] + ([Q.NUMBA] if Q.NUMBA is not None else []):
        assert_within_float32_rounding(impl["qlinear"](x, packed), expected)


@needs_numba
@pytest.mark.parametrize("rows", [576, 7, 1])
def test_the_8bit_panel_sums_in_512_bit_registers_equal_numbas_own_loop(rows):
    """A CPU with AVX-512 sums a panel of 8-bit weights in explicit 512-bit registers; numba's
    loop (every other CPU) gives the same sums to float32 rounding, on every run of rows."""
    from execupy.kernels.fast import quantized_jit as K

    rng = np.random.default_rng(rows)
    qp = rng.integers(-128, 128, (3, rows + 5, 64)).astype(np.int8)
    x = rng.standard_normal(rows + 5).astype(np.float32)
    loop, used = np.empty(64, np.float32), np.empty(64, np.float32)
    K.byte_panel_sums_loop(qp, x, 2, 3, 3 + rows, loop)
    expected = (x[3:3 + rows].astype(np.float64) @ qp[2, 3:3 + rows].astype(np.float64))
    assert np.all(np.abs(loop - expected) <= 1e-5 * np.abs(expected).max() + 1e-6)
    assert (K.byte_panel_sums is K.byte_panel_sums_loop) is not K.AVX512
    K.byte_panel_sums(qp, x, 2, 3, 3 + rows, used)
    assert np.all(np.abs(used - expected) <= 1e-5 * np.abs(expected).max() + 1e-6)


@needs_numba
@pytest.mark.parametrize("group", [32, 8, 576])
def test_the_4bit_panel_in_512_bit_registers_equals_numbas_own_loop(group):
    """A CPU with AVX-512 multiplies a panel of 4-bit words in explicit 512-bit registers (vpermps
    turns sixteen nibbles into floats); numba's loop (every other CPU) gives the same product to
    float32 rounding, scales, offsets and groups included."""
    from execupy.kernels.fast import quantized_jit as K

    rng = np.random.default_rng(group)
    q = rng.integers(-8, 8, (130, 576)).astype(np.int8)
    scales = (rng.random((130, 576 // group)) * 0.05 + 1e-3).astype(np.float32)
    mins = (rng.random((130, 576 // group)) * -0.1).astype(np.float32)
    packed = Q.pack(q, scales, None, group, mins)
    x = rng.standard_normal(576).astype(np.float32)
    sums = x.reshape(-1, group).sum(axis=1)
    w = (q.reshape(130, -1, group) * scales[:, :, None].astype(np.float64) + mins[:, :, None]).reshape(130, 576)
    expected = (w @ x.astype(np.float64))[128:]  # the third panel: outputs 128 and 129
    assert (K.nibble_panel is K.nibble_panel_loop) is not K.AVX512
    for kernel in (K.nibble_panel_loop, K.nibble_panel):
        total = np.full(64, np.nan, np.float32)
        kernel(packed.qt, x, sums, packed.scales, packed.offsets, group // 8, 2, total)
        assert np.all(np.abs(total[:2] - expected) <= 1e-5 * np.abs(w @ x).max() + 1e-6)
        assert np.all(total[2:] == 0)  # the padded columns' weights are 0: their sums too


@needs_numba
def test_packing_warms_the_compiled_kernels_up_at_load():
    """The first pack in a process (the runtime packs while it binds a method) runs each kernel
    once, so the first forward call does not load them; warming twice does nothing more."""
    from execupy.kernels.fast import quantized_jit as K

    Q.pack(np.zeros((8, 32), np.int8), np.ones((8, 1), np.float32), None, 32)
    assert Q._warm["done"]
    assert all(kernel.signatures for kernel in K.KERNELS.values())
    before = {name: len(kernel.signatures) for name, kernel in K.KERNELS.items()}
    Q.warm_up()
    assert before == {name: len(kernel.signatures) for name, kernel in K.KERNELS.items()}


@needs_numba
@pytest.mark.parametrize("values, group", [((-8, 8), 32), ((0, 16), 32), ((-128, 128), 32), ((-128, 128), 576),
                                           ((-100, 100), 6)])  # int4, uint4, int8 words (grouped, per row), bytes
def test_compiled_packing_lays_out_the_numpy_words(monkeypatch, values, group):
    """At load, numba packs a weight's rows into words or byte panels in one pass
    (quantized_jit.pack_nibbles, pack_byte_panels): the very arrays numpy's passes make."""
    rng = np.random.default_rng(group)
    q = rng.integers(*values, (96, 576)).astype(np.int8)
    s = rng.random((96, 576 // group)).astype(np.float32)
    compiled = Q._pack(q, s, None, group)
    monkeypatch.setattr(Q, "NUMBA", None)
    plain = Q._pack(q, s, None, group)
    assert compiled.bits == plain.bits and compiled.qt.dtype == plain.qt.dtype
    for a, b in ((compiled.qt, plain.qt), (compiled.scales, plain.scales), (compiled.offsets, plain.offsets)):
        assert np.array_equal(a, b)


WARM_PROBE = """
import json, numpy as np
from execupy.kernels.fast import quantized as Q
Q.pack(np.full((8, 32), 3, np.int8), np.ones((8, 1), np.float32), None, 32)  # one 4-bit weight, as at load
from execupy.kernels.fast import decode_jit as D, second_thread_jit as S
print(json.dumps({"pair layouts": sorted(str(sig[4].dtype) for sig in S.matvec_pair.signatures),
                  "attention": len(S.attention_halves.signatures), "norm": len(D.add_rms_norm_row.signatures),
                  "rope": len(D.rope_swapped_rows.signatures)}))
"""


@needs_numba
def test_loading_a_4bit_weight_warms_the_decode_steps_up_for_its_layout_only():
    """A program's first decode step does not read machine code from numba's cache (tens of ms
    inside the first generated tokens): packing at load ran the decode steps' kernels and the
    paired mat-vec of the layouts packed, and of no other layout."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    got = json.loads(subprocess.run([sys.executable, "-c", WARM_PROBE], env=env, capture_output=True, text=True,
                                    check=True, timeout=600).stdout)
    assert got == {"pair layouts": ["uint32"], "attention": 1, "norm": 1, "rope": 1}


def test_two_threads_slower_than_one_turn_threads_off_for_a_while():
    cores = SecondCore()
    rng = np.random.default_rng(9)
    w, _ = packed_grouped(rng, 512, 512, 32, 4, False)  # 128 KiB of 4-bit words
    assert cores.free(w)  # a weight's first call shares too, against a time assumed from its bytes
    cores.took(w, 1, 0.00003)  # 30 us on one thread, remembered
    assert w.serial_s == 0.00003 and cores.free(w)
    cores.took(w, 2, 0.00002)  # two threads faster than that: they stay
    assert cores.free(w)
    cores.took(w, 2, 1.0)  # a whole second: a thread waited for a core, or the machine paused
    assert cores.free(w)  # one slow call, however slow, happens on an idle machine too
    cores.last_stall -= 10 * cores.WINDOW_S  # long ago: forgotten
    for _ in range(4):
        cores.took(w, 2, 0.00002)
        cores.took(w, 2, 0.005)  # 5 ms stalls every other call: the other core is busy
        assert cores.free(w)  # not yet: under LOST_S (20 ms) lost so far
    cores.took(w, 2, 0.005)
    assert not cores.free(w)
    cores.serial_until = 0.0  # the back-off is over
    assert cores.free(w)


def test_stalls_a_few_times_a_second_keep_both_cores(monkeypatch):
    """A quiet virtual machine pauses a thread now and then; that costs less than one thread would."""
    from types import SimpleNamespace

    from execupy.kernels import cores as module

    cores, clock = SecondCore(), [100.0]
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    w, _ = packed_grouped(np.random.default_rng(9), 512, 512, 32, 4, False)
    cores.took(w, 1, 0.00003)
    for _ in range(20):  # an 8 ms stall every 150 ms
        clock[0] += 0.15
        cores.took(w, 2, 0.008)
        assert cores.free(w)


@needs_numba
def test_a_weights_first_decode_call_may_share_against_a_time_assumed_from_its_bytes(monkeypatch):
    """A decode step bound anew would otherwise run every weight alone once, to time it."""
    monkeypatch.setattr(Q, "SHARE_MIN_BYTES", 0)
    monkeypatch.setattr(cores_module, "SECOND_CORE", SecondCore())  # no back-off left by other tests
    w, _ = packed_grouped(np.random.default_rng(10), 256, 256, 32, 4, False)
    assumed = cores_module.assumed_serial_s(w.nbytes)
    assert w.serial_s == assumed > 0 and cores_module.SECOND_CORE.free(w)
    Q.NUMBA["qlinear"](np.ones((1, 256), np.float32), w)
    assert w.serial_s == assumed  # offered to the second core: no one-thread time taken


@needs_numba
def test_a_half_the_second_thread_claimed_but_never_finished_is_taken_back():
    """A second thread that lost its core after claiming its half (preempted for a scheduler
    tick, or forever here) holds the call only a few times the caller's own half: the caller
    takes the half back to run it itself, and the thread's late result is refused. (The claim
    is made in the caller's thread, between the post and the caller's own claim: a real second
    thread made it only when the scheduler let it, never on a busy machine.)"""
    import numba

    from execupy.kernels.fast import second_thread_jit as S

    @numba.njit
    def claimed_then_lost(ctrl, xbuf, x):
        seq = S.post_job(ctrl, xbuf, x, S.GROUPED, 0, x.shape[0], 1)
        start = S.cycles()
        S.compare_exchange(ctrl, S.CLAIM, seq * 2, seq * 2 + 1)  # the thread's claim; then it runs nowhere
        where = S.second_half_where(ctrl, seq, start)
        late_done = S.compare_exchange(ctrl, S.RESULT, seq * 4 + S.PENDING, seq * 4 + S.DONE)
        return seq, where, late_done

    ctrl, xbuf = S.control_block(), np.zeros(64, np.float32)
    for _ in range(3):  # job after job
        seq, where, late_done = claimed_then_lost(ctrl, xbuf, np.ones(16, np.float32))
        assert where == S.TAKEN and ctrl[S.RESULT] == seq * 4 + S.TAKEN_BACK and not late_done


@needs_numba
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_shares_mat_vecs_without_the_parents_thread():
    """A child forked after the second thread started has no such thread; its shared calls
    neither hang nor go wrong (the caller runs both halves, then starts a thread of its own)."""
    rng = np.random.default_rng(13)
    packed, _ = packed_grouped(rng, 1024, 512, 32, 4, False)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    expected = Q.NUMBA["qlinear"](x, packed, threads=2)  # the parent's thread is running now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, send the bytes, leave without running the parent's atexit
        try:
            got = np.concatenate([Q.NUMBA["qlinear"](x, packed, threads=2) for _ in range(3)])
            os.write(write, got.tobytes())
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    got = np.frombuffer(data, np.float32).reshape(3, -1)
    assert all(np.array_equal(row, expected[0]) for row in got)


@needs_numba
@pytest.mark.parametrize("start_pos, seqlen, heads, kv_heads, dim", [
    (0, 113, 9, 3, 64), (37, 40, 9, 3, 64),  # SmolLM2's prompt shapes, one 512-key block
    (0, 7, 6, 2, 24), (3, 5, 5, 5, 17), (480, 40, 4, 1, 8)])  # odd sizes; 520 keys: two blocks, numpy alone
def test_compiled_prompt_softmax_gives_the_numpy_paths_bits(monkeypatch, start_pos, seqlen, heads, kv_heads, dim):
    """A prompt's custom_sdpa in a process that has numba loaded makes the softmax between its two
    products in one compiled pass: bit for bit the numpy path's weights and output."""
    import numba  # noqa: F401  (loaded: the gate of the compiled path)

    from execupy.kernels.llm import kv_cache

    rng = np.random.default_rng(start_pos + seqlen)
    q = 3 * rng.standard_normal((1, seqlen, heads, dim), dtype=np.float32)
    k, v = (2 * rng.standard_normal((1, 700, kv_heads, dim), dtype=np.float32) for _ in range(2))
    assert kv_cache._compiled_softmax() is not None
    compiled = kv_cache.custom_sdpa(q, k, v, start_pos, None, 0.0, True, None, np.empty_like(q))
    monkeypatch.setattr(kv_cache, "_compiled_softmax", lambda: None)
    plain = kv_cache.custom_sdpa(q, k, v, start_pos, None, 0.0, True, None, np.empty_like(q))
    assert np.array_equal(compiled, plain)


@needs_numba
@pytest.mark.parametrize("start_pos, heads, kv_heads, dim", [
    (0, 9, 3, 64), (150, 9, 3, 64), (600, 9, 3, 64),  # SmolLM2's shapes; 601 keys: two 512-key blocks
    (10, 6, 2, 24), (5, 5, 5, 17), (3, 4, 1, 8)])  # odd head sizes, multi-head, one KV head
def test_compiled_decode_attention_equals_the_numpy_path(monkeypatch, start_pos, heads, kv_heads, dim):
    """A decode step's custom_sdpa in a process that has numba loaded (a quantized program's)
    runs kernels/fast/attention_jit.py: the numpy path's arithmetic, the products summed in
    another order."""
    import numba  # noqa: F401  (loaded: the gate of the compiled path)

    from execupy.kernels.llm import kv_cache

    rng = np.random.default_rng(start_pos + dim)
    q = rng.standard_normal((1, 1, heads, dim), dtype=np.float32)
    k, v = (2 * rng.standard_normal((1, 700, kv_heads, dim), dtype=np.float32) for _ in range(2))
    compiled = kv_cache.custom_sdpa(q, k, v, start_pos, None, 0.0, True, None, np.empty_like(q))
    monkeypatch.setenv("EXECUPY_NUMBA", "0")
    monkeypatch.setattr(kv_cache, "_COMPILED", [])
    assert kv_cache._compiled_decode() is None
    plain = kv_cache.custom_sdpa(q, k, v, start_pos, None, 0.0, True, None, np.empty_like(q))
    assert not np.array_equal(compiled, plain) or start_pos == 0  # two paths ran (one key: both exact)
    assert_within_float32_rounding(compiled, plain)
