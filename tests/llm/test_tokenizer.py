"""Tokenizers of every kind: trained tiny vocabularies written by the tests in each file format.

Where a format is a re-encoding of another (a GGUF-embedded vocabulary, a llama2.c
tokenizer.bin), the test checks our reconstruction against the original library running
the original file, on text with unicode, code, whitespace runs and emoji.
"""

from __future__ import annotations

import base64
import io
import json
import struct

import pytest

from execupy.llm.tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    USER_DEFINED,
    TiktokenTokenizer,
    TokenizerError,
    load_tokenizer,
)
from tests.llm import tiny

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Numbers: 1234567890, 3.14159, 42 and 2024-11-22.",
    "Unicode: café, naïve, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어.",
    "Emoji 😀🎉 and symbols ±×÷ → ∞.",
    "    indented   text\twith\ttabs\n\n\nand blank lines   ",
    "It's, you're, we'll, they've, I'm, he'd.",
] * 20

SAMPLES = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading and trailing spaces  ",
    "multiple     spaces\tand\ttabs\nnew\n\nlines\r\n",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment",
    "unicode: café naïve Straße Ελληνικά русский 日本語 한국어",
    "emoji: 😀🎉👍🏽 family: 👨‍👩‍👧",
    "numbers 1234567 3.14 and 00007",
    "I'm sure it's fine, they'll see.",
    "unseen chars: ☃ ∑ 𝔘 ﷽",
    "",
    " ",
]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _train_byte_level_bpe(digits: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # SmolLM2's tokenizer.json: single digits split first, then GPT-2's ByteLevel regex.
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tok")
    _train_byte_level_bpe().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    return folder


def _gguf_from_hf_bpe(path, tok, pre: str):
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [CONTROL if t in SPECIALS else NORMAL for t in tokens]
    meta = {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges,
            "bos": tokens.index("<|im_start|>"), "eos": tokens.index("<|im_end|>"), "chat_template": CHATML}
    return tiny.write_gguf(path, "llama", tiny.random_llama_weights(seed=0, vocab_size=len(tokens)),
                           tokenizer=meta, vocab_size=len(tokens))


# ----------------------------------------------------------------------------- HF tokenizer.json


def test_hf_round_trip_and_metadata(hf_folder):
    tok = load_tokenizer(hf_folder)
    assert tok.bos_id == tok.special_tokens["<|im_start|>"] and tok.eos_ids[0] == tok.special_tokens["<|im_end|>"]
    for text in SAMPLES:
        ids = tok.encode(text, bos=False)
        assert tok.decode(ids) == text
    assert len(tok.encode("the the the the", bos=False)) < len("the the the the")  # merges were learned


def test_special_tokens_only_parsed_when_allowed(hf_folder):
    tok = load_tokenizer(hf_folder / "tokenizer.json")
    text = "<|im_start|>user\nhi<|im_end|>"
    allowed = tok.encode(text, bos=False, allow_special=True)
    literal = tok.encode(text, bos=False, allow_special=False)
    assert allowed[0] == tok.special_tokens["<|im_start|>"] and allowed[-1] == tok.special_tokens["<|im_end|>"]
    assert not set(literal) & set(tok.special_tokens.values())
    assert tok.decode(literal) == text  # written as plain text, read back as plain text
    assert tok.decode(allowed) == "user\nhi"  # specials are dropped when decoding for display
    assert tok.decode(allowed, skip_special=False) == text


def test_bos_and_eos_flags(hf_folder):
    tok = load_tokenizer(hf_folder)
    plain = tok.encode("Hello", bos=False)
    assert tok.encode("Hello", bos=True, eos=True) == [tok.bos_id] + plain + [tok.eos_ids[0]]


def test_streaming_decode_holds_back_split_characters(hf_folder):
    tok = load_tokenizer(hf_folder)
    text = "emoji 😀 and 日本語 done"
    ids = tok.encode(text, bos=False)
    stream = tok.stream_decoder()
    pieces = [stream.put(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert "" in pieces  # some token ended mid-character and printed nothing yet
    assert all("\ufffd" not in p for p in pieces)
    # The tokenizer's own decode_token stream gives the same text.
    assert "".join(tok.decode_token(i) for i in ids) + tok.reset_stream() == text


def test_released_encoder_streams_the_same_bytes_and_loads_again_to_encode(hf_folder):
    """`execupy generate` releases the encoder after the prompt: the library's vocabulary maps
    leave memory, the stream reads every token's bytes from a table, and encoding still works."""
    tok = load_tokenizer(hf_folder)
    text = "<|im_start|>emoji 😀 and 日本語 done<|im_end|>"
    ids = tok.encode_raw(text)
    every_id = range(tok.vocab_size)
    before = [(tok.token_bytes(i), tok.token_bytes(i, special=True)) for i in every_id]
    tok.release_encoder()
    assert tok._library is None  # the `tokenizers` object (9 MiB for SmolLM2) is gone
    assert [(tok.token_bytes(i), tok.token_bytes(i, special=True)) for i in every_id] == before
    stream = tok.stream_decoder(special=True)
    assert "".join(map(stream.put, ids)) + stream.flush() == text
    assert tok._library is None  # streaming did not need it back
    assert tok.encode_raw(text) == ids and tok.decode(ids, skip_special=False) == text  # read again


def test_chat_template_renders_and_encodes(hf_folder):
    tok = load_tokenizer(hf_folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat(messages)
    assert ids.count(tok.special_tokens["<|im_start|>"]) == 2 and ids.count(tok.special_tokens["<|im_end|>"]) == 1


# ----------------------------------------------------------------------------- GGUF byte-level BPE


@pytest.mark.parametrize("pre,digits", [("gpt2", False), ("smollm", True)])
def test_gguf_bpe_matches_the_original_tokenizer(tmp_path, pre, digits):
    original = _train_byte_level_bpe(digits=digits)
    tok = load_tokenizer(_gguf_from_hf_bpe(tmp_path / "t.gguf", original, pre))
    for text in SAMPLES + CORPUS[:8]:
        assert tok.encode(text, bos=False) == original.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(tok.encode(text, bos=False)) == text
    assert tok.chat_template == CHATML and tok.bos_id == original.token_to_id("<|im_start|>")
    # The heuristic end-of-generation list adds <|endoftext|> next to the declared EOS.
    assert set(tok.eos_ids) == {original.token_to_id("<|im_end|>"), original.token_to_id("<|endoftext|>")}
    assert tok.encode("<|im_end|>", bos=False, allow_special=True) == [original.token_to_id("<|im_end|>")]


def test_gguf_unknown_pre_tokenizer_is_a_clear_error(tmp_path):
    path = _gguf_from_hf_bpe(tmp_path / "t.gguf", _train_byte_level_bpe(), "no-such-pre")
    with pytest.raises(TokenizerError, match="no-such-pre"):
        load_tokenizer(path)


# ----------------------------------------------------------------------------- SentencePiece family


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   user_defined_symbols=["<tool>"], control_symbols=["<|sep|>"],
                                   # Llama 2's settings: no normalization, whitespace kept as is.
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   minloglevel=2)
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    return path


def test_sentencepiece_model(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    tok = load_tokenizer(sp_model)
    assert tok.bos_id == sp.bos_id() and tok.eos_ids == (sp.eos_id(),) and tok.add_bos
    for text in SAMPLES:
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text), text
        assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))
        # Keeping special tokens in the text must not keep the dummy-prefix space either.
        assert tok.decode(tok.encode(text, bos=False), skip_special=False) == sp.decode(sp.encode(text))
    sep = sp.piece_to_id("<|sep|>")
    assert tok.encode("a<|sep|>b", bos=False, allow_special=True) == sp.encode("a") + [sep] + sp.encode("b")
    assert sep not in tok.encode("a<|sep|>b", bos=False)


def test_sentencepiece_streaming_uses_byte_fallback(sp_model):
    tok = load_tokenizer(sp_model)
    text = "☃ snowman and 🦙"  # not in the training corpus: spelled with byte tokens
    ids = tok.encode(text, bos=False)
    stream = tok.stream_decoder()
    pieces = [stream.put(i) for i in ids]
    assert "".join(pieces).lstrip(" ") == text  # the dummy-prefix space stays in a stream
    assert "" in pieces


def _sp_pieces(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else CONTROL if sp.is_control(i) else BYTE if sp.is_byte(i)
             else USER_DEFINED if sp.id_to_piece(i) == "<tool>" else NORMAL for i in range(n)]
    return sp, [sp.id_to_piece(i) for i in range(n)], [sp.get_score(i) for i in range(n)], types


def test_gguf_llama_vocab_matches_sentencepiece(tmp_path, sp_model):
    sp, pieces, scores, types = _sp_pieces(sp_model)
    meta = {"model": "llama", "tokens": pieces, "scores": scores, "types": types, "bos": sp.bos_id(),
            "eos": sp.eos_id(), "unk": sp.unk_id()}
    path = tiny.write_gguf(tmp_path / "sp.gguf", "llama", tiny.random_llama_weights(seed=0, vocab_size=len(pieces)),
                           tokenizer=meta, vocab_size=len(pieces))
    tok = load_tokenizer(path)
    assert tok.bos_id == sp.bos_id() and tok.add_bos
    for text in SAMPLES + ["use <tool> here"]:
        assert tok.encode(text, bos=False) == sp.encode(text), text
        assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))


