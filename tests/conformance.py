"""Reading and checking the ExecuTorch conformance corpus in ../shared/conformance."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import ml_dtypes
import numpy as np

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "conformance"
SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "design" / "samples"


@dataclass
class Case:
    name: str
    flavour: str
    dir: Path
    manifest: dict

    @property
    def pte(self) -> Path:
        return self.dir / "model.pte"


def cases(*flavours: str) -> list[Case]:
    if not CORPUS.exists():
        return []
    index = json.loads((CORPUS / "index.json").read_text())
    out = []
    for entry in index["cases"]:
        if flavours and entry["flavour"] not in flavours:
            continue
        d = CORPUS / entry["name"]
        out.append(Case(entry["name"], entry["flavour"], d, json.loads((d / "manifest.json").read_text())))
    return out


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
