"""Turn a delegated fx subgraph into an XNNGraph (fp32, fp16, qd8/qs8; docs/xnnpack-export.md), one aten op at a time.

`OPS` is the table both halves use: the partitioner asks `supported(node)` (its check),
preprocess calls its emitter. Emitters add XNNPACK nodes through `GraphBuilder`, which
names values (runtime inputs, constants, results) and marks the subgraph's inputs and
outputs as external values in DelegateCall order, as ExecuTorch's runtime binds them.

Layouts follow ExecuTorch's preprocess: FullyConnected filters are [out, in]; convolution
runs in NHWC with filters stored channels-last (O,H,W,I; depthwise [1,H,W,O]; transposed
[G*O_g,H,W,I_g]). A value stays NHWC from the convolution that makes it through the
elementwise ops, pools and convolutions after it; StaticTranspose nodes stand only where a
reader needs torch's layout or the subgraph returns the value. As ExecuTorch's export does,
a batch norm right after a float convolution is folded into its filter and bias, and a
relu/hardtanh/clamp into the output bounds of the node computing its input.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.fx

from ...backends.xnnpack.schema import EXTERNAL_INPUT, EXTERNAL_OUTPUT, NO_VALUE
from ...errors import ExportError
from ..passes import sym_upper_bound
from .payload import NO_DEBUG_HANDLE, XGraph, XNode, XValue

aten = torch.ops.aten
MAX_DIMS = 6  # XNN_MAX_TENSOR_DIMS
KEEP_DIMS = 0x40
ALIGN_CORNERS = 0x8
TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
PER_CHANNEL, PER_TENSOR, PER_TOKEN, PER_CHANNEL_GROUP = 1, 2, 3, 4  # XNNQuantParams tags
QB4W_ZERO_POINT = 8  # XNNPACK stores 4-bit filter values unsigned, around 8
QB4W_BLOCK = 32  # XNNPACK's blockwise filters take groups of a multiple of 32 input channels
qd = torch.ops.quantized_decomposed

IsConst = Callable[[Any], bool]


# ---------------------------------------------------------------- the builder


class GraphBuilder:
    """Values and nodes of one XNNGraph being built from a subgraph."""

    def __init__(self, constants: dict[torch.fx.Node, torch.Tensor], outputs: list[torch.fx.Node]):
        self.graph = XGraph()
        self.constants = constants
        self.ids: dict[torch.fx.Node, int] = {}  # node -> its result, laid out as torch has it
        # Node -> its 4-D result held channels-last (NHWC), as convolutions read and write it. A chain
        # conv -> relu -> conv -> add stays NHWC; the NCHW form is transposed from it only when
        # something reads that (value()), or the subgraph returns it (define_nhwc()).
        self.channels_last: dict[torch.fx.Node, int] = {}
        self.output_index = {n: i for i, n in enumerate(outputs)}
        self.num_inputs = 0
        # Static int8: the (scale, zero point) each such node's result is stored with (qint8).
        self.static: dict[torch.fx.Node, tuple[float, int]] = {}
        # The float type ("fp32" or "fp16") of the node being lowered: its temporaries and constants.
        self.float_type = "fp32"
        self.debug_handle = NO_DEBUG_HANDLE  # of the fx node being lowered: its XNNPACK nodes carry it

    # -- values

    def input(self, node: torch.fx.Node) -> None:
        """A subgraph input: float, or the int8 values of a static quantize another delegate computed."""
        params = next((p for u in node.users if (p := _per_tensor(u, qd.dequantize_per_tensor.default))), None)
        if params is not None and _val(node) is not None and _val(node).dtype == torch.int8:
            self.ids[node] = self.quantized_temp(_dims(node), params)
            self.graph.values[self.ids[node]].external_id = self.num_inputs
            self.graph.values[self.ids[node]].flags = EXTERNAL_INPUT
        else:
            self.ids[node] = self.graph.add_value(XValue(_float_type(node), _dims(node), external_id=self.num_inputs,
                                                         flags=EXTERNAL_INPUT))
        self.graph.input_ids.append(self.ids[node])
        self.num_inputs += 1

    def constant(self, data: np.ndarray) -> int:
        """A float constant, stored in the float type of the node being lowered."""
        data = np.ascontiguousarray(data, dtype=np.float16 if self.float_type == "fp16" else np.float32)
        idx = self.graph.add_constant(data)
        return self.graph.add_value(XValue(self.float_type, list(data.shape) or [1], constant_buffer_idx=idx))

    @staticmethod
    def stored(arg: Any) -> Any:
        """The node whose value `arg` reads: a static int8 dequantize is its quantized input itself
        (the reader runs on qint8)."""
        return arg.args[0] if _per_tensor(arg, qd.dequantize_per_tensor.default) is not None else arg

    def value(self, arg: Any) -> int:
        """The value id of an operand as torch lays it out: a runtime value, a constant or a number."""
        src = self.stored(arg)
        if src is not arg and src not in self.ids and src not in self.channels_last:
            raise ExportError(f"XnnpackBackend: {arg.name} dequantizes {src.name}, which is not a computed int8 value")
        arg = src
        if isinstance(arg, torch.fx.Node):
            if arg not in self.ids:
                if arg in self.channels_last:
                    self.ids[arg] = self.transpose(self.channels_last[arg], TO_NCHW)
                elif arg in self.constants:
                    self.ids[arg] = self.constant(self.constants[arg].detach().float().numpy())
                else:
                    raise ExportError(f"XnnpackBackend: operand {arg.name} is neither computed nor constant")
            return self.ids[arg]
        return self.constant(np.array([arg], np.float32))

    def held_nhwc(self, arg: Any) -> bool:
        return isinstance(arg, torch.fx.Node) and self.stored(arg) in self.channels_last

    def nhwc_value(self, arg: torch.fx.Node) -> int:
        """The value id of a 4-D operand channels-last (transposed once, for all its NHWC readers)."""
        node = self.stored(arg)
        if node not in self.channels_last:
            self.channels_last[node] = self.transpose(self.value(node), TO_NHWC)
        return self.channels_last[node]

    def define_nhwc(self, node: torch.fx.Node, out: int) -> None:
        """`node`'s result is value `out`, channels-last; a returned one is also transposed out."""
        self.channels_last[node] = out
        if node in self.output_index:
            self.transpose(out, TO_NCHW, self.result(node))

    def dynamic_quantized(self, src: int) -> int:
        """Convert an fp32 value to qdint8 (int8 with a scale and zero point per row, chosen at run time)."""
        out = self.graph.add_value(XValue("qdint8", list(self.dims(src)), quant=(PER_TOKEN, [(0, "Int32", 1)])))
        self.add("Convert", input_id=src, output_id=out, flags=0)
        return out

    def per_channel_filter(self, q: Any, scales: Any, channel_dim: int = 0) -> int:
        """An int8 filter ([out, in], or a convolution's) with one scale per output channel (qcint8)."""
        q = q.detach().numpy() if isinstance(q, torch.Tensor) else q
        idx = self.graph.add_constant(np.ascontiguousarray(q).astype(np.int8))
        quant = (PER_CHANNEL, [(0, "floats", _floats(scales)), (1, "Int32", channel_dim)])
        return self.graph.add_value(XValue("qcint8", [int(d) for d in q.shape], constant_buffer_idx=idx, quant=quant))

    def static_bias(self, bias: Any, x_scale: float, w_scales: torch.Tensor) -> int:
        """A float bias as XNNPACK's int32 one (qcint32), on the accumulator's scales x_scale * w_scale[c]."""
        if bias is None:
            return NO_VALUE
        scales = (np.float32(x_scale) * _floats(w_scales)).astype(np.float32)
        b = self.constants[bias].detach().double().numpy()
        q = np.clip(np.round(b / scales.astype(np.float64)), -2 ** 31, 2 ** 31 - 1).astype(np.int32)
        idx = self.graph.add_constant(q)
        quant = (PER_CHANNEL, [(0, "floats", scales), (1, "Int32", 0)])
        return self.graph.add_value(XValue("qcint32", [int(q.size)], constant_buffer_idx=idx, quant=quant))

    def quantized_temp(self, dims: list[int], params: tuple[float, int]) -> int:
        scale, zero = params
        quant = (PER_TENSOR, [(0, "Float32", scale), (1, "Int32", zero)])
        return self.graph.add_value(XValue("qint8", list(dims), quant=quant))

    def blockwise_filter(self, q: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int]) -> int:
        """A 4-bit [out, in] filter with one scale per group of in-channels (qbint4): the values
        stored unsigned (q + 8) two per byte, even columns in the low nibble; the scales bf16,
        in named data under "scale_" + their SHA-256 (what ExecuTorch writes)."""
        n, k = shape
        u = (q.detach().to(torch.int16).reshape(n, k) + QB4W_ZERO_POINT).to(torch.uint8).numpy()
        idx = self.graph.add_constant(u[:, 0::2] | (u[:, 1::2] << 4))
        bf16 = scales.detach().float().to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        scale_idx = self.graph.add_constant(bf16, prefix="scale_")
        group = k * n // bf16.size
        quant = (PER_CHANNEL_GROUP, [(0, "floats", []), (1, "Int32", 0), (2, "Int32", group),
                                     (4, "Uint32", scale_idx), (5, "Uint32", bf16.size)])
        return self.graph.add_value(XValue("qbint4", [n, k], constant_buffer_idx=idx, quant=quant))

    def quantized_filter(self, weight: "QuantizedWeight") -> int:
        zero = weight.zero_point
        if zero is not None and bool(self.constants[zero].any()):
            raise ExportError(f"XnnpackBackend: {zero.name}: nonzero weight zero points (XNNPACK's filters are "
                              "symmetric)")
        if weight.grouped:
            return self.blockwise_filter(self.constants[weight.q], self.constants[weight.scales], weight.shape)
        return self.per_channel_filter(self.constants[weight.q], self.weight_scales(weight))

    def weight_scales(self, weight: "QuantizedWeight") -> torch.Tensor:
        """One scale per output channel (a per-tensor scale repeated)."""
        if isinstance(weight.scales, float):
            return torch.full((int(self.constants[weight.q].shape[0]),), weight.scales)
        return self.constants[weight.scales]

    def temp(self, dims: list[int], like: Optional[torch.fx.Node] = None) -> int:
        """An internal value; stored as `like`'s result is (qint8 for a static int8 node)."""
        if like in self.static:
            return self.quantized_temp(dims, self.static[like])
        return self.graph.add_value(XValue(self.float_type, list(dims)))

    def result(self, node: torch.fx.Node, dims: Optional[list[int]] = None) -> int:
        """Define the value a node computes (external when the subgraph returns it)."""
        dims = _dims(node) if dims is None else dims
        if node in self.static:
            scale, zero = self.static[node]
            value = XValue("qint8", list(dims), quant=(PER_TENSOR, [(0, "Float32", scale), (1, "Int32", zero)]))
        else:
            value = XValue(_float_type(node), dims)
        if node in self.output_index:
            value.external_id, value.flags = self.num_inputs + self.output_index[node], EXTERNAL_OUTPUT
        self.ids[node] = self.graph.add_value(value)
        if node in self.output_index:
            self.graph.output_ids.append(self.ids[node])
        return self.ids[node]

    def dims(self, value_id: int) -> list[int]:
        return self.graph.values[value_id].dims

    # -- nodes

    def add(self, kind: str, output_min: float = -math.inf, output_max: float = math.inf, **fields: Any) -> None:
        self.graph.nodes.append(XNode(kind, fields, output_min, output_max, self.debug_handle))

    def like(self, src: int, dims: list[int]) -> int:
        """A new internal value stored as value `src` is."""
        v = self.graph.values[src]
        return self.graph.add_value(XValue(v.datatype, list(dims), quant=v.quant))

    def transpose(self, src: int, perm: list[int], out: Optional[int] = None) -> int:
        if out is None:
            out = self.like(src, [self.dims(src)[p] for p in perm])
        self.add("StaticTranspose", num_dims=len(perm), perm=perm, input_id=src, output_id=out)
        return out

    def reshape(self, src: int, dims: list[int], out: Optional[int] = None) -> int:
        out = self.like(src, dims) if out is None else out
        self.add("StaticReshape", num_dims=len(dims), new_shape=list(dims), input_id=src, output_id=out)
        return out

    def nhwc(self, node: torch.fx.Node, arg: torch.fx.Node, emit: Callable[[int], int]) -> None:
        """Run `emit(nhwc input id) -> nhwc output id` on `arg` channels-last, defining `node` so."""
        self.define_nhwc(node, emit(self.nhwc_value(arg)))

    def finish(self) -> XGraph:
        self.graph.num_externs = self.num_inputs + len(self.output_index)
        return self.graph


