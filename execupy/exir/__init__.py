"""Ahead-of-time compiler: capture, edge dialect, passes, memory planning, emit (needs torch).

    from torch.export import export
    from execupy.exir import to_edge
    prog = to_edge(export(model, (x,))).to_executorch()
    prog.save("model.pte")
"""
from . import quantized_ops  # noqa: F401  (out variants of quantized_decomposed ops)
from .edge import EdgeCompileConfig  # noqa: F401
from .program import (  # noqa: F401
    EdgeProgramManager,
    ExecutorchBackendConfig,
    ExecutorchProgramManager,
    to_edge,
    to_edge_transform_and_lower,
)
from .backend import (  # noqa: F401
    BackendDetails,
    DelegationSpec,
    LoweredBackendModule,
    PartitionResult,
    Partitioner,
    PreprocessResult,
    to_backend,
)
