"""Skip `@pytest.mark.reference` tests when ExecuTorch's reference runtime is unavailable
(EXECUPY_SKIP_REFERENCE=1), saying why; the reference venv itself is built on first use.

Tests that read programs run on our own exporter's programs everywhere (tests/programs.py)
and on ExecuTorch's corpus in ../shared as well where it exists.
"""
import pytest

from .reference import skip_reason


def pytest_collection_modifyitems(config, items):
    reference_reason = skip_reason()
    for item in items:
        if reference_reason and "reference" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reference_reason))
