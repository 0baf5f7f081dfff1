"""Depthwise 2-D convolution and int8 requantization: numpy (the reference) and numba (the `fast` extra).

A depthwise convolution (one input channel per output channel) is a few multiply-adds per
output pixel; numpy does it one kernel tap at a time over the whole tensor, each tap a pass
through memory with a temporary, which made it the largest cost of a MobileNet forward.
The compiled kernels add the taps in the same order as the numpy reference, first tap
stored and the others added, each product rounded then added (no fused multiply-add), so
the two agree bit for bit in float32 and float64, and exactly for integers.

Two layouts:

* `depthwise_nchw(xp, w, stride, dilation, out)`: the portable `aten::convolution` layout;
  `xp` (N, C, H, W) already padded, `w` (C, KH, KW).
* `depthwise_nhwc(x, w, stride, dilation, pads, x_zero, out, bias=None, lo=-inf, hi=inf)`:
  XNNPACK's layout, `x` (N, H, W, C), `w` (KH, KW, C), pads (top, bottom, left, right) read
  as zeros without copying the input (a padded pixel still contributes `0 * w`, as the
  padded copy would, so NaN and -0.0 come out the same). For int8 data `w` holds the
  filter with its zero point already taken off and `x_zero` is taken off each input, in
  int32 or in a float type that holds every sum exactly (XNNPACK's node picks float32 where
  that holds: faster than int32 products), so the sum is XNNPACK's int32 one. A float
  convolution may end with XNNPACK's epilogue: + bias, then clamped to [lo, hi] (NaN stays
  NaN), each output row while it is still in cache.
  A 3x3 layer of 16 channels or more summed in float32 (float data, or int8 data) runs 16
  channels a vector (`nhwc_3x3_vectors`: the nine filter vectors in registers along an output
  row, the epilogue in registers, a padded tap read as the padded value; int8 data's exact
  sums with fmas, the same values). Other layers: each (output row, tap) as one loop over the
  row against the tap's weights tiled across it (a strided conv first splits the input's
  columns by phase so that those loops read contiguous runs), or, 3x3 of 32 channels or more
  for float data with a zero point or float64 sums, pixel by pixel (`nhwc_3x3`); the same
  operations in the same order.

`bias_clamp(y, bias, lo, hi)` is that epilogue alone, in place on a matmul's (..., C) result
(`bias_clamp_kernel(bias, lo, hi)` the same with its constants bound once).
`gemm_kernel(w, bias, lo, hi, requantized=None)` is a 1x1 or im2col convolution's product with
that epilogue: rows [M, K] (float32, or int8 data) -> clamp(rows @ w + bias) [M, N] in float32,
or with `requantized` = (scale, zero_point, storage dtype) the int8 convolution's output:
requantize(rows @ w, bias, scale, zero_point, lo, hi), every sum of rows @ w an integer float32
holds (the caller's check). numpy's is BLAS's matmul then the epilogue; the compiled one
(gemm_jit) sums a tile of outputs in registers and finishes it there, one pass: the two agree
within float32 rounding, and bit for bit for the int8 convolution (exact sums, the same
requantization steps). Where the CPU has VNNI, a requantized product of int8 or uint8 rows (K a
multiple of 4, weights in int8's range) sums in int32 instead (gemm_jit.int8_block: four byte
products an instruction, no float32 copy of the rows), the same sums and so the same bytes.
`windows_kernel(w, bias, lo, hi, requantized=None)` is the same product for a convolution's
windows read in place (an implicit im2col): (x, bases, offsets) -> rows r of
x.flat[bases[r] + offsets[k]] times w, x float32 C-ordered (the padded input), bases and offsets
int64 element offsets.
`int8_windows_kernel(w, bias, lo, hi, requantized, x_zero)` is the requantized product of int8 or
uint8 windows read in place four bytes at a time: row r's inputs 4k..4k + 3 are the bytes at
x.flat[bases[r] + offsets[k]], minus x_zero (a padded input's border holds x_zero). The compiled
one is the VNNI tiles', None where they do not run (the caller keeps the float path).
`batch_product_kernel(transpose_b)` is a batch of such products with no epilogue (an encoder's
attention: queries @ keys.T, then probabilities @ values): (a [H, M, K], b [H, K, N], or
[H, N, K] with transpose_b) -> a[h] @ b[h] (or @ b[h].T) [H, M, N], float32 C-ordered. numpy's
is np.matmul; the compiled one lays each B out as the tiles' panels at every call (an operand
computed by the call before) and shares the whole batch between the two cores as one job.
`pad_into(x, x_zero, top, left, xp)` writes x - x_zero inside a zero border already in xp:
numpy's copy from a transposed NCHW input (a CNN's first layer) runs ~5x slower.

`requantize(acc, bias, scale, zero_point, lo, hi, out)` turns such integer sums (int32, or
float holding exact integers) plus a per-channel bias into int8 with XNNPACK's fp32
requantization (execupy/backends/xnnpack/quant.py: requantize) in one pass. acc + bias is
added in numpy's result type: float64 for a float64 bias or int32 sums (exact for every
int32 sum, then rounded to float32), float32 for float32 sums and bias (one correctly rounded
add: the same float32, ~2x faster; the caller passes a float32 bias only where it holds the
bias exactly).

The tiles and the 3x3 vector kernel share a call's rows with the second core's spinning thread
(second_thread.py; chunks taken from the two ends, conv_shared_jit) while kernels/cores.py's
rule says that core is free: a thread pool woken per call, or a busy core, would cost a
scheduler slice (milliseconds) on layers of tens of microseconds. An int8 3x3 depthwise layer
writes its requantized output from those registers (`depthwise_nhwc_kernel(requantized=...)`).

`BACKEND` is "numba" when numba imports and EXECUPY_NUMBA is not 0, else "numpy"; both stay
callable as `NUMPY[...]` / `NUMBA[...]` so a test can compare them on the same inputs.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .. import cores
from .elementwise import numba_enabled

# ---------------------------------------------------------------------------- numpy reference


def _taps(shape: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int], out_hw: tuple[int, int]):
    """(kh, kw, rows slice, columns slice) of each kernel tap over a padded input, in tap order."""
    (sh, sw), (dh, dw), (oh, ow) = stride, dilation, out_hw
    for kh, kw in np.ndindex(*shape):
        yield kh, kw, slice(kh * dh, kh * dh + (oh - 1) * sh + 1, sh), slice(kw * dw, kw * dw + (ow - 1) * sw + 1, sw)


def _depthwise_nchw_numpy(xp: np.ndarray, w: np.ndarray, stride: tuple[int, int], dilation: tuple[int, int],
                          out: np.ndarray) -> np.ndarray:
    for kh, kw, rows, cols in _taps(w.shape[1:], stride, dilation, out.shape[2:]):
        term = xp[:, :, rows, cols] * w[:, kh, kw][:, None, None]
        if kh == kw == 0:
            out[...] = term
        else:
            out += term
    return out


def _depthwise_nhwc_numpy(x: np.ndarray, w: np.ndarray, stride: tuple[int, int], dilation: tuple[int, int],
                          pads: tuple[int, int, int, int], x_zero: int, out: np.ndarray, bias: Optional[np.ndarray] = None,
                          lo: float = -np.inf, hi: float = np.inf) -> np.ndarray:
    top, bottom, left, right = pads
    shifted = x.astype(out.dtype) - out.dtype.type(x_zero) if x_zero else x.astype(out.dtype, copy=False)
    xp = np.pad(shifted, ((0, 0), (top, bottom), (left, right), (0, 0)))
    for kh, kw, rows, cols in _taps(w.shape[:2], stride, dilation, out.shape[1:3]):
        term = xp[:, rows, cols] * w[kh, kw]
        if kh == kw == 0:
            out[...] = term
        else:
            out += term
    return _bias_clamp_numpy(out, bias, lo, hi)


def _bias_clamp_numpy(y: np.ndarray, bias: Optional[np.ndarray], lo: float, hi: float) -> np.ndarray:
    """y (..., C) in place: + bias (C,) if given, then clamped to [lo, hi] unless unbounded."""
    if bias is not None:
        y += bias
    if lo != -np.inf or hi != np.inf:
        np.clip(y, y.dtype.type(lo), y.dtype.type(hi), out=y)
    return y


def _bias_clamp_kernel_numpy(bias: Optional[np.ndarray], lo: float, hi: float) -> Callable[[np.ndarray], np.ndarray]:
    """bias_clamp with the bias and bounds fixed: y -> y."""
    return lambda y: _bias_clamp_numpy(y, bias, lo, hi)


def _gemm_kernel_numpy(w: np.ndarray, bias: Optional[np.ndarray], lo: float, hi: float,
                       requantized: Optional[tuple] = None) -> Callable[[np.ndarray], np.ndarray]:
    """gemm_kernel: rows [M, K] -> clamp(rows @ w + bias, lo, hi), w [K, N] float32 (or requantized)."""
    if requantized is None:
        return lambda rows: _bias_clamp_numpy(np.matmul(rows.astype(w.dtype, copy=False), w), bias, lo, hi)
    scale, zero_point, storage = requantized

    def product(rows: np.ndarray) -> np.ndarray:
        acc = np.matmul(rows.astype(w.dtype, copy=False), w)
        return _requantize_numpy(acc, bias, scale, zero_point, lo, hi, np.empty(acc.shape, storage))

    return product


def _windows_kernel_numpy(w: np.ndarray, bias: Optional[np.ndarray], lo: float, hi: float,
                          requantized: Optional[tuple] = None) -> Callable[..., np.ndarray]:
    """windows_kernel: (x, bases, offsets) -> the gemm_kernel product of the gathered windows."""
    product = _gemm_kernel_numpy(w, bias, lo, hi, requantized)
    return lambda x, bases, offsets: product(x.reshape(-1)[bases[:, None] + offsets[None, :]])


def _int8_windows_kernel_numpy(w: np.ndarray, bias: Optional[np.ndarray], lo: float, hi: float, requantized: tuple,
                               x_zero: int) -> Callable[..., np.ndarray]:
    """int8_windows_kernel: (x, bases, offsets) -> the requantized gemm_kernel product of rows whose
    inputs 4k..4k + 3 are the bytes at x.flat[bases[r] + offsets[k]], each minus x_zero."""
    product = _gemm_kernel_numpy(w, bias, lo, hi, requantized)

    def windows(x: np.ndarray, bases: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        inputs = (offsets[:, None] + np.arange(4)).reshape(-1)
        return product(x.reshape(-1)[bases[:, None] + inputs[None, :]].astype(w.dtype) - w.dtype.type(x_zero))

    return windows


def _pad_into_numpy(x: np.ndarray, x_zero: int, top: int, left: int, xp: np.ndarray) -> np.ndarray:
    """xp[:, top:top + H, left:left + W] = x - x_zero, in xp's dtype (the rest of xp is left as it is)."""
    inner = xp[:, top:top + x.shape[1], left:left + x.shape[2]]
    if x_zero:
        np.subtract(x, xp.dtype.type(x_zero), out=inner, casting="unsafe")
    else:
        inner[...] = x
    return xp


