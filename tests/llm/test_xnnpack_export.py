"""`execupy export-llm --backend xnnpack`: the linears become XNNPACK FullyConnected nodes
(fp32; with --quantize 8da4w qd8 x qb4w, with 8da8w qd8 x qc8w, as ExecuTorch's exports),
and ExecuTorch's own LLM runner (TextLLMRunner, in the reference venv) generates from our
file the same greedy tokens as `execupy generate`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from execupy.backends.xnnpack.schema import read_payload
from execupy.devtools.delegation import get_delegation_info
from execupy.runtime import Program
from tests.et_llm import reference_greedy
from tests.llm.test_export_runner import _write_tiny_model
from tests.reference import reference_python

PROMPT = "the quick brown"
NEW_TOKENS = 12

# The runner prints each piece on stdout itself (and skips bytes that are not valid UTF-8);
# a token callback would fail on the partial characters a random model emits.
_RUNNER = r"""
import sys
from executorch.extension.llm.custom_ops import custom_ops  # registers the llama:: kernels
from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
runner = TextLLMRunner(sys.argv[1], sys.argv[2])
runner.generate(sys.argv[3], GenerationConfig(echo=False, max_new_tokens=int(sys.argv[4]), temperature=0.0))
"""


def _execupy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execupy", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


# --quantize flags -> (input, filter) datatypes of every FullyConnected node.
MODES = {
    "fp32": ([], ("fp32", "fp32")),
    "8da4w": (["--quantize", "8da4w", "--group-size", "32"], ("qdint8", "qbint4")),
    "8da8w": (["--quantize", "8da8w"], ("qdint8", "qcint8")),
}


@pytest.fixture(scope="module", params=list(MODES))
def exported(request, tmp_path_factory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(f"xnnpack_llm_{request.param}")
    folder = _write_tiny_model(root / "hf")
    proc = _execupy("export-llm", "--hf", str(folder), "--backend", "xnnpack", "--max-seq-len", "64",
                    *MODES[request.param][0], "-o", str(root / "tiny.pte"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return request.param, root / "tiny.pte"


def fully_connected_datatypes(pte: Path) -> list[tuple[str, str]]:
    program = Program.load(pte.read_bytes())
    out = []
    for d in program.program.execution_plan[0].delegates:
        g = read_payload(program.delegate_payload(d.processed))
        out += [(g.values[n.fields["input1_id"]].datatype, g.values[n.fields["filter_id"]].datatype)
                for n in g.nodes if n.kind == "FullyConnected"]
    return out


def test_the_linears_are_xnnpack_fully_connected_nodes(exported):
    mode, exported = exported
    ops = get_delegation_info(exported).delegation_by_operator
    # Each layer has 7 linears, plus the output projection: all in XNNPACK, none left as mm.
    assert ops["FullyConnected"].delegated == 2 * 7 + 1
    assert not any(name.startswith(("aten::mm", "aten::addmm", "quantized_decomposed::")) for name in ops)
    assert fully_connected_datatypes(exported) == [MODES[mode][1]] * (2 * 7 + 1)


@pytest.mark.reference
def test_executorch_text_llm_runner_generates_our_greedy_tokens(exported):
    _, exported = exported
    tokenizer = exported.with_name("tiny.tokenizer.json")
    proc = subprocess.run([str(reference_python()), "-c", _RUNNER, str(exported), str(tokenizer), PROMPT,
                           str(NEW_TOKENS)], capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    theirs = proc.stdout.split(b"\nPyTorchObserver")[0]

    ours = _execupy("generate", str(exported), "--prompt", PROMPT, "--raw", "--max-new-tokens", str(NEW_TOKENS),
                    "--print-token-ids")
    assert ours.returncode == 0, ours.stderr[-2000:]
    line = next(ln for ln in (ours.stdout + ours.stderr).splitlines() if ln.startswith('{"prompt_ids"'))
    ids = json.loads(line)["generated_ids"]
    assert len(ids) == NEW_TOKENS
    # Token by token in ExecuTorch's runtime (the runner prints text only): the same ids.
    assert reference_greedy(exported, json.loads(line)["prompt_ids"], NEW_TOKENS, eos_ids=[]) == ids
    from execupy.llm.runner import LLMRunner

    tok = LLMRunner(exported).tokenizer
    ours_bytes = b"".join(tok.token_bytes(i) for i in ids)
    # ExecuTorch's runner prints no bytes of incomplete characters, and leaves out some control
    # characters (the random model emits both): compare the printable ASCII text.
    assert len(printable(theirs)) >= NEW_TOKENS // 2
    assert printable(theirs) == printable(ours_bytes)


def printable(text: bytes) -> bytes:
    return bytes(b for b in text if 0x20 <= b < 0x7F or b in b"\t\n")


def test_gguf_q4_1_linears_are_quantized_again_symmetric_with_a_warning(tmp_path):
    """XNNPACK's 4-bit filters are symmetric: Q4_1 blocks (with a minimum) cannot be kept as
    they are, Q4_0 blocks can. Every layer's linear still becomes a qd8 x qb4w node; so does the
    tied head, Q8_0 in the file (int8 groups of 32, which no XNNPACK filter holds), with a
    warning of its own."""
    import gguf

    from execupy.llm.export import export_llm
    from execupy.llm.export.quantize import QuantizationWarning
    from tests.llm import tiny

    q = gguf.GGMLQuantizationType
    w = tiny.random_llama_weights(seed=1, tied=True)
    linears = [n for n in tiny._gguf_llama_tensors(w) if n.startswith("blk.") and n.endswith("weight")
               and "norm" not in n]
    qtypes = {n: q.Q4_1 for n in linears}
    qtypes.update({"token_embd.weight": q.Q8_0, "blk.0.attn_q.weight": q.Q4_0})
    path = tiny.write_gguf(tmp_path / "tiny.gguf", "llama", w, qtypes=qtypes)
    with pytest.warns(QuantizationWarning, match=r"--backend xnnpack: (\d+) linears kept GGUF Q4_1") as record:
        result = export_llm(path, tmp_path / "tiny.pte", max_seq_len=32, backend="xnnpack", quantize="8da4w",
                            group_size=32)
    message = next(str(r.message) for r in record if "Q4_1" in str(r.message))
    assert message.split(":")[1].split()[0] == str(len(linears) - 1)
    assert fully_connected_datatypes(result.pte_path) == [("qdint8", "qbint4")] * (len(linears) + 1)
    assert any("kept GGUF Q8_0 blocks" in str(r.message) for r in record)
