"""ETDump traces: our runtime writes them, ExecuTorch's Inspector reads them, and our reader
reads the ones ExecuTorch's runtime writes.

The program is the example shipped in the package (written by our exporter; it runs in both
runtimes): layer_norm, linear, relu, linear, softmax. Expected operator names come from the
program's own plan, expected tensors from running it untraced.
"""
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from execupy.devtools.etdump import (
    ETDump,
    Event,
    ProfileEvent,
    RunData,
    debug_tensor,
    read_etdump,
    write_etdump,
)
from execupy.devtools.tracer import EventTracer, profile_name
from execupy.errors import MalformedETDumpError
from execupy.runtime import Module, Program
from execupy.runtime.backends import BACKENDS, register_backend
from execupy.schema import program as P
from execupy.schema.reader import read_pte

from ..conformance import load_inputs, program_name, topic
from ..reference import TIMEOUT_S, reference_python

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "execupy" / "examples" / "mlp.pte"


def mlp_input(seed: int = 0) -> np.ndarray:
    shape = Program.load(MLP).method_meta("forward").inputs[0].shape
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def kernel_names(pte: Path) -> list[str]:
    """The event name of every kernel the plan runs, in order, from the plan itself."""
    plan = read_pte(pte.read_bytes()).program.execution_plan[0]
    return [profile_name(plan.operators[ins.op_index].key) for ins in plan.instructions
            if isinstance(ins, P.KernelCall)]


