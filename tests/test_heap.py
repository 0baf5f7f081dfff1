"""runtime/heap.py: once a program is loaded, a call's large temporaries reuse the pages the
last call freed instead of faulting fresh ones in (glibc; elsewhere nothing is asked)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, resource, sys, numpy as np
g = np.ones((1536, 113), np.float32)  # a SmolLM2 prompt's SwiGLU gate: 694 KB

def faults_per_call():
    for _ in range(3):
        np.exp(np.negative(g))  # two such temporaries alive at once, then both freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        np.exp(np.negative(g))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50

untuned = faults_per_call()
from execupy.runtime import Program
Program.load(sys.argv[1])
print(json.dumps([untuned, faults_per_call()]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_after_a_load_freed_temporaries_are_reused_without_page_faults():
    from .conformance import topic

    pte = topic("dynamic_batch_seq")[0].pte
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", PROBE, str(pte)], env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300, check=True)
    untuned, tuned = json.loads(proc.stdout)
    assert untuned > 100  # glibc's own thresholds: the pages go back at every free (the machine this is about)
    assert tuned < 1


POPULATE_PROBE = """
import json, resource, sys, numpy as np
from execupy.runtime import Program
program = Program.load(sys.argv[1])
program.load_method("forward")  # its matrix product reads the weight whole: that is what gets mapped in
thread = program.populate_in_background() if sys.argv[2] == "populate" else None
if thread is not None:
    thread.join()
view = np.frombuffer(program._keepalive, np.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
total = int(view[::4096].sum(dtype=np.int64))  # one read per page of the file
print(json.dumps([thread is not None, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_READ)")
def test_a_populated_program_reads_its_file_without_page_faults(tmp_path):
    """The LLM runner maps the pages of the weights its steps read whole in on another thread
    while its tokenizer loads, so the first prompt reads them without page faults."""
    pte = tmp_path / "weights.pte"
    pte.write_bytes(_linear_program(4096, 8192))  # 128 MiB of weights
    root = Path(__file__).resolve().parents[1]
    runs = {how: json.loads(subprocess.run([sys.executable, "-c", POPULATE_PROBE, str(pte), how],
                                           env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                                           text=True, timeout=300, check=True).stdout)
            for how in ("populate", "fault")}
    populated, faults = runs["populate"]
    if not populated:
        pytest.skip("glibc not found: nothing to populate with")
    # Unpopulated, a read faults once per page or per batch the kernel maps around it (one per
    # 16 pages, or per large folio of a freshly written file: 19 faults for 32 MiB here).
    assert runs["fault"][0] is False and faults <= 5 and 4 * faults < runs["fault"][1]


def _linear_program(n: int, k: int) -> bytes:
    """x @ w for a weight w [k, n] stored as the product reads it (as export-llm's linears are)."""
    torch = pytest.importorskip("torch")
    from torch.export import export

    from execupy.exir import to_edge

    class Product(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(k, n))

        def forward(self, x):
            return x @ self.w

    return to_edge(export(Product(), (torch.randn(1, k),))).to_executorch().buffer


def test_only_constants_read_whole_are_mapped_in_ahead(tmp_path):
    """An embedding table is read a few rows at a time: mapping all of it in would only grow
    the resident set. A matrix product's weight is read whole at each call."""
    torch = pytest.importorskip("torch")
    from torch.export import export

    from execupy.exir import to_edge
    from execupy.runtime import Program

    class Lookup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(4096, 256)
            self.proj = torch.nn.Parameter(torch.randn(256, 512))

        def forward(self, ids):
            return self.table(ids) @ self.proj

    pte = tmp_path / "lookup.pte"
    pte.write_bytes(to_edge(export(Lookup(), (torch.tensor([[1, 2, 3]]),))).to_executorch().buffer)
    program = Program.load(pte)
    program.load_method("forward")
    read_whole = sum(hi - lo for lo, hi in program._read_in_full)
    assert 512 * 256 * 4 <= read_whole < 4096 * 256 * 4  # the projection's weight, not the table


COMPILER_PROBE = """
import json, numba
from execupy.runtime.heap import COMPILER_LIBRARY, _clean_file_mappings, page_out_compiler

def resident_kib():  # the compiler library's resident pages that are the file's own
    spans, total, current = set(_clean_file_mappings(COMPILER_LIBRARY)), 0, None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            current = tuple(int(a, 16) for a in fields[0].split("-"))
        elif fields[0] == "Rss:" and current in spans:
            total += int(fields[1])
    return total

@numba.njit(cache=False)
def first(x):
    return x + 1

first(1)  # LLVM has compiled: its code and tables are resident
before = resident_kib()
advised = page_out_compiler()
after = resident_kib()

@numba.njit(cache=False)
def second(x):
    return x * 2 + 1

print(json.dumps([before, advised, after, second(3)]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise")
def test_the_compilers_pages_are_handed_back_and_read_again_if_needed():
    """Once the kernels are loaded the LLM runner drops LLVM's resident code and tables (tens of
    MiB of the peak); should something compile afterwards, the library still works."""
    pytest.importorskip("numba")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", COMPILER_PROBE], env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300, check=True)
    before, advised, after, compiled = json.loads(proc.stdout)
    assert before > 20 * 1024 and advised > 0  # KiB: LLVM's pages were there
    assert after < before / 10
    assert compiled == 7


ARENA_PROBE = """
import json
from execupy.runtime.method import _zeroed_arena

def resident_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1])

before = resident_kib()
arena = _zeroed_arena(64 << 20)
total = int(arena[::4096].sum())  # every page read, none written (a prompt's attention over the cache)
read = resident_kib()
arena[: 8 << 20] = 1  # 8 MiB written
written = resident_kib()
print(json.dumps([total, read - before, written - before]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_planned_memory_is_resident_only_where_written():
    """A KV cache is zeros until tokens are written into it; reading its unwritten part (attention
    over the whole cache) must not make it resident."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", ARENA_PROBE], env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300, check=True)
    total, read_kib, written_kib = json.loads(proc.stdout)
    assert total == 0
    assert read_kib < 4 * 1024  # a 64 MiB arena read whole: (nearly) nothing resident
    assert 8 * 1024 <= written_kib < 12 * 1024
