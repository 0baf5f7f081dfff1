"""Programs written by our own exporter, laid out like ExecuTorch's conformance corpus.

`write_corpus(folder, cases)` exports the models below (the case list, name -> flavour,
is tests/programs.py's OWN_CASES; case "execupy-<topic>" is built by the function <topic>
here) with execupy.exir and writes, per case,
model.pte, manifest.json, inputs*.npz and expected*.npz in the layout of
../shared/conformance (see tests/conformance.py), so the runtime, CLI, round-trip and
fuzz tests run on them exactly as on ExecuTorch's programs. The expected values are
torch eager's outputs of the same module, never our runtime's. Manifest facts
(operators, delegates) come from the exporter's in-memory program, not from reading
the file back. tests/programs.py caches the folder; this module needs torch.

Several models mirror the conformance cases that tests name (multi_method,
dynamic_batch_seq, state_kv_cache...) so that the facts those tests check hold for both.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim, export
from torch.utils import _pytree as pytree

from execupy.backends.numpy_fused.aot import NumpyFusedPartitioner
from execupy.exir import to_edge
from execupy.schema import program as P
from execupy.schema import read_pte
from execupy.schema.writer import write_pte

from . import zoo
from .test_backend import Mixed

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    id: str
    session: int
    method: str
    args: tuple


@dataclass
class Model:
    """What to export (one module per method) and the runs to record, in order."""

    methods: dict[str, tuple[nn.Module, tuple]]
    runs: list[Run]
    description: str
    dynamic_shapes: dict[str, Any] = field(default_factory=dict)  # method -> torch dynamic_shapes
    constant_methods: dict[str, Any] = field(default_factory=dict)
    atol: float = 1e-5
    rtol: float = 1e-5
    delegate: bool = False  # lower with NumpyFusedPartitioner
    rename_backend: Optional[str] = None  # rewrite every delegate id: a backend this runtime lacks


def single(module: nn.Module, args: tuple, description: str, more: tuple = (), calls: tuple = (), **kw) -> Model:
    """A forward-only model: `calls` continue session 0 (state carries), `more` are fresh loads."""
    runs = [Run("main", 0, "forward", args)]
    runs += [Run(f"call{k + 2}", 0, "forward", a) for k, a in enumerate(calls)]
    runs += [Run("alt" if k == 0 else f"alt{k + 1}", k + 1, "forward", a) for k, a in enumerate(more)]
    return Model({"forward": (module, args)}, runs, description, **kw)


class Fn(nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


# ---------------------------------------------------------------------------- models


def add_sub_mul_div_broadcast():
    def f(a, b, c):
        return a + b, a - c, a * b * c, a / (c.abs() + 0.5), a + 2.5, 3.0 - a, a * -1.5
    return single(Fn(f), (torch.randn(2, 3, 4), torch.randn(3, 1), torch.randn(4)),
                  "Binary arithmetic with broadcasting and scalar operands; no constants at all.")


def nested_outputs():
    def f(x, y):
        return {"sum": x + y, "pair": (x * y, (x - y).abs()), "items": [x.max(dim=1).values, y.argmin(dim=1)]}
    return single(Fn(f), (torch.randn(2, 3), torch.randn(2, 3)), "Outputs nested in a dict, a tuple and a list.")


class EncDec(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 4), nn.Linear(4, 6)

    def encode(self, x):
        return torch.tanh(self.enc(x))

    def decode(self, z, scale):
        return self.dec(z) * scale

    def forward(self, x):
        return self.decode(self.encode(x), torch.ones(1))


class MethodOf(nn.Module):
    def __init__(self, model: nn.Module, method: str):
        super().__init__()
        self.model, self.method = model, method

    def forward(self, *args):
        return getattr(self.model, self.method)(*args)


def multi_method():
    m = EncDec().eval()
    x, z = torch.randn(3, 6), torch.randn(3, 4)
    methods = {"forward": (m, (x,)), "encode": (MethodOf(m, "encode"), (x,)),
               "decode": (MethodOf(m, "decode"), (z, torch.tensor([0.5])))}
    runs = [Run("main", 0, "forward", (x,)), Run("encode", 0, "encode", (x,)),
            Run("decode", 0, "decode", (z, torch.tensor([0.5])))]
    return Model(methods, runs, "Three methods sharing weights, and a constant method get_max_seq_len.",
                 constant_methods={"get_max_seq_len": 128}, atol=1e-4, rtol=1e-4)


class DynMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        return y, y.mean(dim=1), torch.softmax(y, dim=-1)


def dynamic_batch_seq():
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=32)
    return single(DynMLP().eval(), (torch.randn(2, 5, 16),), "Batch in [1, 8] and sequence in [2, 32].",
                  more=((torch.randn(7, 23, 16),),), dynamic_shapes={"forward": ({0: batch, 1: seq},)},
                  atol=1e-4, rtol=1e-4)


class KVCacheAttention(nn.Module):
    """Single-head attention over a KV cache written in place at input_pos."""

    def __init__(self, d=8, max_t=8):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.register_buffer("k_cache", torch.zeros(1, max_t, d))
        self.register_buffer("v_cache", torch.zeros(1, max_t, d))
        self.max_t = max_t

    def forward(self, x, input_pos):
        self.k_cache.index_put_((torch.zeros_like(input_pos), input_pos), self.k(x)[0])
        self.v_cache[:, input_pos] = self.v(x)
        q = self.q(x)
        scores = q @ self.k_cache.transpose(1, 2) / math.sqrt(q.shape[-1])
        mask = torch.arange(self.max_t)[None, :] <= input_pos[:, None]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        return torch.softmax(scores, dim=-1) @ self.v_cache


def state_kv_cache():
    return single(KVCacheAttention().eval(), (torch.randn(1, 3, 8), torch.tensor([0, 1, 2])),
                  "KV cache in mutable buffers: call 1 writes positions 0-2, call 2 writes 3-5.",
                  calls=((torch.randn(1, 3, 8), torch.tensor([3, 4, 5])),), atol=1e-4, rtol=1e-4)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.tensor([10.0, -3.0]))

    def forward(self, x):
        self.count.add_(1.0)
        return x * self.count


def state_counter_initialized():
    x = torch.randn(3, 2)
    return single(Counter(), (x,), "Mutable buffer with a non-zero initial value, incremented each call.",
                  calls=((x,), (x * 2,)))


class ScalarArgs(nn.Module):
    def forward(self, x, n: int, s: float, flag: bool):
        y = x * n + s
        return y.relu() if flag else y


def scalar_inputs():
    return single(ScalarArgs(), (torch.randn(2), 3, 0.5, True), "int, float and bool inputs, fixed at export.")


def cond():
    model, (x,) = zoo.cond_branches()
    return single(model, (x,), "torch.cond: both branches through jumps and moves.",
                  more=((-torch.rand(2, 4) - 0.1,), (torch.rand(2, 4) + 0.1,)), atol=1e-5, rtol=1e-4)


class BigConstant(nn.Module):
    """A 256x256 weight (256 KiB), its bias, and two small int64 tables."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 256)
        self.register_buffer("index", torch.tensor([3, 1, 2]))
        self.register_buffer("offset", torch.tensor([7]))

    def forward(self, x):
        return self.fc(x), self.index + self.offset


