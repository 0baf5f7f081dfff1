"""The node-type table: for each XNNPACK node kind, a builder that turns the node into a step.

A builder runs once at init (`build(node, graph) -> step`) and does the work that does not
depend on the inputs (filter re-layout, requantization scales, clamp bounds); the step it
returns runs per call as `step(vals)`, reading and writing the value list.

Most nodes are computed in the float domain: inputs are dequantized (an identity for fp32;
fp16 is widened to fp32), the op runs in fp32, the fused clamp is applied and the result is
stored in the output's datatype (rounded to fp16, or quantized). XNNPACK's int8 kernels for
add/multiply/pooling work in fixed point instead; the two agree to within one quantization
step (they can differ where a value falls on a rounding tie). fp16 nodes are computed in
fp32 and rounded once to fp16, where XNNPACK's f16 kernels may round (and accumulate
matrix products) in fp16. FullyConnected and convolutions on quantized data accumulate in
integers exactly as XNNPACK does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ...errors import InvalidInputError, MalformedProgramError, UnsupportedOperatorError
from ...kernels.cores import CallSite, assumed_serial_s
from ...kernels.fast import dense
from ...kernels.fast import conv as FC
from ...kernels.fast import xnnpack_gemm as XG
from ...kernels.portable.conv import conv_output_size, convolution
from ...kernels.portable.pool import avg_pool2d, max_pool2d_with_indices
from ...kernels.registry import get_kernel
from ...runtime import blas_threads
from . import quant as Q
from . import vmath
from .schema import NO_VALUE, Node

F32 = np.float32
Step = Callable[[list], None]
TRANSPOSE_WEIGHTS = 0x1  # FullyConnected: filter is [in, out]; BatchMatrixMultiply: B is transposed
ALIGN_CORNERS = 0x8
TENSORFLOW_LEGACY_MODE = 0x4
# Static sizes a node may produce; a hostile graph must not make us allocate without bound.
MAX_STATIC_ELEMENTS = 1 << 28
TILED_MIN_ROWS = 6  # rows from which an fp32 product runs on the conv GEMM's tiles (gemm_jit.TILE_ROWS)


@dataclass
class FixedBinding:
    """A step that can also run on arrays fixed for every call (a bound delegate's inputs, the
    arrays its outputs go to, and what earlier such steps wrote): `bind(xs, ys)` gives a call
    without arguments (returning None) that reads the values `reads` from the arrays xs and writes
    the values `writes` into the arrays ys, or None where it cannot. With `makes_arrays`, a y may be None (a
    value only the delegate's own steps read): the binding puts the array it made in its place."""

    reads: tuple[int, ...]
    writes: tuple[int, ...]
    bind: Callable[[list[np.ndarray], list[Optional[np.ndarray]]], Optional[Callable[[], None]]]
    makes_arrays: bool = False


def reads(node: Node) -> list[int]:
    """The value ids a node reads (a value read twice appears twice)."""
    return [v for name, v in node.fields.items()
            if name.endswith("_id") and not name.startswith("output") and v != NO_VALUE]


def NOTHING(vals: list) -> None:
    """The step of a node whose work another node's step does (a bound delegate leaves it out)."""


def _present(g, value_id: int) -> bool:
    """Whether an optional value id (a bias) names a value of the graph."""
    return value_id != NO_VALUE and value_id < len(g.values)

def _kernel(name: str) -> Callable[[np.ndarray], np.ndarray]:
    fn = get_kernel(f"aten::{name}.out")
    return lambda x: fn(x, out=np.empty_like(x))


# ---------------------------------------------------------------- float-domain nodes


def _unary(fn: Callable[[np.ndarray], np.ndarray]):
    def build(node: Node, g) -> Step:
        src, out = node.fields["input_id"], node.fields["output_id"]
        if g.plain(node, src, out):
            def plain_step(vals: list) -> None:
                vals[out] = fn(vals[src])

            plain_step.bind_fixed = FixedBinding((src,), (out,), lambda xs, ys: _unary_into(fn, xs[0], ys),
                                                 makes_arrays=True)
            return plain_step
        load, store = g.loader(src), g.storer(out, node)

        def step(vals: list) -> None:
            vals[out] = store(fn(load(vals)))

        return step

    return build


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray], op: Optional[int] = None):
    """A two-input element-wise node; `op` names it to Q.binary_quantized (quant_jit's code)."""
    def build(node: Node, g) -> Step:
        f = node.fields
        x, y, out = f["input1_id"], f["input2_id"], f["output_id"]
        if g.plain(node, x, y, out):
            def plain_step(vals: list) -> None:
                vals[out] = fn(vals[x], vals[y])

            plain_step.bind_fixed = FixedBinding((x, y), (out,), lambda xs, ys: _binary_into(fn, *xs, ys),
                                                 makes_arrays=True)
            return plain_step
        a, b, store = g.loader(x), g.loader(y), g.storer(out, node)

        def step(vals: list) -> None:
            vals[out] = store(fn(a(vals), b(vals)))

        eight_bit = ("qint8", "quint8")
        if op is None or not all(g.values[i].datatype in eight_bit for i in (x, y, out)):
            return step
        # 8-bit in and out (an int8 CNN's residual adds): the same steps in one compiled pass
        # where the two inputs have one shape, else the loaders' and storer's passes
        ends = [(g.values[i].quant.zero_point, g.values[i].quant.scale[0]) for i in (x, y)]
        quantized_binary = Q.binary_quantized(op, *ends, node.output_min, node.output_max, g.values[out])
        if quantized_binary is None:  # numpy only
            return step

        def step_quantized(vals: list) -> None:
            r = quantized_binary(vals[x], vals[y])
            if r is None:
                step(vals)
            else:
                vals[out] = r

        return step_quantized

    return build


def fixed_output(ys: list, shape: tuple) -> Optional[np.ndarray]:
    """The float32 array of `shape` a bound step writes: ys[0] when given (None if it
    does not fit), else one made now and put in ys[0] (see FixedBinding)."""
    if ys[0] is None:
        ys[0] = np.empty(shape, F32)
    y = ys[0]
    return y if y.shape == shape and y.dtype == F32 else None


def _unary_into(fn: Callable, x: np.ndarray, ys: list) -> Optional[Callable[[], None]]:
    """A plain unary node's step on fixed arrays: a numpy ufunc with `out`, or vmath's compiled
    loop (the same bits as fn(x) returns); None for other functions."""
    fn = vmath.gelu if fn is _gelu else fn  # (what _gelu runs on float32)
    y = fixed_output(ys, x.shape) if x.dtype == F32 else None
    if y is None:
        return None
    if not isinstance(fn, np.ufunc):
        return vmath.compiled_into(fn, x, y)

    def ufunc_into() -> None:  # (not the ufunc's own return value: a bound call returns None)
        fn(x, out=y)

    return ufunc_into


def _binary_into(fn: Callable, a: np.ndarray, b: np.ndarray, ys: list) -> Optional[Callable[[], None]]:
    """A plain binary node's step on fixed arrays when fn is a numpy ufunc: fn(a, b, out=y), the
    bits fn(a, b) gives."""
    if not isinstance(fn, np.ufunc) or a.dtype != F32 or b.dtype != F32:
        return None
    try:
        shape = np.broadcast_shapes(a.shape, b.shape)
    except ValueError:  # the step says what is wrong
        return None
    y = fixed_output(ys, shape)
    if y is None:
        return None

    def ufunc_into() -> None:
        fn(a, b, out=y)

    return ufunc_into


