"""The torch-free runtime: load a .pte and execute its methods."""
from .method import Method  # noqa: F401
from .module import Module, unflatten  # noqa: F401
from .program import MethodMeta, Program, ScalarInfo, TensorInfo  # noqa: F401
from ..kernels.registry import get_kernel, kernel_names, register_kernel  # noqa: F401
from .backends import BackendContext, get_backend, register_backend  # noqa: F401
