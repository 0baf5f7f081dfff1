"""Seeing what was delegated: `get_delegation_info` on a `.pte` (torch-free) and on a lowered
exported program (torch side), `print_delegated_graph`, and `execupy inspect`'s delegate contents.

Expected facts come from outside our readers: each case's manifest (which lists its
delegates and the operators left to kernels), ExecuTorch's own deserializer plus `flatc`
with ExecuTorch's XNNPACK schema (node types and weights of each payload), and, for our
own NumpyFused programs, the exported graph before and after `to_backend`. The XNNPACK
checks run on whatever ExecuTorch programs ../shared holds; the rest runs everywhere.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from execupy.devtools.delegation import (
    delegate_contents,
    format_delegation_table,
    get_delegation_info,
    print_delegated_graph,
)
from execupy.errors import MalformedProgramError, MethodNotFoundError
from execupy.runtime.program import Program

from ..conformance import cases, program_name
from ..reference import run_worker_once

REPO = Path(__file__).resolve().parents[2]
XNNPACK = cases("xnnpack", "quant_xnnpack")  # ExecuTorch's; none without ../shared
DELEGATED = XNNPACK + cases("execupy_delegated")
MISSING_BACKEND = cases("execupy_missing_backend")


def execupy_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "execupy", *args], capture_output=True, text=True,
                          timeout=300, env=env)


# ---------------------------------------------------------------------------- .pte, against the manifest


@pytest.mark.parametrize("c", DELEGATED, ids=program_name)
def test_counts_agree_with_the_manifest(c):
    for method, delegates in c.manifest["delegates"].items():
        info = get_delegation_info(c.pte, method)
        assert info.num_delegated_subgraphs == len(delegates)
        called = {op for op, row in info.delegation_by_operator.items() if row.non_delegated}
        assert called == set(c.manifest["operators"][method])
        assert info.num_delegated_nodes >= len(delegates) > 0  # every delegate runs at least one node
        rows = info.get_operator_delegation_table()
        assert rows[-1].op_type == "Total"
        assert (rows[-1].delegated, rows[-1].non_delegated) == (info.num_delegated_nodes, info.num_non_delegated_nodes)
        assert info.opaque_subgraphs == 0


@pytest.mark.parametrize("c", DELEGATED[:1] + DELEGATED[-1:], ids=program_name)
def test_all_methods_together_add_up(c):
    program = Program.load(c.pte)
    per_method = [get_delegation_info(program, m) for m in program.method_names]
    together = get_delegation_info(program)
    assert together.num_delegated_subgraphs == sum(i.num_delegated_subgraphs for i in per_method)
    assert together.num_non_delegated_nodes == sum(i.num_non_delegated_nodes for i in per_method)
    table = format_delegation_table(together)
    assert table.splitlines()[-1].split() == ["Total", str(together.num_delegated_nodes),
                                              str(together.num_non_delegated_nodes)]


@pytest.mark.parametrize("c", MISSING_BACKEND, ids=program_name)
def test_a_backend_we_cannot_read_counts_as_an_opaque_subgraph(c):
    info = get_delegation_info(c.pte)
    (delegates,) = c.manifest["delegates"].values()
    assert info.num_delegated_subgraphs == info.opaque_subgraphs == len(delegates) > 0
    assert info.num_delegated_nodes == 0
    assert "unknown" in info.get_summary()


@pytest.mark.parametrize("c", XNNPACK[:2] + cases("execupy_delegated"), ids=program_name)
def test_pte_delegated_graph_lists_each_delegates_nodes_under_its_call(c, capsys):
    print_delegated_graph(c.pte)
    lines = capsys.readouterr().out.splitlines()
    info = get_delegation_info(c.pte)
    calls = [line for line in lines if " delegate " in line]
    assert len(calls) == info.num_delegated_subgraphs
    node_lines = [line for line in lines if line.startswith(" " * 12)]
    assert len(node_lines) == info.num_delegated_nodes
    operators = {op for ops in c.manifest["operators"].values() for op in ops}
    assert {line.split()[1] for line in lines if line.split()[1:2] and "::" in line.split()[1]} == operators


def test_a_missing_method_is_a_typed_error():
    c = DELEGATED[-1]
    with pytest.raises(MethodNotFoundError, match="no_such_method"):
        get_delegation_info(c.pte, "no_such_method")


@pytest.mark.parametrize("c", [c for c in XNNPACK[:1]] + cases("execupy_delegated")[:1], ids=program_name)
def test_a_damaged_payload_is_a_typed_error_naming_the_backend(c, tmp_path):
    data = bytearray(c.pte.read_bytes())
    magic = b"XH00" if c.flavour.endswith("xnnpack") else b"NPFUSED1"
    at = data.find(magic)
    assert at > 0
    data[at:at + 2] = b"??"
    bad = tmp_path / "damaged.pte"
    bad.write_bytes(data)
    backend = "XnnpackBackend" if magic == b"XH00" else "NumpyFusedBackend"
    with pytest.raises(MalformedProgramError, match=backend):
        get_delegation_info(bad)
    proc = execupy_cli("inspect", str(bad))
    assert proc.returncode == 1 and backend in proc.stdout and "Traceback" not in proc.stderr


def test_damaged_delegates_give_typed_errors_only():
    """300 seeded mutants with bytes changed in and around a delegate payload: each one either
    reads or raises an ExecupyError, and inspect's summary still never crashes."""
    from execupy.devtools.summary import summarize
    from execupy.errors import ExecupyError

    rng = random.Random(0)
    sources = [(c.pte.read_bytes(), b"XH00" if c.flavour.endswith("xnnpack") else b"NPFUSED1") for c in DELEGATED]
    outcomes = Counter()
    for _ in range(300):
        original, magic = rng.choice(sources)
        data = bytearray(original)
        at = data.find(magic)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(max(at - 8, 0), min(len(data), at + 2000))] = rng.randrange(256)
        try:
            get_delegation_info(bytes(data))
            outcomes["read"] += 1
        except ExecupyError:
            outcomes["typed error"] += 1
        problems = summarize(bytes(data))["problems"]
        assert not [p for p in problems if "execupy bug" in p]
    assert outcomes["typed error"] > 0 and sum(outcomes.values()) == 300


