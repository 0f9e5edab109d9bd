"""This process's own device bytes by NVML: the PID's entries summed, None (never a guess) where
NVML cannot say. The NVML query itself needs a GPU; here it runs against the real pynvml module
without a driver (its failure path), and the sum against NVML-shaped entries."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_rl.train import process_memory


def _entry(pid, used):
    return SimpleNamespace(pid=pid, usedGpuMemory=used)  # nvmlProcessInfo's two fields read


def test_the_pids_entries_are_summed_and_other_processes_left_out():
    entries = [_entry(7, 100), _entry(8, 5000), _entry(7, 20)]  # e.g. two contexts of one PID
    assert process_memory.bytes_of_pid(entries, 7) == 120
    assert process_memory.bytes_of_pid(entries, 8) == 5000


def test_an_unlisted_pid_or_withheld_bytes_give_none_not_zero():
    assert process_memory.bytes_of_pid([_entry(8, 5000)], 7) is None  # another PID namespace
    assert process_memory.bytes_of_pid([_entry(7, None), _entry(7, 10)], 7) is None  # MIG/vGPU


def test_off_cuda_there_is_nothing_to_report():
    assert process_memory.process_device_bytes(torch.device("cpu")) is None


def test_without_a_driver_nvml_fails_into_none_and_one_log_line(caplog):
    caplog.set_level("INFO", logger="megatron_rl.train.process_memory")
    process_memory._WARNED.clear()
    for _ in range(2):
        assert process_memory.process_device_bytes(torch.device("cuda", 0)) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "device memory is not reported" in lines[0], lines
