"""Element-wise portable kernels against torch on seeded random inputs.

Every check calls the kernel the way the runtime does (all schema arguments in order,
then a numpy `out` of torch's result dtype and shape) and compares with torch's
functional overload of the same operator called with the same arguments. Where torch
rejects the arguments (e.g. `neg` of a bool tensor), the kernel must reject them too.
"""
from __future__ import annotations

import math
import zlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from execupy.kernels.registry import get_kernel

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["int8", "uint8", "int32", "int64"]
ALL = FLOATS + INTS + ["bool"]

# values every float sample contains: rounding ties, signed zeros, infinities, NaN
SPECIALS = [0.5, 1.5, 2.5, -0.5, -2.5, 0.0, -0.0, math.inf, -math.inf, math.nan]

TOLERANCE = {  # rtol, atol: one or two ulps of the result dtype
    np.dtype(np.float64): (1e-12, 1e-14),
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float16): (2e-3, 1e-3),
    BF16: (1.6e-2, 1e-2),
}


# ----------------------------------------------------------------------------- helpers


def np_dtype(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def sample(shape, dtype: str, seed: Any, *, specials: bool = True, nonzero: bool = False, low: int | None = None):
    """Seeded random values of `dtype`; floats are mostly N(0, 3) plus SPECIALS."""
    rng = np.random.default_rng(zlib.crc32(repr((shape, dtype, seed)).encode()))
    dt = np_dtype(dtype)
    n = int(np.prod(shape))
    if dtype == "bool":
        values = rng.random(n) < 0.5
    elif dtype in FLOATS:
        values = rng.standard_normal(n) * 3
        if specials:
            k = min(n, len(SPECIALS))
            values[rng.choice(n, k, replace=False)] = SPECIALS[:k]
    else:
        lo = low if low is not None else (0 if dtype == "uint8" else -20)
        values = rng.integers(lo, lo + 40, n)
    if nonzero and dtype != "bool":
        values = np.where(values == 0, 1, values)
    return values.astype(dt).reshape(shape)


def to_torch(x: Any) -> Any:
    if not isinstance(x, np.ndarray):
        return x
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def functional(key: str):
    """The functional overload whose arguments are the out variant's minus `out`."""
    name, overload = key.split("::")[1].split(".")
    packet = getattr(torch.ops.aten, name)
    out_args = [a for a in getattr(packet, overload)._schema.arguments if not a.is_out]
    wanted = [(a.name, str(a.type)) for a in out_args]
    for candidate in packet.overloads():
        schema = getattr(packet, candidate)._schema
        if not schema.is_mutable and [(a.name, str(a.type)) for a in schema.arguments] == wanted:
            return getattr(packet, candidate), out_args
    raise LookupError(f"no functional overload for {key}")


def torch_reference(key: str, args: list) -> torch.Tensor:
    op, schema_args = functional(key)
    positional, keywords = [], {}
    for spec, value in zip(schema_args, args):
        if spec.kwarg_only:
            keywords[spec.name] = to_torch(value)
        else:
            positional.append(to_torch(value))
    return op(*positional, **keywords)


def assert_matches(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype in TOLERANCE:
        rtol, atol = TOLERANCE[expected.dtype]
        np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol, atol, equal_nan=True)
    else:
        np.testing.assert_array_equal(actual, expected)


def check(key: str, *args: Any) -> np.ndarray:
    """Run kernel `key` on `args` and compare with torch; returns the kernel's result."""
    kernel = get_kernel(key)
    assert kernel is not None, f"no kernel registered for {key}"
    try:
        expected = to_numpy(torch_reference(key, list(args)))
    except (RuntimeError, TypeError, ValueError, ZeroDivisionError) as torch_error:
        first = next(a for a in args if isinstance(a, np.ndarray))
        with pytest.raises(Exception):
            kernel(*args, np.empty(first.shape, first.dtype))
        return torch_error
    out = np.full(expected.shape, 77, expected.dtype)  # garbage the kernel must overwrite
    result = kernel(*args, out)
    assert result is out, "a kernel must write into `out` and return it when the shape matches"
    assert_matches(result, expected)
    return result


# ----------------------------------------------------------------------------- unary math

FLOAT_UNARY = [
    "sqrt", "rsqrt", "reciprocal", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf",
]


@pytest.mark.parametrize("dtype", FLOATS + ["int32", "uint8", "bool"])
@pytest.mark.parametrize("name", FLOAT_UNARY)
def test_float_unary_ops_match_torch(name, dtype):
    # integer and bool inputs are promoted to float32, as torch does
    check(f"aten::{name}.out", sample((4, 9), dtype, name))


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("name", ["abs", "neg", "sign", "sgn", "ceil", "floor", "round", "trunc", "fix", "frac"])
def test_dtype_preserving_unary_ops_match_torch(name, dtype):
    check(f"aten::{name}.out", sample((4, 9), dtype, name))


def test_round_is_half_to_even_and_sign_of_nan_is_zero():
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, np.nan], np.float32)
    rounded = check("aten::round.out", x)
    assert rounded[:5].tolist() == [0.0, 2.0, 2.0, -0.0, -2.0]
    assert check("aten::sign.out", x)[5] == 0.0


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("decimals", [-1, 0, 2, 3])
def test_round_decimals_matches_torch(decimals, dtype):
    check("aten::round.decimals_out", sample((4, 9), dtype, "round") * 7, decimals)


