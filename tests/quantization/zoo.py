"""Small float models for the pt2e int8 tests: each exercises some ops the quantizer
annotates (linear, conv1d/conv2d with batch norm, depthwise conv, add, mul, cat, pooling,
relu/hardtanh). Every model ends in (or contains) a linear layer, so the dynamic config,
which quantizes linears only, changes every one of them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


def conv_bn_relu(cin: int, cout: int, k: int = 3, groups: int = 1, act: nn.Module | None = None) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout),
                         act or nn.ReLU())


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Hardtanh(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


class CNNBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(conv_bn_relu(3, 8), nn.MaxPool2d(2), conv_bn_relu(8, 16), nn.MaxPool2d(2))
        self.head = nn.Linear(16 * 2 * 2, 5)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class DepthwiseSeparable(nn.Module):
    """MobileNet's block: depthwise 3x3 + pointwise 1x1, ReLU6 (a hardtanh), global pool."""

    def __init__(self):
        super().__init__()
        self.stem = conv_bn_relu(3, 8, act=nn.ReLU6())
        self.depthwise = conv_bn_relu(8, 8, groups=8, act=nn.ReLU6())
        self.pointwise = conv_bn_relu(8, 16, k=1, act=nn.ReLU6())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.pointwise(self.depthwise(self.stem(x)))
        return self.head(torch.flatten(self.pool(x), 1))


class ResidualBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn_relu(3, 8)
        self.conv1 = conv_bn_relu(8, 8)
        self.conv2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.conv2(self.conv1(x)) + x)
        return self.head(torch.flatten(self.pool(x), 1))


class EncoderLayer(nn.Module):
    """A pre-norm transformer encoder layer: attention (linears around softmax) and an MLP."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class AudioConv1d(nn.Module):
    """Keyword-spotting style: strided conv1d + batch norm over a waveform, mean over time."""

    def __init__(self):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv1d(1, 8, 9, stride=4), nn.BatchNorm1d(8), nn.ReLU(),
            nn.Conv1d(8, 16, 5, stride=2), nn.BatchNorm1d(16), nn.ReLU(),
            nn.MaxPool1d(2))
        self.head = nn.Linear(16, 6)

    def forward(self, wave):
        return self.head(self.convs(wave).mean(dim=-1))


class CatPoolHardtanh(nn.Module):
    """Inception-like: two conv branches concatenated, hardtanh, max and average pooling."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 3, padding=1)
        self.clamp = nn.Hardtanh(-1.0, 1.0)
        self.maxpool, self.avgpool = nn.MaxPool2d(2), nn.AvgPool2d(2)
        self.head = nn.Linear(8 * 2 * 2, 4)

    def forward(self, x):
        x = self.clamp(torch.cat([self.a(x), self.b(x)], dim=1))
        return self.head(torch.flatten(self.avgpool(self.maxpool(x)), 1))


class AddMulBranches(nn.Module):
    """Two linear branches multiplied, a third added, then a fused add + relu."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(12, 16), nn.Linear(12, 16), nn.Linear(12, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        y = self.a(x) * self.b(x) + self.c(x)
        return self.out(torch.relu(y + self.c(x)))


class GatedConv(nn.Module):
    """A conv whose output is gated by a sigmoid branch (mul), with a residual add."""

    def __init__(self):
        super().__init__()
        self.conv, self.gate = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        y = self.conv(x) * torch.sigmoid(self.gate(x)) + x
        return self.head(y.mean(dim=(2, 3)))


class LeNet(nn.Module):
    """LeNet-5 shape, ReLU6 activations and average pooling."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 4, 5), nn.Conv2d(4, 8, 5)
        self.pool = nn.AvgPool2d(2)
        self.fc1, self.fc2 = nn.Linear(8 * 4 * 4, 24), nn.Linear(24, 10)
        self.act = nn.ReLU6()

    def forward(self, x):
        x = self.pool(self.act(self.c1(x)))
        x = self.pool(self.act(self.c2(x)))
        return self.fc2(self.act(self.fc1(torch.flatten(x, 1))))


@dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]


MODELS = [
    Model("mlp", MLP, (4, 16)),
    Model("cnn_batchnorm", CNNBatchNorm, (2, 3, 8, 8)),
    Model("depthwise_separable", DepthwiseSeparable, (2, 3, 8, 8)),
    Model("residual_block", ResidualBlock, (2, 3, 8, 8)),
    Model("transformer_encoder", EncoderLayer, (2, 6, 16)),
    Model("audio_conv1d", AudioConv1d, (2, 1, 128)),
    Model("cat_pool_hardtanh", CatPoolHardtanh, (2, 3, 8, 8)),
    Model("add_mul_branches", AddMulBranches, (4, 12)),
    Model("gated_conv", GatedConv, (2, 4, 6, 6)),
    Model("lenet", LeNet, (2, 1, 28, 28)),
]


def randomize_batch_norms(model: nn.Module) -> None:
    """Give batch norms statistics other than the identity, so folding them matters."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)


def build(model: Model, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = model.build()
    with torch.no_grad():
        randomize_batch_norms(m)
    return m.eval()
