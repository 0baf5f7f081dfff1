"""Node patterns of a delegate run as one step: the rotary embedding, which ExecuTorch's XNNPACK
partitioner leaves as nine nodes for each of q and k (SmolLM2's decode step runs 30 such
delegates per token, each node a numpy call of a microsecond on 9 x 32 floats); and the 4-bit
products of one input (a layer's q, k and v; its gate and up) as one product over their
filters side by side, quantizing the input once, the small k and v no longer alone on one core;
and an RMSNorm's last four nodes (add eps, rsqrt, two multiplies: vmath.rms_tail); and a SwiGLU's
Sigmoid and two Multiply nodes (vmath.swiglu, one compiled call); and a
Clamp as the output bounds of the conv, product or add before it.

`fused_steps(graph, g)` finds the patterns; for each it returns the step of one of its nodes
(the last, or for sibling products the first, where their input is ready), which does the
whole pattern's work, and NOTHING for the others. The step computes what the nodes compute,
operation for operation (kernels.fast.rotate_pairs, vmath.rms_tail, vmath.swiglu; each product's panels
alone), so the results are the same bits. `reads_at` tells the release plan which node's step
reads a pattern node's inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

import numpy as np

from ...kernels.fast import compiled_decode, rotate_pairs
from ...kernels.fast import xnnpack_gemm as XG
from . import vmath
from .nodes import BUILDERS, NOTHING, TRANSPOSE_WEIGHTS, FixedBinding, Step, fixed_output, pack_qb4w, reads
from .schema import EXTERNAL_OUTPUT, NO_VALUE, Graph, Node


@dataclass
class Fused:
    steps: dict[int, Step]  # node index -> its step (the patterns' nodes only)
    reads_at: dict[int, int]  # node index -> the node whose step reads its inputs


class _Nodes:
    """Who makes and who reads each value of a graph."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.producer: dict[int, int] = {}
        self.readers: dict[int, list[int]] = {}
        for k, node in enumerate(graph.nodes):
            out = node.fields.get("output_id", NO_VALUE)
            if out != NO_VALUE:
                self.producer[out] = k
            for v in reads(node):
                self.readers.setdefault(v, []).append(k)

    def inner(self, value: int, kind: str, reader: int) -> Optional[Node]:
        """The node of `kind` making `value`, an fp32 value without clamps that only `reader` reads."""
        k = self.producer.get(value)
        if k is None or self.readers.get(value) != [reader]:
            return None
        node, v = self.graph.nodes[k], self.graph.values[value]
        if node.kind != kind or v.datatype != "fp32" or v.flags & EXTERNAL_OUTPUT or not _unclamped(node):
            return None
        return node


def _unclamped(node: Node) -> bool:
    return node.output_min == -np.inf and node.output_max == np.inf


def _operands(node: Node) -> tuple[int, int]:
    return node.fields["input1_id"], node.fields["input2_id"]


def _match_rotate_pairs(nodes: _Nodes, k: int) -> Optional[tuple[list[int], tuple[int, int, int, int], int]]:
    """At a Concatenate2 along a new last axis of [a*c - b*s, a*s + b*c] (each reshaped to a
    trailing 1): (the pattern's node indices, (a, b, c, s), the output value)."""
    graph = nodes.graph
    cat = graph.nodes[k]
    out = cat.fields["output_id"]
    if cat.kind != "Concatenate2" or not _unclamped(cat) or graph.values[out].datatype != "fp32":
        return None
    if cat.fields["axis"] != len(graph.values[out].dims) - 1:
        return None
    found = [k]
    halves = []
    for part, kind in ((cat.fields["input1_id"], "Subtract"), (cat.fields["input2_id"], "Add")):
        reshape = nodes.inner(part, "StaticReshape", k)
        if reshape is None:
            return None
        inner_value = reshape.fields["input_id"]
        if graph.values[part].dims != graph.values[inner_value].dims + [1]:
            return None
        combine = nodes.inner(inner_value, kind, nodes.producer[part])
        if combine is None:
            return None
        products = [nodes.inner(v, "Multiply", nodes.producer[inner_value]) for v in _operands(combine)]
        if None in products:
            return None
        found += [nodes.producer[part], nodes.producer[inner_value]] + [nodes.producer[v] for v in _operands(combine)]
        halves.append([_operands(p) for p in products])
    (p, q), (r, t) = halves  # Subtract(p, q), Add(r, t)
    for a, c in (p, p[::-1]):  # which factor of p is a is a naming choice: a*c == c*a
        for b, s in (q, q[::-1]):
            if {frozenset(r), frozenset(t)} == {frozenset((a, s)), frozenset((b, c))} and len({a, b, c, s}) == 4:
                if any(graph.values[v].datatype != "fp32" for v in (a, b, c, s)):
                    return None
                return found, (a, b, c, s), out
    return None


