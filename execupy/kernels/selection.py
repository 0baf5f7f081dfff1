"""Only the kernels a program needs: kernel lists.

A deployment that runs known programs need not import every kernel family. `execupy
kernels a.pte b.pte -o kernels.txt` writes the operators (and backends) those programs
use, each with the module whose import registers its kernel; the runtime then imports
only those modules when told to, before the first program is loaded:

    from execupy.kernels.selection import use_kernel_list
    use_kernel_list("kernels.txt")          # or: EXECUPY_KERNELS=kernels.txt python app.py
    Module("model.pte")                     # imports only the modules kernels.txt names

A program that needs an operator the list leaves out fails at load with
UnsupportedOperatorError naming the operator and the list. The file is plain text, one
entry per line (`#` starts a comment):

    operator aten::add.out execupy.kernels.portable.binary
    backend NumpyFusedBackend

Modules outside execupy (a custom operator's kernel module) are imported by name too,
so they must be importable where the list is used.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Union

from ..errors import InvalidInputError
from ..fileio import atomic_write

ENV_VAR = "EXECUPY_KERNELS"


@dataclass
class KernelList:
    """Operator keys (each with the module that registers its kernel) and backend ids."""

    operators: dict[str, str] = field(default_factory=dict)
    backends: list[str] = field(default_factory=list)
    source: str = ""  # where it was read from, for error messages

    def modules(self) -> list[str]:
        return sorted(set(self.operators.values()))

    def to_text(self, header: str = "") -> str:
        lines = ["# execupy kernel list: the operators and backends some programs need."]
        lines += [f"# {line}" for line in header.splitlines()]
        lines += [f"operator {key} {module}" for key, module in sorted(self.operators.items())]
        lines += [f"backend {backend}" for backend in sorted(self.backends)]
        return "\n".join(lines) + "\n"

    def save(self, path: Union[str, os.PathLike], header: str = "") -> None:
        atomic_write(path, self.to_text(header))

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "KernelList":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise InvalidInputError(f"cannot read kernel list {path}: {e.strerror}") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str = "<text>") -> "KernelList":
        result = cls(source=source)
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if words[0] == "operator" and len(words) == 3:
                result.operators[words[1]] = words[2]
            elif words[0] == "backend" and len(words) == 2:
                result.backends.append(words[1])
            else:
                raise InvalidInputError(f"{source} line {number}: expected 'operator KEY MODULE' or "
                                        f"'backend ID', got {line.strip()!r}")
        return result


_selected: Optional[KernelList] = None


def use_kernel_list(kernels: Union[KernelList, str, os.PathLike]) -> None:
    """Import only the kernel modules `kernels` names (a KernelList or a path to one).
    Call it before the first program is loaded: kernels once imported stay registered."""
    global _selected
    from . import registry

    if registry._loaded:
        raise InvalidInputError("use_kernel_list must come before the first program is loaded "
                                "(the kernels are imported already)")
    _selected = kernels if isinstance(kernels, KernelList) else KernelList.load(kernels)


def active_kernel_list() -> Optional[KernelList]:
    """The list in force: the one given to use_kernel_list, else $EXECUPY_KERNELS, else None."""
    global _selected
    if _selected is None and os.environ.get(ENV_VAR):
        _selected = KernelList.load(os.environ[ENV_VAR])
    return _selected


def modules_to_import() -> list[str]:
    """What the first kernel lookup imports: the active list's modules, or every built-in one."""
    selected = active_kernel_list()
    if selected is not None:
        return selected.modules()
    from . import builtin_kernel_modules

    return builtin_kernel_modules()


def missing_kernel_reason(key: str) -> str:
    """Why `key` has no kernel and what to do about it, to follow "operator KEY" in an error."""
    selected = active_kernel_list()
    if selected is not None and key not in selected.operators:
        return (f"is not in the kernel list {selected.source or '(given to use_kernel_list)'}; write the list "
                f"again with `execupy kernels` over every program you run, or unset {ENV_VAR}")
    return (f"has no kernel in execupy; register a numpy kernel for it with "
            f"@execupy.runtime.register_kernel({key!r}) (or execupy.kernels.custom.CustomOp.kernel) "
            f"in a module imported before the program is loaded")


# ---------------------------------------------------------------------------- building a list


def all_kernel_origins() -> dict[str, str]:
    """Every registered operator key and the module that registers it (imports all kernels)."""
    from . import registry

    registry.kernel_names()
    if active_kernel_list() is None:
        return dict(registry.ORIGINS)
    # Under a list only its modules were imported; the built-in ones are all wanted here.
    from . import builtin_kernel_modules

    for name in builtin_kernel_modules():
        registry.import_kernel_module(name)
    return dict(registry.ORIGINS)


def kernel_list_for(operators: Iterable[str], backends: Iterable[str] = ()) -> tuple[KernelList, list[str]]:
    """The list that covers `operators`, and the operators no registered kernel covers."""
    origins = all_kernel_origins()
    needed = sorted(set(operators))
    found = KernelList({key: origins[key] for key in needed if key in origins}, sorted(set(backends)))
    return found, [key for key in needed if key not in origins]
