"""The compiled one-token steps (execupy/kernels/fast/decode_jit.py) compute bit for bit what the
numpy kernels they stand in for compute (kernels/fast/__init__.py, themselves bit-identical to
the unfused portable instructions), and a decode plan uses them once numba is loaded."""
import json
import subprocess
import sys

import numpy as np
import pytest

from execupy.kernels.fast import rms_norm, rope_swapped, rotate_pairs

pytest.importorskip("numba")
from execupy.kernels.fast import decode_jit  # noqa: E402  (needs numba)

RNG = np.random.default_rng(11)


def rows(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("n,scale", [(576, 1.0), (576, 1e-3), (576, 3e3), (64, 1.0), (1, 1.0), (2048, 0.1)])
def test_add_rms_norm_row_is_bit_identical_to_the_numpy_kernel(n, scale):
    a, b, w = rows(n, scale=scale), rows(n, scale=scale), rows(n)
    eps = np.float32(1e-5)
    total, normed = np.empty(n, np.float32), np.empty(n, np.float32)
    decode_jit.add_rms_norm_row(a, b, eps, w, total, normed)
    expected_total = np.add(a, b)
    assert np.array_equal(total, expected_total)
    assert np.array_equal(normed, rms_norm(expected_total, eps, w))


def test_add_rms_norm_row_keeps_numpys_inf_and_nan():
    n, w = 64, rows(64)
    zeros, out = np.zeros(n, np.float32), [np.empty(n, np.float32) for _ in range(2)]
    # a zero row and eps 0: 1 / sqrt(0) is inf and 0 * inf NaN, as numpy gives (no ZeroDivisionError)
    decode_jit.add_rms_norm_row(zeros, zeros, np.float32(0), w, *out)
    with np.errstate(divide="ignore", invalid="ignore"):
        assert np.array_equal(out[1], rms_norm(zeros, np.float32(0), w), equal_nan=True)
    a = rows(n)
    a[5] = np.nan
    decode_jit.add_rms_norm_row(a, zeros, np.float32(1e-6), w, *out)
    assert np.isnan(out[1]).all()
    assert np.array_equal(out[1], rms_norm(a, np.float32(1e-6), w), equal_nan=True)


@pytest.mark.parametrize("heads,dim,scale", [(9, 64, 1.0), (3, 64, 50.0), (1, 2, 1.0), (32, 128, 1e-2)])
def test_rope_swapped_rows_is_bit_identical_to_the_numpy_kernel(heads, dim, scale):
    x = rows(heads, dim, scale=scale)
    angles = RNG.uniform(-100, 100, dim // 2).astype(np.float32)
    cos = np.concatenate([np.cos(angles), np.cos(angles)]).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)]).astype(np.float32)  # the pre-signed tables
    out = np.empty_like(x)
    decode_jit.rope_swapped_rows(x, cos, sin, out)
    assert np.array_equal(out, rope_swapped(x, cos, sin))


@pytest.mark.parametrize("positions,heads,dim,scale", [(1, 9, 32, 1.0), (1, 3, 32, 50.0), (113, 9, 32, 1e-2), (4, 1, 2, 1.0)])
def test_rotate_pairs_is_what_its_nodes_compute_and_the_compiled_rows_the_same_bits(positions, heads, dim, scale):
    """XNNPACK's nine-node rotary embedding (backends/xnnpack/fused.py): multiplies, a subtract
    and an add, each rounded to float32, then reshapes and a concatenate along a new last axis."""
    a, b = rows(1, positions, heads, dim, scale=scale), rows(1, positions, heads, dim, scale=scale)
    angles = RNG.uniform(-100, 100, (1, positions, 1, dim)).astype(np.float32)
    c, s = np.cos(angles), np.sin(angles)
    nodes = np.concatenate([np.subtract(np.multiply(a, c), np.multiply(b, s))[..., None],
                            np.add(np.multiply(a, s), np.multiply(b, c))[..., None]], axis=4)
    assert np.array_equal(rotate_pairs(a, b, c, s), nodes)
    out = np.empty(a.shape + (2,), np.float32)
    decode_jit.rotate_pairs_rows(a.reshape(-1, dim), b.reshape(-1, dim), c.reshape(-1, dim), s.reshape(-1, dim),
                                 heads, out.reshape(-1, dim, 2))
    assert np.array_equal(out, nodes)


@pytest.mark.parametrize("shape,scale", [((1, 1, 576), 1.0), ((1, 1, 576), 3e3), ((1, 113, 576), 1e-3), ((4, 7), 1.0),
                                         ((1, 9, 15), 1.0), ((17, 1), 1.0), ((1, 16, 2), 1.0)])
