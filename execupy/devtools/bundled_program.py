"""Bundled programs: a `.pte` plus per-method test cases, in ExecuTorch's `.bpte` format.

A bundled program carries its own proof of correctness: for each method, a list of
inputs and the outputs the model gave for them when it was exported. A runtime loads
the embedded program, runs every case and compares.

    suite = MethodTestSuite("forward", [MethodTestCase([x], [y])])
    write_bundled_program("model.bpte", BundledProgram(program_bytes, [suite]))
    bundle = load_bundled_program("model.bpte")
    results = verify_bundled_program(bundle)          # one CaseResult per test case

The file is a flatbuffer with file identifier `BP08` (ExecuTorch's
bundled_program_schema.fbs, schema version 2): table BundledProgram {version: uint,
method_test_suites: [BundledMethodTestSuite], program: [ubyte] (force_align 32)};
a suite is {method_name: string, test_cases: [BundledMethodTestCase]}; a case is
{inputs: [Value], expected_outputs: [Value]}; a Value holds a union of Tensor
{scalar_type: byte, sizes: [int], data: [ubyte] (force_align 16), dim_order: [ubyte]},
Int {long}, Bool {bool} or Double {double}.

The reader is torch-free and needs no flatbuffers package: it reuses the bounds-checked
cursor of execupy/schema/reader.py, so a truncated or corrupted file raises
MalformedProgramError. Writing needs `flatbuffers` (an export-time dependency) and is
imported on demand. A torch model's expected outputs are computed by
`execupy.exir.bundled.method_test_suite`.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import numpy as np

from ..errors import ExecupyError, InvalidInputError, MalformedProgramError, MethodNotFoundError
from ..fileio import atomic_write
from ..schema import program as P
from ..schema.reader import _Fb, _Table

FILE_IDENTIFIER = b"BP08"
SCHEMA_VERSION = 2  # ExecuTorch's BUNDLED_PROGRAM_SCHEMA_VERSION
PROGRAM_ALIGNMENT = 32  # force_align of BundledProgram.program
TENSOR_DATA_ALIGNMENT = 16  # force_align of Tensor.data

# A test-case value: a tensor, or a scalar the method takes as a non-tensor input.
Value = Union[np.ndarray, int, bool, float]

# ValueUnion member tags, in the order the schema lists them (0 is NONE).
_TENSOR, _INT, _BOOL, _DOUBLE = 1, 2, 3, 4


@dataclass
class MethodTestCase:
    """One call of a method: its inputs and the outputs it must give."""

    inputs: list[Value]
    expected_outputs: list[Value]

    def __post_init__(self) -> None:
        self.inputs = [_as_value(x, "input") for x in self.inputs]
        self.expected_outputs = [_as_value(x, "expected output") for x in self.expected_outputs]


@dataclass
class MethodTestSuite:
    """The test cases of one method of the program."""

    method_name: str
    test_cases: list[MethodTestCase]


@dataclass
class BundledProgram:
    """A program's bytes and its test suites.

    `program` may be the bytes of a `.pte` or anything with a `.buffer` holding them
    (the manager `execupy.exir`'s `to_executorch()` returns).
    """

    program: Any
    method_test_suites: list[MethodTestSuite] = field(default_factory=list)
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        program = getattr(self.program, "buffer", self.program)
        if not isinstance(program, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"program must be .pte bytes or have a .buffer, got {type(self.program).__name__}")
        self.program = bytes(program)

    def suite(self, method_name: str) -> MethodTestSuite:
        for s in self.method_test_suites:
            if s.method_name == method_name:
                return s
        raise MethodNotFoundError(f"the bundle has no test suite for method {method_name!r}")


def _as_value(x: Any, what: str) -> Value:
    if isinstance(x, (bool, int, float)):
        return x  # bool before int matters later: True is an int too
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x)
    if hasattr(x, "__array__"):
        return np.asarray(x)
    raise InvalidInputError(f"a test-case {what} must be an array, int, bool or float, got {type(x).__name__}")


# ---------------------------------------------------------------------------- writing


def serialize_bundled_program(bundle: BundledProgram, *, check: bool = True) -> bytes:
    """The bytes of a `.bpte` file. With `check`, every suite is first checked against
    the program's methods (name, number, dtype and shape of inputs), as a mismatch would
    only show up later as a failed verification."""
    import flatbuffers

    from ..schema.writer import _Writer

    if check:
        check_suites(bundle)
    w = _Writer(flatbuffers.Builder(1024 + len(bundle.program)), TENSOR_DATA_ALIGNMENT, TENSOR_DATA_ALIGNMENT)
    suites = w.tables(bundle.method_test_suites, lambda s: _write_suite(w, s))
    program = w.bytes_vector(bundle.program, PROGRAM_ALIGNMENT)
    root = w.table([(0, "Uint32", bundle.version), (1, "off", suites), (2, "off", program)])
    w.b.Finish(root, file_identifier=FILE_IDENTIFIER)
    return bytes(w.b.Output())


def write_bundled_program(path: Union[str, os.PathLike], bundle: BundledProgram, **kwargs) -> None:
    atomic_write(path, serialize_bundled_program(bundle, **kwargs))


def _write_suite(w, suite: MethodTestSuite) -> int:
    cases = w.tables(suite.test_cases, lambda c: _write_case(w, c))
    name = w.string(suite.method_name)
    return w.table([(0, "off", name), (1, "off", cases)])


def _write_case(w, case: MethodTestCase) -> int:
    inputs = w.tables(case.inputs, lambda v: _write_value(w, v))
    outputs = w.tables(case.expected_outputs, lambda v: _write_value(w, v))
    return w.table([(0, "off", inputs), (1, "off", outputs)])


def _write_value(w, v: Value) -> int:
    if isinstance(v, bool):
        tag, member = _BOOL, w.table([(0, "Bool", v)])
    elif isinstance(v, int):
        tag, member = _INT, w.table([(0, "Int64", v)])
    elif isinstance(v, float):
        tag, member = _DOUBLE, w.table([(0, "Float64", v)])
    else:
        tag, member = _TENSOR, _write_tensor(w, v)
    return w.table([(0, "Uint8", tag), (1, "off", member)])


def _write_tensor(w, arr: np.ndarray) -> int:
    try:
        scalar_type = P.scalar_type_of(arr.dtype)
    except KeyError:
        raise InvalidInputError(f"no ExecuTorch scalar type for dtype {arr.dtype}") from None
    # Contiguous bytes and the identity dim order: every reader takes them as they are.
    data = w.bytes_vector(arr.tobytes(), TENSOR_DATA_ALIGNMENT)  # tobytes: C order
    sizes = w.scalars(arr.shape, "<i4")
    dim_order = w.scalars(range(arr.ndim), "u1")
    return w.table([(0, "Int8", scalar_type), (1, "off", sizes), (2, "off", data), (3, "off", dim_order)])


def check_suites(bundle: BundledProgram) -> None:
    """Raise InvalidInputError when a suite does not fit the program it is bundled with."""
    from ..runtime import Program, TensorInfo

    program = Program.load(bundle.program)
    for suite in bundle.method_test_suites:
        if suite.method_name not in program.method_names:
            raise InvalidInputError(f"test suite names method {suite.method_name!r}, but the program's methods "
                                    f"are: {', '.join(program.method_names)}")
        meta = program.method_meta(suite.method_name)
        for k, case in enumerate(suite.test_cases):
            where = f"method {suite.method_name!r} case {k}"
            if len(case.inputs) != len(meta.inputs):
                raise InvalidInputError(f"{where} has {len(case.inputs)} inputs, the method takes {len(meta.inputs)}")
            if len(case.expected_outputs) != len(meta.outputs):
                raise InvalidInputError(
                    f"{where} has {len(case.expected_outputs)} expected outputs, the method gives {len(meta.outputs)}")
            for j, (x, info) in enumerate(zip(case.inputs, meta.inputs)):
                if isinstance(info, TensorInfo) and (not isinstance(x, np.ndarray) or x.dtype != info.dtype):
                    got = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
                    raise InvalidInputError(f"{where} input {j} is {got}, the method takes {info.dtype}")


# ---------------------------------------------------------------------------- reading


def read_bundled_program(data: Union[bytes, bytearray, memoryview]) -> BundledProgram:
    """Decode `.bpte` bytes; MalformedProgramError names what is wrong with a bad file."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise MalformedProgramError(f"file is {len(view)} bytes, too short to be a bundled program")
    if bytes(view[4:8]) != FILE_IDENTIFIER:
        raise MalformedProgramError(
            f"not a bundled program: file identifier is {bytes(view[4:8])!r}, expected {FILE_IDENTIFIER!r}")
    fb = _Fb(view, len(view))
    root = fb.table(fb.root())
    program = root.bytes_view(2)
    if not len(program):
        raise MalformedProgramError("bundled program has no embedded program")
    return BundledProgram(
        program=program,
        method_test_suites=root.tables(1, _read_suite),
        version=root.scalar(0, "I"),
    )


def load_bundled_program(path: Union[str, os.PathLike]) -> BundledProgram:
    with open(path, "rb") as f:
        return read_bundled_program(f.read())


def _read_suite(t: _Table) -> MethodTestSuite:
    return MethodTestSuite(t.string(0), t.tables(1, _read_case))


def _read_case(t: _Table) -> MethodTestCase:
    return MethodTestCase(t.tables(0, _read_value), t.tables(1, _read_value))


def _read_value(t: _Table) -> Value:
    tag = t.scalar(0, "B")
    member = t.table(1)
    if member is None:
        raise MalformedProgramError(f"test-case value (type tag {tag}) has no value table")
    if tag == _TENSOR:
        return _read_tensor(member)
    if tag == _INT:
        return member.scalar(0, "q")
    if tag == _BOOL:
        return bool(member.scalar(0, "B"))
    if tag == _DOUBLE:
        return float(member.scalar(0, "d", 0.0))
    raise MalformedProgramError(f"test-case value has unknown type tag {tag}")


def _read_tensor(t: _Table) -> np.ndarray:
    code = t.scalar(0, "b")
    try:
        dtype = P.numpy_dtype(code)
    except KeyError:
        raise MalformedProgramError(f"test-case tensor has unsupported scalar type {code}") from None
    sizes = t.scalars(1, "i")
    data = t.bytes_view(2)
    dim_order = t.scalars(3, "B") or list(range(len(sizes)))
    if any(s < 0 for s in sizes):
        raise MalformedProgramError(f"test-case tensor has negative sizes {sizes}")
    if sorted(dim_order) != list(range(len(sizes))):
        raise MalformedProgramError(f"test-case tensor dim order {dim_order} does not fit its sizes {sizes}")
    # Compare with the bytes present before allocating: sizes cannot ask for more than the file holds.
    nbytes = math.prod(sizes) * dtype.itemsize
    if nbytes != len(data):
        raise MalformedProgramError(
            f"test-case tensor of sizes {sizes} and dtype {dtype} needs {nbytes} bytes, the file holds {len(data)}")
    # The bytes are laid out in dim order; transposing back gives the logical tensor.
    physical = np.frombuffer(data, dtype=dtype).reshape([sizes[d] for d in dim_order])
    return physical.transpose(np.argsort(np.asarray(dim_order, dtype=np.intp))).copy()  # copy: C order, writable


# ---------------------------------------------------------------------------- verifying


@dataclass
class CaseResult:
    method: str
    case: int
    passed: bool
    max_abs_error: float  # over every output; inf when an output is missing or of another shape
    message: str = ""  # why it failed


def verify_bundled_program(bundle: BundledProgram, rtol: float = 1e-5, atol: float = 1e-6) -> list[CaseResult]:
    """Run every test case in execupy's runtime and compare with its expected outputs:
    |actual - expected| <= atol + rtol * |expected| everywhere, same dtype and shape.

    An embedded program that cannot be read raises MalformedProgramError; a case whose
    method is missing or fails to run is a failed case that says why."""
    from ..runtime import Program

    program = Program.load(bundle.program)
    results = []
    for suite in bundle.method_test_suites:
        try:
            method, load_error = program.load_method(suite.method_name), ""
        except ExecupyError as e:
            method, load_error = None, f"{type(e).__name__}: {e}"
        for k, case in enumerate(suite.test_cases):
            passed, err, msg = False, math.inf, load_error
            if method is not None:
                try:
                    actual = method.execute(case.inputs)
                    passed, err, msg = compare_outputs(actual, case.expected_outputs, rtol, atol)
                except ExecupyError as e:
                    msg = f"{type(e).__name__}: {e}"
            results.append(CaseResult(suite.method_name, k, passed, err, msg))
    return results


def compare_outputs(actual: Sequence[Any], expected: Sequence[Value], rtol: float, atol: float
                    ) -> tuple[bool, float, str]:
    """(all close, largest absolute error, why not) for one case's outputs."""
    if len(actual) != len(expected):
        return False, math.inf, f"the method gave {len(actual)} outputs, the case expects {len(expected)}"
    worst, problems = 0.0, []
    for j, (a, e) in enumerate(zip(actual, expected)):
        is_tensor = isinstance(e, np.ndarray)
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape or (is_tensor and a.dtype != e.dtype):
            worst = math.inf
            problems.append(f"output {j} is {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
            continue
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        diff = np.abs(a64 - e64)
        same_nan = np.isnan(a64) & np.isnan(e64)
        diff[same_nan | (a64 == e64)] = 0.0  # equal infinities and NaN where NaN is expected are no error
        err = float(diff.max(initial=0.0))
        worst = max(worst, err if not np.isnan(err) else math.inf)
        close = (diff <= atol + rtol * np.abs(e64))
        if not close.all():
            bad = int(np.argmax(~close.reshape(-1)))
            problems.append(f"output {j} differs at flat index {bad}: got {a64.reshape(-1)[bad]:.9g}, "
                            f"expected {e64.reshape(-1)[bad]:.9g}")
    return not problems, worst, "; ".join(problems)


def format_results(results: Sequence[CaseResult]) -> str:
    """One line per case and a summary, as `execupy verify` prints them."""
    lines = [f"{r.method} case {r.case}: {'PASS' if r.passed else 'FAIL'}  max abs error {r.max_abs_error:.3g}"
             + (f"  ({r.message})" if r.message else "") for r in results]
    failed = sum(not r.passed for r in results)
    lines.append(f"{len(results) - failed} of {len(results)} test cases passed"
                 + (f", {failed} failed" if failed else ""))
    return "\n".join(lines)
