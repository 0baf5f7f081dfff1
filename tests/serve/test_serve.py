"""`execupy serve` as a user drives it: a real process on 127.0.0.1, the official openai client,
raw HTTP for the error cases.

The model is a tiny random Llama with a real byte-level BPE tokenizer and a chat template
(tests/llm), exported once per module. Its end-of-turn token's output row is zeroed, so
greedy decoding never ends a turn on its own: a request runs for exactly max_tokens,
which makes "still generating" a state the tests can count on. Expected answers come
from LLMRunner in this process, the code path of `execupy generate`.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from execupy.llm.runner import LLMRunner
from execupy.llm.sampler import SamplerConfig
from tests.llm import tiny
from tests.llm.test_export_runner import _write_tiny_model
from tests.serve.server import running_server

openai = pytest.importorskip("openai")

CONTEXT = 1024  # a greedy answer fills it (end of turn never wins), long enough for a client to leave mid-way
SHAPE = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=256)  # slow enough to interrupt
WORDS = "the quick brown fox jumps over lazy dog hello world tokens".split()


@pytest.fixture(scope="module")
def tiny_program(tmp_path_factory) -> Path:
    from safetensors.numpy import load_file, save_file

    from execupy.llm.export import export_llm

    root = tmp_path_factory.mktemp("serve")
    folder = _write_tiny_model(root / "hf")  # tokenizer, chat template, then bigger weights below
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tiny.write_hf_llama(folder, tiny.random_llama_weights(seed=5, vocab_size=vocab, **SHAPE), vocab_size=vocab,
                        **SHAPE)
    eos = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    eos_id = next(t["id"] for t in eos if t["content"] == "<|im_end|>")
    first = folder / "model-00001-of-00002.safetensors"
    weights = load_file(str(first))
    weights["lm_head.weight"][eos_id] = 0.0  # a zero logit: greedy never picks it over 300 random ones
    save_file(weights, str(first))
    return export_llm(folder, root / "tiny.pte", max_seq_len=CONTEXT, max_prefill_len=32).pte_path


@pytest.fixture(scope="module")
def runner(tiny_program) -> LLMRunner:
    return LLMRunner(tiny_program)


@pytest.fixture(scope="module")
def server(tiny_program, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "stderr.txt"
    with running_server(tiny_program, log, "--queue-size", "16") as s:
        yield s


def client(server, **kwargs) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kwargs)


def greedy(runner: LLMRunner, text: str, max_tokens: int, chat: bool = True) -> str:
    return runner.generate(text, max_tokens, SamplerConfig(temperature=0.0), chat=chat)


def ask(server, text: str, max_tokens: int, stream: bool = False, **kwargs):
    """(answer text, finish_reason, usage) of one chat request through the openai client."""
    messages = [{"role": "user", "content": text}]
    kwargs = {"temperature": 0, **kwargs}
    response = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                                      stream=stream, **kwargs)
    if not stream:
        return response.choices[0].message.content, response.choices[0].finish_reason, response.usage
    parts, finish, usage = [], None, None
    for chunk in response:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish, usage = chunk.choices[0].finish_reason, chunk.usage
    return "".join(parts), finish, usage


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, body = server.http("GET", "/health")
    assert status == 200 and body["status"] == "ok"


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_chat_answer_equals_the_runner(server, runner, stream):
    text, finish, usage = ask(server, "hello world, the lazy dog", 12, stream=stream)
    assert text == greedy(runner, "hello world, the lazy dog", 12)
    assert finish == "length"  # the model never ends a turn; max_tokens does
    prompt = len(runner.tokenizer.encode_chat([{"role": "user", "content": "hello world, the lazy dog"}]))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt, 12, prompt + 12)


def test_stream_options_include_usage_adds_a_usage_chunk(server):
    chunks = list(client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"


def test_raw_completion_equals_the_runner(server, runner):
    response = client(server).completions.create(model="tiny", prompt="the quick brown fox", max_tokens=10,
                                                 temperature=0)
    assert response.choices[0].text == greedy(runner, "the quick brown fox", 10, chat=False)
    assert response.usage.completion_tokens == 10


def test_stop_string_ends_the_answer_before_it(server, runner):
    full = greedy(runner, "a b c d", 20)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    text, finish, usage = ask(server, "a b c d", 20, stop=[stop])
    assert text == full[: full.index(stop)] and finish == "stop"
    streamed, finish, _ = ask(server, "a b c d", 20, stream=True, stop=stop)
    assert streamed == text and finish == "stop"


def test_sampling_with_a_seed_repeats(server):
    def sample():
        return ask(server, "jumps over", 16, temperature=1.5, top_p=0.9, seed=7)[0]

    assert sample() == sample()


def test_errors_are_shaped_like_openai(server, runner):
    def error(path: str, body: bytes) -> tuple[int, dict]:
        status, reply = server.http("POST", path, body)
        assert set(reply["error"]) == {"message", "type", "param", "code"}
        return status, reply["error"]

    status, err = error("/v1/chat/completions", b'{"messages": [')
    assert status == 400 and "not valid JSON" in err["message"]
    status, err = error("/v1/chat/completions", json.dumps({"model": "gpt-9", "messages": [
        {"role": "user", "content": "hi"}]}).encode())
    assert status == 404 and err["code"] == "model_not_found" and "gpt-9" in err["message"]
    long_prompt = " ".join(WORDS * (CONTEXT // 8))  # well over the context
    status, err = error("/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": long_prompt}]}).encode())
    assert status == 400 and err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]
    for field, value in [("temperature", "hot"), ("max_tokens", 0), ("top_p", 0), ("messages", []),
                         ("frequency_penalty", 0.5), ("n", 3), ("seed", -1), ("stop", [""])]:
        body = {"messages": [{"role": "user", "content": "hi"}], field: value}
        status, err = error("/v1/chat/completions", json.dumps(body).encode())
        assert status == 400 and err["param"] == field, (field, err)
    status, err = error("/v1/chat/completions", json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode())
    assert status == 400 and err["param"] == "messages[0].role"
    status, err = error("/v1/completions", json.dumps({"prompt": 42}).encode())
    assert status == 400 and err["param"] == "prompt"
    status, err = error("/v1/completions", b'{"prompt": "' + b"a" * (9 << 20) + b'"}')
    assert status == 413
    status, err = error("/v1/embeddings", b"{}")
    assert status == 404
    # And after all that the server still answers.
    assert ask(server, "hello", 3)[1] == "length"


def test_sixteen_concurrent_clients_get_their_own_answers(server, runner):
    prompts = [" ".join(WORDS[i % len(WORDS):] + WORDS[:i % 3]) + f" {i}" for i in range(16)]
    expected = [greedy(runner, p, 8) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda k: ask(server, prompts[k], 8, stream=k % 2 == 1)[0], range(16)))
    assert answers == expected
    assert server.http("GET", "/health")[1]["status"] == "ok" and server.process.poll() is None


def test_a_client_that_leaves_mid_stream_frees_the_server(server):
    stream = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the lazy dog"}], max_tokens=CONTEXT, temperature=0,
        stream=True)
    for k, _ in enumerate(stream):
        if k == 3:
            break
    stream.close()
    left = time.perf_counter()
    text, finish, _ = ask(server, "hello", 1)
    waited = time.perf_counter() - left
    assert finish == "length"
    deadline = time.monotonic() + 5
    while "generation cancelled" not in server.log and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "client left, generation cancelled" in server.log
    assert waited < 1.0, f"the next request waited {waited:.2f} s after the first client left"


def test_a_client_that_leaves_a_whole_request_cancels_it(server):
    # Greedy: sampled at OpenAI's default temperature 1, the answer may end on the end-of-turn token
    # (its logit is 0, not -inf) before the server sees the client go.
    body = json.dumps({"messages": [{"role": "user", "content": "brown fox"}], "max_tokens": CONTEXT,
                       "temperature": 0}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while not server.http("GET", "/health")[1]["busy"] and time.monotonic() < deadline:
            time.sleep(0.02)
    deadline = time.monotonic() + 5
    while "whole client left, generation cancelled" not in server.log and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "whole client left, generation cancelled" in server.log
    assert ask(server, "hello", 1)[1] == "length"


def test_second_turn_reuses_the_cached_prompt(server, runner):
    first_messages = [{"role": "user", "content": "the quick brown fox"}]
    first = client(server).chat.completions.create(model="tiny", messages=first_messages, max_tokens=6,
                                                   temperature=0)
    messages = first_messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                 {"role": "user", "content": "jumps over the lazy dog"}]
    second = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    # Reusing the cache changes nothing in the answer: a fresh runner says the same.
    runner.reset()
    tokens = runner.tokenizer.encode_chat(messages)
    fresh = runner.generate_tokens(tokens, 6, SamplerConfig(temperature=0.0))
    assert second.choices[0].message.content == runner.tokenizer.decode(fresh)


def test_queue_full_gets_503_and_the_queued_request_still_runs(tiny_program, tmp_path):
    with running_server(tiny_program, tmp_path / "stderr.txt", "--queue-size", "1") as server:
        busy = client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=CONTEXT, temperature=0,
            stream=True)
        next(iter(busy))  # generating now
        queued: dict = {}
        waiter = threading.Thread(target=lambda: queued.update(answer=ask(server, "a b c", 2)))
        waiter.start()
        deadline = time.monotonic() + 10
        while server.http("GET", "/health")[1]["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        status, reply = server.http("POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "one too many"}]}).encode())
        assert status == 503 and reply["error"]["code"] == "queue_full"
        busy.close()
        waiter.join(timeout=30)
        assert queued["answer"][1] == "length"
