"""The runtime half of execupy works in a process where torch (and executorch) cannot be imported.

A child interpreter installs a meta-path finder that refuses `torch`, `executorch` and
their submodules (and records who asked), imports every module under execupy.schema,
execupy.runtime and execupy.kernels, the torch-free parts of backends and llm, the
program summary and the CLI, then runs conformance programs through Module and checks
their outputs against ExecuTorch's.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conformance import CORPUS

REPO = Path(__file__).resolve().parents[1]

CASES = ["portable-add_sub_mul_div_broadcast", "portable-nested_outputs", "portable-llama_block"]

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

def walk(package_name):
    """Module names under a package, from the file tree (importing packages to walk them could import torch)."""
    root = pathlib.Path("execupy", *package_name.split(".")[1:])
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names

def wanted_optional(name):
    """Torch-free parts of packages that also hold torch code: backend runtimes, LLM runner side."""
    last = name.rsplit(".", 1)[-1]
    if name.startswith("execupy.backends."):
        return "runtime" in name.split(".")
    if name.startswith("execupy.llm."):
        return last.startswith(("tokenizer", "sampler", "runner")) or ".tokenizers." in name + "."
    return False

modules = []
for root in ("execupy.schema", "execupy.runtime", "execupy.kernels"):
    modules += walk(root)
for root in ("execupy.backends", "execupy.llm"):
    modules += [m for m in walk(root) if wanted_optional(m)]
modules += ["execupy.devtools.summary", "execupy.cli", "execupy.__main__"]
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
wanted = set(sys.argv[1:])
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
    proc = subprocess.run([sys.executable, "-c", CHILD, *CASES], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_runtime_modules_import_without_torch(child):
    assert child["blocker_works"], "the child could still import torch"
    assert not child["failed"], f"modules that fail to import without torch: {child['failed']}"
    assert not child["attempts"], f"torch-free modules tried to import: {child['attempts']}"
    assert not child["torch_loaded"]
    imported = set(child["modules"])
    for name in ("execupy.schema.reader", "execupy.runtime.method", "execupy.kernels.portable.binary",
                 "execupy.devtools.summary", "execupy.cli"):
        assert name in imported


@pytest.mark.skipif(not CORPUS.exists(), reason="conformance corpus ../shared/conformance not present")
def test_conformance_programs_run_without_torch(child):
    assert set(child["results"]) == set(CASES), "some cases were not run"
    for name, problems in child["results"].items():
        assert not problems, f"{name}: {problems}"
