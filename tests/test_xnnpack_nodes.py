"""Each XNNPACK node type and datatype ExecuTorch 1.5.1's partitioner emits runs in execupy as
in ExecuTorch's runtime, beyond what the conformance corpus covers.

Small modules are lowered by ExecuTorch's XnnpackPartitioner in the reference venv (a
subprocess; fp32, fp16, static int8 and dynamic int8 quantized with its XNNPACKQuantizer,
int8 x int4 with torchao) and run there once; the programs and outputs are cached in
~/.cache/execupy-conformance. Each case names the node kinds and datatypes its XNNGraph
must hold (read with execupy's payload reader), so the test proves what it covers.

Tolerances: fp32 1e-5 relative to the output's scale (same math, other summation order);
fp16 2e-3 (XNNPACK's f16 kernels round inside a product, we round once); static int8:
one output quantization step (the int8 add/pool kernels use fixed point, we use float);
dynamic int8 FullyConnected (qd8 x qc8w / qc4w / qb4w): bit for bit (execupy reproduces
XNNPACK's integer sums, its packed weight sums and its float32 rounding steps); dynamic
int8 convolutions: 1e-4 relative.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from execupy.backends.xnnpack.schema import read_payload
from execupy.runtime import Program

from .cpu import XNNPACK_4BIT, XNNPACK_ELEMENTWISE
from .reference import run_worker_once, worker_case_outputs

pytestmark = [pytest.mark.reference, pytest.mark.slow]

STRESS_ROWS = ("(torch.cat([torch.randn(2, 576) * 3, torch.randn(1, 576) * 0.01 + torch.eye(1, 576) * 50, "
               "-torch.rand(1, 576), torch.zeros(1, 576), torch.rand(1, 576), "
               "(torch.arange(576) % 255 - 127).float().reshape(1, 576) / 127.5, "
               "torch.linspace(-1, 1, 576).reshape(1, 576)]).reshape(2, 4, 576),)")

# name: model (an nn.Module expression), inputs, quant ("", "fp16", "static", "dynamic", "dynamic4" (4-bit
# channelwise weights), "int4:<group>"),
# the node kinds / datatypes the XNNGraph must contain, and exact=True where execupy must
# match ExecuTorch's runtime bit for bit.
CASES = {
    "conv_transpose": dict(model="nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1)",
                           inputs="(torch.randn(2, 4, 5, 6),)", nodes=["ConvTranspose2d"]),
    "conv_transpose_groups": dict(model="nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 1), groups=2)",
                                  inputs="(torch.randn(1, 4, 5, 6),)", nodes=["ConvTranspose2d"]),
    "conv_asymmetric": dict(model="nn.Conv2d(3, 5, (3, 2), stride=(1, 2), padding=(1, 0), dilation=(2, 1))",
                            inputs="(torch.randn(2, 3, 9, 8),)", nodes=["Conv2d"]),
    "avg_pool": dict(model="Fn(lambda x: F.avg_pool2d(x, 3, 2, padding=1, count_include_pad=False))",
                     inputs="(torch.randn(2, 3, 9, 8),)", nodes=["AvgPooling2d"]),
    "max_pool_padded": dict(model="Fn(lambda x: F.max_pool2d(x, 3, 2, padding=1))",
                            inputs="(torch.randn(2, 3, 9, 8),)", nodes=["MaxPooling2d"]),
    "resize_bilinear": dict(model="Fn(lambda x: F.interpolate(x, scale_factor=2, mode='bilinear'))",
                            inputs="(torch.randn(1, 3, 4, 5),)", nodes=["StaticResizeBilinear2D"]),
    "resize_bilinear_align": dict(
        model="Fn(lambda x: F.interpolate(x, size=(7, 9), mode='bilinear', align_corners=True))",
        inputs="(torch.randn(1, 3, 4, 5),)", nodes=["StaticResizeBilinear2D"]),
    "prelu": dict(model="nn.Sequential(nn.Conv2d(3, 4, 1), nn.PReLU(4))", inputs="(torch.randn(1, 3, 4, 4),)",
                  nodes=["PReLU"]),
    "fused_hardtanh": dict(model="Fn(lambda x: F.hardtanh(x * 2, -0.3, 0.8))", inputs="(torch.randn(4, 8),)",
                           nodes=["Multiply"]),  # the clamp is the Multiply's output_min/max
    "cat3_cat4_cat5": dict(
        model="Fn(lambda a, b, c, d, e: (torch.cat([a, b, c], 1) * 2, torch.cat([a, b, c, d], 0) + 1, "
              "torch.cat([a, b, c, d, e], 1) - 1))",
        inputs="tuple(torch.randn(2, 3) for _ in range(5))", nodes=["Concatenate3", "Concatenate4", "Concatenate5"]),
    "sin_cos_neg_sqrt": dict(model="Fn(lambda x: torch.sin(x) * torch.cos(x) - torch.sqrt(x.abs() + 1) - x.neg())",
                             inputs="(torch.randn(3, 5),)", nodes=["Sin", "Cos", "SquareRoot"]),
    "sdpa": dict(model="Fn(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m))",
                 inputs="(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8), "
                        "torch.randn(5, 7))", nodes=[]),
    "fp16_conv_linear": dict(model="nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))",
                             inputs="(torch.randn(2, 3, 6, 6),)", quant="fp16", nodes=["Conv2d", "FullyConnected"],
                             datatypes=["fp16"]),
    "static_int8_pool": dict(
        model="Fn2(nn.Conv2d(3, 4, 3, padding=1), lambda c, x: F.max_pool2d(c(x), 2).relu())",
        inputs="(torch.randn(2, 3, 8, 8),)", quant="static", nodes=["Conv2d", "MaxPooling2d"],
        datatypes=["qint8", "qcint8"]),
    # a CNN's global average pool on int8 data: one compiled pass (quant.mean_quantized), the bits
    # of the loader's, numpy's mean's and the storer's steps, which are ExecuTorch's here
    "static_int8_global_pool": dict(
        model="Fn2(nn.Conv2d(3, 24, 3, padding=1), lambda c, x: F.adaptive_avg_pool2d(c(x).relu(), 1))",
        inputs="(torch.randn(2, 3, 9, 9),)", quant="static", nodes=["GlobalAvgPooling2d"], datatypes=["qint8"],
        exact=True),
    "static_int8_depthwise_hardtanh": dict(
        model="nn.Sequential(nn.Conv2d(4, 8, 3, groups=4, padding=1), nn.Hardtanh(0, 6))",
        inputs="(torch.randn(1, 4, 7, 7),)", quant="static", nodes=["DepthwiseConv2d"], datatypes=["qint8"]),
    "dynamic_int8_linear": dict(model="nn.Sequential(nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8))",
                                inputs="(torch.randn(3, 5, 32),)", quant="dynamic", nodes=["FullyConnected"],
                                datatypes=["qdint8", "qcint8"]),
    "dynamic_int8_conv": dict(model="nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))",
                              inputs="(torch.randn(2, 3, 6, 7),)", quant="dynamic", nodes=["Conv2d"],
                              datatypes=["qdint8", "qcint8"]),
    "dynamic_int8_int4_channelwise": dict(model="nn.Sequential(nn.Linear(64, 24), nn.ReLU(), nn.Linear(24, 10))",
                                          inputs="(torch.randn(3, 64),)", quant="dynamic4", nodes=["FullyConnected"],
                                          datatypes=["qdint8", "qcint4"]),
    "int8_int4_per_channel": dict(model="nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 10))",
                                  inputs="(torch.randn(4, 64),)", quant="int4:0", nodes=["FullyConnected"],
                                  datatypes=["qdint8"]),
    # Rows chosen to stress the per-row int8 quantization: large and small ranges, a lone
    # outlier, negative-only, all-zero, positive-only, values on rounding ties, a ramp.
    "int8_int4_group32_stress": dict(model="nn.Linear(576, 80)", inputs=STRESS_ROWS, quant="int4:32",
                                     nodes=["FullyConnected"], datatypes=["qdint8", "qbint4"], exact=True),
    "int8_int4_group32_wide": dict(model="nn.Sequential(nn.Linear(1536, 48, bias=False))",
                                   inputs="(torch.randn(5, 1536) * 4,)", quant="int4:32", nodes=["FullyConnected"],
                                   datatypes=["qdint8", "qbint4"], exact=True),
    "dynamic_int8_linear_stress": dict(model="nn.Linear(576, 40)", inputs=STRESS_ROWS, quant="dynamic",
                                       nodes=["FullyConnected"], datatypes=["qdint8", "qcint8"], exact=True),
    "sigmoid_rsqrt": dict(model="Fn(lambda x: torch.sigmoid(x) * torch.rsqrt(x.abs() + 1e-3))",
                          inputs="(torch.randn(64, 97) * 6,)", nodes=["Sigmoid", "ReciprocalSquareRoot"], exact=True),
    # a SwiGLU's gate: Sigmoid, Multiply, Multiply (backends/xnnpack/fused.py runs them as one step)
    "swiglu": dict(model="Fn(lambda g, u: F.silu(g) * u)", inputs="(torch.randn(64, 97) * 6, torch.randn(64, 97) * 3)",
                   nodes=["Sigmoid", "Multiply"], exact=True),
    # GELU's rational interpolant, on both sides of its clamp at +-5.16 and on its tails
    "gelu": dict(model="nn.GELU()", inputs="(torch.cat([torch.randn(64, 97) * 3, torch.linspace(-9, 9, 97)[None]]),)",
                 nodes=["Gelu"], exact=True),
    # fp32 linears with a bias: in <= out ones take the bias as one more input row of the product
    # (the first with the ReLU as its output bounds), the narrowing last one adds it after
    "fp32_linear_bias": dict(model="nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 40), nn.Linear(40, 8))",
                             inputs="(torch.randn(2, 5, 16) * 2,)", nodes=["FullyConnected"], datatypes=["fp32"]),
    # a classifier's one row: mat-vecs shared with the second core's thread (kernels/fast/dense.py);
    # the static int8 filter in two runs of exact float32 sums (uniform weights: 3072 x ~64 x 128 > 2**24)
    "fp32_classifier": dict(model="nn.Linear(640, 100)", inputs="(torch.randn(1, 640),)", nodes=["FullyConnected"],
                            datatypes=["fp32"]),
    "static_int8_classifier": dict(model="(lambda fc: (nn.init.uniform_(fc.weight, -1, 1), fc)[1])(nn.Linear(3072, 64))",
                                   inputs="(torch.randn(1, 3072) * 3,)", quant="static",
                                   nodes=["FullyConnected"], datatypes=["qint8"], exact=True),
    # an encoder's attention without the SDPA op: two batched products (queries @ keys.T, then
    # @ values) on the conv GEMM's tiles, the batch of heads one job for both cores
    "attention_products": dict(model="Fn(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), -1) @ v)",
                               inputs="(torch.randn(1, 4, 24, 16), torch.randn(1, 4, 24, 16), torch.randn(1, 4, 24, 16))",
                               nodes=["BatchMatrixMultiply"], datatypes=["fp32"]),
    "int8_int4_group32": dict(model="nn.Sequential(nn.Linear(64, 24, bias=False))",
                              inputs="(torch.randn(2, 3, 64),)", quant="int4:32", nodes=["FullyConnected"],
                              datatypes=["qdint8", "qbint4"]),
}

_WORKER = r"""
import json, sys, traceback
from pathlib import Path
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
from executorch.exir import to_edge_transform_and_lower
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.extension.pybindings.portable_lib import _load_for_executorch


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


