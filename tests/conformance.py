"""Reading and checking test programs in the conformance corpus layout: ExecuTorch's
(../shared/conformance, where it exists) and our own exporter's (tests/programs.py,
always; built on first use).

`cases()` lists both; a Case's folder and manifest are looked up only when a test uses
them, so collecting the tests builds nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Optional

import ml_dtypes
import numpy as np

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "conformance"
SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "design" / "samples"


# ExecuTorch's flavours (how its toolchain wrote the program); ours are in programs.OWN_CASES.
EXECUTORCH_FLAVOURS = ("portable", "quant_portable", "xnnpack", "quant_xnnpack")


@dataclass(eq=False)
class Case:
    name: str
    flavour: str
    corpus: Callable[[], Path]  # the folder holding this case's folder

    @property
    def dir(self) -> Path:
        return self.corpus() / self.name

    @property
    def pte(self) -> Path:
        return self.dir / "model.pte"

    @cached_property
    def manifest(self) -> dict:
        return json.loads((self.dir / "manifest.json").read_text())

    @property
    def by_executorch(self) -> bool:
        return self.flavour in EXECUTORCH_FLAVOURS


def executorch_cases() -> list[Case]:
    if not CORPUS.exists():
        return []
    index = json.loads((CORPUS / "index.json").read_text())
    return [Case(entry["name"], entry["flavour"], lambda: CORPUS) for entry in index["cases"]]


def own_cases() -> list[Case]:
    from . import programs

    return [Case(name, flavour, programs.corpus) for name, flavour in programs.OWN_CASES.items()]


def cases(*flavours: str) -> list[Case]:
    """ExecuTorch's cases (when ../shared is here), then ours; only `flavours` if given."""
    return [c for c in executorch_cases() + own_cases() if not flavours or c.flavour in flavours]


def case(name: str) -> Case:
    (found,) = named(name)
    return found


def named(*names: str) -> list[Case]:
    """The cases of these names that are here (ExecuTorch's only where ../shared is)."""
    return [c for c in cases() if c.name in names]


def topic(name: str) -> list[Case]:
    """ExecuTorch's portable-<name> (when present) and our execupy-<name>: the same model
    written by both exporters, for tests that state facts of that model."""
    return [c for c in cases() if c.name in (f"portable-{name}", f"execupy-{name}")]


@dataclass(eq=False)
class Sample:
    """A design sample: a program ExecuTorch wrote, without input or expected files."""

    name: str

    @property
    def pte(self) -> Path:
        return SAMPLES / f"{self.name}.pte"


def samples() -> list[Sample]:
    return [Sample(path.stem) for path in sorted(SAMPLES.glob("*.pte"))]


def program_name(program: Case | Sample) -> str:
    """The pytest id of a parameter that is a case or a sample."""
    return program.name


def with_sample(sample: str, own: str) -> list:
    """ExecuTorch's design sample `sample` (when present) and our case `own` of the same kind."""
    return [s for s in samples() if s.name == sample] + [case(own)]


def load_inputs(case: Case, run: dict) -> list[Any]:
    arrays = np.load(case.dir / run["inputs_file"])
    args = []
    for spec in run["inputs"]:
        if spec["kind"] != "tensor":
            args.append(spec["value"])
        elif spec["dtype"] == "bfloat16":
            args.append(arrays[spec["name"]].view(ml_dtypes.bfloat16))
        else:
            args.append(arrays[spec["name"]])
    return args


def expected_outputs(case: Case, run: dict) -> list[np.ndarray]:
    arrays = np.load(case.dir / run["expected_file"])
    outs = []
    for spec in run["outputs"]:
        a = arrays[spec["name"]]
        if spec.get("dtype") == "bfloat16":
            a = a.view(ml_dtypes.bfloat16)
        outs.append(a)
    return outs


def flatten(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [leaf for item in x for leaf in flatten(item)]
    if isinstance(x, dict):
        return [leaf for item in x.values() for leaf in flatten(item)]
    return [x]


def mismatch(actual: Any, expected: np.ndarray, atol: float, rtol: float) -> Optional[str]:
    """None when `actual` matches by the corpus rules, else a description of the difference."""
    actual = np.asarray(actual)
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != expected {expected.shape}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != expected {expected.dtype}"
    if expected.dtype.kind in "fc" or expected.dtype == ml_dtypes.bfloat16:
        a, e = actual.astype(np.float64), expected.astype(np.float64)
        if not np.array_equal(np.isnan(a), np.isnan(e)):
            return "NaN positions differ"
        inf = np.isinf(e)
        if not np.array_equal(a[inf], e[inf]):
            return "infinities differ"
        fin = ~np.isnan(e) & ~inf
        bad = np.abs(a[fin] - e[fin]) > atol + rtol * np.abs(e[fin])
        if bad.any():
            return f"{int(bad.sum())} elements off, max abs diff {np.max(np.abs(a[fin] - e[fin])):.3g}"
        return None
    if not np.array_equal(actual, expected):
        return f"{int((actual != expected).sum())} elements differ"
    return None
