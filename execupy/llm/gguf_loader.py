"""Load a GGUF file (llama.cpp's format) into a ModelConfig and a canonical float32 state dict.

Torch-free. We parse the file ourselves (header, metadata, tensor infos), checking every
count, length and offset against the bytes that are really there before trusting it, so
a corrupt file ends in a CheckpointError naming what is wrong rather than in a huge
allocation or a foreign exception. Tensors stay in a memory map until asked for; the
`gguf` package then dequantizes their bytes (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K,
Q5_K, Q6_K and the other types it knows). Architectures: ``llama`` (Llama 2/3, SmolLM2,
TinyLlama, Mistral), ``qwen2`` (Qwen2/2.5, with q/k/v biases) and ``gpt2``.

File layout (little-endian): "GGUF", u32 version (2 or 3), u64 tensor count, u64
metadata count; metadata entries (string key, u32 value type, value); tensor infos
(string name, u32 n_dims, u64 dims fastest first, u32 ggml type, u64 offset); padding to
``general.alignment``; tensor data. A string is a u64 length and UTF-8 bytes; an array a
u32 item type, a u64 count and the items.

RoPE: llama.cpp's converter permutes the q/k rows of ``llama``-architecture models to
the interleaved-pair layout; we permute them back to the HF half-rotation layout our
model uses (see execupy.llm.config). ``qwen2`` files are stored unpermuted (llama.cpp
runs them with NEOX-style rope), so they need nothing.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from execupy.llm.config import (
    CheckpointError,
    ModelConfig,
    check_state_dict,
    config_value,
    interleaved_to_half,
    naming,
)

# GGUF tensor-name suffixes -> canonical names, per block and global.
_LLAMA_BLOCK = {
    "attn_norm": "attention_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_down": "feed_forward.w2",
    "ffn_up": "feed_forward.w3",
}
_GPT2_BLOCK = {
    "attn_norm": "attention_norm",
    "attn_qkv": "attention.wqkv",  # split into wq/wk/wv after loading
    "attn_output": "attention.wo",
    "ffn_norm": "ffn_norm",
    "ffn_up": "feed_forward.w1",
    "ffn_down": "feed_forward.w2",
}
_GLOBAL = {
    "token_embd": "tok_embeddings",
    "position_embd": "pos_embeddings",
    "output_norm": "norm",
    "output": "output",
}
# GGUF architectures whose q/k rows were permuted to interleaved-pair RoPE by the converter.
_PERMUTED_QK_ARCHS = ("llama",)
SUPPORTED_ARCHS = ("llama", "qwen2", "gpt2")

# Metadata value types (GGUF's enum) with a fixed size, as numpy dtypes; 7 is bool.
_SCALAR_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                 10: "<u8", 11: "<i8", 12: "<f8"}
_BOOL, _STRING, _ARRAY = 7, 8, 9
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
_MAX_DIMS = 4  # GGML tensors have at most four dimensions
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor's bytes are, checked to lie inside the file."""

    name: str
    shape: tuple[int, ...]  # numpy (row-major) order: the slowest dimension first
    ggml_type: int  # gguf.GGMLQuantizationType value
    start: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Reads little-endian values off a buffer, each one checked against the bytes left."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what} (at byte {self.pos} of {len(self.buf)})")

    def need(self, n: int, what: str) -> None:
        if n > len(self.buf) - self.pos:
            raise self.fail(f"{what} needs {n} bytes but only {len(self.buf) - self.pos} are left")

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        self.need(fmt.size, what)
        values = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return values

    def u32(self, what: str) -> int:
        return self.unpack(_U32, what)[0]

    def u64(self, what: str) -> int:
        return self.unpack(_U64, what)[0]

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 (byte {e.start} of {n})") from e
        self.pos += n
        return text

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what)
        if vtype not in _SCALAR_TYPES:
            raise self.fail(f"{what} has unknown value type {vtype}")
        return self.scalars(vtype, 1, what)[0]

    def array(self, what: str) -> list:
        item_type = self.u32(f"item type of {what}")
        count = self.u64(f"item count of {what}")
        if item_type == _STRING:
            self.need(count * 8, f"{count} strings of {what}")  # each at least its length field
            return [self.string(f"item {i} of {what}") for i in range(count)]
        if item_type == _ARRAY:
            raise self.fail(f"{what} is an array of arrays, which GGUF readers do not support")
        if item_type not in _SCALAR_TYPES:
            raise self.fail(f"{what} has unknown item type {item_type}")
        return self.scalars(item_type, count, what)

    def scalars(self, vtype: int, count: int, what: str) -> list:
        dtype = np.dtype(_SCALAR_TYPES[vtype])
        self.need(count * dtype.itemsize, what)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return (values != 0).tolist() if vtype == _BOOL else values.tolist()


