#!/usr/bin/env python3
"""SmolLM2-135M's quantized linears, one shape at a time: decode mat-vec bandwidth and prefill rate.

    .venv/bin/python bench/quantized_kernels.py [--rows 1,64,128] [--repeat 5]

For each linear shape of the model (q/o 576x576, k/v 192x576, gate/up 1536x576, down
576x1536, head 49152x576, [N, K]) and each weight form `export-llm` writes from the GGUF
(int8 groups of 32: Q8_0 and `--quantize int8`-like; 4-bit words in groups of 32 with a
minimum: Q4_1 as `int4`/`gguf` keep it), it times `qlinear` (numba) on x [M, K]:

* M = 1 (decode), on one thread and on two (`--threads`): GB/s = bytes the kernel must read
  (packed integers + scales + offsets) / seconds. The weight is cycled over as many distinct
  copies as fill 96 MiB (what a decode step reads, three times the L3 cache), so it comes
  from memory as in a real decode step, not from cache. The ceilings beside it: numpy
  copying a 256 MiB array (read + write counted) and summing one (read only), what one
  core moves.
* M > 1 (prefill): tokens/s of that one shape, and the fp32 BLAS product on the
  dequantized weight for comparison (the float32 weight already made: a lower bound on
  what a dequantize-then-BLAS design can reach).

Times are medians; say `uptime` with the figures (the machine is shared).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from execupy.kernels.fast import quantized as Q

COLD_BYTES = 96 << 20  # a decode step reads ~96 MB of weights: three times the L3 cache
SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "head 49152x576": (49152, 576)}
GROUP = 32


def weight(rng, n: int, k: int, form: str) -> Q.PackedWeight:
    scales = (rng.random((n, k // GROUP)) * 0.02 + 1e-3).astype(np.float32)
    if form == "int8 g32":
        return Q.pack(rng.integers(-128, 128, (n, k)).astype(np.int8), scales, None, GROUP)
    mins = (rng.random((n, k // GROUP)) * -0.1).astype(np.float32)
    return Q.pack(rng.integers(0, 16, (n, k)).astype(np.int8), scales, None, GROUP, mins)


def nbytes(w: Q.PackedWeight) -> int:
    return w.qt.nbytes + w.scales.nbytes + w.offsets.nbytes


def median_seconds(call, calls: int, repeat: int) -> float:
    call()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def ceilings(repeat: int) -> tuple[float, float]:
    """GB/s of np.copyto on 256 MiB (bytes read + written) and of np.sum over it (read)."""
    src = np.ones(64 << 20, np.float32)
    dst = np.empty_like(src)
    copy = median_seconds(lambda: np.copyto(dst, src), 1, repeat)
    read = median_seconds(lambda: src.sum(), 1, repeat)
    return 2 * src.nbytes / copy / 1e9, src.nbytes / read / 1e9


def decode_row(rng, name: str, n: int, k: int, form: str, repeat: int, threads: int) -> str:
    one = weight(rng, n, k, form)
    copies = max(1, -(-COLD_BYTES // nbytes(one)))
    ws = [one] + [weight(rng, n, k, form) for _ in range(copies - 1)]
    x = rng.standard_normal((1, k)).astype(np.float32)

    def cycle():
        for w in ws:
            Q.qlinear(x, w, threads=threads)

    s = median_seconds(cycle, 1, repeat) / copies
    return (f"{name:18s} {form:9s} {threads} thr {nbytes(ws[0]) / 1e6:8.2f} MB {s * 1e6:9.1f} us "
            f"{nbytes(ws[0]) / s / 1e9:7.2f} GB/s")


def prefill_row(rng, name: str, n: int, k: int, form: str, m: int, repeat: int) -> str:
    w = weight(rng, n, k, form)
    x = rng.standard_normal((m, k)).astype(np.float32)
    dense = np.ascontiguousarray(Q.dequantize_columns(w, 0, n))
    s = median_seconds(lambda: Q.qlinear(x, w), 3, repeat)
    blas = median_seconds(lambda: x @ dense, 3, repeat)
    return (f"{name:18s} {form:9s} M={m:<4d} {s * 1e3:8.2f} ms {m / s:10.0f} tok/s   "
            f"fp32 BLAS {blas * 1e3:7.2f} ms ({blas / s:4.2f}x of ours)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,64,128", help="activation rows M (1 = decode)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--forms", default="int8 g32,q4_1 g32")
    ap.add_argument("--threads", default="1,2", help="decode threads to time (qlinear's threads=)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from SHAPES")
    args = ap.parse_args()
    assert Q.NUMBA is not None, "numba (the `fast` extra) is needed"
    rng = np.random.default_rng(0)
    print(f"load: {os.getloadavg()}")
    copy, read = ceilings(args.repeat)
    print(f"ceilings: copy {copy:.2f} GB/s (np.copyto 256 MiB, read + write), read {read:.2f} GB/s (np.sum)")
    rows = [int(r) for r in args.rows.split(",")]
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for form in args.forms.split(","):
            for m in rows:
                if m == 1:
                    for threads in map(int, args.threads.split(",")):
                        print(decode_row(rng, name, n, k, form, args.repeat, threads), flush=True)
                else:
                    print(prefill_row(rng, name, n, k, form, m, args.repeat), flush=True)
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
