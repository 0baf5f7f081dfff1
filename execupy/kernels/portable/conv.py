"""Convolution: `aten::convolution.out` for 1-D, 2-D and 3-D inputs, ordinary and transposed,
with stride, padding, dilation, groups (depthwise included) and an optional bias.

The forward convolution is an im2col: a strided view of the padded input gives every
receptive field without copying, then one batched matmul (one batch entry per group)
contracts channels and kernel taps. Depthwise convolutions (one input channel per
group) skip the matmul and accumulate one kernel tap at a time instead, which is the
same arithmetic without building the column matrix. 2-D float depthwise convolutions with
one output channel per group (MobileNet's) run the same sums compiled when numba is
installed (execupy/kernels/fast/conv.py; bit-identical, 4x faster).

The transposed convolution is the adjoint: one matmul per group gives each input
pixel's contribution to every kernel tap, and those contributions are added into the
output one tap at a time through strided slices (col2im).

Half types compute in float32. Integer convolutions compute in int64 and wrap on the
final cast, which equals C++ arithmetic in the narrow type since + and * commute with
the modular reduction.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..registry import register_kernel
from ._util import compute_dtype, is_float, write


def _fast_conv():
    """The compiled kernels' module, imported at the first depthwise convolution: it imports
    numba, which adds ~100 MiB to a process that would not otherwise load it (an LLM)."""
    from ..fast import conv

    return conv


_COMPILED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _spatial_params(values: Sequence[int], k: int, name: str) -> tuple[int, ...]:
    """Expand a per-dimension parameter list (ATen allows one value for all dims)."""
    values = tuple(int(v) for v in values)
    if len(values) == 1:
        return values * k
    if len(values) != k:
        raise ValueError(f"convolution: {name} has {len(values)} entries, expected {k}")
    return values


def _work_dtype(dtype: np.dtype) -> np.dtype:
    if is_float(dtype):
        return compute_dtype(dtype)
    if dtype == np.bool_:
        raise TypeError("convolution does not support bool tensors")
    return np.dtype(np.int64)


def conv_output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """ATen's forward convolution output length along one spatial dimension."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def conv_transpose_output_size(size: int, kernel: int, stride: int, padding: int, dilation: int,
                               output_padding: int) -> int:
    """ATen's transposed convolution output length along one spatial dimension."""
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


# ----------------------------------------------------------------------------- forward


def _receptive_fields(xp: np.ndarray, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                      out_size: Sequence[int]) -> np.ndarray:
    """View of padded `xp` (N, C, *S) as (N, C, *out_size, *kernel): element [n, c, o..., k...]
    is xp[n, c, o*stride + k*dilation]. No copy."""
    n, c = xp.shape[:2]
    sp = xp.strides[2:]
    shape = (n, c, *out_size, *kernel)
    strides = (*xp.strides[:2], *(s * st for s, st in zip(sp, stride)), *(s * d for s, d in zip(sp, dilation)))
    return as_strided(xp, shape=shape, strides=strides, writeable=False)


def _conv_forward(x: np.ndarray, w: np.ndarray, stride, padding, dilation, groups: int) -> np.ndarray:
    n, cin = x.shape[:2]
    cout, cin_g = w.shape[:2]
    kernel = w.shape[2:]
    k = len(kernel)
    if cin != cin_g * groups:
        raise ValueError(f"convolution: input has {cin} channels, weight expects {cin_g} x {groups} groups")
    if cout % groups:
        raise ValueError(f"convolution: {cout} output channels do not split into {groups} groups")
    out_size = tuple(conv_output_size(x.shape[2 + i], kernel[i], stride[i], padding[i], dilation[i]) for i in range(k))
    if any(o <= 0 for o in out_size):
        raise ValueError(f"convolution: output size {out_size} is not positive for input {x.shape}")
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding]) if any(padding) else x
    cout_g = cout // groups
    if cin_g == cout_g == 1 and k == 2 and x.dtype in _COMPILED_DTYPES and _fast_conv().BACKEND == "numba":
        # compiled depthwise (execupy/kernels/fast/conv.py): the same sums as _depthwise, in registers
        fast_conv = _fast_conv()
        out = np.empty((n, cout, *out_size), x.dtype)
        return fast_conv.depthwise_nchw(np.ascontiguousarray(xp), np.ascontiguousarray(w.reshape(cout, *kernel)),
                                        stride, dilation, out)
    fields = _receptive_fields(xp, kernel, stride, dilation, out_size)  # (N, Cin, *O, *K)
    if cin_g == 1:
        return _depthwise(fields, w, groups, cout_g, out_size)
    taps = int(np.prod(kernel))
    # (N, G, Cin_g, *O, *K) -> (G, Cin_g, *K, N, *O) -> (G, Cin_g*K, N*O): the one copy (im2col).
    # Pixels innermost keeps the copy's reads nearly sequential (measured 3x faster than
    # taps innermost); the matmul then takes the columns transposed, which BLAS does for free.
    cols = fields.reshape(n, groups, cin_g, *out_size, *kernel)
    cols = cols.transpose(1, 2, *range(3 + k, 3 + 2 * k), 0, *range(3, 3 + k))
    cols = cols.reshape(groups, cin_g * taps, -1)
    wg = w.reshape(groups, cout_g, cin_g * taps)
    y = np.matmul(cols.transpose(0, 2, 1), wg.transpose(0, 2, 1))  # (G, N*O, Cout_g)
    y = y.reshape(groups, n, *out_size, cout_g)
    # -> (N, G, Cout_g, *O) -> (N, Cout, *O)
    y = y.transpose(1, 0, 2 + k, *range(2, 2 + k))
    return y.reshape(n, cout, *out_size)


