"""Load a Meta Llama checkpoint folder (params.json + consolidated.*.pth) into canonical form.

Meta's tensor names are already our canonical names; what changes is the RoPE layout
(Meta uses interleaved pairs, we use half rotation, so wq/wk rows are permuted) and,
for model-parallel checkpoints, the shards are concatenated along the dimension each
layer was split on. Needs torch to unpickle the .pth files, and only ever with
``torch.load(weights_only=True)`` so a checkpoint cannot run code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from execupy.llm.config import (
    CheckpointError,
    ModelConfig,
    check_state_dict,
    config_value,
    interleaved_to_half,
    llama3_rope_freq_factors,
    naming,
    read_json_object,
)

# How Meta's model-parallel code splits each weight across shards: the axis to
# concatenate on, or None for tensors every shard holds whole (norms).
_SHARD_AXIS = {
    "tok_embeddings": 1,
    "output": 0,
    "wq": 0, "wk": 0, "wv": 0, "wo": 1,
    "w1": 0, "w3": 0, "w2": 1,
}


def load_meta(folder: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a Meta checkpoint folder: (config, canonical float32 state dict)."""
    folder = Path(folder)
    params_path = folder / "params.json"
    shards = sorted(folder.glob("consolidated.*.pth"))
    if not params_path.is_file() or not shards:
        raise CheckpointError(f"{folder}: expected params.json and consolidated.*.pth")
    params = read_json_object(params_path)
    with naming(folder):
        state = _merge_shards([_load_pth(p) for p in shards])
    with naming(params_path):
        config = meta_config(params, state)
    with naming(folder):
        if config.tie_embeddings:
            state["output.weight"] = state["tok_embeddings.weight"]
        state = {k: v for k, v in state.items() if not k.endswith("rope.freqs")}  # old checkpoints keep a buffer
        check_state_dict(config, state)  # before the permutation relies on the shapes
        for i in range(config.n_layers):
            for proj, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads)):
                name = f"layers.{i}.attention.{proj}.weight"
                state[name] = interleaved_to_half(state[name], heads)
    return config, state


def _load_pth(path: Path) -> dict[str, np.ndarray]:
    """A .pth state dict, unpickled by torch with weights_only (no code runs) and checked to
    be a mapping of names to floating-point tensors."""
    import torch

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch's unpickler and zip reader raise many unrelated types
        raise CheckpointError(f"{path}: not a readable weights-only .pth checkpoint "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from e
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path}: holds a {type(loaded).__name__}, expected a dict of tensors")
    out = {}
    for name, t in loaded.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.numel() == 0):
            raise CheckpointError(f"{path}: entry {name!r:.60} is not a named floating-point tensor")
        out[name] = t.to(torch.float32).numpy()
    return out


def _merge_shards(shards: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(shards) == 1:
        return shards[0]
    merged = {}
    for name, first in shards[0].items():
        parts = [s.get(name) for s in shards]
        axis = _SHARD_AXIS.get(name.split(".")[-2]) if first.ndim == 2 and "." in name else None
        if any(p is None or p.ndim != first.ndim for p in parts) or (
                axis is not None and any(p.shape[1 - axis] != first.shape[1 - axis] for p in parts)):
            raise CheckpointError(f"tensor {name!r} is missing from a shard or its shards do not fit together")
        merged[name] = first if axis is None else np.concatenate(parts, axis=axis)
    return merged


def meta_config(params: dict[str, Any], state: dict[str, np.ndarray]) -> ModelConfig:
    """Hyperparameters from params.json; sizes it leaves implicit come from the weights."""
    get = lambda key, kind, *default: config_value(params, key, kind, *default)  # noqa: E731
    dim, n_heads = get("dim", "int"), get("n_heads", "int")
    head_dim = dim // n_heads
    theta = get("rope_theta", "float", 10000.0)
    factors = None
    if get("use_scaled_rope", "bool", False):
        # Llama 3.1 uses factor 8; 3.2 files say their own factor (32) under this name.
        factor = get("rope_scale_factor", "float", get("rope_scaling_factor", "float", 8.0))
        factors = llama3_rope_freq_factors(head_dim, theta, factor, 1.0, 4.0, 8192)
    return ModelConfig(
        arch="llama",
        dim=dim,
        n_layers=get("n_layers", "int"),
        n_heads=n_heads,
        n_kv_heads=get("n_kv_heads", "int", n_heads),
        # params.json writes vocab_size -1 and derives the FFN size from multiple_of;
        # reading both off the weights is exact.
        vocab_size=_rows(state, "tok_embeddings.weight"),
        hidden_dim=_rows(state, "layers.0.feed_forward.w1.weight"),
        norm_eps=get("norm_eps", "float", 1e-5),
        rope_theta=theta,
        max_seq_len=get("max_seq_len", "int", 2048),
        tie_embeddings="output.weight" not in state,
        head_dim=head_dim,
        rope_freq_factors=factors,
    )


def _rows(state: dict[str, np.ndarray], name: str) -> int:
    if name not in state or state[name].ndim != 2:
        raise CheckpointError(f"no two-dimensional tensor {name!r} in the .pth files")
    return state[name].shape[0]
