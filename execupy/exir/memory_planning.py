"""Memory planning: lifetimes of planned tensors and greedy offsets in one arena.

The emitter creates a `Storage` for every planned tensor and records, as it writes
instructions, the first and last instruction index that touches it. Two storages may
be *merged* (they must share bytes: a cond branch result and the cond output, docs/format.md §19)
or *linked* (one must outlive another: a tensor whose handle is moved into a value
that is used later; a view op's source that must keep its bytes while the view is read). Planning then places storages, largest first, at the lowest
16-byte-aligned offset where no storage with an overlapping lifetime sits
(docs/format.md §15: any plan where live tensors do not overlap is valid).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..schema import program as P

FOREVER = 1 << 62  # lifetime end of graph outputs and mutable state
ALIGNMENT = 16


def align_up(x: int, alignment: int = ALIGNMENT) -> int:
    return (x + alignment - 1) // alignment * alignment


@dataclass(eq=False)
class Storage:
    """The planned bytes of one tensor (or of several that must share them)."""

    nbytes: int
    start: int = FOREVER  # first instruction index that uses it (-1: live on entry)
    end: int = -1  # last instruction index that uses it
    tensors: list[P.Tensor] = field(default_factory=list)  # values whose allocation_info we fill
    offset: Optional[int] = None
    parent: Optional["Storage"] = None  # union-find link for merged storages
    outlives: list["Storage"] = field(default_factory=list)  # must live at least as long as these

    def root(self) -> "Storage":
        s = self
        while s.parent is not None:
            s = s.parent
        return s

    def touch(self, index: int) -> None:
        r = self.root()
        r.start = min(r.start, index)
        r.end = max(r.end, index)


def merge(a: Storage, b: Storage) -> Storage:
    """Make a and b one storage (same offset), living as long as both."""
    ra, rb = a.root(), b.root()
    if ra is rb:
        return ra
    rb.parent = ra
    ra.nbytes = max(ra.nbytes, rb.nbytes)
    ra.start, ra.end = min(ra.start, rb.start), max(ra.end, rb.end)
    ra.tensors += rb.tensors
    ra.outlives += rb.outlives
    rb.tensors, rb.outlives = [], []
    return ra


def _roots(storages: list[Storage]) -> list[Storage]:
    seen: dict[int, Storage] = {}
    for s in storages:
        r = s.root()
        seen.setdefault(id(r), r)
    return list(seen.values())


def _extend_lifetimes(roots: list[Storage]) -> None:
    """Apply `outlives` links until nothing changes (links may chain)."""
    changed = True
    while changed:
        changed = False
        for r in roots:
            for other in r.outlives:
                end = other.root().end
                if end > r.end:
                    r.end, changed = end, True


def _overlap(a: Storage, b: Storage) -> bool:
    return a.start <= b.end and b.start <= a.end


def plan(storages: list[Storage], memory_id: int = 1) -> int:
    """Assign offsets to every storage and fill allocation_info; returns the arena size."""
    roots = _roots(storages)
    _extend_lifetimes(roots)
    for r in roots:
        if r.start > r.end:  # never used by an instruction (e.g. an unused input)
            r.start = r.end = max(r.end, -1)
    # Greedy placement depends on the order tensors are placed in; no single order wins
    # on every graph, so try a few cheap ones and keep the smallest arena.
    orders = [
        lambda s: (-align_up(s.nbytes), s.start),  # largest first (ExecuTorch's greedy)
        lambda s: (s.start, -align_up(s.nbytes)),  # in allocation order
        lambda s: (-(s.end - s.start), -align_up(s.nbytes)),  # longest-lived first
    ]
    arena, offsets = min((_place(sorted(roots, key=order)) for order in orders), key=lambda p: p[0])
    for r in roots:
        r.offset = offset = offsets[id(r)]
        for t in r.tensors:
            t.allocation_info = P.AllocationDetails(memory_id, offset & 0xFFFFFFFF, offset >> 32)
    return arena


def _place(order: list[Storage]) -> tuple[int, dict[int, int]]:
    """First-fit offsets for storages placed in `order`: (arena size, {id(storage): offset})."""
    placed: list[tuple[Storage, int]] = []
    offset_of: dict[int, int] = {}
    arena = 0
    for r in order:
        size = align_up(r.nbytes)
        offset = 0
        for other, other_offset in sorted((p for p in placed if _overlap(p[0], r)), key=lambda p: p[1]):
            if offset + size <= other_offset:
                break  # fits in the gap below `other`
            offset = max(offset, other_offset + align_up(other.nbytes))
        placed.append((r, offset))
        offset_of[id(r)] = offset
        arena = max(arena, offset + size)
    return arena, offset_of


def naive_size(storages: list[Storage]) -> int:
    """Bytes needed without any reuse: the sum of all planned tensors."""
    return sum(align_up(r.nbytes) for r in _roots(storages))
