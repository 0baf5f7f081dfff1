"""The runtime half of execupy works in a process where torch (and executorch) cannot be imported.

The boundary is in the paths: a module may import torch only when a folder or file on
its path is named for the torch side (TORCH_SIDE: `exir/`, `llm/export/`,
`backends/<name>/aot.py`, `quantization/`). A child interpreter installs a meta-path
finder that refuses `torch`, `executorch` and their submodules (and records who asked),
walks execupy/ and imports every other module, then runs conformance programs (ExecuTorch's
where ../shared is present, and our own exporter's, built beforehand by tests/programs.py)
through Module and checks their outputs against the expected ones.

A second test reads the imports of every module (without running them) and checks that
the layers import only downward: schema -> kernels -> runtime -> the rest.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from . import programs
from .conformance import named

REPO = Path(__file__).resolve().parents[1]

# Folder and module names that mark the torch side of the package.
TORCH_SIDE = ("exir", "export", "aot", "quantization")

CASES = [c.name for c in named(
    "portable-add_sub_mul_div_broadcast", "portable-nested_outputs", "portable-llama_block",
    "execupy-add_sub_mul_div_broadcast", "execupy-nested_outputs", "execupy-llama_block", "execupy-mixed_partition")]

CHILD = r'''
import importlib, importlib.abc, json, pathlib, sys, traceback

BLOCKED = ("torch", "executorch")
attempts = []

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            caller = next((f"{f.filename}:{f.lineno}" for f in reversed(traceback.extract_stack())
                           if "/execupy/" in f.filename), "?")
            attempts.append(f"{name} (from {caller})")
            raise ImportError(f"{name} is blocked in this torch-free test")
        return None

sys.meta_path.insert(0, NoTorch())

try:
    import torch  # the blocker must work, or this test proves nothing
    blocker_works = False
except ImportError:
    blocker_works = True
attempts.clear()

TORCH_SIDE = set(sys.argv[1].split(","))

def torch_free_modules():
    """Every module under execupy/ whose path has no torch-side folder or module name in it."""
    names = []
    for path in sorted(pathlib.Path("execupy").rglob("*.py")):
        parts = path.with_suffix("").parts
        if TORCH_SIDE & set(parts):
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names

modules = torch_free_modules()
failed = {}
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"

sys.path.insert(0, ".")
from tests.conformance import cases, expected_outputs, flatten, load_inputs, mismatch
from execupy.runtime import Module

results = {}
wanted = set(sys.argv[2:])
for case in cases():
    if case.name not in wanted:
        continue
    tol = case.manifest["tolerance"]
    module, problems = Module(case.pte), []
    for run in case.manifest["runs"]:
        actual = flatten(module.run_method(run["method"], *load_inputs(case, run)))
        expected = expected_outputs(case, run)
        if len(actual) != len(expected):
            problems.append(f"{run['id']}: {len(actual)} outputs, expected {len(expected)}")
        problems += [f"{run['id']} out{k}: {p}" for k, (a, e) in enumerate(zip(actual, expected))
                     if (p := mismatch(a, e, tol["atol"], tol["rtol"])) is not None]
    results[case.name] = problems

print(json.dumps({"blocker_works": blocker_works, "modules": modules, "failed": failed, "attempts": attempts, "results": results,
                  "torch_loaded": "torch" in sys.modules and sys.modules["torch"] is not None}))
'''


@pytest.fixture(scope="module")
def child() -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, ",".join(TORCH_SIDE), *CASES], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=programs.child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_runtime_modules_import_without_torch(child):
    assert child["blocker_works"], "the child could still import torch"
    assert not child["failed"], f"modules that fail to import without torch: {child['failed']}"
    assert not child["attempts"], f"torch-free modules tried to import: {child['attempts']}"
    assert not child["torch_loaded"]
    imported = set(child["modules"])
    for name in ("execupy.schema.reader", "execupy.runtime.method", "execupy.kernels.portable.binary",
                 "execupy.devtools.summary", "execupy.cli", "execupy.llm.runner", "execupy.llm.tokenizer",
                 "execupy.llm.loaders", "execupy.backends.numpy_fused.runtime"):
        assert name in imported


def test_conformance_programs_run_without_torch(child):
    assert set(child["results"]) == set(CASES), "some cases were not run"
    for name, problems in child["results"].items():
        assert not problems, f"{name}: {problems}"


# Which top-level parts of execupy each layer may import (besides itself and the leaf modules
# execupy.errors and execupy.fileio, which import nothing of ours).
ALLOWED_IMPORTS = {
    "schema": set(),
    "kernels": {"schema"},
    "runtime": {"schema", "kernels"},
}


def _execupy_imports(path: Path) -> set[str]:
    """Top-level execupy parts a module imports (absolute or relative), read from its source."""
    import ast

    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [target] if node.module else [[*base, a.name] for a in node.names]
            else:
                names = [node.module.split(".")] if node.module else []
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        for parts in names:
            if len(parts) >= 2 and parts[0] == "execupy":
                found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED_IMPORTS))
def test_layers_import_only_downward(layer):
    allowed = ALLOWED_IMPORTS[layer] | {layer, "errors", "fileio"}
    wrong = {}
    for path in sorted((REPO / "execupy" / layer).rglob("*.py")):
        bad = _execupy_imports(path) - allowed
        if bad:
            wrong[str(path.relative_to(REPO))] = sorted(bad)
    assert not wrong, f"{layer} may import only {sorted(allowed)}; these import more: {wrong}"