def _rotate_pairs_step(ids: tuple[int, int, int, int], out: int) -> Step:
    a_id, b_id, c_id, s_id = ids
    compiled = compiled_decode()

    def rotate_pairs_step(vals: list) -> None:
        a, b, c, s = vals[a_id], vals[b_id], vals[c_id], vals[s_id]
        if compiled is not None and _rows_with_tables(a, b, c, s):
            d = a.shape[-1]  # every head of a position against its row of the tables
            result = np.empty(a.shape + (2,), np.float32)
            compiled.rotate_pairs_rows(a.reshape(-1, d), b.reshape(-1, d), c.reshape(-1, d), s.reshape(-1, d),
                                       a.shape[-2], result.reshape(-1, d, 2))
            vals[out] = result
            return
        vals[out] = rotate_pairs(a, b, c, s)

    def bind(xs: list[np.ndarray], ys: list) -> Optional[Callable[[], None]]:
        a, b, c, s = xs
        if compiled is None or not _rows_with_tables(a, b, c, s):
            return None
        result, d = fixed_output(ys, a.shape + (2,)), a.shape[-1]
        if result is None or not result.flags.c_contiguous or any(np.may_share_memory(result, t) for t in xs):
            return None
        args = (a.reshape(-1, d), b.reshape(-1, d), c.reshape(-1, d), s.reshape(-1, d), a.shape[-2],
                result.reshape(-1, d, 2))
        kernel = compiled.rotate_pairs_rows

        def rotate_pairs_into() -> None:
            kernel(*args)

        return rotate_pairs_into

    rotate_pairs_step.bind_fixed = FixedBinding(ids, (out,), bind, makes_arrays=True)
    return rotate_pairs_step


def _rows_with_tables(a, b, c, s) -> bool:
    """a, b [..., H, D] and the tables c, s [..., 1, D], float32 in C order."""
    return (a.ndim >= 2 and a.shape == b.shape and c.shape == s.shape == a.shape[:-2] + (1, a.shape[-1])
            and all(t.dtype == np.float32 and t.flags.c_contiguous for t in (a, b, c, s)))


def _sibling_products(graph: Graph, g) -> list[list[int]]:
    """Groups of two or more qb4w FullyConnected nodes (no clamp) that quantize the same fp32
    value themselves (GraphContext.fused_quantize) with the same number of inputs and block: an
    LLM layer's q, k and v projections, its gate and up."""
    groups: dict[tuple, list[int]] = {}
    for k, node in enumerate(graph.nodes):
        if node.kind != "FullyConnected" or not _unclamped(node):
            continue
        f = node.fields
        src = g.fused_quantize.get(f["input1_id"])
        if src is None or graph.values[f["filter_id"]].datatype != "qbint4" or f["bias_id"] != NO_VALUE:
            continue
        filter_value = graph.values[f["filter_id"]]
        in_dim = 0 if f["flags"] & TRANSPOSE_WEIGHTS else 1
        if len(filter_value.dims) != 2 or filter_value.quant is None or not filter_value.quant.group_size:
            continue
        groups.setdefault((src, filter_value.dims[in_dim], filter_value.quant.group_size), []).append(k)
    return [ks for ks in groups.values() if len(ks) > 1]


