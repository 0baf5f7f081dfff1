"""Hostile checkpoint and tokenizer files end in CheckpointError or TokenizerError naming the file.

A seeded fuzzer. Small valid files of every format we load are written here (with
tests/llm/tiny.py and the tokenizer tests' writers), plus the head of the real SmolLM2 GGUF
(its whole vocabulary) when it is installed. Each variant copies one of them, mutates one
file (bit flips, truncations, huge counts/lengths/offsets, structural JSON edits: invalid
UTF-8, null ids, ids beyond u32, malformed merges, wrong types) and loads it with
``load_checkpoint`` or ``load_tokenizer``; a tokenizer that loads is then used once (encode,
decode, stream). Variants run in worker processes under a memory limit: a worker that dies
is a crash, one that answers nothing for EXECUPY_FUZZ_TIMEOUT seconds a hang; the worker is
restarted after the variant that killed it. The verdict: no foreign exception, no crash, no
hang, and every typed error names the file.

    EXECUPY_FUZZ_VARIANTS=5000 EXECUPY_FUZZ_SEED=7 pytest tests/llm/test_checkpoint_fuzz.py -s

Also EXECUPY_FUZZ_JOBS (worker processes, default 2) and EXECUPY_FUZZ_ONLY=<index> to replay
one variant, EXECUPY_FUZZ_REPORT=<file> to keep every variant's outcome (JSON lines). The
worker is this file run as a script.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

if __name__ == "__main__":  # run as the worker script: make `tests` and `execupy` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

from execupy.errors import CheckpointError, TokenizerError
from execupy.llm.loaders import load_checkpoint, smollm2_gguf_path
from execupy.llm.tokenizer import load_tokenizer
from tests.llm.test_tokenizer import hf_folder, sp_model, tiktoken_file  # noqa: F401  (fixtures)

VARIANTS = int(os.environ.get("EXECUPY_FUZZ_VARIANTS", "500"))
SEED = int(os.environ.get("EXECUPY_FUZZ_SEED", "0"))
JOBS = int(os.environ.get("EXECUPY_FUZZ_JOBS", "2"))
TIMEOUT_S = float(os.environ.get("EXECUPY_FUZZ_TIMEOUT", "30"))
ONLY = os.environ.get("EXECUPY_FUZZ_ONLY")
REPORT = os.environ.get("EXECUPY_FUZZ_REPORT")  # a file to write every variant's result to (JSON lines)
WORKER_MEMORY = 6 << 30  # address space per worker: a gigantic allocation fails instead of swapping
SMOLLM2_HEAD = 2 << 20  # bytes of SmolLM2's GGUF kept: header, vocabulary, merges and tensor infos
SAMPLE_TEXT = "Hello, world! 123 café ☃ <|im_start|>user<|im_end|> <s>"


@dataclass(frozen=True)
class Base:
    """A valid checkpoint or tokenizer laid out in ``root``; variants mutate one of ``files``."""

    name: str
    root: str  # a folder, copied whole for each variant
    target: str  # what the loader is given, relative to root
    files: dict[str, str]  # file relative to root -> its format (picks the mutations)
    loaders: tuple[str, ...]  # "checkpoint" and/or "tokenizer"
    weight: float = 1.0  # relative share of the variants (the SmolLM2 head is slow to load)


# ----------------------------------------------------------------------------- base files


def write_bases(folder: Path, sp_model: Path, hf_folder: Path, tiktoken_file: Path) -> list[Base]:
    """Lay out one small valid file set per format (the tokenizer tests' files among them)."""
    import gguf

    from tests.llm import tiny
    from tests.llm.test_tokenizer import _gguf_from_hf_bpe, _sp_pieces, _train_byte_level_bpe, _write_llama2c

    def new(name: str) -> Path:
        (folder / name).mkdir(parents=True)
        return folder / name

    bases = []
    root = new("gguf-bpe")
    _gguf_from_hf_bpe(root / "model.gguf", _train_byte_level_bpe(), "gpt2")
    bases.append(Base("gguf-bpe", str(root), "model.gguf", {"model.gguf": "gguf"}, ("checkpoint", "tokenizer")))

    root = new("sentencepiece")
    shutil.copy(sp_model, root / "tokenizer.model")
    bases.append(Base("sentencepiece", str(root), "tokenizer.model", {"tokenizer.model": "binary"}, ("tokenizer",)))
    sp, pieces, scores, types = _sp_pieces(sp_model)
    root = new("gguf-spm")
    tiny.write_gguf(root / "model.gguf", "llama", tiny.random_llama_weights(seed=1, vocab_size=len(pieces)),
                    qtypes={"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q8_0,
                            "blk.1.ffn_up.weight": gguf.GGMLQuantizationType.Q4_0},
                    tokenizer={"model": "llama", "tokens": pieces, "scores": scores, "types": types,
                               "bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id()},
                    vocab_size=len(pieces))
    bases.append(Base("gguf-spm-quantized", str(root), "model.gguf", {"model.gguf": "gguf"},
                      ("checkpoint", "tokenizer")))
    root = new("llama2c")
    _write_llama2c(root / "tokenizer.bin", pieces, scores)
    bases.append(Base("llama2c", str(root), "tokenizer.bin", {"tokenizer.bin": "llama2c"}, ("tokenizer",)))

    root = new("gguf-gpt2")
    tiny.write_gguf(root / "model.gguf", "gpt2", tiny.random_gpt2_weights(seed=2))
    bases.append(Base("gguf-gpt2", str(root), "model.gguf", {"model.gguf": "gguf"}, ("checkpoint",)))

    root = tiny.write_hf_llama(new("hf-llama"), tiny.random_llama_weights(seed=3))
    bases.append(Base("hf-llama", str(root), ".", {"config.json": "json", "model-00001-of-00002.safetensors":
                                                   "safetensors", "model-00002-of-00002.safetensors": "safetensors"},
                      ("checkpoint",)))
    root = tiny.write_hf_gpt2(new("hf-gpt2"), tiny.random_gpt2_weights(seed=4))
    bases.append(Base("hf-gpt2", str(root), ".", {"config.json": "json", "model.safetensors": "safetensors"},
                      ("checkpoint",)))
    root = tiny.write_meta(new("meta"), tiny.random_llama_weights(seed=5), shards=2)
    bases.append(Base("meta", str(root), ".", {"params.json": "json", "consolidated.00.pth": "pth",
                                               "consolidated.01.pth": "pth"}, ("checkpoint",)))

    root = folder / "hf-tokenizer"
    shutil.copytree(hf_folder, root)  # tokenizer.json and tokenizer_config.json
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    bases.append(Base("hf-tokenizer", str(root), ".", {"tokenizer.json": "tokenizer.json",
                                                       "tokenizer_config.json": "json",
                                                       "generation_config.json": "json"}, ("tokenizer",), 2.0))

    root = new("tiktoken")
    shutil.copy(tiktoken_file, root / "tokenizer.model")
    bases.append(Base("tiktoken", str(root), "tokenizer.model", {"tokenizer.model": "tiktoken"}, ("tokenizer",)))

    smollm2 = smollm2_gguf_path()
    if smollm2 is not None:
        root = new("smollm2-head")
        with open(smollm2, "rb") as fh:
            (root / "smollm2-head.gguf").write_bytes(fh.read(SMOLLM2_HEAD))
        bases.append(Base("smollm2-head", str(root), "smollm2-head.gguf", {"smollm2-head.gguf": "gguf"},
                          ("tokenizer", "checkpoint"), 0.25))
    return bases


# ----------------------------------------------------------------------------- mutations


def hostile_int(rng: random.Random, size: int, original: int, file_size: int) -> int:
    """A value for a ``size``-byte unsigned field that a reader must not trust."""
    top = (1 << (8 * size)) - 1
    return rng.choice([0, 1, top, top >> 1, (top >> 1) + 1, original + 1, original - 1, original * 2 + 1,
                       file_size, file_size + 1, rng.randrange(top + 1)]) & top


def flip_bits(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 16])):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def truncate(rng: random.Random, data: bytes) -> bytes:
    cut = rng.choice([rng.randrange(min(len(data), 64)), rng.randrange(len(data)), len(data) - rng.randint(1, 16)])
    return data[: max(cut, 0)]


