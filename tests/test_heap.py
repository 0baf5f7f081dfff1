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
