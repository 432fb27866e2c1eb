"""Quantised weight formats. A QTensor is data + scale + format; `linear` dispatches on it.

Legend: N output features, K input features.
"""

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

FP8_BLOCK = "fp8_block"  # float8_e4m3fn data, fp32 scale per 128x128 block, W = q * scale


@dataclass(frozen=True)
class QTensor:
    data: torch.Tensor  # quantised values, the logical weight's shape (e.g. [N, K] fp8)
    scale: torch.Tensor  # fp32 multipliers, one per block (e.g. [ceil(N/128), ceil(K/128)])
    fmt: str  # one of the format names above

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


pytree.register_pytree_node(
    QTensor,
    lambda q: ((q.data, q.scale), q.fmt),
    lambda children, fmt: QTensor(children[0], children[1], fmt),
)