def _requantize_numpy(acc: np.ndarray, bias: np.ndarray, scale: np.ndarray, zero_point: int, lo: float, hi: float,
                      out: np.ndarray) -> np.ndarray:
    y = (acc + bias).astype(np.float32)  # exact integers (see the module's docstring)
    y = np.rint(y * scale) + np.float32(zero_point)
    out[...] = np.clip(y, np.float32(lo), np.float32(hi))
    return out


def _depthwise_nhwc_kernel_numpy(w: np.ndarray, stride: tuple[int, int], dilation: tuple[int, int],
                                 pads: tuple[int, int, int, int], x_zero: int, bias: Optional[np.ndarray] = None,
                                 lo: float = -np.inf, hi: float = np.inf, requantized: Optional[tuple] = None
                                 ) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """depthwise_nhwc with everything but the input and output fixed: (x, out) -> out. With
    `requantized` = (scale, zero_point, storage dtype), int8 data: out (storage) = requantize(the
    sums in w's type, bias, scale, zero_point, lo, hi)."""
    if requantized is None:
        return lambda x, out: _depthwise_nhwc_numpy(x, w, stride, dilation, pads, x_zero, out, bias, lo, hi)
    scale, zero_point, _ = requantized

    def depthwise_requantized(x: np.ndarray, out: np.ndarray) -> np.ndarray:
        acc = _depthwise_nhwc_numpy(x, w, stride, dilation, pads, x_zero, np.empty(out.shape, w.dtype))
        return _requantize_numpy(acc, bias, scale, zero_point, lo, hi, out)

    return depthwise_requantized


