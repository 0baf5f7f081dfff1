"""Our kernels' numba cache entries are stamped with their whole folder's text: a kernel that has
another file's function compiled into it is compiled again when that file changes."""
from __future__ import annotations

import pytest

pytest.importorskip("numba", reason="numba (the `fast` extra) is not installed")

from execupy.kernels.fast import jit_cache, xnnpack_gemm_jit  # noqa: E402


def test_a_kernels_stamp_changes_with_any_file_of_its_folder(tmp_path):
    (tmp_path / "callee.py").write_text("def f(): return 1\n")
    (tmp_path / "caller.py").write_text("def g(): return f()\n")
    before = jit_cache.folder_stamp(tmp_path)
    jit_cache.folder_stamp.cache_clear()
    (tmp_path / "callee.py").write_text("def f(): return 2\n")
    assert jit_cache.folder_stamp(tmp_path) != before


def test_our_kernels_use_the_folder_stamped_locator():
    locator = xnnpack_gemm_jit.blockwise_matvec._cache._impl.locator
    assert isinstance(locator, jit_cache._FolderStamped)
    assert locator.get_source_stamp() == jit_cache.folder_stamp(jit_cache._PACKAGE / "kernels" / "fast")
