"""The backend registry: delegate runtimes keyed by the id a program names (`XnnpackBackend`, ...).

A backend is an object with `is_available()`, `init(processed, compile_specs, context)`
(once per method load) and `execute(handle, args)` (once per call), and optionally
`bind(handle, args)`: a call without arguments for args that stay the same arrays (a shape
plan's, bound once; None declines). Backends live above
the runtime (`execupy/backends/<name>/`), so the runtime never imports one by module:
each registers itself with `register_backend` when imported, and the built-in ones are
listed here by module name, imported the first time a program asks for a backend.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Optional, Protocol

# Built-in backends: id -> the module whose import registers it.
BUILTIN_BACKENDS: dict[str, str] = {
    "NumpyFusedBackend": "execupy.backends.numpy_fused",
    "XnnpackBackend": "execupy.backends.xnnpack",
}


class Backend(Protocol):
    """A delegate runtime. `init` runs once per method load, `execute` per call."""

    def is_available(self) -> bool: ...

    def init(self, processed: memoryview, compile_specs: list, context: "BackendContext") -> Any: ...

    def execute(self, handle: Any, args: list) -> Optional[list]:
        """`args` are the DelegateCall's values (inputs, then outputs). Return the outputs
        (they are stored into the trailing output slots) or None after writing them in place."""
        ...


class BackendContext:
    """What a backend may ask of the program at init time. `event_tracer` is the method's
    EventTracer when it is traced (None otherwise): a backend that can time its own steps
    reports them with `event_tracer.log_delegate_event(debug_id, start_ns, end_ns, name)`."""

    def __init__(self, named_data: Callable[[str], memoryview], event_tracer: Any = None):
        self.named_data = named_data
        self.event_tracer = event_tracer


BACKENDS: dict[str, Backend] = {}


def register_backend(backend_id: str, backend: Backend) -> None:
    BACKENDS[backend_id] = backend


def get_backend(backend_id: str) -> Optional[Backend]:
    if backend_id not in BACKENDS and backend_id in BUILTIN_BACKENDS:
        importlib.import_module(BUILTIN_BACKENDS[backend_id])
    return BACKENDS.get(backend_id)


def backend_names() -> list[str]:
    """Every backend this runtime can run: the registered ones and the built-in ones."""
    return sorted(set(BACKENDS) | set(BUILTIN_BACKENDS))
