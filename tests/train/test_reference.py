"""The KL reference: its weights visit the compute device only inside ``resident()``.

No GPU here: a module whose ``to`` records its calls instead of moving stands in for the model
(the trainer's end-to-end KL run on CPU is in test_trainer_e2e.py).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.train.reference import ReferencePolicy


class RecordingModule(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.moves: list[str] = []

    def to(self, device, *args, **kwargs):  # records, does not move
        self.moves.append(str(torch.device(device)))
        return self


def test_offloaded_weights_visit_the_device_only_while_resident():
    module = RecordingModule()
    reference = ReferencePolicy(module, torch.device("cuda", 0), offload=True)
    assert module.moves == ["cpu"] and not module.training
    assert not any(p.requires_grad for p in module.parameters())
    with pytest.raises(RuntimeError, match="offloaded"):
        reference.logprobs([], 1.0)
    with reference.resident():
        assert module.moves == ["cpu", "cuda:0"]
    assert module.moves == ["cpu", "cuda:0", "cpu"]


def test_on_the_cpu_or_without_offload_nothing_moves():
    module = RecordingModule()
    with ReferencePolicy(module, torch.device("cpu"), offload=True).resident():
        pass
    with ReferencePolicy(module, torch.device("cuda", 0), offload=False).resident():
        pass
    assert module.moves == []
