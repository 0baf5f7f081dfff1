"""Embedding lookup: rows of a weight table gathered by integer indices."""
from __future__ import annotations

import numpy as np

from ..registry import register_kernel
from ._util import write


@register_kernel("aten::embedding.out")
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False, out=None):
    # padding_idx and the gradient flags only matter for training.
    idx = np.asarray(indices)
    if idx.size and (idx.min() < 0 or idx.max() >= weight.shape[0]):
        raise IndexError(f"embedding index out of range [0, {weight.shape[0]})")
    shape = idx.shape + weight.shape[1:]
    if shape == out.shape and out.dtype == weight.dtype:
        np.take(weight, idx, axis=0, out=out)
        return out
    return write(out, np.take(weight, idx, axis=0))