class Fn2(nn.Module):
    def __init__(self, layer, fn):
        super().__init__()
        self.layer, self.fn = layer, fn

    def forward(self, x):
        return self.fn(self.layer, x)


def quantize(model, args, how):
    if how == "fp16":
        return model.half(), tuple(a.half() for a in args)
    if how in ("static", "dynamic", "dynamic4"):
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            XNNPACKQuantizer, get_symmetric_quantization_config)
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        bits4 = dict(weight_qmin=-8, weight_qmax=7) if how == "dynamic4" else {}
        config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=how != "static", **bits4)
        m = prepare_pt2e(torch.export.export(model, args).module(), XNNPACKQuantizer().set_global(config))
        m(*args)
        return convert_pt2e(m), args
    if how.startswith("int4:"):
        from torchao.quantization.granularity import PerAxis, PerGroup
        from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, quantize_
        group = int(how.split(":")[1])
        granularity = PerGroup(group) if group else PerAxis(0)
        quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=granularity))
        return model, args
    return model, args


cases, folder = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
report = {}
for name, case in cases.items():
    try:
        torch.manual_seed(0)
        model, args = eval(case["model"]).eval(), eval(case["inputs"])
        with torch.no_grad():
            model, args = quantize(model, args, case.get("quant", ""))
            program = to_edge_transform_and_lower(torch.export.export(model, args),
                                                  partitioner=[XnnpackPartitioner()]).to_executorch()
        (folder / f"{name}.pte").write_bytes(program.buffer)
        outputs = _load_for_executorch(str(folder / f"{name}.pte")).forward(args)
        np.savez(folder / f"{name}.npz", **{f"in{i}": a.numpy() for i, a in enumerate(args)},
                 **{f"out{i}": o.numpy() for i, o in enumerate(outputs)})
        report[name] = "ok"
    except Exception as e:
        report[name] = "".join(traceback.format_exception_only(e)).strip()[-800:]
