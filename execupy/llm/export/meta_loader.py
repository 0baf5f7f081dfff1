"""Load a Meta Llama checkpoint folder (params.json + consolidated.*.pth) into canonical form.

Meta's tensor names are already our canonical names; what changes is the RoPE layout
(Meta uses interleaved pairs, we use half rotation, so wq/wk rows are permuted) and,
for model-parallel checkpoints, the shards are concatenated along the dimension each
layer was split on. Needs torch to unpickle the .pth files, and only ever with
``torch.load(weights_only=True)`` so a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from execupy.llm.config import (
    CheckpointError,
    ModelConfig,
    check_state_dict,
    interleaved_to_half,
    llama3_rope_freq_factors,
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
    params = json.loads(params_path.read_text())
    state = _merge_shards([_load_pth(p) for p in shards])
    config = meta_config(params, state)
    for i in range(config.n_layers):
        for proj, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads)):
            name = f"layers.{i}.attention.{proj}.weight"
            state[name] = interleaved_to_half(state[name], heads)
    if config.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    state = {k: v for k, v in state.items() if not k.endswith("rope.freqs")}  # old checkpoints keep a buffer
    check_state_dict(config, state)
    return config, state


def _load_pth(path: Path) -> dict[str, np.ndarray]:
    import torch

    loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {name: t.to(torch.float32).numpy() for name, t in loaded.items()}


def _merge_shards(shards: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(shards) == 1:
        return shards[0]
    merged = {}
    for name, first in shards[0].items():
        axis = _SHARD_AXIS.get(name.split(".")[-2]) if first.ndim == 2 else None
        merged[name] = first if axis is None else np.concatenate([s[name] for s in shards], axis=axis)
    return merged


def meta_config(params: dict, state: dict[str, np.ndarray]) -> ModelConfig:
    """Hyperparameters from params.json; sizes it leaves implicit come from the weights."""
    dim, n_heads = params["dim"], params["n_heads"]
    head_dim = dim // n_heads
    theta = float(params.get("rope_theta", 10000.0))
    factors = None
    if params.get("use_scaled_rope"):
        # Llama 3.1 uses factor 8; 3.2 files say their own factor (32) under this name.
        factor = params.get("rope_scale_factor", params.get("rope_scaling_factor", 8.0))
        factors = llama3_rope_freq_factors(head_dim, theta, factor, 1.0, 4.0, 8192)
    return ModelConfig(
        arch="llama",
        dim=dim,
        n_layers=params["n_layers"],
        n_heads=n_heads,
        n_kv_heads=params.get("n_kv_heads") or n_heads,
        # params.json writes vocab_size -1 and derives the FFN size from multiple_of;
        # reading both off the weights is exact.
        vocab_size=state["tok_embeddings.weight"].shape[0],
        hidden_dim=state["layers.0.feed_forward.w1.weight"].shape[0],
        norm_eps=float(params.get("norm_eps", 1e-5)),
        rope_theta=theta,
        max_seq_len=params.get("max_seq_len", 2048),
        tie_embeddings="output.weight" not in state,
        head_dim=head_dim,
        rope_freq_factors=factors,
    )
