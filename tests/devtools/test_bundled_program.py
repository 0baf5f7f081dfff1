"""Bundled programs (.bpte): our writer and reader, `execupy verify`, and both directions
with ExecuTorch's own bundled-program tools (run in the reference venv as a subprocess)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from execupy.devtools.bundled_program import (
    BundledProgram,
    MethodTestCase,
    MethodTestSuite,
    load_bundled_program,
    read_bundled_program,
    serialize_bundled_program,
    verify_bundled_program,
    write_bundled_program,
)
from execupy.errors import InvalidInputError, MalformedProgramError

from ..reference import reference_python

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("EXECUPY_BUNDLED_CACHE", Path.home() / ".cache" / "execupy-bundled"))


def execupy_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "execupy", *args], capture_output=True, text=True,
                          timeout=300, env=env)


# ---------------------------------------------------------------------------- our own program


@pytest.fixture(scope="module")
def our_bundle() -> BundledProgram:
    """Two methods exported by execupy, float32 / int64 / bool tensors, expected outputs from eager torch."""
    torch = pytest.importorskip("torch")
    from torch.export import export

    from execupy.exir import to_edge
    from execupy.exir.bundled import method_test_suite

    class Scorer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x, ids):
            return torch.relu(self.linear(x)), ids * 2 + 1

    class Mask(torch.nn.Module):
        def forward(self, x):
            return x > 0.25

    torch.manual_seed(0)
    scorer, mask = Scorer().eval(), Mask().eval()
    x, ids = torch.randn(2, 4), torch.tensor([3, 5], dtype=torch.int64)
    manager = to_edge({"forward": export(scorer, (x, ids)), "mask": export(mask, (x,))}).to_executorch()
    forward_inputs = [(torch.randn(2, 4), torch.randint(0, 100, (2,))) for _ in range(3)]
    mask_inputs = [(torch.rand(2, 4),) for _ in range(2)]
    suites = [method_test_suite(scorer, "forward", forward_inputs), method_test_suite(mask, "mask", mask_inputs)]
    return BundledProgram(manager, suites)


def assert_same_suites(a: list[MethodTestSuite], b: list[MethodTestSuite]) -> None:
    assert [s.method_name for s in a] == [s.method_name for s in b]
    for sa, sb in zip(a, b):
        assert len(sa.test_cases) == len(sb.test_cases)
        for ca, cb in zip(sa.test_cases, sb.test_cases):
            for va, vb in zip(ca.inputs + ca.expected_outputs, cb.inputs + cb.expected_outputs):
                assert type(va) is type(vb)
                if isinstance(va, np.ndarray):
                    assert va.dtype == vb.dtype and va.shape == vb.shape
                    assert va.tobytes() == vb.tobytes()
                else:
                    assert va == vb
            assert len(ca.inputs) == len(cb.inputs) and len(ca.expected_outputs) == len(cb.expected_outputs)


def test_round_trip_keeps_every_method_and_case(our_bundle, tmp_path):
    path = tmp_path / "model.bpte"
    write_bundled_program(path, our_bundle)
    assert path.read_bytes()[4:8] == b"BP08"
    back = load_bundled_program(path)
    assert back.program == our_bundle.program
    assert back.version == 2
    assert_same_suites(our_bundle.method_test_suites, back.method_test_suites)
    dtypes = {v.dtype for s in back.method_test_suites for c in s.test_cases for v in c.inputs + c.expected_outputs}
    assert dtypes == {np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.bool_)}


def test_round_trip_of_every_value_kind(our_bundle):
    rng = np.random.default_rng(1)
    values = [
        rng.standard_normal((2, 3)).astype(np.float16),
        rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
        rng.standard_normal((1, 2, 2)),  # float64
        rng.integers(-100, 100, (3, 1)).astype(np.int32),
        rng.integers(0, 255, (5,)).astype(np.uint8),
        rng.integers(-100, 100, (2,)).astype(np.int8),
        np.zeros((0, 3), np.float32),
        np.asarray(2.5, np.float32),  # 0-d tensor
        7, True, -1.25,
    ]
    # Values that do not fit the program's methods: written unchecked, they still round-trip.
    suites = [MethodTestSuite("values", [MethodTestCase(values, values[::-1])])]
    bundle = BundledProgram(our_bundle.program, suites)
    back = read_bundled_program(serialize_bundled_program(bundle, check=False))
    assert_same_suites(suites, back.method_test_suites)


def test_verify_passes_on_matching_outputs_and_names_a_wrong_one(our_bundle):
    results = verify_bundled_program(our_bundle)
    assert [(r.method, r.case) for r in results] == [("forward", 0), ("forward", 1), ("forward", 2),
                                                     ("mask", 0), ("mask", 1)]
    assert all(r.passed for r in results), [r.message for r in results if not r.passed]

    wrong = load_wrong_copy(our_bundle, method="forward", case=1)
    failed = [r for r in verify_bundled_program(wrong) if not r.passed]
    assert [(r.method, r.case) for r in failed] == [("forward", 1)]
    assert failed[0].max_abs_error >= 0.5 and "output 0" in failed[0].message


def load_wrong_copy(bundle: BundledProgram, method: str, case: int) -> BundledProgram:
    back = read_bundled_program(serialize_bundled_program(bundle))
    expected = back.suite(method).test_cases[case].expected_outputs
    expected[0] = expected[0] + np.float32(0.5)
    return back


def test_writer_checks_suites_against_the_program(our_bundle):
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(InvalidInputError, match="method 'nope'"):
        serialize_bundled_program(BundledProgram(our_bundle.program, [MethodTestSuite("nope", [])]))
    with pytest.raises(InvalidInputError, match="case 0 input 1 is int32"):
        bad = MethodTestCase([x, np.zeros(2, np.int32)], [x, np.zeros(2, np.int64)])
        serialize_bundled_program(BundledProgram(our_bundle.program, [MethodTestSuite("forward", [bad])]))


def test_verify_cli_passes_and_fails_with_exit_status(our_bundle, tmp_path):
    good, wrong = tmp_path / "good.bpte", tmp_path / "wrong.bpte"
    write_bundled_program(good, our_bundle)
    write_bundled_program(wrong, load_wrong_copy(our_bundle, method="mask", case=0), check=False)
    ok = execupy_cli("verify", str(good))
    assert ok.returncode == 0, ok.stderr
    assert "5 of 5 test cases passed" in ok.stdout
    bad = execupy_cli("verify", str(wrong))
    assert bad.returncode == 1
    assert "mask case 0: FAIL" in bad.stdout and "4 of 5 test cases passed, 1 failed" in bad.stdout


def test_verify_cli_rejects_malformed_files_with_status_2(our_bundle, tmp_path):
    data = serialize_bundled_program(our_bundle)
    for name, content in [("truncated.bpte", data[: len(data) // 2]), ("tiny.bpte", data[:5]),
                          ("program.bpte", our_bundle.program)]:
        path = tmp_path / name
        path.write_bytes(content)
        proc = execupy_cli("verify", str(path))
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("error:") and "Traceback" not in proc.stderr


def test_corrupted_bundles_raise_typed_errors_only(our_bundle):
    """Seeded fuzz: truncations and byte flips give a bundle, or MalformedProgramError, never IndexError."""
    data = serialize_bundled_program(our_bundle)
    rng = np.random.default_rng(20261123)
    mutants = [data[:n] for n in rng.integers(0, len(data), 300)]
    for _ in range(700):
        flipped = bytearray(data)
        for pos in rng.integers(0, len(data), rng.integers(1, 9)):
            flipped[pos] = int(rng.integers(0, 256))
        mutants.append(bytes(flipped))
    outcomes = {"read": 0, "malformed": 0}
    for mutant in mutants:
        try:
            bundle = read_bundled_program(mutant)
            verify_bundled_program(bundle)  # failed cases are results, not exceptions
            outcomes["read"] += 1
        except MalformedProgramError:
            outcomes["malformed"] += 1
    assert outcomes["malformed"] >= 300  # every truncation at least
    assert sum(outcomes.values()) == 1000


# ---------------------------------------------------------------------------- with ExecuTorch


# Runs in the reference venv: loads a .bpte with ExecuTorch's bundled-program loader,
# verifies every case with its comparison, and reports per case.
_ET_VERIFY = r"""
import json, sys
from executorch.extension.pybindings.portable_lib import (
    _load_bundled_program_from_buffer, _load_for_executorch_from_bundled_program)