(folder / "report.json").write_text(json.dumps(report, indent=1))
"""


def lowered_programs() -> tuple[Path, dict]:
    """Lower and run every case in the reference venv once; cached under a hash of the cases,
    the worker and the venv."""
    return run_worker_once(_WORKER, json.dumps(CASES, sort_keys=True), "xnnpack-nodes")


@pytest.fixture(scope="module")
def programs() -> tuple[Path, dict]:
    return lowered_programs()


def _graphs(pte: Path) -> list:
    program = Program.load(str(pte))
    return [read_payload(program.delegate_payload(d.processed))
            for name in program.method_names for d in program.plan(name).delegates if d.id == "XnnpackBackend"]


def _reproduced_here(graphs: list) -> bool:
    """Whether ExecuTorch's XNNPACK runs, on this CPU, the kernels execupy reproduces bit for bit
    for every node of the graphs (tests/cpu.py)."""
    kinds = {n.kind for g in graphs for n in g.nodes}
    datatypes = {v.datatype for g in graphs for v in g.values}
    if kinds & {"Sigmoid", "ReciprocalSquareRoot"} and not XNNPACK_ELEMENTWISE:
        return False
    return XNNPACK_4BIT or not datatypes & {"qcint4", "qbint4"}


def _tolerance(case: dict, expected: np.ndarray, graphs: list) -> float:
    scale = float(np.abs(expected).max()) or 1.0
    if not _reproduced_here(graphs):
        return 2e-6 * scale  # other kernels than the ones reproduced: a few ulps (tests/cpu.py)
    if case.get("exact"):
        return 0.0
    quant = case.get("quant", "")
    if quant == "fp16":
        return 2e-3 * scale
    if quant == "static":  # one step of the graph's output quantization
        steps = [v.quant.scale[0] for g in graphs for v in g.values if v.datatype == "qint8"]
        return 1.01 * max(steps)
    if quant and {n.kind for g in graphs for n in g.nodes} <= {"Convert", "FullyConnected"}:
        return 0.0  # XNNPACK's dynamically quantized FullyConnected, reproduced bit for bit
    return (1e-4 if quant else 1e-5) * scale


@pytest.mark.parametrize("name", CASES)
def test_xnnpack_nodes_run_as_in_executorch(programs, name):
    folder, report = programs
    case = CASES[name]
    assert report[name] == "ok", f"ExecuTorch could not lower or run the case: {report[name]}"
    graphs = _graphs(folder / f"{name}.pte")
    assert graphs, "nothing was delegated to XNNPACK"
    kinds = {n.kind for g in graphs for n in g.nodes}
    datatypes = {v.datatype for g in graphs for v in g.values}
    assert set(case["nodes"]) <= kinds, f"the graph holds {sorted(kinds)}"
    assert set(case.get("datatypes", [])) <= datatypes, f"the graph holds {sorted(datatypes)}"
    _, expected, got = worker_case_outputs(folder, name)
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        atol = _tolerance(case, theirs, graphs)
        np.testing.assert_allclose(ours.astype(np.float64), theirs.astype(np.float64), rtol=0, atol=atol)


@pytest.mark.parametrize("name", ["int8_int4_group32_stress", "int8_int4_group32_wide"])
def test_qb4w_filters_packed_from_their_values_give_executorchs_bits_too(programs, name, monkeypatch):
    """A qb4w filter is packed straight from its stored bytes where they lie [out, in / 2]; one
    stored otherwise (transposed) is unpacked and packed from its values: the same bits."""
    from execupy.backends.xnnpack.runtime import GraphContext

    monkeypatch.setattr(GraphContext, "nibbles", lambda self, i: None)  # every filter the other way
    folder, report = programs
    assert report[name] == "ok", f"ExecuTorch could not lower or run the case: {report[name]}"
    _, expected, got = worker_case_outputs(folder, name)
    exact = _reproduced_here(_graphs(folder / f"{name}.pte"))
    for ours, theirs in zip(got, expected, strict=True):
        if exact:
            np.testing.assert_array_equal(ours, theirs)
        else:  # ExecuTorch's kernels here are not the ones reproduced (tests/cpu.py)
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6 * float(np.abs(theirs).max()))


@pytest.mark.parametrize("name", CASES)
def test_delegates_bound_on_fixed_arrays_give_the_bits_of_the_value_list_walk(programs, name, monkeypatch):
    """A delegate call whose arrays are fixed at bind (a static program's, a shape plan's) runs the
    nodes that can write into fixed arrays (products, element-wise nodes, fused patterns;
    nodes.FixedBinding) as those calls; without binding, every node's step walks a value list.
    The outputs are the same bits."""
    from execupy.backends.xnnpack.runtime import XnnpackBackend

    folder, report = programs
    assert report[name] == "ok", f"ExecuTorch could not lower or run the case: {report[name]}"
    inputs, _, _ = worker_case_outputs(folder, name)
    bound = Program.load(str(folder / f"{name}.pte")).load_method("forward").execute(inputs)
    monkeypatch.setattr(XnnpackBackend, "bind", lambda self, handle, args, outs=None: None)
    walked = Program.load(str(folder / f"{name}.pte")).load_method("forward").execute(inputs)
    for ours, theirs in zip(bound, walked, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_a_gelus_delegate_runs_as_its_compiled_loop_alone(programs):
    """A delegate whose every node writes into fixed arrays is bound as those calls, nothing else."""
    folder, _ = programs
    method = Program.load(str(folder / "gelu.pte")).load_method("forward")
    bound = [step.run.__name__ for step in method._steps if step.__name__ == "call_bound_delegate"]
    assert bound == ["compiled_into_out"]


def test_a_swiglus_three_nodes_run_as_one_compiled_call(programs):
    """fused.py's SwiGLU: the Sigmoid and two Multiply nodes are one step, bound as one call (the
    bits are ExecuTorch's: the "swiglu" case above, exact)."""
    folder, _ = programs
    method = Program.load(str(folder / "swiglu.pte")).load_method("forward")
    (handle,) = method._delegate_handles.values()
    assert [s.__name__ for s in handle.steps if s.__name__ != "NOTHING"] == ["swiglu_step"]
    bound = [step.run.__name__ for step in method._steps if step.__name__ == "call_bound_delegate"]
    assert bound == ["swiglu_into_out"]


