"""The README's first command: the shipped example program runs through the CLI."""
import subprocess
import sys
from pathlib import Path

import numpy as np

from execupy.runtime import Module

EXAMPLE = Path(__file__).resolve().parents[1] / "execupy" / "examples" / "mlp.pte"


def test_example_runs_from_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "execupy", "run", str(EXAMPLE), "--random-inputs", "--repeat", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "output 0: float32 [4, 10]" in result.stdout
    assert "execute: 3 run(s)" in result.stdout


def test_example_outputs_are_probabilities():
    probs = Module(EXAMPLE).forward(np.random.default_rng(0).standard_normal((4, 16), dtype=np.float32))
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-5)
    assert (probs > 0).all()
