"""LLM programs written by ExecuTorch's own exporter, built once per machine.

    pte = export_with_executorch(PORTABLE_INT8)                 # a cached Path
    pte = export_with_executorch(("backend.xnnpack.enabled=True",
                                  "quantization.qmode=8da4w", "quantization.group_size=32"))

A tiny random Llama (Meta checkpoint + params.json) is written and handed to the reference
venv's ``python -m executorch.extension.llm.export.export_llm`` as a subprocess (executorch
is never imported here). The result lives under ``~/.cache/execupy-et-llm/<hash>/`` (or
``$EXECUPY_ET_LLM_CACHE``), keyed by everything that shapes the program: the weights' seed
and shape, the flags, the lengths, the metadata and the reference venv's versions. An
export takes 30-60 s on two cores; a file lock makes concurrent test processes wait for the
one that builds it.

``reference_greedy`` decodes greedily in ExecuTorch's runtime on such a program: the
reference for what ``execupy generate`` must produce.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from tests.reference import ReferenceError, _last_lines, reference_python

CACHE = Path(os.environ.get("EXECUPY_ET_LLM_CACHE", Path.home() / ".cache" / "execupy-et-llm"))
EXPORT_TIMEOUT_S = 1800  # a tiny model takes about a minute; leave room for a loaded CI machine

# export_llm flag sets, each added to the common flags in export_with_executorch.
PORTABLE_FP32: tuple[str, ...] = ()
# int8 weight-only linears; on portable kernels ExecuTorch's export folds the int8 weights
# back into fp32 constants (a mul by the scales remains): no quantized ops in the program.
PORTABLE_INT8 = ("quantization.qmode=int8",)
PORTABLE_INT8_EMBEDDING8 = PORTABLE_INT8 + ("quantization.embedding_quantize='8,0'",)  # and an int8 embedding table
XNNPACK = ("backend.xnnpack.enabled=True", "backend.xnnpack.extended_ops=True")
Q8DA4W = XNNPACK + ("quantization.qmode=8da4w", "quantization.group_size=32")  # ExecuTorch's LLM recipe

# ExecuTorch's Llama takes hidden_dim from params.json; no max_seq_len there (export_llm refuses it).
LLAMA_PARAMS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, norm_eps=1e-5,
                    rope_theta=10000.0, multiple_of=32, use_scaled_rope=False)
MAX_SEQ_LENGTH = 16  # tokens per forward call: the token input is bounded by MAX_SEQ_LENGTH - 1
MAX_CONTEXT_LENGTH = 64  # KV-cache positions
BOS_ID, EOS_ID = 1, 2
METADATA = {"get_bos_id": BOS_ID, "get_eos_ids": [EOS_ID]}  # export_llm's base.metadata


def export_with_executorch(flags: Sequence[str] = PORTABLE_FP32, *, vocab_size: int = 98, seed: int = 0,
                           max_seq_length: int = MAX_SEQ_LENGTH,
                           max_context_length: int = MAX_CONTEXT_LENGTH) -> Path:
    """The .pte ExecuTorch's export_llm writes for a tiny random Llama with these extra
    hydra ``flags`` (KV cache, custom sdpa, dynamic shape, fp32 are always on); built on the
    first call and cached on disk after that."""
    config = {"flags": list(flags), "vocab_size": vocab_size, "seed": seed, "params": LLAMA_PARAMS,
              "max_seq_length": max_seq_length, "max_context_length": max_context_length,
              "metadata": METADATA}
    return cached_export(config, _write_checkpoint)


def cached_export(config: dict, write_checkpoint: Callable[[Path, dict], None],
                  timeout_s: float = EXPORT_TIMEOUT_S) -> Path:
    """The .pte export_llm writes for ``config`` (flags, lengths, metadata, and optionally
    ``model_class``), from the Meta checkpoint ``write_checkpoint(folder, config)`` puts in
    ``folder``; cached under a key of the config and the reference venv's versions."""
    pte = cached_export_path(config)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(pte.parent.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building this very program
        if not pte.is_file():
            _build(pte.parent, {**config, "reference": _reference_versions()}, write_checkpoint, timeout_s)
    return pte


def cached_export_path(config: dict) -> Path:
    """Where ``cached_export(config, ...)`` keeps its program (which may not be built yet)."""
    config = {**config, "reference": _reference_versions()}
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    return CACHE / key / "model.pte"


def _reference_versions() -> str:
    """What the reference venv holds, so a new ExecuTorch gets new programs."""
    marker = reference_python().parents[1] / ".ready"
    return marker.read_text().strip() if marker.is_file() else "unknown"


def _build(folder: Path, config: dict, write_checkpoint: Callable[[Path, dict], None], timeout_s: float) -> None:
    """Export into a scratch folder and move it into place whole, so a killed export leaves
    no half-written cache entry behind."""
    scratch = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        write_checkpoint(scratch, config)
        (scratch / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        cmd = [str(reference_python()), "-m", "executorch.extension.llm.export.export_llm",
               f"base.model_class={config.get('model_class', 'llama3_2')}",
               f"base.checkpoint={scratch / 'consolidated.00.pth'}",
               f"base.params={scratch / 'params.json'}", f"base.metadata='{json.dumps(config['metadata'])}'",
               "model.use_kv_cache=True", "model.use_sdpa_with_kv_cache=True", "model.dtype_override=fp32",
               "model.enable_dynamic_shape=True", f"export.max_seq_length={config['max_seq_length']}",
               f"export.max_context_length={config['max_context_length']}", f"export.output_dir={scratch}",
               "export.output_name=model.pte", *config["flags"]]
        proc = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        (scratch / "export.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not (scratch / "model.pte").is_file():
            raise ReferenceError(f"export_llm {' '.join(config['flags'])} exited {proc.returncode}: "
                                 f"{_last_lines(proc.stderr, 8)}")
        shutil.rmtree(scratch / "outputs", ignore_errors=True)  # hydra's run logs
        shutil.rmtree(folder, ignore_errors=True)
        scratch.rename(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_checkpoint(folder: Path, config: dict) -> None:
    """consolidated.00.pth (Meta names) and params.json with the keys export_llm reads."""
    import torch

    from tests.llm.tiny import random_llama_weights

    params = {**config["params"], "vocab_size": config["vocab_size"]}
    (folder / "params.json").write_text(json.dumps(params))
    weights = random_llama_weights(config["seed"], **params)
    torch.save({name: torch.from_numpy(w) for name, w in weights.items()}, folder / "consolidated.00.pth")


# Runs inside the reference venv: greedy decoding with ExecuTorch's runtime, one token per
# decode call after a prefill of the whole prompt, stopping at the first EOS id.
_GREEDY_WORKER = r"""
import sys, json, torch
import executorch.kernels.quantized  # registers the quantized_decomposed:: kernels
from executorch.extension.llm.custom_ops import custom_ops  # registers the llama:: kernels
from executorch.extension.pybindings.portable_lib import _load_for_executorch
prompt, n, eos = json.loads(sys.argv[2]), int(sys.argv[3]), set(json.loads(sys.argv[4]))
module = _load_for_executorch(sys.argv[1])
logits = module.run_method("forward", (torch.tensor([prompt]), torch.tensor([0])))[0]
out, pos = [], len(prompt)
while len(out) < n:
    token = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
    out.append(token)
    if token in eos:
        break
    logits = module.run_method("forward", (torch.tensor([[token]]), torch.tensor([pos])))[0]
    pos += 1
print(json.dumps(out))
"""


def reference_greedy(pte: Path, prompt: Sequence[int], max_new_tokens: int,
                     eos_ids: Sequence[int] = (EOS_ID,), extra_env: Optional[dict[str, str]] = None) -> list[int]:
    """The tokens ExecuTorch's runtime picks greedily after ``prompt`` (the EOS included);
    `extra_env` adds variables to its process's environment (e.g. MKL_CBWR)."""
    cmd = [str(reference_python()), "-c", _GREEDY_WORKER, str(pte), json.dumps(list(prompt)),
           str(max_new_tokens), json.dumps(list(eos_ids))]
    env = {**os.environ, **extra_env} if extra_env else None
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise ReferenceError(f"greedy worker exited {proc.returncode}: {_last_lines(proc.stderr)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Runs inside the reference venv: ExecuTorch's llama::custom_sdpa as a service, one call per
# request on stdin (a length-prefixed .npz of q, k, v, start_pos, causal and maybe scale), its output back on
# stdout (a length-prefixed .npy).
_SDPA_SERVER = r"""
import io, struct, sys, numpy as np, torch
from executorch.extension.llm.custom_ops import custom_ops  # registers llama::custom_sdpa
read, write = sys.stdin.buffer, sys.stdout.buffer
while len(head := read.read(8)) == 8:
    data = np.load(io.BytesIO(read.read(struct.unpack("<Q", head)[0])))
    q, k, v = (torch.from_numpy(data[x]) for x in "qkv")
    scale = float(data["scale"]) if "scale" in data.files else None
    out = torch.ops.llama.custom_sdpa(q, k, v, int(data["start_pos"]), None, 0.0, bool(data["causal"]), scale)
    buf = io.BytesIO()
    np.save(buf, out.numpy())
    write.write(struct.pack("<Q", buf.tell()) + buf.getvalue())
    write.flush()
"""


@contextmanager
def executorch_custom_sdpa():
    """Within the block, programs loaded here run ExecuTorch's own llama::custom_sdpa (a
    reference-venv subprocess answers each call) in place of ours: what is left between the
    two runtimes is then everything but the attention."""
    from execupy.kernels.registry import get_kernel, register_kernel

    key = "llama::custom_sdpa.out"
    ours = get_kernel(key)
    server = subprocess.Popen([str(reference_python()), "-c", _SDPA_SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def theirs(query, key_cache, value_cache, start_pos, attn_mask, drop_p, is_causal, scale, out):
        if attn_mask is not None or drop_p != 0.0:
            raise ValueError("the custom_sdpa service takes causal or full attention, no mask or dropout")
        request = io.BytesIO()
        window = start_pos + query.shape[1]  # the slots it reads: a prefix, the row strides unchanged
        np.savez(request, q=query, k=key_cache[:, :window], v=value_cache[:, :window], start_pos=np.asarray(start_pos),
                 causal=np.asarray(is_causal), **({} if scale is None else {"scale": np.asarray(scale)}))
        server.stdin.write(struct.pack("<Q", request.tell()) + request.getvalue())
        server.stdin.flush()
        head = server.stdout.read(8)
        if len(head) != 8:
            raise ReferenceError("ExecuTorch's custom_sdpa service stopped")
        result = np.load(io.BytesIO(server.stdout.read(struct.unpack("<Q", head)[0])))
        if result.shape != out.shape:
            return result  # another length: the runtime copies it into place
        out[...] = result
        return out

    register_kernel(key, override=True)(theirs)
    try:
        yield
    finally:
        register_kernel(key, override=True)(ours)
        server.stdin.close()
        server.wait(timeout=60)


TOKENIZER_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens", "a b c d e f g 1 2 3"]
TOKENIZER_SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: BOS_ID and EOS_ID above


def write_tokenizer(path: Path) -> Path:
    """A small byte-level BPE tokenizer.json whose special tokens sit at the ids the programs'
    metadata names; the model's vocab_size must equal its size (``tokenizer_size``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=TOKENIZER_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_CORPUS * 5, trainer)
    tok.save(str(path))
    return path


def tokenizer_size(path: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab_size()