# ---------------------------------------------------------------------------- XNNPACK, against flatc

# Runs in the reference venv: ExecuTorch's deserializer finds each delegate payload, flatc
# turns its XNNGraph into JSON with ExecuTorch's schema; reports kernel calls per operator and,
# per delegate, node types and the bytes of the constants it references.
_FLATC_WORKER = r'''
import collections, json, os, re, subprocess, sys, tempfile
from executorch.exir._serialize._program import deserialize_pte_binary
import executorch.backends.xnnpack.serialization.xnnpack_graph_serialize as S
schema = os.path.join(os.path.dirname(S.__file__), "schema.fbs")
flatc = os.path.join(os.path.dirname(sys.executable), "flatc")
NAMED = 2 ** 64 - 1

def xnngraph(payload):
    h = S.XNNHeader.from_bytes(payload[:30])
    with tempfile.TemporaryDirectory() as t:
        open(f"{t}/g.bin", "wb").write(payload[h.flatbuffer_offset:h.flatbuffer_offset + h.flatbuffer_size])
        subprocess.run([flatc, "--json", "--strict-json", "--raw-binary", "-o", t, schema, "--", f"{t}/g.bin"],
                       check=True)
        text = open(f"{t}/g.json").read()
    return json.loads(re.sub(r":\s*-?(inf|nan)\b", ": 0", text))  # bounds are not needed here

report = {}
for path in json.load(open(sys.argv[1])):
    pte = deserialize_pte_binary(open(path, "rb").read())
    named = pte.named_data
    named_size = {k: len(bytes(named.buffers[e.buffer_index])) for k, e in named.pte_data.items()} if named else {}
    methods = {}
    for plan in pte.program.execution_plan:
        ops = collections.Counter()
        for ins in plan.chains[0].instructions:
            if type(ins.instr_args).__name__ == "KernelCall":
                op = plan.operators[ins.instr_args.op_index]
                ops[op.name + ("." + op.overload if op.overload else "")] += 1
        delegates = []
        for d in plan.delegates:
            g = xnngraph(pte.program.backend_delegate_data[d.processed.index].data)
            weights = sum(named_size[c["named_key"]] if int(c.get("offset", 0)) == NAMED else int(c.get("size", 0))
                          for c in g.get("constant_data", [])[1:])
            delegates.append({"nodes": dict(collections.Counter(n["xnode_union_type"][3:] for n in g["xnodes"])),
                              "weight_bytes": weights})
        methods[plan.name] = {"kernel_calls": dict(ops), "delegates": delegates}
    report[path] = methods
json.dump(report, open(os.path.join(sys.argv[2], "report.json"), "w"))
'''


