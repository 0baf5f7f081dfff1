"""XnnpackPartitioner: zoo models lowered to XNNPACK payloads run in ExecuTorch's runtime (whose
pybindings include XNNPACK) and in ours, and match torch eager; the payloads read back with
the runtime's own reader; we delegate at least the share of ops ExecuTorch's partitioner does."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.export import export
from torch.utils import _pytree as pytree

from execupy.backends.xnnpack.schema import GRAPH_IDENTIFIERS, NAMED_DATA_OFFSET, read_payload
from execupy.exir import EdgeCompileConfig, to_edge_transform_and_lower
from execupy.exir.delegation_info import get_delegation_info
from execupy.exir.xnnpack import XnnpackPartitioner
from execupy.runtime import Module, Program

from .. import reference
from . import zoo_functions  # noqa: F401  (adds its cases to CASES)
from .test_zoo import assert_same, eager_outputs, to_numpy
from .zoo import CASES, by_name

ROOT = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=None)
def lowered(name: str):
    """(case, model, inputs, program) with XnnpackPartitioner, exported once per session."""
    c = by_name(name)
    torch.manual_seed(0)
    model, args = c.build()
    ep = export(model, args, dynamic_shapes=c.dynamic_shapes)
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return c, model, args, edge, edge.to_executorch()


def xnnpack_delegates(prog) -> int:
    return Program.load(prog.buffer).method_meta("forward").backends.count("XnnpackBackend")


@lru_cache(maxsize=None)
def delegated_cases() -> list[str]:
    # Tensor inputs only: the batch worker passes tensors (a Python scalar input is another test's subject).
    return [c.name for c in CASES if not c.reference_lacks and xnnpack_delegates(lowered(c.name)[4])
            and all(isinstance(a, torch.Tensor) for a in lowered(c.name)[2])]


def test_most_of_the_zoo_gets_an_xnnpack_delegate():
    assert len(delegated_cases()) >= 40, delegated_cases()


def test_an_mlp_is_one_delegate_and_keeps_its_weights_in_named_data():
    _, model, args, _, prog = lowered("mlp")
    program = Program.load(prog.buffer)
    (delegate,) = program.program.execution_plan[0].delegates
    graph = read_payload(program.delegate_payload(delegate.processed))
    # The relu is the first product's output bounds, as ExecuTorch fuses activations.
    assert [n.kind for n in graph.nodes] == ["FullyConnected", "FullyConnected"]
    assert (graph.nodes[0].output_min, graph.nodes[0].output_max) == (0.0, float("inf"))
    assert bytes(program.delegate_payload(delegate.processed)[36:40]) == GRAPH_IDENTIFIERS[0]
    weights = [model[0].weight, model[0].bias, model[2].weight, model[2].bias]
    keys = {hashlib.sha256(w.detach().numpy().tobytes()).hexdigest() for w in weights}
    refs = graph.constant_data[1:]
    assert {r.named_key for r in refs} == keys and all(r.offset == NAMED_DATA_OFFSET for r in refs)
    assert {e.key for e in program.program.named_data} == keys
    # The weights are stored once, in named data: not in the constant segment as well.
    assert len(prog.buffer) < sum(w.numel() * 4 for w in weights) * 1.5 + 4096


def test_a_float16_mlp_is_one_fp16_delegate():
    case, model, args, _, prog = lowered("float16_mlp")
    program = Program.load(prog.buffer)
    assert program.method_meta("forward").backends == ["XnnpackBackend"]
    (delegate,) = program.program.execution_plan[0].delegates
    graph = read_payload(program.delegate_payload(delegate.processed))
    assert [n.kind for n in graph.nodes] == ["FullyConnected", "FullyConnected"]
    assert {v.datatype for v in graph.values} == {"fp16"}  # weights too: no float32 copy of them
    got = Module(prog.buffer).forward(*[to_numpy(a) for a in args])
    assert_same(got, eager_outputs(model, args, 1)[0], case)


def node_kinds(prog) -> list[str]:
    program = Program.load(prog.buffer)
    return [n.kind for d in program.program.execution_plan[0].delegates
            for n in read_payload(program.delegate_payload(d.processed)).nodes]


def test_convolution_chains_run_channels_last_with_batch_norms_and_relus_folded():
    """As ExecuTorch's export writes them: a batch norm right after a conv is in its filter and
    bias, a relu after a conv its output bounds, and values stay NHWC from the first conv on,
    transposed only at the ends (the input in; each returned 4-D value out)."""
    kinds = node_kinds(lowered("channels_last_chain")[4])
    assert kinds.count("StaticTranspose") == 3, kinds
    assert "Clamp" not in kinds
    assert kinds.count("Multiply") == 2, kinds  # the batch norm after the add (x * scale + shift), the gain
    kinds = node_kinds(lowered("cnn_bn_pool")[4])
    assert "Multiply" not in kinds and "Clamp" not in kinds, kinds


@pytest.mark.parametrize("name", ["mlp_activations", "cnn_bn_pool", "channels_last_chain", "depthwise_separable", "conv_variants",
                                  "pooling_variants", "interpolate_bilinear", "gpt2_block", "llama_block",
                                  "kv_cache_attention"])
def test_execupy_runtime_matches_eager(name):
    c, model, args, _, prog = lowered(name)
    assert xnnpack_delegates(prog) > 0
    for inputs in [args] + c.more_inputs():
        got = Module(prog.buffer).forward(*[to_numpy(x) for x in inputs])
        assert_same(got, eager_outputs(model, inputs, 1)[0], c)


# One process in the reference venv runs every program (loading torch and ExecuTorch once).
_BATCH_WORKER = r"""
import json, sys, numpy as np, torch
import executorch.kernels.quantized  # registers the quantized_decomposed:: kernels
from executorch.extension.pybindings.portable_lib import _load_for_executorch
for job in json.load(open(sys.argv[1])):
    data = np.load(job["inputs"])
    args = tuple(torch.from_numpy(data[f"in{i}"]) for i in range(len(data.files)))
    try:
        outs = _load_for_executorch(job["pte"]).run_method("forward", args)
        np.savez(job["out"], *[o.numpy() for o in outs])
    except Exception as e:
        open(job["out"] + ".err", "w").write(str(e))