def test_mean_rows_is_the_portable_means_bits(shape, scale, monkeypatch):
    """The compiled mean (eight rows side by side, then one by one) against the numpy path's
    (the portable kernel with the compiled path off), with a row of -0.0 (summed from its first
    element, as ExecuTorch seeds a reduction: -0.0), NaN and inf; the portable kernel itself
    takes the compiled path when numba is loaded."""
    from execupy.kernels import fast
    from execupy.kernels.portable.reduce import mean_dim

    x = rows(*shape, scale=scale) ** 2  # an RMSNorm's squares
    flat = x.reshape(-1, shape[-1])
    flat[0] = -0.0
    if flat.shape[0] > 3:
        flat[2, -1], flat[3, 0] = np.nan, np.inf
    with monkeypatch.context() as m:
        m.setattr(fast, "compiled_decode", lambda: None)
        expected = mean_dim(x, [-1], True, None, np.empty(shape[:-1] + (1,), np.float32))
    out = np.empty(shape[:-1] + (1,), np.float32)
    decode_jit.mean_rows(flat, out.reshape(-1))
    assert np.array_equal(out, expected, equal_nan=True) and np.signbit(out.flat[0]) and np.signbit(expected.flat[0])
    through_kernel = mean_dim(x, [-1], True, None, np.empty(shape[:-1] + (1,), np.float32))
    assert np.array_equal(through_kernel, expected, equal_nan=True)


def test_a_prompts_rows_through_the_compiled_steps_are_bit_identical_to_numpys():
    """A prompt's [1, T, n] residual add + RMSNorm and [1, T, H, D] RoPE (each position its own
    tables), row after row in the decode kernels, as the dynamic fused steps run them."""
    a, b, w, eps = rows(113, 576, scale=3.0), rows(113, 576), rows(576), np.float32(1e-5)
    # b as it lies in memory too: a linear's result transposed (the kernel takes four rows at a
    # time, then 113 % 4 one by one)
    for b_read in (b, np.ascontiguousarray(b.T).T):
        total, normed = np.empty_like(a), np.empty_like(a)
        decode_jit.add_rms_norm_rows(a, b_read, eps, w, total, normed)
        assert np.array_equal(total, a + b) and np.array_equal(normed, rms_norm(a + b, eps, w))
    x = rows(1, 113, 9, 64, scale=5.0)
    angles = RNG.uniform(-100, 100, (1, 113, 1, 32)).astype(np.float32)
    cos = np.concatenate([np.cos(angles), np.cos(angles)], axis=-1).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=-1).astype(np.float32)
    out = np.empty_like(x)
    decode_jit.rope_swapped_positions(x.reshape(113, 9, 64), cos.reshape(113, 64), sin.reshape(113, 64),
                                      out.reshape(113, 9, 64))
    assert np.array_equal(out, rope_swapped(x, cos, sin))


def test_a_decode_plan_binds_the_compiled_steps_and_matches_numpys(tmp_path, monkeypatch):
    """Our exporter's tiny LLM: decoding with numba loaded runs the compiled add + RMSNorm, RoPE and
    attention steps, and every call's logits equal those of the same program with EXECUPY_NUMBA=0."""
    pytest.importorskip("torch")

    from ..llm.test_export_runner import export_tiny
    from ..test_fusion import generate_both

    result, _ = export_tiny(tmp_path)
    _, (fused, _), (compiled, _) = generate_both(result.pte_path, [1, 5, 17, 42, 7], steps=4)
    names = [step.__name__ for step in fused._shape_plans[fused._shape_key()].steps]
    assert "add_rms_norm_compiled" in names and "rope_swapped_compiled" in names
    assert "custom_sdpa_step" in names  # the attention bound too, its heads shared with the second core
    monkeypatch.setenv("EXECUPY_NUMBA", "0")
    _, (plain_fused, _), (numpy_only, _) = generate_both(result.pte_path, [1, 5, 17, 42, 7], steps=4)
    names = [step.__name__ for step in plain_fused._shape_plans[plain_fused._shape_key()].steps]
    assert "add_rms_norm_compiled" not in names and "add_rms_norm_row" in names
    for k, (x, y) in enumerate(zip(compiled, numpy_only)):
        assert np.array_equal(x, y), f"call {k}: max |diff| {np.abs(x - y).max()}"


def test_the_compiled_attentions_exp_rounds_as_the_numpy_paths():
    """attention_jit.exp_below (a vectorised float64 polynomial in fused multiply-adds) gives the
    float32 the numpy path (kv_cache._exp: float64 exp rounded once) gives, on scores spread as
    attention's are and on the edges: 0, underflow to denormals and to 0, -inf, NaN."""
    from execupy.kernels.fast.attention_jit import exp_below
    from execupy.kernels.llm.kv_cache import _exp

    scores = np.concatenate([rows(1_000_000, scale=s) for s in (0.3, 5.0, 40.0)])
    top = np.float32(scores.max())
    edges = np.array([0, -0.0, -1e-30, -1e-7, -0.5, -87.3, -88.7, -103.2, -103.97, -104, -104.5, -105, -200, -1e30,
                      -np.inf, np.nan], np.float32)
    for values, top in ((scores, top), (edges, np.float32(0))):
        e = values.copy()
        exp_below(e, e.size, top)
        with np.errstate(invalid="ignore"):
            expected = _exp(np.subtract(values, top, dtype=np.float32))
        assert np.array_equal(e, expected, equal_nan=True), f"{np.count_nonzero(e != expected)} differ"


