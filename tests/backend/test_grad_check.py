"""The chunked finiteness check of the gradient buffers."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.backend.grad_check import all_finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_bad_value_in_any_chunk_of_any_buffer_is_found(bad):
    buffers = [torch.zeros(10), torch.zeros(25)]
    assert all_finite(buffers, chunk=4)
    for index in (0, 23, 24):  # first chunk, the short last chunk, its last element
        buffers[1][index] = bad
        assert not all_finite(buffers, chunk=4)
        buffers[1][index] = 0.0
    assert all_finite([torch.zeros(0)], chunk=4)
