"""pt2e int8 quantization, ExecuTorch's way, over a zoo of small models.

Each model is quantized twice with execupy's XNNPACKQuantizer and torchao's
prepare_pt2e / convert_pt2e:
  static   int8 activations per tensor (calibrated), int8 weights per output channel;
  dynamic  linears only: activations per token, chosen at run time; weights per channel.
Every zoo model has a linear layer, so the dynamic mode quantizes something in each.

The converted model is exported to a .pte by execupy; then our runtime must match torch's
converted model, and ExecuTorch's runtime (with its quantized kernels) must match ours, to
within ONE QUANTIZATION STEP OF THE OUTPUT. A static model's output is dequantized from
int8, so its step is that final dequantize's scale (read from the converted graph); a
dynamic model's output is a linear's float result, and its step is the output's range
(max - min of torch's converted output on the test input) over 255, the width of one int8
level spread over that range. Rounding a value to the other neighbouring level (runtimes
order float operations differently) moves the output by about one step, no more.

ExecuTorch's runtime starts in a subprocess (about 10 s each on a small machine), so its
check runs one program per mode that calls all ten converted models at once: the same
graphs, exported and written the same way, and both runtimes run that file.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pytest
import torch
from torch.export import export
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from execupy.exir import to_edge
from execupy.quantization import XNNPACKQuantizer, get_symmetric_quantization_config
from execupy.runtime import Module, Program

from ..reference import run_reference
from .zoo import MODELS, Model, build

MODES = ("static", "dynamic")
CALIBRATION_BATCHES = 4


@dataclass
class Quantized:
    model: Model
    mode: str
    converted: torch.fx.GraphModule
    pte: bytes
    test_input: torch.Tensor

    @property
    def operators(self) -> set[str]:
        return set(Program.load(self.pte).method_meta("forward").operators)

    def torch_output(self) -> np.ndarray:
        with torch.no_grad():
            return self.converted(self.test_input).numpy()

    def step(self) -> float:
        """One quantization step of the output (see the module docstring)."""
        [output] = [n for n in self.converted.graph.nodes if n.op == "output"]
        [result] = output.args[0]
        if result.target == torch.ops.quantized_decomposed.dequantize_per_tensor.default:
            return float(result.args[1])
        out = self.torch_output()
        return float(out.max() - out.min()) / 255


@lru_cache(maxsize=None)
def quantize(model: Model, mode: str) -> Quantized:
    """The documented flow: export, prepare, calibrate, convert, export again, to_edge."""
    float_model = build(model)
    torch.manual_seed(1)
    example = (torch.randn(model.input_shape),)
    config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=mode == "dynamic")
    quantizer = XNNPACKQuantizer().set_global(config)
    prepared = prepare_pt2e(export(float_model, example).module(), quantizer)
    for _ in range(CALIBRATION_BATCHES):
        prepared(torch.randn(model.input_shape))
    converted = convert_pt2e(prepared)
    pte = to_edge(export(converted, example)).to_executorch().buffer
    return Quantized(model, mode, converted, pte, torch.randn(model.input_shape))


@pytest.fixture(scope="module", params=[(m, mode) for m in MODELS for mode in MODES],
                ids=[f"{m.name}-{mode}" for m in MODELS for mode in MODES])
def quantized(request) -> Quantized:
    """One export per model and mode, shared by the tests below."""
    return quantize(*request.param)


def assert_within_one_step(got: np.ndarray, expected: np.ndarray, step: float) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    worst = float(np.max(np.abs(got.astype(np.float64) - expected)))
    slack = 1 + 1e-4  # float32 rounding of the dequantized values
    assert worst <= step * slack, f"off by {worst:.3g}, more than one quantization step ({step:.3g})"


def test_program_runs_int8_weights_and_activations(quantized):
    ops = quantized.operators
    assert "quantized_decomposed::dequantize_per_channel.out" in ops  # int8 weights, per channel
    assert not any("batch_norm" in op for op in ops)  # prepare_pt2e folded them into the convs
    if quantized.mode == "static":
        assert {"quantized_decomposed::quantize_per_tensor.out",
                "quantized_decomposed::dequantize_per_tensor.out"} <= ops
        assert not any("per_token" in op for op in ops)
    else:
        assert {"quantized_decomposed::choose_qparams_per_token_asymmetric.out",
                "quantized_decomposed::quantize_per_token.out",
                "quantized_decomposed::dequantize_per_token.out"} <= ops
        assert "quantized_decomposed::quantize_per_tensor.out" not in ops


def test_our_runtime_matches_torch_converted_model(quantized):
    got = Module(quantized.pte).forward(quantized.test_input.numpy())
    assert_within_one_step(got, quantized.torch_output(), quantized.step())


def test_quantized_model_stays_close_to_float(quantized):
    """Quantization changed the numbers, but not the answer: within 8 % of the output range."""
    with torch.no_grad():
        float_out = build(quantized.model)(quantized.test_input).numpy()
    out = quantized.torch_output()
    assert not np.array_equal(out, float_out)
    assert np.max(np.abs(out - float_out)) <= 0.08 * (out.max() - out.min())


class AllModels(torch.nn.Module):
    """Calls every converted model of one mode on its own input, in one program."""

    def __init__(self, converted: list[torch.fx.GraphModule]):
        super().__init__()
        self.models = torch.nn.ModuleList(converted)

    def forward(self, *inputs):
        return tuple(model(x) for model, x in zip(self.models, inputs))


@lru_cache(maxsize=None)
def both_runtimes(mode: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """model name -> (our output, ExecuTorch's output) of the all-models program of `mode`."""
    models = [quantize(m, mode) for m in MODELS]
    inputs = tuple(q.test_input for q in models)
    pte = to_edge(export(AllModels([q.converted for q in models]), inputs)).to_executorch().buffer
    arrays = [x.numpy() for x in inputs]
    [reference] = run_reference(pte, arrays)
    ours = Module(pte).forward(*arrays)
    return {m.name: pair for m, pair in zip(MODELS, zip(ours, reference))}


@pytest.mark.reference
def test_executorch_runtime_matches_ours(quantized):
    ours, reference = both_runtimes(quantized.mode)[quantized.model.name]
    assert_within_one_step(reference, ours, quantized.step())
    assert_within_one_step(ours, quantized.torch_output(), quantized.step())  # the same graphs as the test above