def _batch_product_kernel_numpy(transpose_b: bool) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    return lambda a, b: np.matmul(a, np.swapaxes(b, -1, -2) if transpose_b else b)


NUMPY: dict[str, Callable] = {"depthwise_nchw": _depthwise_nchw_numpy, "depthwise_nhwc": _depthwise_nhwc_numpy,
                              "depthwise_nhwc_kernel": _depthwise_nhwc_kernel_numpy, "bias_clamp": _bias_clamp_numpy,
                              "bias_clamp_kernel": _bias_clamp_kernel_numpy, "gemm_kernel": _gemm_kernel_numpy,
                              "windows_kernel": _windows_kernel_numpy, "pad_into": _pad_into_numpy,
                              "requantize": _requantize_numpy, "batch_product_kernel": _batch_product_kernel_numpy,
                              "int8_windows_kernel": _int8_windows_kernel_numpy}

# ---------------------------------------------------------------------------- numba

# From this many channels a 3x3 depthwise layer that nhwc_3x3_vectors does not take runs pixel by
# pixel (conv_jit.nhwc_3x3): 1.4-2.2x faster than tap by tap for 48-192 channels (a strided one
# also skips the column split), 3x slower for 16. nhwc_3x3_vectors was 1.4-4x faster again (16-288
# channels; 80x80x16 138 -> 33 us).
PIXELWISE_MIN_CHANNELS = 32
_VECTOR_INPUTS = (np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.uint8))  # what nhwc_3x3_vectors reads
_VNNI_INPUTS = (np.dtype(np.int8), np.dtype(np.uint8))  # what gemm_jit.int8_block reads