cases = json.loads(sys.argv[2])
bundle = _load_bundled_program_from_buffer(open(sys.argv[1], "rb").read())
module = _load_for_executorch_from_bundled_program(bundle)
report = {"methods": sorted(module.method_names()), "cases": []}
for method, index in cases:
    try:
        bundle.verify_result_with_bundled_expected_output(method, index, 1e-5, 1e-6)
        report["cases"].append([method, index, True])
    except Exception as e:
        report["cases"].append([method, index, False])
print("REPORT " + json.dumps(report))
"""


def executorch_verify(path: Path, cases: list[tuple[str, int]]) -> dict:
    proc = subprocess.run([str(reference_python()), "-c", _ET_VERIFY, str(path), json.dumps(cases)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


@pytest.mark.reference
@pytest.mark.slow
def test_executorch_loads_and_verifies_a_bundle_we_wrote(our_bundle, tmp_path):
    good, wrong = tmp_path / "ours.bpte", tmp_path / "ours_wrong.bpte"
    write_bundled_program(good, our_bundle)
    write_bundled_program(wrong, load_wrong_copy(our_bundle, method="forward", case=2))
    cases = [(s.method_name, k) for s in our_bundle.method_test_suites for k in range(len(s.test_cases))]
    report = executorch_verify(good, cases)
    assert report["methods"] == ["forward", "mask"]
    assert report["cases"] == [[m, k, True] for m, k in cases]
    # The same check fails on a wrong expected output: ExecuTorch really compares.
    report = executorch_verify(wrong, cases)
    assert [(m, k) for m, k, ok in report["cases"] if not ok] == [("forward", 2)]


# Runs in the reference venv: ExecuTorch exports two methods itself and bundles them with
# expected outputs from eager torch, through its executorch.devtools.bundled_program API.
_ET_WRITE = r"""
import sys, torch
from torch.export import export
from executorch.exir import to_edge
from executorch.devtools import BundledProgram
from executorch.devtools.bundled_program.config import MethodTestCase, MethodTestSuite
from executorch.devtools.bundled_program.serialize import serialize_from_bundled_program_to_flatbuffer

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).softmax(-1)

