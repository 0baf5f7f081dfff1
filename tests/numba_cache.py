"""Runs a probe script in two fresh processes sharing one numba cache folder, so a test can
check that compiled kernels are compiled once per machine, not once per process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A probe's last lines: print each kernel's [disk-cache hits, misses] as JSON.
PRINT_STATS = """
import json
print(json.dumps({name: [sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())]
                  for name, k in K.KERNELS.items()}))
"""


def two_processes_cache_stats(probe: str, cache_dir: Path) -> list[dict[str, list[int]]]:
    """`probe` (a script that imports the jit module as K and runs every kernel in K.KERNELS)
    run twice; each run's {kernel: [hits, misses]}."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    return [json.loads(subprocess.run([sys.executable, "-c", probe + PRINT_STATS], env=env, capture_output=True,
                                      text=True, check=True, timeout=600).stdout) for _ in range(2)]
