"""A small model of twenty operators, exported with its ETRecord, for the Inspector and `execupy debug`.

    pte, etrecord = export_twenty_ops(tmp_path)

The gelu in the middle is the operator tests plant a wrong kernel for (planted_gelu.py).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.export import export

from execupy.exir import to_edge
from execupy.exir.etrecord import generate_etrecord

INPUT_SHAPE = (2, 16)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x)) + x)


class TwentyOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = Block()
        self.mid = nn.Linear(16, 16)
        self.second = Block()
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        x = self.first(x) * 0.5
        x = torch.nn.functional.gelu(self.mid(x))  # the operator a test breaks on purpose
        x = self.second(x - x.mean(dim=-1, keepdim=True))
        return torch.softmax(self.head(torch.tanh(x)), dim=-1) + torch.sigmoid(x).sum(dim=-1, keepdim=True)


def export_twenty_ops(folder: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    model = TwentyOps().eval()
    ep = export(model, (torch.randn(*INPUT_SHAPE),))
    edge = to_edge(ep)
    prog = edge.to_executorch()
    pte, etrecord = folder / "twenty.pte", folder / "twenty.etrecord"
    prog.save(pte)
    generate_etrecord(etrecord, edge, prog, exported_program=ep)
    return pte, etrecord