def _depthwise(fields: np.ndarray, w: np.ndarray, groups: int, cout_g: int, out_size) -> np.ndarray:
    """One input channel per group: out[n, g*m + j] = sum_k w[g*m + j, 0, k] * field[n, g, ..., k].
    Accumulate tap by tap; each step is one broadcast multiply-add over all pixels."""
    n = fields.shape[0]
    k = len(out_size)
    kernel = w.shape[2:]
    # weight (G*M, 1, *K) -> (G, M, *K); fields (N, G, *O, *K) -> (N, G, 1, *O, *K)
    wg = w.reshape(groups, cout_g, *kernel)
    f = fields[:, :, None]
    shape = (n, groups, cout_g, *out_size)
    dtype = np.result_type(fields.dtype, w.dtype)
    acc, term = np.empty(shape, dtype), np.empty(shape, dtype)
    expand = (slice(None), slice(None)) + (None,) * k
    for i, tap in enumerate(np.ndindex(*kernel)):
        np.multiply(f[(Ellipsis, *tap)], wg[(Ellipsis, *tap)][expand], out=acc if i == 0 else term)
        if i:
            acc += term
    return acc.reshape(n, groups * cout_g, *out_size)


# ----------------------------------------------------------------------------- transposed


def _conv_transposed(x: np.ndarray, w: np.ndarray, stride, padding, dilation, output_padding,
                     groups: int) -> np.ndarray:
    n, cin = x.shape[:2]
    spatial = x.shape[2:]
    k = len(spatial)
    cin_w, cout_g = w.shape[:2]
    kernel = w.shape[2:]
    if cin != cin_w or cin % groups:
        raise ValueError(f"transposed convolution: input has {cin} channels, weight has {cin_w} for {groups} groups")
    for i in range(k):
        if output_padding[i] >= max(stride[i], dilation[i]):
            raise ValueError("transposed convolution: output_padding must be smaller than stride or dilation")
    cin_g = cin // groups
    out_size = tuple(conv_transpose_output_size(spatial[i], kernel[i], stride[i], padding[i], dilation[i],
                                                output_padding[i]) for i in range(k))
    if any(o <= 0 for o in out_size):
        raise ValueError(f"transposed convolution: output size {out_size} is not positive for input {x.shape}")
    # contributions: (G, N*S, Cin_g) @ (G, Cin_g, Cout_g*K) -> (N, S..., G, Cout_g, K...)
    xs = x.reshape(n, groups, cin_g, -1).transpose(1, 0, 3, 2).reshape(groups, -1, cin_g)
    wg = w.reshape(groups, cin_g, -1)
    contrib = np.matmul(xs, wg).reshape(groups, n, *spatial, cout_g, *kernel)
    # to (N, G, Cout_g, *S, *K) so a tap slice lines up with the output's layout
    contrib = contrib.transpose(1, 0, 2 + k, *range(2, 2 + k), *range(3 + k, 3 + 2 * k))
    # the full (uncropped) output, long enough for the output_padding tail
    full = tuple((spatial[i] - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1 + output_padding[i] for i in range(k))
    acc = np.zeros((n, groups, cout_g, *full), dtype=contrib.dtype)
    for tap in np.ndindex(*kernel):
        target = tuple(slice(t * d, t * d + (s - 1) * st + 1, st)
                       for t, d, s, st in zip(tap, dilation, spatial, stride))
        acc[(Ellipsis, *target)] += contrib[(Ellipsis, *tap)]
    crop = tuple(slice(p, p + o) for p, o in zip(padding, out_size))
    return acc[(Ellipsis, *crop)].reshape(n, groups * cout_g, *out_size)


# ----------------------------------------------------------------------------- the kernel


@register_kernel("aten::convolution.out")
def convolution(input: np.ndarray, weight: np.ndarray, bias: Optional[np.ndarray], stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
                groups: int, out: np.ndarray) -> np.ndarray:
    """`aten::convolution.out`: input (N, C, *S) with 1 to 3 spatial dims, weight
    (Cout, Cin/groups, *K), or (Cin, Cout/groups, *K) when `transposed`."""
    if input.ndim not in (3, 4, 5) or weight.ndim != input.ndim:
        raise ValueError(f"convolution: expected a batched 1-D/2-D/3-D input and a matching weight, "
                         f"got shapes {input.shape} and {weight.shape}")
    if any(s < 1 for s in weight.shape[2:]):
        raise ValueError(f"convolution: empty kernel in weight of shape {weight.shape}")
    groups = int(groups)
    if groups < 1:
        raise ValueError(f"convolution: groups must be positive, got {groups}")
    k = input.ndim - 2
    stride = _spatial_params(stride, k, "stride")
    padding = _spatial_params(padding, k, "padding")
    dilation = _spatial_params(dilation, k, "dilation")
    if any(s < 1 for s in stride) or any(d < 1 for d in dilation) or any(p < 0 for p in padding):
        raise ValueError(f"convolution: invalid stride {stride}, padding {padding} or dilation {dilation}")
    dtype = _work_dtype(out.dtype)
    x, w = input.astype(dtype, copy=False), weight.astype(dtype, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        if transposed:
            output_padding = _spatial_params(output_padding, k, "output_padding") if output_padding else (0,) * k
            y = _conv_transposed(x, w, stride, padding, dilation, output_padding, groups)
        else:
            y = _conv_forward(x, w, stride, padding, dilation, groups)
        if bias is not None:
            if bias.shape != (y.shape[1],):
                raise ValueError(f"convolution: bias shape {bias.shape}, expected ({y.shape[1]},)")
            y = y + bias.astype(dtype, copy=False).reshape(-1, *(1,) * k)
    return write(out, y)