def _floats(v: Any) -> np.ndarray:
    return (v.detach().float().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)).astype(np.float32).reshape(-1)


def _float_type(node: torch.fx.Node) -> str:
    val = node.meta.get("val")
    val = val[0] if isinstance(val, (list, tuple)) and val else val
    return "fp16" if isinstance(val, torch.Tensor) and val.dtype == torch.float16 else "fp32"


def _dims(node: torch.fx.Node) -> list[int]:
    """Static sizes, or for a dynamic size its upper bound (XNNPACK reshapes to the actual
    sizes of the inputs at every call)."""
    val = node.meta["val"]
    return [sym_upper_bound(d, {}) for d in val.shape] or [1]


def _val(arg: Any) -> Optional[torch.Tensor]:
    v = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


# ---------------------------------------------------------------- emitters


def _operands_nhwc(g: GraphBuilder, node: torch.fx.Node, args: tuple) -> Optional[list[int]]:
    """The value ids of an elementwise node's operands channels-last, when it can run so: it is
    4-D, reads at least one value held NHWC, and nothing broadcasts but numbers and constants."""
    dims = _dims(node)
    if len(dims) != 4 or not any(g.held_nhwc(a) for a in args):
        return None
    for a in args:
        if g.held_nhwc(a):
            if _dims(a) != dims:
                return None
        elif isinstance(a, torch.fx.Node) and not (a in g.constants and g.constants[a].dim() <= 4):
            return None
    ids = []
    for a in args:
        if g.held_nhwc(a):
            ids.append(g.nhwc_value(a))
        elif isinstance(a, torch.fx.Node):  # a constant: made 4-D as torch broadcasts it, then NHWC
            c = g.constants[a].detach().float().numpy()
            ids.append(g.constant(c.reshape((1,) * (4 - c.ndim) + c.shape).transpose(TO_NHWC)))
        else:
            ids.append(g.value(a))
    return ids


