"""`build_model` leaves every parameter and buffer on the compute device, or says which is not."""

import pytest
import torch

from megatron_rl.model.builder import check_placement


def test_a_tensor_off_the_compute_device_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.RMSNorm(2, device="meta"))
    with pytest.raises(RuntimeError, match=r"1 model tensors .* 1\.weight \(meta\)"):
        check_placement(model, torch.device("cpu"))


def test_buffers_are_checked_too():
    model = torch.nn.BatchNorm1d(2)
    model.running_mean = model.running_mean.to("meta")
    with pytest.raises(RuntimeError, match="running_mean"):
        check_placement(model, torch.device("cpu"))


def test_a_module_on_the_device_passes():
    check_placement(torch.nn.Linear(2, 2), torch.device("cpu"))
