"""Int8 from our pt2e quantizer, lowered by XnnpackPartitioner, run in ExecuTorch's runtime and in
ours like torch's converted model:

- dynamic: every linear becomes an XNNPACK qd8 x qc8w FullyConnected (int8 weights kept,
  activations quantized per token at run time);
- static: linears and convolutions (depthwise too) become qs8 nodes on qint8 values, with
  the adds, multiplies, max pools, concatenations, clamps and reshapes between them;
- export-llm's 8da4w linears become qd8 x qb4w FullyConnected nodes."""
from __future__ import annotations

import json
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.export import export
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from execupy.backends.xnnpack.schema import read_payload
from execupy.exir import to_edge_transform_and_lower
from execupy.exir.xnnpack import XnnpackPartitioner
from execupy.quantization import XNNPACKQuantizer, get_symmetric_quantization_config
from execupy.runtime import Module, Program

from .. import reference
from ..exir.test_xnnpack_partitioner import _BATCH_WORKER
from .zoo import MODELS, build

NAMES = [m.name for m in MODELS]


@lru_cache(maxsize=None)
def lowered(name: str, dynamic: bool = True, per_channel: bool = True):
    """(torch's converted model, input, program): int8 weights (a scale per channel or one per
    tensor), activations per token at run time (dynamic) or per tensor, calibrated (static)."""
    model = next(m for m in MODELS if m.name == name)
    torch.manual_seed(1)
    x = torch.randn(*model.input_shape)
    config = get_symmetric_quantization_config(is_per_channel=per_channel, is_dynamic=dynamic)
    quantizer = XNNPACKQuantizer().set_global(config)
    prepared = prepare_pt2e(export(build(model), (x,)).module(), quantizer)
    prepared(x)
    converted = convert_pt2e(prepared)
    prog = to_edge_transform_and_lower(export(converted, (x,)), partitioner=[XnnpackPartitioner()]).to_executorch()
    return converted, x, prog


def node_datatypes(prog, kinds=("FullyConnected",)) -> list[tuple[str, str, str]]:
    """(node kind, input datatype, filter datatype) of every node of `kinds` in the program's delegates."""
    program = Program.load(prog.buffer)
    out = []
    for d in program.program.execution_plan[0].delegates:
        g = read_payload(program.delegate_payload(d.processed))
        out += [(n.kind, g.values[n.fields["input1_id"]].datatype, g.values[n.fields["filter_id"]].datatype)
                for n in g.nodes if n.kind in kinds]
    return out


def linear_count(converted: torch.fx.GraphModule) -> int:
    return sum(n.target in (torch.ops.aten.linear.default, torch.ops.aten.addmm.default)
               for n in converted.graph.nodes)


def run_ours(prog, x: torch.Tensor) -> np.ndarray:
    out = Module(prog.buffer).forward(x.numpy())
    return np.asarray(out[0] if isinstance(out, (list, tuple)) else out)


