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
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from execupy.llm.config import CheckpointError, ModelConfig, check_state_dict, llama3_rope_freq_factors

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_LLAMA_TYPES = ("llama", "mistral", "qwen2")


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as float32 numpy arrays (bf16/f16 widened)."""
    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if len(buf) < 8:
        raise CheckpointError(f"{path}: too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", buf[:8])
    if 8 + header_len > len(buf):
        raise CheckpointError(f"{path}: safetensors header length {header_len} runs past the file")
    header = json.loads(buf[8 : 8 + header_len])
    data_start = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if info["dtype"] not in _DTYPES or data_start + end > len(buf):
            raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']} or offsets out of range")
        dtype = np.dtype(_DTYPES[info["dtype"]])
        count = (end - begin) // dtype.itemsize
        raw = np.frombuffer(buf, dtype=dtype, count=count, offset=data_start + begin).reshape(info["shape"])
        out[name] = _to_float32(raw, info["dtype"])
    return out


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
    hf = json.loads(config_path.read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    raw: dict[str, np.ndarray] = {}
    for f in files:
        raw.update(read_safetensors(f))
    model_type = hf.get("model_type", "llama")
    if model_type in _LLAMA_TYPES:
        config = hf_llama_config(hf, raw)
        state = _llama_state(raw, config)
    elif model_type == "gpt2":
        config = hf_gpt2_config(hf, raw)
        state = _gpt2_state(raw, config)
    else:
        raise CheckpointError(f"{folder}: model_type {model_type!r} is not supported")
    check_state_dict(config, state)
    return config, state


def hf_llama_config(hf: dict, raw: dict[str, np.ndarray]) -> ModelConfig:
    n_heads = hf["num_attention_heads"]
    dim = hf["hidden_size"]
    head_dim = hf.get("head_dim") or dim // n_heads
    theta = float(hf.get("rope_theta", 10000.0))
    return ModelConfig(
        arch="llama",
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        vocab_size=hf["vocab_size"],
        hidden_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        # An absent lm_head is tying too (some exports drop it).
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)) or "lm_head.weight" not in raw,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in raw,
        head_dim=head_dim,
        rope_freq_factors=_hf_rope_factors(hf.get("rope_scaling"), head_dim, theta),
        name=hf.get("_name_or_path", ""),
    )


def _hf_rope_factors(scaling: dict | None, head_dim: int, theta: float) -> tuple[float, ...] | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise CheckpointError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
    return llama3_rope_freq_factors(
        head_dim, theta, scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
        scaling["original_max_position_embeddings"],
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
    state = {"tok_embeddings.weight": raw["model.embed_tokens.weight"], "norm.weight": raw["model.norm.weight"]}
    for i in range(config.n_layers):
        for hf_name, ours in block.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf_name}.{kind}"
                if key in raw:
                    state[f"layers.{i}.{ours}.{kind}"] = raw[key]
    state["output.weight"] = state["tok_embeddings.weight"] if config.tie_embeddings else raw["lm_head.weight"]
    return state


def hf_gpt2_config(hf: dict, raw: dict[str, np.ndarray]) -> ModelConfig:
    dim = hf["n_embd"]
    return ModelConfig(
        arch="gpt2",
        dim=dim,
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        n_kv_heads=hf["n_head"],
        vocab_size=hf["vocab_size"],
        hidden_dim=hf.get("n_inner") or 4 * dim,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        max_seq_len=hf.get("n_positions", 1024),
        tie_embeddings=True,  # GPT-2 always ties its output head to wte
        name=hf.get("_name_or_path", ""),
    )


def _gpt2_state(raw: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    # Names may or may not carry the "transformer." prefix depending on how they were saved.
    prefix = "transformer." if "transformer.wte.weight" in raw else ""
    get = lambda name: raw[prefix + name]  # noqa: E731
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
