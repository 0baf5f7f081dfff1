"""NumpyFusedBackend: a small delegate that runs float32 linear/matmul/elementwise/view
subgraphs as one fused numpy function.

`aot.py` (torch side) holds the partitioner and the payload writer; import it
to export. `runtime.py` (no torch) parses the payload; importing this package registers
it with the runtime.
"""
from ...runtime.backends import register_backend
from .runtime import BACKEND_ID, NumpyFusedBackend

register_backend(BACKEND_ID, NumpyFusedBackend())

__all__ = ["BACKEND_ID", "NumpyFusedBackend"]
