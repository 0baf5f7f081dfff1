"""BLAS threads by product size (execupy/runtime/blas_threads.py): a product with a few rows
(an LLM's decode) runs on one thread first, then on BLAS's threads while two threads are not
slower than one was; a large one on BLAS's threads, or, an `out = a @ b` of many rows, in two
halves on two threads with BLAS on one thread each; every call of a method leaves BLAS as it
found it."""
import mmap
import time

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
def test_a_mat_vec_starts_on_one_thread_and_the_call_restores_blas(rows, product_threads, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from execupy.kernels import cores

    monkeypatch.setattr(cores, "SECOND_CORE", cores.SecondCore())  # no back-off left by other tests
    monkeypatch.setattr(blas_threads, "SECOND_CORE", cores.SECOND_CORE)
    model, pte = export_linear(tmp_path, rows)
    x = np.random.default_rng(0).standard_normal((rows, 64), dtype=np.float32)
    m = Module(pte)
    out = m.forward(x)
    np.testing.assert_allclose(out, model(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-5)
    default = blas_threads.default_threads()
    if rows < blas_threads.SMALL_ROWS:
        assert product_threads == [1]  # timed on one thread: the time two threads must beat
        cores.SECOND_CORE.serial_until = float("inf")  # as after a two-thread call that stalled
        m.forward(x)
        assert product_threads == [1, 1]
        cores.SECOND_CORE.serial_until = 0.0
        m.forward(x)
        assert product_threads == [1, 1, default]
        # where our second thread takes the large mat-vecs, OpenBLAS's worker is never woken for a
        # small one (it would spin beside ours for ~0.1 s)
        cores.SECOND_CORE.own_thread = True
        m.forward(x)
        assert product_threads == [1, 1, default, 1]
    else:
        assert product_threads == [default]
    assert blas_threads.threads() == default


def test_a_prompts_product_runs_in_halves_while_the_other_core_is_busy(monkeypatch):
    """A large product runs on BLAS's threads, timed; while the rule of kernels/cores.py says
    the other core is busy it splits a's rows between this thread and a worker, BLAS on one
    thread in each (OpenBLAS's own threads spin waiting for each other, which stalls)."""
    if blas_threads.default_threads() is None or blas_threads.default_threads() < 2:
        pytest.skip("needs numpy's OpenBLAS on two or more threads")
    import threading

    from execupy.kernels import cores
    from execupy.kernels.cores import CallSite

    monkeypatch.setattr(blas_threads, "SECOND_CORE", cores.SecondCore())
    monkeypatch.setattr(blas_threads, "_FASTEST", [0.0])
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((300, 64), dtype=np.float32), rng.standard_normal((64, 40), dtype=np.float32)
    want = a @ b
    seen = []

    def halves_seen(*args, **kwargs):
        seen.append((threading.current_thread().name.startswith("execupy-blas"), blas_threads.threads()))
        return np.matmul(*args, **kwargs)

    monkeypatch.setattr(blas_threads, "in_halves", lambda a, b, out: blas_threads.both(
        lambda: halves_seen(a[:150], b, out=out[:150]), lambda: halves_seen(a[150:], b, out=out[150:])) or out)
    out = np.empty((300, 40), np.float32)
    assert blas_threads.product(CallSite(), 40, np.matmul, a, b, out=out) is out
    assert seen == [] and blas_threads._FASTEST[0] > 0  # whole, on BLAS's threads, and timed
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-5)
    blas_threads.SECOND_CORE.serial_until = float("inf")  # as after stalls: the other core is busy
    out[:] = 0
    assert blas_threads.product(CallSite(), 40, np.matmul, a, b, out=out) is out
    assert sorted(seen) == [(False, 1), (True, 1)]  # one half here, one on the worker, one BLAS thread each
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-5)
    monkeypatch.undo()
    monkeypatch.setattr(blas_threads.SECOND_CORE, "serial_until", float("inf"))
    monkeypatch.setattr(blas_threads, "_FASTEST", [1.0])
    # the real halves, and the portable mm kernel whose out is a dynamic tensor's larger
    # planned storage: a new array, as the kernel returns one
    planned = np.empty((400, 40), np.float32)
    result = blas_threads.product(CallSite(), 40, linalg.mm, a, b, planned)
    assert result.shape == (300, 40) and result is not planned
    np.testing.assert_allclose(result, want, rtol=1e-6, atol=1e-5)
    blas_threads.restore()