def close_to_torch(got: np.ndarray, want: np.ndarray) -> None:
    # XNNPACK picks each token's scale itself; a step of int8 rounding apart is still the same result.
    np.testing.assert_allclose(got, want, atol=0.02 * float(np.abs(want).max()) + 1e-6, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_linears_become_qd8_qc8w_fully_connected_and_match_torch(name):
    converted, x, prog = lowered(name)
    qd8 = [n for n in node_datatypes(prog) if n == ("FullyConnected", "qdint8", "qcint8")]
    # every one, also those on [B, T, K] tokens (transformer_encoder), which read their rows through a view
    assert len(qd8) == linear_count(converted) > 0
    got = Module(prog.buffer).forward(x.numpy())
    got = got[0] if isinstance(got, (list, tuple)) else got
    close_to_torch(np.asarray(got), converted(x).detach().numpy())


def executorch_outputs(programs: dict[str, tuple]) -> dict[str, np.ndarray]:
    """name -> the first output of (program, input) run in ExecuTorch's runtime (one process for all)."""
    with tempfile.TemporaryDirectory(prefix="execupy-xnnq-") as tmp:
        jobs = {}
        for name, (prog, x) in programs.items():
            (Path(tmp) / f"{name}.pte").write_bytes(prog.buffer)
            np.savez(Path(tmp) / f"{name}.in.npz", in0=x.numpy())
            jobs[name] = {"pte": f"{tmp}/{name}.pte", "inputs": f"{tmp}/{name}.in.npz", "out": f"{tmp}/{name}.out.npz"}
        (Path(tmp) / "jobs.json").write_text(json.dumps(list(jobs.values())))
        proc = subprocess.run([str(reference.reference_python()), "-c", _BATCH_WORKER, f"{tmp}/jobs.json"],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        for name, job in jobs.items():
            assert not Path(job["out"] + ".err").exists(), f"{name}: {Path(job['out'] + '.err').read_text()}"
        return {name: np.load(job["out"])["arr_0"] for name, job in jobs.items()}


@pytest.mark.reference
def test_executorch_runs_the_same_programs():
    theirs = executorch_outputs({name: lowered(name)[2:0:-1] for name in NAMES})
    for name in NAMES:
        converted, x, prog = lowered(name)
        # The same XNNPACK arithmetic on both sides: equal up to float summation order.
        scale = float(np.abs(theirs[name]).max())
        np.testing.assert_allclose(run_ours(prog, x), theirs[name], atol=1e-4 * scale + 1e-6, rtol=0)
        close_to_torch(theirs[name], converted(x).detach().numpy())


# ---------------------------------------------------------------- static int8

QS8_KINDS = ("FullyConnected", "Conv2d", "DepthwiseConv2d")
# Conv1d (3-D) is not delegated, and MultiheadAttention slices its packed in_proj weight after
# dequantizing it: those layers stay on the portable kernels; all others become qs8 nodes.
ALL_LAYERS_QS8 = [n for n in NAMES if n not in ("transformer_encoder", "audio_conv1d")]


def layer_count(converted: torch.fx.GraphModule) -> int:
    layers = (torch.ops.aten.linear.default, torch.ops.aten.addmm.default, torch.ops.aten.conv2d.default)
    return sum(n.target in layers for n in converted.graph.nodes)


def output_step(converted: torch.fx.GraphModule) -> float:
    """The scale of the int8 output's last dequantize: one quantization step of the result."""
    dq = [n for n in converted.graph.nodes if n.target == torch.ops.quantized_decomposed.dequantize_per_tensor.default]
    return float(dq[-1].args[1])


@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("name", NAMES)
def test_static_int8_layers_become_qs8_nodes_and_match_torch(name, per_channel):
    converted, x, prog = lowered(name, dynamic=False, per_channel=per_channel)
    qs8 = [n for n in node_datatypes(prog, QS8_KINDS) if n[1:] == ("qint8", "qcint8")]
    assert len(qs8) == layer_count(converted) if name in ALL_LAYERS_QS8 else len(qs8) >= 1
    # XNNPACK's requantization rounds like torch's quantize: at most one step apart.
    np.testing.assert_allclose(run_ours(prog, x), converted(x).detach().numpy(), atol=1.01 * output_step(converted),
                               rtol=0)


@pytest.mark.reference
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_executorch_runs_the_same_static_int8_programs(per_channel):
    theirs = executorch_outputs({name: lowered(name, dynamic=False, per_channel=per_channel)[2:0:-1] for name in NAMES})
    for name in NAMES:
        converted, x, prog = lowered(name, dynamic=False, per_channel=per_channel)
        # The same integer arithmetic; a value on a rounding boundary may land one step apart.
        np.testing.assert_allclose(run_ours(prog, x), theirs[name], atol=1.01 * output_step(converted), rtol=0)


# ---------------------------------------------------------------- 8da4w linears (export-llm's quantize modes)


@lru_cache(maxsize=None)
def lowered_8da4w():
    """An MLP with export-llm's 8da4w linears (int8 per-token activations, int4 groups of 32)
    in the rows-first form export-llm --backend xnnpack writes: (model, input, program)."""
    from execupy.llm.export.quantize import quantize_linears
    from execupy.llm.export.xnnpack_linears import xnnpack_linear_forms

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 96, bias=False),
                                torch.nn.Linear(96, 10))
    xnnpack_linear_forms(quantize_linears(model, "8da4w", group_size=32))
    x = torch.randn(1, 5, 128)
    prog = to_edge_transform_and_lower(export(model, (x,)), partitioner=[XnnpackPartitioner()]).to_executorch()
    return model, x, prog


def test_8da4w_linears_become_qd8_qb4w_fully_connected_and_match_torch():
    model, x, prog = lowered_8da4w()
    assert node_datatypes(prog) == [("FullyConnected", "qdint8", "qbint4")] * 3
    got = run_ours(prog, x)
    # XNNPACK keeps the block scales in bf16: a relative change of at most 2^-9 per weight.
    close_to_torch(got, model(x).detach().numpy())


@pytest.mark.reference
def test_executorch_runs_the_8da4w_program_as_we_do():
    model, x, prog = lowered_8da4w()
    (theirs,) = reference.run_reference(prog.buffer, [x.numpy()])[0]
    ours = run_ours(prog, x)
    np.testing.assert_allclose(ours, theirs, atol=1e-4 * float(np.abs(theirs).max()) + 1e-6, rtol=0)
