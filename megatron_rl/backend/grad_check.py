"""Whether gradient buffers are finite, checked in chunks so the check costs no buffer copy.

``torch.isfinite(x).all()`` over a whole fp32 buffer holds ``|x|`` in fp32 and three bool
tensors at once, 7 bytes per element: 47 GiB per GPU for the 235B launcher's gradient buffer.
Checked ``GRAD_CHECK_CHUNK_ELEMENTS`` at a time it is 7 x 2^26 bytes = 0.44 GiB, with one
host sync per buffer (the per-chunk results are combined on the device).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

GRAD_CHECK_CHUNK_ELEMENTS = 1 << 26


def all_finite(tensors: Iterable[torch.Tensor], chunk: int = GRAD_CHECK_CHUNK_ELEMENTS) -> bool:
    """True when every element of every tensor is finite (no NaN, no +-Inf)."""
    for tensor in tensors:
        flat = tensor.reshape(-1)
        finite = torch.ones((), dtype=torch.bool, device=flat.device)
        for start in range(0, flat.numel(), chunk):
            finite &= torch.isfinite(flat[start : start + chunk]).all()
        if not bool(finite):
            return False
    return True
