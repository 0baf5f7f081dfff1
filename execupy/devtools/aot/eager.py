"""Torch eager outputs of every graph node of an ETRecord, keyed by debug handle.

    reference = eager_outputs_by_handle("model.etrecord", [x])        # {handle: np.ndarray | tuple}
    Inspector(..., etrecord="model.etrecord").calculate_numeric_gap(reference)

The ETRecord's edge program is the graph the .pte was made from, before out variants and
memory planning; running it node by node in torch (an fx Interpreter) gives, for each debug
handle, what that node computes in eager mode. Parameters, buffers and constants come from
the program itself, the user inputs from the caller.
"""
from __future__ import annotations

import os
from typing import Any, Sequence, Union

import numpy as np
import torch
import torch.fx
from torch.export.graph_signature import InputKind

from ...errors import InvalidInputError
from ...exir.debug_info import HANDLE
from ...exir.etrecord import load_edge_programs


class _Recorder(torch.fx.Interpreter):
    """Runs a graph and keeps the output of every node that has a debug handle."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.by_handle: dict[int, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        handle = n.meta.get(HANDLE)
        if handle is not None:
            self.by_handle[handle] = _to_numpy(result)
        return result


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy().copy()
    if isinstance(value, (list, tuple)):
        return tuple(_to_numpy(v) for v in value)
    return value


_MISSING = object()


def _graph_inputs(ep, inputs: Sequence[Any]) -> list[Any]:
    """One value per placeholder: the program's own tensors, then the user inputs in order."""
    user = iter(torch.as_tensor(x) if isinstance(x, np.ndarray) else x for x in inputs)
    args = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            value = next(user, _MISSING)
            if value is _MISSING:
                raise InvalidInputError(f"the exported program takes more inputs than the {len(inputs)} given")
            args.append(value)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            args.append(ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target])
        else:
            args.append(ep.constants[spec.target])
    return args


def eager_outputs_by_handle(etrecord: Union[str, os.PathLike], inputs: Sequence[Any],
                            method: str = "forward") -> dict[int, Any]:
    """Debug handle -> the eager output of its node (numpy; a tuple for a multi-output node)."""
    programs = load_edge_programs(etrecord)
    if method not in programs:
        raise InvalidInputError(f"{etrecord} has no edge program for method {method!r}; it has {sorted(programs)}")
    ep = programs[method]
    recorder = _Recorder(ep.graph_module)
    with torch.no_grad():
        recorder.run(*_graph_inputs(ep, inputs))
    return recorder.by_handle
