"""XNNPACKQuantizer: the int8 pt2e quantizer, under ExecuTorch's names, for torchao's flow.

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    m = prepare_pt2e(export(model, example).module(), quantizer)   # torchao
    m(*calibration)
    m = convert_pt2e(m)                                            # torchao
    prog = to_edge(export(m, example)).to_executorch()

Annotating marks, on each supported op node, which of its inputs and its output get
quantized (a QuantizationAnnotation in node.meta); torchao then inserts observers there and
later turns them into quantized_decomposed quantize/dequantize pairs. What is annotated:

  static   linear, conv1d/conv2d (depthwise too; batch norm is folded by prepare_pt2e),
           add, mul, cat, pooling; a relu/hardtanh that is the only user of a linear, conv,
           add or mul is fused (quantized once, after the activation). Ops that keep values
           as they are (relu, hardtanh, pooling, views, ...) share their input's qparams.
  dynamic  linear only (its input per token at run time, its output float).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationConfig,
    Quantizer,
    SharedQuantizationSpec,
    get_module_name_filter,
)

from .config import quantizes_per_token

aten = torch.ops.aten
ANNOTATION = "quantization_annotation"  # the node.meta key torchao reads

LINEAR = {aten.linear.default}
CONV = {aten.conv1d.default, aten.conv2d.default, aten.convolution.default}
BINARY = {aten.add.Tensor, aten.add_.Tensor, aten.mul.Tensor, aten.mul_.Tensor}
ACTIVATIONS = {aten.relu.default, aten.relu_.default, aten.hardtanh.default, aten.hardtanh_.default}
POOLING = {aten.max_pool1d.default, aten.max_pool2d.default, aten.avg_pool1d.default, aten.avg_pool2d.default,
           aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default, aten.mean.dim, aten.mean.default}
# Ops whose outputs stay within their input's range (rearranged, clamped, maxed or
# averaged): their output fits the input's qparams, so they share them.
SHARES_INPUT_QPARAMS = ACTIVATIONS | POOLING | {
    aten.view.default, aten.reshape.default, aten.flatten.using_ints, aten.permute.default,
    aten.transpose.int, aten.squeeze.dim, aten.unsqueeze.default, aten.slice.Tensor,
    aten.dropout.default, aten.contiguous.default,
}


@dataclass
class NodeFilter:
    """Which nodes a config applies to: all, or those from the named submodules/types."""

    module_names: tuple[str, ...] = ()
    module_types: tuple[type, ...] = ()

    def __call__(self, node: Node) -> bool:
        if not self.module_names and not self.module_types:
            return True
        if any(get_module_name_filter(name)(node) for name in self.module_names):
            return True
        stack = node.meta.get("nn_module_stack", {}).values()
        qualnames = {t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}" for _, t in stack}
        return any(f"{t.__module__}.{t.__qualname__}" in qualnames for t in self.module_types)


def _annotated(node: Node) -> bool:
    a = node.meta.get(ANNOTATION)
    return a is not None and a._annotated


def _annotate(node: Node, inputs: dict, output=None) -> None:
    node.meta[ANNOTATION] = QuantizationAnnotation(input_qspec_map=inputs, output_qspec=output, _annotated=True)


def _is_float_tensor(arg) -> bool:
    val = arg.meta.get("val") if isinstance(arg, Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _fused_activation(node: Node) -> Optional[Node]:
    """The relu/hardtanh that is `node`'s only user, quantized in its place."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    return user if user.op == "call_function" and user.target in ACTIVATIONS else None


def _annotate_output(node: Node, config: QuantizationConfig) -> None:
    """Quantize `node`'s output, or, when a relu/hardtanh follows, that activation's output."""
    act = _fused_activation(node)
    output = config.output_activation
    if act is None or output is None:
        node.meta[ANNOTATION].output_qspec = output
        return
    _annotate(act, {}, output)


def annotate_weighted(node: Node, config: QuantizationConfig) -> None:
    """linear / conv: input activation, weight (bias stays float), output."""
    x, weight = node.args[0], node.args[1]
    if quantizes_per_token(config) and node.target not in LINEAR:
        return  # dynamic quantization covers linear layers only
    if not (_is_float_tensor(x) and isinstance(weight, Node)):
        return
    _annotate(node, {x: config.input_activation, weight: config.weight})
    _annotate_output(node, config)


