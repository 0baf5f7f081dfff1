"""The torch half of a custom operator (see execupy/kernels/custom.py for the whole picture).

    implement(scale_add, lambda x, y, alpha=1.0: x + alpha * y)
    torch.ops.mylib.scale_add(x, y, 2.0)      # now callable in a model, and exportable

`implement` defines the functional op and its out variant in torch's operator registry
(`torch.library`), with `impl` as the eager implementation. Shape inference during
export runs `impl` on meta tensors unless `fake` is given (for an impl that reads
values, give a `fake` that only builds the result's shape). to_edge then finds the out
variant by its schema, so the program names `mylib::scale_add.out`, the key the numpy
kernel is registered under.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..errors import ExportError
from ..kernels.custom import CustomOp

# The Library objects must stay alive for their registrations to last.
_LIBRARIES: dict[str, torch.library.Library] = {}


def implement(op: CustomOp, impl: Callable[..., torch.Tensor],
              fake: Optional[Callable[..., torch.Tensor]] = None) -> torch._ops.OpOverloadPacket:
    """Define `op` in torch with `impl` as its implementation; returns torch.ops.<ns>.<name>."""
    if hasattr(getattr(torch.ops, op.namespace), op.op):
        raise ExportError(f"operator {op.name} is already defined in torch; define it once per process")
    lib = _LIBRARIES.get(op.namespace)
    if lib is None:
        lib = _LIBRARIES[op.namespace] = torch.library.Library(op.namespace, "FRAGMENT")
    lib.define(op.schema)
    lib.define(op.out_schema)
    lib.impl(op.op, impl, "CompositeExplicitAutograd")
    lib.impl(op.op, fake or impl, "Meta")
    return getattr(getattr(torch.ops, op.namespace), op.op)
