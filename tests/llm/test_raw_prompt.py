"""`execupy generate --raw`: raw in, raw out, through the CLI in a subprocess.

A ChatML conversation written out by hand is tokenized as written, its special tokens
(``<|im_start|>``, ``<|im_end|>``) becoming their ids, so it gets the ids the chat template
gives and the same greedy reply as `generate` without --raw. Special tokens the model
generates are printed as their text with --raw and print nothing without it.
`--print-token-ids` shows the prompt and generated ids on stderr. Checked on the tiny random
Llama of test_export_runner and on the real SmolLM2-135M-Instruct (slow), against torch eager.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from execupy.llm.export.models import greedy_generate
from execupy.llm.runner import LLMRunner
from tests.llm.test_export_runner import export_tiny

REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"


def run_generate(pte: Path, *flags: str) -> tuple[str, dict]:
    """`python -m execupy generate PTE --print-token-ids FLAGS...`: (stdout, the ids it printed)."""
    argv = [sys.executable, "-m", "execupy", "generate", str(pte), "--print-token-ids", *flags]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    ids_line = next(line for line in proc.stderr.splitlines() if line.startswith('{"prompt_ids"'))
    return proc.stdout, json.loads(ids_line)


def eager_greedy(eager, prompt_ids: list[int], n: int) -> list[int]:
    eager.reset_cache()
    return greedy_generate(eager, prompt_ids, n)[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("raw_prompt"))


def test_tiny_raw_chatml_prompt_is_the_chat_templates_prompt(tiny):
    result, eager = tiny
    tok = LLMRunner(result.pte_path).tokenizer
    chatml = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert chatml == tok.apply_chat_template([{"role": "user", "content": "hello world"}])

    raw_out, raw = run_generate(result.pte_path, "--raw", "--prompt", chatml, "--max-new-tokens", "12")
    assert raw["prompt_ids"] == tok.encode(chatml, allow_special=True)
    assert raw["prompt_ids"].count(tok.special_tokens["<|im_start|>"]) == 2
    assert raw["prompt_ids"] != tok.encode(chatml)  # as plain text, '<|im_start|>' is several tokens

    chat_out, chat = run_generate(result.pte_path, "--prompt", "hello world", "--max-new-tokens", "12")
    assert chat == raw and chat_out == raw_out
    assert raw["generated_ids"] == eager_greedy(eager, raw["prompt_ids"], 12)[:len(raw["generated_ids"])]


# ----------------------------------------------------------------------------- SmolLM2 (slow)


def smollm2_chatml(question: str) -> str:
    """SmolLM2-Instruct's conversation format, written out by hand (its default system prompt included)."""
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_raw_chatml_64_greedy_tokens_equal_eager_and_print_special_tokens(smollm2_export):
    result, eager = smollm2_export
    tok = LLMRunner(result.pte_path).tokenizer
    chatml = smollm2_chatml(QUESTION)
    out, ids = run_generate(result.pte_path, "--raw", "--prompt", chatml, "--max-new-tokens", "64", "--ignore-eos")
    assert ids["prompt_ids"] == tok.encode(chatml, allow_special=True)
    assert ids["generated_ids"] == eager_greedy(eager, ids["prompt_ids"], 64)
    # Past its answer the model writes <|im_end|> and more turns: raw out prints them as text.
    generated = ids["generated_ids"]
    assert tok.special_tokens["<|im_end|>"] in generated
    assert out == tok.decode(generated, skip_special=False) + "\n"
    assert "Paris" in out and "<|im_end|>" in out


@pytest.mark.slow
def test_smollm2_raw_chatml_reply_equals_the_chat_paths(smollm2_export):
    result, _ = smollm2_export
    tok = LLMRunner(result.pte_path).tokenizer
    chatml = smollm2_chatml(QUESTION)
    assert chatml == tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    raw_out, raw = run_generate(result.pte_path, "--raw", "--prompt", chatml, "--max-new-tokens", "64")
    chat_out, chat = run_generate(result.pte_path, "--prompt", QUESTION, "--max-new-tokens", "64")
    assert chat == raw and chat_out == raw_out
    # Both stopped at <|im_end|>, which ends the reply and is not printed, even with --raw.
    assert raw["generated_ids"][-1] == tok.special_tokens["<|im_end|>"] and "<|im_end|>" not in raw_out
    assert "Paris" in raw_out