def _vector_sums_exact(w: np.ndarray, dtype: np.dtype, x_zero: float) -> bool:
    """Whether nhwc_3x3_vectors' float32 sums of int8 data are exact integers: they run from
    -x_zero * the taps' sum through the products x * w, bounded by (|x_zero| + max |x|) * sum |w|."""
    info = np.iinfo(dtype)
    x_max = abs(float(x_zero)) + max(abs(info.min), abs(info.max))
    return float(np.abs(np.asarray(w, np.float64)).sum(axis=(0, 1)).max(initial=0.0)) * x_max < 2.0 ** 24


def _compile() -> Optional[dict[str, Callable]]:
    from . import conv_jit as K

    shared: list = []  # [conv_shared_jit, the second core's thread] once imported

    def both_cores():
        """conv_shared_jit and the second core's thread, imported at the first conv kernel built
        (~0.1-0.2 s that a program without one does not pay at import)."""
        if not shared:
            from . import conv_shared_jit
            from .second_thread import SECOND_THREAD

            shared.extend((conv_shared_jit, SECOND_THREAD))
        return shared

    def requantize(acc, bias, scale, zero_point, lo, hi, out):
        channels = acc.shape[-1]
        f32 = np.float32
        K.requantize_rows(np.ascontiguousarray(acc).reshape(-1, channels), bias, scale, f32(zero_point), f32(lo), f32(hi),
                          out.reshape(-1, channels))
        return out

    def depthwise_nchw(xp, w, stride, dilation, out):
        K.nchw(xp, w, *stride, *dilation, out)
        return out

    def depthwise_nhwc_kernel(w, stride, dilation, pads, x_zero, bias=None, lo=-np.inf, hi=np.inf, requantized=None):
        if requantized is not None:
            return _depthwise_requantized(w, stride, dilation, pads, x_zero, bias, lo, hi, requantized)
        sh, sw = stride
        clamp = lo != -np.inf or hi != np.inf
        rows: dict = {}  # (output width, dtype) -> (weights, bias) tiled across an output row
        pixelwise = w.shape[:2] == (3, 3)  # wide 3x3 layers into float sums: nhwc_3x3, pixel by pixel
        typed: dict = {}  # dtype -> (w, bias) in it (an empty bias: none)

        def pixelwise_args(dtype) -> tuple[np.ndarray, np.ndarray]:
            if dtype not in typed:
                typed[dtype] = (np.ascontiguousarray(w, dtype),
                                np.empty(0, dtype) if bias is None else np.asarray(bias, dtype))
            return typed[dtype]

        def tiled_rows(ow: int, dtype) -> tuple[np.ndarray, np.ndarray]:
            if (ow, dtype) not in rows:
                no_bias = np.empty(0, dtype)
                rows[ow, dtype] = (np.ascontiguousarray(np.tile(w.astype(dtype), (1, 1, ow))),
                                   no_bias if bias is None else np.tile(np.asarray(bias, dtype), ow))
            return rows[ow, dtype]

        vectors = _vectors_3x3(w, stride, dilation, pads, x_zero, bias, lo, hi) if pixelwise else None

        def depthwise(x, out):
            kind = out.dtype.type  # the zero point and the padding's zero in the accumulator's type
            n, h, width, c = x.shape
            if vectors is not None and vectors(x, out):
                return out
            if pixelwise and c >= PIXELWISE_MIN_CHANNELS and out.dtype.kind == "f" and (
                    x.dtype == out.dtype or x.dtype.kind in "iu"):
                w_typed, bias_typed = pixelwise_args(out.dtype)
                shift = bool(x_zero) or x.dtype != out.dtype  # x - x_zero in the accumulator's type (int8 data)
                K.nhwc_3x3(np.ascontiguousarray(x), np.full(c, x_zero, x.dtype), kind(x_zero), shift,
                           w_typed, bias_typed, clamp, sh, sw, *dilation, pads[0], pads[2], kind(lo), kind(hi), out)
                return out
            if sw == 1 and x.dtype == out.dtype and not x_zero and x.flags.c_contiguous:
                xs = x.reshape(n, h, 1, width * c)
            else:
                xs = np.empty((n, h, sw, -(-width // sw) * c), out.dtype)
                K.split_columns(x, sw, kind(x_zero), xs)
            tiled, bias_row = tiled_rows(out.shape[2], out.dtype)
            bounds = (kind(lo), kind(hi)) if out.dtype.kind == "f" else (kind(0), kind(0))  # integer sums: no epilogue
            K.nhwc(xs, tiled, bias_row, clamp, width, sh, sw, *dilation, pads[0], pads[2], kind(0), *bounds, out)
            return out

        return depthwise

    def _vectors_3x3(w, stride, dilation, pads, x_zero, bias, lo, hi, requantized=None):
        """A 3x3 layer's call of nhwc_3x3_vectors (conv_shared_jit.nhwc_3x3_shared): (x, out) -> whether
        it applied: float32 sums (float data without a zero point, or int8 data) of 16 channels or
        more into a float32 out, or with `requantized` into the int8 storage, requantized there."""
        call_args: dict = {}  # (x's dtype, out's dtype) -> the call's arguments but x and out, made once
        site = cores.CallSite()  # this layer's one-thread time, for the second-core rule
        f32 = np.float32

        def vectors(x, out) -> bool:
            c = x.shape[3]
            if not (c >= K.LANES and x.dtype in _VECTOR_INPUTS and w.dtype == np.float32
                    and not (x_zero and x.dtype == np.float32)):  # float data with a zero point: nhwc_3x3
                return False
            S, thread = both_cores()
            key = (x.dtype, out.dtype)
            if key not in call_args:
                if key not in S.KINDS or (requantized is None) != (out.dtype == np.float32):
                    return False
                if x.dtype.kind in "iu" and not _vector_sums_exact(w, x.dtype, x_zero):
                    return False
                no_bias = np.full(c, -0.0, np.float32)  # x + -0.0 is x: the same bits as no bias
                scale, zero = (np.empty(0, f32), f32(0)) if requantized is None else (
                    np.ascontiguousarray(np.broadcast_to(requantized[0], (c,)), f32), f32(requantized[1]))
                kind = S.KINDS[key]
                call_args[key] = (
                    (S.NHWC_3X3_CHUNKS[kind].address, thread.job, kind),
                    (np.full(c, x_zero, x.dtype), f32(x_zero), np.ascontiguousarray(w, np.float32),
                     no_bias if bias is None else np.ascontiguousarray(bias, np.float32), scale, zero, f32(lo),
                     f32(hi), *stride, *dilation, pads[0], pads[2]))
            head, tail = call_args[key]
            thread.run(S.nhwc_3x3_shared, (*head, np.ascontiguousarray(x), *tail, out), site)
            return True

        return vectors

    def _depthwise_requantized(w, stride, dilation, pads, x_zero, bias, lo, hi, requantized):
        """depthwise_nhwc_kernel with `requantized`: a 3x3 layer of int8 data with a float32 bias
        requantized in nhwc_3x3_vectors' registers, others summed and then requantized in a pass."""
        scale, zero_point, _ = requantized
        sums = depthwise_nhwc_kernel(w, stride, dilation, pads, x_zero)
        fused = w.shape[:2] == (3, 3) and bias is not None and bias.dtype == np.float32
        vectors = _vectors_3x3(w, stride, dilation, pads, x_zero, bias, lo, hi, requantized) if fused else None

        def depthwise_requantized(x, out):
            if vectors is not None and x.dtype.kind in "iu" and vectors(x, out):
                return out
            return requantize(sums(x, np.empty(out.shape, w.dtype)), bias, scale, zero_point, lo, hi, out)

        return depthwise_requantized

    def depthwise_nhwc(x, w, stride, dilation, pads, x_zero, out, bias=None, lo=-np.inf, hi=np.inf):
        return depthwise_nhwc_kernel(w, stride, dilation, pads, x_zero, bias, lo, hi)(x, out)

    def bias_clamp_kernel(bias, lo, hi):
        tiles: dict = {}  # dtype -> the bias tiled over at least 1024 values
        clamp = lo != -np.inf or hi != np.inf

        def bias_clamp(y):
            if not y.flags.c_contiguous:  # in place: a flat view is needed
                return _bias_clamp_numpy(y, bias, lo, hi)
            if y.dtype not in tiles:
                tiles[y.dtype] = np.empty(0, y.dtype) if bias is None else np.tile(
                    np.asarray(bias, y.dtype), -(-1024 // bias.shape[0]))
            kind = y.dtype.type
            K.bias_clamp_flat(y.reshape(-1), tiles[y.dtype], clamp, kind(lo), kind(hi))
            return y

        return bias_clamp

    def bias_clamp(y, bias, lo, hi):
        return bias_clamp_kernel(bias, lo, hi)(y)

    def _tiles(w, bias, lo, hi, requantized):
        """windows_product's arguments after x, bases and offsets, and out's dtype; None where
        the tiles do not apply."""
        from . import gemm_jit as G

        if not G.FMA or w.dtype != np.float32 or (bias is not None and bias.dtype != np.float32):
            return None  # float64 sums (int8 data float32 cannot sum exactly), or a float64 bias
        n = w.shape[1]
        w_panels = G.panels(w)

        def padded(v):
            return np.pad(np.asarray(v, np.float32), (0, w_panels.shape[0] * G.LANES - n))

        bias_p, f32 = padded(np.zeros(n) if bias is None else bias), np.float32
        if requantized is None:
            return (w_panels, bias_p, bias_p, f32(0), f32(lo), f32(hi), False), np.float32
        scale, zero_point, storage = requantized
        scale_p = padded(np.broadcast_to(scale, (n,)))
        return (w_panels, bias_p, scale_p, f32(zero_point), f32(lo), f32(hi), True), storage

    def _blas(w, bias, lo, hi, requantized):
        def product(rows):  # BLAS's product, the epilogue compiled
            acc = np.matmul(rows.astype(w.dtype, copy=False), w)
            if requantized is None:
                return bias_clamp(acc, bias, lo, hi)
            scale, zero_point, storage = requantized
            return requantize(acc, bias, scale, zero_point, lo, hi, np.empty(acc.shape, storage))

        return product

    def _windows(tiles, n):
        """The tiles' product of gathered rows into a new [M, n] output (windows_kernel's call)."""
        S, thread = both_cores()
        args, storage = tiles
        site = cores.CallSite()  # this conv's one-thread time, for the second-core rule

        def windows(x, bases, offsets):
            out = np.empty((bases.shape[0], n), storage)
            thread.run(S.windows_shared, (S.WINDOWS_CHUNKS.address, thread.job, x.reshape(-1), bases, offsets, *args,
                                          out.view(np.int8) if args[-1] else out, 1),
                       site)
            return out

        return windows

    def windows_kernel(w, bias, lo, hi, requantized=None):
        tiles = _tiles(w, bias, lo, hi, requantized)
        if tiles is None:
            product = _blas(w, bias, lo, hi, requantized)
            return lambda x, bases, offsets: product(x.reshape(-1)[bases[:, None] + offsets[None, :]])
        return _windows(tiles, w.shape[1])

    def _int8_windows(tiles, w, x_zero):
        """An int8 convolution's requantized product on VNNI (gemm_jit.int8_block): (x, bases,
        offsets) -> out, row r's inputs 4k..4k + 3 the four bytes at x.flat[bases[r] + offsets[k]]
        (int8 or uint8 data), each minus x_zero; None where it does not apply (no VNNI, K not a
        multiple of 4, weights outside int8). `tiles`: _tiles' float32 arguments, whose bias,
        scale and bounds it shares."""
        from . import gemm_jit as G
        from .vnni_jit import VNNI

        (_, bias_p, scale_p, zero, lo, hi, requantize), storage = tiles
        k, n = w.shape
        if not (VNNI and requantize and k % 4 == 0 and np.all((w >= -128) & (w <= 127))):
            return None
        S, thread = both_cores()
        w8 = w.astype(np.int8)
        panels = G.int8_panels(w8)
        # int8 data is read as x + 128 (bytes xor 0x80): the sums start at -(128 + x_zero) * each
        # column's weight sum (uint8 data: -x_zero * it), and end as the exact sum of (x - x_zero) * w
        wsum = np.zeros(bias_p.shape[0], np.int64)
        wsum[:n] = w8.sum(axis=0, dtype=np.int64)
        starts = {np.dtype(np.int8): (((-128 - x_zero) * wsum).astype(np.int32), np.int32(-0x7F7F7F80)),
                  np.dtype(np.uint8): ((-x_zero * wsum).astype(np.int32), np.int32(0))}
        site = cores.CallSite()  # this conv's one-thread time, for the second-core rule

        def windows(x, bases, offsets):
            init, flip = starts[x.dtype]
            out = np.empty((bases.shape[0], n), storage)
            thread.run(S.int8_shared, (S.INT8_CHUNKS.address, thread.job, x.reshape(-1).view(np.int8), bases, offsets,
                                       panels, init, bias_p, scale_p, zero, lo, hi, flip, out.view(np.int8)), site)
            return out

        return windows

    def int8_windows_kernel(w, bias, lo, hi, requantized, x_zero):
        tiles = _tiles(w, bias, lo, hi, requantized)
        return None if tiles is None else _int8_windows(tiles, w, x_zero)

    def gemm_kernel(w, bias, lo, hi, requantized=None):
        from . import gemm_jit as G

        blas, tiles = _blas(w, bias, lo, hi, requantized), _tiles(w, bias, lo, hi, requantized)
        if tiles is None:
            return blas
        windows, int8 = _windows(tiles, w.shape[1]), _int8_windows(tiles, w, 0)
        k = w.shape[0]
        offsets, quads, bases_of = np.arange(k, dtype=np.int64), np.arange(0, k, 4, dtype=np.int64), {}

        def product(rows):
            m = rows.shape[0]
            if m not in bases_of:  # each row's start
                bases_of[m] = np.arange(0, m * k, k, dtype=np.int64)
            if int8 is not None and rows.dtype in _VNNI_INPUTS:
                return int8(np.ascontiguousarray(rows), bases_of[m], quads)
            if m < G.TILE_ROWS:  # a mat-vec: BLAS's reads w as fast
                return blas(rows)
            # int8 data as float32 first: one vectorised pass, where converting in the tiles cost
            # three instructions a row and input
            return windows(np.ascontiguousarray(rows, np.float32), bases_of[m], offsets)

        return product

    def batch_product_kernel(transpose_b):
        from . import gemm_jit as G

        if not G.FMA:
            return _batch_product_kernel_numpy(transpose_b)
        S, thread = both_cores()
        site, f32 = cores.CallSite(), np.float32
        layout = {}  # (H, M, K, N) -> the panels' buffer, bases, offsets, zero bias: the last shape's

        def product(a, b):
            h, m, k = a.shape
            n = b.shape[1] if transpose_b else b.shape[2]
            key = (h, m, k, n)
            if key not in layout:
                p = -(-n // G.LANES)
                layout.clear()
                layout[key] = (np.empty((h * p, k, G.LANES), f32), np.arange(0, m * k, k, dtype=np.int64),
                               np.arange(k, dtype=np.int64), np.zeros(p * G.LANES, f32))
            w, bases, offsets, zeros = layout[key]
            G.batch_panels(b, transpose_b, w)
            out = np.empty((h, m, n), f32)
            thread.run(S.windows_shared, (S.WINDOWS_CHUNKS.address, thread.job, a.reshape(-1), bases, offsets, w, zeros,
                                          zeros, f32(0), f32(-np.inf), f32(np.inf), False, out.reshape(h * m, n), h),
                       site)
            return out

        return product

    def pad_into(x, x_zero, top, left, xp):
        s = x.strides
        K.pad_into(x, xp.dtype.type(x_zero), top, left, abs(s[3]) > abs(s[2]), xp)
        return xp

    return {"depthwise_nchw": depthwise_nchw, "depthwise_nhwc": depthwise_nhwc,
            "depthwise_nhwc_kernel": depthwise_nhwc_kernel, "bias_clamp": bias_clamp,
            "bias_clamp_kernel": bias_clamp_kernel, "gemm_kernel": gemm_kernel, "windows_kernel": windows_kernel,
            "pad_into": pad_into, "requantize": requantize, "batch_product_kernel": batch_product_kernel,
            "int8_windows_kernel": int8_windows_kernel}


NUMBA: Optional[dict[str, Callable]] = _compile() if numba_enabled() else None
BACKEND = "numba" if NUMBA is not None else "numpy"
(depthwise_nchw, depthwise_nhwc, depthwise_nhwc_kernel, bias_clamp, bias_clamp_kernel, gemm_kernel, windows_kernel,
 pad_into, requantize, batch_product_kernel, int8_windows_kernel) = ((NUMBA or NUMPY)[name] for name in NUMPY)