@pytest.fixture(scope="module")
def flatc_report() -> dict:
    paths = json.dumps(sorted(str(c.pte) for c in XNNPACK))
    _, report = run_worker_once(_FLATC_WORKER, paths, "delegation-flatc")
    return report


@pytest.mark.reference
@pytest.mark.parametrize("c", XNNPACK, ids=program_name)
def test_xnnpack_node_types_and_weights_match_flatc(c, flatc_report):
    expected = flatc_report[str(c.pte)]
    program = Program.load(c.pte)
    for method, facts in expected.items():
        plan = program.plan(method)
        contents = [delegate_contents(program, d) for d in plan.delegates]
        assert [x.node_types for x in contents] == [d["nodes"] for d in facts["delegates"]]
        assert [x.weight_bytes for x in contents] == [d["weight_bytes"] for d in facts["delegates"]]
        info = get_delegation_info(program, method)
        assert {op: r.non_delegated for op, r in info.delegation_by_operator.items() if r.non_delegated} \
            == facts["kernel_calls"]
        assert info.num_delegated_nodes == sum(sum(d["nodes"].values()) for d in facts["delegates"])


# ---------------------------------------------------------------------------- execupy inspect


@pytest.mark.parametrize("c", XNNPACK[:3] + cases("execupy_delegated"), ids=program_name)
def test_inspect_shows_each_delegates_nodes_datatypes_and_weights(c):
    program = Program.load(c.pte)
    proc = execupy_cli("inspect", str(c.pte), "--json")
    assert proc.returncode == 0, proc.stderr
    methods = {m["name"]: m for m in json.loads(proc.stdout)["methods"]}
    text = execupy_cli("inspect", str(c.pte)).stdout
    for method, delegates in c.manifest["delegates"].items():
        shown = methods[method]["delegates"]
        assert [d["id"] for d in shown] == delegates
        for d, delegate in zip(shown, program.plan(method).delegates):
            contents = delegate_contents(program, delegate)
            assert d["node_types"] == contents.node_types and d["num_nodes"] == sum(contents.node_types.values())
            assert d["weight_bytes"] == d["weights"]["named_data"]["bytes"] + d["weights"]["payload"]["bytes"] > 0
            assert sum(d["datatypes"].values()) > 0
            node_lines = [line for line in text.splitlines() if line.strip().startswith(f"nodes ({d['num_nodes']}):")]
            assert any(all(f"{kind} {n}" in line for kind, n in d["node_types"].items()) for line in node_lines)
        delegation = methods[method]["delegation"]
        assert delegation["num_delegated_subgraphs"] == len(delegates)
        assert delegation["num_delegated_nodes"] == get_delegation_info(program, method).num_delegated_nodes
    assert "weights: " in text and "value datatypes: " in text


