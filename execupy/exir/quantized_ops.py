"""Out variants of torch's quantized_decomposed ops, so quantized graphs can be emitted.

torch defines the functional quantize/dequantize/choose_qparams ops a pt2e-quantized
graph calls (torch/ao/quantization/fx/_decomposed.py) but not their out variants, and
the emitter names every call by its out variant (passes.resolve_out_variant). These are
the schemas ExecuTorch's quantized kernel library registers; our kernels in
execupy/kernels/quantized/quant.py answer to the same keys. Each out variant runs its
functional op and copies into `out`, so the definitions are real ops, not placeholders.
"""
from __future__ import annotations

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (defines the functional ops)

NAMESPACE = "quantized_decomposed"

# out overload -> (functional overload it stands for, argument list after the op name)
OUT_VARIANTS: dict[str, tuple[str, str]] = {
    "quantize_per_tensor.out": (
        "quantize_per_tensor.default",
        "Tensor input, float scale, int zero_point, int quant_min, int quant_max, ScalarType dtype, "
        "*, Tensor(a!) out"),
    "quantize_per_tensor.Tensor_out": (
        "quantize_per_tensor.tensor",
        "Tensor input, Tensor scale, Tensor zero_point, int quant_min, int quant_max, ScalarType dtype, "
        "*, Tensor(a!) out"),
    "dequantize_per_tensor.out": (
        "dequantize_per_tensor.default",
        "Tensor input, float scale, int zero_point, int quant_min, int quant_max, ScalarType dtype, "
        "*, ScalarType? out_dtype=None, Tensor(a!) out"),
    "dequantize_per_tensor.Tensor_out": (
        "dequantize_per_tensor.tensor",
        "Tensor input, Tensor scale, Tensor zero_point, int quant_min, int quant_max, ScalarType dtype, "
        "*, ScalarType? out_dtype=None, Tensor(a!) out"),
    "quantize_per_channel.out": (
        "quantize_per_channel.default",
        "Tensor input, Tensor scales, Tensor zero_points, int axis, int quant_min, int quant_max, "
        "ScalarType dtype, *, Tensor(a!) out"),
    "dequantize_per_channel.out": (
        "dequantize_per_channel.default",
        "Tensor input, Tensor scales, Tensor? zero_points, int axis, int quant_min, int quant_max, "
        "ScalarType dtype, *, ScalarType? out_dtype=None, Tensor(a!) out"),
    "quantize_per_token.out": (
        "quantize_per_token.default",
        "Tensor input, Tensor scales, Tensor zero_points, int quant_min, int quant_max, ScalarType dtype, "
        "*, Tensor(a!) out"),
    "dequantize_per_token.out": (
        "dequantize_per_token.default",
        "Tensor input, Tensor scales, Tensor zero_points, int quant_min, int quant_max, ScalarType dtype, "
        "ScalarType output_dtype, *, Tensor(a!) out"),
}
# Two results, two out tensors.
TWO_OUT_VARIANTS: dict[str, tuple[str, str]] = {
    "choose_qparams.Tensor_out": (
        "choose_qparams.tensor",
        "Tensor input, int quant_min, int quant_max, float eps, ScalarType dtype, "
        "*, Tensor(a!) scale_out, Tensor(b!) zero_point_out"),
    "choose_qparams_per_token_asymmetric.out": (
        "choose_qparams_per_token_asymmetric.default",
        "Tensor input, ScalarType dtype, *, Tensor(a!) scale_out, Tensor(b!) zero_point_out"),
}

_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # must stay alive


def _functional(qualified: str) -> torch._ops.OpOverload:
    name, overload = qualified.split(".")
    return getattr(getattr(getattr(torch.ops, NAMESPACE), name), overload)


def _one_out_impl(functional: torch._ops.OpOverload):
    def impl(*args, out, **kwargs):
        result = functional(*args, **kwargs)
        out.resize_(result.shape).copy_(result)
        return out
    return impl


def _two_out_impl(functional: torch._ops.OpOverload):
    def impl(*args, scale_out, zero_point_out):
        scale, zero_point = functional(*args)
        scale_out.resize_(scale.shape).copy_(scale)
        zero_point_out.resize_(zero_point.shape).copy_(zero_point)
        return scale_out, zero_point_out
    return impl


def _define(table: dict[str, tuple[str, str]], returns: str, make_impl) -> None:
    for qualified, (functional, arguments) in table.items():
        name, overload = qualified.split(".")
        if overload in getattr(getattr(torch.ops, NAMESPACE), name).overloads():
            continue  # defined already (by another library loaded into this process)
        _LIBRARY.define(f"{name}.{overload}({arguments}) -> {returns}")
        _LIBRARY.impl(qualified, make_impl(_functional(functional)), "CompositeExplicitAutograd")


_define(OUT_VARIANTS, "Tensor(a!)", _one_out_impl)
_define(TWO_OUT_VARIANTS, "(Tensor(a!), Tensor(b!))", _two_out_impl)
