"""`execupy run` runs an ExecuTorch-written XNNPACK program as a user would. And XnnpackBackend
on damaged payloads: a truncated payload or flipped bytes in its XNNGraph
flatbuffer give a typed execupy error naming the delegate (MalformedProgramError for
structure damage), never an IndexError or a crash; a program whose damage still decodes
either runs or fails with an ExecupyError.

The programs are ExecuTorch-written: its conformance cases (float and int8) where ../shared
is here, else small modules ExecuTorch's own XnnpackPartitioner lowers in the reference venv
(tests/test_xnnpack_nodes.py, cached). They are damaged with a seeded random generator so a
failure can be replayed from its seed and variant number.
"""
from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from execupy.backends.xnnpack import XnnpackBackend
from execupy.errors import ExecupyError, MalformedProgramError
from execupy.runtime import Program
from execupy.runtime.backends import BackendContext

from .conformance import cases, expected_outputs, load_inputs, mismatch

CASES = {c.name: c for c in cases("xnnpack", "quant_xnnpack")}
VARIANTS_PER_CASE = 60
SEED = 20261123


@dataclass
class XnnpackProgram:
    """An ExecuTorch-written XNNPACK program with one call's inputs and ExecuTorch's outputs."""

    pte: Path
    inputs: list
    expected: list
    atol: float = 1e-5
    rtol: float = 1e-5


def corpus_program(name: str) -> XnnpackProgram:
    case = CASES[name]
    run = case.manifest["runs"][0]
    tol = case.manifest["tolerance"]
    return XnnpackProgram(case.pte, load_inputs(case, run), expected_outputs(case, run), tol["atol"], tol["rtol"])


def lowered_program(name: str) -> XnnpackProgram:
    from .test_xnnpack_nodes import lowered_programs

    folder, report = lowered_programs()
    assert report[name] == "ok", report[name]
    data = np.load(folder / f"{name}.npz")
    count = lambda prefix: sum(k.startswith(prefix) for k in data.files)  # noqa: E731
    return XnnpackProgram(folder / f"{name}.pte", [data[f"in{i}"] for i in range(count("in"))],
                          [data[f"out{i}"] for i in range(count("out"))], atol=1e-4, rtol=1e-4)


if CASES:  # ExecuTorch's conformance corpus
    PROGRAM, FUZZ_CASES = corpus_program, ["xnnpack-linear", "xnnpack-conv_bn_relu_pool",
                                           "quant_xnnpack-small_cnn", "xnnpack-llama_block"]
    CLI_CASE, LINEAR_CASE, MARKS = "quant_xnnpack-mobilenet_v2_tiny", "xnnpack-linear", []
    CLAMPED_CASE = "quant_xnnpack-mobilenet_v2_tiny"
else:  # programs ExecuTorch's partitioner writes here, in the reference venv
    PROGRAM, FUZZ_CASES = lowered_program, ["fp16_conv_linear", "static_int8_pool", "dynamic_int8_linear",
                                            "conv_asymmetric"]
    CLI_CASE, LINEAR_CASE, MARKS = "static_int8_pool", "dynamic_int8_linear", [pytest.mark.reference]
    CLAMPED_CASE = "static_int8_depthwise_hardtanh"
pytestmark = MARKS


def test_a_clamp_after_an_int8_conv_is_the_convs_output_bounds_bit_for_bit(monkeypatch):
    """backends/xnnpack/fused.py: ExecuTorch's int8 graphs keep each ReLU6 as a Clamp node after
    its conv. The conv's step clamps in its own requantizing pass instead and the Clamp's step
    does nothing; the outputs are those of the nodes run one by one (EXECUPY_FUSION=0)."""
    program = PROGRAM(CLAMPED_CASE)
    method = Program.load(str(program.pte)).load_method("forward")
    fused = method.execute(program.inputs)
    steps = [(kind, step.__name__) for handle in method._delegate_handles.values()
             for kind, step in zip(handle.node_kinds, handle.steps)]
    clamps = [name for kind, name in steps if kind == "Clamp"]
    assert clamps and set(clamps) == {"NOTHING"}, steps
    monkeypatch.setenv("EXECUPY_FUSION", "0")
    plain = Program.load(str(program.pte)).load_method("forward").execute(program.inputs)
    for a, b in zip(fused, plain):
        np.testing.assert_array_equal(a, b)
    assert not mismatch(fused[0], program.expected[0], program.atol, program.rtol)


