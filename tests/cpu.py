"""What the test machine's CPU offers, for expectations that depend on which XNNPACK microkernels
ExecuTorch's runtime picks on it.

execupy reproduces bit for bit the kernels ExecuTorch's XNNPACK runs on a CPU with AVX-512
(f32 sigmoid and rsqrt) and with AVX512-VNNI (the dynamically quantized 4-bit
products; kernels/fast/xnnpack_gemm.py). On a CPU without them (an AMD EPYC whose hypervisor
hides AVX-512: AVX2 and FMA only) XNNPACK picks other kernels whose results differ from those
in the last bit of some elements, so there the tests that assert ExecuTorch's bits for those
nodes assert agreement within a few float32 ulps instead.
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
XNNPACK_AVX512 = "avx512f" in FLAGS  # the elementwise approximations execupy reproduces
XNNPACK_VNNI = "avx512_vnni" in FLAGS  # the 4-bit products execupy reproduces (/proc/cpuinfo's spelling)