def test_erf_is_accurate_in_float64():
    x = np.concatenate([np.linspace(-7, 7, 2001), [1e-300, -1e-12, 0.999999, 1.0, 5.999, 6.0]])
    expected = np.array([math.erf(v) for v in x])
    actual = check("aten::erf.out", x)
    np.testing.assert_allclose(actual, expected, rtol=5e-15, atol=1e-16)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("name", ["isnan", "isinf"])
def test_isnan_isinf_match_torch(name, dtype):
    check(f"aten::{name}.out", sample((4, 9), dtype, name))


@pytest.mark.parametrize("dtype", FLOATS + ["int32"])
@pytest.mark.parametrize("fills", [(None, None, None), (1.5, 100.0, -100.0)])
def test_nan_to_num_matches_torch(fills, dtype):
    check("aten::nan_to_num.out", sample((4, 9), dtype, "nan_to_num"), *fills)


# ----------------------------------------------------------------------------- binary arithmetic

BINARY = ["add", "sub", "mul", "div", "remainder", "fmod", "pow", "maximum", "minimum", "atan2", "hypot", "copysign"]
TENSOR_KEY = {
    "add": "add.out", "sub": "sub.out", "mul": "mul.out", "div": "div.out", "remainder": "remainder.Tensor_out",
    "fmod": "fmod.Tensor_out", "pow": "pow.Tensor_Tensor_out", "maximum": "maximum.out", "minimum": "minimum.out",
    "atan2": "atan2.out", "hypot": "hypot.out", "copysign": "copysign.out",
}
SCALAR_KEY = {
    "add": "add.Scalar_out", "sub": "sub.Scalar_out", "mul": "mul.Scalar_out", "div": "div.Scalar_out",
    "remainder": "remainder.Scalar_out", "fmod": "fmod.Scalar_out", "pow": "pow.Tensor_Scalar_out",
    "copysign": "copysign.Scalar_out",
}
DIVIDES = {"div", "remainder", "fmod"}


def operands(name: str, dtype_a: str, dtype_b: str, shape_a=(3, 1, 5), shape_b=(4, 5)):
    """Broadcasting operands; integer divisors are nonzero, integer exponents non-negative."""
    a = sample(shape_a, dtype_a, (name, "a"))
    int_b = dtype_b not in FLOATS
    b = sample(shape_b, dtype_b, (name, "b"), nonzero=name in DIVIDES, low=0 if name == "pow" and int_b else None)
    if name == "pow" and int_b:
        b = np.minimum(b, 5).astype(b.dtype)  # keep integer powers from overflowing into noise
    return a, b


def with_alpha(name: str, args: tuple, alpha: Any) -> tuple:
    return args + (alpha,) if name in ("add", "sub") else args


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("name", BINARY)
def test_binary_ops_broadcast_and_match_torch(name, dtype):
    check(f"aten::{TENSOR_KEY[name]}", *with_alpha(name, operands(name, dtype, dtype), 1))


MIXED = [("int64", "float32"), ("uint8", "int8"), ("bool", "int32"), ("float16", "float32"), ("int32", "float16"),
         ("bfloat16", "float16"), ("int8", "int64"), ("bfloat16", "float64"), ("bool", "float32")]


