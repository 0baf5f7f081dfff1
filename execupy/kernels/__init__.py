"""Kernel libraries. Importing this package registers every built-in kernel.

Each module under `portable/`, `quantized/` and `llm/` registers its kernels with
`@register_kernel("aten::name.overload")` when imported; this file imports them all,
so a new kernel family is a new file, nothing else to edit.
"""
import importlib
import pkgutil

from . import llm, portable, quantized


def _import_all(package) -> None:
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")


_import_all(portable)
_import_all(quantized)
_import_all(llm)
