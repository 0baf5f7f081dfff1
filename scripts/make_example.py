"""Regenerate execupy/examples/mlp.pte, the small program the README's first command runs.

    .venv/bin/python scripts/make_example.py

It is written by our own exporter (torch needed here only; running it needs numpy).
"""
from pathlib import Path

import torch
from torch.export import export

from execupy.exir import to_edge


class TinyClassifier(torch.nn.Module):
    """A 2-layer MLP with layer norm and softmax: enough ops to show a real plan."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        return torch.softmax(self.fc2(torch.relu(self.fc1(self.norm(x)))), dim=-1)


def main() -> None:
    torch.manual_seed(0)
    model = TinyClassifier().eval()
    program = to_edge(export(model, (torch.randn(4, 16),))).to_executorch()
    out = Path(__file__).resolve().parents[1] / "execupy" / "examples" / "mlp.pte"
    program.save(str(out))
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
