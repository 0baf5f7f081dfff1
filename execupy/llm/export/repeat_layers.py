"""Capture two transformer layers and repeat the second in the edge graph (needs torch).

Tracing is most of an LLM export's time, and nearly all of it goes to the layers, each
traced twice (torch.export, then the core-ATen decomposition) with the token count
symbolic: SmolLM2's 30 layers took 32 of its 39 seconds. Every layer of a decoder runs
the same code on its own weights and KV cache, so this module lets the exporter trace
two and stamp out the rest:

    same_layers(model)                    are layers 1..n-1 built like layer 1?
    two_layers(model)                     with: model.layers is its first two layers
    repeat_layers(edge_program, model)    the edge graph with layer 1 copied for layers 2..n-1

Layer 1, not layer 0, is the template: it takes its input from a layer, as every later
layer does. Each copy reads layer k's own parameters and buffers (new placeholders, in
the places a full capture gives them), its input from layer k-1's copy, and what all
layers share (RoPE tables, start position) from the same nodes; what came after the
layers now reads the last one. The result is the graph a capture of all layers gives,
node for node, so the program written is the same file (tests/llm/test_repeat_layers.py).

Anything unexpected returns None from repeat_layers, and the caller captures every layer.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator, Optional

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument

TEMPLATE = 1  # the layer copied; layer 0 is the one before it


def same_layers(model: torch.nn.Module) -> bool:
    """Do layers 2..n-1 match layer 1 in everything tracing sees but tensor values?"""
    layers = list(getattr(model, "layers", ()))
    if len(layers) <= TEMPLATE + 1:
        return False
    template = _structure(layers[TEMPLATE])
    try:
        return all(_structure(layer) == template for layer in layers[TEMPLATE + 1:])
    except Exception:  # noqa: BLE001  attributes that do not compare (arrays, say): capture them all
        return False


def _structure(layer: torch.nn.Module) -> list:
    """Each submodule's name, type and plain attributes; tensors by shape and dtype only."""
    out = []
    for name, module in layer.named_modules():
        attrs = sorted((k, _plain(v)) for k, v in vars(module).items()
                       if not k.startswith("_") and not isinstance(v, torch.nn.Module))
        tensors = [(k, _plain(t)) for k, t in (*module.named_parameters(recurse=False),
                                               *module.named_buffers(recurse=False))]
        out.append((name, type(module), attrs, tensors))
    return out


def _plain(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return value


@contextlib.contextmanager
def two_layers(model: torch.nn.Module) -> Iterator[None]:
    """model.layers cut to its first two layers for the duration (the same module objects)."""
    layers = model.layers
    model.layers = torch.nn.ModuleList(list(layers)[:TEMPLATE + 1])
    try:
        yield
    finally:
        model.layers = layers


def repeat_layers(ep: ExportedProgram, model: torch.nn.Module) -> Optional[ExportedProgram]:
    """ep (the edge program of a two-layer capture of model) with layer 1 repeated for
    layers 2..n-1 of model, in place; None if the graph is not laid out as expected."""
    graph = ep.graph_module.graph
    first, template = _layer_nodes(graph, 0), _layer_nodes(graph, TEMPLATE)
    if first is None or template is None:
        return None
    carried = _carried(first, template)
    specs = {n.name: s for n, s in zip(_placeholders(graph), ep.graph_signature.input_specs)}
    own = _own_placeholders(graph, template, specs)
    if carried is None or own is None:
        return None
    layers = _add_placeholders(ep, model, own, specs)  # per copied layer: template node -> its own
    previous, last = {n: n for n in template}, template[-1]
    for k, env in enumerate(layers, start=TEMPLATE + 1):
        def source(a: torch.fx.Node, env=env, previous=previous) -> torch.fx.Node:
            if a in env:
                return env[a]
            return previous[carried[a]] if a in carried else a  # what the layer before gave / all share

        for node in template:
            with graph.inserting_after(last):
                last = env[node] = graph.node_copy(node, source)
            last.meta = _meta_for_layer(node.meta, k)
        previous = env
    _rewire_after_layers(template, layers)
    _repeat_outputs(ep, layers)
    for node in graph.nodes:  # numbered again, in graph order, by the edge manager built on ep
        node.meta.pop("debug_handle", None)
    graph.lint()
    ep.graph_module.recompile()
    return ep


def _layer_nodes(graph: torch.fx.Graph, index: int) -> Optional[list[torch.fx.Node]]:
    """The call nodes of layers.<index>, in graph order, if they sit together."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    inside = [i for i, n in enumerate(nodes) if _layer_of(n) == index]
    if not inside or inside != list(range(inside[0], inside[-1] + 1)):
        return None
    return [nodes[i] for i in inside]


def _carried(first: list, template: list) -> Optional[dict]:
    """Layer 0's tensors that layer 1 reads (its output, the next layer's input) -> the
    template nodes that give the same to the layer after it. Symbolic sizes layer 0
    computed first are shared by every later layer, as in a capture of them all. None if
    the correspondence is not clear."""
    inside = set(first)
    read = [a for a in dict.fromkeys(a for n in template for a in n.all_input_nodes) if a in inside]
    tensors = [a for a in read if isinstance(a.meta.get("val"), torch.Tensor)]
    if [n.target for n in first] == [n.target for n in template]:
        return {a: template[first.index(a)] for a in tensors}
    inside = set(template)
    given = [n for n in template if any(u not in inside and u.op != "output" for u in n.users)]
    return {tensors[0]: given[0]} if len(tensors) == 1 and len(given) == 1 else None


def _layer_of(node: torch.fx.Node) -> Optional[int]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack and node.target.__name__ == "getitem":  # picks an output of the op before it
        return _layer_of(node.args[0])
    for path, _type in stack.values():
        m = re.match(r"layers\.(\d+)(\.|$)", path)
        if m:
            return int(m.group(1))
    return None


def _placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _own_placeholders(graph: torch.fx.Graph, template: list, specs: dict) -> Optional[list[torch.fx.Node]]:
    """The template's own weights and buffers (targets under layers.1.), in input order; None
    if it reads a state tensor that is neither its own nor shared with code outside it."""
    inside = set(template)
    prefix = f"layers.{TEMPLATE}."
    own = []
    for p in _placeholders(graph):
        spec = specs[p.name]
        if spec.kind == InputKind.USER_INPUT or not any(u in inside for u in p.users):
            continue
        if spec.target.startswith(prefix):
            own.append(p)
        elif all(u in inside for u in p.users):
            return None  # a constant only this layer reads, named for no layer: whose is it?
    return own


def _retarget(target: str, k: int) -> str:
    return f"layers.{k}." + target[len(f"layers.{TEMPLATE}."):]


def _add_placeholders(ep: ExportedProgram, model: torch.nn.Module, own: list, specs: dict) -> list[dict]:
    """Placeholders, input specs and tensors of layers 2..n-1: each run of the template's
    placeholders is followed by the same run for layer 2, then layer 3, and so on, the
    order a capture of every layer gives. Returns, per new layer, template placeholder ->
    that layer's."""
    graph = ep.graph_module.graph
    input_specs = ep.graph_signature.input_specs
    layers = [{} for _ in range(TEMPLATE + 1, len(model.layers))]
    for run in _runs(_placeholders(graph), set(own)):
        anchor, added = run[-1], []
        for k, made in enumerate(layers, start=TEMPLATE + 1):
            for p in run:
                spec = specs[p.name]
                target = _retarget(spec.target, k)
                with graph.inserting_after(anchor):
                    anchor = made[p] = graph.placeholder(_placeholder_name(p.name, spec, k))
                anchor.meta = dict(p.meta)
                added.append(InputSpec(spec.kind, TensorArgument(name=anchor.name), target, spec.persistent))
                store = ep.state_dict if spec.target in ep.state_dict else ep.constants
                store[target] = _tensor_at(model, target)
        end = next(i for i, s in enumerate(input_specs) if s.arg.name == run[-1].name) + 1
        input_specs[end:end] = added
    return layers


