"""The README's custom-operator example, run as written.

Its three code blocks (the kernel module, the export script, the run script) are written
to files; the export runs with torch, then the run script runs in a fresh interpreter
where importing torch fails, and its output must equal the torch model's. The same
program without the kernel module fails at load naming the operator and how to register
it; with a kernel list written by `execupy kernels --import`, the runtime imports the
kernel module itself.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

# Makes `import torch` fail in a child interpreter (the runtime side must not need it).
NO_TORCH = '''
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "executorch"):
            raise ImportError(f"{name} is blocked: this child runs without torch")
sys.meta_path.insert(0, NoTorch())
'''


def readme_files() -> dict[str, str]:
    """The README's Custom operators code blocks, keyed by the file name on their first line."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Custom operators", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    return {re.match(r"# (\S+\.py)", block).group(1): block for block in blocks}


def run(code: str, cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{cwd}", **(env or {})})


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("custom_op")
    files = readme_files()
    assert set(files) == {"mylib_kernels.py", "export_model.py", "run_model.py"}
    for name, code in files.items():
        (folder / name).write_text(code)
    # Export as the README does, and keep the torch model's answer for the same input.
    exported = run("import runpy, numpy as np, torch\n"
                   "ns = runpy.run_path('export_model.py')\n"
                   "np.save('expected.npy', ns['model'](torch.ones(2, 8)).detach().numpy())", folder)
    assert exported.returncode == 0, exported.stderr[-3000:]
    return folder


def test_readme_example_runs_without_torch(example):
    ran = run(NO_TORCH + "import runpy, numpy as np\n"
              "ns = runpy.run_path('run_model.py')\n"
              "np.save('got.npy', ns['y'])\n"
              "print('torch' in sys.modules)", example)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip().endswith("False")  # torch was never imported
    np.testing.assert_allclose(np.load(example / "got.npy"), np.load(example / "expected.npy"), rtol=1e-5, atol=1e-6)


def test_program_without_its_kernel_fails_at_load_naming_the_operator(example):
    ran = run(NO_TORCH + "from execupy.errors import UnsupportedOperatorError\n"
              "from execupy.runtime import Program\n"
              "try:\n"
              "    Program.load('model.pte').load_method('forward')\n"
              "except UnsupportedOperatorError as e:\n"
              "    print(e)\n", example)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "mylib::scale_add.out" in ran.stdout and "register" in ran.stdout


def test_kernel_list_imports_the_custom_kernel_module(example):
    listed = subprocess.run([sys.executable, "-m", "execupy", "kernels", "model.pte", "--import", "mylib_kernels",
                             "-o", "kernels.txt"], cwd=example, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{example}"})
    assert listed.returncode == 0, listed.stderr
    assert "operator mylib::scale_add.out mylib_kernels" in (example / "kernels.txt").read_text()
    # The application does not import the kernel module: the list does.
    ran = run(NO_TORCH + "import json, sys, numpy as np\n"
              "from execupy.runtime import Module\n"
              "y = Module('model.pte').forward(np.ones((2, 8), np.float32))\n"
              "np.save('listed.npy', y)\n"
              "print(json.dumps(sorted(m for m in sys.modules if 'kernels' in m)))", example,
              env={"EXECUPY_KERNELS": str(example / "kernels.txt")})
    assert ran.returncode == 0, ran.stderr[-3000:]
    modules = json.loads(ran.stdout.strip().splitlines()[-1])
    assert "mylib_kernels" in modules and "execupy.kernels.quantized.quant" not in modules
    np.testing.assert_allclose(np.load(example / "listed.npy"), np.load(example / "expected.npy"), rtol=1e-5,
                               atol=1e-6)


def test_schema_gives_the_out_variant_the_exporter_looks_for():
    from execupy.errors import InvalidInputError
    from execupy.kernels.custom import custom_op

    op = custom_op("demo::clamp_to(Tensor x, Tensor(a!) state, *, float limit=1.0) -> Tensor")
    assert op.kernel_key == "demo::clamp_to.out"
    assert op.out_schema == "clamp_to.out(Tensor x, Tensor(a!) state, *, float limit=1.0, Tensor(b!) out) -> Tensor(b!)"
    for bad in ("clamp(Tensor x) -> Tensor", "aten::mine(Tensor x) -> Tensor", "demo::two(Tensor x) -> (Tensor, Tensor)"):
        with pytest.raises(InvalidInputError):
            custom_op(bad)
