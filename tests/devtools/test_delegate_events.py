"""An XNNPACK delegate reports its nodes through the method's EventTracer: one delegate event
per node (named for its kind, with its node index as the delegate debug id), inside the
DELEGATE_CALL that ran it, in the ETDump and in the Inspector's table.

The programs are ExecuTorch-written XNNPACK programs (the conformance corpus, or programs
ExecuTorch's partitioner lowers in the reference venv when the corpus is absent)."""
import json

import numpy as np
import pytest

from execupy.backends.xnnpack.schema import read_payload
from execupy.devtools.etdump import read_etdump, write_etdump
from execupy.devtools.inspector import Inspector
from execupy.devtools.tracer import EventTracer
from execupy.runtime import Module, Program
from execupy.schema import program as P

from .test_etdump import reference
from ..test_xnnpack_backend import CLI_CASE, LINEAR_CASE, MARKS, PROGRAM

pytestmark = MARKS


def delegate_nodes(pte) -> dict[int, list[str]]:
    """Instruction id of each XNNPACK delegate call -> the kinds of its payload's nodes, in order."""
    program = Program.load(pte)
    plan = program.program.execution_plan[0]
    nodes = {}
    for pc, ins in enumerate(plan.instructions):
        if isinstance(ins, P.DelegateCall):
            payload = program.delegate_payload(plan.delegates[ins.delegate_index].processed)
            nodes[pc] = [n.kind for n in read_payload(payload).nodes]
    return nodes


@pytest.mark.parametrize("name", [LINEAR_CASE, CLI_CASE])
def test_xnnpack_nodes_appear_as_delegate_events_of_their_call(name):
    case = PROGRAM(name)
    tracer = EventTracer()
    traced = Module(case.pte, event_tracer=tracer).forward(*case.inputs)
    plain = Module(case.pte).forward(*case.inputs)
    for got, want in zip(traced if isinstance(traced, (list, tuple)) else [traced],
                         plain if isinstance(plain, (list, tuple)) else [plain]):
        np.testing.assert_array_equal(got, want)  # tracing changes nothing the program computes

    expected = delegate_nodes(case.pte)
    assert expected and sum(map(len, expected.values())) >= 1
    events = read_etdump(write_etdump(tracer.etdump())).profile_events("Execute")
    calls = {p.instruction_id: p for p in events if p.name == "DELEGATE_CALL"}
    assert sorted(calls) == sorted(expected)
    for pc, kinds in expected.items():
        inner = [p for p in events if p.instruction_id == pc and p.delegate_debug_id_int != -1]
        assert [p.name for p in inner] == kinds
        assert [p.delegate_debug_id_int for p in inner] == list(range(len(kinds)))
        call = calls[pc]
        assert all(call.start_time <= p.start_time <= p.end_time <= call.end_time for p in inner)

    rows = Inspector(write_etdump(tracer.etdump())).operator_table()
    node_calls = {}
    for kinds in expected.values():
        for kind in kinds:
            node_calls[kind] = node_calls.get(kind, 0) + 1
    assert {r.op: r.count for r in rows if r.op in node_calls} == node_calls
    assert "DELEGATE_CALL" not in {r.op for r in rows}  # its nodes stand for it


_ET_INSPECTOR = r"""
import json, sys
from executorch.devtools import Inspector
inspector = Inspector(etdump_path=sys.argv[1])
print("DELEGATED " + json.dumps([e.perf_data.raw[0] for b in inspector.event_blocks if b.name == "Execute"
                                 for e in b.events if e.is_delegated_op]))
"""


@pytest.mark.reference
def test_executorchs_inspector_lists_the_nodes_as_delegated_operators(tmp_path):
    case = PROGRAM(CLI_CASE)
    tracer = EventTracer()
    Module(case.pte, event_tracer=tracer).forward(*case.inputs)
    tracer.save(tmp_path / "x.etdp")
    out = reference(_ET_INSPECTOR, tmp_path / "x.etdp")
    times = json.loads(next(ln for ln in out.splitlines() if ln.startswith("DELEGATED "))[len("DELEGATED "):])
    assert len(times) == sum(map(len, delegate_nodes(case.pte).values()))
    assert all(t >= 0 for t in times) and sum(times) > 0
