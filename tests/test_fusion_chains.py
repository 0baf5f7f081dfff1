"""Rule 3 of load-time fusion (docs/fusion.md): a run of float32 element-wise instructions is
one step, a numba loop where numba can run it and the portable kernels' numpy calls
elsewhere. Either way the outputs are bit-identical to the unfused plan, and every value
another step or the caller reads is still written.
"""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from execupy.kernels.fast import elementwise as ew
from execupy.runtime.program import Program

torch = pytest.importorskip("torch")

BACKENDS = ["numba", "numpy"]


def runtime_overhead_bench():
    """bench/runtime_overhead.py, whose chain program (x = x * a; x = x + b; ...) the tests export too."""
    path = Path(__file__).resolve().parents[1] / "bench" / "runtime_overhead.py"
    spec = importlib.util.spec_from_file_location("runtime_overhead", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


BENCH = runtime_overhead_bench()


def use_backend(backend: str, monkeypatch) -> None:
    if backend == "numba" and not ew.numba_enabled():
        pytest.skip("numba (the `fast` extra) is not installed")
    monkeypatch.setenv("EXECUPY_NUMBA", "1" if backend == "numba" else "0")


def export(model, *inputs) -> bytes:
    from execupy.exir import to_edge

    return to_edge(torch.export.export(model, tuple(torch.from_numpy(x) for x in inputs))).to_executorch().buffer


class Mixed(torch.nn.Module):
    """Broadcast constants, Python scalars, rsub, transcendental ops, and an intermediate
    (`gate`) that is both a method output and read after the run by a non-element-wise op."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(-2, 2, 8))
        self.bias = torch.nn.Parameter(torch.linspace(1, -1, 8))

    def forward(self, x, y):
        h = x * self.scale + self.bias
        h = torch.relu(h) - y / 3.0
        gate = torch.sigmoid(h) * 2.0
        h = 1.0 - torch.tanh(gate) + torch.exp(-h) / y
        h = torch.sqrt(h * h + 1.0) * -h
        return torch.cat([h, gate], dim=-1).sum(-1), gate, h


def both(pte: bytes) -> tuple:
    program = Program.load(pte)
    return program.load_method("forward", fuse=True), program.load_method("forward", fuse=False)


def assert_bit_equal(fused: list, plain: list) -> None:
    assert len(fused) == len(plain)
    for k, (f, p) in enumerate(zip(fused, plain)):
        assert f.dtype == p.dtype and f.shape == p.shape, f"output {k}"
        assert np.array_equal(f, p, equal_nan=True), f"output {k}: max |diff| {np.nanmax(np.abs(f - p))}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_chain_of_64_ops_is_one_step_with_bit_equal_results(backend, monkeypatch):
    use_backend(backend, monkeypatch)
    rng = np.random.default_rng(0)
    x, a, b = (rng.standard_normal(4).astype(np.float32) for _ in range(3))
    fused, plain = both(export(BENCH.chain_model(64), x, a, b))
    assert plain.steps_per_call == 64 and fused.steps_per_call == 1
    assert fused._op_names == ["fused:elementwise"]
    for scale in (1, 1e3, 1e30):  # the last overflows to inf and then NaN, as the unfused ops do
        inputs = [x * np.float32(scale), a * np.float32(scale), b]
        assert_bit_equal(fused.execute(inputs), plain.execute(inputs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcasts_scalars_and_intermediate_outputs_stay_bit_equal(backend, monkeypatch):
    use_backend(backend, monkeypatch)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    y = rng.standard_normal((3, 8)).astype(np.float32)
    fused, plain = both(export(Mixed(), x, y))
    assert "fused:elementwise" in fused._op_names
    assert fused.steps_per_call < plain.steps_per_call
    y[0, :3] = 0  # division by zero: inf and NaN, without an error, in both plans
    x[1, :2] = np.float32(-0.0)
    for inputs in ([x, y], [x * 100, y], [-x, y * 1e-30]):
        assert_bit_equal(fused.execute(inputs), plain.execute(inputs))


def test_chain_fusion_follows_the_fusion_switch(monkeypatch):
    x = np.ones(4, np.float32)
    pte = export(BENCH.chain_model(8), x, x, x)
    monkeypatch.setenv("EXECUPY_FUSION", "0")
    assert Program.load(pte).load_method("forward").steps_per_call == 8


def test_a_compiled_chain_is_kept_in_the_kernel_cache(monkeypatch, tmp_path):
    use_backend("numba", monkeypatch)
    monkeypatch.setenv("EXECUPY_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(ew, "_LOADED", {})  # as in a fresh process
    x = np.ones(4, np.float32)
    method = Program.load(export(BENCH.chain_model(10), x, x, x)).load_method("forward")
    assert method.steps_per_call == 1
    (source,) = tmp_path.glob("chain_*.py")
    assert source.read_text().count(" * a1[i]") == 5  # the five multiplications, in one loop
    assert list((tmp_path / "__pycache__").glob("chain_*.nbi")), "numba's cache index beside the source"


def test_the_overhead_bench_times_bit_equal_fused_and_unfused_plans(tmp_path):
    """Our side of bench/runtime_overhead.py on a chain our exporter wrote: its three plans agree bit for bit."""
    path = tmp_path / "chain.pte"
    path.write_bytes(export(BENCH.chain_model(20), *BENCH._inputs()))
    ours = BENCH.run_ours(str(path), repeat=3)
    assert ours.instructions == 20
    fused, fused_numpy, unfused = ours.outputs
    assert np.array_equal(fused, unfused) and np.array_equal(fused_numpy, unfused)
    assert min(ours.fused, ours.fused_numpy, ours.unfused, ours.dispatch, ours.tracing) > 0


def test_a_compiled_stretch_never_overwrites_memory_it_still_reads():
    """The loop reads and writes element by element, so a stored value may share an input's
    memory only exactly, and only when it is produced after the input's last read."""
    from execupy.runtime.chains import _Stretch, _stretch_is_safe

    memory = np.zeros(8, np.float32)
    x = memory[:4]  # read by ops 0 and 1
    stretch = _Stretch((4,), [("neg", [("a", 0)]), ("mul", [("a", 0), ("t", 0)])], [x], [0], {7: 0}, {0: 1}, [], {})
    assert _stretch_is_safe(stretch, [1], [memory[:4]])  # op 1 writes x's own bytes after reading them
    assert not _stretch_is_safe(stretch, [0], [memory[:4]])  # op 0's value would clobber x before op 1 reads it
    assert not _stretch_is_safe(stretch, [1], [memory[2:6]])  # element i's store lands on element i + 2's input
    assert _stretch_is_safe(stretch, [0, 1], [np.zeros(4, np.float32), np.zeros(4, np.float32)])
    assert not _stretch_is_safe(stretch, [0, 1], [memory[4:], memory[4:]])  # two stored values in one place
