"""numba's disk cache for our kernels, invalidated when any file of the kernel's folder changes.

numba checks a cached function against the text of its own file only. A kernel that calls a
function of another file (blockwise_jit calls quantized_jit's exact_nibble_sums, say) has that
function compiled into it, and kept its old machine code after the other file changed: a new
version of execupy, or of a kernel here, would have run the old code.
Each *_jit module imports this first, before its kernels are decorated; their cache entries are
then stamped with the text of every .py file in their folder (~1 ms to read, once a process).
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core import caching

_PACKAGE = Path(__file__).resolve().parents[2]  # execupy/


@functools.lru_cache(maxsize=None)
def folder_stamp(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


class _FolderStamped:
    """Mixed into numba's file-backed locators: ours only, stamped by folder."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if not Path(py_file).resolve().is_relative_to(_PACKAGE):
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        return folder_stamp(Path(self._py_file).resolve().parent)


class _UserProvided(_FolderStamped, caching.UserProvidedCacheLocator):
    pass


class _InTree(_FolderStamped, caching.InTreeCacheLocator):
    pass


class _UserWide(_FolderStamped, caching.UserWideCacheLocator):
    pass


if _InTree not in caching.CacheImpl._locator_classes:  # in numba's order, before its own
    caching.CacheImpl._locator_classes[:0] = [_UserProvided, _InTree, _UserWide]
