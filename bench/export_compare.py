#!/usr/bin/env python3
"""Our exporter beside ExecuTorch's on zoo models: planned arena bytes, .pte size, export time.

    .venv/bin/python bench/export_compare.py [--models mlp,gpt2_block | --models all] [--repeat 3]

For each model (tests/exir/zoo.py), both sides start from the same torch.export program
and time `to_edge(...).to_executorch()` (best of --repeat; torch.export itself is shared
and not timed). ExecuTorch's side runs in its reference venv (~/.cache/execupy-reference,
override with $EXECUPY_REFERENCE_VENV) as `--reference-worker`, a separate process:
execupy never imports executorch. Printed per model: each side's value and ours/theirs.
Arena bytes are the sum of the planned (non-constant) buffer sizes of every method.
The "delegated" arena/pte columns are ours again with NumpyFusedBackend delegating the float32
linear/matmul/elementwise parts (its intermediates live in numpy, not in the arena). The
last two are the share of graph nodes each side's XnnpackPartitioner delegates
(to_edge_transform_and_lower; delegated / all call nodes, by each side's get_delegation_info).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_PYTHON = Path(os.environ.get("EXECUPY_REFERENCE_VENV", Path.home() / ".cache/execupy-reference")) \
    / "bin" / "python"
DEFAULT_MODELS = "mlp,mlp_activations,cnn_bn_pool,embedding_layernorm,causal_attention,gpt2_block,llama_block"


def build(name: str):
    """(exported program) for a zoo case, the same on both sides (seeded)."""
    import torch
    from torch.export import export

    sys.path.insert(0, str(ROOT / "tests" / "exir"))
    import zoo  # only torch: importable from either venv

    torch.manual_seed(0)
    case = zoo.by_name(name)
    model, args = case.build()
    return export(model.eval(), args, dynamic_shapes=case.dynamic_shapes)


def measure(name: str, repeat: int, to_edge, arena_bytes) -> dict:
    best, prog = float("inf"), None
    for _ in range(repeat):
        ep = build(name)
        t0 = time.perf_counter()
        prog = to_edge(ep).to_executorch()
        best = min(best, time.perf_counter() - t0)
    return {"arena": arena_bytes(prog), "pte": len(prog.buffer), "seconds": best}


def ours(name: str, repeat: int, delegate: bool = False) -> dict:
    sys.path.insert(0, str(ROOT))
    from execupy.exir import to_edge

    lower = to_edge
    if delegate:  # our exporter with NumpyFusedBackend taking what it can
        from execupy.backends.numpy_fused.aot import NumpyFusedPartitioner

        def lower(ep):
            return to_edge(ep).to_backend(NumpyFusedPartitioner())

    return measure(name, repeat, lower,
                   lambda prog: sum(s["planned_bytes"] for s in prog.plan_summary().values()))


def delegated_share(info) -> float:
    total = info.num_delegated_nodes + info.num_non_delegated_nodes
    return info.num_delegated_nodes / total if total else 0.0


def ours_xnnpack_share(name: str) -> float:
    sys.path.insert(0, str(ROOT))
    from execupy.exir import to_edge_transform_and_lower
    from execupy.exir.delegation_info import get_delegation_info
    from execupy.exir.xnnpack import XnnpackPartitioner

    edge = to_edge_transform_and_lower(build(name), partitioner=[XnnpackPartitioner()])
    return delegated_share(get_delegation_info(edge))


def reference_xnnpack_share(name: str) -> float:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.devtools.backend_debug import get_delegation_info
    from executorch.exir import to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(build(name), partitioner=[XnnpackPartitioner()])
    return delegated_share(get_delegation_info(edge.exported_program().graph_module))


def reference_worker(models: list[str], repeat: int) -> None:
    from executorch.exir import to_edge  # reference venv only

    def arena(prog) -> int:
        return sum(sum(plan.non_const_buffer_sizes) for plan in prog.executorch_program.execution_plan)

    results = {}
    for name in models:
        try:
            results[name] = measure(name, repeat, to_edge, arena)
            results[name]["xnnpack_share"] = reference_xnnpack_share(name)
        except Exception as e:  # report, keep going: one model the reference rejects is a result too
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    print(json.dumps(results))


def reference(models: list[str], repeat: int) -> dict:
    cmd = [str(REFERENCE_PYTHON), __file__, "--reference-worker", "--models", ",".join(models),
           "--repeat", str(repeat)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"reference worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated zoo names, or 'all'")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reference-worker", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    models = [m for m in opts.models.split(",") if m]
    if models == ["all"]:
        sys.path.insert(0, str(ROOT / "tests" / "exir"))
        import zoo

        models = [c.name for c in zoo.CASES]
    if opts.reference_worker:
        reference_worker(models, opts.repeat)
        return
    if not REFERENCE_PYTHON.is_file():
        raise SystemExit(f"no reference venv at {REFERENCE_PYTHON} (see shared/tools/reference_run.py)")
    theirs = reference(models, opts.repeat)
    head = f"{'model':<22}{'arena ours':>11}{'theirs':>9}{'ratio':>7}{'pte ours':>10}{'theirs':>9}{'ratio':>7}" \
           f"{'export s ours':>14}{'theirs':>8}{'ratio':>7}   | delegated: {'arena':>7}{'pte':>8}" \
           f"   | xnnpack share: {'ours':>5}{'theirs':>7}"
    print(head)
    print("-" * len(head))
    for name in models:
        them = theirs[name]
        try:
            us, fused = ours(name, opts.repeat), ours(name, 1, delegate=True)
            share = ours_xnnpack_share(name)
        except Exception as e:  # a benchmark row, not a test: report and go on
            print(f"{name:<22} ours failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        if "error" in them:
            print(f"{name:<22} reference failed: {them['error']}")
            continue
        print(f"{name:<22}{us['arena']:>11}{them['arena']:>9}{ratio(us['arena'], them['arena']):>7}"
              f"{us['pte']:>10}{them['pte']:>9}{ratio(us['pte'], them['pte']):>7}"
              f"{us['seconds']:>14.3f}{them['seconds']:>8.3f}{ratio(us['seconds'], them['seconds']):>7}"
              f"   | {'':>10}{fused['arena']:>7}{fused['pte']:>8}"
              f"   | {'':>15}{share:>5.2f}{them['xnnpack_share']:>7.2f}")


if __name__ == "__main__":
    main()
