"""A program that needs no compiled kernel imports none of the optional heavy modules: numba
(about 100 MiB resident), numpy.random (6 MiB: it loads OpenSSL), hashlib (OpenSSL, 3 MiB),
ml_dtypes (2.5 MiB, for bfloat16 and float8) and numpy.polynomial (1.3 MiB, for erf). A small
fp32 program would otherwise carry them beside its weights. (An fp32 LLM's decode does load
numba, for the mat-vecs it shares with the second core: kernels/fast/dense.py.)"""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HEAVY = ("numba", "numpy.random", "_hashlib", "ml_dtypes", "numpy.polynomial")


def test_an_fp32_program_sampled_greedily_imports_no_heavy_module():
    probe = f"""
import sys
import numpy as np
import execupy.kernels.llm.kv_cache  # the LLM kernels an fp32 program runs
from execupy.llm.sampler import Sampler
from execupy.runtime import Program
method = Program.load(sys.argv[1]).load_method("forward")
out = method.execute([np.ones((4, 16), np.float32)])[0]
Sampler().sample(out[0])  # greedy (the default): draws nothing
print([name for name in {HEAVY!r} if name in sys.modules])
"""
    pte = REPO / "execupy" / "examples" / "mlp.pte"
    result = subprocess.run([sys.executable, "-c", probe, str(pte)], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
