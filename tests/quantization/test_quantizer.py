"""XNNPACKQuantizer's configuration API and the exporter's quantized_decomposed out variants
(importing execupy.exir defines them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.export import export
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from execupy.exir import to_edge
from execupy.errors import ExportError
from execupy.quantization import XNNPACKQuantizer, get_symmetric_quantization_config
from execupy.runtime import Module

from .zoo import MODELS, build

qd = torch.ops.quantized_decomposed


def converted(name: str, quantizer: XNNPACKQuantizer) -> torch.fx.GraphModule:
    [model] = [m for m in MODELS if m.name == name]
    example = (torch.randn(model.input_shape),)
    prepared = prepare_pt2e(export(build(model), example).module(), quantizer)
    prepared(*example)
    return convert_pt2e(prepared)


def weight_dequantizes(quantizer: XNNPACKQuantizer) -> int:
    """How many int8 weights the zoo's MLP (three linears) ends up with under `quantizer`."""
    graph = converted("mlp", quantizer).graph
    return sum(n.target == qd.dequantize_per_channel.default for n in graph.nodes)


@pytest.mark.parametrize("name", ["mlp", "depthwise_separable"])
def test_relu_and_hardtanh_after_linear_or_conv_are_fused(name):
    """No quantize between a linear/conv and its relu/hardtanh; one after the activation."""
    config = get_symmetric_quantization_config(is_per_channel=True)
    aten = torch.ops.aten
    activations = [n for n in converted(name, XNNPACKQuantizer().set_global(config)).graph.nodes
                   if n.target in (aten.relu.default, aten.hardtanh.default)]
    assert activations
    for act in activations:
        assert act.args[0].target in (aten.linear.default, aten.conv2d.default)
        assert [u.target for u in act.users] == [qd.quantize_per_tensor.default]


def test_a_submodule_set_to_none_stays_float():
    config = get_symmetric_quantization_config(is_per_channel=True)
    assert weight_dequantizes(XNNPACKQuantizer().set_global(config)) == 3
    assert weight_dequantizes(XNNPACKQuantizer().set_global(config).set_module_name("net.2", None)) == 2
    assert weight_dequantizes(XNNPACKQuantizer().set_module_type(torch.nn.Linear, config)) == 3


def test_per_tensor_weights_export_and_run():
    """is_per_channel=False: one scale per weight tensor, which our runtime runs like torch."""
    [mlp] = [m for m in MODELS if m.name == "mlp"]
    model = converted("mlp", XNNPACKQuantizer().set_global(get_symmetric_quantization_config()))
    targets = [n.target for n in model.graph.nodes]
    assert qd.dequantize_per_channel.default not in targets
    x = torch.randn(mlp.input_shape)
    pte = to_edge(export(model, (x,))).to_executorch().buffer
    expected = model(x).detach().numpy()
    [output] = [n for n in model.graph.nodes if n.op == "output"]
    step = output.args[0][0].args[1]  # the scale the output is dequantized with
    assert np.max(np.abs(Module(pte).forward(x.numpy()) - expected)) <= step * (1 + 1e-4)


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
