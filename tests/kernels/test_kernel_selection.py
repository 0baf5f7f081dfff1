"""Only the kernels a program needs: `execupy kernels` writes a list, EXECUPY_KERNELS uses it.

On programs ExecuTorch wrote (the conformance corpus) and the shipped example: the list
names exactly the operators of the programs; a fresh interpreter told to use it imports
only the listed kernel modules and still gets ExecuTorch's outputs; a program needing an
operator the list leaves out fails at load with UnsupportedOperatorError naming it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from execupy.errors import InvalidInputError
from execupy.kernels.selection import KernelList
from execupy.runtime import Program
from tests.conformance import CORPUS

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "execupy" / "examples" / "mlp.pte"
PROGRAMS = ["portable-gpt2_block", "quant_portable-mlp_relu"]  # portable and quantized kernels
needs_corpus = pytest.mark.skipif(not CORPUS.exists(), reason="conformance corpus ../shared/conformance not present")


def execupy(*args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execupy", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def operators(pte: Path) -> set[str]:
    program = Program.load(pte)
    return {key for name in program.method_names for key in program.method_meta(name).operators}


# Runs conformance cases under the kernel list in force and reports what it imported.
CHILD = '''
import json, sys
sys.path.insert(0, ".")
from tests.conformance import cases, expected_outputs, flatten, load_inputs, mismatch
from execupy.runtime import Module
problems = []
for case in cases():
    if case.name in sys.argv[1:]:
        module, tol = Module(case.pte), case.manifest["tolerance"]
        for run in case.manifest["runs"]:
            got = flatten(module.run_method(run["method"], *load_inputs(case, run)))
            problems += [p for a, e in zip(got, expected_outputs(case, run))
                         if (p := mismatch(a, e, tol["atol"], tol["rtol"])) is not None]
print(json.dumps({"problems": problems, "modules": sorted(m for m in sys.modules if m.startswith("execupy.kernels."))}))
'''


def run_cases(names: list[str], kernel_list: Path | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("EXECUPY_KERNELS", None)
    if kernel_list is not None:
        env["EXECUPY_KERNELS"] = str(kernel_list)
    proc = subprocess.run([sys.executable, "-c", CHILD, *names], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_list_of_the_example_program(tmp_path):
    out = tmp_path / "kernels.txt"
    listed = execupy("kernels", str(MLP), "-o", str(out))
    assert listed.returncode == 0, listed.stderr
    kernels = KernelList.load(out)
    assert set(kernels.operators) == operators(MLP)
    assert all(key in listed.stdout for key in kernels.operators)
    ran = execupy("run", str(MLP), "--random-inputs", env={"EXECUPY_KERNELS": str(out)})
    assert ran.returncode == 0 and "output 0" in ran.stdout, ran.stderr


def test_a_left_out_operator_fails_at_load_naming_it(tmp_path):
    out = tmp_path / "kernels.txt"
    assert execupy("kernels", str(MLP), "-o", str(out)).returncode == 0
    kernels = KernelList.load(out)
    dropped = sorted(kernels.operators)[0]
    del kernels.operators[dropped]
    kernels.save(out)
    ran = execupy("run", str(MLP), "--random-inputs", env={"EXECUPY_KERNELS": str(out)})
    assert ran.returncode == 1
    assert dropped in ran.stderr and str(out) in ran.stderr and "not in the kernel list" in ran.stderr


@needs_corpus
def test_programs_executorch_wrote_run_with_only_their_kernels(tmp_path):
    ptes = [CORPUS / name / "model.pte" for name in PROGRAMS]
    out = tmp_path / "kernels.txt"
    listed = execupy("kernels", *map(str, ptes), "-o", str(out))
    assert listed.returncode == 0, listed.stderr
    kernels = KernelList.load(out)
    assert set(kernels.operators) == set().union(*map(operators, ptes))

    selected = run_cases(PROGRAMS, out)
    everything = run_cases(PROGRAMS, None)
    assert selected["problems"] == [] and everything["problems"] == []
    assert set(kernels.modules()) <= set(selected["modules"])
    assert len(selected["modules"]) < len(everything["modules"])
    assert "execupy.kernels.portable.conv" not in selected["modules"]

    # A program that needs more than the list has fails at load, naming an operator it lacks.
    other = CORPUS / "portable-conv1d" / "model.pte"
    ran = execupy("run", str(other), "--random-inputs", env={"EXECUPY_KERNELS": str(out)})
    missing = sorted(operators(other) - set(kernels.operators))
    assert ran.returncode == 1 and missing and any(key in ran.stderr for key in missing), ran.stderr


def test_use_kernel_list_in_python(tmp_path):
    out = tmp_path / "kernels.txt"
    assert execupy("kernels", str(MLP), "-o", str(out)).returncode == 0
    code = ("import sys, numpy as np\n"
            "from execupy.kernels.selection import use_kernel_list\n"
            "from execupy.runtime import Module\n"
            f"use_kernel_list({str(out)!r})\n"
            "Module(sys.argv[1]).forward(np.zeros((4, 16), np.float32))\n"
            "print(sorted(m for m in sys.modules if m.startswith('execupy.kernels.portable.')))")
    proc = subprocess.run([sys.executable, "-c", code, str(MLP)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "execupy.kernels.portable.conv" not in proc.stdout and "execupy.kernels.portable.linalg" in proc.stdout


def test_malformed_list_is_refused_naming_the_line(tmp_path):
    bad = tmp_path / "kernels.txt"
    bad.write_text("operator aten::add.out execupy.kernels.portable.binary\nkernel aten::mul.out\n")
    with pytest.raises(InvalidInputError, match="line 2"):
        KernelList.load(bad)
