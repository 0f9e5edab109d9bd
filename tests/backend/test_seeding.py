"""Two fresh processes of one run build identical weights, whatever ran before them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# One fresh process: the CPU generator is disturbed first (as an import or a data loader may),
# and megatron's model-parallel seeding is made a no-op for the CPU generator, as it is on a GPU
# (it seeds the CUDA generators only; on CPU this project's backend routes it to the CPU one).
# Then init_distributed + build_model, and the routers' and an embedding's checksums are printed.
BUILD = """
import sys, torch
from megatron.core import tensor_parallel
torch.manual_seed(int(sys.argv[1]))
seeded = tensor_parallel.model_parallel_cuda_manual_seed
def cuda_only(seed, *args, **kwargs):
    state = torch.get_rng_state()
    seeded(seed, *args, **kwargs)
    torch.set_rng_state(state)
tensor_parallel.model_parallel_cuda_manual_seed = cuda_only
from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
from megatron_rl.model import build_model, preset_config
init_distributed(ParallelConfig(seed=7), init_method=sys.argv[2], device="cpu")
model = build_model(preset_config("tiny"))
routers = [p for n, p in model.named_parameters() if "router" in n]
assert routers
embedding = model.embedding.word_embeddings.weight
print([float(p.double().sum()) for p in routers], float(embedding.double().sum()))
destroy_distributed()
"""


@pytest.mark.slow
def test_two_fresh_processes_build_the_same_routers(tmp_path):
    outputs = []
    for i, disturb in enumerate((1, 99)):
        result = subprocess.run(
            [sys.executable, "-c", BUILD, str(disturb), f"file://{tmp_path}/rdzv{i}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout.strip().splitlines()[-1])
    assert outputs[0] == outputs[1]
