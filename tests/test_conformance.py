"""Every portable and quant_portable program written by ExecuTorch runs through Module
and matches the reference runtime's outputs; XNNPACK programs fail with MissingBackendError.

Our own exporter's programs (tests/programs.py) go through the same checks against torch
eager's outputs, so the runtime is tested on a machine without ExecuTorch's corpus too.
"""
import pytest

from execupy.errors import MissingBackendError
from execupy.runtime import Module, get_backend

from .conformance import CORPUS, cases, expected_outputs, flatten, load_inputs, mismatch, program_name

PORTABLE = cases("portable", "quant_portable", "execupy", "execupy_delegated")
DELEGATED = cases("xnnpack", "quant_xnnpack", "execupy_missing_backend")


@pytest.mark.parametrize("case", PORTABLE, ids=program_name)
def test_portable_case_matches_reference(case):
    tol = case.manifest["tolerance"]
    modules = {}
    for run in case.manifest["runs"]:
        module = modules.setdefault(run["session"], Module(case.pte))
        outputs = module.run_method(run["method"], *load_inputs(case, run))
        actual = flatten(outputs)
        expected = expected_outputs(case, run)
        assert len(actual) == len(expected), f"run {run['id']}: {len(actual)} outputs, expected {len(expected)}"
        for k, (a, e) in enumerate(zip(actual, expected)):
            problem = mismatch(a, e, tol["atol"], tol["rtol"])
            assert problem is None, f"run {run['id']} output {k}: {problem}"


@pytest.mark.skipif(get_backend("XnnpackBackend") is not None, reason="XNNPACK backend is registered")
@pytest.mark.parametrize("case", DELEGATED, ids=program_name)
def test_delegated_case_names_missing_backend(case):
    with pytest.raises(MissingBackendError, match="XnnpackBackend"):
        module = Module(case.pte)
        module.method(case.manifest["method_names"][0])


@pytest.mark.skipif(not CORPUS.exists(), reason=f"ExecuTorch's conformance corpus is not at {CORPUS}")
def test_executorch_corpus_is_present():
    assert len([c for c in PORTABLE if c.by_executorch]) >= 50
    assert len([c for c in DELEGATED if c.by_executorch]) >= 20


def test_own_programs_cover_kernels_and_delegates():
    own = [c for c in PORTABLE + DELEGATED if not c.by_executorch]
    assert {c.flavour for c in own} == {"execupy", "execupy_delegated", "execupy_missing_backend"}
    assert all(c.pte.stat().st_size == c.manifest["pte_bytes"] for c in own)