"""


@pytest.mark.reference
def test_zoo_with_xnnpack_runs_in_both_runtimes_and_matches_eager():
    names = delegated_cases()
    with tempfile.TemporaryDirectory(prefix="execupy-xnn-") as tmp:
        jobs = []
        for name in names:
            _, _, args, _, prog = lowered(name)
            (Path(tmp) / f"{name}.pte").write_bytes(prog.buffer)
            np.savez(Path(tmp) / f"{name}.in.npz", **{f"in{i}": to_numpy(a) for i, a in enumerate(args)})
            jobs.append({"pte": f"{tmp}/{name}.pte", "inputs": f"{tmp}/{name}.in.npz", "out": f"{tmp}/{name}.out.npz"})
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        proc = subprocess.run([str(reference.reference_python()), "-c", _BATCH_WORKER, f"{tmp}/jobs.json"],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        failures = []
        for name, job in zip(names, jobs):
            c, model, args, _, prog = lowered(name)
            expected = eager_outputs(model, args, 1)[0]
            if Path(job["out"] + ".err").exists():
                failures.append(f"{name}: ExecuTorch refused: {Path(job['out'] + '.err').read_text()[-300:]}")
                continue
            theirs = np.load(job["out"])
            for side, got in (("ExecuTorch", [theirs[f"arr_{i}"] for i in range(len(theirs.files))]),
                              ("execupy", pytree.tree_leaves(Module(prog.buffer).forward(*[to_numpy(a) for a in args])))):
                try:
                    assert_same(got, pytree.tree_leaves(expected), c)
                except AssertionError as e:
                    failures.append(f"{name} ({side}): {str(e)[:300]}")
    assert not failures, "\n".join(failures)


# causal_attention is not here: ExecuTorch delegates its q/k/v split too (0.49 of its nodes, ours 0.48).
SHARE_MODELS = ["mlp", "mlp_activations", "cnn_bn_pool", "depthwise_separable", "gpt2_block",
                "llama_block", "conv1d_bn", "sdpa_causal", "shape_ops", "unary_math"]


@pytest.mark.reference
def test_we_delegate_at_least_the_share_executorch_delegates():
    cmd = [str(reference.reference_python()), str(ROOT / "bench" / "export_compare.py"), "--reference-worker",
           "--models", ",".join(SHARE_MODELS), "--repeat", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    lower = []
    for name in SHARE_MODELS:
        info = get_delegation_info(lowered(name)[3])
        ours = info.num_delegated_nodes / (info.num_delegated_nodes + info.num_non_delegated_nodes)
        assert "error" not in theirs[name], f"{name}: ExecuTorch's side failed: {theirs[name]}"
        if ours + 1e-9 < theirs[name]["xnnpack_share"]:
            lower.append(f"{name}: ours {ours:.2f} < ExecuTorch's {theirs[name]['xnnpack_share']:.2f}")
    assert not lower, "\n".join(lower)
