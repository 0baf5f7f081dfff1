"""Import-plus-load time and resident memory: every kernel module vs only those a program needs.

    .venv/bin/python bench/kernel_selection.py [--repeat 5] [--program PTE ...]

For each program (default: the shipped example MLP and, when it has been exported, the
SmolLM2 program the tests cache in ~/.cache/execupy/tests), `execupy kernels` writes its
kernel list, then fresh interpreters (`--repeat` of each, alternating) time
`import execupy.runtime` + `Module(pte)` + loading `forward` and report their peak
resident memory, once with all kernels and once with EXECUPY_KERNELS set to the list.
Printed: the medians and the ratio selected / all.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import resource, sys, time
t0 = time.perf_counter()
from execupy.runtime import Module
module = Module(sys.argv[1])
module.method("forward")
elapsed = time.perf_counter() - t0
kernel_modules = [m for m in sys.modules if m.startswith("execupy.kernels.") and m.count(".") == 3]
print(elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, len(kernel_modules))
"""


def default_programs() -> list[Path]:
    programs = [REPO / "execupy" / "examples" / "mlp.pte"]
    cache = Path(os.environ.get("EXECUPY_CACHE", Path.home() / ".cache/execupy")) / "tests"
    programs += sorted(cache.glob("smollm2-*.pte"))[:1]
    return programs


def measure(pte: Path, kernel_list: Path | None) -> tuple[float, float, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("EXECUPY_KERNELS", None)
    if kernel_list is not None:
        env["EXECUPY_KERNELS"] = str(kernel_list)
    out = subprocess.run([sys.executable, "-c", CHILD, str(pte)], capture_output=True, text=True, check=True,
                         env=env, timeout=600).stdout.split()
    return float(out[0]), float(out[1]), int(out[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--program", type=Path, action="append", help="a .pte (repeatable; default: MLP and SmolLM2)")
    args = ap.parse_args()
    print(f"{'program':<28} {'kernels':>9} {'modules':>8} {'import+load ms':>15} {'peak RSS MiB':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for pte in args.program or default_programs():
            kernel_list = Path(tmp) / f"{pte.stem}.kernels"
            subprocess.run([sys.executable, "-m", "execupy", "kernels", str(pte), "-o", str(kernel_list)],
                           check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            runs: dict[str, list[tuple[float, float, int]]] = {"all": [], "selected": []}
            for _ in range(args.repeat):  # alternate, so that machine noise hits both alike
                runs["all"].append(measure(pte, None))
                runs["selected"].append(measure(pte, kernel_list))
            medians = {}
            for name, rows in runs.items():
                seconds = statistics.median(r[0] for r in rows)
                rss = statistics.median(r[1] for r in rows)
                medians[name] = (seconds, rss)
                print(f"{pte.name[:28]:<28} {name:>9} {rows[0][2]:>8} {1e3 * seconds:>15.1f} {rss:>13.1f}")
            (t_all, m_all), (t_sel, m_sel) = medians["all"], medians["selected"]
            print(f"{'':<28} {'ratio':>9} {'':>8} {t_sel / t_all:>14.2f}x {m_sel / m_all:>12.2f}x")
            print(json.dumps({"program": pte.name, "all": medians["all"], "selected": medians["selected"]}),
                  file=sys.stderr)


if __name__ == "__main__":
    main()
