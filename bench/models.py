#!/usr/bin/env python3
"""Non-LLM models: our runtime's latency beside ExecuTorch's XNNPACK and portable runtimes, same models.

    .venv/bin/python bench/models.py [--rounds 3] [--calls 20] [--models mobilenet_v2,bert]

Two models, each in fp32 and int8 (pt2e: static int8 for the CNN, per-tensor activations
and per-channel weights; dynamic int8 linears for the encoder, as ExecuTorch's examples
quantize transformers):

* ``mobilenet_v2``: MobileNetV2's inverted residual blocks (1x1 expand, 3x3 depthwise,
  1x1 project, ReLU6, residual adds) at width 0.5 on a 1x3x160x160 image.
* ``bert``: a BERT-like encoder, 4 post-norm layers, dim 256, 4 heads, feed-forward 1024,
  GELU, token + position embeddings, 128 tokens.

The models are built here from a seed (torch only), so both sides hold the same weights:

* ExecuTorch's side runs this file with ``--reference-worker`` in the reference venv (a
  subprocess; execupy never imports executorch): its own quantizer and exporter, lowered
  with its XnnpackPartitioner (``to_edge_transform_and_lower``) and plain ``to_edge`` for
  the portable kernels, timed with ``_load_for_executorch(...).forward``.
* Our side: our quantizer (``execupy.quantization``) and exporter, run by our runtime;
  also our runtime on ExecuTorch's XNNPACK file, and on our own XNNPACK export when this
  checkout's exporter has ``to_edge_transform_and_lower`` and ``XnnpackPartitioner``.

Each timing is the median of --calls forward calls after two warm-up calls, each side in a
process of its own (ours never imports torch, as a user's runtime would not). The two sides
take turns --rounds times (the machine is shared; a burst of load hits both) and the table
shows the median of the rounds. Ratios: our fastest program / ExecuTorch's (below 1.0 is
faster). Columns: ``execupy`` our export (portable kernels) in our runtime; ``ours xnn`` our
XNNPACK export in our runtime; ``ours ET-xnn`` ExecuTorch's XNNPACK file in our runtime;
``ET xnnpack`` / ``ET portable`` ExecuTorch's files in its runtime. ``max diff`` compares our export's output with ExecuTorch's portable output, as a
fraction of the output's range (int8 sides quantize separately, so they differ by a step
or so).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

import blas_core  # bench/, this script's folder
from checkout import source_version

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_PYTHON = Path(os.environ.get("EXECUPY_REFERENCE_VENV", Path.home() / ".cache/execupy-reference")) \
    / "bin" / "python"
MODELS = ("mobilenet_v2", "bert")
PRECISIONS = ("fp32", "int8")
CALIBRATION_BATCHES = 4

# ---------------------------------------------------------------------------- the models (torch only)


def mobilenet_v2(width: float = 0.5, classes: int = 1000):
    """MobileNetV2 (Sandler et al. 2018): its block table, channels scaled by ``width``."""
    import torch
    from torch import nn

    def ch(c: int) -> int:
        return max(8, int(c * width + 4) // 8 * 8)

    def conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, nn.ReLU6()) if act else nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            hidden = cin * expand
            self.residual = stride == 1 and cin == cout
            self.block = nn.Sequential(*([conv_bn(cin, hidden, 1)] if expand != 1 else []),
                                       conv_bn(hidden, hidden, 3, stride, groups=hidden),
                                       conv_bn(hidden, cout, 1, act=False))

        def forward(self, x):
            return x + self.block(x) if self.residual else self.block(x)

    class MobileNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            blocks, cin = [conv_bn(3, ch(32), 3, 2)], ch(32)
            for expand, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                                    (6, 160, 3, 2), (6, 320, 1, 1)]:
                for i in range(n):
                    blocks.append(InvertedResidual(cin, ch(c), s if i == 0 else 1, expand))
                    cin = ch(c)
            blocks.append(conv_bn(cin, 1280, 1))
            self.features = nn.Sequential(*blocks)
            self.classifier = nn.Linear(1280, classes)

        def forward(self, x):
            return self.classifier(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))

    return MobileNetV2()


def bert(vocab: int = 8000, dim: int = 256, layers: int = 4, heads: int = 4, ffn: int = 1024, positions: int = 128):
    """BERT's encoder (Devlin et al. 2018): embeddings + LayerNorm, post-norm layers of
    self-attention and a GELU feed-forward."""
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).reshape(b, t, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            attn = torch.softmax(q @ k.transpose(-2, -1) * (dim // heads) ** -0.5, dim=-1)
            x = self.norm1(x + self.out((attn @ v).transpose(1, 2).reshape(b, t, dim)))
            return self.norm2(x + self.ffn(x))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
            self.norm = nn.LayerNorm(dim)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))

        def forward(self, ids):
            x = self.norm(self.tokens(ids) + self.positions(torch.arange(ids.shape[1]).unsqueeze(0)))
            for layer in self.layers:
                x = layer(x)
            return x

    return Bert()


def model_and_inputs(name: str) -> tuple[object, Callable[[int], tuple]]:
    """The seeded model (eval mode, batch norms given statistics) and a seeded input maker."""
    import torch

    torch.manual_seed(0)
    model = {"mobilenet_v2": mobilenet_v2, "bert": bert}[name]().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.2, 0.2), m.running_var.uniform_(0.5, 1.5)

    def inputs(seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        if name == "bert":
            return (torch.randint(0, 8000, (1, 128), generator=g),)
        return (torch.randn(1, 3, 160, 160, generator=g),)

    return model, inputs


def quantize(name: str, model, inputs, quantizer_module) -> object:
    """pt2e with the given side's XNNPACKQuantizer module: static per-channel for the CNN,
    dynamic linears for the encoder; the same calibration inputs on both sides."""
    from torch.export import export
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    config = quantizer_module.get_symmetric_quantization_config(is_per_channel=True, is_dynamic=name == "bert")
    prepared = prepare_pt2e(export(model, inputs(0)).module(), quantizer_module.XNNPACKQuantizer().set_global(config))
    for seed in range(1, CALIBRATION_BATCHES + 1):
        prepared(*inputs(seed))
    return convert_pt2e(prepared)


def time_calls(call: Callable[[], object], calls: int) -> float:
    """Median milliseconds of ``calls`` calls after two warm-up calls."""
    call(), call()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


TEST_SEED = 100  # the timed input, the same on both sides

# ---------------------------------------------------------------------------- ExecuTorch's side


def reference_worker(models: list[str], work: Path, calls: int) -> dict:
    """In the reference venv: export (once, cached in ``work``) and time ExecuTorch's XNNPACK
    and portable programs of each model and precision."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.backends.xnnpack.quantizer import xnnpack_quantizer
    from executorch.exir import to_edge, to_edge_transform_and_lower
    import executorch.kernels.quantized  # noqa: F401  the quantized_decomposed:: kernels for portable programs
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    out = {}
    for name in models:
        for precision in PRECISIONS:
            paths = {kind: work / f"et-{name}-{precision}-{kind}.pte" for kind in ("xnnpack", "portable")}
            model, inputs = model_and_inputs(name)
            if not all(p.is_file() for p in paths.values()):
                if precision == "int8":
                    model = quantize(name, model, inputs, xnnpack_quantizer)
                ep = torch.export.export(model, inputs(0))
                paths["xnnpack"].write_bytes(
                    to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
                paths["portable"].write_bytes(to_edge(torch.export.export(model, inputs(0))).to_executorch().buffer)
            x = inputs(TEST_SEED)
            for kind, path in paths.items():
                module = _load_for_executorch(str(path))
                np.save(work / f"et-{name}-{precision}-{kind}.npy", module.forward(x)[0].numpy())
                out[f"{name}/{precision}/ET {kind}"] = time_calls(lambda: module.forward(x), calls)
    return out


def reference(models: list[str], work: Path, calls: int) -> dict:
    cmd = [str(REFERENCE_PYTHON), __file__, "--reference-worker", "--models", ",".join(models), "--work", str(work),
           "--calls", str(calls)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"reference worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])

# ---------------------------------------------------------------------------- our side


def our_xnnpack_lowering() -> Callable | None:
    """Our one-call XNNPACK lowering, if this checkout has it."""
    try:
        from execupy.exir import to_edge_transform_and_lower
        from execupy.exir.xnnpack import XnnpackPartitioner
    except ImportError:
        return None
    return lambda ep: to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])