def test_a_large_product_many_times_slower_than_the_fastest_counts_as_a_stall(monkeypatch):
    if blas_threads.default_threads() is None or blas_threads.default_threads() < 2:
        pytest.skip("needs numpy's OpenBLAS on two or more threads")
    from execupy.kernels import cores

    monkeypatch.setattr(blas_threads, "SECOND_CORE", cores.SecondCore())
    monkeypatch.setattr(blas_threads, "_FASTEST", [1e15])  # as if a product had run at a petaflop
    halves = []

    def slow_product():  # 6 ms: a stall that loses enough time to count in full
        time.sleep(0.006)
        return np.ones((64, 64)) @ np.ones((64, 64))

    calls = 0
    while not halves and calls < 20:  # stalls until they lost SecondCore.LOST_S (20 ms), then the halves
        blas_threads.large(1e6, slow_product, lambda: halves.append(1))
        calls += 1
    assert halves == [1] and 6 <= calls < 20  # each stall counts at most 5 ms: five or more of them
    blas_threads.restore()


def test_a_large_product_that_faults_in_pages_is_not_timed(monkeypatch):
    """A program's first prompt reads its memory-mapped weights for the first time: slow for a
    reason that is not the other core, so it neither counts as a stall nor sets the pace."""
    if blas_threads.default_threads() is None or blas_threads.default_threads() < 2:
        pytest.skip("needs numpy's OpenBLAS on two or more threads")
    from execupy.kernels import cores

    monkeypatch.setattr(blas_threads, "SECOND_CORE", cores.SecondCore())
    monkeypatch.setattr(blas_threads, "_FASTEST", [1e15])  # every product would be a stall

    def first_touch():  # 4 MiB of fresh pages (a new mapping each time), then a product
        with mmap.mmap(-1, 4 << 20) as fresh:
            np.frombuffer(fresh, np.uint8)[::4096] = 1
        time.sleep(0.006)
        return np.ones((64, 64)) @ np.ones((64, 64))

    for _ in range(8):
        blas_threads.large(1e6, first_touch, lambda: pytest.fail("the halves ran: faults counted as stalls"))
    assert blas_threads.SECOND_CORE.lost_s == 0.0 and blas_threads._FASTEST == [1e15]
    blas_threads.restore()


def test_a_float32_decode_linear_shares_its_rows_with_the_second_core(tmp_path, monkeypatch):
    """A weight-first mat-vec (W @ x^T, as export-llm writes a float linear) of a large weight
    runs on the second core's thread with half of W's rows (kernels/fast/dense.py), not on BLAS."""
    torch = pytest.importorskip("torch")
    from torch.export import export

    from execupy.exir import to_edge
    from execupy.kernels.fast import dense

    real = dense.matvec_kernel()
    if real is None:
        pytest.skip("needs the `fast` extra (numba)")

    class WeightFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(768, 512))

        def forward(self, x):
            return (self.weight @ x.transpose(0, 1)).transpose(0, 1)

    model = WeightFirst().eval()
    pte = tmp_path / "weight_first.pte"
    pte.write_bytes(to_edge(export(model, (torch.randn(1, 512),))).to_executorch().buffer)
    shapes = []
    monkeypatch.setattr(dense, "_LOADED", [lambda site, w, x, out: (shapes.append(w.shape), real(site, w, x, out))])
    m = Module(pte)
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, 512), dtype=np.float32)
        np.testing.assert_allclose(m.forward(x), model(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-4)
    assert shapes and set(shapes) == {(768, 512)}


def test_execupy_imported_first_shortens_openblass_spin_unless_the_user_set_it():
    """execupy/__init__.py: set before numpy loads OpenBLAS, so that its idle threads stop spinning
    a fraction of a millisecond after an attention's or a prompt's products, not ~0.1 s into the
    compiled kernels' threads that run next. The command line imports execupy first."""
    import os
    import subprocess
    import sys

    show = "import os, {} ; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}

    def seen(imports: str, **extra: str) -> str:
        return subprocess.run([sys.executable, "-c", show.format(imports)], env={**env, **extra}, capture_output=True,
                              text=True, check=True).stdout.strip()

    assert seen("execupy.cli") == seen("execupy.runtime") == "20"
    assert seen("execupy", OPENBLAS_THREAD_TIMEOUT="28") == "28"
    assert seen("numpy, execupy") == "None"  # too late to matter: left alone