def _write_llama2c(path, pieces, scores):
    # llama2.c's tokenizer.py export: "▁" as space, BOS/EOS as "\n<s>\n" / "\n</s>\n".
    records = []
    for i, (piece, score) in enumerate(zip(pieces, scores)):
        text = {1: "\n<s>\n", 2: "\n</s>\n"}.get(i, piece.replace("▁", " ")).encode()
        records.append((text, score))
    with open(path, "wb") as fh:
        fh.write(struct.pack("<i", max(len(t) for t, _ in records)))
        for text, score in records:
            fh.write(struct.pack("<fi", score, len(text)) + text)
    return path


def test_llama2c_tokenizer_bin_matches_sentencepiece(tmp_path, sp_model):
    sp, pieces, scores, _ = _sp_pieces(sp_model)
    tok = load_tokenizer(_write_llama2c(tmp_path / "tokenizer.bin", pieces, scores))
    assert (tok.bos_id, tok.eos_ids) == (1, (2,))
    for text in SAMPLES:
        assert tok.encode(text) == [1] + sp.encode(text), text
        assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))


# ----------------------------------------------------------------------------- tiktoken (Llama 3)


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
    # Byte-level BPE ranks: the 256 bytes, then merged tokens in merge order (as Llama 3's file is).
    spec = json.loads(_train_byte_level_bpe().to_str())
    from execupy.llm.tokenizer import _BYTE_DECODER

    ranked = [bytes([b]) for b in range(256)]
    for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in SPECIALS and len(piece) > 1:
            ranked.append(bytes(_BYTE_DECODER[c] for c in piece))
    path = tmp_path_factory.mktemp("tt") / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranked)))
    return path, len(ranked)