def overwrite_run(rng: random.Random, data: bytes) -> bytes:
    pos, n = rng.randrange(len(data)), rng.choice([1, 4, 8, 32])
    fill = rng.choice([b"\xff" * n, b"\x00" * n, rng.randbytes(n)])
    return data[:pos] + fill + data[pos + n :]


def insert_or_delete(rng: random.Random, data: bytes) -> bytes:
    pos = rng.randrange(len(data))
    if rng.random() < 0.5:
        return data[:pos] + rng.randbytes(rng.choice([1, 3, 8])) + data[pos:]
    return data[:pos] + data[pos + rng.choice([1, 3, 8, 100]) :]


BYTE_MUTATIONS = [flip_bits, truncate, overwrite_run, insert_or_delete]


# GGUF: every field of the header, metadata and tensor infos, found by an independent walk.
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(data: bytes) -> dict[str, list[tuple[int, int]]]:
    """(offset, size) of the GGUF fields by role: count (lengths, counts, dims, offsets),
    type (value types, n_dims, tensor types), scalar (metadata values), string (payloads)."""
    fields: dict[str, list[tuple[int, int]]] = {"count": [], "type": [], "scalar": [], "string": []}
    pos = 4

    def take(role: str, size: int) -> int:
        nonlocal pos
        fields[role].append((pos, size))
        value = int.from_bytes(data[pos : pos + size], "little")
        pos += size
        return value

    def string() -> None:
        nonlocal pos
        n = take("count", 8)
        fields["string"].append((pos, n))
        pos += n

    def value(vtype: int) -> None:
        if vtype == 8:
            string()
        elif vtype == 9:
            item_type, count = take("type", 4), take("count", 8)
            for _ in range(count):
                value(item_type)
        else:
            take("scalar", _GGUF_SCALAR_SIZES[vtype])

    take("type", 4)  # version
    n_tensors, n_kv = take("count", 8), take("count", 8)
    for _ in range(n_kv):
        string()
        value(take("type", 4))
    for _ in range(n_tensors):
        string()
        for _ in range(take("type", 4)):
            take("count", 8)
        take("type", 4)
        take("count", 8)
    return fields