@pytest.mark.parametrize("dtypes", MIXED, ids="-".join)
@pytest.mark.parametrize("name", BINARY)
def test_binary_ops_promote_mixed_dtypes_like_torch(name, dtypes):
    check(f"aten::{TENSOR_KEY[name]}", *with_alpha(name, operands(name, *dtypes), 1))


@pytest.mark.parametrize("dtypes", [("float16", "float32"), ("int32", "int64"), ("uint8", "float64"), ("int8", "bool")],
                         ids="-".join)
@pytest.mark.parametrize("name", ["add", "mul", "div", "maximum"])
def test_zero_dim_tensors_do_not_widen_their_category(name, dtypes):
    a, b = operands(name, *dtypes, shape_b=())
    check(f"aten::{TENSOR_KEY[name]}", *with_alpha(name, (a, b), 1))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "uint8", "int8", "bool"])
@pytest.mark.parametrize("name", sorted(SCALAR_KEY))
def test_binary_scalar_overloads_match_torch(name, dtype):
    # 300 overflows uint8/int8 (wraps, or is refused by pow); a float scalar promotes an int tensor
    a = sample((3, 5), dtype, (name, "scalar"), low=0 if name == "pow" else None)
    for scalar in [2, -3, 300, 2.5, -0.75, True]:
        check(f"aten::{SCALAR_KEY[name]}", *with_alpha(name, (a, scalar), 1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
@pytest.mark.parametrize("key", ["add.out", "sub.out", "add.Scalar_out", "sub.Scalar_out", "rsub.Scalar_out"])
def test_alpha_scales_the_other_operand(key, dtype):
    a = sample((3, 5), dtype, key)
    b = sample((5,), dtype, (key, "b")) if key.endswith(".out") else (True if dtype == "bool" else 3)
    for alpha in [2, -1, 0.5, True]:  # float alpha is refused for integers, bool alpha for non-bool results
        check(f"aten::{key}", a, b, alpha)


@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("float16", "float16"), ("int32", "int32"),
                                    ("int64", "int8"), ("uint8", "uint8"), ("float64", "int32")], ids="-".join)
@pytest.mark.parametrize("mode", [None, "trunc", "floor"])
def test_div_rounding_modes_match_torch(mode, dtypes):
    a, b = operands("div", *dtypes)
    check("aten::div.out_mode", a, b, mode)
    check("aten::div.Scalar_mode_out", a, -3, mode)
    check("aten::floor_divide.out", a, b)
    check("aten::floor_divide.Scalar_out", a, 4)


def test_integer_division_by_zero_raises():
    a = np.array([1, 2], np.int32)
    for key in ("aten::div.out_mode", "aten::remainder.Tensor_out", "aten::fmod.Tensor_out"):
        args = (a, np.array([1, 0], np.int32)) + (("floor",) if key.endswith("mode") else ())
        with pytest.raises(ZeroDivisionError):
            get_kernel(key)(*args, np.empty(2, np.int32))


def test_float_floor_division_by_zero_gives_signed_infinity():
    a = np.array([-7.0, 0.0, 7.0], np.float32)
    out = check("aten::div.out_mode", a, np.zeros(3, np.float32), "floor")
    assert np.isneginf(out[0]) and np.isnan(out[1]) and np.isposinf(out[2])


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_pow_with_a_scalar_base_matches_torch(dtype):
    check("aten::pow.Scalar_out", 2.0, sample((3, 5), dtype, "pow_base", low=0))
    check("aten::pow.Scalar_out", 3, sample((3, 5), dtype, "pow_base", low=0))


# ----------------------------------------------------------------------------- activations

