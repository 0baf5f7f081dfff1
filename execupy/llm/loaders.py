"""Pick the right checkpoint loader for a path: a .gguf file, an HF folder or a Meta folder."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from execupy.llm.config import CheckpointError, ModelConfig


def load_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, canonical float32 state dict) from any supported checkpoint."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from execupy.llm.gguf_loader import load_gguf

        return load_gguf(path)
    if (path / "config.json").is_file():
        from execupy.llm.hf_loader import load_hf

        return load_hf(path)
    if (path / "params.json").is_file():
        from execupy.llm.meta_loader import load_meta

        return load_meta(path)
    raise CheckpointError(f"{path}: not a .gguf file, nor a folder with config.json (HF) or params.json (Meta)")
