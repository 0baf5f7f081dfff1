"""Kernel libraries: `portable/`, `quantized/` and `llm/`, one module per operator family.

Each module registers its kernels with `@register_kernel("aten::name.overload")` when
imported. Importing this package registers nothing: the first kernel lookup
(`registry.get_kernel`) imports every family module, or, under a kernel list
(`execupy.kernels.selection`, the EXECUPY_KERNELS variable), only the modules the list
names. A new kernel family is a new file, nothing else to edit.
"""
import importlib
import pkgutil

FAMILIES = ("portable", "quantized", "llm")


def builtin_kernel_modules() -> list[str]:
    """Every built-in kernel module, by dotted name (found by listing the family folders)."""
    names = []
    for family in FAMILIES:
        package = importlib.import_module(f"{__name__}.{family}")
        names += [f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)
                  if not info.name.startswith("_")]
    return names
