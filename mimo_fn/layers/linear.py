"""linear(x, w): y = x @ w.T for plain weights; QTensor weights dispatch on their format."""

import torch.nn.functional as F

from mimo_fn.quant import QTensor


def linear(x, w):
    if isinstance(w, QTensor):
        raise ValueError(f"linear: QTensor format {w.fmt!r} is not supported yet")
    return F.linear(x, w)
