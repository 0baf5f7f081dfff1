"""How the Inspector groups a trace, on hand-made ETDumps (no torch, no program): runs that took
different branches, the timeline of one run, and what it says about traces it cannot use."""
import pytest

from execupy.devtools.etdump import ETDump, Event, ProfileEvent, RunData, write_etdump
from execupy.devtools.inspector import Inspector
from execupy.errors import InvalidInputError, MalformedETDumpError

MS = 1_000_000  # ns


def run(*events: tuple) -> RunData:
    """An Execute run of (name, instruction, start ms, end ms) events, then Method::execute."""
    profiled = [Event(profile_event=ProfileEvent(name, 0, pc, start_time=start * MS, end_time=end * MS))
                for name, pc, start, end in events]
    whole = ProfileEvent("Method::execute", 0, 0, start_time=events[0][2] * MS, end_time=events[-1][3] * MS)
    return RunData("Execute", events=[*profiled, Event(profile_event=whole)])


def test_runs_that_took_other_branches_group_by_instruction():
    dump = ETDump(run_data=[
        run(("native_call_add.out", 0, 100, 101), ("JF_CALL", 1, 101, 101), ("native_call_mul.out", 2, 101, 104)),
        run(("native_call_add.out", 0, 200, 203), ("JF_CALL", 1, 203, 203), ("native_call_sub.out", 4, 203, 205)),
    ])
    inspector = Inspector(write_etdump(dump))
    rows = {r.op: r for r in inspector.operator_table()}
    assert set(rows) == {"add.out", "mul.out", "sub.out"}
    assert rows["add.out"].count == 1 and rows["add.out"].mean_ms == pytest.approx(2.0)  # 1 ms and 3 ms
    assert rows["mul.out"].count == 0.5 and rows["mul.out"].total_ms == pytest.approx(1.5)  # once in two runs
    assert inspector.execute_ms() == pytest.approx(4.5)  # whole calls of 4 ms and 5 ms
    assert rows["add.out"].share == pytest.approx(2.0 / 4.5)
    timeline = inspector.timeline()  # the last run only, from its own start
    assert [(e.name, e.start_ms, e.duration_ms) for e in timeline] == [("add.out", 0, 3), ("sub.out", 3, 2)]
    assert [(e.name, e.start_ms) for e in inspector.timeline(run=0)] == [("add.out", 0), ("mul.out", 1)]


def test_what_the_inspector_cannot_use_is_a_typed_error(tmp_path):
    load_only = ETDump(run_data=[RunData("Default", events=[
        Event(profile_event=ProfileEvent("Method::init", 0, 0, start_time=1, end_time=2))])])
    with pytest.raises(InvalidInputError, match="no 'Execute' block"):
        Inspector(write_etdump(load_only)).operator_table()
    with pytest.raises(MalformedETDumpError):
        Inspector(b"not a trace at all")
    inspector = Inspector(write_etdump(ETDump(run_data=[run(("native_call_add.out", 0, 1, 2))])))
    with pytest.raises(InvalidInputError, match="needs the ETRecord and the debug buffer"):
        inspector.calculate_numeric_gap(inputs=[])
