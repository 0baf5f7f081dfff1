"""Every program written by ExecuTorch (portable, quant_portable, xnnpack, quant_xnnpack)
runs through Module and matches the reference runtime's outputs, XNNPACK delegates on our
XnnpackBackend.

Our own exporter's programs (tests/programs.py) go through the same checks against torch
eager's outputs, so the runtime is tested on a machine without ExecuTorch's corpus too; one
of them names a backend no runtime has and must fail saying which.
"""
import pytest

from execupy.errors import MissingBackendError
from execupy.runtime import Module

from .conformance import CORPUS, cases, expected_outputs, flatten, load_inputs, mismatch, program_name

PORTABLE = cases("portable", "quant_portable", "execupy", "execupy_delegated")
XNNPACK = cases("xnnpack", "quant_xnnpack")
MISSING_BACKEND = cases("execupy_missing_backend")


def check_case(case) -> None:
    """Run every recorded call of a case (one Module per session, so state carries) and compare
    each output with the expected one within the case's tolerance."""
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


@pytest.mark.parametrize("case", PORTABLE, ids=program_name)
def test_portable_case_matches_reference(case):
    check_case(case)


@pytest.mark.parametrize("case", XNNPACK, ids=program_name)
def test_xnnpack_case_matches_reference(case):
    """ExecuTorch's XNNPACK-delegated programs run on execupy's XnnpackBackend and match the
    outputs ExecuTorch's runtime (with XNNPACK) produced, within the case's tolerance."""
    check_case(case)


@pytest.mark.parametrize("case", MISSING_BACKEND, ids=program_name)
def test_delegate_to_an_unknown_backend_names_it(case):
    with pytest.raises(MissingBackendError, match="NoSuchBackend"):
        Module(case.pte).method(case.manifest["method_names"][0])


@pytest.mark.skipif(not CORPUS.exists(), reason=f"ExecuTorch's conformance corpus is not at {CORPUS}")
def test_executorch_corpus_is_present():
    assert len([c for c in PORTABLE if c.by_executorch]) >= 50
    assert len([c for c in XNNPACK if c.by_executorch]) >= 20


def test_own_programs_cover_kernels_and_delegates():
    own = [c for c in PORTABLE + XNNPACK + MISSING_BACKEND if not c.by_executorch]
    assert {c.flavour for c in own} == {"execupy", "execupy_delegated", "execupy_missing_backend"}
    assert all(c.pte.stat().st_size == c.manifest["pte_bytes"] for c in own)
