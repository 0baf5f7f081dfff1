"""The ExecuTorch Program data model (schema `executorch_flatbuffer`, file id `ET12`).

One dataclass per flatbuffer table, with the field names of the schema
(see docs/format.md §10-§11). Unions are plain Python unions: an EValue is
just one of the value classes below, an Instruction one of the instruction classes.
Defaults equal the schema defaults, so an absent field reads as the default.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Optional, Union

import numpy as np


class ScalarType(IntEnum):
    BYTE = 0
    CHAR = 1
    SHORT = 2
    INT = 3
    LONG = 4
    HALF = 5
    FLOAT = 6
    DOUBLE = 7
    BOOL = 11
    QINT8 = 12
    QUINT8 = 13
    QINT32 = 14
    BFLOAT16 = 15
    QUINT4X2 = 16
    QUINT2X4 = 17
    BITS16 = 22
    FLOAT8_E5M2 = 23
    FLOAT8_E4M3FN = 24
    FLOAT8_E5M2FNUZ = 25
    FLOAT8_E4M3FNUZ = 26
    UINT16 = 27
    UINT32 = 28
    UINT64 = 29


def _numpy_dtypes() -> dict[int, np.dtype]:
    return {
        ScalarType.BYTE: np.dtype(np.uint8),
        ScalarType.CHAR: np.dtype(np.int8),
        ScalarType.SHORT: np.dtype(np.int16),
        ScalarType.INT: np.dtype(np.int32),
        ScalarType.LONG: np.dtype(np.int64),
        ScalarType.HALF: np.dtype(np.float16),
        ScalarType.FLOAT: np.dtype(np.float32),
        ScalarType.DOUBLE: np.dtype(np.float64),
        ScalarType.BOOL: np.dtype(np.bool_),
        # Quantized storage types are their integer carriers.
        ScalarType.QINT8: np.dtype(np.int8),
        ScalarType.QUINT8: np.dtype(np.uint8),
        ScalarType.QINT32: np.dtype(np.int32),
        ScalarType.QUINT4X2: np.dtype(np.uint8),
        ScalarType.QUINT2X4: np.dtype(np.uint8),
        ScalarType.BITS16: np.dtype(np.uint16),
        ScalarType.UINT16: np.dtype(np.uint16),
        ScalarType.UINT32: np.dtype(np.uint32),
        ScalarType.UINT64: np.dtype(np.uint64),
    }


# Types numpy lacks, by their name in ml_dtypes. That module is imported only when a program
# uses one of them: it costs a process 2.5 MiB resident, which an fp32 program need not carry
# (and no array can have such a dtype before something imports it).
_ML_DTYPES: dict[int, str] = {
    ScalarType.BFLOAT16: "bfloat16",
    ScalarType.FLOAT8_E5M2: "float8_e5m2",
    ScalarType.FLOAT8_E4M3FN: "float8_e4m3fn",
    ScalarType.FLOAT8_E5M2FNUZ: "float8_e5m2fnuz",
    ScalarType.FLOAT8_E4M3FNUZ: "float8_e4m3fnuz",
}
_ML_SCALAR_TYPES: dict[str, int] = {name: code for code, name in _ML_DTYPES.items()}

NUMPY_DTYPE: dict[int, np.dtype] = _numpy_dtypes()  # ml_dtypes' types join at their first use
# The inverse map prefers the plain types (int8 -> CHAR, not QINT8).
SCALAR_TYPE: dict[np.dtype, int] = {}
for _code, _dt in reversed(list(NUMPY_DTYPE.items())):
    SCALAR_TYPE[_dt] = _code
for _code in (ScalarType.BYTE, ScalarType.CHAR, ScalarType.INT, ScalarType.UINT16):
    SCALAR_TYPE[NUMPY_DTYPE[_code]] = _code


def numpy_dtype(scalar_type: int) -> np.dtype:
    """numpy dtype for a ScalarType code; KeyError for codes we do not support."""
    dtype = NUMPY_DTYPE.get(scalar_type)
    if dtype is None:
        import ml_dtypes

        dtype = NUMPY_DTYPE[scalar_type] = np.dtype(getattr(ml_dtypes, _ML_DTYPES[scalar_type]))
    return dtype


def scalar_type_of(dtype) -> int:
    dtype = np.dtype(dtype)
    code = SCALAR_TYPE.get(dtype)
    if code is None and dtype.type.__module__ == "ml_dtypes":
        code = _ML_SCALAR_TYPES.get(dtype.name)
    if code is None:
        raise KeyError(dtype)
    return code


class TensorShapeDynamism(IntEnum):
    STATIC = 0
    DYNAMIC_BOUND = 1
    DYNAMIC_UNBOUND = 2


class TensorDataLocation(IntEnum):
    SEGMENT = 0
    EXTERNAL = 1


class DataLocation(IntEnum):
    INLINE = 0
    SEGMENT = 1


# ---------------------------------------------------------------------------- values


@dataclass
class AllocationDetails:
    memory_id: int = 0
    memory_offset_low: int = 0
    memory_offset_high: int = 0

    @property
    def offset(self) -> int:
        return self.memory_offset_low | (self.memory_offset_high << 32)


@dataclass
class ExtraTensorInfo:
    mutable_data_segments_idx: int = 0
    fully_qualified_name: Optional[str] = None
    location: int = TensorDataLocation.SEGMENT
    device_type: int = 0
    device_index: int = 0


@dataclass
class Tensor:
    scalar_type: int = 0
    storage_offset: int = 0
    sizes: list[int] = field(default_factory=list)
    dim_order: list[int] = field(default_factory=list)
    requires_grad: bool = False
    data_buffer_idx: int = 0
    allocation_info: Optional[AllocationDetails] = None
    layout: int = 0
    shape_dynamism: int = TensorShapeDynamism.STATIC
    extra_tensor_info: Optional[ExtraTensorInfo] = None


@dataclass
class Null:
    pass


@dataclass
class Int:
    int_val: int = 0


@dataclass
class Bool:
    bool_val: bool = False


@dataclass
class Double:
    double_val: float = 0.0


@dataclass
class String:
    string_val: str = ""


@dataclass
class IntList:
    items: list[int] = field(default_factory=list)  # value indices of Int values


@dataclass
class DoubleList:
    items: list[float] = field(default_factory=list)


@dataclass
class BoolList:
    items: list[bool] = field(default_factory=list)


@dataclass
class TensorList:
    items: list[int] = field(default_factory=list)  # value indices of Tensor values


@dataclass
class OptionalTensorList:
    items: list[int] = field(default_factory=list)  # value indices, -1 = None


EValue = Union[
    Null, Int, Bool, Double, Tensor, String, IntList, DoubleList, BoolList, TensorList, OptionalTensorList
]
# The scalar EValues: the field that holds each one's value, and that value's Python type.
_SCALAR_FIELDS: dict[type, tuple[str, type]] = {
    Int: ("int_val", int), Double: ("double_val", float), Bool: ("bool_val", bool), String: ("string_val", str),
}


def is_scalar(value: object) -> bool:
    """Whether `value` is an Int, Double, Bool or String EValue (one Python scalar)."""
    return type(value) in _SCALAR_FIELDS


def scalar_value(value: EValue) -> Union[int, float, bool, str]:
    """The Python value an Int, Double, Bool or String holds, as a plain int/float/bool/str."""
    try:
        field_name, python_type = _SCALAR_FIELDS[type(value)]
    except KeyError:
        raise TypeError(f"{type(value).__name__} is not a scalar EValue") from None
    return python_type(getattr(value, field_name))


def scalar_evalue(x: object) -> Optional[EValue]:
    """The EValue holding a Python bool, int, float or str (Null for None); None for other types."""
    if x is None:
        return Null()
    if isinstance(x, bool):  # before int: a bool is an int to Python
        return Bool(x)
    if isinstance(x, int):
        return Int(x)
    if isinstance(x, float):
        return Double(x)
    if isinstance(x, str):
        return String(x)
    return None


# KernelTypes union tags, in schema order (tag 0 = NONE).
EVALUE_TAGS: dict[type, int] = {
    Null: 1, Int: 2, Bool: 3, Double: 4, Tensor: 5, String: 6, IntList: 7,
    DoubleList: 8, BoolList: 9, TensorList: 10, OptionalTensorList: 11,
}


# ---------------------------------------------------------------------------- instructions


@dataclass
class KernelCall:
    op_index: int = 0
    args: list[int] = field(default_factory=list)


@dataclass
class DelegateCall:
    delegate_index: int = 0
    args: list[int] = field(default_factory=list)


@dataclass
class MoveCall:
    move_from: int = 0
    move_to: int = 0


@dataclass
class JumpFalseCall:
    cond_value_index: int = 0
    destination_instruction: int = 0


@dataclass
class FreeCall:
    value_index: int = 0


Instruction = Union[KernelCall, DelegateCall, MoveCall, JumpFalseCall, FreeCall]
INSTRUCTION_TAGS: dict[type, int] = {
    KernelCall: 1, DelegateCall: 2, MoveCall: 3, JumpFalseCall: 4, FreeCall: 5,
}


# ---------------------------------------------------------------------------- plan


@dataclass
class Frame:
    filename: Optional[str] = None
    lineno: int = 0
    name: Optional[str] = None
    context: Optional[str] = None


@dataclass
class FrameList:
    items: list[Frame] = field(default_factory=list)


@dataclass
class Chain:
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    instructions: list[Instruction] = field(default_factory=list)
    stacktrace: Optional[list[FrameList]] = None


@dataclass
class Operator:
    name: str = ""
    overload: str = ""

    @property
    def key(self) -> str:
        """Kernel registry key: `aten::add.out`, or `aten::copy_` for the default overload."""
        return f"{self.name}.{self.overload}" if self.overload else self.name


@dataclass
class CompileSpec:
    key: str = ""
    value: bytes = b""


@dataclass
class BackendDelegateDataReference:
    location: int = DataLocation.INLINE
    index: int = 0


@dataclass
class BackendDelegate:
    id: str = ""
    processed: BackendDelegateDataReference = field(default_factory=BackendDelegateDataReference)
    compile_specs: list[CompileSpec] = field(default_factory=list)


@dataclass
class ContainerMetadata:
    encoded_inp_str: str = ""
    encoded_out_str: str = ""


@dataclass
class NonConstBufferDevice:
    buffer_idx: int = 0
    device_type: int = 0
    device_index: int = 0


@dataclass
class ExecutionPlan:
    name: str = ""
    container_meta_type: ContainerMetadata = field(default_factory=ContainerMetadata)
    values: list[EValue] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    chains: list[Chain] = field(default_factory=list)
    operators: list[Operator] = field(default_factory=list)
    delegates: list[BackendDelegate] = field(default_factory=list)
    non_const_buffer_sizes: list[int] = field(default_factory=list)
    non_const_buffer_device: Optional[list[NonConstBufferDevice]] = None

    @property
    def instructions(self) -> list[Instruction]:
        """The instructions of the plan's first chain (the only one a runtime runs), or none."""
        return self.chains[0].instructions if self.chains else []


# ---------------------------------------------------------------------------- program


@dataclass
class DataSegment:
    offset: int = 0
    size: int = 0


@dataclass
class SubsegmentOffsets:
    segment_index: int = 0
    offsets: list[int] = field(default_factory=list)


@dataclass
class NamedData:
    key: str = ""
    segment_index: int = 0


@dataclass
class Program:
    version: int = 0
    execution_plan: list[ExecutionPlan] = field(default_factory=list)
    # Legacy inline constants (Buffer.storage); entry 0 reserved. Bytes-like.
    constant_buffer: list[bytes] = field(default_factory=list)
    # Inline delegate payloads (BackendDelegateInlineData.data). Bytes-like.
    backend_delegate_data: list[bytes] = field(default_factory=list)
    segments: list[DataSegment] = field(default_factory=list)
    constant_segment: Optional[SubsegmentOffsets] = None
    mutable_data_segments: Optional[list[SubsegmentOffsets]] = None
    named_data: Optional[list[NamedData]] = None