@pytest.mark.parametrize("r,n,scale", [(1, 576, 1.0), (3, 576, 1e-3), (2, 64, 3e3), (1, 1, 1.0)])
def test_rms_norm_rows_is_bit_identical_to_the_numpy_kernel(r, n, scale):
    x, w = rows(r, n, scale=scale), rows(n)
    x[0, 0] = -0.0  # a negative zero stays one (the norm alone has no add to turn it into +0)
    normed = np.empty((r, n), np.float32)
    decode_jit.rms_norm_rows(x, np.float32(1e-5), w, normed)
    expected = rms_norm(x, np.float32(1e-5), w)
    assert np.array_equal(normed, expected) and np.array_equal(np.signbit(normed), np.signbit(expected))


# In a process of its own (the kernels an earlier test called would look loaded): the runner's
# load, then every compiled kernel's signatures and LLVM's resident pages before and after
# generating. A kernel that gains a signature was read from numba's cache (or compiled) inside
# a prompt or a token, through LLVM, whose pages the load handed back (runtime/heap.py).
_GENERATE_AFTER_LOAD = r"""
import json, sys
import numba
from execupy.llm.runner import LLMRunner

def kernels():
    return {f"{module}.{name}": sorted(map(str, f.signatures)) for module, m in list(sys.modules.items())
            if module.startswith("execupy.") for name, f in vars(m).items()
            if isinstance(f, numba.core.registry.CPUDispatcher)}

def llvm_resident_kib():
    # pages of LLVM's code and constants that only this process maps (the kernel does not page
    # out what another process maps too, such as the pytest process that started this one)
    kib, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if not fields[0].endswith(":"):
            inside = len(fields) > 5 and "libllvmlite" in fields[5] and "w" not in fields[1]
        elif fields[0] in ("Private_Clean:", "Private_Dirty:") and inside:
            kib += int(fields[1])
    return kib

runner = LLMRunner(sys.argv[1], sys.argv[2])
before, llvm_before = kernels(), llvm_resident_kib()
runner.generate("the quick brown fox jumps over the lazy dog " * 2, max_new_tokens=4)
after = kernels()
print(json.dumps({"loaded_while_generating": {k: v for k, v in after.items() if v != before.get(k)},
                  "llvm_kib": [llvm_before, llvm_resident_kib()]}))
"""


def _assert_nothing_loads_while_generating(pte, tokenizer) -> None:
    proc = subprocess.run([sys.executable, "-c", _GENERATE_AFTER_LOAD, str(pte), str(tokenizer)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["loaded_while_generating"] == {}
    # ~2 MiB stay: LLVM's relocated tables, written at load, have no file to go back to
    assert seen["llvm_kib"][1] <= seen["llvm_kib"][0] + 256 and seen["llvm_kib"][0] < 4 << 10


@pytest.mark.parametrize("flags", [{"quantize": "int4", "group_size": 32}, {"quantize": "int8"},
                                   {"backend": "xnnpack", "quantize": "8da4w", "group_size": 32}],
                         ids=["int4", "int8", "xnnpack-8da4w"])
def test_loading_an_llm_program_leaves_no_compiled_step_to_load_while_generating(tmp_path, flags):
    """numba reads a kernel's machine code at its first call with each signature (a read-only
    weight is one of its own): every compiled kernel a tiny LLM's prompt and first tokens call
    was called at load, in that form (else 1-13 ms each fell inside them), so LLVM's pages,
    handed back at load, stay out while generating."""
    pytest.importorskip("torch")
    from execupy.llm.export import export_llm

    from ..llm.test_export_runner import MAX_PREFILL, MAX_SEQ_LEN, _write_tiny_model

    result = export_llm(_write_tiny_model(tmp_path / "hf"), tmp_path / "tiny.pte", max_seq_len=MAX_SEQ_LEN,
                        max_prefill_len=MAX_PREFILL, **flags)
    _assert_nothing_loads_while_generating(result.pte_path, tmp_path / "hf" / "tokenizer.json")


@pytest.mark.reference
def test_executorchs_xnnpack_llm_program_leaves_no_compiled_step_to_load_while_generating(tmp_path):
    """The same of ExecuTorch's own 8da4w XNNPACK program (its prompt quantizes its rows, runs
    the many-row products, the sigmoid and the RMSNorm tail: each loaded at load now)."""
    from tests.et_llm import Q8DA4W, export_with_executorch, tokenizer_size, write_tokenizer

    tokenizer = write_tokenizer(tmp_path / "tokenizer.json")
    _assert_nothing_loads_while_generating(export_with_executorch(Q8DA4W, vocab_size=tokenizer_size(tokenizer)),
                                           tokenizer)