@pytest.mark.reference
@pytest.mark.parametrize("c", XNNPACK[:3], ids=program_name)
def test_inspect_weight_bytes_match_flatc(c, flatc_report):
    proc = execupy_cli("inspect", str(c.pte), "--json")
    for m in json.loads(proc.stdout)["methods"]:
        assert [d["weight_bytes"] for d in m["delegates"]] == \
            [d["weight_bytes"] for d in flatc_report[str(c.pte)][m["name"]]["delegates"]]


# ---------------------------------------------------------------------------- torch side


class _Mixed:
    """linear -> relu (delegated), softmax (left to a kernel), linear -> * 2 + x (delegated)."""

    @staticmethod
    def build():
        torch = pytest.importorskip("torch")

        class Mixed(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 6)

            def forward(self, x):
                return self.b(torch.softmax(torch.relu(self.a(x)), dim=-1)) * 2.0 + x

        torch.manual_seed(0)
        return Mixed().eval(), (torch.randn(4, 6),)


@pytest.fixture(scope="module")
def lowered():
    model, args = _Mixed.build()
    from torch.export import export

    from execupy.backends.numpy_fused.aot import NumpyFusedPartitioner
    from execupy.exir import to_edge

    edge = to_edge(export(model, args))
    return edge, edge.to_backend(NumpyFusedPartitioner())


def test_torch_side_every_node_is_delegated_or_not(lowered):
    from execupy.backends.numpy_fused.aot import SUPPORTED
    from execupy.exir.delegation_info import get_delegation_info as graph_delegation_info

    edge, delegated = lowered
    before, after = graph_delegation_info(edge), graph_delegation_info(delegated)
    assert before.num_delegated_subgraphs == before.num_delegated_nodes == 0
    assert after.num_delegated_subgraphs == 2
    assert after.num_delegated_nodes + after.num_non_delegated_nodes == before.num_non_delegated_nodes
    supported = {op.name() for op in SUPPORTED}
    assert {op for op, r in after.delegation_by_operator.items() if r.delegated} <= supported
    assert after.delegation_by_operator["aten::_softmax"].non_delegated == 1
    # the same info from the program object, the method's exported program and its graph module
    ep = delegated.exported_program()
    assert graph_delegation_info(ep) == graph_delegation_info(ep.graph_module) == after


def test_torch_side_and_pte_side_agree(lowered):
    from execupy.backends.numpy_fused.aot import SUPPORTED
    from execupy.exir.delegation_info import get_delegation_info as graph_delegation_info

    _, delegated = lowered
    graph = graph_delegation_info(delegated)
    pte = get_delegation_info(delegated.to_executorch().buffer)
    assert (pte.num_delegated_subgraphs, pte.num_delegated_nodes, pte.num_non_delegated_nodes) == \
        (graph.num_delegated_subgraphs, graph.num_delegated_nodes, graph.num_non_delegated_nodes)
    payload_name = {op.name(): name for op, (name, _, _) in SUPPORTED.items()}
    in_graph = Counter({payload_name[op]: r.delegated for op, r in graph.delegation_by_operator.items() if r.delegated})
    in_pte = Counter({op: r.delegated for op, r in pte.delegation_by_operator.items() if r.delegated})
    assert in_graph == in_pte


def test_print_delegated_graph_lists_each_subgraph_under_its_call(lowered, capsys):
    from execupy.exir.delegation_info import print_delegated_graph

    _, delegated = lowered
    print_delegated_graph(delegated.exported_program().graph_module)
    lines = capsys.readouterr().out.splitlines()
    calls = [k for k, line in enumerate(lines) if "executorch_call_delegate(" in line]
    assert len(calls) == 2
    for k in calls:
        assert lines[k + 1].strip() == "NumpyFusedBackend runs:"
        assert "aten::addmm" in "\n".join(lines[k + 2:k + 9])
    assert any(line.startswith("_softmax = aten::_softmax(") for line in lines)