def test_tiktoken_llama3_format(tiktoken_file):
    path, n_ranks = tiktoken_file
    tok = load_tokenizer(path)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.bos_id == n_ranks and tok.special_tokens["<|eot_id|>"] == n_ranks + 9
    assert set(tok.eos_ids) == {n_ranks + 1, n_ranks + 9, n_ranks + 8}
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and tok.decode(ids) == text
    assert len(tok.encode(" the", bos=False)) == 1  # a learned merge is one token
    header = "<|start_header_id|>user<|end_header_id|>"
    assert tok.encode(header, bos=False, allow_special=True)[0] == n_ranks + 6
    assert n_ranks + 6 not in tok.encode(header, bos=False)


def test_tiktoken_chat_template_writes_bos_once(tiktoken_file):
    tok = load_tokenizer(tiktoken_file[0])
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
    assert tok.decode(ids, skip_special=False).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_unknown_tokenizer_path_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


# ----------------------------------------------------------------------------- save / reload


def test_gguf_tokenizers_save_to_one_file_and_reload(tmp_path, sp_model, tiktoken_file):
    sp, pieces, scores, types = _sp_pieces(sp_model)
    spm_gguf = tiny.write_gguf(tmp_path / "sp.gguf", "llama", tiny.random_llama_weights(seed=0, vocab_size=len(pieces)),
                               tokenizer={"model": "llama", "tokens": pieces, "scores": scores, "types": types},
                               vocab_size=len(pieces))
    bpe_gguf = _gguf_from_hf_bpe(tmp_path / "bpe.gguf", _train_byte_level_bpe(digits=True), "smollm")
    cases = [(load_tokenizer(spm_gguf), "tokenizer.model"), (load_tokenizer(bpe_gguf), "tokenizer.json"),
             (load_tokenizer(tiktoken_file[0]), "tokenizer.model")]
    for original, filename in cases:
        path = tmp_path / type(original).__name__ / filename
        path.parent.mkdir()
        original.save(path)
        # BOS/EOS/template come from the program's metadata in a real run; pass them back here.
        copy = load_tokenizer(path, bos_id=original.bos_id, eos_ids=original.eos_ids, add_bos=original.add_bos,
                              chat_template=original.chat_template)
        assert type(copy) is type(original)
        assert (copy.bos_id, copy.eos_ids, copy.chat_template) == (original.bos_id, original.eos_ids,
                                                                   original.chat_template)
        for text in SAMPLES + ["<|im_start|>hi<|im_end|>"]:
            for allow in (False, True):
                assert copy.encode(text, allow_special=allow) == original.encode(text, allow_special=allow), text