def our_programs(name: str, precision: str, work: Path) -> dict[str, Path]:
    """Our exports of the model (cached in ``work``): the portable program, and our XNNPACK
    one when the lowering exists."""
    from torch.export import export

    import execupy.quantization as our_quantizer
    from execupy.exir import to_edge

    version = source_version()  # an export is reused only by the code that wrote it
    paths = {"execupy": work / f"ours-{name}-{precision}-{version}.pte"}
    lower = our_xnnpack_lowering()
    if lower is not None:
        paths["execupy xnnpack export"] = work / f"ours-{name}-{precision}-xnnpack-{version}.pte"
    if all(p.is_file() for p in paths.values()):
        return paths
    model, inputs = model_and_inputs(name)
    if precision == "int8":
        model = quantize(name, model, inputs, our_quantizer)
    if not paths["execupy"].is_file():
        paths["execupy"].write_bytes(to_edge(export(model, inputs(0))).to_executorch().buffer)
    if lower is not None and not paths["execupy xnnpack export"].is_file():
        try:
            paths["execupy xnnpack export"].write_bytes(lower(export(model, inputs(0))).to_executorch().buffer)
        except Exception as e:  # our partitioner is young: a model it cannot lower yet is an n/a cell, not a stop
            print(f"our XNNPACK export of {name} {precision} failed: {type(e).__name__}: {str(e)[:200]}",
                  file=sys.stderr)
            del paths["execupy xnnpack export"]
    return paths


