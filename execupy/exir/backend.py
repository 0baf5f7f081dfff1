"""Delegation: hand parts of a graph to a backend (ExecuTorch's to_backend, in small).

    edge = to_edge(export(model, args))
    edge = edge.to_backend(NumpyFusedPartitioner())   # tagged subgraphs -> lowered modules
    prog = edge.to_executorch()                       # each lowered module -> DelegateCall

A `Partitioner` tags nodes (`node.meta["delegation_tag"]`) and says which backend each
tag goes to (`DelegationSpec`). `to_backend` cuts every tag's nodes out as a small
GraphModule (runtime inputs are placeholders, weights are get_attr constants), asks the
backend's `BackendDetails.preprocess` for its payload bytes, and puts one
`executorch_call_delegate(lowered_module, *inputs)` node in its place. The emitter turns
that node into a DelegateCall whose payload lives in its own segment of the .pte file.
"""
from __future__ import annotations

import copy
import heapq
import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._ops import HigherOrderOperator
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from ..errors import ExportError
from ..schema.program import CompileSpec

TAG = "delegation_tag"
ABSORBED = "delegation_absorbed"  # placeholder meta: a weight now stored inside a delegate payload


@dataclass
class DelegationSpec:
    backend_id: str
    compile_specs: list[CompileSpec] = field(default_factory=list)


@dataclass
class PartitionResult:
    tagged_exported_program: ExportedProgram
    partition_tags: dict[str, DelegationSpec]


class Partitioner(ABC):
    @abstractmethod
    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        """Tag the nodes to delegate (node.meta["delegation_tag"] = tag), one spec per tag."""


@dataclass
class PreprocessResult:
    processed_bytes: bytes
    # The backend's debug ids (what its runtime half would log) -> debug handles of the
    # subgraph's nodes (node.meta["debug_handle"]); kept for devtools, not written to the .pte.
    debug_handle_map: dict[int, list[int]] = field(default_factory=dict)
    # Blobs the payload names by key instead of holding (XNNPACK's weights): the program
    # stores each distinct one once as a segment listed in its named data.
    named_data: dict[str, bytes] = field(default_factory=dict)


class BackendDetails(ABC):
    @staticmethod
    @abstractmethod
    def preprocess(edge_program: torch.fx.GraphModule, compile_specs: list[CompileSpec]) -> PreprocessResult:
        """Compile one subgraph into the bytes its runtime half parses at init.

        `edge_program` has one placeholder per runtime input (in DelegateCall order), its
        weights as get_attr nodes on the module, and returns a tuple of its outputs."""


_BACKEND_DETAILS: dict[str, type[BackendDetails]] = {}


def register_backend_details(backend_id: str, details: type[BackendDetails]) -> None:
    _BACKEND_DETAILS[backend_id] = details


class LoweredBackendModule(torch.nn.Module):
    """A preprocessed subgraph; calling it runs the original subgraph in torch."""

    def __init__(self, backend_id: str, processed_bytes: bytes, compile_specs: list[CompileSpec],
                 original_module: torch.fx.GraphModule, debug_handle_map: dict[int, list[int]] | None = None,
                 named_data: dict[str, bytes] | None = None):
        super().__init__()
        self.named_data = dict(named_data or {})
        self.debug_handle_map = dict(debug_handle_map or {})
        self.backend_id = backend_id
        self.processed_bytes = processed_bytes
        self.compile_specs = compile_specs
        self.original_module = original_module

    def forward(self, *args: Any) -> Any:
        return self.original_module(*args)


class _CallDelegate(HigherOrderOperator):
    """The graph node standing for a lowered module. A higher-order operator, so that
    kernel checks skip it (it needs no kernel) and fx can print and recompile it."""

    def __init__(self) -> None:
        super().__init__("execupy_call_delegate")

    def __call__(self, lowered: LoweredBackendModule, *args: Any) -> Any:
        return lowered(*args)


executorch_call_delegate = _CallDelegate()


# ---------------------------------------------------------------------------- to_backend


