"""Load a GGUF file (llama.cpp's format) into a ModelConfig and a canonical float32 state dict.

Torch-free: the `gguf` package reads the file (memory-mapped) and dequantizes the
tensors (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and the other types it
knows). Architectures: ``llama`` (Llama 2/3, SmolLM2, TinyLlama, Mistral), ``qwen2``
(Qwen2/2.5, with q/k/v biases) and ``gpt2``.

RoPE: llama.cpp's converter permutes the q/k rows of ``llama``-architecture models to
the interleaved-pair layout; we permute them back to the HF half-rotation layout our
model uses (see execupy.llm.config). ``qwen2`` files are stored unpermuted (llama.cpp
runs them with NEOX-style rope), so they need nothing.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from execupy.llm.config import CheckpointError, ModelConfig, check_state_dict, interleaved_to_half

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


class GGUFFile:
    """A parsed GGUF file: metadata as plain Python values, tensors on demand."""

    def __init__(self, path: str | os.PathLike) -> None:
        import gguf  # imported here so that merely importing execupy.llm stays cheap

        self.path = os.fspath(path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from e
        self.metadata: dict[str, Any] = {
            name: field.contents() for name, field in self._reader.fields.items()
        }
        self.tensors = {t.name: t for t in self._reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise CheckpointError(f"{self.path}: GGUF metadata has no {key!r}")
        return self.metadata[key]

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32, in numpy (row-major, torch) order: [rows, cols]."""
        import gguf

        t = self.tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest dim first
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(f"{name}: GGUF tensor type {t.tensor_type.name} is not supported") from e
        out = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
        # F32 tensors come back as read-only views of the memory map; hand out owned arrays.
        return out if out.flags.writeable else out.copy()


def load_gguf(path: "str | os.PathLike | GGUFFile") -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a GGUF checkpoint (a path, or a GGUFFile already open): (config, canonical float32 state dict)."""
    f = path if isinstance(path, GGUFFile) else GGUFFile(path)
    arch = f.require("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"{f.path}: GGUF architecture {arch!r} is not supported (have {SUPPORTED_ARCHS})")
    config = gguf_config(f)
    state = _load_tensors(f, config, arch)
    check_state_dict(config, state)
    return config, state


def gguf_config(f: GGUFFile) -> ModelConfig:
    """Hyperparameters from the ``{arch}.*`` metadata keys."""
    arch = f.require("general.architecture")
    key = lambda k: f"{arch}.{k}"  # noqa: E731
    n_heads = int(f.require(key("attention.head_count")))
    dim = int(f.require(key("embedding_length")))
    n_kv_heads = f.get(key("attention.head_count_kv"), n_heads)
    vocab_size = f.get(key("vocab_size"))
    if vocab_size is None:  # older files: the embedding table says it
        vocab_size = int(f.tensors["token_embd.weight"].shape[1])
    is_gpt2 = arch == "gpt2"
    eps_key = "attention.layer_norm_epsilon" if is_gpt2 else "attention.layer_norm_rms_epsilon"
    return ModelConfig(
        arch="gpt2" if is_gpt2 else "llama",
        dim=dim,
        n_layers=int(f.require(key("block_count"))),
        n_heads=n_heads,
        n_kv_heads=int(n_kv_heads),
        vocab_size=int(vocab_size),
        hidden_dim=int(f.require(key("feed_forward_length"))),
        norm_eps=_f32_to_decimal(f.get(key(eps_key), 1e-5)),
        rope_theta=_f32_to_decimal(f.get(key("rope.freq_base"), 10000.0)),
        max_seq_len=int(f.get(key("context_length"), 2048)),
        tie_embeddings="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        head_dim=int(f.get(key("attention.key_length"), dim // n_heads)),
        rope_freq_factors=_rope_freq_factors(f),
        name=str(f.get("general.name", "")),
    )


def _f32_to_decimal(value: float) -> float:
    """GGUF stores these as float32 (1e-5 reads back as 9.99999974e-06); take the shortest
    decimal that rounds to the same float32, which is the value the model was written with."""
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
        base = block_map.get(parts[2])
        return None if base is None else f"layers.{parts[1]}.{base}.{parts[-1]}"
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
    if arch in _PERMUTED_QK_ARCHS:
        for i in range(config.n_layers):
            for proj, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads)):
                for kind in ("weight", "bias"):
                    name = f"layers.{i}.attention.{proj}.{kind}"
                    if name in state:
                        state[name] = interleaved_to_half(state[name], heads)
    if config.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def _split_fused_qkv(state: dict[str, np.ndarray], config: ModelConfig) -> None:
    q_rows = config.n_heads * config.head_dim
    kv_rows = config.n_kv_heads * config.head_dim
    for i in range(config.n_layers):
        for kind in ("weight", "bias"):
            fused = state.pop(f"layers.{i}.attention.wqkv.{kind}")
            q, k, v = np.split(fused, [q_rows, q_rows + kv_rows], axis=0)
            for proj, part in (("wq", q), ("wk", k), ("wv", v)):
                state[f"layers.{i}.attention.{proj}.{kind}"] = np.ascontiguousarray(part)
