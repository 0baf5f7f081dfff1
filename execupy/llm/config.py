"""The one model description every checkpoint loader produces, and the weight conventions.

Every loader (GGUF, HF, Meta) returns ``(ModelConfig, state_dict)`` where the state dict
maps the canonical names below to float32 numpy arrays. Torch-free.

Canonical names (Meta-style, shared by the Llama family and GPT-2)::

    tok_embeddings.weight                     [vocab, dim]
    pos_embeddings.weight                     [max_seq_len, dim]      (gpt2 only)
    layers.{i}.attention_norm.weight / .bias  [dim]                   (bias: gpt2)
    layers.{i}.attention.wq.weight / .bias    [n_heads*head_dim, dim] (bias: qkv_bias or gpt2)
    layers.{i}.attention.wk.weight / .bias    [n_kv_heads*head_dim, dim]
    layers.{i}.attention.wv.weight / .bias    [n_kv_heads*head_dim, dim]
    layers.{i}.attention.wo.weight / .bias    [dim, n_heads*head_dim] (bias: gpt2)
    layers.{i}.ffn_norm.weight / .bias        [dim]
    layers.{i}.feed_forward.w1.weight / .bias [hidden, dim]   llama: gate; gpt2: c_fc
    layers.{i}.feed_forward.w2.weight / .bias [dim, hidden]   llama: down; gpt2: c_proj
    layers.{i}.feed_forward.w3.weight         [hidden, dim]   llama: up
    norm.weight / .bias                       [dim]
    output.weight                             [vocab, dim]    (same array as tok_embeddings
                                                               when tie_embeddings)

Rotary convention: HF "half rotation" (rotate_half: pairs (i, i + head_dim/2)). Meta
checkpoints and llama-architecture GGUF files store wq/wk for the interleaved-pair
rotation (pairs (2i, 2i+1)); their loaders permute the rows of wq/wk (and their biases)
with ``interleaved_to_half`` so one model serves all three formats.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from execupy.errors import CheckpointError, TokenizerError

ARCHS = ("llama", "gpt2")
# The dtypes an LLM can be exported in (weights, activations and KV cache): named here,
# torch-free, so that the CLI lists them without importing the exporter.
EXPORT_DTYPES = ("fp32", "fp16", "bf16")
_REQUIRED = object()
# Kinds of config value ``config_value`` checks: a predicate and how to say what was expected.
_KINDS = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
}


def config_value(source: Mapping[str, Any], key: str, kind: str, default: Any = _REQUIRED) -> Any:
    """``source[key]`` (a config.json, params.json or GGUF metadata value) checked to be of
    ``kind`` ("int": positive, "float": finite, "str", "bool"); ``default`` when absent or null."""
    value = source.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{key} is missing")
        return default
    ok, expected = _KINDS[kind]
    if not ok(value):
        raise CheckpointError(f"{key} is {_short(value)}, expected {expected}")
    return float(value) if kind == "float" else value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_json_object(path: str | os.PathLike, error: type[Exception] = CheckpointError) -> dict[str, Any]:
    """A JSON file whose top level is an object; anything else raises ``error`` naming the file."""
    return read_json_text(path, error)[1]


def read_json_text(path: str | os.PathLike, error: type[Exception] = CheckpointError) -> tuple[str, dict[str, Any]]:
    """The text of a JSON object file and the object, read once (a library can then parse the
    very text that was checked)."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
        value = json.loads(text)
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start})") from e
    except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integers, deep nesting
        raise error(f"{path}: not valid JSON ({str(e)[:200]})") from e
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror})") from e
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object at the top level, found {type(value).__name__}")
    return text, value


@contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Checkpoint and tokenizer errors raised inside say which file they are about."""
    try:
        yield
    except (CheckpointError, TokenizerError) as e:
        if str(path) in str(e):
            raise
        raise type(e)(f"{path}: {e}") from e


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer, read off a checkpoint's metadata."""

    arch: str  # "llama" (Llama 2/3, SmolLM2, TinyLlama, Qwen2.5, Mistral) or "gpt2"
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int  # feed-forward inner size
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048  # the context the model was trained for
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2.5 has biases on q, k and v only
    head_dim: int = 0  # 0 means dim // n_heads
    # Per-frequency divisors for Llama 3.1/3.2 "llama3" rope scaling (llama.cpp's
    # rope_freqs tensor); None means plain RoPE.
    rope_freq_factors: tuple[float, ...] | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise CheckpointError(f"unknown architecture {self.arch!r}; expected one of {ARCHS}")
        fields = vars(self)
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "max_seq_len"):
            config_value(fields, name, "int")
        for name in ("norm_eps", "rope_theta"):
            config_value(fields, name, "float")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        config_value(fields, "head_dim", "int")
        if self.rope_theta <= 0 or self.norm_eps < 0:
            raise CheckpointError(f"rope_theta {self.rope_theta} must be positive and norm_eps {self.norm_eps} not negative")
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.arch == "llama" and self.head_dim % 2:
            raise CheckpointError(f"head_dim {self.head_dim} is odd; rotary embeddings rotate pairs")
        factors = self.rope_freq_factors
        if factors is not None and (len(factors) != self.head_dim // 2
                                    or not all(math.isfinite(x) and x > 0 for x in factors)):
            raise CheckpointError(f"rope frequency factors must be {self.head_dim // 2} positive numbers "
                                  f"(one per rotated pair), got {len(factors)}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows from interleaved-pair RoPE (Meta, GGUF) to half rotation (HF).

    Within each head, rows (0,1),(2,3),... are rotation pairs in the interleaved layout;
    in the half layout the pairs are (0, d/2),(1, d/2+1),... So row 2i goes to i and row
    2i+1 to d/2+i. Works for weights [rows, in] and biases [rows].
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def half_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of ``interleaved_to_half`` (what llama.cpp's converter does to HF weights)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (
        w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# Wider heads than any model has; bounds the per-frequency loop below.
_MAX_HEAD_DIM = 1 << 16


def llama3_rope_freq_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_seq_len: int,
) -> tuple[float, ...]:
    """Divisors of the RoPE frequencies for Llama 3.1 "llama3" scaling.

    Same formula as Meta's ``apply_scaling`` and llama.cpp's ``rope_freqs`` tensor: long
    wavelengths are slowed down by ``factor``, short ones untouched, the middle band blended.
    """
    if not 0 < head_dim <= _MAX_HEAD_DIM or not 0 < low_freq_factor < high_freq_factor or theta <= 0:
        raise CheckpointError(f"llama3 rope scaling needs 0 < head_dim <= {_MAX_HEAD_DIM} (have {head_dim}), "
                              f"0 < low_freq_factor < high_freq_factor (have {low_freq_factor}, "
                              f"{high_freq_factor}) and theta > 0 (have {theta})")
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def check_state_dict(config: ModelConfig, state: dict[str, np.ndarray]) -> None:
    """Raise CheckpointError naming the first missing or mis-shaped canonical tensor."""
    check_layer_count(config, len(state))
    for name, shape in expected_shapes(config).items():
        if name not in state:
            raise CheckpointError(f"checkpoint has no tensor for {name}")
        if tuple(state[name].shape) != shape:
            raise CheckpointError(f"{name} has shape {tuple(state[name].shape)}, expected {shape}")


def check_layer_count(config: ModelConfig, n_tensors: int) -> None:
    """Every layer has tensors of its own: a layer count beyond the tensor count is a corrupt
    config, caught here before anything loops over the layers."""
    if config.n_layers > n_tensors:
        raise CheckpointError(f"config says {config.n_layers} layers but the checkpoint has only {n_tensors} tensors")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The canonical tensor names of a config and their shapes."""
    c = config
    gpt2 = c.arch == "gpt2"
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (c.vocab_size, c.dim)}
    if gpt2:
        shapes["pos_embeddings.weight"] = (c.max_seq_len, c.dim)
    for i in range(c.n_layers):
        p = f"layers.{i}."
        layer = {
            "attention_norm.weight": (c.dim,),
            "attention.wq.weight": (q_rows, c.dim),
            "attention.wk.weight": (kv_rows, c.dim),
            "attention.wv.weight": (kv_rows, c.dim),
            "attention.wo.weight": (c.dim, q_rows),
            "ffn_norm.weight": (c.dim,),
            "feed_forward.w1.weight": (c.hidden_dim, c.dim),
            "feed_forward.w2.weight": (c.dim, c.hidden_dim),
        }
        if gpt2 or c.qkv_bias:
            layer.update({"attention.wq.bias": (q_rows,), "attention.wk.bias": (kv_rows,),
                          "attention.wv.bias": (kv_rows,)})
        if gpt2:
            layer.update({"attention_norm.bias": (c.dim,), "attention.wo.bias": (c.dim,),
                          "ffn_norm.bias": (c.dim,), "feed_forward.w1.bias": (c.hidden_dim,),
                          "feed_forward.w2.bias": (c.dim,)})
        else:
            layer["feed_forward.w3.weight"] = (c.hidden_dim, c.dim)
        shapes.update({p + k: v for k, v in layer.items()})
    shapes["norm.weight"] = (c.dim,)
    if gpt2:
        shapes["norm.bias"] = (c.dim,)
    shapes["output.weight"] = (c.vocab_size, c.dim)
    return shapes
