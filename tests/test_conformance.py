"""Every portable and quant_portable program written by ExecuTorch runs through Module
and matches the reference runtime's outputs; XNNPACK programs fail with MissingBackendError."""
import pytest

from execupy.errors import MissingBackendError
from execupy.runtime import Module, get_backend

from .conformance import cases, expected_outputs, flatten, load_inputs, mismatch

PORTABLE = cases("portable", "quant_portable")
DELEGATED = cases("xnnpack", "quant_xnnpack")


@pytest.mark.parametrize("case", PORTABLE, ids=lambda c: c.name)
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
@pytest.mark.parametrize("case", DELEGATED, ids=lambda c: c.name)
def test_delegated_case_names_missing_backend(case):
    with pytest.raises(MissingBackendError, match="XnnpackBackend"):
        module = Module(case.pte)
        module.method(case.manifest["method_names"][0])


def test_corpus_is_present():
    assert len(PORTABLE) >= 50 and len(DELEGATED) >= 20
