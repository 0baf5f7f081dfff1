"""What a user sees when a checkpoint or tokenizer file is broken: CheckpointError or
TokenizerError, naming the file and what is wrong in it (tests/llm/test_checkpoint_fuzz.py
covers the same ground at random; these are the cases worth reading)."""

from __future__ import annotations

import json
import struct
import time

import pytest

from execupy.errors import CheckpointError, TokenizerError
from execupy.llm.loaders import load_checkpoint
from execupy.llm.tokenizer import load_tokenizer
from tests.llm import tiny
from tests.llm.test_tokenizer import (  # noqa: F401  (fixtures)
    _gguf_from_hf_bpe,
    _train_byte_level_bpe,
    hf_folder,
    sp_model,
    tiktoken_file,
)


@pytest.fixture(scope="module")
def bpe_gguf(tmp_path_factory):
    return _gguf_from_hf_bpe(tmp_path_factory.mktemp("gguf") / "model.gguf", _train_byte_level_bpe(), "gpt2")


def patched(src, dst, find: bytes, skip: int, value: bytes):
    """A copy of ``src`` with ``value`` written ``skip`` bytes after the first ``find``."""
    data = bytearray(src.read_bytes())
    at = data.index(find) + len(find) + skip
    data[at : at + len(value)] = value
    dst.write_bytes(bytes(data))
    return dst


# ----------------------------------------------------------------------------- GGUF


def test_gguf_huge_string_count_is_refused_before_reading(bpe_gguf, tmp_path):
    # key, then u32 value type (array), u32 item type (string), u64 count
    path = patched(bpe_gguf, tmp_path / "m.gguf", b"tokenizer.ggml.tokens", 8, struct.pack("<Q", 1 << 62))
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"m\.gguf: .*strings of metadata 'tokenizer.ggml.tokens' needs"):
        load_tokenizer(path)
    assert time.perf_counter() - started < 5  # nothing was allocated or looped over


def test_gguf_without_tensor_data_still_has_its_vocabulary(bpe_gguf, tmp_path):
    path = tmp_path / "head.gguf"
    path.write_bytes(bpe_gguf.read_bytes()[: bpe_gguf.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"head\.gguf: tensor '.*' .* runs past the end of the file"):
        load_checkpoint(path)
    assert load_tokenizer(path).encode("Hello", bos=False) == load_tokenizer(bpe_gguf).encode("Hello", bos=False)


def test_gguf_token_that_is_not_utf8(bpe_gguf, tmp_path):
    path = patched(bpe_gguf, tmp_path / "m.gguf", b"tokenizer.ggml.tokens", 16 + 8, b"\xff")
    with pytest.raises(CheckpointError, match=r"item 0 of metadata 'tokenizer.ggml.tokens' is not UTF-8"):
        load_tokenizer(path)


@pytest.mark.parametrize("key, value, message", [
    ("llama.attention.head_count", 0, r"llama.attention.head_count is 0, expected a positive integer"),
    ("llama.block_count", (1 << 32) - 1, r"config says 4294967295 layers but the checkpoint has only \d+ tensors"),
    ("llama.attention.head_count_kv", 3, r"n_heads 4 is not a multiple of n_kv_heads 3"),
])
def test_gguf_hyperparameters_are_checked(bpe_gguf, tmp_path, key, value, message):
    # key, u32 value type (uint32), the value
    path = patched(bpe_gguf, tmp_path / "m.gguf", key.encode(), 4, struct.pack("<I", value))
    with pytest.raises(CheckpointError, match=r"m\.gguf: " + message):
        load_checkpoint(path)


def test_gguf_merge_of_unknown_tokens_and_out_of_range_ids(tmp_path):
    tokens = ["a", "b", "ab", "<s>"]
    meta = {"model": "gpt2", "pre": "gpt2", "tokens": tokens, "types": [1, 1, 1, 3], "merges": ["a c"]}
    weights = tiny.random_llama_weights(seed=0, vocab_size=4)
    bad_merge = tiny.write_gguf(tmp_path / "merge.gguf", "llama", weights, tokenizer=meta, vocab_size=4)
    with pytest.raises(TokenizerError, match=r"merge\.gguf: GGUF merge 0 \('a c'\) uses 'c', which is not in"):
        load_tokenizer(bad_merge)
    bad_bos = tiny.write_gguf(tmp_path / "bos.gguf", "llama", weights, vocab_size=4,
                              tokenizer={**meta, "merges": ["a b"], "bos": 9})
    with pytest.raises(TokenizerError, match=r"bos\.gguf: .*bos_token_id 9 is not below the vocabulary size 4"):
        load_tokenizer(bad_bos)


# ----------------------------------------------------------------------------- HF


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["model"]["vocab"].update({"a": None}), r"vocab entry 'a' has id None, expected an integer"),
    (lambda s: s["model"]["vocab"].update({"a": 1 << 32}), r"vocab entry 'a' has id 4294967296"),
    (lambda s: s["model"]["merges"].__setitem__(0, ["a", "b", "c"]), r"BPE merge 0 .* is not two pieces"),
    (lambda s: s["model"]["merges"].__setitem__(0, ["zz", "qq"]), r"BPE merge 0 .* uses 'zz', which is not in"),
    (lambda s: s["model"]["vocab"].update({"a": s["model"]["vocab"]["b"]}), r"BPE vocab gives the same id to two pieces"),
    (lambda s: s["added_tokens"][0].update({"id": None}), r"added_tokens must be a list of objects"),
])
def test_tokenizer_json_mistakes_are_named(hf_folder, tmp_path, edit, message):
    spec = json.loads((hf_folder / "tokenizer.json").read_text())
    edit(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: " + message):
        load_tokenizer(tmp_path)


def test_tokenizer_json_that_is_not_utf8(hf_folder, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(b'{"model": "\xff"}')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not UTF-8 text \(byte 11\)"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_hf_checkpoint_config_and_safetensors_mistakes(tmp_path):
    folder = tiny.write_hf_llama(tmp_path / "hf", tiny.random_llama_weights(seed=0))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "64"}))
    with pytest.raises(CheckpointError, match=r"config\.json: hidden_size is '64', expected a positive integer"):
        load_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps(config))
    shard = folder / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    (header_len,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 1 << 40
    new_header = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(new_header)) + new_header + data[8 + header_len :])
    with pytest.raises(CheckpointError, match=rf"00001-of-00002\.safetensors: tensor '{name}': data_offsets"):
        load_checkpoint(folder)


