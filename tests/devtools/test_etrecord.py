"""Debug handles and ETRecord: every emitted instruction leads back to its graph node, its source
line and its module; `generate_etrecord` writes a file ExecuTorch's own parser loads; our
torch-free reader reads the maps back where torch cannot be imported."""
from __future__ import annotations

import inspect
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.export import export  # noqa: E402

from execupy.backends.numpy_fused.aot import NumpyFusedPartitioner  # noqa: E402
from execupy.devtools.etrecord import read_etrecord_maps  # noqa: E402
from execupy.errors import ExportError, MalformedProgramError  # noqa: E402
from execupy.exir import to_edge  # noqa: E402
from execupy.exir.etrecord import generate_etrecord, load_edge_programs  # noqa: E402
from execupy.exir.passes import resolve_out_variant  # noqa: E402
from execupy.schema import program as P  # noqa: E402

from ..exir.zoo import CASES  # noqa: E402
from ..reference import reference_python  # noqa: E402
from .no_torch import BLOCK_TORCH  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ZOO = REPO / "tests" / "exir" / "zoo.py"


def op_overload(name: str):
    """"aten.addmm.default" -> torch.ops.aten.addmm.default"""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def zoo_program(name: str):
    case = next(c for c in CASES if c.name == name)
    model, args = case.build()
    edge = to_edge(export(model.eval(), args, dynamic_shapes=case.dynamic_shapes))
    return model, edge, edge.to_executorch()


def lines_of_classes_in(model: nn.Module, path: Path) -> set[int]:
    """Line numbers of the source of every module class of `model` defined in `path`."""
    lines = set()
    for m in model.modules():
        if Path(inspect.getsourcefile(type(m))).resolve() == path:
            source, start = inspect.getsourcelines(type(m))
            lines.update(range(start, start + len(source)))
    return lines


@pytest.mark.parametrize("name", ["gpt2_block", "cnn_bn_pool", "embedding_layernorm"])
def test_every_instruction_leads_to_its_aten_op_source_line_and_module(name):
    model, edge, prog = zoo_program(name)
    modules = dict(model.named_modules())
    class_lines = lines_of_classes_in(model, ZOO)
    plan = prog.program.execution_plan[0]
    instructions = plan.chains[0].instructions
    assert instructions and sorted(prog.debug_handle_map["forward"]) == list(range(len(instructions)))
    for pc, ins in enumerate(instructions):
        [handle] = prog.debug_handle_map["forward"][pc]
        info = prog.node_info["forward"][handle]
        # The kernel this instruction calls is the out variant of the node's aten op.
        assert isinstance(ins, P.KernelCall)
        operator = plan.operators[ins.op_index]
        expected = resolve_out_variant(op_overload(info.op))
        assert (operator.name, operator.overload) == (expected.name, expected.overload), (pc, info)
        # The source line is a line of the model's own code in the zoo, not torch.nn's.
        assert Path(info.file).resolve() == ZOO and info.line in class_lines, (pc, info)
        # The module path names the submodule the op ran in, with its class.
        module = modules[info.module_path]
        assert info.module_type == f"{type(module).__module__}.{type(module).__qualname__}", (pc, info)


@pytest.mark.parametrize("name", ["cond_branches", "mutable_counter"])
def test_jumps_moves_and_state_writebacks_have_handles_too(name):
    _, _, prog = zoo_program(name)
    plan = prog.program.execution_plan[0]
    info, handles = prog.node_info["forward"], prog.debug_handle_map["forward"]
    instructions = plan.chains[0].instructions
    assert sorted(handles) == list(range(len(instructions)))
    for pc, ins in enumerate(instructions):
        [op] = [info[h].op for h in handles[pc]]
        if isinstance(ins, (P.JumpFalseCall, P.MoveCall)):
            assert op == "higher_order.cond"  # control flow belongs to the cond node
        elif plan.operators[ins.op_index].name == "aten::copy_":
            assert op == "aten.add.Tensor"  # the state write-back belongs to the op computing the new state
        else:  # ops inside the branches lead to their own nodes
            assert plan.operators[ins.op_index].name == resolve_out_variant(op_overload(op)).name


