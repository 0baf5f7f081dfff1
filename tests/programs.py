"""Programs our own exporter writes for the tests, cached, so that the runtime, CLI,
round-trip and fuzz tests run on a machine without ../shared (ExecuTorch's corpus).

The cases are built by tests/exir/corpus.py (which needs torch) into
~/.cache/execupy-tests/<fingerprint>, in the layout of the conformance corpus; the
fingerprint covers execupy's sources, the model definitions and the torch version, so
a change to the exporter rebuilds them (about half a minute). This module itself is
torch-free: child processes that must not import torch (tests/test_torch_free.py) or
that run under a memory cap (tests/test_fuzz.py) get the folder of an already built
corpus through EXECUPY_TEST_PROGRAMS.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EXECUPY_TEST_CACHE", Path.home() / ".cache" / "execupy-tests"))
ENV = "EXECUPY_TEST_PROGRAMS"  # a built corpus to use as it is
STALE_DAYS = 7  # corpora of other source versions unused this long are removed

# Case name -> flavour. "execupy": kernels only; "execupy_delegated": NumpyFusedBackend
# delegates (runs here); "execupy_missing_backend": delegates naming a backend we lack.
OWN_CASES = {
    "execupy-add_sub_mul_div_broadcast": "execupy",
    "execupy-nested_outputs": "execupy",
    "execupy-multi_method": "execupy",
    "execupy-dynamic_batch_seq": "execupy",
    "execupy-state_kv_cache": "execupy",
    "execupy-state_counter_initialized": "execupy",
    "execupy-scalar_inputs": "execupy",
    "execupy-cond": "execupy",
    "execupy-big_constant": "execupy",
    "execupy-linear_relu": "execupy",
    "execupy-llama_block": "execupy",
    "execupy-gpt2_block_dynamic": "execupy",
    "execupy-cnn_bn_pool": "execupy",
    "execupy-int_tensors": "execupy",
    "execupy-bool_tensors": "execupy",
    "execupy-bfloat16_linear": "execupy",
    "execupy-example_classifier": "execupy",
    "execupy-mixed_partition": "execupy_delegated",
    "execupy-unknown_backend": "execupy_missing_backend",
}

SOURCES = ["execupy/**/*.py", "tests/exir/corpus.py", "tests/exir/zoo.py", "tests/exir/test_backend.py",
           "tests/programs.py", "scripts/make_example.py"]


def fingerprint() -> str:
    """Changes whenever anything that shapes the programs or their expected values changes."""
    h = hashlib.sha256()
    for pattern in SOURCES:
        for path in sorted(REPO.glob(pattern)):
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in ("torch", "numpy"):
        h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
    return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def corpus() -> Path:
    """The folder of our own programs, built on first use (in a scratch folder, then renamed,
    so a concurrent run never sees half a corpus)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    folder = CACHE / fingerprint()
    if not (folder / "index.json").exists():
        try:
            from .exir.corpus import write_corpus
        except ModuleNotFoundError as e:
            pytest.skip(f"our own test programs are exported with torch: {e}")

        CACHE.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="building-", dir=CACHE))
        write_corpus(scratch, OWN_CASES)
        try:
            scratch.rename(folder)
        except OSError:  # another process finished first; its copy is the same
            shutil.rmtree(scratch, ignore_errors=True)
        remove_stale(keep=folder)
    os.utime(folder)
    return folder


def remove_stale(keep: Path) -> None:
    cutoff = time.time() - STALE_DAYS * 86400
    for old in CACHE.iterdir():
        if old != keep and old.is_dir() and old.stat().st_mtime < cutoff:
            shutil.rmtree(old, ignore_errors=True)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that reads our programs without building them."""
    return dict(os.environ, **{ENV: str(corpus())}, **extra)