def to_backend(ep: ExportedProgram, partitioner: Partitioner) -> ExportedProgram:
    """A copy of `ep` where every tagged subgraph is replaced by a lowered-module call."""
    result = partitioner.partition(copy.deepcopy(ep))
    ep = result.tagged_exported_program
    gm = ep.graph_module
    groups: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        tag = node.meta.get(TAG)
        if tag is not None and node.op == "call_function":
            groups.setdefault(tag, []).append(node)
    for k, (tag, nodes) in enumerate(groups.items()):
        spec = result.partition_tags.get(tag)
        if spec is None:
            raise ExportError(f"partitioner tagged nodes {tag!r} but gave no DelegationSpec for it")
        details = _BACKEND_DETAILS.get(spec.backend_id)
        if details is None:
            raise ExportError(f"no BackendDetails registered for backend {spec.backend_id!r} "
                              f"(known: {sorted(_BACKEND_DETAILS)})")
        _lower_group(ep, nodes, spec, details, f"lowered_module_{k}")
    for node in gm.graph.nodes:
        node.meta.pop(TAG, None)
    # A call sits where its group's last node was; outside users that sat between the
    # group's nodes now come before it, so restore a topological order.
    stable_topological_sort(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return ep


def _constant_inputs(ep: ExportedProgram) -> dict[str, torch.Tensor]:
    """Placeholder name -> tensor, for the weights a delegate may embed (never mutated state)."""
    sig = ep.graph_signature
    mutated = {s.target for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    out = {}
    for spec in sig.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR) \
                and spec.target not in mutated:
            t = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
            out[spec.arg.name] = t
    return out


def _lower_group(ep: ExportedProgram, nodes: list[torch.fx.Node], spec: DelegationSpec,
                 details: type[BackendDetails], name: str) -> None:
    gm = ep.graph_module
    inside = set(nodes)
    constants = _constant_inputs(ep)
    sub_root = torch.nn.Module()
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    runtime_inputs: list[torch.fx.Node] = []

    def input_for(n: torch.fx.Node) -> torch.fx.Node:
        if n not in env:
            if n.op == "placeholder" and n.name in constants:
                sub_root.register_buffer(n.name, constants[n.name].detach().clone())
                env[n] = sub.get_attr(n.name)
            else:
                runtime_inputs.append(n)
                env[n] = sub.placeholder(n.name)
            env[n].meta["val"] = n.meta.get("val")
        return env[n]

    # Placeholders first (fx wants them at the top of the graph), then the ops.
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in inside and not (a.op == "placeholder" and a.name in constants):
                input_for(a)
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in inside:
                input_for(a)
        env[node] = sub.node_copy(node, lambda a: env[a])
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub.output(tuple(env[n] for n in outputs))
    sub_gm = torch.fx.GraphModule(sub_root, sub)

    result = details.preprocess(sub_gm, list(spec.compile_specs))
    lowered = LoweredBackendModule(spec.backend_id, bytes(result.processed_bytes), list(spec.compile_specs), sub_gm,
                                   result.debug_handle_map, result.named_data)
    gm.add_submodule(name, lowered)

    # The call goes where the group's last node was (all its inputs come before that);
    # to_backend re-sorts the graph for outside users placed earlier.
    with gm.graph.inserting_after(nodes[-1]):
        attr = gm.graph.get_attr(name)
    with gm.graph.inserting_after(attr):
        call = gm.graph.call_function(executorch_call_delegate, (attr, *runtime_inputs))
    call.meta["val"] = tuple(n.meta["val"] for n in outputs)
    last = call
    for i, n in enumerate(outputs):
        with gm.graph.inserting_after(last):
            item = gm.graph.call_function(operator.getitem, (call, i))
        item.meta["val"] = n.meta["val"]
        n.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        last = item
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    for n in list(env):
        if n.op == "placeholder" and n.name in constants and not n.users:
            n.meta[ABSORBED] = True  # the emitter does not store it again


def _writes_in_place(node: torch.fx.Node, arg: torch.fx.Node) -> bool:
    """Does `node` mutate `arg` (an argument at a `Tensor(a!)` position of its schema)?"""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    given = dict(zip((a.name for a in node.target._schema.arguments), node.args), **node.kwargs)
    return any(given.get(a.name) is arg and a.alias_info is not None and a.alias_info.is_write
               for a in node.target._schema.arguments)


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Put every node after its inputs, moving as few nodes as possible.

    Among the nodes whose inputs are placed, the one that came first goes next, so an
    order that was already topological stays as it was. A buffer written in place (the
    KV cache by llama::update_cache) links its readers and writers by nothing but their
    order, so those keep their original order explicitly.
    """
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    deps = {n: set(n.all_input_nodes) for n in nodes}
    for value in nodes:
        users = sorted(value.users, key=index.__getitem__)
        if any(_writes_in_place(u, value) for u in users):
            for before, after in zip(users, users[1:]):
                deps[after].add(before)
    dependents: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            dependents[d].append(n)
    waiting = {n: len(ds) for n, ds in deps.items()}
    ready = [index[n] for n in nodes if not waiting[n]]
    heapq.heapify(ready)
    order: list[torch.fx.Node] = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        order.append(n)
        for d in dependents[n]:
            waiting[d] -= 1
            if not waiting[d]:
                heapq.heappush(ready, index[d])
    if len(order) != len(nodes):
        raise ExportError("delegation left a cycle in the graph (a partition was not convex)")
    for prev, n in zip(order, order[1:]):
        if prev.next is not n:
            prev.append(n)


# ---------------------------------------------------------------------------- partition helper


def tag_supported_runs(gm: torch.fx.GraphModule, supported: Any, prefix: str = "tag",
                       worth: Any = lambda component: True) -> list[str]:
    """Tag each connected component of each convex run of supported call nodes.

    Nodes are visited in graph order. An unsupported node that reads (directly or not)
    from the current run is "tainted"; a supported node that reads a tainted node would
    close a cycle (run -> outside -> run), so it starts a new run instead. Every other
    supported node joins the run, so unsupported nodes that merely sit between supported
    ones (a view of the input) do not split it. Each connected component of a run is
    convex too, so it can become one call; to_backend re-sorts the graph afterwards.
    `worth(component)` may refuse a component (e.g. one that only moves data)."""
    runs: list[list[torch.fx.Node]] = [[]]
    in_run: set[torch.fx.Node] = set()
    tainted: set[torch.fx.Node] = set()
    # Supported nodes that read only graph inputs (a weight's permute) wait for their
    # first supported reader and join its run, rather than forming a delegate of their own.
    waiting: set[torch.fx.Node] = set()

    def join(node: torch.fx.Node) -> None:
        for a in node.all_input_nodes:
            if a in waiting:
                waiting.discard(a)
                join(a)
        runs[-1].append(node)
        in_run.add(node)

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        inputs = node.all_input_nodes
        if node.op == "call_function" and supported(node):
            if all(a.op in ("placeholder", "get_attr") or a in waiting for a in inputs):
                waiting.add(node)
                continue
            if any(a in tainted for a in inputs):
                runs.append([])
                in_run, tainted = set(), set()
            join(node)
        else:
            for a in inputs:  # read by a kernel call: the waiting node joins the current run now
                if a in waiting:
                    waiting.discard(a)
                    join(a)
            if any(a in in_run or a in tainted for a in inputs):
                tainted.add(node)
    # Still waiting: read only by the graph's output (or nobody); they depend on graph
    # inputs alone, so one more run of them is convex.
    runs.append([n for n in gm.graph.nodes if n in waiting])
    tags: list[str] = []
    for run in runs:
        for component in _components(run):
            if not worth(component):
                continue
            tag = f"{prefix}{len(tags)}"
            for n in component:
                n.meta[TAG] = tag
            tags.append(tag)
    return tags


def _components(run: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    members = set(run)
    parent = {n: n for n in run}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in run:
        for a in n.all_input_nodes:
            if a in members:
                parent[find(a)] = find(n)
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in run:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def get_lowered_modules(ep: ExportedProgram) -> list[LoweredBackendModule]:
    return [m for m in ep.graph_module.children() if isinstance(m, LoweredBackendModule)]


__all__ = [
    "BackendDetails", "DelegationSpec", "LoweredBackendModule", "PartitionResult", "Partitioner",
    "PreprocessResult", "executorch_call_delegate", "get_lowered_modules", "register_backend_details",
    "tag_supported_runs", "to_backend",
]

