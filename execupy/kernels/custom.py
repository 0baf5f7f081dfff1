"""Custom operators, defined once: a name and schema, a numpy kernel, a torch implementation.

The runtime half lives here and needs numpy only; the torch half (used when exporting)
is `execupy.exir.custom_ops.implement`. Keep the two in separate modules, so that the
program runs where torch is not installed:

    # mylib_kernels.py: numpy only
    import numpy as np
    from execupy.kernels.custom import custom_op

    scale_add = custom_op("mylib::scale_add(Tensor x, Tensor y, float alpha=1.0) -> Tensor")

    @scale_add.kernel
    def _(x, y, alpha, out):
        np.add(x, alpha * y, out=out)
        return out

    # mylib_export.py: torch side
    from execupy.exir.custom_ops import implement
    from mylib_kernels import scale_add

    implement(scale_add, lambda x, y, alpha=1.0: x + alpha * y)   # torch.ops.mylib.scale_add

The schema is written in torch's schema language, with the namespace. The exporter writes
the call as the operator's out variant, `mylib::scale_add.out`, whose schema is the
functional one plus a keyword-only `out` tensor; the kernel is registered under that key
and called as every kernel is (kernels/registry.py): the arguments in schema order, then
`out`, and it returns the result. One Tensor result is supported.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from ..errors import InvalidInputError
from .registry import Kernel, register_kernel

_SCHEMA = re.compile(r"^\s*(?P<ns>\w+)::(?P<op>\w+)\s*\((?P<args>.*)\)\s*->\s*(?P<ret>.+?)\s*$")


@dataclass(frozen=True)
class CustomOp:
    namespace: str  # "mylib"
    op: str  # "scale_add"
    arguments: str  # "Tensor x, Tensor y, float alpha=1.0"
    returns: str  # "Tensor"

    @property
    def name(self) -> str:
        return f"{self.namespace}::{self.op}"

    @property
    def kernel_key(self) -> str:
        """The key the program names and the runtime looks the kernel up by."""
        return f"{self.name}.out"

    @property
    def schema(self) -> str:
        """The functional schema without the namespace (as torch.library.Library.define takes it)."""
        return f"{self.op}({self.arguments}) -> {self.returns}"

    @property
    def out_schema(self) -> str:
        """The out variant's schema: the functional arguments, then `*, Tensor(x!) out`."""
        used = set(re.findall(r"\((\w)!?\)", self.arguments))
        alias = next(c for c in "abcdefghijklmnopqrstuvwxyz" if c not in used)
        keyword_only_already = "*" in [a.strip() for a in self.arguments.split(",")]
        out = f"Tensor({alias}!) out" if keyword_only_already else f"*, Tensor({alias}!) out"
        args = f"{self.arguments}, {out}" if self.arguments else out
        return f"{self.op}.out({args}) -> Tensor({alias}!)"

    def kernel(self, fn: Kernel) -> Kernel:
        """Decorator: register `fn` as this operator's numpy kernel (under kernel_key)."""
        return register_kernel(self.kernel_key)(fn)


def custom_op(schema: str) -> CustomOp:
    """Declare an operator from its schema, e.g. "mylib::scale_add(Tensor x, float a) -> Tensor"."""
    m = _SCHEMA.match(schema)
    if m is None:
        raise InvalidInputError(f"custom op schema {schema!r} is not 'namespace::name(arguments) -> Tensor'")
    if m["ns"] == "aten":
        raise InvalidInputError(f"custom op {m['op']!r}: the aten namespace belongs to PyTorch; pick your own")
    if m["ret"] != "Tensor":
        raise InvalidInputError(f"custom op {m['ns']}::{m['op']}: returns {m['ret']!r}; only one Tensor is supported")
    return CustomOp(m["ns"], m["op"], m["args"].strip(), m["ret"])

