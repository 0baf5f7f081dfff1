"""Every operator of an ExecuTorch kernel library has a kernel in execupy.

The operator lists are ExecuTorch's own yaml files, read from the reference venv
(~/.cache/execupy-reference, or $EXECUPY_REFERENCE_VENV), so a new ExecuTorch release
that adds an operator makes this test name it. Each yaml entry starts with `- op: name.overload`
(an ATen operator) or `- func: [namespace::]name.overload(schema)`; the kernel key is
`namespace::name.overload`, `aten` when no namespace is given.

Not expected to have kernels: backward operators (training only) and ExecuTorch's
host/device copies (`et_copy::`), which only a device-partitioned program contains.
Loading a program that uses one fails with UnsupportedOperatorError (see
test_portable_more.py).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from execupy.kernels.registry import kernel_names

REFERENCE_VENV = Path(os.environ.get("EXECUPY_REFERENCE_VENV", Path.home() / ".cache" / "execupy-reference"))

# Paths inside the installed executorch package: the portable library and the quantized one.
LIBRARIES = ["kernels/portable/functions.yaml", "kernels/portable/custom_ops.yaml",
             "kernels/quantized/quantized.yaml"]

_ENTRY = re.compile(r"^- (?:op|func):\s*([A-Za-z0-9_:.]+)", re.MULTILINE)


def not_for_inference(key: str) -> bool:
    """Backward operators and host/device copies: no kernel needed (load refuses them)."""
    return "_backward" in key or key.startswith("et_copy::")


def library_yaml(library: str) -> Path | None:
    """The yaml file of `library` in the reference venv, or None when it is not installed."""
    found = sorted(REFERENCE_VENV.glob(f"lib/python*/site-packages/executorch/{library}"))
    return found[0] if found else None


def operator_keys(yaml_path: Path) -> list[str]:
    """Kernel keys of every operator the yaml file registers, in file order."""
    keys = []
    for name in _ENTRY.findall(yaml_path.read_text()):
        keys.append(name if "::" in name else f"aten::{name}")
    return keys


def missing_kernels(yaml_path: Path) -> list[str]:
    """The inference operators of `yaml_path` that have no kernel registered in execupy."""
    have = set(kernel_names())
    return [k for k in operator_keys(yaml_path) if k not in have and not not_for_inference(k)]


@pytest.mark.parametrize("library", LIBRARIES)
def test_every_operator_of_the_library_has_a_kernel(library):
    path = library_yaml(library)
    if path is None:
        pytest.skip(f"ExecuTorch's {library} not found under {REFERENCE_VENV} (set EXECUPY_REFERENCE_VENV)")
    keys = operator_keys(path)
    assert keys, f"no operators parsed from {path}: has the yaml format changed?"
    missing = missing_kernels(path)
    assert not missing, f"{len(missing)} of {len(keys)} operators in {library} have no kernel: {missing}"


def test_operator_keys_follow_the_registry_convention(tmp_path):
    """The parser gives `aten::` to plain ATen names and keeps explicit namespaces."""
    yaml = tmp_path / "functions.yaml"
    yaml.write_text("- op: add.out\n  kernels: []\n"
                    "- func: dim_order_ops::_clone_dim_order.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)\n"
                    "- op: convolution_backward.out\n"
                    "- func: et_copy::_h2d_copy.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)\n"
                    "- func: frobnicate.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)\n")
    assert operator_keys(yaml) == ["aten::add.out", "dim_order_ops::_clone_dim_order.out",
                                   "aten::convolution_backward.out", "et_copy::_h2d_copy.out", "aten::frobnicate.out"]
    assert missing_kernels(yaml) == ["aten::frobnicate.out"]


def test_all_libraries_together_have_every_inference_operator():
    """The whole count, as the foundations issue states it: 226 of 226 for ExecuTorch 1.5.1."""
    paths = [library_yaml(library) for library in LIBRARIES]
    if None in paths:
        pytest.skip(f"ExecuTorch's kernel libraries not found under {REFERENCE_VENV}")
    wanted = [k for path in paths for k in operator_keys(path) if not not_for_inference(k)]
    have = set(kernel_names())
    covered = [k for k in wanted if k in have]
    print(f"{len(covered)} of {len(wanted)} operators of ExecuTorch's portable and quantized libraries have a kernel")
    assert len(wanted) >= 226, f"only {len(wanted)} operators parsed: has the yaml format changed?"
    assert covered == wanted, f"missing: {sorted(set(wanted) - have)}"