def _elementwise(node: torch.fx.Node, g: GraphBuilder, args: tuple, add: Callable[[list[int], int], None]) -> None:
    """Emit an elementwise node by `add(operand ids, output id)`: channels-last where its operands
    are (no transposes between a convolution and the next), else as torch lays them out."""
    nhwc = _operands_nhwc(g, node, args)
    if nhwc is None:
        add([g.value(a) for a in args], g.result(node))
    else:
        out = g.temp(_nhwc_out(node), like=node)
        add(nhwc, out)
        g.define_nhwc(node, out)


def _binary(kind: str):
    def emit(node: torch.fx.Node, g: GraphBuilder) -> None:
        _elementwise(node, g, node.args[:2],
                     lambda ins, out: g.add(kind, input1_id=ins[0], input2_id=ins[1], output_id=out))

    return emit


def _unary(kind: str, **fields: Any):
    def emit(node: torch.fx.Node, g: GraphBuilder) -> None:
        _elementwise(node, g, node.args[:1], lambda ins, out: g.add(kind, input_id=ins[0], output_id=out, **fields))

    return emit


# Nodes an activation is folded into, as their output bounds (those ExecuTorch's export fuses
# into; XNNPACK applies them).
ACTIVATION_HOSTS = {"Conv2d", "DepthwiseConv2d", "ConvTranspose2d", "FullyConnected", "Add"}


def _clamp(bounds: Callable[[torch.fx.Node], tuple[float, float]]):
    def emit(node: torch.fx.Node, g: GraphBuilder) -> None:
        lo, hi = bounds(node)
        if not _fold_clamp(node, g, lo, hi):
            _elementwise(node, g, node.args[:1], lambda ins, out: g.add("Clamp", output_min=lo, output_max=hi,
                                                                        input_id=ins[0], output_id=out))

    return emit


def _fold_clamp(node: torch.fx.Node, g: GraphBuilder, lo: float, hi: float) -> bool:
    """A float relu/hardtanh/clamp whose input only it reads, computed by the node just emitted:
    that node's output bounds instead (as ExecuTorch's XNNPACK export fuses activations), one
    node and one pass over the values less."""
    src, last = node.args[0], g.graph.nodes[-1] if g.graph.nodes else None
    if (not isinstance(src, torch.fx.Node) or len(src.users) != 1 or src in g.output_index or node in g.static
            or last is None or last.kind not in ACTIVATION_HOSTS):
        return False
    nhwc = src in g.channels_last
    out = g.channels_last[src] if nhwc else g.ids.get(src)
    if out is None or last.fields["output_id"] != out or (not nhwc and node in g.output_index):
        return False
    last.output_min, last.output_max = max(last.output_min, lo), min(last.output_max, hi)
    if nhwc:
        g.define_nhwc(node, out)
    else:
        g.ids[node] = out
    return True


def _clamp_bounds(node: torch.fx.Node) -> tuple[float, float]:
    lo, hi = _arg(node, 1, "min"), _arg(node, 2, "max")
    return (-math.inf if lo is None else float(lo)), (math.inf if hi is None else float(hi))


def _leaky_relu(node: torch.fx.Node, g: GraphBuilder) -> None:
    slope = float(_arg(node, 1, "negative_slope", 0.01))
    _elementwise(node, g, node.args[:1],
                 lambda ins, out: g.add("LeakyReLU", negative_slope=slope, input_id=ins[0], output_id=out))


def _elu(node: torch.fx.Node, g: GraphBuilder) -> None:
    alpha = float(_arg(node, 1, "alpha", 1.0))
    _elementwise(node, g, node.args[:1], lambda ins, out: g.add("ELU", alpha=alpha, input_id=ins[0], output_id=out))


def _matmul(node: torch.fx.Node, g: GraphBuilder, x: torch.fx.Node, w: Any, bias: Any) -> None:
    """y = x @ w (+ bias), x [M, K], w [K, N]: FullyConnected when w is a constant, else a
    BatchMatrixMultiply of a batch of one."""
    static = static_linear(x, w)
    if static is not None:
        x_scale = int8_input(x)[0]
        filt = g.quantized_filter(static)
        bias_id = g.static_bias(bias, x_scale, g.weight_scales(static))
        g.add("FullyConnected", input1_id=g.value(x), filter_id=filt, bias_id=bias_id, output_id=g.result(node))
        return
    quantized = qd8_linear(x, w)
    if quantized is not None:
        src, weight = quantized
        filt = g.quantized_filter(weight)
        src = g.value(src) if _dims(src) == _dims(x) else g.reshape(g.value(src), _dims(x))  # rows of a view
        bias_id = NO_VALUE
        fused_bias = bias is not None and bias in g.constants and g.constants[bias].dim() == 1
        if fused_bias:
            bias_id = g.constant(g.constants[bias].detach().float().numpy())
        out = g.result(node) if bias is None or fused_bias else g.temp(_dims(node))
        g.add("FullyConnected", input1_id=g.dynamic_quantized(src), filter_id=filt, bias_id=bias_id,
              output_id=out)
        if bias is None or fused_bias:
            return
    elif isinstance(w, torch.fx.Node) and w in g.constants:
        filt = g.constant(g.constants[w].detach().float().numpy().T)  # [out, in]
        bias_id = NO_VALUE
        fused_bias = bias is not None and bias in g.constants and g.constants[bias].dim() == 1
        if fused_bias:
            bias_id = g.constant(g.constants[bias].detach().float().numpy())
        out = g.result(node) if bias is None or fused_bias else g.temp(_dims(node))
        g.add("FullyConnected", input1_id=g.value(x), filter_id=filt, bias_id=bias_id, output_id=out)
        if bias is None or fused_bias:
            return
    else:
        m, k = _dims(x)
        n = _dims(node)[1]
        a, b = g.reshape(g.value(x), [1, m, k]), g.reshape(g.value(w), [1, k, n])
        prod = g.temp([1, m, n])
        g.add("BatchMatrixMultiply", input1_id=a, input2_id=b, output_id=prod)
        out = g.reshape(prod, [m, n], g.result(node) if bias is None else None)
        if bias is None:
            return
    g.add("Add", input1_id=out, input2_id=g.value(bias), output_id=g.result(node))


def per_token_round_trip(x: Any) -> Optional[torch.fx.Node]:
    """The float source of dequantize_per_token(quantize_per_token(src, s, zp), s, zp) with s, zp
    from choose_qparams_per_token_asymmetric(src): int8 activations per token (qd8). A view of
    one counts too: a linear on [B, T, K] activations reads them as [B * T, K] rows (BERT)."""
    if isinstance(x, torch.fx.Node) and x.target is aten.view.default:
        x = x.args[0]
    if not isinstance(x, torch.fx.Node) or x.target is not qd.dequantize_per_token.default:
        return None
    quant = x.args[0]
    if not isinstance(quant, torch.fx.Node) or quant.target is not qd.quantize_per_token.default:
        return None
    src, scale, zero = quant.args[:3]
    choose = scale.args[0] if isinstance(scale, torch.fx.Node) and scale.target is operator.getitem else None
    if (choose is None or choose.target is not qd.choose_qparams_per_token_asymmetric.default
            or choose.args[0] is not src or tuple(quant.args[3:6]) != (-128, 127, torch.int8)):
        return None
    return src


