"""Every portable, quant_portable, xnnpack and quant_xnnpack program written by ExecuTorch
runs through Module and matches the reference runtime's outputs."""
import pytest

from execupy.runtime import Module

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


@pytest.mark.parametrize("case", DELEGATED, ids=lambda c: c.name)
def test_xnnpack_case_matches_reference(case):
    """ExecuTorch's XNNPACK-delegated programs run on execupy's XnnpackBackend and match the
    outputs ExecuTorch's runtime (with XNNPACK) produced, within the case's tolerance."""
    tol = case.manifest["tolerance"]
    modules = {}
    for run in case.manifest["runs"]:
        module = modules.setdefault(run["session"], Module(case.pte))
        actual = flatten(module.run_method(run["method"], *load_inputs(case, run)))
        expected = expected_outputs(case, run)
        assert len(actual) == len(expected), f"run {run['id']}: {len(actual)} outputs, expected {len(expected)}"
        for k, (a, e) in enumerate(zip(actual, expected)):
            problem = mismatch(a, e, tol["atol"], tol["rtol"])
            assert problem is None, f"run {run['id']} output {k}: {problem}"


def test_corpus_is_present():
    assert len(PORTABLE) >= 50 and len(DELEGATED) >= 20
