"""The Inspector: per-operator tables of a trace (ours or ExecuTorch's runtime's), joined with
our ETRecord, without torch; and the numeric comparison with torch eager behind `execupy debug`.

The program is a small model of about twenty operators (twenty_ops.py), exported with its
ETRecord once per module. Expected names, modules and source lines come from the program's
plan and from the exporter's own debug-handle maps, never from literals.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from execupy.devtools.etrecord import read_etrecord_maps  # noqa: E402
from execupy.devtools.inspector import Inspector  # noqa: E402
from execupy.devtools.tracer import EventTracer, profile_name  # noqa: E402
from execupy.errors import InvalidInputError  # noqa: E402
from execupy.runtime import Module  # noqa: E402
from execupy.schema import program as P  # noqa: E402
from execupy.schema.reader import read_pte  # noqa: E402

from .no_torch import BLOCK_TORCH  # noqa: E402
from .test_etdump import _RUN_WITH_ETDUMP, reference  # noqa: E402
from .twenty_ops import INPUT_SHAPE, export_twenty_ops  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def twenty(tmp_path_factory):
    """(pte, etrecord, input) of the twenty-operator model."""
    folder = tmp_path_factory.mktemp("twenty")
    pte, etrecord = export_twenty_ops(folder)
    x = np.random.default_rng(0).standard_normal(INPUT_SHAPE).astype(np.float32)
    return pte, etrecord, x


def trace(pte: Path, x: np.ndarray, folder: Path, calls: int = 3) -> tuple[Path, Path]:
    tracer = EventTracer(log_intermediate_outputs=True)
    module = Module(pte, event_tracer=tracer)
    for _ in range(calls):
        module.forward(x)
    tracer.save(folder / "t.etdp", folder / "t.bin")
    return folder / "t.etdp", folder / "t.bin"


def kernel_instructions(pte: Path) -> dict[int, str]:
    """Instruction id -> the kernel's op name as the Inspector shows it, from the plan."""
    plan = read_pte(pte.read_bytes()).program.execution_plan[0]
    return {pc: profile_name(plan.operators[ins.op_index].key).removeprefix("native_call_")
            for pc, ins in enumerate(plan.instructions) if isinstance(ins, P.KernelCall)}


# ---------------------------------------------------------------------------- tables


def test_operator_table_names_every_kernel_with_its_module_and_source_line(twenty, tmp_path):
    pte, etrecord, x = twenty
    etdp, buf = trace(pte, x, tmp_path, calls=3)
    inspector = Inspector(etdump_path=etdp, etrecord=etrecord, debug_buffer_path=buf)
    assert [(b.name, b.runs) for b in inspector.event_blocks] == [("Default", 1), ("Execute", 3)]

    maps = read_etrecord_maps(etrecord)
    kernels = kernel_instructions(pte)
    expected = {}  # (op, module, source) -> calls per run, from the plan and the exporter's maps
    for pc, op in kernels.items():
        info = maps.node_info["forward"][maps.debug_handle_map["forward"][pc][-1]]
        key = (op, info.module_path, f"{info.file}:{info.line}")
        expected[key] = expected.get(key, 0) + 1
    rows = inspector.operator_table()
    assert {(r.op, r.module_path, r.source): r.count for r in rows} == expected
    assert any(r.module_path == "first.norm" and r.op == "native_layer_norm.out" for r in rows)
    for r in rows:
        assert 0 < r.p50_ms <= r.p90_ms and r.mean_ms > 0
        assert r.total_ms == pytest.approx(r.mean_ms * r.count)
    assert [r.total_ms for r in rows] == sorted((r.total_ms for r in rows), reverse=True)
    assert 0 < sum(r.share for r in rows) <= 1.0  # kernels are part of the call, never more than it

    in_first = sum(r.total_ms for r in rows if r.module_path in ("first", "first.fc", "first.norm"))
    assert inspector.find_total_for_module("first") == pytest.approx(in_first)
    assert inspector.find_total_for_module("first.norm") < inspector.find_total_for_module("first")
    assert inspector.find_total_for_module("no.such.module") == 0

    # one run's timeline: every kernel once, in plan order, one after the other
    timeline = inspector.timeline()
    assert [e.name for e in timeline] == list(kernels.values())
    assert all(a.start_ms + a.duration_ms <= b.start_ms + 1e-6 for a, b in zip(timeline, timeline[1:]))