@dataclass(frozen=True)
class QuantizedWeight:
    """The constant int8 values and scales behind a matmul's float weight: per output channel
    (q [N, K], int8), or in groups of in-channels (q [N*K/G, G] in -8..7, XNNPACK's qb4w)."""

    q: torch.fx.Node
    scales: Any  # a node of scales, or one number for the whole tensor (dequantize_per_tensor)
    zero_point: Optional[torch.fx.Node]
    shape: tuple[int, int]  # (N, K) of the float weight
    grouped: bool


def weight_dequantize(dq: Any) -> Optional[tuple]:
    """(q, scales, zero point node or None, quant_min, quant_max) of dequantize_per_channel(q, s, zp, axis 0,
    int8), or of dequantize_per_tensor(q, scale, 0, int8) (one scale: per-channel ones all equal)."""
    if not isinstance(dq, torch.fx.Node):
        return None
    if dq.target is qd.dequantize_per_tensor.default:
        q, scale, zero, lo, hi, dtype = dq.args[:6]
        ok = isinstance(scale, float) and zero == 0 and dtype == torch.int8 and isinstance(q, torch.fx.Node)
        return (q, scale, None, lo, hi) if ok else None
    if dq.target is not qd.dequantize_per_channel.default:
        return None
    q, scales, zero, axis, lo, hi, dtype = dq.args[:7]
    if axis != 0 or dtype != torch.int8 or (zero is not None and not isinstance(zero, torch.fx.Node)):
        return None
    return q, scales, zero, lo, hi


def quantized_weight(w: Any) -> Optional[QuantizedWeight]:
    """The weight of permute(W, [1, 0]) for W = dequantize_per_channel(q, s, zp=0|None, axis 0, int8)
    (per channel), or W = view(that, [N, K]) for grouped 4-bit q (docs/quantized-llm.md)."""
    if not isinstance(w, torch.fx.Node) or w.target is not aten.permute.default or list(w.args[1]) != [1, 0]:
        return None
    src = w.args[0]
    view = src if isinstance(src, torch.fx.Node) and src.target is aten.view.default else None
    dq = view.args[0] if view is not None else src
    parts = weight_dequantize(dq)
    if parts is None or (view is not None and dq.target is not qd.dequantize_per_channel.default):
        return None
    q, scales, zero, lo, hi = parts
    shape = tuple(int(d) for d in _val(w).shape[::-1])
    if view is None:
        return QuantizedWeight(q, scales, zero, shape, False) if lo >= -128 and hi <= 127 else None
    group = int(_val(dq).shape[1])
    n, k = shape
    if lo < -8 or hi > 7 or group % QB4W_BLOCK or k % group or _val(dq).shape[0] * group != n * k:
        return None
    return QuantizedWeight(q, scales, zero, shape, True)


def static_linear(x: Any, w: Any) -> Optional[QuantizedWeight]:
    """The int8 per-channel weight of a static int8 linear (its input a dequantize_per_tensor)."""
    weight = quantized_weight(w)
    if int8_input(x) is None or weight is None or weight.grouped:
        return None
    return weight


def int8_input(x: Any) -> Optional[tuple[float, int]]:
    """(scale, zero point) of a static int8 dequantize, or of a view of one (a linear's rows)."""
    if isinstance(x, torch.fx.Node) and x.target is aten.view.default:
        x = x.args[0]
    return _per_tensor(x, qd.dequantize_per_tensor.default)


def static_conv_weight(w: Any) -> Optional[QuantizedWeight]:
    """An int8 weight_dequantize as a convolution's weight."""
    parts = weight_dequantize(w)
    if parts is None or parts[3] < -128 or parts[4] > 127:
        return None
    q, scales, zero = parts[:3]
    return QuantizedWeight(q, scales, zero, (0, 0), False)


def _per_tensor(node: Any, target: Any) -> Optional[tuple[float, int]]:
    """(scale, zero point) of a `target` (quantize/dequantize_per_tensor) node of int8 with numbers as parameters."""
    if not isinstance(node, torch.fx.Node) or node.target is not target:
        return None
    scale, zero = node.args[1:3]
    if not isinstance(scale, float) or not isinstance(zero, int) or tuple(node.args[3:6]) != (-128, 127, torch.int8):
        return None
    return scale, zero


def qd8_linear(x: Any, w: Any) -> Optional[tuple[torch.fx.Node, QuantizedWeight]]:
    """(the float activations, the weight) of a dynamically quantized linear: qd8 x qc8w or qd8 x qb4w."""
    src, weight = per_token_round_trip(x), quantized_weight(w)
    return None if src is None or weight is None else (src, weight)


def _addmm(node: torch.fx.Node, g: GraphBuilder) -> None:
    _matmul(node, g, node.args[1], node.args[2], node.args[0])


def _mm(node: torch.fx.Node, g: GraphBuilder) -> None:
    _matmul(node, g, node.args[0], node.args[1], None)


def _linear(node: torch.fx.Node, g: GraphBuilder) -> None:
    w, bias = node.args[1], _arg(node, 2, "bias")
    filt = g.constant(g.constants[w].detach().float().numpy())
    bias_id = NO_VALUE if bias is None else g.constant(g.constants[bias].detach().float().numpy())
    g.add("FullyConnected", input1_id=g.value(node.args[0]), filter_id=filt, bias_id=bias_id, output_id=g.result(node))


def _pair(v: Any) -> list[int]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * 2 if len(v) == 1 else v


