"""XnnpackBackend: runs the delegate payloads ExecuTorch's XNNPACK partitioner writes, in numpy.

`schema.py` reads the payload (header + XNNGraph flatbuffer), `nodes.py` is the table of
node types, `quant.py` XNNPACK's quantization arithmetic and `runtime.py` the backend
itself. Importing this package registers it with the runtime. No torch.
"""
from ...runtime.backends import register_backend
from .runtime import BACKEND_ID, XnnpackBackend

register_backend(BACKEND_ID, XnnpackBackend())

__all__ = ["BACKEND_ID", "XnnpackBackend"]