def _sibling_products_step(graph: Graph, g, ks: list[int]) -> Optional[Step]:
    """One product for the sibling filters side by side (xnnpack_gemm.side_by_side), each output
    the columns of its filter: the bits each node's own product gives. None when their packed
    filters differ in inputs or block after all (the group was formed from the values' metadata)."""
    nodes = [graph.nodes[k] for k in ks]
    packed = [pack_qb4w(n, g) for n in nodes]
    if len({(w.k, w.block) for w in packed}) != 1:
        return None
    both, starts = XG.side_by_side(packed)
    src = g.fused_quantize[nodes[0].fields["input1_id"]]
    parts = [(n.fields["output_id"], start, w.n) for n, start, w in zip(nodes, starts, packed)]
    from_float, k_in = XG.bind_blockwise_from_float(both, None), both.k

    def sibling_products_step(vals: list) -> None:
        x = vals[src]
        y = from_float(x.reshape(-1, k_in))
        for out, start, n in parts:
            vals[out] = np.ascontiguousarray(y[:, start:start + n]).reshape(*x.shape[:-1], n)

    def bind(xs: list[np.ndarray], ys: list[np.ndarray]) -> Optional[Callable[[], None]]:
        x = xs[0]
        if x.ndim == 0:
            return None
        scratch = np.empty(x.shape[:-1] + (both.n,), np.float32)
        run = XG.bind_blockwise_from_float_into(both, None, x, scratch)
        if run is None or any(y.shape != x.shape[:-1] + (n,) or y.dtype != np.float32 for y, (_, _, n) in zip(ys, parts)):
            return None
        copies = [(y, scratch[..., start:start + n]) for y, (_, start, n) in zip(ys, parts)]
        copyto = np.copyto

        def sibling_products() -> None:
            run()
            for y, columns in copies:
                copyto(y, columns)

        return sibling_products

    sibling_products_step.bind_fixed = FixedBinding((src,), tuple(out for out, _, _ in parts), bind)
    return sibling_products_step


def _products_of_products(nodes: _Nodes, k: int) -> Iterator[tuple[int, int, int, int]]:
    """At node k, a Multiply without bounds writing fp32, of Multiply(a, b) by w (the inner
    product read by k alone): (w, a, b, the inner Multiply's index) in each operand order."""
    graph = nodes.graph
    last = graph.nodes[k]
    if last.kind != "Multiply" or not _unclamped(last) or graph.values[last.fields["output_id"]].datatype != "fp32":
        return
    for p, w in (_operands(last), _operands(last)[::-1]):
        if nodes.inner(p, "Multiply", k) is not None:
            inner = nodes.producer[p]
            for a, b in (_operands(graph.nodes[inner]), _operands(graph.nodes[inner])[::-1]):
                yield w, a, b, inner


def _match_rms_tail(nodes: _Nodes, k: int) -> Optional[tuple[list[int], tuple[int, int, int, int], int]]:
    """At a Multiply of Multiply(x, ReciprocalSquareRoot(Add(mean, eps))) by w (either operand
    order at each): (the pattern's node indices, (mean, eps, x, w), the output value)."""
    graph = nodes.graph
    for w, x, r, inner in _products_of_products(nodes, k):
        root = nodes.inner(r, "ReciprocalSquareRoot", inner)
        if root is None:
            continue
        add = nodes.inner(root.fields["input_id"], "Add", nodes.producer[r])
        if add is None:
            continue
        mean, eps = _operands(add)
        if any(graph.values[v].datatype != "fp32" for v in (mean, eps, x, w)):
            return None
        found = [k, inner, nodes.producer[r], nodes.producer[root.fields["input_id"]]]
        return found, (mean, eps, x, w), graph.nodes[k].fields["output_id"]
    return None


def _rms_tail_step(ids: tuple[int, int, int, int], out: int) -> Step:
    mean, eps, x, w = ids

    def rms_tail_step(vals: list) -> None:
        vals[out] = vmath.rms_tail(vals[mean], vals[eps], vals[x], vals[w])

    def bind(xs: list[np.ndarray], ys: list) -> Optional[Callable[[], None]]:
        out = fixed_output(ys, xs[2].shape)
        return None if out is None else vmath.rms_tail_into(*xs, out)

    rms_tail_step.bind_fixed = FixedBinding(ids, (out,), bind, makes_arrays=True)
    return rms_tail_step


