"""What the OS does with our memory: glibc's freed heap (elsewhere those calls do nothing), a
program file's pages mapped in ahead of the first call (Linux 5.14 and later), and the compiler's
pages handed back once it has done its work.

A call with dynamic shapes (a prompt) allocates its intermediates as it goes, many of them
hundreds of KB to a few MB. glibc gives memory back to the OS when it is freed: blocks of 128 KB
and up are mapped and unmapped one by one until that threshold adapts, and then the top of the
heap is returned whenever more than twice the largest such block is free there. A call whose
live temporaries exceed that gives their pages back at every free and faults them in again at
the next allocation, one fault per 4 KB page (~1.5 us each on our 2-core machines): SmolLM2
fp32's 113-token prompt took 307 page faults per SiLU on [1536, 113] (0.52 ms against 0.06)
and 285-347 ms in all against 200-207 ms with freed memory kept.

`keep_freed_memory` (at the first program load) keeps up to KEEP_FREE bytes of freed heap
mapped and maps separately only blocks from MAP_APART up (weights, arenas, KV caches: made
once). The peak resident set is what the live set was at its largest, as before; what a call
freed stays mapped for the next one. `trim_heap` hands the free heap back when asked (the LLM
runner does after loading and before a prompt).
"""
from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path
from typing import Any, Optional

KEEP_FREE = 256 << 20  # M_TRIM_THRESHOLD: free heap kept mapped, bytes
MAP_APART = 32 << 20  # M_MMAP_THRESHOLD: blocks this large get a mapping of their own (glibc's largest default)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_state = {"kept": False}


def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc: nothing to tune
        return None


def keep_freed_memory() -> None:
    """Once per process: freed memory stays mapped for the next allocation (see above). Setting
    either threshold turns off glibc's own adapting of both, so both are set."""
    if _state["kept"]:
        return
    _state["kept"] = True
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MAP_APART)
        libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREE)


def trim_heap() -> None:
    """Ask glibc to unmap the free pages inside its heap (a tenth of a millisecond)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


MADV_POPULATE_READ = 22  # madvise: map the range's pages in now, reading them (Linux 5.14+; EINVAL before)
POPULATE_CHUNK = 32 << 20  # bytes per madvise call


def populate_in_background(base: int, ranges: list[tuple[int, int]], keepalive: Any) -> Optional[threading.Thread]:
    """Map in the pages of [base + lo, base + hi) for each range, on a thread of its own (ctypes
    lets go of the GIL during each call, so the caller's Python goes on meanwhile). A read-only
    file mapping's first read of each page otherwise faults inside the first forward call: SmolLM2
    fp32's 113-token prompt took 11,000 faults and 220-269 ms against 197 ms with its 514 MiB
    mapped in first (40 ms of populating). `keepalive` (the mapping) is held until done."""
    libc = _libc()
    if libc is None or not ranges:
        return None

    def populate() -> None:
        for lo, hi in ranges:
            for start in range(lo, hi, POPULATE_CHUNK):
                n = min(POPULATE_CHUNK, hi - start)
                if libc.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(n), MADV_POPULATE_READ) != 0:
                    return  # an older kernel (EINVAL), or the mapping is gone: pages fault in as read
        del keep[:]

    keep = [keepalive]
    thread = threading.Thread(target=populate, name="execupy-populate", daemon=True)
    thread.start()
    return thread


MADV_DONTNEED = 4  # madvise: drop the range's pages from this process (a file's are read again on use)
COMPILER_LIBRARY = "libllvmlite"  # LLVM, as numba's llvmlite ships it


def page_out_compiler() -> int:
    """Hand back the pages of LLVM's library that loading the compiled kernels left resident, and
    return how many bytes of mappings were advised (0 where numba was never imported).

    numba loads each kernel from its disk cache through LLVM, whose code and tables then hold
    ~69 MiB of the resident set (SmolLM2 fp32: 725 MiB at its peak, 514 of them the program).
    Once a program's methods are bound nothing compiles again (the LLM runner's test holds it
    to that), so those pages are dead weight while generating. Only mappings that are clean
    copies of the file are dropped (no page of theirs written, as the relocated ones were):
    should something compile after all, their pages are read back from the file (a few ms),
    the same bytes. (MADV_PAGEOUT, used before, left them resident on Linux 6.18, whose file
    cache holds them in large folios.)"""
    if "llvmlite" not in sys.modules:
        return 0
    libc = _libc()
    if libc is None:
        return 0
    advised = 0
    for start, end in _clean_file_mappings(COMPILER_LIBRARY):
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) != 0:
            return advised
        advised += end - start
    return advised


def _clean_file_mappings(library: str) -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of a file whose name holds `library` that are
    unwritable and hold no page of the process's own (smaps' Anonymous: 0): every resident page
    is the file's. A read-only mapping may still hold written pages (RELRO: relocated, then
    made read-only); dropping those would lose the relocations."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:  # not Linux
        return []
    spans, current = [], None
    for line in lines:
        fields = line.split(maxsplit=5)
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            current = None
            if len(fields) == 6 and library in fields[5] and "w" not in fields[1]:
                current = tuple(int(a, 16) for a in fields[0].split("-"))
        elif current is not None and fields[:1] == ["Anonymous:"]:
            if fields[1] == "0":
                spans.append(current)
            current = None
    return spans
