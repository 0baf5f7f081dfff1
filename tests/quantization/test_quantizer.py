"""XNNPACKQuantizer's configuration API and the exporter's quantized_decomposed out variants."""
from __future__ import annotations

import pytest
import torch
from torch.export import export
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

import execupy.exir  # noqa: F401  (defines the out variants)
from execupy.errors import ExportError
from execupy.quantization import XNNPACKQuantizer, get_symmetric_quantization_config

from .zoo import MODELS, build

qd = torch.ops.quantized_decomposed


def weight_dequantizes(quantizer: XNNPACKQuantizer) -> int:
    """How many int8 weights the zoo's MLP (three linears) ends up with under `quantizer`."""
    [mlp] = [m for m in MODELS if m.name == "mlp"]
    example = (torch.randn(mlp.input_shape),)
    prepared = prepare_pt2e(export(build(mlp), example).module(), quantizer)
    prepared(*example)
    converted = convert_pt2e(prepared)
    return sum(n.target == qd.dequantize_per_channel.default for n in converted.graph.nodes)


def test_a_submodule_set_to_none_stays_float():
    config = get_symmetric_quantization_config(is_per_channel=True)
    assert weight_dequantizes(XNNPACKQuantizer().set_global(config)) == 3
    assert weight_dequantizes(XNNPACKQuantizer().set_global(config).set_module_name("net.2", None)) == 2
    assert weight_dequantizes(XNNPACKQuantizer().set_module_type(torch.nn.Linear, config)) == 3


def test_qat_config_is_refused_by_name():
    with pytest.raises(ExportError, match="is_qat"):
        get_symmetric_quantization_config(is_qat=True)


def test_out_variants_compute_what_the_functional_ops_do():
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    q = qd.quantize_per_tensor.out(x, 0.05, 3, -128, 127, torch.int8, out=torch.empty(0, dtype=torch.int8))
    assert torch.equal(q, qd.quantize_per_tensor(x, 0.05, 3, -128, 127, torch.int8))
    scale, zero_point = qd.choose_qparams_per_token_asymmetric.out(
        x, torch.int8, scale_out=torch.empty(0, dtype=torch.float64), zero_point_out=torch.empty(0, dtype=torch.int64))
    expected_scale, expected_zero_point = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
    assert torch.equal(scale, expected_scale) and torch.equal(zero_point, expected_zero_point)