def _conv_filter(w: np.ndarray, transposed: bool, depthwise: bool, groups: int) -> np.ndarray:
    if transposed:  # (G*I_g, O_g, H, W) -> (G*O_g, H, W, I_g)
        gi, og, kh, kw = w.shape
        return w.reshape(groups, gi // groups, og, kh, kw).transpose(0, 2, 3, 4, 1).reshape(groups * og, kh, kw,
                                                                                            gi // groups)
    if depthwise:  # (O, 1, H, W) -> (1, H, W, O)
        return w.transpose(1, 2, 3, 0)
    return w.transpose(0, 2, 3, 1)


def _convolution(node: torch.fx.Node, g: GraphBuilder) -> None:
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = node.args[:9]
    static = static_conv_weight(w) if node in g.static else None
    weight = (g.constants[static.q] if static else g.constants[w]).detach().float().numpy()
    if transposed:
        group_in, group_out = weight.shape[0] // groups, weight.shape[1]
    else:
        group_in, group_out = weight.shape[1], weight.shape[0] // groups
    depthwise = group_in == 1 and group_out % group_in == 0 and not transposed
    kind = "DepthwiseConv2d" if depthwise else "ConvTranspose2d" if transposed else "Conv2d"
    bn = None if static or transposed else _folded_batch_norm(node)
    if static:  # int8 values, one scale per output channel (the last dim of a depthwise filter)
        scales = g.weight_scales(static)
        filt = g.per_channel_filter(_conv_filter(weight, False, depthwise, groups), scales,
                                    channel_dim=3 if depthwise else 0)
        bias_id = g.static_bias(bias, _per_tensor(x, qd.dequantize_per_tensor.default)[0], scales)
    else:
        bias_values = None if bias is None else g.constants[bias].detach().double()
        if bn is not None:  # conv then batch norm = one conv: filter rows and bias scaled, bias shifted
            scale, shift = _batch_norm_affine(bn, g)
            weight = (torch.from_numpy(weight).double() * scale.reshape(-1, 1, 1, 1)).float().numpy()
            bias_values = shift if bias_values is None else bias_values * scale + shift
        filt = g.constant(_conv_filter(weight, transposed, depthwise, groups))
        bias_id = NO_VALUE if bias_values is None else g.constant(bias_values.float().numpy())
    (sh, sw), (ph, pw), (dh, dw), (ah, aw) = (_pair(v) for v in (stride, padding, dilation, output_padding))
    n, c, h, wd = _dims(node)

    def emit(src: int) -> int:
        out = g.temp([n, h, wd, c], like=node)
        g.add(kind, padding_top=ph, padding_right=pw, padding_bottom=ph, padding_left=pw,
              kernel_height=weight.shape[2], kernel_width=weight.shape[3], subsampling_height=sh,
              subsampling_width=sw, dilation_height=dh, dilation_width=dw, group_input_channels=group_in,
              group_output_channels=group_out, groups=groups, adjustment_height=ah, adjustment_width=aw,
              input1_id=src, filter_id=filt, bias_id=bias_id, output_id=out, flags=0)
        return out

    g.nhwc(node, x, emit)
    if bn is not None:
        g.define_nhwc(next(iter(bn.users)), g.channels_last[node])


def _nhwc_out(node: torch.fx.Node) -> list[int]:
    n, c, h, w = _dims(node)
    return [n, h, w, c]


def _max_pool(node: torch.fx.Node, g: GraphBuilder) -> None:
    x, kernel = node.args[0], _pair(node.args[1])
    stride = _pair(_arg(node, 2, "stride", []) or kernel)
    padding, dilation = _pair(_arg(node, 3, "padding", 0)), _pair(_arg(node, 4, "dilation", 1))
    (item,) = node.users  # the pooled values (checked: nobody reads the indices)

    def emit(src: int) -> int:
        out = g.temp(_nhwc_out(item), like=item)
        g.add("MaxPooling2d", padding_top=padding[0], padding_right=padding[1], padding_bottom=padding[0],
              padding_left=padding[1], pooling_height=kernel[0], pooling_width=kernel[1], stride_height=stride[0],
              stride_width=stride[1], dilation_height=dilation[0], dilation_width=dilation[1], input_id=src,
              output_id=out, flags=KEEP_DIMS)
        return out

    g.nhwc(item, x, emit)


def _batch_norm_affine(node: torch.fx.Node, g: GraphBuilder) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference batch norm with constant statistics as x * scale + shift, per channel (float64)."""
    weight, bias, mean, var = node.args[1:5]
    const = lambda a: g.constants[a].detach().double()  # noqa: E731
    scale = 1.0 / torch.sqrt(const(var) + float(node.args[6]))
    if weight is not None:
        scale = scale * const(weight)
    return scale, -const(mean) * scale + (const(bias) if bias is not None else 0.0)


def _batch_norm(node: torch.fx.Node, g: GraphBuilder) -> None:
    (item,) = node.users  # the normalized values (checked: nobody reads the saved statistics)
    if item in g.channels_last or item in g.ids:
        return  # folded into the convolution before it
    scale, shift = _batch_norm_affine(node, g)
    x = node.args[0]
    if g.held_nhwc(x) and len(_dims(x)) == 4:  # channels are the last dim: [C] broadcasts
        scaled = g.temp(_nhwc_out(item))
        g.add("Multiply", input1_id=g.nhwc_value(x), input2_id=g.constant(scale.float().numpy()), output_id=scaled)
        out = g.temp(_nhwc_out(item))
        g.add("Add", input1_id=scaled, input2_id=g.constant(shift.float().numpy()), output_id=out)
        g.define_nhwc(item, out)
        return
    per_channel = [-1] + [1] * (len(_dims(x)) - 2)
    scaled = g.temp(_dims(item))
    g.add("Multiply", input1_id=g.value(x), input2_id=g.constant(scale.reshape(per_channel).float().numpy()),
          output_id=scaled)
    g.add("Add", input1_id=scaled, input2_id=g.constant(shift.reshape(per_channel).float().numpy()),
          output_id=g.result(item))


def _folded_batch_norm(conv: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The batch norm a float convolution's result goes to and nothing else: folded into its filter."""
    users = list(conv.users)
    bn = users[0] if len(users) == 1 else None
    if bn is None or bn.target is not aten._native_batch_norm_legit_no_training.default or bn.args[0] is not conv:
        return None
    return bn


def _avg_pool(node: torch.fx.Node, g: GraphBuilder) -> None:
    x, kernel = node.args[0], _pair(node.args[1])
    stride = _pair(_arg(node, 2, "stride", []) or kernel)
    padding = _pair(_arg(node, 3, "padding", 0))

    def emit(src: int) -> int:
        out = g.temp(_nhwc_out(node), like=node)
        g.add("AvgPooling2d", padding_top=padding[0], padding_right=padding[1], padding_bottom=padding[0],
              padding_left=padding[1], pooling_height=kernel[0], pooling_width=kernel[1], stride_height=stride[0],
              stride_width=stride[1], dilation_height=1, dilation_width=1, input_id=src, output_id=out,
              flags=KEEP_DIMS)
        return out

    g.nhwc(node, x, emit)


def _global_mean(node: torch.fx.Node, g: GraphBuilder) -> None:
    def emit(src: int) -> int:
        out = g.temp(_nhwc_out(node), like=node)
        g.add("GlobalAvgPooling2d", input_id=src, output_id=out, flags=KEEP_DIMS)
        return out

    g.nhwc(node, node.args[0], emit)


def _upsample_bilinear(node: torch.fx.Node, g: GraphBuilder) -> None:
    n, c, h, w = _dims(node)
    flags = ALIGN_CORNERS if node.args[2] else 0

    def emit(src: int) -> int:
        out = g.temp([n, h, w, c])
        g.add("StaticResizeBilinear2D", new_height=h, new_width=w, input_id=src, output_id=out, flags=flags)
        return out

    g.nhwc(node, node.args[0], emit)


def _softmax(node: torch.fx.Node, g: GraphBuilder) -> None:
    g.add("Softmax", input_id=g.value(node.args[0]), output_id=g.result(node), flags=0)


def _cat(node: torch.fx.Node, g: GraphBuilder) -> None:
    tensors = node.args[0]
    axis = _arg(node, 1, "dim", 0) % len(_dims(node))
    ids = [g.value(t) for t in tensors] + [NO_VALUE] * (5 - len(tensors))
    g.add(f"Concatenate{len(tensors)}", axis=axis, input1_id=ids[0], input2_id=ids[1], input3_id=ids[2],
          input4_id=ids[3], input5_id=ids[4], output_id=g.result(node), flags=0)


def _slice_bounds(node: torch.fx.Node) -> tuple[int, int, int]:
    size = _val(node.args[0]).shape
    dim = _arg(node, 1, "dim", 0) % len(size)
    n = int(size[dim])
    start, end = _arg(node, 2, "start"), _arg(node, 3, "end")
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else end)
    start, end = min(max(start, 0), n), min(max(end, 0), n)
    return dim, start, end


def _slice(node: torch.fx.Node, g: GraphBuilder) -> None:
    dim, start, end = _slice_bounds(node)
    src = g.value(node.args[0])
    offsets = [0] * len(g.dims(src))
    offsets[dim] = start
    g.add("StaticSlice", num_dims=len(offsets), offsets=offsets, sizes=_dims(node), input_id=src,
          output_id=g.result(node), flags=0)


def _permute(node: torch.fx.Node, g: GraphBuilder) -> None:
    rank = len(_dims(node))
    g.transpose(g.value(node.args[0]), [d % rank for d in node.args[1]], g.result(node))


