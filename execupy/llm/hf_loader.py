"""Load a Hugging Face checkpoint folder (config.json + *.safetensors) into canonical form.

Torch-free. Supported ``model_type``: llama, mistral, qwen2 (q/k/v biases), smollm via
llama, and gpt2. HF Llama weights already use the half-rotation RoPE layout our model
uses, so they need no permutation; GPT-2's Conv1D weights are transposed and its fused
``c_attn`` split into q, k and v.

Safetensors files are read with a small parser over a memory map (the format is an
8-byte header length, a JSON header, then raw little-endian data) because the
`safetensors` numpy binding cannot return bfloat16, the dtype most checkpoints use.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from execupy.llm.config import (
    CheckpointError,
    ModelConfig,
    check_layer_count,
    check_state_dict,
    config_value,
    llama3_rope_freq_factors,
    naming,
    read_json_object,
)

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_LLAMA_TYPES = ("llama", "mistral", "qwen2")


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as float32 numpy arrays (bf16/f16 widened)."""
    with naming(path):
        buf = _map(path)
        header, data_start = _safetensors_header(buf)
        return {name: _safetensors_tensor(buf, data_start, name, info)
                for name, info in header.items() if name != "__metadata__"}


def _map(path: str | os.PathLike) -> Any:
    try:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size < 8:
                raise CheckpointError("too short for a safetensors file")
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"cannot be read ({e.strerror})") from e


def _safetensors_header(buf: Any) -> tuple[dict[str, Any], int]:
    """The JSON header (checked to be an object) and where the data begins."""
    (header_len,) = struct.unpack("<Q", buf[:8])
    if 8 + header_len > len(buf):
        raise CheckpointError(f"safetensors header length {header_len} runs past the end of the file")
    try:
        header = json.loads(buf[8 : 8 + header_len].decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"safetensors header is not UTF-8 (byte {8 + e.start})") from e
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"safetensors header is not valid JSON ({str(e)[:200]})") from e
    if not isinstance(header, dict):
        raise CheckpointError("safetensors header is not a JSON object")
    return header, 8 + header_len