def _match_swiglu(nodes: _Nodes, k: int) -> Optional[tuple[list[int], tuple[int, int], int]]:
    """At a Multiply of Multiply(x, Sigmoid(x)) by u (either operand order at each): (the
    pattern's node indices, (x, u), the output value)."""
    graph = nodes.graph
    for u, x, s, inner in _products_of_products(nodes, k):
        sigmoid = nodes.inner(s, "Sigmoid", inner)
        if sigmoid is None or sigmoid.fields["input_id"] != x:
            continue
        if any(graph.values[v].datatype != "fp32" for v in (x, u)):
            return None
        return [k, inner, nodes.producer[s]], (x, u), graph.nodes[k].fields["output_id"]
    return None


def _swiglu_step(ids: tuple[int, int], out: int) -> Step:
    x, u = ids

    def swiglu_step(vals: list) -> None:
        vals[out] = vmath.swiglu(vals[x], vals[u])

    def bind(xs: list[np.ndarray], ys: list) -> Optional[Callable[[], None]]:
        if xs[0].shape != xs[1].shape:
            return None  # (a broadcast u: the value-list step)
        out = fixed_output(ys, xs[0].shape)
        return None if out is None else vmath.swiglu_into(*xs, out)

    swiglu_step.bind_fixed = FixedBinding(ids, (out,), bind, makes_arrays=True)
    return swiglu_step


# Nodes whose steps apply the node's own output bounds (XNNPACK's fused activation).
BOUNDED = {"Conv2d", "DepthwiseConv2d", "ConvTranspose2d", "FullyConnected", "Add", "Subtract", "Multiply"}


def _match_clamp_after(nodes: _Nodes, g, k: int) -> Optional[int]:
    """At a Clamp whose input only it reads, made by a node that applies output bounds and stored
    as the Clamp's output is (ExecuTorch's int8 MobileNet: a Clamp after each of 35 convs): the
    index of that node, which then writes the Clamp's output, clamped in its own pass."""
    graph = nodes.graph
    clamp = graph.nodes[k]
    src, out = clamp.fields["input_id"], clamp.fields["output_id"]
    p = nodes.producer.get(src)
    if p is None or p > k or nodes.readers.get(src) != [k] or graph.values[src].flags & EXTERNAL_OUTPUT:
        return None
    if graph.nodes[p].kind not in BOUNDED or not g.stored_alike(src, out):
        return None
    return p


def _clamped_step(graph: Graph, g, p: int, k: int) -> Step:
    """Node p's step with node k's bounds added to its own, writing k's output."""
    node, clamp = graph.nodes[p], graph.nodes[k]
    bounded = replace(node, fields={**node.fields, "output_id": clamp.fields["output_id"]},
                      output_min=max(node.output_min, clamp.output_min), output_max=min(node.output_max, clamp.output_max))
    return BUILDERS[node.kind](bounded, g)


def fused_steps(graph: Graph, g) -> Fused:
    nodes = _Nodes(graph)
    fused = Fused({}, {})
    for ks in _sibling_products(graph, g):  # the products run where the first one did: their input is ready there
        step = _sibling_products_step(graph, g, ks)
        if step is None:
            continue
        for k in ks:
            fused.steps[k], fused.reads_at[k] = NOTHING, ks[0]
        fused.steps[ks[0]] = step
    for k, node in enumerate(graph.nodes):
        if node.kind == "Concatenate2":
            match, make = _match_rotate_pairs(nodes, k), _rotate_pairs_step
        elif node.kind == "Multiply":
            match, make = _match_rms_tail(nodes, k), _rms_tail_step
            if match is None:
                match, make = _match_swiglu(nodes, k), _swiglu_step
        else:
            continue
        if match is None:
            continue
        found, ids, out = match
        if any(j in fused.steps for j in found):
            continue
        for j in found:
            fused.steps[j], fused.reads_at[j] = NOTHING, k
        fused.steps[k] = make(ids, out)
    for k, node in enumerate(graph.nodes):
        p = _match_clamp_after(nodes, g, k) if node.kind == "Clamp" else None
        if p is not None and p not in fused.steps and k not in fused.steps:
            fused.steps[p], fused.steps[k], fused.reads_at[k] = _clamped_step(graph, g, p, k), NOTHING, p
    return fused
