"""Skip tests whose inputs are not on this machine, saying why:

* `@pytest.mark.reference` tests when ExecuTorch's reference runtime is unavailable
  (EXECUPY_SKIP_REFERENCE=1, or ../shared/tools/reference_run.py is missing);
* tests of modules that read ../shared (the conformance corpus and design samples),
  which exists for CI and developers but not on a user's machine.
"""
import pytest

from .conformance import CORPUS, SAMPLES
from .reference import skip_reason

# Test modules that need ../shared/conformance or ../shared/design/samples to mean anything.
NEEDS_SHARED = {"test_conformance", "test_schema_roundtrip", "test_fuzz", "test_cli_inspect", "test_torch_free"}


def pytest_collection_modifyitems(config, items):
    reference_reason = skip_reason()
    shared_missing = not (CORPUS.exists() and SAMPLES.exists())
    for item in items:
        if reference_reason and "reference" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reference_reason))
        if shared_missing and item.module.__name__.rsplit(".", 1)[-1] in NEEDS_SHARED:
            item.add_marker(pytest.mark.skip(reason=f"needs the shared corpus at {CORPUS.parent}, absent here"))
