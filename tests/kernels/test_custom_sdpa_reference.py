"""`llama::custom_sdpa` against ExecuTorch 1.5.1's own kernel (its `torch.ops.llama.custom_sdpa`,
run in the reference venv as a subprocess), on the shapes ExecuTorch's SmolLM2 program uses
(9 query heads, 3 KV heads, head_dim 64) and odd ones, decode and causal prefill, with windows
past ExecuTorch's 512-slot KV blocks.

What the comparison shows (docs/xnnpack-export.md, "Attention: why the last bits differ"):
ExecuTorch's kernel runs q @ k.T and p @ v through the Fortran `sgemm_` symbol, which in any
process that has imported torch binds to the MKL inside libtorch_cpu. MKL's summation order
for these products changes with the matrix size and the output's alignment, so the result is
not reproducible bit for bit outside that library. Ours agrees to a few float32 roundings:
within 2e-6 + 1e-5 * |x| here (inputs of unit scale), and equal where the products are exact.
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from execupy.kernels.llm.kv_cache import custom_sdpa
from tests.reference import ReferenceError, _last_lines, reference_python

pytestmark = pytest.mark.reference

# (start_pos, query length, query heads, KV heads, head_dim, cache slots, causal)
CASES = {
    "smollm2-decode-first": (0, 1, 9, 3, 64, 700, True),
    "smollm2-decode-37": (37, 1, 9, 3, 64, 700, True),
    "smollm2-decode-300": (300, 1, 9, 3, 64, 700, True),
    "smollm2-decode-600-two-kv-blocks": (600, 1, 9, 3, 64, 700, True),
    "smollm2-prefill-7": (0, 7, 9, 3, 64, 700, True),
    "smollm2-prefill-12-after-20": (20, 12, 9, 3, 64, 700, True),
    "smollm2-prefill-40-two-q-blocks": (0, 40, 9, 3, 64, 700, True),
    "gqa-head-dim-24": (10, 3, 6, 2, 24, 64, True),
    "mha-head-dim-17": (5, 4, 5, 5, 17, 32, True),
    "mqa-head-dim-8": (3, 1, 4, 1, 8, 16, True),
    "not-causal": (6, 3, 4, 2, 16, 32, False),
}

_WORKER = r"""
import sys, numpy as np, torch
from executorch.extension.llm.custom_ops import custom_ops  # registers llama::custom_sdpa
data = np.load(sys.argv[1])
outs = {}
for name in data["names"]:
    q, k, v = (torch.from_numpy(data[f"{name}.{x}"]) for x in "qkv")
    start_pos, causal = int(data[f"{name}.start_pos"]), bool(data[f"{name}.causal"])
    outs[name] = torch.ops.llama.custom_sdpa(q, k, v, start_pos, None, 0.0, causal, None).numpy()
np.savez(sys.argv[2], **outs)
"""


def _inputs(seed: int, start_pos: int, seqlen: int, heads: int, kv_heads: int, dim: int, slots: int):
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((1, seqlen, heads, dim), dtype=np.float32)
    # Keys at twice the scale give peaked and flat rows alike; slots past the window hold
    # values too, so reading beyond start_pos + seqlen would show.
    key = 2 * rng.standard_normal((1, slots, kv_heads, dim), dtype=np.float32)
    value = rng.standard_normal((1, slots, kv_heads, dim), dtype=np.float32)
    return query, key, value


def executorch_custom_sdpa(cases: dict[str, tuple]) -> dict[str, np.ndarray]:
    """ExecuTorch's llama::custom_sdpa on each case's (query, key cache, value cache, start_pos, causal)."""
    with tempfile.TemporaryDirectory(prefix="execupy-sdpa-") as tmp:
        arrays = {"names": np.array(list(cases))}
        for name, (query, key, value, start_pos, causal) in cases.items():
            arrays.update({f"{name}.q": query, f"{name}.k": key, f"{name}.v": value,
                           f"{name}.start_pos": np.asarray(start_pos), f"{name}.causal": np.asarray(causal)})
        np.savez(Path(tmp) / "in.npz", **arrays)
        proc = subprocess.run([str(reference_python()), "-c", _WORKER, str(Path(tmp) / "in.npz"),
                               str(Path(tmp) / "out.npz")], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise ReferenceError(f"custom_sdpa worker exited {proc.returncode}: {_last_lines(proc.stderr)}")
        with np.load(Path(tmp) / "out.npz") as out:
            return {name: out[name] for name in cases}


@pytest.fixture(scope="module")
def compared() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(ours, ExecuTorch's) per case, ExecuTorch's all from one subprocess."""
    cases = {}
    for seed, (name, (start_pos, seqlen, heads, kv_heads, dim, slots, causal)) in enumerate(CASES.items()):
        cases[name] = (*_inputs(seed, start_pos, seqlen, heads, kv_heads, dim, slots), start_pos, causal)
    theirs = executorch_custom_sdpa(cases)
    ours = {name: custom_sdpa(q, k, v, start_pos, None, 0.0, causal, None, np.empty_like(q))
            for name, (q, k, v, start_pos, causal) in cases.items()}
    return {name: (ours[name], theirs[name]) for name in cases}


@pytest.mark.parametrize("name", list(CASES))
def test_custom_sdpa_agrees_with_executorchs_kernel(compared, name):
    ours, theirs = compared[name]
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=2e-6)


def test_exact_products_give_executorchs_bits():
    """Where every score and every weighted sum is exact (one-hot keys scaled by powers of
    two, one-hot values), the softmax alone decides the result: ours is ExecuTorch's, bit for bit."""
    dim, slots = 64, 40
    query = np.zeros((1, 1, 1, dim), np.float32)
    query[..., 0] = 1.0
    key = np.zeros((1, slots, 1, dim), np.float32)
    key[0, :, 0, 0] = np.arange(slots, dtype=np.float32) * 0.25 - 4  # scores exact in float32
    value = np.zeros((1, slots, 1, dim), np.float32)
    value[0, np.arange(slots), 0, np.arange(slots)] = 1.0
    theirs = executorch_custom_sdpa({"exact": (query, key, value, slots - 1, True)})["exact"]
    ours = custom_sdpa(query, key, value, slots - 1, None, 0.0, True, None, np.empty_like(query))
    assert np.count_nonzero(theirs) == slots
    np.testing.assert_array_equal(ours, theirs)