def _with_fields(make: Callable[[Node, object], Callable[[np.ndarray], np.ndarray]]):
    """A unary node whose function depends on the node's fields (perm, shape, ...)."""

    def build(node: Node, g) -> Step:
        return _unary(make(node, g))(node, g)

    return build


def _layout(make: Callable[[Node, object], Callable[[np.ndarray], np.ndarray]]):
    """A node that only moves elements (transpose, reshape, slice): on the stored values
    directly when input and output are stored alike (int8 with the same parameters, or the
    same float type), so quantized data is not round-tripped through fp32."""

    def build(node: Node, g) -> Step:
        fn, src, out = make(node, g), node.fields["input_id"], node.fields["output_id"]
        if not g.stored_alike(src, out) or node.output_min != -math.inf or node.output_max != math.inf:
            return _unary(fn)(node, g)

        def step(vals: list) -> None:
            vals[out] = fn(vals[src])

        return step

    return build


def _softmax(x: np.ndarray) -> np.ndarray:
    return get_kernel("aten::_softmax.out")(x, -1, False, np.empty_like(x))  # along the last axis, as XNNPACK's


def _gelu(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.float32:
        return vmath.gelu(x)
    return get_kernel("aten::gelu.out")(x, "none", np.empty_like(x))  # fp16: the exact GELU, rounded once


def _prelu(x: np.ndarray, slope: np.ndarray) -> np.ndarray:
    return np.where(x >= 0, x, x * slope)


def _transpose(node: Node, g):
    perm = tuple(node.fields["perm"])
    rank = len(g.values[node.fields["input_id"]].dims)
    if sorted(perm) != list(range(rank)):
        raise MalformedProgramError(f"StaticTranspose perm {list(perm)} does not fit a rank-{rank} input")
    return lambda x: np.transpose(x, perm)


def _reshape(node: Node, g):
    shape = [int(d) for d in node.fields["new_shape"]]
    limit = max(1, math.prod(g.values[node.fields["input_id"]].dims))
    if math.prod(d for d in shape if d) > limit:
        raise MalformedProgramError(f"StaticReshape to {shape} is larger than its input")
    # A 0 marks a dimension XNNPACK infers (dynamic shapes); numpy infers at most one.
    if shape.count(0) <= 1:
        target = tuple(-1 if d == 0 else d for d in shape)
        return lambda x: x.reshape(target)
    out_dims = g.values[node.fields["output_id"]].dims

    def reshape(x: np.ndarray) -> np.ndarray:  # several dynamic dims: keep the batch's, infer the last
        known = [d if d else (x.shape[i] if i < x.ndim else out_dims[i]) for i, d in enumerate(shape)]
        known[max(i for i, d in enumerate(shape) if d == 0)] = -1
        return x.reshape(known)

    return reshape


def _slice(node: Node, g):
    offsets, sizes = node.fields["offsets"], node.fields["sizes"]
    if len(offsets) != len(sizes):
        raise MalformedProgramError("StaticSlice has offsets and sizes of different lengths")
    # A size of 0 means "to the end" (dynamic shapes).
    index = tuple(slice(o, o + s if s else None) for o, s in zip(offsets, sizes))
    return lambda x: x[index]


def _pad(node: Node, g):
    pre, post = node.fields["pre_paddings"], node.fields["post_paddings"]
    ins, outs = g.values[node.fields["input_id"]].dims, g.values[node.fields["output_id"]].dims
    if not (len(pre) == len(post) == len(ins) == len(outs)) or any(
            i + a + b != o for i, a, b, o in zip(ins, pre, post, outs)):
        raise MalformedProgramError(f"StaticConstantPad {pre}/{post} does not turn {ins} into {outs}")
    if math.prod(outs) > MAX_STATIC_ELEMENTS:
        raise MalformedProgramError(f"StaticConstantPad output {outs} is implausibly large")
    width, value = list(zip(pre, post)), node.fields["padding_value"]
    return lambda x: np.pad(x, width, constant_values=value)


def _global_avg_pool(node: Node, g):
    keep = len(g.values[node.fields["output_id"]].dims) == 4
    return lambda x: x.mean(axis=(1, 2), keepdims=keep, dtype=F32)


def _global_avg_pool_node(node: Node, g) -> Step:
    """The mean over H and W; 8-bit in and out in one compiled pass where it can (the
    loader's, numpy's mean's and the storer's steps: the same bits)."""
    plain = _with_fields(_global_avg_pool)(node, g)
    src, out = node.fields["input_id"], node.fields["output_id"]
    x_val, out_val = g.values[src], g.values[out]
    mean = Q.mean_quantized((x_val.quant.zero_point, x_val.quant.scale[0]), node.output_min, node.output_max,
                            out_val) if x_val.datatype in ("qint8", "quint8") and out_val.datatype in (
                                "qint8", "quint8") and len(x_val.dims) == 4 else None
    if mean is None:
        return plain
    shape = (1, 1) if len(out_val.dims) == 4 else ()  # keepdims

    def step_quantized(vals: list) -> None:
        y = mean(vals[src])
        if y is None:
            plain(vals)
        else:
            vals[out] = y.reshape(y.shape[0], *shape, y.shape[1])

    return step_quantized


def _leaky_relu(node: Node, g):
    slope = F32(node.fields["negative_slope"])
    return lambda x: np.where(x > 0, x, x * slope)


def _elu(node: Node, g):
    alpha = F32(node.fields["alpha"])
    return lambda x: np.where(x > 0, x, np.expm1(x) * alpha)


def _nhwc(fn):
    """Run an NCHW kernel on NHWC data."""
    return lambda x: np.ascontiguousarray(fn(x.transpose(0, 3, 1, 2)).transpose(0, 2, 3, 1))


def _pool_geometry(node: Node, what: str):
    f = node.fields
    if f["padding_top"] != f["padding_bottom"] or f["padding_left"] != f["padding_right"]:
        raise UnsupportedOperatorError(f"XnnpackBackend: {what} with asymmetric padding is not supported")
    kernel = (f["pooling_height"], f["pooling_width"])
    stride = (f["stride_height"], f["stride_width"])
    dilation = (max(1, f["dilation_height"]), max(1, f["dilation_width"]))
    return kernel, stride, (f["padding_top"], f["padding_left"]), dilation


def _max_pool(node: Node, g):
    kernel, stride, padding, dilation = _pool_geometry(node, "MaxPooling2d")
    dummy = np.empty(0, F32)
    return _nhwc(lambda x: max_pool2d_with_indices(x, kernel, stride, padding, dilation, False, dummy,
                                                   np.empty(0, np.int64))[0])


def _avg_pool(node: Node, g):
    kernel, stride, padding, _ = _pool_geometry(node, "AvgPooling2d")
    # XNNPACK averages over the pixels inside the input only.
    return _nhwc(lambda x: avg_pool2d(x, kernel, stride, padding, False, False, None, np.empty(0, F32)))


def _resize_bilinear(node: Node, g):
    f = node.fields
    out_h, out_w = f["new_height"], f["new_width"]
    out_dims = g.values[f["output_id"]].dims
    if len(out_dims) != 4 or (out_dims[1], out_dims[2]) != (out_h, out_w):
        raise MalformedProgramError(f"StaticResizeBilinear2D to {out_h}x{out_w} disagrees with output {out_dims}")
    if math.prod(out_dims) > MAX_STATIC_ELEMENTS:
        raise MalformedProgramError(f"StaticResizeBilinear2D to {out_h}x{out_w} is implausibly large")
    align = bool(f["flags"] & ALIGN_CORNERS)
    half_pixel = not align and not f["flags"] & TENSORFLOW_LEGACY_MODE

    def coords(n_in: int, n_out: int):
        if align:
            scale = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
            src = np.arange(n_out) * scale
        else:
            scale = n_in / n_out
            src = (np.arange(n_out) + 0.5) * scale - 0.5 if half_pixel else np.arange(n_out) * scale
        src = np.clip(src, 0, n_in - 1).astype(F32)
        lo = np.floor(src).astype(np.int64)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, (src - lo).astype(F32)

    def resize(x: np.ndarray) -> np.ndarray:
        y0, y1, wy = coords(x.shape[1], out_h)
        x0, x1, wx = coords(x.shape[2], out_w)
        top = x[:, y0] * (1 - wy)[None, :, None, None] + x[:, y1] * wy[None, :, None, None]
        return top[:, :, x0] * (1 - wx)[None, None, :, None] + top[:, :, x1] * wx[None, None, :, None]

    return resize


def _clamp_only(node: Node, g):
    return lambda x: x  # the bounds are the node's fused output clamp


def _int8_table(build: Callable[[Node, object], Step]) -> Callable[[Node, object], Step]:
    """An element-wise node from 8-bit quantized data to 8-bit quantized data as a lookup:
    the node's own float-domain step (dequantize, op, clamp, quantize) is run once at init on
    all 256 input values, so looking the answer up is the same arithmetic, bit for bit, at a
    fraction of the cost (MobileNet's int8 graph has a separate Clamp per ReLU6)."""

    def builder(node: Node, g) -> Step:
        step = build(node, g)
        src, out = node.fields["input_id"], node.fields["output_id"]
        eight_bit = ("qint8", "quint8")
        if g.values[src].datatype not in eight_bit or g.values[out].datatype not in eight_bit:
            return step
        vals = [None] * len(g.values)
        vals[src] = np.arange(256, dtype=np.uint8).view(Q.STORAGE[g.values[src].datatype])
        step(vals)
        every, table = vals[src], np.asarray(vals[out])  # table: indexed by the input's bits read as uint8
        lo, hi = table.min(), table.max()
        if table.dtype == every.dtype and np.array_equal(table, np.clip(every, lo, hi)):
            # the usual case (a clamp with the same parameters in and out): a clip of the
            # integers, several times faster than a gather
            def clip(vals: list) -> None:
                vals[out] = np.clip(vals[src], lo, hi)

            return clip

        def lookup(vals: list) -> None:
            vals[out] = np.take(table, vals[src].view(np.uint8))

        return lookup

    return builder


def _concatenate(node: Node, g) -> Step:
    f = node.fields
    count = {"Concatenate2": 2, "Concatenate3": 3, "Concatenate4": 4, "Concatenate5": 5}[node.kind]
    loads = [g.loader(f[f"input{i}_id"]) for i in range(1, count + 1)]
    store, out, axis = g.storer(f["output_id"], node), f["output_id"], f["axis"]

    def step(vals: list) -> None:
        vals[out] = store(np.concatenate([load(vals) for load in loads], axis=axis))

    return step


def _batch_matmul(node: Node, g) -> Step:
    transpose_b, site = bool(node.fields["flags"] & TRANSPOSE_WEIGHTS), CallSite()
    # float32 batches of TILE_ROWS rows or more (an encoder's attention): the conv GEMM's tiles,
    # the whole batch one job for both cores; BLAS multiplied each head's small matrices on one
    # thread, and on two its worker then spun beside the second core's thread
    tiles = FC.batch_product_kernel(transpose_b) if FC.BACKEND == "numba" else None

    def product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if (tiles is not None and a.dtype == F32 and b.dtype == F32 and a.ndim >= 3 and a.shape[:-2] == b.shape[:-2]
                and a.shape[-2] >= TILED_MIN_ROWS and a.shape[-1] == b.shape[-1 if transpose_b else -2] > 0
                and b.shape[-2 if transpose_b else -1] > 0):
            m, k = a.shape[-2:]
            # b as it lies (a transposed view of the keys: batch_panels reads any strides)
            y = tiles(np.ascontiguousarray(a).reshape(-1, m, k), b.reshape((-1,) + b.shape[-2:]))
            return y.reshape(a.shape[:-1] + y.shape[-1:])
        return blas_threads.matmul(site, a, np.swapaxes(b, -1, -2) if transpose_b else b)

    return _binary(product)(node, g)


def _sdpa(node: Node, g) -> Step:
    f = node.fields
    q, k, v, scale, mask = (g.loader(f[n]) for n in ("query_id", "key_id", "value_id", "scale_id", "mask_id"))
    store, out = g.storer(f["output_id"], node), f["output_id"]

    def step(vals: list) -> None:
        logits = np.matmul(q(vals) * scale(vals), np.swapaxes(k(vals), -1, -2)) + mask(vals)
        vals[out] = store(np.matmul(_softmax(logits), v(vals)))

    return step


# ---------------------------------------------------------------- convert


def _convert(node: Node, g) -> Step:
    out = node.fields["output_id"]
    dst = g.values[out]
    if out in g.fused_quantize:  # the FullyConnected reading it quantizes its input itself
        return NOTHING
    if dst.datatype == "qdint8":
        load = g.loader(node.fields["input_id"])

        def step(vals: list) -> None:
            vals[out] = Q.quantize_dynamic(load(vals))

        return step
    return _unary(lambda x: x)(node, g)


# ---------------------------------------------------------------- fully connected


def filter_matrix(node: Node, g) -> np.ndarray:
    """A FullyConnected's filter as [out, in] (its stored values)."""
    f = node.fields
    w = g.const(f["filter_id"], "FullyConnected filter")
    if f["flags"] & TRANSPOSE_WEIGHTS:
        w = w.T
    return np.ascontiguousarray(w)


def _fully_connected(node: Node, g) -> Step:
    f = node.fields
    x_id, w_id, b_id, out = f["input1_id"], f["filter_id"], f["bias_id"], f["output_id"]
    x_val, w_val, out_val = g.values[x_id], g.values[w_id], g.values[out]
    has_bias = _present(g, b_id)
    if x_val.datatype == "qdint8":
        return _fc_dynamic_quant(node, g, has_bias)
    w = filter_matrix(node, g)
    if x_val.datatype in ("qint8", "quint8"):
        return _fc_static_quant(node, g, w, has_bias)
    if w_val.datatype not in ("fp32", "fp16"):
        raise UnsupportedOperatorError(
            f"XnnpackBackend: FullyConnected with {x_val.datatype} input and {w_val.datatype} filter")
    wt = np.ascontiguousarray(w.astype(F32).T)
    k, n = wt.shape
    tiled = FC.BACKEND == "numba" and x_val.datatype == out_val.datatype == "fp32" and k > 0 and n > 0 and (
        not has_bias or (b_id in g.constants and g.constants[b_id].shape == (n,)))
    if tiled:
        return _fc_tiled(node, g, wt, g.constants[b_id].astype(F32) if has_bias else None,
                         _fc_plain(node, g, wt, has_bias))
    if (has_bias and b_id in g.constants and g.constants[b_id].shape == (n,) and n >= k
            and x_val.datatype == out_val.datatype == "fp32"):
        return _fc_bias_folded(node, g, wt, g.constants[b_id].astype(F32))
    return _fc_plain(node, g, wt, has_bias)


def _fc_plain(node: Node, g, wt: np.ndarray, has_bias: bool) -> Step:
    """An fp32 FullyConnected on BLAS (wt [in, out]), one row on both cores' shared mat-vec."""
    f = node.fields
    x_id, b_id, out = f["input1_id"], f["bias_id"], f["output_id"]
    k, n = wt.shape
    bias = g.loader(b_id) if has_bias else None
    load, store, site = g.loader(x_id), g.storer(out, node), CallSite()
    matvec = dense.matvec_kernel(decode_steps=False) if wt.nbytes >= dense.SHARE_MIN_BYTES else None
    if matvec is not None:  # the filter kept once, [out, in]: a mat-vec's rows, and BLAS's transposed view
        w_rows = np.ascontiguousarray(wt.T)
        wt = w_rows.T
        matvec_site = CallSite(assumed_serial_s(w_rows.nbytes))

    def step(vals: list) -> None:
        x = load(vals)
        if matvec is not None and x.size == k and x.dtype == F32:
            # one row (a CNN's classifier): both cores, each half of the filter's rows; BLAS's
            # threads would spin beside the second core's, which the convs keep busy
            y = np.empty(x.shape[:-1] + (n,), F32)
            matvec(matvec_site, w_rows, np.ascontiguousarray(x).reshape(k), y.reshape(n))
        else:
            y = blas_threads.matmul(site, x, wt)
        if bias is not None:
            y += bias(vals)
        vals[out] = store(y)

    return step


def _fc_tiled(node: Node, g, wt: np.ndarray, bias: Optional[np.ndarray], few_rows: Step) -> Step:
    """An fp32 FullyConnected of TILED_MIN_ROWS rows or more (an encoder's 128 tokens) on the conv
    GEMM's tiles (conv.gemm_kernel): bias and clamp in registers, XNNPACK's order of sums (bias,
    then each input in turn), both cores through the second core's thread. Fewer rows: `few_rows`.
    On BLAS's two threads its worker spun after each product beside that thread."""
    f = node.fields
    x_id, out = f["input1_id"], f["output_id"]
    k, n = wt.shape
    gemm = FC.gemm_kernel(wt, bias, node.output_min, node.output_max)

    def step(vals: list) -> None:
        x = vals[x_id]
        rows = x.size // k if x.ndim and x.shape[-1] == k else 0
        if rows < TILED_MIN_ROWS or x.dtype != F32:
            few_rows(vals)
            return
        vals[out] = gemm(x.reshape(rows, k)).reshape(x.shape[:-1] + (n,))

    return step


def _fc_bias_folded(node: Node, g, wt: np.ndarray, bias: np.ndarray) -> Step:
    """An fp32 FullyConnected whose bias is one more input row of the product: [x, 1] @ [wt; bias].
    After a product on BLAS's two threads half of y lies in the other core's cache, and a
    separate y += bias pulled it across (BERT's 128 x 1024 outputs: 45-90 us an add). Copying x
    beside a column of ones costs less where x is no wider than y (in <= out, the case taken)."""
    f = node.fields
    x_id, out = f["input1_id"], f["output_id"]
    k = wt.shape[0]
    wt_bias = np.ascontiguousarray(np.vstack([wt, bias[None]]))
    store, site = g.storer(out, node), CallSite()
    last = [np.ones((0, k + 1), F32)]  # the last call's [x, 1] array: its column of ones stays

    def step(vals: list) -> None:
        x = vals[x_id]
        if x.ndim == 0 or x.shape[-1] != k:
            raise InvalidInputError(f"XnnpackBackend: FullyConnected input of shape {list(x.shape)} for a "
                                    f"filter of {k} inputs")
        rows = math.prod(x.shape[:-1])
        if last[0].shape[0] != rows:
            last[0] = np.ones((rows, k + 1), F32)
        xb = last[0]
        np.copyto(xb[:, :k], x.reshape(rows, k))
        vals[out] = store(blas_threads.matmul(site, xb, wt_bias).reshape(*x.shape[:-1], wt.shape[1]))

    return step


def _fc_static_quant(node: Node, g, w: np.ndarray, has_bias: bool) -> Step:
    f = node.fields
    x_val, out_val = g.values[f["input1_id"]], g.values[f["output_id"]]
    x_zp = x_val.quant.zero_point
    wt = (w.astype(np.float64) - g.filter_zero_point(f["filter_id"])).T  # [in, out]
    bias = g.const(f["bias_id"], "FullyConnected bias").astype(np.float64) if has_bias else 0.0
    bias = bias - x_zp * wt.sum(axis=0)  # sum (x - zp) * w = sum x * w - zp * sum w
    scale = _requant_scale(x_val, g.scales(f["filter_id"]), out_val)
    lo, hi = Q.quantized_bounds(out_val.datatype, out_val.quant.scale[0], out_val.quant.zero_point,
                                node.output_min, node.output_max)
    x_id, out = f["input1_id"], f["output_id"]
    # XNNPACK's int32 sums, exactly: float32 products over runs of inputs short enough that no
    # partial sum can pass 2**24, added up in float64 (half the bytes of a float64 filter); each
    # run's filter kept [out, in], a mat-vec's rows (BLAS reads its transposed view)
    bounds = _exact_float32_runs(wt, x_val.datatype)
    n_in, n_out = wt.shape
    vnni = _fc_static_quant_vnni(wt, bounds, x_val.datatype)
    if vnni is not None:
        def step_vnni(vals: list) -> None:
            acc = bias + vnni(vals[x_id].reshape(-1, n_in))
            vals[out] = Q.requantize(acc.reshape(*vals[x_id].shape[:-1], n_out), scale, out_val.quant.zero_point,
                                     out_val.datatype, lo, hi)

        return step_vnni
    runs = [(a, b, np.ascontiguousarray(wt[a:b].T, F32)) for a, b in bounds]
    site = CallSite()  # BLAS's threads as blas_threads allows: a classifier's one row keeps one
    matvec = dense.matvec_kernel(decode_steps=False) if 4 * wt.size >= dense.SHARE_MIN_BYTES else None
    matvec_site = CallSite(assumed_serial_s(4 * wt.size))

    def one_row(x: np.ndarray) -> np.ndarray:
        # a classifier's row: both cores, each half of each run's filter rows (exact integer sums, as BLAS's)
        acc = bias
        for a, b, rows in runs:
            y = np.empty(n_out, F32)
            matvec(matvec_site, rows, np.ascontiguousarray(x.reshape(n_in)[a:b]), y)
            acc = acc + y.astype(np.float64)
        return np.broadcast_to(acc, x.shape[:-1] + (n_out,))

    def step(vals: list) -> None:
        x = vals[x_id].astype(F32)
        if matvec is not None and x.size == n_in:
            acc = one_row(x)
        else:
            acc = bias + sum(blas_threads.matmul(site, x[..., a:b], rows.T).astype(np.float64) for a, b, rows in runs)
        vals[out] = Q.requantize(acc, scale, out_val.quant.zero_point, out_val.datatype, lo, hi)

    return step


def _fc_static_quant_vnni(wt: np.ndarray, runs: list[tuple[int, int]], x_datatype: str
                          ) -> Optional[Callable[[np.ndarray], np.ndarray]]:
    """x int8/uint8 [M, in] -> float64 sum of x * w (wt [in, out], integers), each run's int32 sums
    through vpdpbusd (xnnpack_gemm.bind_channelwise with unit scales: float32 of each run's exact
    sum, exact as `runs` are cut), added in float64 as the BLAS path adds them: the same values.
    A classifier's 1280 x 1000 int8 row: ~12-23 us, where the float32 filter's mat-vec read 4x
    the bytes (~150 us in MobileNetV2). None without AVX512-VNNI or for a filter int8 cannot hold."""
    if XG.NUMBA is None or not XG.NUMBA["vnni"] or wt.min(initial=0) < -128 or wt.max(initial=0) > 127:
        return None
    ones = np.ones(wt.shape[1], F32)
    products = [(a, b, XG.bind_channelwise(np.ascontiguousarray(wt[a:b].T, np.int8), ones, None)) for a, b in runs]
    unsigned = x_datatype == "quint8"  # x - 128 as int8 with a zero point of -128: the same sums

    def sums(x: np.ndarray) -> np.ndarray:
        m = x.shape[0]
        q = (x ^ np.uint8(128)).view(np.int8) if unsigned else x.view(np.int8)
        zp, x_scale = np.full(m, -128 if unsigned else 0, np.int32), np.ones(m, F32)
        total = 0.0
        for a, b, product in products:
            total = total + product(np.ascontiguousarray(q[:, a:b]), zp, x_scale).astype(np.float64)
        return total

    return sums


def _exact_float32_runs(wt: np.ndarray, x_datatype: str, x_zero: int = 0) -> list[tuple[int, int]]:
    """Split the inputs (rows of the zero-point-free integer filter `wt` [in, out]) into runs over
    which a float32 product with x - x_zero (x of `x_datatype`) is exact: each output's partial
    sums, in whatever order BLAS adds, are bounded by its run's sum of |x - x_zero| * |w|, and
    float32 holds every integer below 2**24."""
    lo, hi = Q.QRANGE[x_datatype]
    x_max = max(abs(lo - x_zero), abs(hi - x_zero))
    magnitudes = np.abs(wt)
    if float(magnitudes.sum(axis=0).max(initial=0.0)) * x_max < 2.0 ** 24:
        return [(0, wt.shape[0])]  # the usual case: one product
    runs, a, total = [], 0, np.zeros(wt.shape[1])
    for k, row in enumerate(magnitudes):
        if k > a and float((total + row).max(initial=0.0)) * x_max >= 2.0 ** 24:
            runs.append((a, k))
            a, total = k, np.zeros(wt.shape[1])
        total += row
    runs.append((a, wt.shape[0]))
    return runs


def _requant_scale(x_val, w_scales: np.ndarray, out_val) -> np.ndarray:
    return (F32(x_val.quant.scale[0]) * w_scales.astype(F32) / F32(out_val.quant.scale[0])).astype(F32)


def _fc_dynamic_quant(node: Node, g, has_bias: bool) -> Step:
    """qd8 input x qc8w/qc4w/qb4w filter -> fp32, with XNNPACK's own arithmetic bit for bit
    (execupy/kernels/fast/xnnpack_gemm.py says what that is)."""
    f = node.fields
    w_id, out, x_id = f["filter_id"], f["output_id"], f["input1_id"]
    bias = g.const(f["bias_id"], "FullyConnected bias").astype(F32) if has_bias else None
    lo, hi = F32(node.output_min), F32(node.output_max)
    if g.values[w_id].datatype == "qbint4":
        packed = pack_qb4w(node, g)
        n_out, n_in = packed.n, packed.k
        product = XG.bind_blockwise(packed, bias)
        from_float = XG.bind_blockwise_from_float(packed, bias)
    else:
        w_signed = (filter_matrix(node, g).astype(np.int16) - g.filter_zero_point(w_id)).astype(np.int8)
        n_out, n_in = w_signed.shape
        w_scale = g.scales(w_id).reshape(n_out).astype(F32)
        product = XG.bind_channelwise(w_signed, w_scale, bias)
        from_float = XG.bind_channelwise(w_signed, w_scale, bias, from_float=True)

    unclamped = lo == -np.inf and hi == np.inf
    clamp = (lambda y: y) if unclamped else (lambda y: np.clip(y, lo, hi))
    src = g.fused_quantize.get(x_id)
    if src is not None:
        def step_quantizing(vals: list) -> None:
            x = vals[src]  # fp32: the Convert to qdint8 before this node, done here (Q.quantize_dynamic)
            vals[out] = clamp(from_float(x.reshape(-1, n_in))).reshape(*x.shape[:-1], n_out)

        if g.values[w_id].datatype == "qbint4" and unclamped:
            step_quantizing.bind_fixed = FixedBinding((src,), (out,), lambda xs, ys: XG.bind_blockwise_from_float_into(
                packed, bias, xs[0], ys[0]))
        return step_quantizing

    def step(vals: list) -> None:
        x: Q.DynamicQuant = vals[x_id]
        y = product(x.q.reshape(-1, n_in), x.zero_point.reshape(-1), x.scale.reshape(-1))
        vals[out] = clamp(y).reshape(*x.q.shape[:-1], n_out)

    return step


def pack_qb4w(node: Node, g) -> XG.BlockwiseWeight:
    """A qb4w FullyConnected's filter and block scales, checked and packed for the products:
    straight from the stored bytes where they are [out, in / 2] (xnnpack_gemm.pack_blockwise_stored),
    else from the filter's values."""
    w_id = node.fields["filter_id"]
    scales = g.scales(w_id)
    nibbles = None if node.fields["flags"] & TRANSPOSE_WEIGHTS else g.nibbles(w_id)
    stored = filter_matrix(node, g) if nibbles is None else None  # values 0..15, [out, in]
    n_out, n_in = (nibbles.shape[0], nibbles.shape[1] * 2) if nibbles is not None else stored.shape
    if scales.ndim != 2 or scales.shape[0] != n_out or scales.shape[1] == 0:
        raise MalformedProgramError(f"XnnpackBackend: FullyConnected filter (value {w_id}) has {n_out} outputs but "
                                    f"block scales of shape {list(scales.shape)}")
    if n_in % scales.shape[1] or (n_in // scales.shape[1]) % XG.KSUM_CHUNK:
        raise UnsupportedOperatorError(f"XnnpackBackend: FullyConnected with {scales.shape[1]} blocks over "
                                       f"{n_in} inputs (XNNPACK needs blocks of a multiple of {XG.KSUM_CHUNK})")
    if n_in // scales.shape[1] > XG.MAX_EXACT_BLOCK:
        raise UnsupportedOperatorError(f"XnnpackBackend: FullyConnected with blocks of {n_in // scales.shape[1]} "
                                       f"inputs (execupy sums a block exactly up to {XG.MAX_EXACT_BLOCK})")
    if nibbles is not None:
        return XG.pack_blockwise_stored(nibbles, scales)
    return XG.pack_blockwise((stored.astype(np.int16) - 8).astype(np.int8), scales)


# ---------------------------------------------------------------- convolution


def _conv_geometry(f: dict):
    stride = (max(1, f["subsampling_height"]), max(1, f["subsampling_width"]))
    dilation = (max(1, f["dilation_height"]), max(1, f["dilation_width"]))
    pads = ((f["padding_top"], f["padding_bottom"]), (f["padding_left"], f["padding_right"]))
    return stride, dilation, pads


def _conv_filter(node: Node, g) -> np.ndarray:
    """The filter as torch lays it out: (Cout, Cin/groups, KH, KW)."""
    f = node.fields
    w = g.const(f["filter_id"], f"{node.kind} filter")
    if w.ndim != 4 or (w.shape[1], w.shape[2]) != (f["kernel_height"], f["kernel_width"]):
        raise MalformedProgramError(f"{node.kind} filter of shape {w.shape} does not match its kernel size")
    if node.kind == "DepthwiseConv2d":  # [1, KH, KW, Cout]
        return np.ascontiguousarray(w[0].transpose(2, 0, 1)[:, None])
    if node.kind == "ConvTranspose2d":  # [G*Cout_g, KH, KW, Cin_g] -> (G*Cin_g, Cout_g, KH, KW)
        groups = max(1, f["groups"])
        cout_g, kh, kw, cin_g = w.shape[0] // groups, w.shape[1], w.shape[2], w.shape[3]
        return np.ascontiguousarray(
            w.reshape(groups, cout_g, kh, kw, cin_g).transpose(0, 4, 1, 2, 3).reshape(groups * cin_g, cout_g, kh, kw))
    return np.ascontiguousarray(w.transpose(0, 3, 1, 2))  # [Cout, KH, KW, Cin_g]


def _conv_nchw(node: Node, w: np.ndarray, dtype) -> Callable[[np.ndarray], np.ndarray]:
    """x NHWC -> conv (no bias) -> NHWC, computed in `dtype`."""
    f = node.fields
    stride, dilation, pads = _conv_geometry(f)
    groups = max(1, f["groups"])
    w = w.astype(dtype)
    dummy = np.empty(0, dtype)
    if node.kind == "ConvTranspose2d":
        adjust = (f["adjustment_height"], f["adjustment_width"])

        def deconv(x: np.ndarray) -> np.ndarray:
            y = convolution(x, w, None, stride, (0, 0), dilation, True, adjust, groups, dummy)
            return y[:, :, pads[0][0]:y.shape[2] - pads[0][1], pads[1][0]:y.shape[3] - pads[1][1]]

        return _nhwc(lambda x: deconv(x.astype(dtype, copy=False)))

    def conv(x: np.ndarray) -> np.ndarray:
        x = x.astype(dtype, copy=False)
        if any(p for pair in pads for p in pair):
            x = np.pad(x, ((0, 0), (0, 0), *pads))
        return convolution(x, w, None, stride, (0, 0), dilation, False, (0, 0), groups, dummy)

    return _nhwc(conv)


Epilogue = tuple[Optional[np.ndarray], float, float]  # a float conv's bias (or None) and clamp bounds


@dataclass(frozen=True)
class Requantization:
    """An int8 conv's output step (conv.requantize): + bias, * scale, + zero point, clamped, stored."""
    bias: np.ndarray
    scale: np.ndarray
    zero_point: int
    lo: float
    hi: float
    storage: type

    def __call__(self, acc: np.ndarray) -> np.ndarray:
        return FC.requantize(acc, self.bias, self.scale, self.zero_point, self.lo, self.hi,
                             np.empty(acc.shape, self.storage))


def _fast_conv(node: Node, g, w: np.ndarray, x_zero: int, dtype, epilogue: Optional[Epilogue] = None,
               requantized: Optional[Requantization] = None) -> Callable[[np.ndarray], np.ndarray] | None:
    """NHWC x -> NHWC conv(x - x_zero, w) without the NCHW round trip, for the two kinds of
    layer a MobileNet is mostly made of: a depthwise conv through the compiled kernel and an
    ungrouped conv as one product (a 1x1 one straight on the pixels, others on an NHWC
    im2col; conv.gemm_kernel), both in `dtype` (for integer inputs the caller's choice of a
    type that holds every sum exactly, as XNNPACK's int32 does). With `epilogue` the result
    is also + bias and clamped, with `requantized` it is the int8 output, in the compiled
    kernel's own pass over its outputs or in one pass after. None for any other convolution
    (grouped, transposed)."""
    f = node.fields
    stride, dilation, pads = _conv_geometry(f)
    cout, cin_g, kh, kw = w.shape
    x_val = g.values[f["input1_id"]]
    channels = x_val.dims[-1] if len(x_val.dims) == 4 else None
    r = requantized  # the kernels' epilogue: their arguments after the filter (and a depthwise one's geometry)
    finish = (r.bias, r.lo, r.hi, (r.scale, r.zero_point, r.storage)) if r is not None \
        else (epilogue or (None, -np.inf, np.inf))
    if node.kind == "DepthwiseConv2d" and cin_g == 1 and channels == cout and FC.BACKEND == "numba":
        # integer inputs too: the caller picks float32 only where it holds every sum exactly
        w_hwc = np.ascontiguousarray(w[:, 0].transpose(1, 2, 0).astype(dtype))  # (KH, KW, C)
        kernel = FC.depthwise_nhwc_kernel(w_hwc, stride, dilation, (*pads[0], *pads[1]), x_zero, *finish)
        out_dtype = dtype if r is None else r.storage  # requantized in the kernel (its registers where it can)

        def depthwise(x: np.ndarray) -> np.ndarray:
            n, h, width, _ = x.shape
            oh = conv_output_size(h + pads[0][0] + pads[0][1], kh, stride[0], 0, dilation[0])
            ow = conv_output_size(width + pads[1][0] + pads[1][1], kw, stride[1], 0, dilation[1])
            return kernel(np.ascontiguousarray(x), np.empty((n, oh, ow, cout), out_dtype))

        return depthwise
    if node.kind != "Conv2d" or max(1, f["groups"]) != 1 or channels != cin_g:
        return None
    # rows in (KH, KW, Cin) order: an NHWC window's pixels are runs of KW * Cin contiguous values
    wt = np.ascontiguousarray(w.transpose(2, 3, 1, 0).reshape(-1, cout).astype(dtype))
    zero = dtype(x_zero)
    padded = any(p for pair in pads for p in pair)
    if (kh, kw) == (1, 1) and stride == (1, 1) and not padded:
        product = FC.gemm_kernel(wt, *finish)

        def pointwise(x: np.ndarray) -> np.ndarray:
            rows = x.reshape(-1, cin_g)
            if x_zero:
                rows = rows.astype(dtype) - zero
            return product(rows).reshape(*x.shape[:-1], cout)  # int8 data read as it is (exact in dtype)

        return pointwise

    windows = FC.windows_kernel(wt, *finish)
    int8 = _int8_dense(w.astype(dtype), x_zero, stride, dilation, pads, finish) if r is not None else None
    offsets_of: dict = {}  # (padded input shape, layout) -> (each output pixel's window start, each input's offset)
    planes: dict = {}  # padded NCHW input shape -> its buffer (this step's own, reused by every call)

    def window_offsets(shape: tuple, planar: bool) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
        """Element offsets into the C-ordered padded input, NHWC, or NCHW where `planar`: rows in
        (N, OH, OW) order, window inputs in the filter rows' (KH, KW, Cin) order."""
        if (shape, planar) not in offsets_of:
            (_, sh, sw, sc), bases, out_shape = _window_starts(shape, planar, (kh, kw), stride, dilation)
            offsets = (np.arange(kh)[:, None, None] * (dilation[0] * sh)
                       + np.arange(kw)[None, :, None] * (dilation[1] * sw)
                       + np.arange(shape[3])[None, None, :] * sc).reshape(-1)
            offsets_of[shape, planar] = (bases, offsets.astype(np.int64), out_shape)
        return offsets_of[shape, planar]

    def dense(x: np.ndarray) -> np.ndarray:
        """The product of each output pixel's window of the input, read in place (conv.windows_kernel).
        An input whose memory is NCHW (a network's image, transposed to NHWC by a view) is padded
        and read as NCHW: its rows copy whole (an NHWC copy of a 3-channel image went a value at
        a time, 90 us of MobileNet's first conv)."""
        n, h, width, c = x.shape
        planar = c > 1 and x.transpose(0, 3, 1, 2).flags.c_contiguous
        if int8 is not None and x.dtype.kind in "iu" and (y := int8(x, planar)) is not None:
            return y
        (top, bottom), (left, right) = pads
        if planar:  # the border's zeros written once, at the first call of this shape
            shape = (n, c, h + top + bottom, width + left + right)
            if shape not in planes:
                planes[shape] = np.zeros(shape, dtype)
            xp = planes[shape]
            inside = xp[:, :, top:top + h, left:left + width]
            inside[...] = x.transpose(0, 3, 1, 2)
            if x_zero:
                inside -= zero
        elif padded:  # x - x_zero inside a zero border
            xp = FC.pad_into(x, x_zero, top, left, np.zeros((n, h + top + bottom, width + left + right, c), dtype))
        else:
            xp = np.ascontiguousarray(x, dtype)
            xp = xp - zero if x_zero else xp
        bases, offsets, out_shape = window_offsets((n, h + top + bottom, width + left + right, c), planar)
        return windows(xp, bases, offsets).reshape(*out_shape, cout)

    return dense


def _window_starts(shape: tuple, planar: bool, kernel: tuple, stride: tuple, dilation: tuple
                   ) -> tuple[tuple[int, int, int, int], np.ndarray, tuple[int, int, int]]:
    """A conv's windows over its C-ordered padded input of `shape` (N, H, W, C; its memory NCHW
    where `planar`): the input's element strides (image, row, column, channel), each output
    pixel's window start in (N, OH, OW) order (int64), and (N, OH, OW)."""
    n, h, width, c = shape
    oh = conv_output_size(h, kernel[0], stride[0], 0, dilation[0])
    ow = conv_output_size(width, kernel[1], stride[1], 0, dilation[1])
    strides = (c * h * width, width, 1, h * width) if planar else (h * width * c, width * c, c, 1)
    sn, sh, sw, _ = strides
    bases = (np.arange(n)[:, None, None] * sn + np.arange(oh)[None, :, None] * (stride[0] * sh)
             + np.arange(ow)[None, None, :] * (stride[1] * sw)).reshape(-1)
    return strides, bases.astype(np.int64), (n, oh, ow)


def _int8_dense(w: np.ndarray, x_zero: int, stride: tuple, dilation: tuple, pads: tuple, finish: tuple
                ) -> Optional[Callable[[np.ndarray, bool], Optional[np.ndarray]]]:
    """An int8 convolution's windows summed in int32 four bytes at a time (conv.int8_windows_kernel,
    where the CPU has VNNI): (NHWC x, planar) -> its requantized NHWC output, or None where x's
    layout does not suit. The quads: four channels of a pixel (Cin a multiple of 4), or, for an
    input whose memory is NCHW (a network's image), four pixels along a row of one channel (KW <= 4
    and no column dilation: the filter's columns past KW are zeros). The padded input is a copy
    of x's bytes inside a border of x_zero (the kernel takes x_zero off every input). None where
    the kernel does not run. `w`: the filter (out, in, KH, KW), integers, in the sums' float type."""
    if FC.BACKEND != "numba":
        return None
    cout, cin, kh, kw = w.shape
    pixel_quads = FC.int8_windows_kernel(np.ascontiguousarray(w.transpose(2, 3, 1, 0).reshape(-1, cout)), *finish,
                                         x_zero) if cin % 4 == 0 else None
    row_quads = FC.int8_windows_kernel(np.ascontiguousarray(
        np.pad(w, ((0, 0), (0, 0), (0, 0), (0, 4 - kw))).transpose(1, 2, 3, 0).reshape(-1, cout)), *finish,
        x_zero) if kw <= 4 and dilation[1] == 1 else None
    if pixel_quads is None and row_quads is None:
        return None
    (top, bottom), (left, right) = pads
    layouts: dict = {}  # (x's shape and dtype, planar) -> the padded input's bytes, bases, offsets, out's shape

    def layout(x: np.ndarray, planar: bool) -> tuple:
        key = (x.shape, x.dtype, planar)
        if key not in layouts:
            n, h, width, c = x.shape
            hp, wp = h + top + bottom, width + left + right
            (_, sh, sw, sc), bases, out_shape = _window_starts((n, hp, wp, c), planar, (kh, kw), stride, dilation)
            if planar:  # quads in (Cin, KH) order, each the row's KW pixels from the window's left
                offsets = np.arange(c)[:, None] * sc + np.arange(kh)[None, :] * (dilation[0] * sh)
            else:  # quads in (KH, KW, Cin / 4) order
                offsets = (np.arange(kh)[:, None, None] * (dilation[0] * sh)
                           + np.arange(kw)[None, :, None] * (dilation[1] * sw) + np.arange(0, c, 4)[None, None, :])
            size = n * c * hp * wp
            data = np.full(size + 4, x_zero, x.dtype)  # 4 bytes past the end: a row's last quad may read there
            layouts[key] = (data, data[:size].reshape((n, c, hp, wp) if planar else (n, hp, wp, c)),
                            bases, offsets.reshape(-1).astype(np.int64), out_shape)
        return layouts[key]

    def dense_int8(x: np.ndarray, planar: bool) -> Optional[np.ndarray]:
        kernel = row_quads if planar else pixel_quads
        if kernel is None:
            return None
        data, inside, bases, offsets, out_shape = layout(x, planar)
        n, h, width, c = x.shape
        if planar:
            inside[:, :, top:top + h, left:left + width] = x.transpose(0, 3, 1, 2)
        else:
            inside[:, top:top + h, left:left + width] = x
        return kernel(data, bases, offsets).reshape(*out_shape, -1)

    return dense_int8


def _exact_in_float32(w_shifted: np.ndarray, x_datatype: str, x_zero: int) -> bool:
    """Whether one float32 product of x - x_zero and the integer conv filter (out first) is exact."""
    return len(_exact_float32_runs(w_shifted.reshape(w_shifted.shape[0], -1).T, x_datatype, x_zero)) == 1


def _convolution(node: Node, g) -> Step:
    f = node.fields
    x_id, b_id, out = f["input1_id"], f["bias_id"], f["output_id"]
    x_val, out_val = g.values[x_id], g.values[out]
    w = _conv_filter(node, g)
    has_bias = _present(g, b_id)
    if x_val.datatype in ("qint8", "quint8"):
        x_zp = x_val.quant.zero_point
        w_shifted = w.astype(np.float64) - g.filter_zero_point(f["filter_id"])
        cout = w.shape[0]
        bias = g.const(b_id, f"{node.kind} bias").astype(np.float64) if has_bias else np.zeros(cout)
        if node.kind == "Conv2d" and not any(p for pair in _conv_geometry(f)[2] for p in pair):
            # Unpadded, every output sums whole windows of x: sum (x - zp) * w = sum x * w - zp * sum w,
            # the zero point's part a constant of the bias (one pass over x less: no subtraction)
            bias = bias - x_zp * w_shifted.reshape(cout, -1).sum(axis=1)
            x_zp = 0
        # The integer sums XNNPACK computes in int32, exactly: in float32 BLAS where that is
        # exact (twice the speed of float64), else in float64, which holds every int32.
        acc_dtype = F32 if _exact_in_float32(w_shifted, x_val.datatype, x_zp) else np.float64
        scale = _requant_scale(x_val, g.scales(f["filter_id"]), out_val)
        lo, hi = Q.quantized_bounds(out_val.datatype, out_val.quant.scale[0], out_val.quant.zero_point,
                                    node.output_min, node.output_max)
        if FC.BACKEND == "numba" and scale.size in (1, cout) and bias.shape == (cout,):
            # XNNPACK's fp32 requantization (Q.requantize) and the bias in one pass, or in the
            # product's own (conv.gemm_kernel)
            scale_c = np.ascontiguousarray(np.broadcast_to(scale.reshape(-1), (cout,)), F32)
            # float32 sums + the bias in float32 where the bias is a float32 value: one correctly
            # rounded add, the float64 sum's bits, 2.3x faster (MobileNetV2's requantization was a
            # third of its time)
            bias_c = bias.astype(F32) if acc_dtype == F32 and np.array_equal(bias.astype(F32), bias) else bias
            requantized = Requantization(bias_c, scale_c, out_val.quant.zero_point, lo, hi, Q.STORAGE[out_val.datatype])
            conv = _fast_conv(node, g, w_shifted, x_zp, acc_dtype, requantized=requantized)
            if conv is None:
                nchw = _conv_nchw(node, w_shifted, acc_dtype)
                conv = lambda x: requantized(nchw(x.astype(acc_dtype) - acc_dtype(x_zp)))  # noqa: E731

            def step_quantized(vals: list) -> None:
                vals[out] = conv(vals[x_id])

            return step_quantized
        conv = _fast_conv(node, g, w_shifted, x_zp, acc_dtype)
        if conv is None:
            nchw = _conv_nchw(node, w_shifted, acc_dtype)
            conv = lambda x: nchw(x.astype(acc_dtype) - acc_dtype(x_zp))  # noqa: E731

        def step_quantized_numpy(vals: list) -> None:
            acc = conv(vals[x_id]) + bias  # exact integers in float64
            vals[out] = Q.requantize(acc, scale, out_val.quant.zero_point, out_val.datatype, lo, hi)

        return step_quantized_numpy
    if x_val.datatype == "qdint8":
        return _conv_dynamic_quant(node, g, w, has_bias)
    if g.values[f["filter_id"]].datatype not in ("fp32", "fp16"):
        raise UnsupportedOperatorError(f"XnnpackBackend: {node.kind} with a {g.values[f['filter_id']].datatype} "
                                       f"filter and {x_val.datatype} input")
    if x_val.datatype == out_val.datatype == "fp32" and (not has_bias or b_id in g.constants):
        # bias and clamp in the conv's own pass over its output where that is compiled
        bias = g.const(b_id, f"{node.kind} bias").astype(F32) if has_bias else None
        fused = _fast_conv(node, g, w.astype(F32), 0, F32, (bias, node.output_min, node.output_max))
        if fused is not None:

            def step_fused(vals: list) -> None:
                vals[out] = fused(vals[x_id])

            return step_fused
    conv = _fast_conv(node, g, w.astype(F32), 0, F32) or _conv_nchw(node, w, F32)
    bias = g.loader(b_id) if has_bias else None
    load, store = g.loader(x_id), g.storer(out, node)

    def step(vals: list) -> None:
        y = conv(load(vals))
        if bias is not None:
            y = y + bias(vals)
        vals[out] = store(y)

    return step


def _conv_dynamic_quant(node: Node, g, w: np.ndarray, has_bias: bool) -> Step:
    """qd8 input (a scale and zero point per pixel) x qc8w filter -> fp32:
    y = w_scale[c] * conv(x_scale * (x - x_zp), w)[n, c] + bias[c]; for a 1x1 filter (the case
    ExecuTorch emits) this is XNNPACK's per-row scaling exactly. For larger filters a window
    mixes pixels with different scales, which XNNPACK's qd8 igemm cannot express; we dequantize
    the pixels first, the mathematically meaningful reading."""
    f = node.fields
    conv = _conv_nchw(node, w.astype(np.float64) - g.filter_zero_point(f["filter_id"]), np.float64)
    w_scale = g.scales(f["filter_id"]).astype(np.float64).reshape(-1)  # per output channel, NHWC's last dim
    bias = g.const(f["bias_id"], f"{node.kind} bias").astype(np.float64) if has_bias else 0.0
    lo, hi = F32(node.output_min), F32(node.output_max)
    x_id, out = f["input1_id"], f["output_id"]

    def step(vals: list) -> None:
        x: Q.DynamicQuant = vals[x_id]
        y = conv((x.q.astype(np.float64) - x.zero_point) * x.scale)
        vals[out] = np.clip((y * w_scale + bias).astype(F32), lo, hi)

    return step


def _unsupported(node: Node, g) -> Step:
    raise UnsupportedOperatorError(f"XnnpackBackend: node type {node.kind} is not supported by execupy")


# node kind -> builder(node, graph) -> step
BUILDERS: dict[str, Callable[[Node, object], Step]] = {
    "Add": _binary(np.add, Q.ADD),
    "Subtract": _binary(np.subtract, Q.SUBTRACT),
    "Multiply": _binary(np.multiply, Q.MULTIPLY),
    "Div": _binary(np.divide),
    "Minimum": _binary(np.minimum),
    "Maximum": _binary(np.maximum),
    "PReLU": _binary(_prelu),
    "BatchMatrixMultiply": _batch_matmul,
    "FullyConnected": _fully_connected,
    "Conv2d": _convolution,
    "DepthwiseConv2d": _convolution,
    "ConvTranspose2d": _convolution,
    "Convert": _convert,
    "Softmax": _unary(_softmax),
    "Sigmoid": _unary(vmath.sigmoid),
    "Tanh": _unary(_kernel("tanh")),
    "Exp": _unary(_kernel("exp")),
    "Log": _unary(_kernel("log")),
    "Sin": _unary(_kernel("sin")),
    "Cos": _unary(_kernel("cos")),
    "Abs": _unary(np.abs),
    "Negate": _unary(np.negative),
    "Square": _unary(np.square),
    "SquareRoot": _unary(_kernel("sqrt")),
    "ReciprocalSquareRoot": _unary(vmath.rsqrt),
    "Floor": _unary(np.floor),
    "Ceiling": _unary(np.ceil),
    "Gelu": _unary(_gelu),
    "Hardswish": _unary(_kernel("hardswish")),
    "Copy": _unary(lambda x: x.copy()),
    "Clamp": _int8_table(_with_fields(_clamp_only)),
    "LeakyReLU": _with_fields(_leaky_relu),
    "ELU": _with_fields(_elu),
    "StaticTranspose": _layout(_transpose),
    "StaticReshape": _layout(_reshape),
    "StaticSlice": _layout(_slice),
    "StaticConstantPad": _with_fields(_pad),
    "GlobalAvgPooling2d": _global_avg_pool_node,
    "MaxPooling2d": _with_fields(_max_pool),
    "AvgPooling2d": _with_fields(_avg_pool),
    "StaticResizeBilinear2D": _with_fields(_resize_bilinear),
    "Concatenate2": _concatenate,
    "Concatenate3": _concatenate,
    "Concatenate4": _concatenate,
    "Concatenate5": _concatenate,
    "ScaledDotProductAttention": _sdpa,
    "ArgMaxPooling2d": _unsupported,
}