def _reshape(node: torch.fx.Node, g: GraphBuilder) -> None:
    g.reshape(g.value(node.args[0]), _dims(node), g.result(node))


def _pad(node: torch.fx.Node, g: GraphBuilder) -> None:
    src = g.value(node.args[0])
    rank, pad = len(g.dims(src)), list(node.args[1])
    pre, post = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):  # torch lists (before, after) pairs from the last dim backwards
        pre[rank - 1 - i], post[rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    g.add("StaticConstantPad", pre_paddings=pre, post_paddings=post, padding_value=float(_arg(node, 2, "value", 0.0)),
          input_id=src, output_id=g.result(node), flags=0)


def _bmm(node: torch.fx.Node, g: GraphBuilder) -> None:
    g.add("BatchMatrixMultiply", input1_id=g.value(node.args[0]), input2_id=g.value(node.args[1]),
          output_id=g.result(node), flags=0)


# ---------------------------------------------------------------- checks (what the emitters handle)


def _always(node: torch.fx.Node, is_const: IsConst) -> bool:
    return True


def _alpha_one(node: torch.fx.Node, is_const: IsConst) -> bool:
    return node.kwargs.get("alpha", 1) == 1


def _two_d(node: torch.fx.Node, is_const: IsConst) -> bool:
    return all(_val(a) is not None and _val(a).dim() == 2 for a in node.args[:2])


def _addmm_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return (node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1
            and all(_val(a) is not None and _val(a).dim() == 2 for a in node.args[1:3]))


def _linear_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    bias = _arg(node, 2, "bias")
    return _val(node.args[0]).dim() == 2 and is_const(node.args[1]) and (bias is None or is_const(bias))


def _conv_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    x, w, bias = node.args[:3]
    return (_val(x).dim() == 4 and is_const(w) and (bias is None or is_const(bias))
            and all(len(_pair(v)) == 2 for v in node.args[3:6]))


def _max_pool_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return _val(node.args[0]).dim() == 4 and not _arg(node, 5, "ceil_mode", False) and _only_first_output_read(node)


def _only_first_output_read(node: torch.fx.Node) -> bool:
    users = list(node.users)
    return len(users) == 1 and users[0].target is operator.getitem and users[0].args[1] == 0


def _batch_norm_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return (_val(node.args[0]).dim() >= 2 and all(a is None or is_const(a) for a in node.args[1:3])
            and all(is_const(a) for a in node.args[3:5]) and _only_first_output_read(node))


def _avg_pool_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    padded = any(_pair(_arg(node, 3, "padding", 0)))
    # XNNPACK averages over the input pixels only: padded windows must not count the padding.
    return (_val(node.args[0]).dim() == 4 and not _arg(node, 4, "ceil_mode", False)
            and _arg(node, 6, "divisor_override") is None and not (padded and _arg(node, 5, "count_include_pad", True)))


def _mean_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    rank = _val(node.args[0]).dim()
    dims = _arg(node, 1, "dim")
    return (rank == 4 and dims is not None and sorted(d % 4 for d in dims) == [2, 3]
            and bool(_arg(node, 2, "keepdim", False)) and node.kwargs.get("dtype") is None)


def _softmax_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return node.args[1] % _val(node.args[0]).dim() == _val(node.args[0]).dim() - 1 and not node.args[2]


def _cat_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return 2 <= len(node.args[0]) <= 5


def _slice_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return _arg(node, 4, "step", 1) == 1 and all(d > 0 for d in _val(node).shape)


def _pad_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return all(p >= 0 for p in node.args[1])


def _clone_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return node.kwargs.get("memory_format") in (None, torch.contiguous_format)


def _gelu_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return node.kwargs.get("approximate", _arg(node, 1, "approximate", "none")) == "none"


def _elu_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return _arg(node, 2, "scale", 1) == 1 and _arg(node, 3, "input_scale", 1) == 1


def _bmm_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    return all(_val(a) is not None and _val(a).dim() == 3 for a in node.args[:2])


@dataclass(frozen=True)
class Op:
    emit: Callable[[torch.fx.Node, GraphBuilder], None]
    check: Callable[[torch.fx.Node, IsConst], bool] = _always


OPS: dict[Any, Op] = {
    aten.addmm.default: Op(_addmm, _addmm_ok),
    aten.mm.default: Op(_mm, _two_d),
    aten.linear.default: Op(_linear, _linear_ok),
    aten.convolution.default: Op(_convolution, _conv_ok),
    aten.add.Tensor: Op(_binary("Add"), _alpha_one),
    aten.sub.Tensor: Op(_binary("Subtract"), _alpha_one),
    aten.mul.Tensor: Op(_binary("Multiply")),
    aten.div.Tensor: Op(_binary("Div")),
    aten.add.Scalar: Op(_binary("Add"), _alpha_one),
    aten.sub.Scalar: Op(_binary("Subtract"), _alpha_one),
    aten.mul.Scalar: Op(_binary("Multiply")),
    aten.div.Scalar: Op(_binary("Div")),
    aten.minimum.default: Op(_binary("Minimum")),
    aten.maximum.default: Op(_binary("Maximum")),
    aten.relu.default: Op(_clamp(lambda n: (0.0, math.inf))),
    aten.hardtanh.default: Op(_clamp(lambda n: (float(_arg(n, 1, "min_val", -1.0)), float(_arg(n, 2, "max_val", 1.0))))),
    aten.clamp.default: Op(_clamp(_clamp_bounds)),
    aten.sigmoid.default: Op(_unary("Sigmoid")),
    aten.tanh.default: Op(_unary("Tanh")),
    aten.gelu.default: Op(_unary("Gelu"), _gelu_ok),
    aten.elu.default: Op(_elu, _elu_ok),
    aten.leaky_relu.default: Op(_leaky_relu),
    aten.hardswish.default: Op(_unary("Hardswish")),
    aten.abs.default: Op(_unary("Abs")),
    aten.neg.default: Op(_unary("Negate")),
    aten.exp.default: Op(_unary("Exp")),
    aten.log.default: Op(_unary("Log")),
    aten.sqrt.default: Op(_unary("SquareRoot")),
    aten.rsqrt.default: Op(_unary("ReciprocalSquareRoot")),
    aten.sin.default: Op(_unary("Sin")),
    aten.cos.default: Op(_unary("Cos")),
    aten.floor.default: Op(_unary("Floor")),
    aten.ceil.default: Op(_unary("Ceiling")),
    aten.pow.Tensor_Scalar: Op(_unary("Square"), lambda n, c: n.args[1] == 2),
    aten._softmax.default: Op(_softmax, _softmax_ok),
    aten.mean.dim: Op(_global_mean, _mean_ok),
    aten.max_pool2d_with_indices.default: Op(_max_pool, _max_pool_ok),
    aten.avg_pool2d.default: Op(_avg_pool, _avg_pool_ok),
    aten._native_batch_norm_legit_no_training.default: Op(_batch_norm, _batch_norm_ok),
    aten.cat.default: Op(_cat, _cat_ok),
    aten.slice.Tensor: Op(_slice, _slice_ok),
    aten.permute.default: Op(_permute),
    aten.view.default: Op(_reshape),
    aten._unsafe_view.default: Op(_reshape),
    aten.squeeze.dims: Op(_reshape),
    aten.squeeze.dim: Op(_reshape),
    aten.unsqueeze.default: Op(_reshape),
    aten.clone.default: Op(_unary("Copy"), _clone_ok),
    aten.constant_pad_nd.default: Op(_pad, _pad_ok),
    aten.bmm.default: Op(_bmm, _bmm_ok),
    aten.upsample_bilinear2d.vec: Op(_upsample_bilinear, lambda n, c: _val(n.args[0]).dim() == 4),
}
# Ops returning a tuple of which only the first element is delegated (read through getitem).
TUPLE_OPS = {aten.max_pool2d_with_indices.default, aten._native_batch_norm_legit_no_training.default}
LAYOUT_ONLY = {aten.permute.default, aten.view.default, aten._unsafe_view.default, aten.squeeze.dims,
               aten.squeeze.dim, aten.unsqueeze.default, aten.clone.default, aten.slice.Tensor}


# Ops whose XNNPACK node takes any leading sizes at run time: they may have dynamic sizes
# (an LLM's token count). Reshapes, slices, pooling... need static ones.
DYNAMIC_OK = {aten.addmm.default, aten.mm.default, aten.linear.default, aten.add.Tensor, aten.sub.Tensor,
              aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar,
              aten.div.Scalar, aten.minimum.default, aten.maximum.default, aten.relu.default,
              aten.hardtanh.default, aten.clamp.default, aten.sigmoid.default, aten.tanh.default,
              aten.gelu.default, aten.elu.default, aten.leaky_relu.default, aten.hardswish.default,
              aten._softmax.default, aten.abs.default, aten.neg.default, aten.exp.default, aten.log.default,
              aten.sqrt.default, aten.rsqrt.default, aten.sin.default, aten.cos.default, aten.floor.default,
              aten.ceil.default, aten.pow.Tensor_Scalar}


# Ops XNNPACK runs in fp16 as well (every value of the node float16; ExecuTorch delegates these).
FP16_OPS = {aten.addmm.default, aten.mm.default, aten.linear.default, aten.add.Tensor, aten.sub.Tensor,
            aten.mul.Tensor, aten.div.Tensor, aten.relu.default, aten.hardtanh.default, aten.clamp.default,
            aten.sigmoid.default, aten.tanh.default, aten.permute.default, aten.view.default,
            aten._unsafe_view.default, aten.squeeze.dims, aten.unsqueeze.default, aten.cat.default}


def _fp16(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype == torch.float16 and 1 <= v.dim() <= MAX_DIMS


def _fp32(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32 and 1 <= v.dim() <= MAX_DIMS


def _static(v: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in v.shape)


def _dynamic_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    """Dynamic sizes: the op must take them, and a matrix product needs a constant weight
    (a FullyConnected; the batch-matmul fallback reshapes)."""
    if node.target not in DYNAMIC_OK:
        return False
    if node.target in (aten.mm.default, aten.addmm.default):
        return is_const(node.args[1] if node.target is aten.mm.default else node.args[2])
    return True


def supported(node: torch.fx.Node, is_const: IsConst) -> bool:
    """Can XNNPACK run this node (fp32, static shapes, arguments its emitter handles)?"""
    if node.target in QD8_PARTS:
        return _qd8_part_ok(node, is_const)
    if node.target is qd.quantize_per_tensor.default:
        return _per_tensor(node, node.target) is not None and _fp32(_val(node.args[0]))
    if node.target is qd.dequantize_per_tensor.default and _per_tensor(node, node.target) is None:
        return is_const(node.args[0]) and _qd8_part_ok(node, is_const)  # a weight's
    if node.target is qd.dequantize_per_tensor.default:
        return (_per_tensor(node, node.target) is not None
                and _per_tensor(node.args[0], qd.quantize_per_tensor.default) is not None)
    if node.target in OPS and is_static(node):
        return _static_ok(node, is_const)
    if node.target is operator.getitem and node.args[0].target is qd.choose_qparams_per_token_asymmetric.default:
        return _qd8_part_ok(node.args[0], is_const)
    if node.target is operator.getitem:  # the values of a delegated max pooling / batch norm
        src = node.args[0]
        return src.target in TUPLE_OPS and supported(src, is_const)
    op = OPS.get(node.target)
    if op is None:
        return False
    out = node.meta.get("val")
    out = out[0] if node.target in TUPLE_OPS else out
    values = [out] + [a.meta.get("val") for a in node.all_input_nodes]
    if not all(_fp32(v) for v in values) and not (node.target in FP16_OPS and all(_fp16(v) for v in values)):
        return False
    if not all(_static(v) for v in values) and not _dynamic_ok(node, is_const):
        return False
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, (list, tuple)) and not all(isinstance(d, (int, torch.fx.Node)) for d in a):
            return False  # symbolic sizes
    try:
        return bool(op.check(node, is_const))
    except (TypeError, AttributeError, IndexError, ValueError):
        return False


# ---------------------------------------------------------------- static int8 (pt2e's static config)

# Ops XNNPACK runs on qint8 values: each reads dequantize_per_tensor nodes and its result is
# read by one quantize_per_tensor, possibly through an activation (conv -> relu -> quantize),
# whose parameters the op's own result then takes (the activation is a Clamp on them).
QS8_OPS = {aten.addmm.default, aten.mm.default, aten.convolution.default, aten.add.Tensor, aten.mul.Tensor,
           aten.max_pool2d_with_indices.default, aten.mean.dim, aten.cat.default,
           aten.relu.default, aten.hardtanh.default, aten.clamp.default, aten.view.default}
ACTIVATIONS = {aten.relu.default, aten.hardtanh.default, aten.clamp.default}
SAME_PARAMS = ACTIVATIONS | {aten.view.default, aten.max_pool2d_with_indices.default, aten.cat.default}
# Nodes that may read a static int8 op's result before its quantize (taking that quantize's parameters).
FOLLOWERS = ACTIVATIONS | {aten.view.default}


def _activations(node: torch.fx.Node) -> list[torch.fx.Node]:
    args = node.args[0] if node.target is aten.cat.default else node.args[:2]
    return [a for a in args if isinstance(a, torch.fx.Node)]


def is_static(node: torch.fx.Node) -> bool:
    """Reads a static int8 dequantize (a linear: or a view of one), or is an activation or a view
    reading an op that does."""
    reads = _activations(node)
    if any(_per_tensor(a, qd.dequantize_per_tensor.default) is not None for a in reads):
        return True
    if node.target in (aten.addmm.default, aten.mm.default):
        return int8_input(node.args[1] if node.target is aten.addmm.default else node.args[0]) is not None
    return node.target in FOLLOWERS and bool(reads) and reads[0].target in QS8_OPS and is_static(reads[0])


def static_output(node: torch.fx.Node) -> Optional[tuple[float, int]]:
    """The (scale, zero point) a static int8 node's result is stored with, or None."""
    users = list(node.users)
    if node.target in TUPLE_OPS:
        return static_output(users[0]) if len(users) == 1 and users[0].target is operator.getitem else None
    if len(users) != 1:
        return None
    user = users[0]
    params = _per_tensor(user, qd.quantize_per_tensor.default)
    if params is None and user.target in FOLLOWERS and node.target not in ACTIVATIONS:
        return static_output(user)
    if params is None and node.target is aten.view.default and user.target in (aten.addmm.default, aten.mm.default):
        return int8_input(node)  # a linear's rows: the int8 values reshaped
    return params


def _static_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    if node.target not in QS8_OPS or static_output(node) is None:
        return False
    reads = _activations(node)
    if node.target in FOLLOWERS and not _per_tensor(reads[0], qd.dequantize_per_tensor.default):
        reads = []  # after its producer: reads that op's qint8 result
    if node.target in (aten.addmm.default, aten.mm.default):
        x, w = node.args[1:3] if node.target is aten.addmm.default else node.args[:2]
        bias = node.args[0] if node.target is aten.addmm.default else None
        return (static_linear(x, w) is not None and (bias is None or is_const(bias))
                and (node.target is aten.mm.default or _addmm_ok(node, is_const)))
    if node.target is aten.convolution.default:
        x, w, bias = node.args[:3]
        return (_per_tensor(x, qd.dequantize_per_tensor.default) is not None and static_conv_weight(w) is not None
                and not node.args[6] and (bias is None or is_const(bias)) and _conv_ok(node, is_const))
    if not all(_per_tensor(a, qd.dequantize_per_tensor.default) is not None for a in reads):
        return False
    if node.target in SAME_PARAMS and any(_per_tensor(a, qd.dequantize_per_tensor.default) != static_output(node)
                                          for a in reads):
        return False  # XNNPACK moves or compares these int8 values without requantizing them
    op = OPS[node.target]
    try:
        return bool(op.check(node, is_const)) and all(_static(v) for v in [_val(a) for a in reads] if v is not None)
    except (TypeError, AttributeError, IndexError, ValueError):
        return False


def static_results(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, tuple[float, int]]:
    """Every static int8 node of a subgraph (and the getitem of a pooling) -> its result's parameters."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in QS8_OPS and is_static(node):
            params = static_output(node)
            if params is not None:
                out[node] = params
                if node.target in TUPLE_OPS:
                    out[next(iter(node.users))] = params
    return out


def _quantize(node: torch.fx.Node, g: GraphBuilder) -> None:
    """A static int8 quantize: the qint8 result of the op before it, or a Convert of a float value."""
    src = node.args[0]
    quantized = src in g.static and (src in g.ids or src in g.channels_last)
    params = _per_tensor(node, node.target)
    if node in g.output_index:  # another delegate reads the int8 values
        g.static[node] = params
        g.add("Copy" if quantized else "Convert", input_id=g.value(src), output_id=g.result(node), flags=0)
    elif quantized:  # the same values, in the layouts they are held in
        for held in (g.ids, g.channels_last):
            if src in held:
                held[node] = held[src]
    elif g.held_nhwc(src) and len(_dims(node)) == 4:
        g.channels_last[node] = g.quantized_temp(_nhwc_out(node), params)
        g.add("Convert", input_id=g.nhwc_value(src), output_id=g.channels_last[node], flags=0)
    else:
        g.ids[node] = g.quantized_temp(_dims(node), params)
        g.add("Convert", input_id=g.value(src), output_id=g.ids[node], flags=0)


def _dequantize(node: torch.fx.Node, g: GraphBuilder) -> None:
    """Readers inside the subgraph read the qint8 value itself; a returned one is converted to float."""
    if node in g.output_index:
        g.add("Convert", input_id=g.value(node.args[0]), output_id=g.result(node), flags=0)


# ---------------------------------------------------------------- whole subgraph


QD8_PARTS = {qd.choose_qparams_per_token_asymmetric.default, qd.quantize_per_token.default,
             qd.dequantize_per_token.default, qd.dequantize_per_channel.default}


def _qd8_part_ok(node: torch.fx.Node, is_const: IsConst) -> bool:
    """A node of the qd8 x qc8w linear form, every use of which is such a linear: XNNPACK does the
    activation round trip itself (Convert to qdint8) and keeps the int8 weight."""
    if node.target in (qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default):
        # Read by the weight's permute (for groups through a view), or by a static int8 convolution.
        if node.users and all(u.target is aten.convolution.default and u.args[1] is node and is_static(u)
                              and _static_ok(u, is_const) for u in node.users):
            return True
        permutes = [p for u in node.users for p in (u.users if u.target is aten.view.default else [u])]
        return bool(permutes) and all(p.target is aten.permute.default and quantized_weight(p) is not None
                                      and all(_is_qd8_matmul(m) or _is_static_matmul(m, is_const) for m in p.users)
                                      for p in permutes)
    if node.target is qd.choose_qparams_per_token_asymmetric.default:
        return all(u.target is operator.getitem and all(_qd8_part_ok(v, is_const) for v in u.users)
                   for u in node.users)
    if node.target is qd.quantize_per_token.default:
        return all(_qd8_part_ok(u, is_const) for u in node.users)
    if node.target is qd.dequantize_per_token.default:
        return per_token_round_trip(node) is not None and all(_is_qd8_matmul(u) or is_qd8_rows(u) for u in node.users)
    return False


def is_qd8_rows(node: torch.fx.Node) -> bool:
    """A view of a dequantize_per_token read only by qd8 linears: the linear quantizes its float
    source itself, so the view is not emitted (the linear reshapes the source to its rows)."""
    return (node.target is aten.view.default and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].target is qd.dequantize_per_token.default and bool(node.users)
            and all(_is_qd8_matmul(u) for u in node.users))


def _is_static_matmul(node: torch.fx.Node, is_const: IsConst) -> bool:
    return node.target in (aten.addmm.default, aten.mm.default) and is_static(node) and _static_ok(node, is_const)


def _is_qd8_matmul(node: torch.fx.Node) -> bool:
    if node.target is aten.addmm.default:
        return qd8_linear(node.args[1], node.args[2]) is not None and _addmm_ok(node, lambda a: True)
    if node.target is aten.mm.default:
        return qd8_linear(node.args[0], node.args[1]) is not None
    return False


def fold_constants(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.Tensor]:
    """get_attr tensors, and every node computed from them alone (a weight's permute), evaluated."""
    consts: dict[torch.fx.Node, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            consts[node] = getattr(gm, node.target)
        elif node.op == "call_function" and node.all_input_nodes and all(a in consts for a in node.all_input_nodes):
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: consts[a])
            value = node.target(*args, **kwargs)
            if isinstance(value, torch.Tensor):
                consts[node] = value
    return consts


def build_graph(gm: torch.fx.GraphModule) -> XGraph:
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = list(output_node.args[0])
    consts = fold_constants(gm)
    g = GraphBuilder(consts, outputs)
    g.static = static_results(gm)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            g.input(node)
    for node in gm.graph.nodes:
        if (node.op != "call_function" or node in consts or node.target is operator.getitem or node.target in QD8_PARTS
                or is_qd8_rows(node)):
            continue
        g.debug_handle = node.meta.get("debug_handle") or NO_DEBUG_HANDLE
        g.float_type = _float_type(node)
        if node.target is qd.quantize_per_tensor.default:
            _quantize(node, g)
            continue
        if node.target is qd.dequantize_per_tensor.default:
            _dequantize(node, g)
            continue
        op = OPS.get(node.target)
        if op is None:
            raise ExportError(f"XnnpackBackend: cannot lower {node.target} ({node.name})")
        g.debug_handle = node.meta.get("debug_handle") or NO_DEBUG_HANDLE
        op.emit(node, g)
    for n in outputs:  # a constant the subgraph also returns: copy it out
        if n not in g.ids or n in consts and g.graph.values[g.ids[n]].flags == 0:
            src = g.value(n)
            del g.ids[n]
            g.add("Copy", input_id=src, output_id=g.result(n))
    return g.finish()