class Mixed(nn.Module):
    """A Linear+ReLU run the NumpyFused backend takes, then ops it leaves to the kernels."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        y = torch.relu(self.fc(x))
        return torch.sigmoid(y) - y


def mixed_program():
    model = Mixed().eval()
    x = torch.randn(3, 4)
    ep = export(model, (x,))
    edge = to_edge(ep)
    prog = edge.to_backend(NumpyFusedPartitioner()).to_executorch()
    return model, x, ep, edge, prog


def test_a_delegate_call_leads_to_every_op_its_payload_holds():
    _, _, _, edge, prog = mixed_program()
    plan = prog.program.execution_plan[0]
    calls = [pc for pc, ins in enumerate(plan.chains[0].instructions) if isinstance(ins, P.DelegateCall)]
    assert len(calls) == 1
    [pc] = calls
    info = prog.node_info["forward"]
    # The DelegateCall's handles are those of the edge nodes it replaced, in graph order.
    delegated = [info[h].op for h in prog.debug_handle_map["forward"][pc]]
    assert delegated == ["aten.permute.default", "aten.addmm.default", "aten.relu.default"]
    # The backend's own map: op k of the payload -> that node's handle.
    entry = prog.delegate_map["forward"][pc]
    assert entry["name"] == "NumpyFusedBackend"
    assert [h for k in sorted(entry["delegate_map"]) for h in entry["delegate_map"][k]] == \
        prog.debug_handle_map["forward"][pc]
    assert prog.instruction_id_to_num_outs_map["forward"] == {pc: 1}
    # Handles come from the edge program the user gave to_backend: the same numbers there.
    edge_handles = {n.meta["debug_handle"]: str(n.target)
                    for n in edge.exported_program().graph_module.graph.nodes if n.op == "call_function"}
    assert all(edge_handles[h] == info[h].op for h in prog.debug_handle_map["forward"][pc])


def strip_handles(edge) -> None:
    for ep in (edge.exported_program(m) for m in edge.methods):
        for gm in ep.graph_module.modules():
            if isinstance(gm, torch.fx.GraphModule):
                for n in gm.graph.nodes:
                    n.meta.pop("debug_handle", None)


@pytest.mark.parametrize("name", ["gpt2_block", "cnn_bn_pool"])
def test_debug_handles_do_not_change_the_pte_bytes(name):
    _, edge, prog = zoo_program(name)
    strip_handles(edge)
    bare = edge.to_executorch()
    assert bare.debug_handle_map == {"forward": {}}  # the handles really were gone
    assert bare.buffer == prog.buffer


def test_etrecord_round_trips_through_our_readers(tmp_path):
    _, x, ep, edge, prog = mixed_program()
    path = tmp_path / "mixed.etrecord"
    generate_etrecord(path, edge, prog, exported_program=ep)
    names = zipfile.ZipFile(path).namelist()
    assert "ETRECORD_V0" in names and "edge_dialect_exported_program/forward" in names
    maps = read_etrecord_maps(path)
    assert maps.debug_handle_map == prog.debug_handle_map
    # Instruction ids come back as ints; what a backend keeps inside is JSON (string keys).
    assert maps.delegate_map == {m: {pc: json.loads(json.dumps(entry)) for pc, entry in d.items()}
                                 for m, d in prog.delegate_map.items()}
    assert maps.instruction_id_to_num_outs_map == prog.instruction_id_to_num_outs_map
    # Node info read from the serialized edge graph, without torch, is what the exporter knew.
    assert maps.node_info == prog.node_info
    # The edge program comes back on the torch side with its handles and computes the same.
    back = load_edge_programs(path)["forward"]
    handles = {n.meta.get("debug_handle") for n in back.graph_module.graph.nodes if n.op == "call_function"}
    assert set(prog.node_info["forward"]) <= handles
    torch.testing.assert_close(back.module()(x), edge.exported_program().module()(x))


@pytest.mark.parametrize("name", ["cond_branches", "dynamic_sequence"])
def test_node_info_of_branches_and_symbolic_ops_survives_the_etrecord(name, tmp_path):
    _, edge, prog = zoo_program(name)
    generate_etrecord(tmp_path / "r.etrecord", edge, prog)
    assert read_etrecord_maps(tmp_path / "r.etrecord").node_info == prog.node_info


def test_an_edge_manager_after_to_backend_is_refused_with_a_reason(tmp_path):
    _, _, _, edge, prog = mixed_program()
    with pytest.raises(ExportError, match="before to_backend"):
        generate_etrecord(tmp_path / "x.etrecord", edge.to_backend(NumpyFusedPartitioner()), prog)
    assert not (tmp_path / "x.etrecord").exists()


def test_what_is_not_an_etrecord_is_a_typed_error(tmp_path):
    not_zip = tmp_path / "a.etrecord"
    not_zip.write_bytes(b"PK\x03\x04 but not really a zip")
    with pytest.raises(MalformedProgramError, match="not an ETRecord"):
        read_etrecord_maps(not_zip)
    no_marker = tmp_path / "b.etrecord"
    with zipfile.ZipFile(no_marker, "w") as z:
        z.writestr("debug_handle_map", "{}")
    with pytest.raises(MalformedProgramError, match="ETRECORD_V0"):
        read_etrecord_maps(no_marker)
    bad_json = tmp_path / "c.etrecord"
    with zipfile.ZipFile(bad_json, "w") as z:
        z.writestr("ETRECORD_V0", "")
        z.writestr("debug_handle_map", "{not json")
    with pytest.raises(MalformedProgramError, match="debug_handle_map"):
        read_etrecord_maps(bad_json)


def test_damaged_etrecords_give_typed_errors_only(tmp_path):
    """1000 seeded mutants of a real ETRecord: flipped bytes anywhere, or a JSON entry replaced
    by JSON of another shape. Each either reads or raises MalformedProgramError."""
    import random

    _, _, _, edge, prog = mixed_program()
    good = tmp_path / "good.etrecord"
    generate_etrecord(good, edge, prog)
    data = good.read_bytes()
    entries = {name: zipfile.ZipFile(good).read(name) for name in zipfile.ZipFile(good).namelist()}
    shapes = [[], {}, 3, "x", None, {"forward": 1}, {"forward": {"a": [1]}}, {"forward": {"0": ["x"]}},
              {"forward": {"0": {"1": 2}}}, {"graph_module": {"graph": {"nodes": [1, {"metadata": []}]}}},
              {"graph_module": {"graph": {"nodes": [{"metadata": {"debug_handle": "x", "stack_trace": 5}}]}}},
              {"graph_module": {"graph": {"nodes": [{"metadata": {"nn_module_stack": "a"}}]}}}]
    rng = random.Random(0)
    outcomes = {"read": 0, "refused": 0}
    for k in range(1000):
        path = tmp_path / f"m{k % 10}.etrecord"
        if k % 2:
            damaged = bytearray(data)
            for _ in range(rng.randint(1, 8)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
            path.write_bytes(bytes(damaged))
        else:
            victim = rng.choice([n for n in entries if n.endswith(("_map", "/forward"))])
            with zipfile.ZipFile(path, "w") as z:
                for name, content in entries.items():
                    z.writestr(name, json.dumps(rng.choice(shapes)) if name == victim else content)
        try:
            read_etrecord_maps(path)
            outcomes["read"] += 1
        except MalformedProgramError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and sum(outcomes.values()) == 1000, outcomes


# Runs where torch cannot be imported: reads the maps and prints them as JSON.
_TORCH_FREE_READ = BLOCK_TORCH + r'''
import json
from dataclasses import asdict
from execupy.devtools.etrecord import read_etrecord_maps
maps = read_etrecord_maps(sys.argv[1])
print(json.dumps({"debug_handle_map": maps.debug_handle_map, "delegate_map": maps.delegate_map,
                  "node_info": {m: {h: asdict(i) for h, i in t.items()} for m, t in maps.node_info.items()}}))
'''


def test_torch_free_reader_reads_the_maps_where_torch_is_blocked(tmp_path):
    _, _, _, edge, prog = mixed_program()
    path = tmp_path / "mixed.etrecord"
    generate_etrecord(path, edge, prog)
    proc = subprocess.run([sys.executable, "-c", _TORCH_FREE_READ, str(path)], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert got["debug_handle_map"] == json.loads(json.dumps(prog.debug_handle_map))
    assert got["delegate_map"] == json.loads(json.dumps(prog.delegate_map))
    expected_info = {m: {str(h): {"op": i.op, "file": i.file, "line": i.line, "module_path": i.module_path,
                                  "module_type": i.module_type} for h, i in t.items()}
                     for m, t in prog.node_info.items()}
    assert got["node_info"] == expected_info


# Runs in the reference venv: ExecuTorch 1.5.1's own parser loads our ETRecord, and its edge
# program (deserialized by ExecuTorch's serializer) runs on the input we give.
_ET_PARSE = r'''
import json, sys, torch
from executorch.devtools.etrecord import parse_etrecord
record = parse_etrecord(sys.argv[1])
ep = record.edge_dialect_program
x = torch.tensor(json.loads(sys.argv[2]))
nodes = {n.meta["debug_handle"]: str(n.target) for n in ep.graph_module.graph.nodes
         if n.op == "call_function" and n.meta.get("debug_handle") is not None}
print("REPORT " + json.dumps({
    "debug_handle_map": record._debug_handle_map, "delegate_map": record._delegate_map,
    "num_outs": record._instruction_id_to_num_outs_map, "nodes": nodes,
    "edge_output": ep.module()(x).tolist(), "original_output": record.exported_program.module()(x).tolist()}))
'''


@pytest.mark.reference
@pytest.mark.slow
def test_executorch_parses_our_etrecord_and_loads_its_programs(tmp_path):
    model, x, ep, edge, prog = mixed_program()
    path = tmp_path / "mixed.etrecord"
    generate_etrecord(path, edge, prog, exported_program=ep)
    proc = subprocess.run([str(reference_python()), "-c", _ET_PARSE, str(path), json.dumps(x.tolist())],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
    assert report["debug_handle_map"] == json.loads(json.dumps(prog.debug_handle_map))
    assert report["delegate_map"] == json.loads(json.dumps(prog.delegate_map))
    assert report["num_outs"] == json.loads(json.dumps(prog.instruction_id_to_num_outs_map))
    # Its edge graph carries our handles on the same aten ops our node info names.
    assert report["nodes"] == {str(h): i.op for h, i in prog.node_info["forward"].items()}
    eager = model(x)
    torch.testing.assert_close(torch.tensor(report["edge_output"]), eager)
    torch.testing.assert_close(torch.tensor(report["original_output"]), eager)


# Runs in the reference venv: ExecuTorch's Inspector joins a trace of our .pte (ETDump, written by
# ExecuTorch's runtime here unless one is there already) with our ETRecord; prints, per traced
# operator call, what the join found.
_ET_INSPECT = r'''
import json, os, sys, torch
from executorch.devtools import Inspector
pte, record, x = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
if not os.path.exists("trace.etdp"):
    from executorch.extension.pybindings.portable_lib import _load_for_executorch
    m = _load_for_executorch(pte, enable_etdump=True, debug_buffer_size=1 << 20)
    m.forward((x,))
    m.write_etdump_result_to_file("trace.etdp", "trace.bin")
inspector = Inspector(etdump_path="trace.etdp", etrecord=record, debug_buffer_path="trace.bin")
calls = [{"instruction": ev._instruction_id, "handles": ev.debug_handles, "ops": ev.op_types,
          "modules": [list(stack.values())[-1][0] for stack in ev.module_hierarchy.values()]}
         for block in inspector.event_blocks if block.name == "Execute"
         for ev in block.events if ev.name == "OPERATOR_CALL"]
print("REPORT " + json.dumps(calls))
'''


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        return torch.sigmoid(torch.relu(self.fc(x))) - x.sum()


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.parametrize("traced_by", ["executorch", "execupy"])
def test_executorch_inspector_joins_a_trace_of_our_pte_with_our_etrecord(traced_by, tmp_path):
    x = torch.randn(3, 4)
    ep = export(Small().eval(), (x,))
    edge = to_edge(ep)
    prog = edge.to_executorch()
    prog.save(tmp_path / "small.pte")
    if traced_by == "execupy":  # our runtime's own ETDump
        from execupy.devtools.tracer import EventTracer
        from execupy.runtime import Module

        tracer = EventTracer(log_intermediate_outputs=True)
        Module(tmp_path / "small.pte", event_tracer=tracer).forward(x.numpy())
        tracer.save(tmp_path / "trace.etdp", tmp_path / "trace.bin")
    generate_etrecord(tmp_path / "small.etrecord", edge, prog, exported_program=ep)
    proc = subprocess.run([str(reference_python()), "-c", _ET_INSPECT, "small.pte", "small.etrecord",
                           json.dumps(x.tolist())], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
    handles = prog.debug_handle_map["forward"]
    assert [c["instruction"] for c in calls] == sorted(handles)  # every instruction was traced
    for call in calls:
        info = prog.node_info["forward"][handles[call["instruction"]][0]]
        assert call["handles"] == handles[call["instruction"]]
        assert call["ops"] == [info.op.removeprefix("aten.")]  # ExecuTorch names ops without namespace
        assert call["modules"] == [info.module_path]


# Runs in the reference venv: ExecuTorch's parser loads each ETRecord named; prints, per file,
# its edge graph's handle -> op (branches included).
_ET_HANDLES = r'''
import json, sys, torch
from executorch.devtools.etrecord import parse_etrecord

def name(target):  # as torch.export's serializer spells a target, less "torch.ops."
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "higher_order." + target.__name__
    return f"{target.__module__}.{target.__name__}"

report = {}
for path in sys.argv[1:]:
    gm = parse_etrecord(path).edge_dialect_program.graph_module
    report[path] = {n.meta["debug_handle"]: name(n.target) for m in gm.modules() if hasattr(m, "graph")
                    for n in m.graph.nodes if n.op == "call_function" and n.meta.get("debug_handle") is not None
                    and name(n.target) != "_operator.getitem"}  # they carry the handle of the op they read
print("REPORT " + json.dumps(report))
'''


@pytest.mark.reference
@pytest.mark.slow
def test_executorch_parses_etrecords_of_dynamic_shape_and_cond_programs(tmp_path):
    """torch 2.13 writes symbolic sizes as sympy srepr; ExecuTorch's reader needs them plain."""
    expected = {}
    for name in ["dynamic_sequence", "dynamic_gpt2_block", "cond_branches"]:
        _, edge, prog = zoo_program(name)
        path = str(tmp_path / f"{name}.etrecord")
        generate_etrecord(path, edge, prog)
        expected[path] = {str(h): i.op for h, i in prog.node_info["forward"].items()}
    proc = subprocess.run([str(reference_python()), "-c", _ET_HANDLES, *expected], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
    assert report == expected
