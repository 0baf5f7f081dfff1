"""Python's cycle collector is paused while a program loads and while a method binds a shape plan
(execupy/runtime/collector.py), and left as the caller had it."""
import gc

import numpy as np
import pytest

from execupy.runtime import Program
from execupy.runtime.method import Method


@pytest.fixture(scope="module")
def dynamic_linear(tmp_path_factory):
    """A linear over any number of rows: a program with shape plans."""
    torch = pytest.importorskip("torch")
    from torch.export import Dim, export

    from execupy.exir import to_edge

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).eval()
    program = export(model, (torch.randn(3, 16),), dynamic_shapes=({0: Dim("rows", max=64)},))
    pte = tmp_path_factory.mktemp("collector") / "linear.pte"
    pte.write_bytes(to_edge(program).to_executorch().buffer)
    return pte


def test_a_call_that_binds_a_shape_plan_pauses_the_collector_and_a_planned_call_does_not(dynamic_linear,
                                                                                           monkeypatch):
    states = []
    run = Method._run

    def spy(self, *args):
        states.append(gc.isenabled())
        return run(self, *args)

    monkeypatch.setattr(Method, "_run", spy)
    method = Program.load(dynamic_linear).load_method("forward")
    x = np.ones((5, 16), np.float32)
    first = method.execute([x])[0]
    for _ in range(3):
        np.testing.assert_array_equal(method.execute([x])[0], first)
    assert method.planned_shapes == [((5, 16),)]
    unplanned = states.count(False)  # the calls before the plan was bound (the last of them binds it)
    assert unplanned >= 1 and states == [False] * unplanned + [True] * (4 - unplanned) and states[-1]
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(dynamic_linear):
    gc.disable()
    try:
        method = Program.load(dynamic_linear).load_method("forward")
        method.execute([np.ones((5, 16), np.float32)])
        assert not gc.isenabled()
    finally:
        gc.enable()