class Step(torch.nn.Module):
    def forward(self, x, n):
        return x * 2.0 - 1.0, n + 1

torch.manual_seed(0)
net, step = Net().eval(), Step().eval()
x, n = torch.randn(3, 8), torch.tensor([1, 2], dtype=torch.int64)
manager = to_edge({"forward": export(net, (x,)), "step": export(step, (torch.randn(2, 3), n))}).to_executorch()
suites = []
for name, model, args in [("forward", net, [(torch.randn(3, 8),) for _ in range(3)]),
                          ("step", step, [(torch.randn(2, 3), torch.randint(0, 9, (2,))) for _ in range(2)])]:
    cases = []
    for a in args:
        out = model(*a)
        cases.append(MethodTestCase(inputs=list(a), expected_outputs=list(out) if isinstance(out, tuple) else [out]))
    suites.append(MethodTestSuite(method_name=name, test_cases=cases))
with torch.no_grad():
    data = serialize_from_bundled_program_to_flatbuffer(BundledProgram(manager, suites))
open(sys.argv[1] + ".tmp", "wb").write(data)
import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""


@pytest.fixture(scope="module")
def executorch_bpte() -> Path:
    """A .bpte ExecuTorch wrote (cached: the export takes a while in its venv)."""
    key = hashlib.sha256(_ET_WRITE.encode()).hexdigest()[:12]
    path = CACHE / key / "model.bpte"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([str(reference_python()), "-c", _ET_WRITE, str(path)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return path


@pytest.mark.reference
@pytest.mark.slow
def test_execupy_verify_passes_a_bundle_executorch_wrote(executorch_bpte):
    bundle = load_bundled_program(executorch_bpte)
    assert [(s.method_name, len(s.test_cases)) for s in bundle.method_test_suites] == [("forward", 3), ("step", 2)]
    proc = execupy_cli("verify", str(executorch_bpte))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "5 of 5 test cases passed" in proc.stdout
    for method, case in [("forward", 0), ("forward", 2), ("step", 1)]:
        assert f"{method} case {case}: PASS" in proc.stdout


@pytest.mark.reference
@pytest.mark.slow
def test_execupy_verify_fails_an_executorch_bundle_with_a_wrong_expected_output(executorch_bpte, tmp_path):
    # Patch the file's bytes in place (not through our writer): the expected output of
    # step case 1 gets +0.5 in its first element.
    data = bytearray(executorch_bpte.read_bytes())
    expected = load_bundled_program(executorch_bpte).suite("step").test_cases[1].expected_outputs[0]
    raw = expected.tobytes()
    assert data.count(raw) == 1
    at = data.index(raw)
    data[at : at + 4] = (expected.reshape(-1)[:1] + np.float32(0.5)).tobytes()
    wrong = tmp_path / "wrong.bpte"
    wrong.write_bytes(bytes(data))
    proc = execupy_cli("verify", str(wrong))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step case 1: FAIL" in proc.stdout
    assert "4 of 5 test cases passed, 1 failed" in proc.stdout