def test_print_data_tabular_and_to_dataframe(twenty, tmp_path, capsys):
    pte, etrecord, x = twenty
    etdp, _ = trace(pte, x, tmp_path, calls=1)
    inspector = Inspector(etdump_path=etdp, etrecord=etrecord)
    inspector.print_data_tabular()
    printed = capsys.readouterr().out
    for row in inspector.operator_table():
        assert f"{row.op} " in printed and row.source_short in printed
    try:
        import pandas  # noqa: F401  (not a dependency of execupy)
    except ImportError:
        with pytest.raises(InvalidInputError, match="needs pandas"):
            inspector.to_dataframe()
    else:
        frame = inspector.to_dataframe()
        assert list(frame["op"]) == [r.op for r in inspector.operator_table()]


def test_without_an_etrecord_rows_are_per_operator_and_modules_are_refused(twenty, tmp_path):
    pte, _, x = twenty
    etdp, _ = trace(pte, x, tmp_path, calls=2)
    inspector = Inspector(etdump_path=etdp)
    kernels = list(kernel_instructions(pte).values())
    assert {r.op: r.count for r in inspector.operator_table()} == {op: kernels.count(op) for op in set(kernels)}
    with pytest.raises(InvalidInputError, match="needs the ETRecord"):
        inspector.find_total_for_module("first")


_TORCH_FREE = BLOCK_TORCH + r'''
import json
from execupy.devtools.inspector import Inspector
inspector = Inspector(etdump_path=sys.argv[1], etrecord=sys.argv[2], debug_buffer_path=sys.argv[3])
inspector.print_data_tabular()
print("ROWS " + json.dumps([[r.op, r.module_path, r.count] for r in inspector.operator_table()]))
try:
    inspector.calculate_numeric_gap(inputs=[[0.0]])
except ImportError as e:
    print("GAP " + str(e))
'''


