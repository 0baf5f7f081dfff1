"""Torch half of XnnpackBackend: the partitioner and the payload writer (see partitioner.py)."""
from .partitioner import XnnpackBackendDetails, XnnpackPartitioner  # noqa: F401