_GGUF_FIELD_CACHE: dict[str, dict[str, list[tuple[int, int]]]] = {}


def gguf_field_mutation(rng: random.Random, data: bytes, key: str) -> tuple[bytes, str]:
    if key not in _GGUF_FIELD_CACHE:
        _GGUF_FIELD_CACHE[key] = gguf_fields(data)
    fields = _GGUF_FIELD_CACHE[key]
    role = rng.choice(["count", "count", "type", "scalar", "string"])
    pos, size = rng.choice(fields[role])
    out = bytearray(data)
    if role == "string":
        if size == 0:
            return data, "string (empty, unchanged)"
        at = pos + rng.randrange(size)
        out[at] = rng.choice([0xFF, 0xC3, 0x20, 0x00, 0x80, ord("a")])
        return bytes(out), f"string byte at {at} = {out[at]:#x}"
    original = int.from_bytes(data[pos : pos + size], "little")
    new = hostile_int(rng, size, original, len(data))
    out[pos : pos + size] = new.to_bytes(size, "little")
    return bytes(out), f"{role} at {pos} {original} -> {new}"


def llama2c_mutation(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A hostile record length (or the max-length header)."""
    lengths, pos = [0], 4
    while pos + 8 <= len(data):
        lengths.append(pos + 4)
        pos += 8 + struct.unpack_from("<i", data, pos + 4)[0]
    at = rng.choice(lengths)
    value = rng.choice([-1, -8, -(1 << 31), (1 << 31) - 1, len(data), 0, 1000])
    return data[:at] + struct.pack("<i", value) + data[at + 4 :], f"length at {at} = {value}"


# JSON: structural edits anywhere in the tree, and targeted ones for tokenizer.json.
def hostile_json_value(rng: random.Random) -> Any:
    return rng.choice([None, -1, 0, 1 << 32, 1 << 64, -(1 << 63), 10 ** 30, 1.5, float("nan"), float("inf"),
                       "x", "", [], {}, True, [1, 2], {"a": None}, "\u0000"])


def json_nodes(value: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += json_nodes(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += json_nodes(v, path + (i,))
    return out


def json_set(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = root
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return root


def json_replace_node(rng: random.Random, spec: Any) -> tuple[Any, str]:
    path = rng.choice(json_nodes(spec))
    value = hostile_json_value(rng)
    return json_set(spec, path, value), f"{'/'.join(map(str, path))[:80]} = {value!r}"


def json_delete_key(rng: random.Random, spec: Any) -> tuple[Any, str]:
    objects = [p for p in json_nodes(spec) if isinstance(_at(spec, p), dict) and _at(spec, p)]
    if not objects:
        return spec, "no key to delete"
    path = rng.choice(objects)
    key = rng.choice(list(_at(spec, path)))
    del _at(spec, path)[key]
    return spec, f"deleted {'/'.join(map(str, path + (key,)))[:80]}"


def _at(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


def tokenizer_json_edit(rng: random.Random, spec: Any) -> tuple[Any, str]:
    """The edits `tokenizers` answers with a bare Exception: bad ids, bad merges, bad added tokens."""
    model = spec["model"]
    vocab, merges, added = model["vocab"], model["merges"], spec["added_tokens"]
    kind = rng.choice(["vocab id", "merge", "added id", "added content", "model type", "drop piece"])
    if kind == "vocab id":
        piece = rng.choice(list(vocab))
        vocab[piece] = rng.choice([None, -1, 1 << 32, 1 << 64, "7", 2.5, len(vocab) + 10 ** 6, True,
                                   len(vocab) + 5, vocab[rng.choice(list(vocab))]])  # a gap, a duplicate
        return spec, f"vocab[{piece!r}] = {vocab[piece]!r}"
    if kind == "merge":
        i = rng.randrange(len(merges))
        merges[i] = rng.choice(["a", "a b c", "", " ", ["a"], ["a", "b", "c"], [1, 2], 7, None, "zz\u0001 qq",
                                ["Ġt", "zzz"], "Ġt he"])
        return spec, f"merges[{i}] = {merges[i]!r}"
    if kind in ("added id", "added content"):
        token = rng.choice(added)
        field = "id" if kind == "added id" else "content"
        token[field] = rng.choice([None, -1, 1 << 32, "3", 1.5, 12345678, ""] if field == "id" else [None, 5, ""])
        return spec, f"added token {field} = {token[field]!r}"
    if kind == "model type":
        model["type"] = rng.choice(["Unigram", "WordPiece", "WordLevel", "Nope", 3, None])
        return spec, f"model type = {model['type']!r}"
    piece = rng.choice(list(vocab))
    del vocab[piece]
    return spec, f"dropped vocab piece {piece!r}"


def mutate_json(rng: random.Random, data: bytes, fmt: str) -> tuple[bytes, str]:
    choice = rng.random()
    if choice < 0.2:  # byte-level: invalid UTF-8, truncation, bit flips
        at = rng.randrange(len(data))
        kind = rng.choice(["utf8", "truncate", "flip"])
        if kind == "utf8":
            return data[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]) + data[at:], f"bytes at {at}"
        return (truncate(rng, data), "truncated") if kind == "truncate" else (flip_bits(rng, data), "bit flips")
    if choice < 0.25:  # deep nesting
        depth = rng.choice([1000, 100_000])
        return b"[" * depth + b"1" + b"]" * depth, f"nesting depth {depth}"
    spec = json.loads(data)
    if fmt == "tokenizer.json" and choice < 0.7:
        spec, what = tokenizer_json_edit(rng, spec)
    elif choice < 0.85:
        spec, what = json_replace_node(rng, spec)
    else:
        spec, what = json_delete_key(rng, spec)
    return json.dumps(spec).encode(), what


def mutate_safetensors(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    (n,) = struct.unpack_from("<Q", data)
    choice = rng.random()
    if choice < 0.25:
        new = hostile_int(rng, 8, n, len(data))
        return struct.pack("<Q", new) + data[8:], f"header length {n} -> {new}"
    if choice < 0.6:
        header, what = mutate_json(rng, data[8 : 8 + n], "json")
        return struct.pack("<Q", len(header)) + header + data[8 + n :], f"header: {what}"
    mutation = rng.choice(BYTE_MUTATIONS)
    return mutation(rng, data), mutation.__name__


def mutate_tiktoken(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    lines = data.splitlines()
    i = rng.randrange(len(lines))
    token, rank = lines[i].split()
    kind = rng.choice(["rank", "base64", "duplicate", "drop", "empty", "fields", "bytes"])
    if kind == "rank":
        lines[i] = token + b" " + rng.choice([b"-1", b"4294967296", b"99999999999999999999", b"x", b"1.5",
                                              lines[0].split()[1]])
    elif kind == "base64":
        lines[i] = token[:-1] + rng.choice([b"!", b"\xff", b"="]) + b" " + rank
    elif kind == "duplicate":
        lines.insert(rng.randrange(len(lines)), lines[i])
    elif kind == "drop":
        del lines[i]
    elif kind == "empty":
        lines[i] = b"= " + rank
    elif kind == "fields":
        lines[i] = rng.choice([token, token + b" " + rank + b" 3", b""])
    else:
        mutation = rng.choice(BYTE_MUTATIONS)
        return mutation(rng, data), mutation.__name__
    return b"\n".join(lines) + b"\n", f"{kind} on line {i + 1}"


def mutate_pth(rng: random.Random, data: bytes, path: Path) -> tuple[bytes, str]:
    """Byte damage to the zip, or a well-formed .pth holding the wrong kind of thing."""
    if rng.random() < 0.75:
        mutation = rng.choice(BYTE_MUTATIONS)
        return mutation(rng, data), mutation.__name__
    import io

    import torch

    good = torch.load(path, weights_only=True)
    name = rng.choice(sorted(good))
    kind = rng.choice(["list", "int key", "int tensor", "number", "shape", "missing"])
    if kind == "list":
        value: Any = list(good.values())
    elif kind == "int key":
        value = {**good, 7: good[name]}
    elif kind == "int tensor":
        value = {**good, name: good[name].to(torch.int64)}
    elif kind == "number":
        value = {**good, name: 3.0}
    elif kind == "shape":
        value = {**good, name: torch.zeros(3, 5, 7)}
    else:
        value = {k: v for k, v in good.items() if k != name}
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue(), f"{kind} ({name})"


def mutate(rng: random.Random, path: Path, fmt: str, key: str) -> str:
    """Mutate the file at ``path`` in place; returns what was done."""
    data = path.read_bytes()
    if fmt == "gguf" and rng.random() < 0.6:
        data, what = gguf_field_mutation(rng, data, key)
    elif fmt == "llama2c" and rng.random() < 0.5:
        data, what = llama2c_mutation(rng, data)
    elif fmt in ("json", "tokenizer.json"):
        data, what = mutate_json(rng, data, fmt)
    elif fmt == "safetensors":
        data, what = mutate_safetensors(rng, data)
    elif fmt == "tiktoken":
        data, what = mutate_tiktoken(rng, data)
    elif fmt == "pth":
        data, what = mutate_pth(rng, data, path)
    else:
        mutation = rng.choice(BYTE_MUTATIONS)
        data, what = mutation(rng, data), mutation.__name__
    path.write_bytes(data)
    return what


# ----------------------------------------------------------------------------- worker


def use_tokenizer(tok: Any) -> None:
    """What a runner does with a tokenizer it loaded: encode a prompt, decode, stream."""
    ids = tok.encode(SAMPLE_TEXT, allow_special=True)
    tok.decode(ids)
    tok.decode(ids, skip_special=False)
    for i in ids + [0, tok.vocab_size - 1]:
        tok.decode_token(i)
    tok.reset_stream()


def run_variant(bases: list[Base], seed: int, index: int, scratch: Path) -> dict[str, Any]:
    rng = random.Random(f"{seed}/{index}")
    base = rng.choices(bases, weights=[b.weight for b in bases])[0]
    loader = rng.choice(base.loaders)
    rel, fmt = rng.choice(sorted(base.files.items()))
    root = scratch / f"v{index}"
    shutil.copytree(base.root, root)
    what = mutate(rng, root / rel, fmt, f"{base.name}/{rel}")
    target = root / base.target
    result = {"i": index, "base": base.name, "loader": loader, "file": rel, "mutation": what}
    started = time.perf_counter()
    try:
        if loader == "checkpoint":
            load_checkpoint(target)
        else:
            use_tokenizer(load_tokenizer(target))
        result["outcome"] = "ok"
    except (CheckpointError, TokenizerError) as e:
        # The error must say which file: the one given to the loader or the one inside it.
        result["outcome"] = "typed" if str(root) in str(e) else "unnamed"
        result["detail"] = f"{type(e).__name__}: {str(e)[:300]}"
    except Exception as e:  # noqa: BLE001 - any other exception is the bug this test looks for
        import traceback

        result["outcome"] = "foreign"
        result["detail"] = f"{type(e).__name__}: {str(e)[:300]}\n{''.join(traceback.format_tb(e.__traceback__)[-3:])}"
    result["seconds"] = round(time.perf_counter() - started, 3)
    shutil.rmtree(root, ignore_errors=True)
    return result


def worker_main(bases_file: str, seed: int, indices: list[int], scratch: str) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    bases = [Base(**b) for b in json.loads(Path(bases_file).read_text())]
    for index in indices:
        print(json.dumps({"i": index, "started": True}), flush=True)
        print(json.dumps(run_variant(bases, seed, index, Path(scratch))), flush=True)


# ----------------------------------------------------------------------------- driver


def _reader(stream: Any, lines: "queue.Queue[str | None]") -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_batch(bases_file: Path, seed: int, indices: list[int], scratch: Path) -> list[dict[str, Any]]:
    """Run the variants in a worker, restarting it after the variant that crashed or hung it."""
    results: list[dict[str, Any]] = []
    todo = list(indices)
    while todo:
        ended_by = _run_worker(bases_file, seed, todo, scratch, results)
        if ended_by is None:  # the worker went through its whole list
            break
        if ended_by["outcome"] == "no start":  # it would fail the same way again
            results.extend({**ended_by, "i": i} for i in todo)
            break
        results.append(ended_by)
        finished = {r["i"] for r in results}
        todo = [i for i in todo if i not in finished]
    return results


def _run_worker(bases_file: Path, seed: int, todo: list[int], scratch: Path,
                results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One worker process over ``todo``, appending its results; the outcome of the variant
    that ended it early (a crash or a hang), or None once it has done them all."""
    # stderr goes to a file: a pipe nobody reads would fill and stall a chatty library.
    with open(scratch / f"worker-{todo[0]}.stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, __file__, str(bases_file), str(seed), json.dumps(todo),
                                 str(scratch)], stdout=subprocess.PIPE, stderr=err, text=True)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        current, done = None, 0
        while True:
            try:  # until its first message the worker is importing: give it longer
                line = lines.get(timeout=TIMEOUT_S + (0 if current is not None or done else 60))
            except queue.Empty:
                proc.kill()
                proc.wait()
                return {"i": current if current is not None else todo[done], "outcome": "hang",
                        "detail": f"no answer within {TIMEOUT_S} s"}
            if line is None:  # the worker exited
                proc.wait()
                if done == len(todo):
                    return None
                err.seek(0)
                detail = f"worker exit {proc.returncode}: {err.read()[-500:]}"
                if current is None and not done:
                    return {"i": todo[0], "outcome": "no start", "detail": detail}
                return {"i": current if current is not None else todo[done], "outcome": "crash", "detail": detail}
            message = json.loads(line)
            if message.get("started"):
                current = message["i"]
            else:
                results.append(message)
                current, done = None, done + 1


