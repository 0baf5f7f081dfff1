"""The torch-free runtime: load a .pte and execute its methods."""
from .method import Method  # noqa: F401
from .module import Module, unflatten  # noqa: F401
from .program import MethodMeta, Program, ScalarInfo, TensorInfo  # noqa: F401
from .registry import (  # noqa: F401
    BackendContext,
    get_backend,
    get_kernel,
    kernel_names,
    register_backend,
    register_kernel,
)
