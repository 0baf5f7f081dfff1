"""BLAS threads by product size (execupy/runtime/blas_threads.py): a product with a few rows
(an LLM's decode) runs on one thread, a large one on the threads BLAS had, and every call of
a method leaves BLAS as it found it."""
import numpy as np
import pytest

from execupy.kernels.portable import linalg
from execupy.runtime import Module, blas_threads


@pytest.fixture
def product_threads(monkeypatch) -> list:
    """The BLAS threads in force at each np.matmul a kernel makes."""
    if blas_threads.default_threads() is None:
        pytest.skip("numpy's BLAS is not an OpenBLAS that execupy steers")
    seen = []
    matmul = np.matmul

    def spy(*args, **kwargs):
        seen.append(blas_threads.threads())
        return matmul(*args, **kwargs)

    monkeypatch.setattr(linalg.np, "matmul", spy)
    return seen


def export_linear(tmp_path, rows: int):
    torch = pytest.importorskip("torch")
    from torch.export import export

    from execupy.exir import to_edge

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 256).eval()
    pte = tmp_path / f"linear{rows}.pte"
    pte.write_bytes(to_edge(export(model, (torch.randn(rows, 64),))).to_executorch().buffer)
    return model, pte


@pytest.mark.parametrize("rows", [1, 64])
def test_a_mat_vec_runs_on_one_thread_and_the_call_restores_blas(rows, product_threads, tmp_path):
    torch = pytest.importorskip("torch")
    model, pte = export_linear(tmp_path, rows)
    x = np.random.default_rng(0).standard_normal((rows, 64), dtype=np.float32)
    out = Module(pte).forward(x)
    np.testing.assert_allclose(out, model(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-5)
    expected = 1 if rows < blas_threads.ONE_THREAD_ROWS else blas_threads.default_threads()
    assert product_threads and set(product_threads) == {expected}
    assert blas_threads.threads() == blas_threads.default_threads()