_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFFile:
    """A parsed GGUF file: metadata as plain Python values, tensors on demand.

    ``metadata_only`` stops after the metadata (a tokenizer needs nothing else), so a file
    whose tensor part is cut off still yields its vocabulary.
    """

    def __init__(self, path: str | os.PathLike, metadata_only: bool = False) -> None:
        self.path = os.fspath(path)
        self._map = _map_file(self.path)
        cur = _Cursor(self._map, self.path)
        magic, version, n_tensors, n_kv = cur.unpack(_HEADER, "GGUF header")
        if magic != b"GGUF":
            raise CheckpointError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        if version not in (2, 3):
            big_endian = version & 0xFFFF == 0
            raise CheckpointError(f"{self.path}: GGUF version {version} is not supported (have 2 and 3)"
                                  + ("; this looks like a big-endian file" if big_endian else ""))
        self.metadata = _read_metadata(cur, n_kv)
        self.tensors: dict[str, GGUFTensor] = {}
        if not metadata_only:
            self.tensors = _read_tensor_infos(cur, n_tensors, self._alignment())

    def _alignment(self) -> int:
        align = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise CheckpointError(f"{self.path}: general.alignment {align!r} is not a power of two")
        return align

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise CheckpointError(f"{self.path}: GGUF metadata has no {key!r}")
        return self.metadata[key]

    def tensor_type(self, name: str) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.tensors[name].ggml_type).name

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [..., bytes per row], as `gguf.quants` takes them."""
        t = self.tensors[name]
        data = np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.start)
        return data.reshape(*t.shape[:-1], -1) if t.nbytes else data

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32, in numpy (row-major, torch) order: [rows, cols]."""
        import gguf

        t = self.tensors[name]
        try:
            values = gguf.quants.dequantize(self.raw(name), gguf.GGMLQuantizationType(t.ggml_type))
        except NotImplementedError as e:
            raise CheckpointError(f"{self.path}: tensor {name}: GGUF type {self.tensor_type(name)} "
                                  "is not supported") from e
        out = np.ascontiguousarray(values, dtype=np.float32).reshape(t.shape)
        # F32 tensors come back as read-only views of the memory map; hand out owned arrays.
        return out if out.flags.writeable else out.copy()


def _map_file(path: str) -> Any:
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < _HEADER.size:
                raise CheckpointError(f"{path}: {size} bytes is too short for a GGUF file")
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from e


def _read_metadata(cur: _Cursor, count: int) -> dict[str, Any]:
    cur.need(count * 12, f"{count} metadata entries")  # key length + value type, at the least
    metadata: dict[str, Any] = {}
    for i in range(count):
        key = cur.string(f"key of metadata entry {i}")
        vtype = cur.u32(f"value type of {key!r}")
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")
    return metadata


