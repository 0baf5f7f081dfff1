"""Skip `@pytest.mark.reference` tests when ExecuTorch's reference runtime is unavailable
(EXECUPY_SKIP_REFERENCE=1, or the tool is missing); they run by default."""
import pytest

from .reference import skip_reason


def pytest_collection_modifyitems(config, items):
    reason = skip_reason()
    if reason is None:
        return
    for item in items:
        if "reference" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