ACTIVATIONS = [
    ("relu.out", ()), ("gelu.out", ("none",)), ("gelu.out", ("tanh",)), ("elu.out", (1.0, 1.0, 1.0)),
    ("elu.out", (0.5, 1.5, 2.0)), ("hardtanh.out", (-1, 1)), ("hardtanh.out", (-0.5, 0.7)), ("hardtanh.out", (0.0, 6.0)),
    ("leaky_relu.out", (0.01,)), ("leaky_relu.out", (0.2,)), ("hardswish.out", ()), ("hardsigmoid.out", ()),
    ("silu.out", ()), ("softplus.out", (1, 20)), ("softplus.out", (2.0, 3.0)), ("mish.out", ()),
    ("glu.out", (-1,)), ("glu.out", (0,)), ("logit.out", (None,)), ("logit.out", (1e-3,)),
    ("threshold.out", (0.5, -2.0)),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("key, params", ACTIVATIONS, ids=lambda v: repr(v))
def test_activations_match_torch(key, params, dtype):
    x = sample((4, 6), dtype, key)
    if key == "gelu.out":
        x[np.isposinf(x)] = 7  # torch's float32 gelu(+inf) is NaN, a quirk of its vector erf; ours is +inf
    if key == "logit.out":
        x = (np.abs(x.astype(np.float32)) / 8).astype(x.dtype)  # mostly inside (0, 1), some outside
    check(f"aten::{key}", x, *params)


@pytest.mark.parametrize("dtype", ["int32", "int8", "bool"])
@pytest.mark.parametrize("key, params", [("relu.out", ()), ("hardtanh.out", (-3, 5)), ("threshold.out", (2, 9))])
def test_integer_activations_match_torch(key, params, dtype):
    check(f"aten::{key}", sample((4, 6), dtype, key), *params)


def test_large_inputs_do_not_overflow_sigmoid_silu_softplus():
    x = np.array([-1e4, -90.0, 0.0, 90.0, 1e4], np.float32)
    for key in ("aten::sigmoid.out", "aten::silu.out", "aten::softplus.out", "aten::gelu.out"):
        extra = {"aten::softplus.out": (1, 20), "aten::gelu.out": ("none",)}.get(key, ())
        assert np.isfinite(check(key, x, *extra)).all()


# ----------------------------------------------------------------------------- comparisons and where

COMPARISONS = ["eq", "ne", "lt", "le", "gt", "ge"]


@pytest.mark.parametrize("dtypes", [(d, d) for d in ALL] + MIXED, ids="-".join)
@pytest.mark.parametrize("name", COMPARISONS)
def test_tensor_comparisons_match_torch(name, dtypes):
    a, b = operands(name, *dtypes)
    b = b.copy()
    b.reshape(-1)[:3] = a.reshape(-1)[:3].astype(b.dtype)  # some equal elements
    check(f"aten::{name}.Tensor_out", a, b)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int64", "uint8", "int8", "bool"])
@pytest.mark.parametrize("name", COMPARISONS)
def test_scalar_comparisons_use_torch_promotion(name, dtype):
    # uint8 == -1 compares with 255, float16 < 0.1 with 0.1 rounded to half
    x = sample((3, 5), dtype, "cmp")
    for scalar in [0, 2, -1, 300, 0.1, -2.5, True, math.inf]:
        check(f"aten::{name}.Scalar_out", x, scalar)


def test_wrapped_scalars_follow_the_tensor_dtype():
    u8 = np.array([255, 44, 1], np.uint8)
    assert check("aten::eq.Scalar_out", u8, -1).tolist() == [True, False, False]
    assert check("aten::eq.Scalar_out", u8, 300).tolist() == [False, True, False]


@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("int64", "float32"), ("float16", "float64"),
                                    ("bfloat16", "bfloat16"), ("bool", "int8"), ("int32", "int32"), ("float32", "float16")],
                         ids="-".join)
def test_where_broadcasts_and_promotes_like_torch(dtypes):
    cond = sample((3, 1, 5), "bool", "cond")
    a = sample((4, 5), dtypes[0], "a")
    b = sample((3, 4, 1), dtypes[1], "b")
    check("aten::where.self_out", cond, a, b)
    check("aten::where.self_out", cond, a, b[0, 0, :1].reshape(()))  # a 0-dim "other", as edge programs write


# ----------------------------------------------------------------------------- logical and bitwise


@pytest.mark.parametrize("dtypes", [("bool", "bool"), ("float32", "float32"), ("int32", "bool"), ("float16", "int8"),
                                    ("bfloat16", "float64")], ids="-".join)
@pytest.mark.parametrize("name", ["logical_and", "logical_or", "logical_xor"])
def test_logical_ops_treat_nonzero_and_nan_as_true(name, dtypes):
    a, b = operands(name, *dtypes)
    check(f"aten::{name}.out", a, b)


@pytest.mark.parametrize("dtype", ALL)
def test_logical_not_matches_torch(dtype):
    check("aten::logical_not.out", sample((3, 5), dtype, "not"))