def annotate_binary(node: Node, config: QuantizationConfig) -> None:
    """add / mul of two activations (a scalar operand stays a literal)."""
    inputs = {a: config.input_activation for a in node.args[:2] if _is_float_tensor(a)}
    if not inputs or not _is_float_tensor(node):
        return
    _annotate(node, inputs)
    _annotate_output(node, config)


def annotate_cat(node: Node, config: QuantizationConfig) -> None:
    """cat: every input and the output share one set of qparams (the first input's edge)."""
    tensors = [a for a in node.args[0] if isinstance(a, Node)]
    if not tensors or not all(_is_float_tensor(a) for a in tensors):
        return
    shared = SharedQuantizationSpec((tensors[0], node))
    inputs = {a: shared for a in tensors[1:]}
    inputs[tensors[0]] = config.input_activation
    _annotate(node, inputs, shared)


def annotate_pooling(node: Node, config: QuantizationConfig) -> None:
    """Pooling: a quantized input, and the output on the same qparams."""
    x = node.args[0]
    if not _is_float_tensor(x) or not _is_float_tensor(node):
        return
    _annotate(node, {x: config.input_activation}, SharedQuantizationSpec((x, node)))


# op -> annotator, run in this order (linear and conv first, so their fused activations
# are claimed before anything shares qparams through them).
ANNOTATORS: list[tuple[set, Callable[[Node, QuantizationConfig], None], bool]] = [
    # (targets, annotator, also in dynamic mode)
    (LINEAR | CONV, annotate_weighted, True),
    (BINARY, annotate_binary, False),
    ({aten.cat.default}, annotate_cat, False),
    (POOLING - {aten.max_pool1d.default, aten.max_pool2d.default}, annotate_pooling, False),
]


def propagate_shared_qparams(gm: GraphModule) -> None:
    """Ops that keep values (views, relu, max pool...) after a quantized output share its qparams,
    so the quantized value flows through them without a requantize."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in SHARES_INPUT_QPARAMS or _annotated(node):
            continue
        prev = node.args[0]
        producer = prev.meta.get(ANNOTATION) if isinstance(prev, Node) else None
        if producer is None or producer.output_qspec is None:
            continue
        shared = SharedQuantizationSpec(prev)
        _annotate(node, {prev: shared}, shared)


class XNNPACKQuantizer(Quantizer):
    """Annotates an exported model for int8 quantization the way ExecuTorch's XNNPACK flow does.

    set_global(config) applies everywhere; set_module_name / set_module_type give a
    submodule its own config (or None to leave it float), and win over the global one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.global_config: Optional[QuantizationConfig] = None
        self.module_name_config: dict[str, Optional[QuantizationConfig]] = {}
        self.module_type_config: dict[type, Optional[QuantizationConfig]] = {}

    def set_global(self, config: QuantizationConfig) -> "XNNPACKQuantizer":
        self.global_config = config
        return self

    def set_module_name(self, name: str, config: Optional[QuantizationConfig]) -> "XNNPACKQuantizer":
        self.module_name_config[name] = config
        return self

    def set_module_type(self, module_type: type, config: Optional[QuantizationConfig]) -> "XNNPACKQuantizer":
        self.module_type_config[module_type] = config
        return self

    def _configs(self) -> list[tuple[NodeFilter, Optional[QuantizationConfig]]]:
        """Most specific first; the first filter a node passes decides its config."""
        return ([(NodeFilter(module_names=(n,)), c) for n, c in self.module_name_config.items()]
                + [(NodeFilter(module_types=(t,)), c) for t, c in self.module_type_config.items()]
                + [(NodeFilter(), self.global_config)])

    def config_for(self, node: Node) -> Optional[QuantizationConfig]:
        return next((c for f, c in self._configs() if f(node)), None)

    def annotate(self, model: GraphModule) -> GraphModule:
        for targets, annotator, dynamic_too in ANNOTATORS:
            for node in model.graph.nodes:
                if node.op != "call_function" or node.target not in targets or _annotated(node):
                    continue
                config = self.config_for(node)
                if config is None or (quantizes_per_token(config) and not dynamic_too):
                    continue
                annotator(node, config)
        propagate_shared_qparams(model)
        return model

    def validate(self, model: GraphModule) -> None:
        """Nothing to check: every annotation comes from a supported config."""
