"""`destroy_distributed` frees a trained model and its process groups, with gloo's threads.

megatron-core's DDP, its MoE token dispatcher and its rotary-embedding cache keep a model (and
the ~20 gloo groups it holds, two threads each) alive after the groups are destroyed. Idle, each
group costs ~0.15% of a core; a test worker that leaked them for every trainer test ran 1,500
threads and burned most of a core on them.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
from megatron_rl.model import build_model, causal_lm_logits, preset_config

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def _gloo_threads() -> int:
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() in ("gloo_tcp_loop", "pt_gloo_runloop")
        except OSError:  # the thread ended while listed
            pass
    return count


def _train_a_tiny_model(tmp_path, run: int) -> weakref.ref:
    init_distributed(ParallelConfig(seed=run), init_method=f"file://{tmp_path}/rdzv{run}")
    config = preset_config("tiny")
    model = wrap_for_training(build_model(config))
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3))
    tokens_BT = torch.randint(0, config.vocab_size, (2, 9))
    optimizer.zero_grad()
    logits_BTV = causal_lm_logits(model, tokens_BT[:, :-1])
    F.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten()).backward()
    optimizer.step()
    return weakref.ref(model)


def test_a_trained_model_and_its_gloo_threads_end_with_destroy_distributed(tmp_path):
    destroy_distributed()
    before = _gloo_threads()
    for run in range(2):
        model = _train_a_tiny_model(tmp_path, run)
        assert model() is not None and _gloo_threads() > before + 20
        destroy_distributed()
        assert model() is None, "the model outlived destroy_distributed"
        assert _gloo_threads() == before, f"run {run}: gloo threads {_gloo_threads()} != {before}"