@pytest.mark.parametrize("dtypes", [(d, d) for d in INTS + ["bool"]] + [("uint8", "int8"), ("bool", "int32"),
                                                                        ("int32", "int64")], ids="-".join)
@pytest.mark.parametrize("name", ["bitwise_and", "bitwise_or", "bitwise_xor"])
def test_bitwise_tensor_ops_match_torch(name, dtypes):
    check(f"aten::{name}.Tensor_out", *operands(name, *dtypes))


@pytest.mark.parametrize("scalar", [0x0F, -2, 300, True], ids=repr)
@pytest.mark.parametrize("dtype", INTS + ["bool"])
@pytest.mark.parametrize("name", ["bitwise_and", "bitwise_or", "bitwise_xor"])
def test_bitwise_scalar_ops_match_torch(name, dtype, scalar):
    check(f"aten::{name}.Scalar_out", sample((3, 5), dtype, name), scalar)


@pytest.mark.parametrize("dtype", ALL)
def test_bitwise_not_matches_torch(dtype):
    check("aten::bitwise_not.out", sample((3, 5), dtype, "invert"))  # floats: both reject


# ----------------------------------------------------------------------------- clamp


@pytest.mark.parametrize("bounds", [(-0.5, 0.5), (0.1, None), (None, 2), (2, -1), (-3, 5), (None, None), (0.5, 300)],
                         ids=repr)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "uint8", "int8"])
def test_clamp_with_scalar_bounds_matches_torch(dtype, bounds):
    check("aten::clamp.out", sample((3, 5), dtype, "clamp"), *bounds)


@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("int32", "int32"), ("float16", "float32"),
                                    ("int64", "float32"), ("bfloat16", "bfloat16")], ids="-".join)
def test_clamp_with_tensor_bounds_broadcasts_like_torch(dtypes):
    x = sample((3, 5), dtypes[0], "x")
    lo, hi = sample((5,), dtypes[1], "lo"), sample((3, 1), dtypes[1], "hi")  # lo > hi in places: hi wins
    check("aten::clamp.Tensor_out", x, lo, hi)
    check("aten::clamp.Tensor_out", x, lo, None)
    check("aten::clamp.Tensor_out", x, None, hi)
    check("aten::clamp_min.out", x, 0.25)
    check("aten::clamp_max.out", x, -1)
    check("aten::clamp_min.Tensor_out", x, lo)
    check("aten::clamp_max.Tensor_out", x, hi)


def test_clamp_keeps_nan():
    out = check("aten::clamp.out", np.array([np.nan, 3.0], np.float32), -1.0, 1.0)
    assert np.isnan(out[0]) and out[1] == 1.0


# ----------------------------------------------------------------------------- the calling convention


def test_kernels_write_into_non_contiguous_out_views():
    x = sample((4, 6), "float32", "view")
    out = np.zeros((6, 4), np.float32).T  # a permuted dim order, as planned memory may be
    assert get_kernel("aten::add.out")(x, x, 1, out) is out
    np.testing.assert_array_equal(out, x + x)


def test_dynamic_shapes_return_a_new_array_of_out_dtype():
    x = sample((2, 3), "float32", "dyn")
    out = np.zeros((4, 3), np.float16)  # planned for an upper bound; the runtime copies the result in
    result = get_kernel("aten::exp.out")(x, out)
    assert result.shape == (2, 3) and result.dtype == np.float16
    np.testing.assert_allclose(result.astype(np.float32), np.exp(x), rtol=1e-3)


@pytest.mark.parametrize("shape", [(), (0, 3)], ids=["0-dim", "empty"])
def test_zero_dim_and_empty_tensors(shape):
    x = sample(shape, "float32", "edge")
    i = sample(shape, "int32", "edge")
    cond = sample(shape, "bool", "edge")
    cases = [
        ("aten::erf.out", x), ("aten::gelu.out", x, "none"), ("aten::relu.out", x), ("aten::sign.out", x),
        ("aten::round.out", x), ("aten::add.out", x, i, 2), ("aten::div.out_mode", i, i + 100, "trunc"),
        ("aten::gt.Tensor_out", x, i), ("aten::where.self_out", cond, x, i), ("aten::clamp.out", x, -1, None),
        ("aten::bitwise_and.Tensor_out", i, i), ("aten::logical_not.out", x), ("aten::isnan.out", x),
    ]
    for key, *args in cases:
        assert check(key, *args).shape == shape