def test_execupy_run_cli_runs_an_int8_xnnpack_program_as_executorch_does(tmp_path):
    program = PROGRAM(CLI_CASE)
    np.savez(tmp_path / "in.npz", **{f"in{i}": x for i, x in enumerate(program.inputs)})
    proc = subprocess.run([sys.executable, "-m", "execupy", "run", str(program.pte), "--inputs",
                           str(tmp_path / "in.npz"), "--save", str(tmp_path / "out.npz")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (expected,) = program.expected
    assert mismatch(np.load(tmp_path / "out.npz")["out0"], expected, program.atol, program.rtol) is None


def _payload(xnnpack: XnnpackProgram) -> tuple[bytes, int, Program]:
    """The file's bytes and where its first XNNPACK payload starts in them."""
    data = xnnpack.pte.read_bytes()
    program = Program.load(data)
    delegate = program.plan("forward").delegates[0]
    payload = bytes(program.delegate_payload(delegate.processed))
    return data, data.find(payload), program


@pytest.mark.parametrize("name", FUZZ_CASES)
def test_truncated_payload_is_a_malformed_program_naming_the_delegate(name):
    data, start, program = _payload(PROGRAM(name))
    delegate = program.plan("forward").delegates[0]
    payload = program.delegate_payload(delegate.processed)
    context = BackendContext(program.named_data)
    rng = random.Random(SEED)
    cuts = sorted({0, 8, 31, 40, len(payload) // 2, len(payload) - 8} | {rng.randrange(len(payload)) for _ in range(20)})
    for cut in cuts:
        with pytest.raises(MalformedProgramError, match="XnnpackBackend"):
            XnnpackBackend().init(payload[:cut], [], context)


@pytest.mark.parametrize("name", FUZZ_CASES)
def test_flipped_flatbuffer_bytes_give_typed_errors_naming_the_delegate(name):
    xnnpack = PROGRAM(name)
    data, start, program = _payload(xnnpack)
    header = np.frombuffer(data, np.uint8, 18, start)
    fb_offset, fb_size = int(header[10:14].view("<u4")[0]), int(header[14:18].view("<u4")[0])
    inputs = xnnpack.inputs
    rng = random.Random(f"{SEED}:{name}")
    outcomes = {"ran": 0, "rejected at load": 0, "failed at run": 0}
    for variant in range(VARIANTS_PER_CASE):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[start + fb_offset + rng.randrange(fb_size)] ^= 1 << rng.randrange(8)
        try:
            method = Program.load(bytes(damaged)).load_method("forward")
        except ExecupyError as e:
            assert "XnnpackBackend" in str(e), f"variant {variant}: {type(e).__name__}: {e}"
            outcomes["rejected at load"] += 1
            continue
        try:
            method.execute(inputs)
            outcomes["ran"] += 1
        except ExecupyError:
            outcomes["failed at run"] += 1
    # Most flips land in structure (offsets, ids, tags), so most variants must be rejected.
    assert outcomes["rejected at load"] >= VARIANTS_PER_CASE // 4, outcomes


def test_both_schema_identifiers_load_and_a_wrong_one_is_named():
    data, start, program = _payload(PROGRAM(LINEAR_CASE))
    payload = bytearray(program.delegate_payload(program.plan("forward").delegates[0].processed))
    context = BackendContext(program.named_data)
    assert XnnpackBackend().init(bytes(payload), [], context).steps
    payload[32 + 4:32 + 8] = b"XN00"  # the identifier of the runtime-side schema copy is accepted too
    assert XnnpackBackend().init(bytes(payload), [], context).steps
    payload[32 + 4:32 + 8] = b"XX99"
    with pytest.raises(MalformedProgramError, match="XnnpackBackend.*identifier"):
        XnnpackBackend().init(bytes(payload), [], context)
