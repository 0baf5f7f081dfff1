"""write_pte round trips: every program ExecuTorch wrote reads back equal after we rewrite it,
runs the same in our runtime, and (marked `reference`) still runs in ExecuTorch's own runtime.
Our own exporter's programs (tests/programs.py) go through the same round trips, so the
writer is tested on a machine without ExecuTorch's corpus and samples too.

Besides plain rewrites, a few tests restructure a program before writing it (constants
re-packed at 64-byte alignment, legacy inline constants, delegate payloads moved between
inline data and segments) so that the writer is exercised on layouts the corpus lacks.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Callable

import numpy as np
import pytest

from execupy.runtime import Module
from execupy.schema import program as P
from execupy.schema import read_pte
from execupy.schema.reader import PteFile
from execupy.schema.writer import layout_segments, pack_constants, pack_mutable_data, write_pte

from .conformance import (SAMPLES, Case, cases, expected_outputs, flatten, load_inputs, mismatch, named,
                          program_name, samples, with_sample)
from .reference import run_reference

PROGRAMS = samples() + cases()  # each has .name and .pte
RUNNABLE = cases("portable", "quant_portable", "execupy", "execupy_delegated")


def segments_of(pte: PteFile) -> list[memoryview]:
    return [pte.segment(i) for i in range(len(pte.program.segments))]


def rewrite(data: bytes) -> bytes:
    pte = read_pte(data)
    return write_pte(pte.program, segments_of(pte))


# ---------------------------------------------------------------------------- restructuring helpers


def tensor_nbytes(t: P.Tensor) -> int:
    return int(np.prod(t.sizes, dtype=np.int64)) * P.numpy_dtype(t.scalar_type).itemsize


def all_tensors(program: P.Program) -> list[P.Tensor]:
    return [v for plan in program.execution_plan for v in plan.values if isinstance(v, P.Tensor)]


def constant_entries(pte: PteFile) -> list[bytes]:
    """The constant list without its placeholder, each entry exactly as long as its tensor."""
    seg = pte.program.constant_segment
    sizes = {t.data_buffer_idx: tensor_nbytes(t) for t in all_tensors(pte.program)
             if t.data_buffer_idx and t.allocation_info is None}
    assert set(sizes) == set(range(1, len(seg.offsets))), "every constant entry is used by a tensor"
    data = pte.segment(seg.segment_index)
    return [bytes(data[seg.offsets[k]: seg.offsets[k] + sizes[k]]) for k in range(1, len(seg.offsets))]


def mutable_entries(pte: PteFile) -> list[bytes]:
    (seg,) = pte.program.mutable_data_segments
    sizes = {t.data_buffer_idx: tensor_nbytes(t) for t in all_tensors(pte.program)
             if t.data_buffer_idx and t.allocation_info is not None}
    data = pte.segment(seg.segment_index)
    return [bytes(data[seg.offsets[k]: seg.offsets[k] + sizes[k]]) for k in range(1, len(seg.offsets))]


def repack_constants(data: bytes, alignment: int = 64) -> bytes:
    """Rewrite with the constant segment re-packed at `alignment` (docs/format.md §6, §4)."""
    pte = read_pte(data)
    program, segments = pte.program, segments_of(pte)
    packed, offsets = pack_constants(constant_entries(pte), alignment)
    program.constant_segment.offsets = offsets
    segments[program.constant_segment.segment_index] = packed
    return write_pte(program, segments, constant_tensor_alignment=alignment)


def inline_constants(data: bytes) -> bytes:
    """Rewrite with constants in the legacy inline `constant_buffer` and an empty constant segment."""
    pte = read_pte(data)
    program, segments = pte.program, segments_of(pte)
    program.constant_buffer = [b""] + constant_entries(pte)
    segments[program.constant_segment.segment_index] = b""
    program.constant_segment.offsets = [0]
    return write_pte(program, segments)


def drop_segments(program: P.Program, segments: list, dropped: set[int]) -> list:
    """Remove segments and renumber every reference to the ones that remain."""
    kept = [i for i in range(len(segments)) if i not in dropped]
    new_index = {old: new for new, old in enumerate(kept)}
    subsegments = [program.constant_segment] + list(program.mutable_data_segments or [])
    for ref in [s for s in subsegments if s is not None] + list(program.named_data or []):
        ref.segment_index = new_index[ref.segment_index]
    for d in delegates(program):
        if d.processed.location == P.DataLocation.SEGMENT:
            d.processed.index = new_index[d.processed.index]
    return [segments[i] for i in kept]


def delegates(program: P.Program) -> list[P.BackendDelegate]:
    return [d for plan in program.execution_plan for d in plan.delegates]


def inline_delegates(data: bytes) -> bytes:
    """Rewrite with every delegate payload inline, as with extract_delegate_segments=False (docs/format.md §8)."""
    pte = read_pte(data)
    program, segments = pte.program, segments_of(pte)
    moved = set()
    for d in delegates(program):
        if d.processed.location == P.DataLocation.SEGMENT:
            moved.add(d.processed.index)
            program.backend_delegate_data.append(segments[d.processed.index])
            d.processed = P.BackendDelegateDataReference(P.DataLocation.INLINE, len(program.backend_delegate_data) - 1)
    assert moved, "the program has delegate segments"
    return write_pte(program, drop_segments(program, segments, moved))


def extract_delegates(data: bytes) -> bytes:
    """Rewrite with every inline delegate payload moved to a segment of its own."""
    pte = read_pte(data)
    program, segments = pte.program, segments_of(pte)
    inline = program.backend_delegate_data
    assert any(len(p) for p in inline), "the program has inline delegate payloads"
    for d in delegates(program):
        assert d.processed.location == P.DataLocation.INLINE and len(inline[d.processed.index])
        segments.append(inline[d.processed.index])
        d.processed = P.BackendDelegateDataReference(P.DataLocation.SEGMENT, len(segments) - 1)
    program.backend_delegate_data = []
    return write_pte(program, segments)


def delegate_payloads(data: bytes) -> list[bytes]:
    pte = read_pte(data)
    return [bytes(pte.program.backend_delegate_data[d.processed.index] if d.processed.location == P.DataLocation.INLINE
                  else pte.segment(d.processed.index)) for d in delegates(pte.program)]


# ---------------------------------------------------------------------------- format round trip


@pytest.mark.parametrize("program", PROGRAMS, ids=program_name)
def test_rewritten_program_reads_back_equal(program):
    data = program.pte.read_bytes()
    original = read_pte(data)
    again = read_pte(rewrite(data))
    assert again.program == original.program
    assert [bytes(s) for s in segments_of(again)] == [bytes(s) for s in segments_of(original)]


@pytest.mark.parametrize("program", PROGRAMS, ids=program_name)
def test_rewrite_is_byte_identical_to_the_original(program):
    # Not required by the format (docs/format.md §3), but our builder happens to emit fields and
    # padding in the reference order; a change here deserves a look. On our own
    # programs: the writer reproduces its own output exactly.
    data = program.pte.read_bytes()
    assert rewrite(data) == data


@pytest.mark.parametrize("program", PROGRAMS, ids=program_name)
def test_pack_constants_reproduces_the_constant_segment(program):
    pte = read_pte(program.pte.read_bytes())
    seg = pte.program.constant_segment
    packed, offsets = pack_constants(constant_entries(pte))
    assert offsets == seg.offsets
    assert packed == bytes(pte.segment(seg.segment_index))


def test_pack_mutable_data_reproduces_the_mutable_segment():
    with_state = [p for p in PROGRAMS if read_pte(p.pte.read_bytes()).program.mutable_data_segments]
    # (Our state_kv_cache starts all zeros, so it has no mutable data: planned memory starts zeroed.)
    expected = {"execupy-state_counter_initialized"}
    if SAMPLES.exists():
        expected |= {"mutable_init", "portable-state_counter_initialized"}
    assert expected <= {p.name for p in with_state}
    for program in with_state:
        pte = read_pte(program.pte.read_bytes())
        (seg,) = pte.program.mutable_data_segments
        packed, offsets = pack_mutable_data(mutable_entries(pte))
        assert offsets == seg.offsets
        assert packed == bytes(pte.segment(seg.segment_index))


def test_pack_constants_pads_only_between_entries():
    # The big_constant sample, packed per docs/format.md §6: 256x256 f32, 256 f32, 3 x i64, one i64.
    blobs = [bytes(262144), bytes(1024), bytes(range(24)), bytes(range(8))]
    packed, offsets = pack_constants(blobs)
    assert offsets == [0, 0, 262144, 263168, 263200]
    assert len(packed) == 263208
    assert packed[263168:263192] == blobs[2] and packed[263192:263200] == bytes(8)
    assert pack_constants([]) == (b"", [0])
    assert pack_mutable_data([b"abc", b"de"]) == (b"abcde", [0, 0, 3])


def test_segments_are_placed_at_aligned_offsets():
    segments, blob = layout_segments([b"", b"x" * 1312, b"y" * 5, b"z"])
    assert [(s.offset, s.size) for s in segments] == [(0, 0), (0, 1312), (1408, 5), (1536, 1)]
    assert len(blob) == 1537 and blob[1312:1408] == bytes(96)


DELEGATED = with_sample("xnnpack", "execupy-mixed_partition")


@pytest.mark.parametrize("program", DELEGATED, ids=program_name)
def test_segment_table_is_recomputed_from_the_data(program):
    pte = read_pte(program.pte.read_bytes())
    program, segments = pte.program, segments_of(pte)
    expected = list(program.segments)
    program.segments = [P.DataSegment(offset=999, size=1)]
    data = write_pte(program, segments)
    assert read_pte(data).program.segments == expected
    assert program.segments == [P.DataSegment(offset=999, size=1)], "the input program is left alone"


@pytest.mark.parametrize("program", with_sample("ops_args", "execupy-nested_outputs"), ids=program_name)
def test_no_extended_header_without_segment_bytes(program):
    # No constants: segments=[{0, 0}] and no eh00 (docs/format.md §4).
    data = rewrite(program.pte.read_bytes())
    assert data[4:8] == b"ET12" and data[8:12] != b"eh00"
    assert read_pte(data).program.segments == [P.DataSegment(0, 0)]


@pytest.mark.parametrize("program", with_sample("linear_relu", "execupy-linear_relu"), ids=program_name)
def test_64_byte_alignment_pads_header_and_constants(program):
    original = program.pte.read_bytes()
    data = repack_constants(original, 64)
    assert data[8:16] == b"eh00" + (32).to_bytes(4, "little")
    assert int.from_bytes(data[0:4], "little") == int.from_bytes(original[0:4], "little") + 32
    pte = read_pte(data)
    assert all(off % 64 == 0 for off in pte.program.constant_segment.offsets)
    assert pte.header.segment_base_offset % 128 == 0
    assert constant_entries(pte) == constant_entries(read_pte(original))


@pytest.mark.parametrize("program", with_sample("big_constant", "execupy-big_constant"), ids=program_name)
def test_inline_constant_buffers_are_force_aligned(program):
    data = inline_constants(program.pte.read_bytes())
    pte = read_pte(data)
    buffers = pte.program.constant_buffer
    assert len(buffers) == 5 and len(buffers[1]) == 262144
    base = np.frombuffer(data, np.uint8).ctypes.data
    assert all((np.frombuffer(b, np.uint8).ctypes.data - base) % 16 == 0 for b in buffers if len(b))


@pytest.mark.parametrize("program", DELEGATED, ids=program_name)
def test_delegate_payloads_survive_moving_inline_and_back(program):
    original = program.pte.read_bytes()
    inlined = inline_delegates(original)
    before = read_pte(original).program
    assert len(read_pte(inlined).program.segments) == len(before.segments) - len(delegates(before))
    assert delegate_payloads(inlined) == delegate_payloads(original)
    extracted = extract_delegates(inlined)
    assert read_pte(extracted).program.backend_delegate_data == []
    assert delegate_payloads(extracted) == delegate_payloads(original)


def test_importing_the_schema_does_not_import_flatbuffers():
    code = "import sys, execupy.schema; assert 'flatbuffers' not in sys.modules, 'flatbuffers imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------- our runtime


def run_all(case: Case, pte: bytes) -> list[list[np.ndarray]]:
    """Every run of the case in manifest order (sessions share a Module); outputs copied."""
    modules: dict[int, Module] = {}
    results = []
    for run in case.manifest["runs"]:
        module = modules.setdefault(run["session"], Module(pte))
        outputs = flatten(module.run_method(run["method"], *load_inputs(case, run)))
        results.append([np.array(o, copy=True) for o in outputs])
    return results


def assert_identical(actual: list[list[np.ndarray]], expected: list[list[np.ndarray]]) -> None:
    assert len(actual) == len(expected)
    for r, (outs, exps) in enumerate(zip(actual, expected)):
        assert len(outs) == len(exps), f"run {r}: {len(outs)} outputs, expected {len(exps)}"
        for k, (a, e) in enumerate(zip(outs, exps)):
            assert (a.dtype, a.shape) == (e.dtype, e.shape), f"run {r} output {k}"
            assert a.tobytes() == e.tobytes(), f"run {r} output {k}: values differ"


REWRITES: dict[str, Callable[[bytes], bytes]] = {
    "plain": rewrite,
    "constants64": repack_constants,
    "inline_constants": inline_constants,
}


@pytest.mark.parametrize("how", REWRITES)
@pytest.mark.parametrize("case", RUNNABLE, ids=program_name)
def test_rewritten_program_runs_like_the_original(case, how):
    original = case.pte.read_bytes()
    try:
        expected = run_all(case, original)
    except Exception as e:  # kernels still missing: this test cannot say anything yet
        pytest.skip(f"the original program fails in our runtime too: {type(e).__name__}: {e}")
    assert_identical(run_all(case, REWRITES[how](original)), expected)


# ---------------------------------------------------------------------------- ExecuTorch's runtime

# (case, how the file is rewritten): each covers a program feature the writer must keep.
# Not here, because reference_run.py cannot run them even unchanged: quant_portable cases
# (its pybindings lack the quantized_decomposed kernels) and portable-cond_pred_input (it
# turns the 0-dim predicate input into shape [1]); cond is covered by the sample below.
REFERENCE_CASES = {
    "portable-state_kv_cache": rewrite,                # stateful, index_put into mutable buffers
    "portable-state_counter_initialized": rewrite,     # serialized initial state (mutable segment)
    "portable-multi_method": rewrite,                  # several execution plans
    "portable-dynamic_batch_seq": rewrite,             # dynamic shapes (upper bounds)
    "quant_xnnpack-conv2d_relu": rewrite,              # quantized XNNPACK payload + named data
    "portable-bfloat16_compute": rewrite,              # bf16 tensors
    "portable-llama_block": repack_constants,          # 64-byte aligned constants, 64-byte header
    "xnnpack-mixed_partition": inline_delegates,       # payload moved inline
    "xnnpack-inline_delegate_data": extract_delegates,  # inline payload moved to a segment
    # The same features in programs our exporter writes (here with or without ../shared):
    "execupy-state_kv_cache": rewrite,
    "execupy-state_counter_initialized": rewrite,
    "execupy-multi_method": rewrite,
    "execupy-dynamic_batch_seq": rewrite,
    "execupy-bfloat16_linear": rewrite,
    "execupy-big_constant": repack_constants,
    "execupy-cond": rewrite,                           # jumps and moves
}


def reference_calls(case: Case) -> list[list[dict]]:
    """Runs the reference tool can replay, grouped into calls of one loaded program.

    One call per method; a call also covers the runs right after it that repeat the same
    method with the same inputs in the same session (`--calls N`). In a stateful session a
    run after a *different* call depends on state a fresh load cannot rebuild, so the
    rest of that session is left out.
    """
    calls: list[list[dict]] = []
    seen_methods, diverged = set(), set()
    stateful = case.manifest.get("stateful", False)
    for run in case.manifest["runs"]:
        prev = calls[-1][-1] if calls else None
        if run["session"] in diverged:
            continue
        if prev and (prev["session"], prev["method"]) == (run["session"], run["method"]) \
                and same_inputs(case, prev, run):
            calls[-1].append(run)
        elif stateful and prev and prev["session"] == run["session"]:
            diverged.add(run["session"])
        elif run["method"] not in seen_methods:
            seen_methods.add(run["method"])
            calls.append([run])
    return calls


def same_inputs(case: Case, a: dict, b: dict) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(load_inputs(case, a), load_inputs(case, b), strict=True))


@pytest.mark.reference
@pytest.mark.parametrize("case", named(*REFERENCE_CASES), ids=program_name)
def test_rewritten_program_runs_in_reference_runtime(case, tmp_path):
    tol = case.manifest["tolerance"]
    pte = tmp_path / "model.pte"
    pte.write_bytes(REFERENCE_CASES[case.name](case.pte.read_bytes()))
    calls = reference_calls(case)
    assert calls[0][0]["id"] == "main", "the main run is always checked"
    for runs in calls:
        results = run_reference(pte, load_inputs(case, runs[0]), runs[0]["method"], calls=len(runs))
        for run, actual in zip(runs, results, strict=True):
            expected = expected_outputs(case, run)
            assert len(actual) == len(expected), f"run {run['id']}: {len(actual)} outputs, expected {len(expected)}"
            for k, (a, e) in enumerate(zip(actual, expected)):
                problem = mismatch(a, e, tol["atol"], tol["rtol"])
                assert problem is None, f"run {run['id']} output {k}: {problem}"


@pytest.mark.reference
@pytest.mark.parametrize("program", with_sample("cond", "execupy-cond"), ids=program_name)
def test_rewritten_cond_program_runs_like_the_original_in_reference_runtime(program, tmp_path):
    # torch.cond, so both sides run through JumpFalseCall and MoveCall; re-packed constants make
    # the file differ from the original. ExecuTorch's samples/cond.pte takes a float predicate.
    rewritten = tmp_path / "cond.pte"
    rewritten.write_bytes(repack_constants(program.pte.read_bytes()))
    if isinstance(program, Case):
        inputs = load_inputs(program, program.manifest["runs"][0])
    else:
        rng = np.random.default_rng(0)
        inputs = [np.array([-1.0], np.float32), rng.standard_normal(3).astype(np.float32)]
    assert_identical(run_reference(rewritten, inputs), run_reference(program.pte, inputs))
