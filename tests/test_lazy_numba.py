"""numba is imported only by a program that runs a compiled kernel: its import alone adds about
100 MiB to the resident set, which an fp32 LLM (no compiled kernel) would otherwise carry."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

def test_an_fp32_program_does_not_import_numba():
    probe = """
import sys
import numpy as np
import execupy.kernels.llm.kv_cache  # the LLM kernels an fp32 program runs
from execupy.runtime import Program
method = Program.load(sys.argv[1]).load_method("forward")
method.execute([np.ones((4, 16), np.float32)])
print("numba" in sys.modules)
"""
    pte = REPO / "execupy" / "examples" / "mlp.pte"
    result = subprocess.run([sys.executable, "-c", probe, str(pte)], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "False"