@pytest.mark.parametrize("name, runs", [("fp32_classifier", 1), ("static_int8_classifier", 2)])
def test_a_classifiers_one_row_is_a_shared_mat_vec(programs, name, runs, monkeypatch):
    """One row through a large filter reads it on both cores (dense.matvec_kernel), once per exact
    float32 run of an int8 filter, and still gives ExecuTorch's outputs (the case above). Where
    the CPU has AVX512-VNNI an int8 filter's runs are int8 products instead (a quarter of the bytes)."""
    from execupy.kernels.fast import dense
    from execupy.kernels.fast import xnnpack_gemm as XG

    if dense.matvec_kernel(decode_steps=False) is None:
        pytest.skip("numba (the `fast` extra) is not installed")
    calls = []
    monkeypatch.setattr(dense, "_LOADED", [lambda site, w, x, out: calls.append(("matvec", *w.shape))
                                           or np.matmul(w, x, out=out)])
    vnni = name.startswith("static_int8") and XG.NUMBA["vnni"]
    bind = XG.bind_channelwise
    monkeypatch.setattr(XG, "bind_channelwise", lambda w, *rest, **kw: calls.append(("vnni", *w.shape))
                        or bind(w, *rest, **kw))
    folder, report = programs
    assert report[name] == "ok", f"ExecuTorch could not lower or run the case: {report[name]}"
    _, expected, got = worker_case_outputs(folder, name)
    # the filters' shapes: the mat-vec's rows [out, in], bind_channelwise's w [out, in] at load
    assert len(calls) == runs and sum(k for _, _, k in calls) == (640 if runs == 1 else 3072)
    assert {kind for kind, _, _ in calls} == {"vnni" if vnni else "matvec"}
    np.testing.assert_allclose(got[0].astype(np.float64), expected[0].astype(np.float64), rtol=0,
                               atol=0 if runs > 1 else 1e-5 * float(np.abs(expected[0]).max()))


