"""Export an LLM checkpoint to one .pte program plus one tokenizer file (needs torch).

    from execupy.llm.export import export_llm
    result = export_llm("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2.pte", max_seq_len=512)
    # -> smollm2.pte and smollm2.tokenizer.json, all a user ships

``export_llm`` runs the stages of ``LLMExportManager`` in order; use the manager to add
source transforms or a delegate, or to look at the graph between stages.

The program has one ``forward(tokens [1, T] int64, input_pos [1] int64) -> logits [1, 1, vocab]``
method (``[1, T, vocab]`` with ``generate_full_logits``) with a KV cache held in mutable
buffers (T dynamic in 1..max_prefill_len), updated and attended in place by the ``llama::``
custom ops unless ``custom_ops=False``, and constant methods the runner reads instead of a side config file:

    get_max_seq_len, get_max_context_len, get_max_prefill_len, get_vocab_size, get_n_layers,
    get_bos_id, get_eos_ids (list), use_kv_cache, use_sdpa_with_kv_cache, enable_dynamic_shape,
    get_add_bos, get_chat_template (string, "" when none)

The BOS/EOS ids, add-BOS flag and chat template live in the program, not in the
tokenizer file, because ``Tokenizer.save`` writes only the vocabulary.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from execupy.errors import ExecupyError, ExportError
from execupy.llm.config import EXPORT_DTYPES
from execupy.llm.loaders import load_checkpoint
from execupy.llm.export.models import Transformer
from execupy.llm.export import repeat_layers as repeating
from execupy.progress import ProgressBar

Progress = Callable[[str], None]

# Prefill runs T tokens at once; the bound sets the size of the planned activation
# memory (activations scale with T), so it stays modest and longer prompts are chunked.
DEFAULT_MAX_PREFILL = 128
SUPPORTED_DTYPES = EXPORT_DTYPES
# fp16 / bf16 store every weight, activation and the KV cache in that dtype (ExecuTorch's
# dtype_override): half the file and the memory. RMSNorm and softmax still compute in fp32
# inside the model, and our numpy kernels compute in fp32 for half inputs and round the result.
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
assert tuple(TORCH_DTYPES) == SUPPORTED_DTYPES


@dataclass
class ExportResult:
    pte_path: Path
    tokenizer_path: Optional[Path]
    max_seq_len: int
    max_prefill_len: int
    seconds: float
    layers_traced: int = 0  # 2 when the other layers were repeated from the second (repeat_layers.py)


def _check_dtype(dtype: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported yet (choose from {', '.join(SUPPORTED_DTYPES)})")


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
    backend: str = "portable",
    quantize: str | None = None,
    group_size: int | None = None,
    embedding_quantize: str | None = None,
    progress_bar: Optional[bool] = False,
    generate_full_logits: bool = False,
    down_proj_blocks: int | None = None,
    repeat_layers: bool = True,
) -> ExportResult:
    """Load a .gguf / HF / Meta checkpoint, export it with a KV cache and save the .pte
    and its tokenizer: every stage of LLMExportManager in order. ``progress`` receives
    one short line per stage.

    ``custom_ops`` (the default) updates and attends the KV cache in place with
    ``llama::update_cache`` / ``llama::custom_sdpa``; ``custom_ops=False`` writes the
    program in core ATen ops only, which ExecuTorch's stock runtime loads as well.

    ``backend="xnnpack"`` delegates the linears (and the fp32 ops around them that XNNPACK
    runs) to ExecuTorch's XnnpackBackend (execupy.exir.xnnpack). ``progress_bar`` draws a
    bar per long stage on stderr (None: only on a terminal).

    ``quantize`` ("int8", "int4", "8da4w", "8da8w" or "gguf"), ``group_size`` and
    ``embedding_quantize`` ("8", "4" or "4,32") are ExecuTorch's quantization options; the
    graphs they write are those of docs/quantized-llm.md. ``down_proj_blocks`` (8da4w / 8da8w):
    the FFN down projections quantize their input per token in that many blocks (default
    quantize.DOWN_PROJ_BLOCKS; 1 is ExecuTorch's graph; XNNPACK's nodes take one per token).

    ``repeat_layers`` (the default) traces two layers and repeats the second for the others
    when all are alike (repeat_layers.py): the same program, several times faster to export;
    False traces every layer.

    ``generate_full_logits`` (ExecuTorch's name) makes forward return the logits of every
    token fed, ``[1, T, vocab]``, instead of the last one's: what ``execupy perplexity``
    scores a whole window from in a few calls. The runner samples from the last row either way."""
    _check_dtype(dtype)  # before the (slow) load, not after
    transforms = quant_transforms(quantize, group_size, embedding_quantize, dtype, checkpoint_path, progress,
                                  down_proj_blocks)
    if backend not in BACKENDS:
        raise ExportError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "xnnpack" and down_proj_blocks not in (None, 1):
        raise ExportError(f"--down-proj-blocks {down_proj_blocks}: XNNPACK's dynamically quantized linears take "
                          "one int8 scale per token; leave it out (or 1) with --backend xnnpack")
    output_path = Path(output_path)
    manager = LLMExportManager.from_checkpoint(checkpoint_path, max_seq_len=max_seq_len,
                                               max_prefill_len=max_prefill_len, custom_ops=custom_ops,
                                               progress=progress, progress_bar=progress_bar,
                                               full_logits=generate_full_logits)
    manager.repeat_layers = repeat_layers
    if backend == "xnnpack":
        from execupy.llm.export.xnnpack_linears import xnnpack_linear_forms

        transforms += [head_as_linear, xnnpack_linear_forms]
    elif dtype == "fp32":
        transforms.append(weight_first_linears)
    manager = (manager.set_output_dir(output_path.parent).set_dtype(dtype).source_transform(transforms)
               .export().to_edge())
    return manager.to_backend(backend_partitioners(backend)).to_executorch().save(output_path.name)


BACKENDS = ("portable", "xnnpack")


def head_as_linear(model: Transformer) -> Transformer:
    """Source transform: the output head as nn.Linear's own form (x @ W^T), which XNNPACK
    runs as a fully connected node, instead of the portable program's `W @ column`."""
    model.column_head = False
    return model


def weight_first_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Source transform: every float nn.Linear but the output head multiplies weight-first,
    `(W @ rows^T)^T`, the form of the quantized linears (docs/quantized-llm.md), so the file
    keeps torch's [out, in] weight. `x @ W^T` had the transpose folded into an [in, out]
    constant, and a decode row's product against that layout is OpenBLAS's slower mat-vec:
    SmolLM2 fp32 on a 2-core EPYC: 576x1536 67 -> 50 us, 1536x576 92 -> 56 us, decode
    72.3 -> 78.0 tok/s (median of five interleaved generate runs). The head
    keeps its own weight-first column form (its table is the tied embedding's)."""
    from execupy.llm.export.quantize import FloatWeight, QuantizedLinear

    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child is not getattr(model, "output", None):
                bias = None if child.bias is None else child.bias.detach()
                setattr(parent, attr, QuantizedLinear(FloatWeight(child.weight.detach()), bias))
    return model


def backend_partitioners(backend: str) -> list:
    if backend == "xnnpack":
        from execupy.exir.xnnpack import XnnpackPartitioner

        return [XnnpackPartitioner()]
    return []


def quant_transforms(quantize: str | None, group_size: int | None, embedding_quantize: str | None, dtype: str,
                     checkpoint_path: str | os.PathLike, say: Optional[Progress] = None,
                     down_proj_blocks: int | None = None) -> list[Callable[[torch.nn.Module], torch.nn.Module]]:
    """The source transforms of the quantization options, checked before anything is loaded."""
    from execupy.llm.export.quantize import (DOWN_PROJ_BLOCKS, check_down_proj_blocks, check_mode,
                                             get_quant_embedding_transform, get_quant_weight_transform,
                                             parse_embedding_quantize)

    transforms = []
    if (quantize or embedding_quantize) and dtype != "fp32":
        raise ExportError(f"quantization computes in fp32 between its integer weights; use --dtype fp32, not {dtype}")
    if quantize is None and group_size is not None:
        raise ExportError("--group-size needs --quantize")
    if down_proj_blocks is not None:
        if quantize not in ("8da4w", "8da8w"):
            raise ExportError("--down-proj-blocks applies to the int8 activations of --quantize 8da4w / 8da8w")
        check_down_proj_blocks(down_proj_blocks)
    if quantize is not None:
        check_mode(quantize, group_size, checkpoint_path)
        transforms.append(get_quant_weight_transform(quantize, group_size, checkpoint_path, say,
                                                     down_proj_blocks or DOWN_PROJ_BLOCKS))
    if embedding_quantize is not None:
        if quantize == "gguf":
            raise ExportError("--quantize gguf keeps the file's own embedding; --embedding-quantize does not apply")
        parse_embedding_quantize(embedding_quantize)
        transforms.insert(0, get_quant_embedding_transform(embedding_quantize))  # before a tied output is split off
    return transforms


class LLMExportManager:
    """The export as a chain of stages, for users who want to step in between.

        manager = (LLMExportManager.from_checkpoint("model.gguf", max_seq_len=512)
                   .set_output_dir("out").set_dtype("fp32")
                   .source_transform([my_transform])           # any nn.Module -> nn.Module
                   .export()                                   # torch.export, T dynamic
                   .to_edge()                                  # core ATen + metadata methods
                   .to_backend([NumpyFusedPartitioner()])      # optional (backends.numpy_fused.aot)
                   .to_executorch())                           # memory planning + emit
        result = manager.save("model.pte")                     # .pte + tokenizer file

    Each stage checks that the one before it ran, and keeps its product on the manager
    (``model``, ``exported``, ``edge``, ``program``) for inspection. When every layer is built
    alike, ``exported`` holds the first two layers only and ``edge`` all of them (see
    repeat_layers.py; ``manager.repeat_layers = False`` before export() captures them all).
    """

    def __init__(self, model: Transformer, tokenizer: object | None = None, max_prefill_len: int | None = None,
                 progress: Optional[Progress] = None, progress_bar: Optional[bool] = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_prefill_len = min(max_prefill_len or DEFAULT_MAX_PREFILL, model.max_seq_len)
        self.output_dir = Path(".")
        self.dtype = "fp32"
        self.exported: Optional[torch.export.ExportedProgram] = None
        # Trace two layers and repeat the second (repeat_layers.py); False traces them all.
        self.repeat_layers = True
        self.repeated_layers = False  # whether export() did
        self.edge = None  # execupy.exir.EdgeProgramManager
        self.program = None  # execupy.exir.ExecutorchProgramManager
        self._say = progress or (lambda _msg: None)
        self._bar = ProgressBar(enabled=progress_bar)
        self._t0 = time.perf_counter()

    @classmethod
    def from_checkpoint(cls, checkpoint_path: str | os.PathLike, max_seq_len: int | None = None,
                        max_prefill_len: int | None = None, custom_ops: bool = True,
                        progress: Optional[Progress] = None, progress_bar: Optional[bool] = False,
                        full_logits: bool = False) -> "LLMExportManager":
        """Load weights and tokenizer from a .gguf file, an HF folder or a Meta folder;
        ``full_logits``: forward returns every position's logits, not only the last one's."""
        say = progress or (lambda _msg: None)
        t0 = time.perf_counter()
        say(f"loading {checkpoint_path}")
        with ProgressBar(enabled=progress_bar).stage("loading"):
            config, state = load_checkpoint(checkpoint_path)
            tokenizer = _load_tokenizer_or_none(checkpoint_path, say)
            model = Transformer.from_state_dict(config, state, max_seq_len=max_seq_len, use_kv_cache=True,
                                                last_logits_only=not full_logits, use_custom_ops=custom_ops)
        manager = cls(model, tokenizer, max_prefill_len, progress, progress_bar)
        manager._t0 = t0
        say(f"model: {config.arch}, {config.n_layers} layers, dim {config.dim}, vocab {config.vocab_size}; "
            f"context {model.max_seq_len}, prefill up to {manager.max_prefill_len} tokens, "
            f"{'custom KV-cache ops' if custom_ops else 'core ATen ops only'}")
        return manager

    def set_output_dir(self, path: str | os.PathLike) -> "LLMExportManager":
        self.output_dir = Path(path)
        return self

    def set_dtype(self, dtype: str) -> "LLMExportManager":
        """Cast the model (weights, buffers, KV cache) to ``dtype`` ("fp32", "fp16" or "bf16").
        The program's logits come out in that dtype too."""
        _check_dtype(dtype)
        self._require(self.exported is None, "set_dtype", "before export()")
        self.model = self.model.to(TORCH_DTYPES[dtype])
        self.dtype = dtype
        return self

    def source_transform(self, transforms: Sequence[Callable[[torch.nn.Module], torch.nn.Module]]
                         ) -> "LLMExportManager":
        """Rewrite the torch model before capture (each transform returns the new model)."""
        self._require(self.exported is None, "source_transform", "before export()")
        for transform in transforms:
            self.model = transform(self.model)
        return self

    def export(self) -> "LLMExportManager":
        """torch.export of the model; when its layers are all alike (repeat_layers.same_layers),
        of its first two only, and to_edge repeats the second for the others."""
        self._say("capturing with torch.export")
        self.repeated_layers = self.repeat_layers and repeating.same_layers(self.model)
        self.exported = self._capture(only_two_layers=self.repeated_layers)
        return self

    def _capture(self, only_two_layers: bool) -> torch.export.ExportedProgram:
        with repeating.two_layers(self.model) if only_two_layers else contextlib.nullcontext():
            layers = list(getattr(self.model, "layers", ()))
            with self._bar.stage("capturing", total=len(layers) or None) as bar:
                hooks = [layer.register_forward_hook(lambda *_: bar.advance()) for layer in layers]
                try:
                    return _capture(self.model, self.max_prefill_len)
                finally:
                    for hook in hooks:
                        hook.remove()

    def to_edge(self) -> "LLMExportManager":
        self._require(self.exported is not None, "to_edge", "after export()")
        from execupy.exir import EdgeProgramManager, to_edge

        self._say("lowering to the edge dialect")
        methods = constant_methods(self.model, self.max_prefill_len, self.tokenizer)
        with self._bar.stage("lowering"):
            self.edge = to_edge(self.exported, constant_methods=methods)
            if self.repeated_layers:
                ep = repeating.repeat_layers(self.edge.exported_program(), self.model)
                if ep is None:  # not laid out as repeat_layers expects: capture every layer after all
                    self.repeated_layers = False
                    self.exported = self._capture(only_two_layers=False)
                    self.edge = to_edge(self.exported, constant_methods=methods)
                else:
                    self.edge = EdgeProgramManager({"forward": ep}, methods, self.edge.compile_config)
                    self._say(f"repeated layer 1 for layers 2-{len(self.model.layers) - 1}")
        return self

    @property
    def layers_traced(self) -> int:
        return 2 if self.repeated_layers else len(getattr(self.model, "layers", ()))

    def to_backend(self, partitioners: Sequence[object]) -> "LLMExportManager":
        """Delegate what each partitioner claims (execupy.exir.backend.Partitioner)."""
        self._require(self.edge is not None, "to_backend", "after to_edge()")
        for partitioner in partitioners:
            self._say(f"delegating with {type(partitioner).__name__}")
            self.edge = self.edge.to_backend(partitioner)
        return self

    def to_executorch(self) -> "LLMExportManager":
        """Plan memory and emit. Weights the graph only reads transposed (every linear's,
        outside a delegate) are stored transposed first, so each linear is one mm."""
        from execupy.exir.passes import fold_constant_transposes

        self._require(self.edge is not None, "to_executorch", "after to_edge()")
        self._say("planning memory and emitting the program")
        with self._bar.stage("emitting"):
            self.program = self.edge.transform([fold_constant_transposes]).to_executorch()
        return self

    def save(self, filename: str | os.PathLike = "model.pte") -> ExportResult:
        """Write the tokenizer and then the .pte beside it (relative names go under the output dir).

        Each file is replaced whole or not at all (`execupy.fileio.atomic_write`), and the
        .pte comes last, so a finished .pte means its tokenizer is already in place."""
        self._require(self.program is not None, "save", "after to_executorch()")
        path = self.output_dir / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        tok_path = None
        if self.tokenizer is not None:
            tok_path = tokenizer_path_for(path, self.tokenizer)
            self.tokenizer.save(tok_path)
            self._say(f"wrote {tok_path}")
        with self._bar.stage("writing", total=self.program.nbytes) as bar:
            self.program.save(path, on_write=bar.advance)
        self._say(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
        return ExportResult(path, tok_path, self.model.max_seq_len, self.max_prefill_len,
                            time.perf_counter() - self._t0, self.layers_traced)

    @staticmethod
    def _require(ok: bool, stage: str, when: str) -> None:
        if not ok:
            raise ExportError(f"LLMExportManager.{stage}() must run {when}")


def _capture(model: Transformer, max_prefill_len: int) -> torch.export.ExportedProgram:
    """torch.export with the token count dynamic; an example of 2 tokens keeps T from being
    specialized to 1 (0/1 specialization) while 1 stays allowed."""
    example = (torch.zeros(1, min(2, max_prefill_len), dtype=torch.long), torch.tensor([0], dtype=torch.long))
    if max_prefill_len == 1:
        return torch.export.export(model, example)
    seq = torch.export.Dim("seq_len", min=1, max=max_prefill_len)
    with torch.no_grad():
        return torch.export.export(model, example, dynamic_shapes=({1: seq}, None))


def constant_methods(model: Transformer, max_prefill_len: int, tokenizer: object | None) -> dict:
    """The metadata the runner reads back from the program. Ours, plus the names
    ExecuTorch's llama runner reads, so that its runner finds what it looks for."""
    bos = getattr(tokenizer, "bos_id", None)
    return {
        "get_max_seq_len": int(model.max_seq_len),
        "get_max_context_len": int(model.max_seq_len),
        "get_max_prefill_len": int(max_prefill_len),
        "get_vocab_size": int(model.config.vocab_size),
        "get_n_layers": int(model.config.n_layers),
        "get_bos_id": int(bos) if bos is not None else -1,
        "get_eos_ids": [int(i) for i in getattr(tokenizer, "eos_ids", ())],
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": bool(model.use_custom_ops),
        "enable_dynamic_shape": max_prefill_len > 1,
        "get_add_bos": bool(getattr(tokenizer, "add_bos", False)),
        "get_chat_template": getattr(tokenizer, "chat_template", None) or "",
    }


def _load_tokenizer_or_none(checkpoint_path: str | os.PathLike, say: Progress):
    """The checkpoint's own tokenizer (embedded in a GGUF, or files in the folder); a model
    without one still exports, but the runner then needs ``--tokenizer``."""
    from execupy.llm.tokenizer import load_tokenizer

    try:
        return load_tokenizer(checkpoint_path)
    except (ExecupyError, OSError) as e:
        say(f"warning: no tokenizer exported ({e})")
        return None