def _read_tensor_infos(cur: _Cursor, count: int, alignment: int) -> dict[str, GGUFTensor]:
    import gguf

    cur.need(count * 24, f"{count} tensor infos")  # name length, n_dims, type, offset at the least
    infos = []
    for i in range(count):
        name = cur.string(f"name of tensor {i}")
        n_dims = cur.u32(f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {_MAX_DIMS})")
        dims = [cur.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims)]
        ggml_type, offset = cur.u32(f"type of tensor {name!r}"), cur.u64(f"offset of tensor {name!r}")
        if ggml_type not in gguf.GGML_QUANT_SIZES:
            raise cur.fail(f"tensor {name!r} has unknown GGML type {ggml_type}")
        infos.append((name, dims, ggml_type, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, ggml_type, offset in infos:
        if name in tensors:
            raise cur.fail(f"tensor {name!r} appears twice")
        tensors[name] = _tensor(cur, name, dims, ggml_type, data_start, offset, alignment)
    return tensors


def _tensor(cur: _Cursor, name: str, dims: list[int], ggml_type: int, data_start: int, offset: int,
            alignment: int) -> GGUFTensor:
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    type_name = gguf.GGMLQuantizationType(ggml_type).name
    if dims[0] % block:
        raise cur.fail(f"tensor {name!r}: first dimension {dims[0]} is not a multiple of the "
                       f"{type_name} block size {block}")
    if 0 in dims:
        raise cur.fail(f"tensor {name!r} has an empty dimension: {dims}")
    nbytes = math.prod(dims) // block * block_bytes  # Python ints: no overflow
    start = data_start + offset
    if offset % alignment or start + nbytes > len(cur.buf):
        raise cur.fail(f"tensor {name!r} ({type_name}, dims {dims}) at data offset {offset} needs "
                       f"{nbytes} bytes: {'misaligned' if offset % alignment else 'runs past the end of the file'}")
    return GGUFTensor(name, tuple(reversed(dims)), ggml_type, start, nbytes)


def load_gguf(path: "str | os.PathLike | GGUFFile") -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a GGUF checkpoint (a path, or a GGUFFile already open): (config, canonical float32 state dict)."""
    with naming(path.path if isinstance(path, GGUFFile) else path):
        f = path if isinstance(path, GGUFFile) else GGUFFile(path)
        config = gguf_config(f)
        state = _load_tensors(f, config, f.metadata["general.architecture"])
        return config, state


def gguf_config(f: GGUFFile) -> ModelConfig:
    """Hyperparameters from the ``{arch}.*`` metadata keys."""
    arch = config_value(f.metadata, "general.architecture", "str")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"{f.path}: GGUF architecture {arch!r} is not supported (have {SUPPORTED_ARCHS})")

    def get(key: str, kind: str, *default: Any) -> Any:
        return config_value(f.metadata, f"{arch}.{key}", kind, *default)

    n_heads = get("attention.head_count", "int")
    dim = get("embedding_length", "int")
    is_gpt2 = arch == "gpt2"
    eps_key = "attention.layer_norm_epsilon" if is_gpt2 else "attention.layer_norm_rms_epsilon"
    return ModelConfig(
        arch="gpt2" if is_gpt2 else "llama",
        dim=dim,
        n_layers=get("block_count", "int"),
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", "int", n_heads),
        vocab_size=get("vocab_size", "int", None) or _embedding_rows(f),
        hidden_dim=get("feed_forward_length", "int"),
        norm_eps=_f32_to_decimal(get(eps_key, "float", 1e-5)),
        rope_theta=_f32_to_decimal(get("rope.freq_base", "float", 10000.0)),
        max_seq_len=get("context_length", "int", 2048),
        tie_embeddings="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        head_dim=get("attention.key_length", "int", dim // n_heads),
        rope_freq_factors=_rope_freq_factors(f),
        name=config_value(f.metadata, "general.name", "str", ""),
    )


def _embedding_rows(f: GGUFFile) -> int:
    # Older files do not say the vocabulary size; the embedding table does.
    if "token_embd.weight" not in f.tensors:
        raise CheckpointError(f"{f.path}: no vocab_size in the metadata and no token_embd.weight tensor")
    return f.tensors["token_embd.weight"].shape[0]


def _f32_to_decimal(value: float) -> float:
    """GGUF stores these as float32 (1e-5 reads back as 9.99999974e-06); take the shortest
    decimal that rounds to the same float32, which is the value the model was written with."""
    with np.errstate(over="ignore"):  # a value beyond float32 becomes inf, which ModelConfig rejects
        return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _rope_freq_factors(f: GGUFFile) -> tuple[float, ...] | None:
    # Llama 3.1+ GGUFs carry the "llama3" rope scaling as a tensor of frequency divisors.
    if "rope_freqs.weight" not in f.tensors:
        return None
    return tuple(float(x) for x in f.dequantize("rope_freqs.weight").reshape(-1))


def _canonical_name(gguf_name: str, block_map: dict[str, str]) -> str | None:
    """``blk.3.attn_q.weight`` -> ``layers.3.attention.wq.weight``; None for tensors we skip."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        base = block_map.get(parts[2]) if len(parts) == 4 and parts[1].isdecimal() else None
        return None if base is None else f"layers.{int(parts[1])}.{base}.{parts[-1]}"
    base = _GLOBAL.get(parts[0])
    return None if base is None else f"{base}.{parts[-1]}"


def _load_tensors(f: GGUFFile, config: ModelConfig, arch: str) -> dict[str, np.ndarray]:
    block_map = _GPT2_BLOCK if arch == "gpt2" else _LLAMA_BLOCK
    state: dict[str, np.ndarray] = {}
    for gguf_name in f.tensors:
        name = _canonical_name(gguf_name, block_map)
        if name is None:
            if gguf_name != "rope_freqs.weight":
                raise CheckpointError(f"{f.path}: unexpected tensor {gguf_name!r} for architecture {arch!r}")
            continue
        state[name] = f.dequantize(gguf_name)
    if arch == "gpt2":
        _split_fused_qkv(state, config)
    if config.tie_embeddings and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    check_state_dict(config, state)  # before the permutation below relies on the shapes
    if arch in _PERMUTED_QK_ARCHS:
        for i in range(config.n_layers):
            for proj, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads)):
                for kind in ("weight", "bias"):
                    name = f"layers.{i}.attention.{proj}.{kind}"
                    if name in state:
                        state[name] = interleaved_to_half(state[name], heads)
    return state


def _split_fused_qkv(state: dict[str, np.ndarray], config: ModelConfig) -> None:
    q_rows = config.n_heads * config.head_dim
    kv_rows = config.n_kv_heads * config.head_dim
    for i in range(min(config.n_layers, len(state))):  # a missing layer is reported by check_state_dict
        for kind in ("weight", "bias"):
            fused = state.pop(f"layers.{i}.attention.wqkv.{kind}", None)
            if fused is None or fused.shape[0] != q_rows + 2 * kv_rows:
                raise CheckpointError(f"blk.{i}.attn_qkv.{kind} is missing or does not have "
                                      f"{q_rows + 2 * kv_rows} rows")
            q, k, v = np.split(fused, [q_rows, q_rows + kv_rows], axis=0)
            for proj, part in (("wq", q), ("wk", k), ("wv", v)):
                state[f"layers.{i}.attention.{proj}.{kind}"] = np.ascontiguousarray(part)