def test_an_attentions_batched_products_and_many_row_linears_run_on_the_gemm_tiles(programs, monkeypatch):
    """Batches of fp32 products of 6 rows or more (the heads' queries @ keys.T, then @ values) and
    fp32 FullyConnected nodes of 6 rows or more run on the conv GEMM's tiles (both cores'
    kernels), not BLAS, and still give ExecuTorch's outputs within float32 rounding."""
    from execupy.kernels.fast import conv as FC

    if FC.BACKEND != "numba":
        pytest.skip("numba (the `fast` extra) is not installed")
    calls = []
    real_batch, real_gemm = FC.batch_product_kernel, FC.gemm_kernel

    def batch_product_kernel(transpose_b):
        product = real_batch(transpose_b)
        return lambda a, b: calls.append(("batch", transpose_b, a.shape, b.shape)) or product(a, b)

    def gemm_kernel(w, bias, lo, hi, requantized=None):
        product = real_gemm(w, bias, lo, hi, requantized)
        return lambda rows: calls.append(("gemm", rows.shape, w.shape)) or product(rows)

    monkeypatch.setattr(FC, "batch_product_kernel", batch_product_kernel)
    monkeypatch.setattr(FC, "gemm_kernel", gemm_kernel)
    folder, report = programs
    for name in ("attention_products", "fp32_linear_bias"):
        assert report[name] == "ok", f"ExecuTorch could not lower or run the case: {report[name]}"
        _, expected, got = worker_case_outputs(folder, name)
        np.testing.assert_allclose(got[0].astype(np.float64), expected[0].astype(np.float64), rtol=0,
                                   atol=1e-5 * float(np.abs(expected[0]).max()))
    # (ExecuTorch's lowering transposes the keys in a node of its own: both products read B as it lies)
    assert calls == [("batch", False, (4, 24, 16), (4, 16, 24)), ("batch", False, (4, 24, 24), (4, 24, 16)),
                     ("gemm", (10, 16), (16, 40)), ("gemm", (10, 40), (40, 40)), ("gemm", (10, 40), (40, 8))]


def test_an_int8_global_pool_is_one_compiled_pass_with_numpys_bits(programs, monkeypatch):
    """quant.mean_quantized against the loader, numpy mean and storer steps it replaces."""
    from execupy.backends.xnnpack import quant as Q

    folder, report = programs
    assert report["static_int8_global_pool"] == "ok"
    if Q._COMPILED is None:
        pytest.skip("numba is not installed")
    method = Program.load(str(folder / "static_int8_global_pool.pte")).load_method("forward")
    (handle,) = method._delegate_handles.values()
    assert "step_quantized" in [s.__name__ for s, kind in zip(handle.steps, handle.node_kinds)
                                if kind == "GlobalAvgPooling2d"]
    inputs, expected, _ = worker_case_outputs(folder, "static_int8_global_pool")
    compiled = method.execute(inputs)
    monkeypatch.setattr(Q, "_COMPILED", None)
    plain = Program.load(str(folder / "static_int8_global_pool.pte")).load_method("forward").execute(inputs)
    for ours, theirs in zip(compiled, plain, strict=True):
        np.testing.assert_array_equal(ours, theirs)