def test_the_inspector_constructs_and_tabulates_where_torch_is_blocked(twenty, tmp_path):
    pte, etrecord, x = twenty
    etdp, buf = trace(pte, x, tmp_path)
    proc = subprocess.run([sys.executable, "-c", _TORCH_FREE, str(etdp), str(etrecord), str(buf)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS "))[5:])
    expected = [[r.op, r.module_path, r.count] for r in Inspector(etdp, etrecord, buf).operator_table()]
    assert sorted(map(str, rows)) == sorted(map(str, expected))
    # only the eager comparison needs torch, and says so by failing to import it
    assert "GAP torch is blocked" in proc.stdout


@pytest.mark.reference
def test_the_inspector_reads_the_trace_executorchs_runtime_writes(twenty, tmp_path):
    pte, etrecord, x = twenty
    np.savez(tmp_path / "in.npz", in0=x)
    reference(_RUN_WITH_ETDUMP, pte, tmp_path / "in.npz", tmp_path / "ref.etdp", tmp_path / "ref.bin",
              tmp_path / "out.npy")
    theirs = Inspector(etdump_path=tmp_path / "ref.etdp", etrecord=etrecord, debug_buffer_path=tmp_path / "ref.bin")
    etdp, buf = trace(pte, x, tmp_path, calls=1)
    ours = Inspector(etdump_path=etdp, etrecord=etrecord, debug_buffer_path=buf)
    key = lambda r: (r.op, r.module_path, r.source, r.count)  # noqa: E731
    assert sorted(map(key, theirs.operator_table())) == sorted(map(key, ours.operator_table()))
    assert all(r.total_ms > 0 for r in theirs.operator_table())
    assert theirs.find_total_for_module("second") > 0
    # ExecuTorch's runtime logged every kernel's output too: each is as close to eager as ours
    gaps = theirs.calculate_numeric_gap(inputs=[x])
    assert [g.instruction_id for g in gaps] == sorted(kernel_instructions(pte))
    assert not [g for g in gaps if g.exceeds(atol=1e-5, rtol=1e-5)]


# ---------------------------------------------------------------------------- numeric gap


def test_a_correct_runtime_is_close_to_eager_at_every_operator(twenty, tmp_path):
    pte, etrecord, x = twenty
    etdp, buf = trace(pte, x, tmp_path, calls=1)
    gaps = Inspector(etdp, etrecord, buf).calculate_numeric_gap(inputs=[x])
    assert [g.instruction_id for g in gaps] == sorted(kernel_instructions(pte))  # every kernel, in order
    for g in gaps:
        assert g.snr_db > 100 and g.mse < 1e-10 and not g.exceeds(atol=1e-5, rtol=1e-5), g


def test_a_wrong_kernel_shows_as_the_first_gap(twenty, tmp_path):
    from execupy.kernels.portable.activation import gelu
    from execupy.kernels.registry import register_kernel

    pte, etrecord, x = twenty

    def off_gelu(v, approximate, out):
        return np.add(gelu(v, approximate, out), np.float32(1e-2), out=out)

    register_kernel("aten::gelu.out", override=True)(off_gelu)
    try:
        etdp, buf = trace(pte, x, tmp_path, calls=1)
    finally:
        register_kernel("aten::gelu.out", override=True)(gelu)
    gaps = Inspector(etdp, etrecord, buf).calculate_numeric_gap(inputs=[x])
    first = next(g for g in gaps if g.exceeds(atol=1e-4, rtol=1e-4))
    assert first.op == "gelu.out"
    assert first.max_abs == pytest.approx(1e-2, rel=1e-3) and first.l1 == pytest.approx(1e-2, rel=1e-3)
    assert first.snr_db < 60


# ---------------------------------------------------------------------------- execupy debug


def gelu_source_line() -> int:
    """The line of twenty_ops.py that calls gelu, found in the file itself."""
    lines = (REPO / "tests/devtools/twenty_ops.py").read_text().splitlines()
    return next(k for k, line in enumerate(lines, 1) if "functional.gelu(" in line)


def test_execupy_debug_names_the_planted_wrong_kernel_and_its_source_line_first(twenty, tmp_path):
    """The runtime imports the kernels a kernel list names (EXECUPY_KERNELS); this list has the
    program's own operators with gelu's entry pointing at a wrong kernel (planted_gelu.py)."""
    pte, etrecord, x = twenty
    listed = subprocess.run([sys.executable, "-m", "execupy", "kernels", str(pte), "-o", str(tmp_path / "k.txt")],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert listed.returncode == 0, listed.stderr
    text = (tmp_path / "k.txt").read_text()
    assert "operator aten::gelu.out " in text
    planted = "\n".join("operator aten::gelu.out tests.devtools.planted_gelu" if ln.startswith("operator aten::gelu.out")
                        else ln for ln in text.splitlines())
    (tmp_path / "planted.txt").write_text(planted + "\n")
    np.savez(tmp_path / "in.npz", in0=x)

    def debug(kernel_list: str) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "EXECUPY_KERNELS": kernel_list}
        return subprocess.run([sys.executable, "-m", "execupy", "debug", str(pte), "--etrecord", str(etrecord),
                               "--inputs", str(tmp_path / "in.npz")],
                              capture_output=True, text=True, timeout=300, cwd=REPO, env=env)

    bad = debug(str(tmp_path / "planted.txt"))
    assert bad.returncode == 1, bad.stderr[-2000:]
    head = bad.stdout.split("\n\n")[0]
    assert "instruction " in head and ": gelu.out" in head
    assert f"twenty_ops.py:{gelu_source_line()}" in head
    assert "max |diff| 0.01 " in head
    assert "gelu.out" in bad.stdout.split("lowest SNR")[1]  # among the worst too

    good = debug(str(tmp_path / "k.txt"))
    assert good.returncode == 0, good.stdout + good.stderr[-2000:]
    assert "within atol" in good.stdout
