"""Interleaved pipeline parallelism loads and exports HF checkpoints as plain pipelines do.

An 8-layer tiny Qwen3-MoE checkpoint of seeded weights is loaded by 2 gloo ranks at PP 2 plain,
PP 2 x VP 2, PP 2 x VP 4 (one layer per chunk) and PP 2 x VP 2 with an uneven 2 + 6 split, and
exported again: every export holds exactly the source's tensors, bit for bit (so each equals the
plain pipeline's byte for byte), and each chunk holds the global layers megatron gives it.
"""

from __future__ import annotations

import pytest
import torch
from qwen3_moe_testing import spawn_ranks

LAYERS = 8
LAYOUTS = {  # name -> ModelOptions fields
    "pp2": {},
    "pp2_vp2": {"virtual_stages": 2},
    "pp2_vp4": {"virtual_stages": 4},
    "pp2_vp2_uneven": {"virtual_stages": 2, "first_stage_layers": 2},
}


def _export_worker(rank, world_size, init_method, tmp_dir, name, options) -> None:
    from pathlib import Path

    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.model import ModelOptions, build_model, preset_config
    from megatron_rl.model.chunks import as_chunks
    from megatron_rl.model.conversion import load_checkpoint, save_checkpoint
    from megatron_rl.model.stages import virtual_chunk_layers

    init_distributed(
        ParallelConfig(pipeline_parallel=2), rank=rank, world_size=world_size,
        init_method=init_method, device="cpu",
    )  # fmt: skip
    config = preset_config("tiny", num_hidden_layers=LAYERS)
    model = build_model(config, ModelOptions(spec="local", **options))
    vp = options.get("virtual_stages")
    if vp is not None:
        split = virtual_chunk_layers(LAYERS, 2, vp, options.get("first_stage_layers"))[rank]
        held = [[layer.layer_number - 1 for layer in c.decoder.layers] for c in as_chunks(model)]
        assert held == [list(range(first, first + n)) for first, n in split], held
    load_checkpoint(model, Path(tmp_dir).parent / "source", config)
    save_checkpoint(model, config, Path(tmp_dir) / "export", fmt="hf")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from megatron_rl.cli.bench.pipeline import write_model

    folder = tmp_path_factory.mktemp("interleaved_export")
    (folder / "source").mkdir()
    write_model(folder / "source", layers=LAYERS, hidden=64, seed=3)
    return folder


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_interleaved_export_is_the_source_checkpoint_bit_for_bit(source, name):
    from safetensors import safe_open

    folder = source / name
    folder.mkdir()
    spawn_ranks(_export_worker, folder, 2, name, LAYOUTS[name])
    with safe_open(source / "source" / "model.safetensors", "pt") as want:
        names = want.keys()  # a safetensors handle: no iteration of its own
        expected = {key: want.get_tensor(key) for key in names}
    exported = {}
    for shard in sorted((folder / "export").glob("*.safetensors")):
        with safe_open(shard, "pt") as got:
            names = got.keys()
            exported.update({key: got.get_tensor(key) for key in names})
    assert set(exported) == set(expected)
    for key, tensor in expected.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