def run_fuzz(bases_file: Path, seed: int, indices: list[int], scratch: Path, jobs: int) -> list[dict[str, Any]]:
    batches = [indices[k::jobs] for k in range(jobs)]
    results: list[list[dict[str, Any]]] = [[] for _ in batches]
    threads = [threading.Thread(target=lambda k=k: results[k].extend(run_batch(bases_file, seed, batches[k], scratch)))
               for k in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted((r for batch in results for r in batch), key=lambda r: r["i"])


@pytest.fixture(scope="module")
def bases(tmp_path_factory, sp_model, hf_folder, tiktoken_file) -> tuple[Path, list[Base]]:
    folder = tmp_path_factory.mktemp("fuzz_bases")
    found = write_bases(folder, sp_model, hf_folder, tiktoken_file[0])
    bases_file = folder / "bases.json"
    bases_file.write_text(json.dumps([asdict(b) for b in found]))
    return bases_file, found


def test_every_base_file_loads(bases):
    """The files the fuzzer starts from are valid, so the errors below come from the mutations."""
    for base in bases[1]:
        target = Path(base.root) / base.target
        if "checkpoint" in base.loaders and base.name != "smollm2-head":  # the head has no tensor data
            config, state = load_checkpoint(target)
            assert config.n_layers >= 1 and state["output.weight"].shape == (config.vocab_size, config.dim)
        if "tokenizer" in base.loaders:
            tok = load_tokenizer(target)
            use_tokenizer(tok)
            assert tok.decode(tok.encode("Hello world", bos=False)) == "Hello world", base.name


def test_hostile_files_end_in_typed_errors(bases, tmp_path):
    bases_file, found = bases
    indices = [int(ONLY)] if ONLY is not None else list(range(VARIANTS))
    started = time.perf_counter()
    results = run_fuzz(bases_file, SEED, indices, tmp_path, min(JOBS, len(indices)))
    elapsed = time.perf_counter() - started
    outcomes = Counter(r["outcome"] for r in results)
    by_base = Counter((r.get("base", "?"), r["outcome"]) for r in results)
    slowest = max(results, key=lambda r: r.get("seconds", 0))
    print(f"\nfuzz: {len(results)} variants, seed {SEED}, {elapsed:.1f} s, {dict(outcomes)}; slowest variant "
          f"{slowest['i']} ({slowest.get('base')}) {slowest.get('seconds')} s", file=sys.stderr)
    for (base, outcome), n in sorted(by_base.items()):
        print(f"  {base:20s} {outcome:8s} {n}", file=sys.stderr)
    if REPORT:
        Path(REPORT).write_text("".join(json.dumps(r) + "\n" for r in results))
    assert len(results) == len(indices)
    bad = [r for r in results if r["outcome"] not in ("ok", "typed")]
    report = "\n".join(f"EXECUPY_FUZZ_SEED={SEED} EXECUPY_FUZZ_ONLY={r['i']}: {r['outcome']} {r.get('base')} "
                       f"{r.get('loader')} {r.get('file')} [{r.get('mutation')}]\n    {r.get('detail')}"
                       for r in bad[:25])
    assert not bad, f"{len(bad)} of {len(results)} variants ended badly:\n{report}"
    if ONLY is None:  # the mutations reach every format and are mostly rejected, not shrugged off
        tried = Counter(r["base"] for r in results)
        assert {b for b, n in tried.items() if n >= 10} <= {r["base"] for r in results if r["outcome"] == "typed"}
        assert outcomes["typed"] > len(results) / 2


if __name__ == "__main__":
    worker_main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])