def prepare_ours(models: list[str], work: Path) -> Path:
    """Export our programs (cached) and save the timed inputs; returns the manifest the timing
    worker reads: {"name/precision/label": [program, inputs]}."""
    manifest = {}
    for name in models:
        for precision in PRECISIONS:
            _, inputs = model_and_inputs(name)
            x = work / f"inputs-{name}.npz"
            np.savez(x, *(t.numpy() for t in inputs(TEST_SEED)))
            programs = {**our_programs(name, precision, work),
                        "execupy on ET's xnnpack file": work / f"et-{name}-{precision}-xnnpack.pte"}
            manifest.update({f"{name}/{precision}/{label}": [str(path), str(x)] for label, path in programs.items()})
    path = work / "ours-manifest.json"
    path.write_text(json.dumps(manifest))
    return path


def ours_worker(manifest: Path, calls: int) -> dict:
    """In a fresh process that never imports torch (as a user's runtime runs: torch's idle
    threads would share the cores with ours): time each of our programs."""
    from execupy.runtime import Module

    out = {}
    for key, (path, inputs) in json.loads(manifest.read_text()).items():
        with np.load(inputs) as saved:
            x = tuple(saved[f"arr_{i}"] for i in range(len(saved.files)))
        module = Module(path)
        name, precision, label = key.split("/")
        np.save(manifest.parent / f"{label.replace(' ', '_')}-{name}-{precision}.npy", np.asarray(module.forward(*x)))
        out[key] = time_calls(lambda: module.forward(*x), calls)
    assert "torch" not in sys.modules, "the timing worker imported torch"
    return out


def time_ours(manifest: Path, calls: int) -> dict:
    cmd = [sys.executable, __file__, "--ours-worker", str(manifest), "--calls", str(calls)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        sys.exit(f"our timing worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])

# ---------------------------------------------------------------------------- the table


COLUMNS = ("execupy", "execupy xnnpack export", "execupy on ET's xnnpack file", "ET xnnpack", "ET portable")
SHORT = dict(zip(COLUMNS, ("execupy", "ours xnn", "ours ET-xnn", "ET xnnpack", "ET portable")))


def report(models: list[str], rounds: list[dict], work: Path) -> list[str]:
    head = (f"{'model':13} {'prec':5} " + " ".join(f"{SHORT[c]:>12}" for c in COLUMNS)
            + f" {'best/ET xnn':>11} {'best/ET port':>12} {'max diff':>8}")
    lines = [head, "-" * len(head)]
    for name in models:
        for precision in PRECISIONS:
            ms = {c: statistics.median(r[f"{name}/{precision}/{c}"] for r in rounds)
                  for c in COLUMNS if f"{name}/{precision}/{c}" in rounds[0]}
            best = min(v for c, v in ms.items() if c.startswith("execupy"))
            ours = np.load(work / f"execupy-{name}-{precision}.npy")
            theirs = np.load(work / f"et-{name}-{precision}-portable.npy")
            diff = float(np.abs(ours - theirs).max() / (np.ptp(theirs) or 1.0))
            cells = " ".join(f"{ms[c]:9.1f} ms" if c in ms else f"{'n/a':>12}" for c in COLUMNS)
            lines.append(f"{name:13} {precision:5} {cells} {best / ms['ET xnnpack']:11.2f} "
                         f"{best / ms['ET portable']:12.3f} {diff:8.1e}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=3, help="turns of both sides; the table shows medians")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per program per round (median)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/execupy/bench/models",
                    help="where the exported programs are kept")
    ap.add_argument("--keep-blas-core", action="store_true",
                    help="keep OPENBLAS_CORETYPE as the environment has it (default: removed; blas_core.py)")
    ap.add_argument("--reference-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ours-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ours_worker:
        print(json.dumps(ours_worker(args.ours_worker, args.calls)))
        return 0
    if not (args.keep_blas_core or args.reference_worker) and blas_core.PIN in os.environ:
        # our side runs in this process, whose numpy has loaded OpenBLAS already: start again without the pin
        os.execve(sys.executable, [sys.executable, *sys.argv], blas_core.engine_env(False))
    models = [m for m in args.models.split(",") if m]
    if not set(models) <= set(MODELS):
        sys.exit(f"unknown model in {models}; known: {', '.join(MODELS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.reference_worker:
        print(json.dumps(reference_worker(models, args.work, args.calls)))
        return 0

    sys.path.insert(0, str(ROOT))
    if not REFERENCE_PYTHON.is_file():
        sys.exit(f"no reference venv at {REFERENCE_PYTHON} (see shared/tools/reference_run.py)")
    manifest = prepare_ours(models, args.work)
    load = os.getloadavg()[0]
    rounds = []
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        theirs = reference(models, args.work, args.calls)
        rounds.append({**theirs, **time_ours(manifest, args.calls)})
    print(f"latency per forward call, median of {args.calls} calls x {args.rounds} rounds; {os.cpu_count()} cores, "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"numpy's OpenBLAS in our runs: {blas_core.chosen_core(dict(os.environ))}")
    print("\n".join(report(models, rounds, args.work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
