"""Delegate backends. Each backend's runtime half registers itself here when imported."""

from . import numpy_fused  # noqa: F401,E402  (registers NumpyFusedBackend)