def _runs(nodes: list, chosen: set) -> list[list]:
    """The maximal stretches of consecutive nodes that are all in chosen."""
    runs, current = [], []
    for n in nodes:
        if n in chosen:
            current.append(n)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _placeholder_name(name: str, spec: InputSpec, k: int) -> str:
    return name.replace(spec.target.replace(".", "_"), _retarget(spec.target, k).replace(".", "_"))


def _tensor_at(model: torch.nn.Module, target: str) -> torch.Tensor:
    owner, _, attr = target.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


def _meta_for_layer(meta: dict, k: int) -> dict:
    """The template node's metadata as layer k's: its module paths name layer k."""
    meta = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        def rename(s: str) -> str:
            return re.sub(rf"layers\.{TEMPLATE}(?=\.|$)", f"layers.{k}", s)
        meta["nn_module_stack"] = {rename(key): (rename(path), kind) for key, (path, kind) in stack.items()}
    return meta


def _rewire_after_layers(template: list, layers: list) -> None:
    """Code after the layers (final norm, head) reads the last layer instead of layer 1."""
    inside = set(template) | {c for env in layers for c in env.values()}
    for node in template:
        node.replace_all_uses_with(layers[-1][node], delete_user_cb=lambda u: u not in inside and u.op != "output")


def _repeat_outputs(ep: ExportedProgram, layers: list) -> None:
    """Each run of the template's buffer mutations is followed by the same run for every
    later layer; user outputs come from the last layer."""
    output = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
    pairs = list(zip(ep.graph_signature.output_specs, output.args[0]))
    prefix = f"layers.{TEMPLATE}."
    mutated = {i for i, (s, _) in enumerate(pairs)
               if s.kind == OutputKind.BUFFER_MUTATION and s.target.startswith(prefix)}
    runs = _runs(list(range(len(pairs))), mutated)
    run_after = {run[-1]: run for run in runs}
    new_specs, values = [], []
    for i, (spec, value) in enumerate(pairs):
        new_specs.append(spec)
        values.append(value if i in mutated else layers[-1].get(value, value))
        for k, env in enumerate(layers if i in run_after else (), start=TEMPLATE + 1):
            for s, v in (pairs[j] for j in run_after[i]):
                new_specs.append(OutputSpec(s.kind, TensorArgument(name=env[v].name), _retarget(s.target, k)))
                values.append(env[v])
    ep.graph_signature.output_specs[:] = new_specs
    output.args = (tuple(values),)