def big_constant():
    return single(BigConstant().eval(), (torch.randn(1, 256),), "A constant segment larger than 256 KiB.",
                  atol=1e-4, rtol=1e-4)


def linear_relu():
    return single(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), (torch.randn(3, 8),),
                  "Two linear layers with a ReLU between.", atol=1e-4, rtol=1e-4)


def llama_block():
    model, args = zoo.llama_block()
    return single(model, args, "A Llama block: RMSNorm, RoPE, GQA attention, SwiGLU.", atol=1e-4, rtol=1e-3)


def gpt2_block_dynamic():
    model, args = zoo.dynamic_gpt2_block()
    return single(model, args, "A GPT-2 block with a dynamic sequence length.", more=((torch.randn(1, 11, 16),),),
                  dynamic_shapes={"forward": zoo.by_name("dynamic_gpt2_block").dynamic_shapes}, atol=1e-4, rtol=1e-3)


def cnn_bn_pool():
    model, args = zoo.cnn_bn_pool()
    return single(model, args, "Convolutions, batch norm, pooling.", atol=1e-4, rtol=1e-3)


def int_tensors():
    model, args = zoo.int_tensors()
    return single(model, args, "int32 arithmetic, floor division, remainder, comparison, casts.")


def bool_tensors():
    model, args = zoo.bool_tensors()
    return single(model, args, "Boolean masks: and, or, not, where.")


