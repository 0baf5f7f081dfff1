"""Export an LLM checkpoint to one .pte program plus one tokenizer file (needs torch).

    from execupy.llm.export import export_llm
    result = export_llm("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2.pte", max_seq_len=512)
    # -> smollm2.pte and smollm2.tokenizer.json, all a user ships

The program has one ``forward(tokens [1, T] int64, input_pos [1] int64) -> logits [1, 1, vocab]``
method with a KV cache held in mutable buffers (T dynamic in 1..max_prefill_len), updated
and attended in place by the ``llama::`` custom ops unless ``custom_ops=False``, and
constant methods the runner reads instead of a side config file:

    get_max_seq_len, get_max_prefill_len, get_vocab_size, get_bos_id, get_eos_ids (list),
    use_kv_cache, get_add_bos, get_chat_template (string, "" when none)

The BOS/EOS ids, add-BOS flag and chat template live in the program, not in the
tokenizer file, because ``Tokenizer.save`` writes only the vocabulary.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from execupy.llm.loaders import load_checkpoint
from execupy.llm.model import Transformer

Progress = Callable[[str], None]

# Prefill runs T tokens at once; the bound sets the size of the planned activation
# memory (activations scale with T), so it stays modest and longer prompts are chunked.
DEFAULT_MAX_PREFILL = 128


@dataclass
class ExportResult:
    pte_path: Path
    tokenizer_path: Optional[Path]
    max_seq_len: int
    max_prefill_len: int
    seconds: float


def tokenizer_path_for(pte_path: str | os.PathLike, tokenizer: object | None = None) -> Path:
    """Where the tokenizer file sits next to a program: ``<stem>.tokenizer.json`` for
    `tokenizers`-based vocabularies, ``<stem>.tokenizer.model`` for the others."""
    from execupy.llm.tokenizer import HFTokenizer

    pte_path = Path(pte_path)
    suffix = ".json" if tokenizer is None or isinstance(tokenizer, HFTokenizer) else ".model"
    return pte_path.with_name(pte_path.stem + ".tokenizer" + suffix)


def export_llm(
    checkpoint_path: str | os.PathLike,
    output_path: str | os.PathLike,
    max_seq_len: int | None = None,
    max_prefill_len: int | None = None,
    dtype: str = "fp32",
    progress: Optional[Progress] = None,
    custom_ops: bool = True,
) -> ExportResult:
    """Load a .gguf / HF / Meta checkpoint, export it with a KV cache and save the .pte
    and its tokenizer. ``progress`` receives one short line per stage.

    ``custom_ops`` (the default) updates and attends the KV cache in place with
    ``llama::update_cache`` / ``llama::custom_sdpa``; ``custom_ops=False`` writes the
    program in core ATen ops only, which ExecuTorch's stock runtime loads as well."""
    if dtype != "fp32":
        raise ValueError(f"dtype {dtype!r} is not supported yet (only 'fp32')")
    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    output_path = Path(output_path)

    say(f"loading {checkpoint_path}")
    config, state = load_checkpoint(checkpoint_path)
    tokenizer = _load_tokenizer_or_none(checkpoint_path, say)
    model = Transformer.from_state_dict(config, state, max_seq_len=max_seq_len, use_kv_cache=True,
                                        last_logits_only=True, use_custom_ops=custom_ops)
    del state
    seq_len = model.max_seq_len
    prefill = min(max_prefill_len or DEFAULT_MAX_PREFILL, seq_len)
    say(f"model: {config.arch}, {config.n_layers} layers, dim {config.dim}, vocab {config.vocab_size}; "
        f"context {seq_len}, prefill up to {prefill} tokens, "
        f"{'custom KV-cache ops' if custom_ops else 'core ATen ops only'}")

    say("capturing with torch.export")
    _use_weight_first_linears(model)
    ep = _capture(model, prefill)
    say("lowering to the edge dialect and emitting the program")
    from execupy.exir import to_edge

    methods = constant_methods(config.vocab_size, seq_len, prefill, tokenizer)
    program = to_edge(ep, constant_methods=methods).to_executorch()
    output_path.parent.mkdir(parents=True, exist_ok=True)
    program.save(output_path)
    say(f"wrote {output_path} ({output_path.stat().st_size / 2**20:.1f} MiB)")

    tok_path = None
    if tokenizer is not None:
        tok_path = tokenizer_path_for(output_path, tokenizer)
        tokenizer.save(tok_path)
        say(f"wrote {tok_path}")
    return ExportResult(output_path, tok_path, seq_len, prefill, time.perf_counter() - t0)


def _capture(model: Transformer, max_prefill_len: int) -> torch.export.ExportedProgram:
    """torch.export with the token count dynamic; an example of 2 tokens keeps T from being
    specialized to 1 (0/1 specialization) while 1 stays allowed."""
    example = (torch.zeros(1, min(2, max_prefill_len), dtype=torch.long), torch.tensor([0], dtype=torch.long))
    if max_prefill_len == 1:
        return torch.export.export(model, example)
    seq = torch.export.Dim("seq_len", min=1, max=max_prefill_len)
    with torch.no_grad():
        return torch.export.export(model, example, dynamic_shapes=({1: seq}, None))


class _WeightFirstLinear(torch.nn.Module):
    """``y = (W @ x^T)^T (+ b)``: the same function as nn.Linear, captured so that the
    transpose falls on the (small) activations instead of the weight. Exported as is,
    nn.Linear becomes permute_copy(W) + mm, and the runtime would copy every weight matrix
    (the whole model) on every call."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # the same Parameter: tied weights stay tied
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        y = (self.weight @ rows.transpose(0, 1)).transpose(0, 1)  # [N, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.weight.shape[0])


def _use_weight_first_linears(model: torch.nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, _WeightFirstLinear(child))


def constant_methods(vocab_size: int, max_seq_len: int, max_prefill_len: int, tokenizer: object | None) -> dict:
    """The metadata the runner reads back from the program."""
    bos = getattr(tokenizer, "bos_id", None)
    return {
        "get_max_seq_len": int(max_seq_len),
        "get_max_prefill_len": int(max_prefill_len),
        "get_vocab_size": int(vocab_size),
        "get_bos_id": int(bos) if bos is not None else -1,
        "get_eos_ids": [int(i) for i in getattr(tokenizer, "eos_ids", ())],
        "use_kv_cache": True,
        "get_add_bos": bool(getattr(tokenizer, "add_bos", False)),
        "get_chat_template": getattr(tokenizer, "chat_template", None) or "",
    }


def _load_tokenizer_or_none(checkpoint_path: str | os.PathLike, say: Progress):
    """The checkpoint's own tokenizer (embedded in a GGUF, or files in the folder); a model
    without one still exports, but the runner then needs ``--tokenizer``."""
    from execupy.errors import ExecupyError
    from execupy.llm.tokenizer import load_tokenizer

    try:
        return load_tokenizer(checkpoint_path)
    except (ExecupyError, OSError) as e:
        say(f"warning: no tokenizer exported ({e})")
        return None