def traced_run(tmp_path: Path, calls: int = 1) -> tuple[Path, Path, list]:
    """Run the example through the CLI with a trace and a debug buffer."""
    etdp, buf, inputs = tmp_path / "trace.etdp", tmp_path / "trace.bin", tmp_path / "in.npz"
    np.savez(inputs, in0=mlp_input())
    proc = subprocess.run([sys.executable, "-m", "execupy", "run", str(MLP), "--inputs", str(inputs),
                           "--repeat", str(calls), "--save", str(tmp_path / "out.npz"),
                           "--etdump", str(etdp), "--debug-buffer", str(buf)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"trace written to {etdp}" in proc.stdout
    return etdp, buf, [np.load(tmp_path / "out.npz")["out0"]]


# ---------------------------------------------------------------------------- our writer, our reader


def test_cli_trace_lists_every_kernel_with_times_and_outputs(tmp_path):
    etdp, buf, (output,) = traced_run(tmp_path, calls=2)
    dump = read_etdump(etdp)
    assert [r.name for r in dump.run_data] == ["Default", "Execute", "Execute"]
    assert [p.name for p in dump.profile_events("Default")] == ["Method::init", "Program::load_method"]
    for run in dump.run_data[1:]:
        events = [e.profile_event for e in run.events if e.profile_event]
        ops = [p for p in events if p.name.startswith("native_call_")]
        assert [p.name for p in ops] == kernel_names(MLP)
        assert [p.instruction_id for p in ops] == list(range(len(ops)))
        whole = events[-1]
        assert whole.name == "Method::execute"
        for p in ops:  # every kernel ran inside the call, one after the other
            assert whole.start_time <= p.start_time <= p.end_time <= whole.end_time
        assert all(a.end_time <= b.start_time for a, b in zip(ops, ops[1:]))
        # the method output, logged last, is what the run printed and saved
        out = [e.debug_event for e in run.events if e.debug_event][-1]
        assert out.debug_entry.output is True
        np.testing.assert_array_equal(debug_tensor(buf.read_bytes(), out.debug_entry.tensor), output)


def test_round_trip_keeps_events_and_intermediate_outputs(tmp_path):
    tracer = EventTracer(log_intermediate_outputs=True)
    module = Module(MLP, event_tracer=tracer)
    x = mlp_input(1)
    y = module.forward(x)
    tracer.save(tmp_path / "t.etdp", tmp_path / "t.bin")
    dump = read_etdump(tmp_path / "t.etdp")
    assert dump == tracer.etdump()  # every field survives the file
    assert write_etdump(dump) == (tmp_path / "t.etdp").read_bytes()

    buffer = (tmp_path / "t.bin").read_bytes()
    by_instruction: dict[int, list[np.ndarray]] = {}
    for d in dump.debug_events("Execute"):
        if not d.debug_entry.output:
            by_instruction.setdefault(d.instruction_id, []).append(debug_tensor(buffer, d.debug_entry.tensor))
    # layer_norm logs its three results, every other kernel one
    assert [len(v) for _, v in sorted(by_instruction.items())] == [3, 1, 1, 1, 1, 1, 1]
    normed, mean, _ = by_instruction[0]
    np.testing.assert_allclose(mean.reshape(-1), x.mean(axis=-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.maximum(by_instruction[2][0], 0), by_instruction[3][0])  # relu of the linear
    np.testing.assert_array_equal(by_instruction[6][0], y)  # softmax is the output
    assert normed.shape == x.shape


def test_hand_made_dump_with_every_value_kind_round_trips():
    from execupy.devtools.etdump import AllocationEvent, DebugEvent, TensorRef, Value

    t = TensorRef(scalar_type=6, sizes=[2, 3], strides=[3, 1], offset=128)
    values = [Value("Tensor", tensor=t), Value("TensorList", tensor_list=[t, t]), Value("Int", int_value=-7),
              Value("Bool", bool_value=True), Value("Float", float_value=0.5), Value("Double", double_value=-2.25),
              Value("Null", output=True)]
    dump = ETDump(run_data=[RunData(name="Execute", bundled_input_index=3, allocators=["planned", "temp"], events=[
        Event(profile_event=ProfileEvent("DELEGATE_CALL", 0, 4, 17, "conv#1", b"\x01\x02", 10, 2**63 + 5)),
        Event(allocation_event=AllocationEvent(1, 4096)),
        *[Event(debug_event=DebugEvent(chain_index=2**64 - 1, instruction_id=k, debug_entry=v, name=f"v{k}"))
          for k, v in enumerate(values)],
    ])])
    assert read_etdump(write_etdump(dump)) == dump


# ---------------------------------------------------------------------------- delegates


class RecordingRelu:
    """A test backend running relu that reports one delegate event per call, keyed by a debug id."""

    def __init__(self, tracer: EventTracer):
        self.tracer = tracer

    def is_available(self) -> bool:
        return True

    def init(self, processed, compile_specs, context):
        return bytes(processed).decode()

    def execute(self, debug_id, args):
        from execupy.devtools.tracer import now_ns

        start = now_ns()
        result = np.maximum(args[0], 0)
        self.tracer.log_delegate_event(debug_id, start, now_ns(), metadata=b"relu")
        return [result]


def test_delegate_calls_and_their_events_carry_the_debug_ids(tmp_path):
    from execupy.schema.writer import write_pte  # export-side: needs the flatbuffers package

    original = read_pte(MLP.read_bytes())
    program, plan = original.program, original.program.execution_plan[0]
    relu_at = next(k for k, ins in enumerate(plan.instructions)
                   if isinstance(ins, P.KernelCall) and plan.operators[ins.op_index].key == "aten::relu.out")
    relu = plan.instructions[relu_at]
    instructions = list(plan.instructions)
    instructions[relu_at] = P.DelegateCall(0, [relu.args[0], relu.args[-1]])
    plan = dataclasses.replace(
        plan, chains=[dataclasses.replace(plan.chains[0], instructions=instructions)],
        delegates=[P.BackendDelegate("EtdumpTestRelu", P.BackendDelegateDataReference(0, 0), [])])
    pte = write_pte(dataclasses.replace(program, execution_plan=[plan], backend_delegate_data=[b"relu-7"]),
                    [original.segment(i) for i in range(len(program.segments))])

    tracer = EventTracer()
    register_backend("EtdumpTestRelu", RecordingRelu(tracer))
    try:
        y = Module(pte, event_tracer=tracer).forward(mlp_input())
    finally:
        BACKENDS.pop("EtdumpTestRelu")
    np.testing.assert_allclose(y, Module(MLP).forward(mlp_input()), rtol=1e-6)
    events = read_etdump(write_etdump(tracer.etdump())).profile_events("Execute")
    names = [p.name for p in events]
    assert names.count("DELEGATE_CALL") == 1 and "native_call_relu.out" not in names
    inner, call = events[names.index("DELEGATE_CALL") - 1], events[names.index("DELEGATE_CALL")]
    assert (inner.delegate_debug_id_str, inner.delegate_debug_metadata, inner.instruction_id) == ("relu-7", b"relu", relu_at)
    assert call.instruction_id == relu_at and call.start_time <= inner.start_time <= inner.end_time <= call.end_time


# ---------------------------------------------------------------------------- tracing off


def test_untraced_methods_run_exactly_the_steps_they_always_did():
    plain = Program.load(MLP).load_method("forward", fuse=False)  # a traced method is never fused
    tracer = EventTracer()
    traced = Program.load(MLP).load_method("forward", event_tracer=tracer)
    # without a tracer: the binder's own closures and the class's execute, no wrapper anywhere
    assert "execute" not in vars(plain)
    assert all(not hasattr(step, "__wrapped__") and step.__module__ == "execupy.runtime.method" for step in plain._steps)
    # with one: the very same kinds of closure, each inside a timed wrapper
    assert [s.__wrapped__.__qualname__ for s in traced._steps] == [s.__qualname__ for s in plain._steps]
    assert [p.name for p in tracer.etdump().profile_events()] == ["Method::init", "Program::load_method"]


# ---------------------------------------------------------------------------- malformed input


def test_damaged_traces_raise_a_typed_error(tmp_path):
    etdp, _, _ = traced_run(tmp_path)
    good = etdp.read_bytes()
    with pytest.raises(MalformedETDumpError, match="identifier"):
        read_etdump(good[:8] + b"ET12" + good[12:])
    with pytest.raises(MalformedETDumpError, match="size prefix"):
        read_etdump(good[:-16])
    rng, rejected = random.Random(0), 0
    for _ in range(400):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(12, len(data) - 4)
            data[at:at + 4] = rng.randbytes(4)
        try:
            read_etdump(bytes(data))
        except MalformedETDumpError:
            rejected += 1
    assert rejected > 0  # some damage is caught; none of it escapes as another exception
    bad_ref = dataclasses.replace(read_etdump(good).debug_events()[0].debug_entry.tensor, offset=10**9)
    with pytest.raises(MalformedETDumpError, match="outside the debug buffer"):
        debug_tensor(b"\0" * 64, bad_ref)


# ---------------------------------------------------------------------------- ExecuTorch's tools

_INSPECTOR = r"""
import json, sys
from executorch.devtools import Inspector
inspector = Inspector(etdump_path=sys.argv[1], debug_buffer_path=sys.argv[2])
print(json.dumps([{"block": b.name, "name": e.name, "raw": list(e.perf_data.raw) if e.perf_data else [],
                   "debug_shapes": [list(t.shape) for t in (e.debug_data or [])]}
                  for b in inspector.event_blocks for e in b.events]))
"""

_RUN_WITH_ETDUMP = r"""
import sys, numpy as np, torch
from executorch.extension.pybindings.portable_lib import _load_for_executorch
module = _load_for_executorch(sys.argv[1], enable_etdump=True, debug_buffer_size=1 << 20)
data = np.load(sys.argv[2])
out = module.run_method("forward", tuple(torch.from_numpy(data[f"in{i}"]) for i in range(len(data.files))))
module.write_etdump_result_to_file(sys.argv[3], sys.argv[4])
np.save(sys.argv[5], out[0].numpy())
"""


def reference(script: str, *args) -> str:
    proc = subprocess.run([str(reference_python()), "-c", script, *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.reference
def test_executorch_inspector_reads_our_trace(tmp_path):
    etdp, buf, _ = traced_run(tmp_path)
    rows = json.loads(reference(_INSPECTOR, etdp, buf).strip().splitlines()[-1])
    execute = [r for r in rows if r["block"] == "Execute"]
    assert [r["name"] for r in execute if r["name"].startswith("native_call_")] == kernel_names(MLP)
    total = next(r for r in execute if r["name"] == "Method::execute")["raw"][0]
    kernels = [r["raw"][0] for r in execute if r["name"].startswith("native_call_")]
    assert all(0 < t for t in kernels) and sum(kernels) <= total < 10_000  # ms: plausible, nested
    # it attached our intermediate outputs to the kernels: layer_norm's three, then one each
    shapes = [r["debug_shapes"] for r in execute if r["name"].startswith("native_call_")]
    assert [len(s) for s in shapes] == [3, 1, 1, 1, 1, 1, 1] and shapes[-1] == [[4, 10]]


@pytest.mark.reference
def test_we_read_the_trace_executorchs_runtime_writes(tmp_path):
    np.savez(tmp_path / "in.npz", in0=mlp_input())
    etdp, buf = tmp_path / "ref.etdp", tmp_path / "ref.bin"
    reference(_RUN_WITH_ETDUMP, MLP, tmp_path / "in.npz", etdp, buf, tmp_path / "out.npy")
    theirs = read_etdump(etdp)

    tracer = EventTracer()
    Module(MLP, event_tracer=tracer).forward(mlp_input())
    ours = tracer.etdump()
    names = lambda d: [p.name for p in d.profile_events("Execute")]  # noqa: E731
    assert names(theirs) == names(ours)
    assert [p.name for p in theirs.profile_events("Default")] == [p.name for p in ours.profile_events("Default")]
    assert all(p.start_time <= p.end_time for p in theirs.profile_events())
    # their method output, read from their debug buffer, is the output they returned
    out = theirs.debug_events("Execute")[-1]
    assert out.debug_entry.output is True
    np.testing.assert_array_equal(debug_tensor(buf.read_bytes(), out.debug_entry.tensor), np.load(tmp_path / "out.npy"))


@pytest.mark.reference
@pytest.mark.parametrize("case", topic("cond_pred_input") + topic("cond") + topic("dynamic_batch_seq"),
                         ids=program_name)
def test_jumps_moves_and_prim_ops_are_named_as_executorch_names_them(case, tmp_path):
    """Programs with control flow (JF_CALL, MOVE_CALL) and dynamic shapes (sym_size, which
    ExecuTorch runs as a prim op: OPERATOR_CALL alone) from ExecuTorch's exporter and ours."""
    inputs = load_inputs(case, case.manifest["runs"][0])
    np.savez(tmp_path / "in.npz", **{f"in{i}": np.asarray(x) for i, x in enumerate(inputs)})
    reference(_RUN_WITH_ETDUMP, case.pte, tmp_path / "in.npz", tmp_path / "ref.etdp", tmp_path / "ref.bin",
              tmp_path / "out.npy")
    tracer = EventTracer()
    Module(case.pte, event_tracer=tracer).forward(*inputs)
    names = lambda d: [p.name for p in d.profile_events("Execute")]  # noqa: E731
    theirs = names(read_etdump(tmp_path / "ref.etdp"))
    assert names(tracer.etdump()) == theirs
    assert {"JF_CALL", "MOVE_CALL"} <= set(theirs) or theirs.count("OPERATOR_CALL") > sum(
        n.startswith("native_call_") for n in theirs)