def bfloat16_linear():
    model, args = zoo.bfloat16_linear()
    return single(model, args, "bfloat16 weights and activations.", atol=5e-2, rtol=2e-2)


def example_classifier():
    """The model of the shipped example program (scripts/make_example.py)."""
    path = REPO / "scripts" / "make_example.py"
    spec = importlib.util.spec_from_file_location("make_example", path)
    make_example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_example)
    return single(make_example.TinyClassifier().eval(), (torch.randn(4, 16),),
                  "The README's example: layer norm, two linear layers, softmax.", atol=1e-5, rtol=1e-4)


def mixed_partition():
    return single(Mixed().eval(), (torch.randn(4, 6),), "Two NumpyFusedBackend delegates with a kernel between.",
                  delegate=True, atol=1e-4, rtol=1e-4)


MISSING_BACKEND = "NoSuchBackend"  # unknown_backend names it; tests expect it in the error


def unknown_backend():
    return single(Mixed().eval(), (torch.randn(4, 6),), "mixed_partition with its delegates renamed to "
                  f"{MISSING_BACKEND}, a backend no runtime has.", delegate=True,
                  rename_backend=MISSING_BACKEND, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- export and record


def export_model(model: Model) -> tuple[bytes, P.Program]:
    """The .pte bytes and the program as the exporter built it."""
    eps = {name: export(module, args, dynamic_shapes=model.dynamic_shapes.get(name))
           for name, (module, args) in model.methods.items()}
    edge = to_edge(eps, constant_methods=model.constant_methods or None)
    if model.delegate:
        edge = edge.to_backend(NumpyFusedPartitioner())
    prog = edge.to_executorch()
    if model.rename_backend is None:
        return prog.buffer, prog.program
    written = read_pte(prog.buffer)  # for its segments: constants and payloads as laid out
    segments = [written.segment(i) for i in range(len(written.program.segments))]
    for plan in prog.program.execution_plan:
        for d in plan.delegates:
            d.id = model.rename_backend
    return write_pte(prog.program, segments), prog.program


def eager_runs(model: Model) -> list[list[Any]]:
    """Outputs of every run, each session on a fresh copy of the modules (state carries within one)."""
    sessions: dict[int, dict[str, nn.Module]] = {}
    results = []
    with torch.no_grad():
        for run in model.runs:
            modules = sessions.setdefault(run.session, copy.deepcopy({k: m for k, (m, _) in model.methods.items()}))
            results.append(pytree.tree_leaves(modules[run.method](*run.args)))
    return results


def to_array(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.detach().view(torch.int16).numpy().view(np.uint16)  # the corpus stores bf16 as bits
    return t.detach().numpy().copy()


def dtype_name(t: torch.Tensor) -> str:
    return "bfloat16" if t.dtype == torch.bfloat16 else str(to_array(t).dtype)


def input_specs(args: tuple) -> list[dict]:
    specs = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            specs.append({"name": f"in{i}", "index": i, "kind": "tensor", "dtype": dtype_name(a), "shape": list(a.shape)})
        else:
            specs.append({"name": f"in{i}", "index": i, "kind": type(a).__name__, "value": a})
    return specs


def output_specs(outputs: list) -> list[dict]:
    return [{"name": f"out{k}", "dtype": dtype_name(o), "shape": list(o.shape)} for k, o in enumerate(outputs)]


def manifest_dynamic_shapes(model: Model) -> Optional[dict]:
    """forward's dynamic axes in the corpus form: {"inN": {"axis": {name, min, max}}}."""
    shapes = model.dynamic_shapes.get("forward")
    if not shapes:
        return None
    out = {}
    for i, axes in enumerate(shapes):
        if axes:
            out[f"in{i}"] = {str(k): {"name": d.__name__, "min": d.min, "max": d.max} for k, d in axes.items()}
    return out


def op_name(op: P.Operator) -> str:
    return f"{op.name}.{op.overload}" if op.overload else op.name


def write_case(folder: Path, name: str, flavour: str) -> None:
    """Case `name` ("execupy-<topic>"): the model is built by the function named <topic> above."""
    torch.manual_seed(0)
    model = globals()[name.removeprefix("execupy-")]()
    outputs = eager_runs(model)  # before export: copies of the untouched modules
    data, program = export_model(model)
    case_dir = folder / name
    case_dir.mkdir(parents=True)
    (case_dir / "model.pte").write_bytes(data)
    runs = []
    for run, outs in zip(model.runs, outputs):
        suffix = "" if run.id == "main" else f"_{run.id}"
        np.savez(case_dir / f"inputs{suffix}.npz",
                 **{f"in{i}": to_array(a) for i, a in enumerate(run.args) if isinstance(a, torch.Tensor)})
        np.savez(case_dir / f"expected{suffix}.npz", **{f"out{k}": to_array(o) for k, o in enumerate(outs)})
        runs.append({"id": run.id, "method": run.method, "session": run.session, "inputs_file": f"inputs{suffix}.npz",
                     "expected_file": f"expected{suffix}.npz", "inputs": input_specs(run.args),
                     "outputs": output_specs(outs)})
    plans = {p.name: p for p in program.execution_plan}
    manifest = {
        "name": name, "flavour": flavour, "description": model.description,
        "producer": {"execupy": "tests/exir/corpus.py", "torch": torch.__version__},
        "method_names": list(model.methods) + list(model.constant_methods),
        "operators": {method: [op_name(op) for op in plan.operators] for method, plan in plans.items()},
        "delegates": {method: [d.id for d in plan.delegates] for method, plan in plans.items()},
        "inputs": runs[0]["inputs"], "outputs": runs[0]["outputs"], "runs": runs,
        "tolerance": {"atol": model.atol, "rtol": model.rtol, "note": "against torch eager"},
        "dynamic_shapes": manifest_dynamic_shapes(model),
        "stateful": any(run["id"].startswith("call") for run in runs),
        "pte_bytes": len(data), "eager_reference": "torch eager on the same module",
    }
    (case_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))


def write_corpus(folder: Path, cases: dict[str, str]) -> None:
    """Each case of `cases` (name -> flavour) under `folder`, and an index.json like the
    conformance corpus's."""
    with warnings.catch_warnings():  # torch's run_decompositions deep-copies a deprecated LeafSpec
        warnings.simplefilter("ignore", FutureWarning)
        for name, flavour in cases.items():
            try:
                write_case(folder, name, flavour)
            except Exception as e:  # every test of our programs fails on this; say which one broke
                raise RuntimeError(f"writing the test program {name} failed: {type(e).__name__}: {e}") from e
    index = [{"name": name, "flavour": flavour} for name, flavour in cases.items()]
    (folder / "index.json").write_text(json.dumps({"cases": index}, indent=1))
