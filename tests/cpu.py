"""What the test machine's CPU offers, for expectations that depend on which XNNPACK microkernels
ExecuTorch's runtime picks on it.

execupy reproduces bit for bit the f32 sigmoid and rsqrt kernels ExecuTorch's XNNPACK runs on a
CPU with AVX-512F and on an x86 CPU with AVX2 + FMA but no AVX-512 (backends/xnnpack/vmath.py
picks the CPU's variant), and its dynamically quantized 4-bit products both on a CPU with
AVX512-VNNI and on one with AVX2 + FMA (kernels/fast/xnnpack_gemm.py). On other CPUs XNNPACK
picks other kernels whose results differ from those in the last bit of some elements, so there
the tests that assert ExecuTorch's bits for those nodes assert agreement within a few float32
ulps instead.
"""
from __future__ import annotations

from pathlib import Path


def _flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


FLAGS = _flags()
# the f32 sigmoid and rsqrt execupy reproduces: XNNPACK's AVX-512F kernels, and its AVX2 + FMA ones
XNNPACK_ELEMENTWISE = "avx512f" in FLAGS or {"avx2", "fma"} <= FLAGS
# the 4-bit products execupy reproduces: XNNPACK's qb4w kernels of a CPU with AVX512-VNNI and of an
# x86 CPU with AVX2 + FMA (kernels/fast/xnnpack_gemm.py; /proc/cpuinfo spells avx512_vnni)
XNNPACK_4BIT = bool({"avx512_vnni", "avx512vnni"} & FLAGS) or {"avx2", "fma"} <= FLAGS
