"""Runtime half of NumpyFusedBackend (no torch): parse the payload once, run it per call.

Payload layout (all of it written by aot.py, read only here):

    b"NPFUSED1"  | u32 little-endian header length | JSON header | zero pad to 16 | weights

The header lists numbered values: `inputs` (DelegateCall order), `constants` (float32
arrays at byte offsets into the weights), `ops` ({"op", "args", "out", "attrs"}; an arg
is a value number or {"scalar": x}) and `outputs`. No pickle, no code: only data.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

BACKEND_ID = "NumpyFusedBackend"
MAGIC = b"NPFUSED1"
DATA_ALIGNMENT = 16


def _addmm(bias, a, b, beta=1.0, alpha=1.0):
    out = np.matmul(a, b)
    if alpha != 1.0:
        out *= alpha
    out += bias if beta == 1.0 else beta * bias
    return out


def _linear(x, w, b=None):
    out = np.matmul(x, w.T)
    if b is not None:
        out += b
    return out


def _add(a, b, alpha=1.0):
    return np.add(a, b if alpha == 1.0 else np.multiply(b, alpha), dtype=np.float32)


# op name -> numpy function(*args, **attrs)
OPS: dict[str, Callable[..., Any]] = {
    "addmm": _addmm,
    "mm": np.matmul,
    "linear": _linear,
    "permute": lambda x, dims: np.transpose(x, dims),
    "add": _add,
    "mul": lambda a, b: np.multiply(a, b, dtype=np.float32),
    "relu": lambda x: np.maximum(x, np.float32(0)),
    "view": lambda x, size: np.reshape(x, size),
}


@dataclass
class FusedProgram:
    inputs: list[int]
    outputs: list[int]
    constants: dict[int, np.ndarray]
    steps: list[Callable[[list], None]]
    num_values: int

    def __call__(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        vals: list[Any] = [None] * self.num_values
        for i, v in self.constants.items():
            vals[i] = v
        for i, x in zip(self.inputs, inputs):
            vals[i] = x
        for step in self.steps:
            step(vals)
        return [vals[i] for i in self.outputs]


def parse(payload: bytes | memoryview) -> tuple[dict, memoryview]:
    """(header, weights) of a payload; ValueError when it is not one of ours."""
    view = memoryview(payload).cast("B")
    if bytes(view[:8]) != MAGIC:
        raise ValueError(f"not a {BACKEND_ID} payload (magic {bytes(view[:8])!r})")
    (n,) = struct.unpack_from("<I", view, 8)
    header = json.loads(bytes(view[12:12 + n]).decode("utf-8"))
    start = -(-(12 + n) // DATA_ALIGNMENT) * DATA_ALIGNMENT
    return header, view[start:]


def compile_payload(payload: bytes | memoryview) -> FusedProgram:
    header, weights = parse(payload)
    constants: dict[int, np.ndarray] = {}
    for c in header["constants"]:
        count = int(np.prod(c["shape"], dtype=np.int64))
        constants[c["id"]] = np.frombuffer(weights, np.float32, count, c["offset"]).reshape(c["shape"])
    steps = []
    for op in header["ops"]:
        fn = OPS.get(op["op"])
        if fn is None:
            raise ValueError(f"{BACKEND_ID}: unknown op {op['op']!r}")
        args, attrs = op["args"], op.get("attrs", {})
        if all(not isinstance(a, int) or a in constants for a in args):
            # Constant folding: weight permutes (linear's transpose) are done once, here.
            value = fn(*[_resolve(a, constants) for a in args], **attrs)
            constants[op["out"]] = np.ascontiguousarray(value)
            continue
        steps.append(_step(fn, args, attrs, op["out"]))
    return FusedProgram(header["inputs"], header["outputs"], constants, steps, header["num_values"])


def _resolve(a: Any, vals: Any) -> Any:
    return vals[a] if isinstance(a, int) else np.float32(a["scalar"])


def _step(fn: Callable[..., Any], args: list, attrs: dict, out: int) -> Callable[[list], None]:
    refs = [a if isinstance(a, int) else None for a in args]
    scalars = [None if isinstance(a, int) else np.float32(a["scalar"]) for a in args]

    def step(vals: list) -> None:
        vals[out] = fn(*[vals[r] if r is not None else s for r, s in zip(refs, scalars)], **attrs)

    return step


class NumpyFusedBackend:
    def is_available(self) -> bool:
        return True

    def init(self, processed: memoryview, compile_specs: list, context: Any) -> FusedProgram:
        return compile_payload(processed)

    def execute(self, handle: FusedProgram, args: list) -> Optional[list]:
        outs = handle(args[:len(handle.inputs)])
        return [np.asarray(o, dtype=np.float32) for o in outs]