def _safetensors_tensor(buf: Any, data_start: int, name: str, info: Any) -> np.ndarray:
    """One tensor, after checking its dtype, shape and offsets against each other and the file."""
    if not isinstance(info, dict):
        raise CheckpointError(f"tensor {name!r}: header entry is not an object")
    dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise CheckpointError(f"tensor {name!r}: dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
    if not _int_list(shape) or not _int_list(offsets) or len(offsets) != 2:
        raise CheckpointError(f"tensor {name!r}: shape {shape!r:.60} and data_offsets {offsets!r:.60} "
                              "must be lists of non-negative integers (two offsets)")
    begin, end = offsets
    dtype = np.dtype(_DTYPES[dtype_name])
    nbytes = math.prod(shape) * dtype.itemsize
    if begin > end or data_start + end > len(buf) or end - begin != nbytes:
        raise CheckpointError(f"tensor {name!r}: data_offsets [{begin}, {end}] do not hold {dtype_name} "
                              f"{shape} ({nbytes} bytes) inside the {len(buf) - data_start} data bytes")
    raw = np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=data_start + begin)
    return _to_float32(raw.reshape(shape), dtype_name)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def load_hf(folder: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read an HF model folder: (config, canonical float32 state dict)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    hf = read_json_object(config_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    raw: dict[str, np.ndarray] = {}
    for f in files:
        raw.update(read_safetensors(f))
    with naming(config_path):
        model_type = config_value(hf, "model_type", "str", "llama")
        if model_type not in _LLAMA_TYPES + ("gpt2",):
            raise CheckpointError(f"model_type {model_type!r} is not supported")
        gpt2 = model_type == "gpt2"
        config = hf_gpt2_config(hf, raw) if gpt2 else hf_llama_config(hf, raw)
    with naming(folder):
        check_layer_count(config, len(raw))
        state = _gpt2_state(raw, config) if gpt2 else _llama_state(raw, config)
        check_state_dict(config, state)
    return config, state


def hf_llama_config(hf: dict, raw: dict[str, np.ndarray]) -> ModelConfig:
    get = lambda key, kind, *default: config_value(hf, key, kind, *default)  # noqa: E731
    n_heads = get("num_attention_heads", "int")
    dim = get("hidden_size", "int")
    head_dim = get("head_dim", "int", None) or dim // n_heads
    theta = get("rope_theta", "float", 10000.0)
    return ModelConfig(
        arch="llama",
        dim=dim,
        n_layers=get("num_hidden_layers", "int"),
        n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads", "int", n_heads),
        vocab_size=get("vocab_size", "int"),
        hidden_dim=get("intermediate_size", "int"),
        norm_eps=get("rms_norm_eps", "float", 1e-6),
        rope_theta=theta,
        max_seq_len=get("max_position_embeddings", "int", 2048),
        # An absent lm_head is tying too (some exports drop it).
        tie_embeddings=get("tie_word_embeddings", "bool", False) or "lm_head.weight" not in raw,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in raw,
        head_dim=head_dim,
        rope_freq_factors=_hf_rope_factors(hf.get("rope_scaling"), head_dim, theta),
        name=get("_name_or_path", "str", ""),
    )


def _hf_rope_factors(scaling: Any, head_dim: int, theta: float) -> tuple[float, ...] | None:
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise CheckpointError(f"rope_scaling is {scaling!r:.60}, expected an object")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise CheckpointError(f"rope_scaling type {kind!r:.60} is not supported (only 'llama3')")
    get = lambda key, kind: config_value(scaling, key, kind)  # noqa: E731
    return llama3_rope_freq_factors(
        head_dim, theta, get("factor", "float"), get("low_freq_factor", "float"), get("high_freq_factor", "float"),
        get("original_max_position_embeddings", "int"),
    )


def _llama_state(raw: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    block = {
        "input_layernorm": "attention_norm",
        "self_attn.q_proj": "attention.wq",
        "self_attn.k_proj": "attention.wk",
        "self_attn.v_proj": "attention.wv",
        "self_attn.o_proj": "attention.wo",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.down_proj": "feed_forward.w2",
        "mlp.up_proj": "feed_forward.w3",
    }
    state = {"tok_embeddings.weight": _tensor(raw, "model.embed_tokens.weight"),
             "norm.weight": _tensor(raw, "model.norm.weight")}
    for i in range(config.n_layers):
        for hf_name, ours in block.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf_name}.{kind}"
                if key in raw:
                    state[f"layers.{i}.{ours}.{kind}"] = raw[key]
    state["output.weight"] = state["tok_embeddings.weight"] if config.tie_embeddings else raw["lm_head.weight"]
    return state


def _tensor(raw: dict[str, np.ndarray], name: str) -> np.ndarray:
    if name not in raw:
        raise CheckpointError(f"no tensor {name!r} in the *.safetensors files")
    return raw[name]


def hf_gpt2_config(hf: dict, raw: dict[str, np.ndarray]) -> ModelConfig:
    get = lambda key, kind, *default: config_value(hf, key, kind, *default)  # noqa: E731
    dim = get("n_embd", "int")
    return ModelConfig(
        arch="gpt2",
        dim=dim,
        n_layers=get("n_layer", "int"),
        n_heads=get("n_head", "int"),
        n_kv_heads=get("n_head", "int"),
        vocab_size=get("vocab_size", "int"),
        hidden_dim=get("n_inner", "int", 4 * dim),
        norm_eps=get("layer_norm_epsilon", "float", 1e-5),
        max_seq_len=get("n_positions", "int", 1024),
        tie_embeddings=True,  # GPT-2 always ties its output head to wte
        name=get("_name_or_path", "str", ""),
    )


def _gpt2_state(raw: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    # Names may or may not carry the "transformer." prefix depending on how they were saved.
    prefix = "transformer." if "transformer.wte.weight" in raw else ""
    get = lambda name: _tensor(raw, prefix + name)  # noqa: E731
    state = {
        "tok_embeddings.weight": get("wte.weight"),
        "pos_embeddings.weight": get("wpe.weight"),
        "norm.weight": get("ln_f.weight"),
        "norm.bias": get("ln_f.bias"),
    }
    for i in range(config.n_layers):
        h, ours = f"h.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            state[ours + f"attention_norm.{kind}"] = get(h + f"ln_1.{kind}")
            state[ours + f"ffn_norm.{kind}"] = get(h + f"ln_2.{kind}")
        # Conv1D stores [in, out]; a Linear wants [out, in].
        qkv_w, qkv_b = get(h + "attn.c_attn.weight").T, get(h + "attn.c_attn.bias")
        for j, proj in enumerate(("wq", "wk", "wv")):
            rows = slice(j * config.dim, (j + 1) * config.dim)
            state[ours + f"attention.{proj}.weight"] = np.ascontiguousarray(qkv_w[rows])
            state[ours + f"attention.{proj}.bias"] = qkv_b[rows]
        for conv, lin in (("attn.c_proj", "attention.wo"), ("mlp.c_fc", "feed_forward.w1"),
                          ("mlp.c_proj", "feed_forward.w2")):
            state[ours + f"{lin}.weight"] = np.ascontiguousarray(get(h + f"{conv}.weight").T)
            state[ours + f"{lin}.bias"] = get(h + f"{conv}.bias")
    state["output.weight"] = state["tok_embeddings.weight"]
    return state
