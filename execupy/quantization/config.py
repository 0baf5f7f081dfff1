"""Quantization configs for the pt2e flow: what each tensor of an annotated op becomes.

Static int8: activations per tensor (affine, observed during calibration with a histogram),
weights symmetric int8 in [-127, 127], per output channel or per tensor, bias kept float.
Dynamic int8: activations per token (each row of the last dimension gets its own affine
scale and zero point, chosen at run time), weights as above; the op's output stays float.

The specs are torchao's (torchao.quantization.pt2e.quantizer); the numbers (ranges, eps,
observers) follow ExecuTorch's XNNPACK quantizer so the files behave like theirs.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx
from torchao.quantization.pt2e import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver, PlaceholderObserver
from torchao.quantization.pt2e.quantizer import QuantizationConfig, QuantizationSpec

from ..errors import ExportError

# Smallest scale an observer picks (an all-zero tensor would otherwise get scale 0).
EPS = 2**-12


class PerTokenDynamicObserver(PlaceholderObserver):
    """Marks an activation for per-token dynamic quantization; observes nothing.

    torchao's convert_pt2e calls an observer's own `convert(model, node)` when it has one;
    this one replaces the observer node by ExecuTorch's per-token ops:
    choose_qparams_per_token_asymmetric -> quantize_per_token -> dequantize_per_token.
    """

    def convert(self, model: torch.fx.GraphModule, observer_node: torch.fx.Node) -> None:
        ops = torch.ops.quantized_decomposed
        graph = model.graph
        x = observer_node.args[0]
        qrange = (self.quant_min, self.quant_max, self.dtype)
        with graph.inserting_before(observer_node):
            qparams = graph.call_function(ops.choose_qparams_per_token_asymmetric.default, (x, self.dtype))
            scales = graph.call_function(operator.getitem, (qparams, 0))
            zero_points = graph.call_function(operator.getitem, (qparams, 1))
            q = graph.call_function(ops.quantize_per_token.default, (x, scales, zero_points, *qrange))
            dq = graph.call_function(ops.dequantize_per_token.default,
                                     (q, scales, zero_points, *qrange, torch.float32))
        observer_node.replace_all_uses_with(dq)
        graph.erase_node(observer_node)


def _activation_spec(is_dynamic: bool) -> QuantizationSpec:
    if is_dynamic:
        # is_dynamic stays False: torchao's metadata pass would look for its own
        # choose_qparams op; the observer's convert() inserts the per-token ops instead.
        return QuantizationSpec(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_affine,
                                observer_or_fake_quant_ctr=PerTokenDynamicObserver)
    return QuantizationSpec(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_affine,
                            observer_or_fake_quant_ctr=HistogramObserver.with_args(eps=EPS))


def _weight_spec(is_per_channel: bool) -> QuantizationSpec:
    if is_per_channel:
        return QuantizationSpec(dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric,
                                ch_axis=0, observer_or_fake_quant_ctr=PerChannelMinMaxObserver.with_args(eps=EPS))
    return QuantizationSpec(dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric,
                            observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=EPS))


def quantizes_per_token(config: QuantizationConfig) -> bool:
    """Whether `config` quantizes activations per token at run time."""
    act = config.input_activation
    return act is not None and act.observer_or_fake_quant_ctr is PerTokenDynamicObserver


@functools.lru_cache
def get_symmetric_quantization_config(is_per_channel: bool = False, is_qat: bool = False,
                                      is_dynamic: bool = False) -> QuantizationConfig:
    """The int8 config of ExecuTorch's XNNPACK flow (same signature; QAT is not supported).

    Dynamic configs have no output spec: a dynamically quantized op hands on float.
    """
    if is_qat:
        raise ExportError("get_symmetric_quantization_config: is_qat=True is not supported; "
                          "execupy's XNNPACKQuantizer does post-training quantization only")
    act = _activation_spec(is_dynamic)
    return QuantizationConfig(input_activation=act, output_activation=None if is_dynamic else act,
                              weight=_weight_spec(is_per_channel), bias=None, is_qat=False)
