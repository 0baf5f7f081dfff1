"""The torch side of the LLM path: models, the llama:: custom-op definitions, the Meta
checkpoint reader (.pth needs torch) and the export manager that writes the .pte.

Everything else under `execupy/llm/` is torch-free and runs on the device.
"""
from .manager import (  # noqa: F401
    SUPPORTED_DTYPES,
    ExportResult,
    LLMExportManager,
    export_llm,
    tokenizer_path_for,
)