# ----------------------------------------------------------------------------- other tokenizer formats


def test_llama2c_negative_length_ends_instead_of_looping(tmp_path):
    path = tmp_path / "tokenizer.bin"
    path.write_bytes(struct.pack("<i", 8) + struct.pack("<fi", 0.0, -8) + b"x" * 16)
    with pytest.raises(TokenizerError, match=r"tokenizer\.bin: token 0 at byte 4 says it is -8 bytes long"):
        load_tokenizer(path)


def test_tiktoken_file_must_cover_every_byte(tiktoken_file, tmp_path):
    lines = tiktoken_file[0].read_text().splitlines()
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{line.split()[0]} {rank}\n" for rank, line in enumerate(lines[1:])))  # drops byte 0
    with pytest.raises(TokenizerError, match=r"tokenizer\.model: 1 single bytes \(first 0x00\) have no token"):
        load_tokenizer(path)


def test_truncated_sentencepiece_model(sp_model, tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(sp_model.read_bytes()[:1000])
    with pytest.raises(TokenizerError, match=r"tokenizer\.model: protobuf field 1 at byte \d+ says \d+ bytes"):
        load_tokenizer(path)


# ----------------------------------------------------------------------------- Meta (.pth, read by torch)


def test_meta_pth_that_is_not_a_state_dict(tmp_path):
    import torch

    folder = tiny.write_meta(tmp_path / "meta", tiny.random_llama_weights(seed=0))
    shard = folder / "consolidated.00.pth"
    torch.save([torch.zeros(2)], shard)
    with pytest.raises(CheckpointError, match=r"consolidated\.00\.pth: holds a list, expected a dict of tensors"):
        load_checkpoint(folder)
    shard.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match=r"consolidated\.00\.pth: not a readable weights-only \.pth checkpoint"):
        load_checkpoint(folder)


# ----------------------------------------------------------------------------- the command line


def test_cli_export_of_a_broken_gguf_says_what_is_wrong(bpe_gguf, tmp_path):
    import subprocess
    import sys

    broken = patched(bpe_gguf, tmp_path / "broken.gguf", b"tokenizer.ggml.tokens", 8, struct.pack("<Q", 1 << 62))
    done = subprocess.run([sys.executable, "-m", "execupy", "export-llm", "--gguf", str(broken),
                           "-o", str(tmp_path / "out.pte")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"error: {broken}: " in done.stderr and "metadata 'tokenizer.ggml.tokens'" in done.stderr
    assert not (tmp_path / "out.pte").exists()
