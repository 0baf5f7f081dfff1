"""A wrong gelu kernel, off by 1e-2 everywhere: the bug `execupy debug` has to find.

A kernel list (EXECUPY_KERNELS) that names this module for aten::gelu.out makes the runtime
import it after the built-in kernels, and its registration replaces the right one.
"""
import numpy as np

from execupy.kernels.portable.activation import gelu as right_gelu
from execupy.kernels.registry import register_kernel


@register_kernel("aten::gelu.out", override=True)
def planted_gelu(x, approximate, out):
    result = right_gelu(x, approximate, out)
    np.add(result, np.float32(1e-2), out=result)
    return result
