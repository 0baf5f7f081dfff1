"""Module: the convenience API. Load a .pte, call its methods with nested outputs."""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

from ..errors import MalformedProgramError
from .method import Method
from .program import Program


def unflatten(flat: list, encoded_out_str: str) -> Any:
    """Re-nest flat outputs with the JSON tree spec written by the exporter (docs/format.md §22).

    Falls back to the flat list when the spec is absent or unreadable.
    """
    if not encoded_out_str:
        return flat
    try:
        protocol, tree = json.loads(encoded_out_str)
    except (ValueError, TypeError):
        return flat
    leaves = iter(flat)

    def build(node: dict) -> Any:
        kind, children = node.get("type"), node.get("children_spec", [])
        if kind is None:
            return next(leaves)
        items = [build(c) for c in children]
        if kind == "builtins.tuple":
            return tuple(items)
        if kind == "builtins.list":
            return items
        if kind in ("builtins.dict", "collections.OrderedDict"):
            keys = json.loads(node.get("context") or "[]")
            return dict(zip(keys, items))
        return tuple(items)  # namedtuples and other containers: keep order

    try:
        result = build(tree)
    except (StopIteration, AttributeError, TypeError, ValueError):
        return flat
    if next(leaves, StopIteration) is not StopIteration:
        return flat
    return result


class Module:
    """Load a program and call its methods like a torch module.

    >>> m = Module("model.pte")
    >>> y = m.forward(x)               # nested like the model's own outputs
    >>> m.run_method("encode", tokens)
    """

    def __init__(self, source: Union[str, os.PathLike, bytes], event_tracer=None, fuse: Optional[bool] = None,
                 **program_kwargs):
        self.program = Program.load(source, **program_kwargs)
        self.event_tracer = event_tracer  # given to every method this module loads
        self.fuse = fuse  # load-time fusion (runtime/fusion.py): None = on unless EXECUPY_FUSION=0
        self._methods: dict[str, Method] = {}

    @property
    def method_names(self) -> list[str]:
        return self.program.method_names

    def method(self, name: str) -> Method:
        if name not in self._methods:
            self._methods[name] = self.program.load_method(name, event_tracer=self.event_tracer, fuse=self.fuse)
        return self._methods[name]

    def run_method(self, name: str, *args: Any) -> Any:
        method = self.method(name)
        flat = method.execute(list(args))
        return unflatten(flat, method.plan.container_meta_type.encoded_out_str)

    def forward(self, *args: Any) -> Any:
        return self.run_method("forward", *args)

    __call__ = forward

    def __repr__(self) -> str:
        return f"<Module methods={self.method_names}>"


__all__ = ["Module", "unflatten", "MalformedProgramError"]
