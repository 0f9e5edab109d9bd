"""HF <-> Megatron conversion: exact round trips, sharding inverses, and validation of bad input."""

from __future__ import annotations

import os

import pytest
import torch
from qwen3_moe_testing import make_hf_checkpoint, tiny_config
from safetensors.torch import load_file, save_file

from megatron_rl.model import build_model, load_hf_config
from megatron_rl.model.conversion import (
    RankLayout,
    expected_hf_shapes,
    load_checkpoint,
    rank_tensor_maps,
    save_checkpoint,
)
from megatron_rl.model.conversion.safetensors_io import CheckpointReader, write_checkpoint
from megatron_rl.model.conversion.transforms import fuse, shard, split, unshard


def _tensors(folder) -> dict[str, torch.Tensor]:
    with CheckpointReader(folder) as reader:
        return {name: reader.get(name) for name in reader.names()}


def test_hf_to_megatron_to_hf_round_trip_is_bit_exact(ws1, tmp_path):
    config = tiny_config()
    make_hf_checkpoint(str(tmp_path / "hf"), config)
    model = build_model(config)
    load_checkpoint(model, tmp_path / "hf", config)
    save_checkpoint(model, config, tmp_path / "meg", fmt="megatron", max_shard_bytes=64 * 1024)
    assert os.path.exists(tmp_path / "meg" / "model.safetensors.index.json")  # sharded output

    fresh = build_model(config)
    load_checkpoint(fresh, tmp_path / "meg", config)  # format detected from the names
    save_checkpoint(fresh, config, tmp_path / "hf2", fmt="hf")
    original, back = _tensors(tmp_path / "hf"), _tensors(tmp_path / "hf2")
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert torch.equal(tensor, back[name]), name
    assert load_hf_config(tmp_path / "hf2").to_dict() == config.to_dict()


@pytest.mark.parametrize("layout", ["local", "te"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_reassemble_and_hf_split_inverts_fuse(layout, tp):
    config = tiny_config(num_attention_heads=8, num_key_value_heads=4)
    hf = {n: torch.randn(s) for n, s in expected_hf_shapes(config).items()}
    for tmap in rank_tensor_maps(config, layout, RankLayout()):
        full = fuse(tmap, [hf[n] for n in tmap.hf], config)
        assert all(
            torch.equal(a, b)
            for a, b in zip(split(tmap, full, config), [hf[n] for n in tmap.hf], strict=True)
        )
        shards = [shard(tmap, full, r, tp) for r in range(tp)]
        assert torch.equal(unshard(tmap, shards), full), tmap.canonical


def test_qkv_fusion_groups_queries_with_their_kv_head():
    config = tiny_config(num_attention_heads=4, num_key_value_heads=2, head_dim=1, hidden_size=1)
    tmap = next(t for t in rank_tensor_maps(config) if t.kind == "qkv")
    q, k, v = (
        torch.tensor([[0.0], [1], [2], [3]]),
        torch.tensor([[10.0], [11]]),
        torch.tensor([[20.0], [21]]),
    )
    fused = fuse(tmap, [q, k, v], config).flatten().tolist()
    assert fused == [0, 1, 10, 20, 2, 3, 11, 21]


def test_te_names_cover_fused_norms_and_grouped_experts():
    names = {t.param for t in rank_tensor_maps(tiny_config(mlp_only_layers=[0]), "te")}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names  # dense layer
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in names  # MoE layer keeps its norm
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight7" in names


def test_ep_ranks_hold_disjoint_global_experts():
    config = tiny_config()
    held = [
        {
            t.canonical
            for t in rank_tensor_maps(config, "local", RankLayout(ep_rank=r, ep_size=2))
            if t.local_expert is not None
        }
        for r in range(2)
    ]
    assert not held[0] & held[1]
    assert ".local_experts.4." in next(iter(sorted(held[1])))


def _corrupt(src, dst, edit) -> None:
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    os.makedirs(dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
            "missing tensors: model.layers.1.mlp.experts.3.up_proj.weight",
        ),
        (
            lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}),
            "unexpected tensors: model.layers.0.extra.weight",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 64)}),
            "model.layers.0.self_attn.q_proj.weight has (3, 64)",
        ),
    ],
    ids=["missing", "extra", "shape"],
)
def test_bad_checkpoint_names_tensors_and_leaves_weights_untouched(ws1, tmp_path, edit, message):
    config = tiny_config()
    make_hf_checkpoint(str(tmp_path / "hf"), config)
    _corrupt(tmp_path / "hf", tmp_path / "bad", edit)
    model = build_model(config)
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_checkpoint(model, tmp_path / "bad", config)
    assert all(
        torch.equal(before[k], v) for k, v in model.state_dict().items() if torch.is_tensor(v)
    )


def test_checkpoint_with_other_expert_count_is_rejected(ws1, tmp_path):
    make_hf_checkpoint(str(tmp_path / "hf16"), tiny_config(num_experts=16))
    model = build_model(tiny_config())
    with pytest.raises(
        ValueError,
        match=r"unexpected tensors: .*experts\.1[0-5]\..*wrong shapes: "
        r".*mlp\.gate\.weight has \(16, 64\)",
    ):
        load_checkpoint(model, tmp_path / "hf16", tiny_config())


def test_writer_is_atomic_and_shards_by_size(tmp_path):
    tensors = [(f"t{i}", torch.full((256,), float(i))) for i in range(4)]
    files = write_checkpoint(iter(tensors), tmp_path / "out", max_shard_bytes=2048)
    assert files[-1] == "model.safetensors.index.json" and len(files) == 3
    assert not [f for f in os.listdir(tmp_path / "out") if f.startswith(".")]
    assert all(torch.equal(_tensors(tmp_path / "out")[n], t) for n, t in tensors)


def test_convert_tool_round_trip_is_exact(tmp_path):
    from megatron_rl.cli import convert as tool  # megatron-rl convert (tools/convert_checkpoint.py)

    make_hf_checkpoint(str(tmp_path / "hf"), tiny_config(mlp_only_layers=[1]))
    assert (
        tool.main(
            [
                "hf-to-megatron",
                "--src",
                str(tmp_path / "hf"),
                "--dst",
                str(tmp_path / "meg"),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert (
        tool.main(
            [
                "megatron-to-hf",
                "--src",
                str(tmp_path / "meg"),
                "--dst",
                str(tmp_path / "hf2"),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    original, back = _tensors(tmp_path / "hf"), _tensors(tmp_path / "hf2")
    assert "decoder.layers.1.mlp.linear_fc1.weight" in _tensors(tmp_path / "meg")
    assert sorted(original) == sorted(back)
    assert all(torch.equal(t, back[n]) for n, t in original.items())


def _with_extra_state(module: torch.nn.Module) -> None:
    """Give ``module`` a Transformer-Engine-like ``_extra_state`` entry (FP8 metadata blob)."""

    class WithExtraState(type(module)):
        def get_extra_state(self):
            return torch.zeros(3, dtype=torch.uint8)

        def set_extra_state(self, state):
            del state

    module.__class__ = WithExtraState


def test_te_extra_state_entries_are_not_weights(ws1, tmp_path):
    """TE modules carry ``*._extra_state`` in their state dict; loading and exporting skip it."""
    config = tiny_config()
    make_hf_checkpoint(str(tmp_path / "hf"), config)
    model = build_model(config)
    _with_extra_state(model.decoder.layers[0].self_attention.linear_proj)
    assert "decoder.layers.0.self_attention.linear_proj._extra_state" in model.state_dict()
    load_checkpoint(model, tmp_path / "hf", config)
    save_checkpoint(model, config, tmp_path / "hf2", fmt="hf")
    original, back = _tensors(tmp_path / "hf"), _tensors(tmp_path / "hf2")
    assert sorted(original) == sorted(back)
    assert all(torch.equal(tensor, back[name]) for name, tensor in original.items())


def test_cuda_without_transformer_engine_names_the_fix(monkeypatch):
    from megatron_rl.model import builder

    monkeypatch.setattr(builder, "cuda_available", lambda: True)
    monkeypatch.setattr(builder, "te_available", lambda: False)
    with pytest.raises(ValueError, match=r"transformer-engine.*--transformer-impl local"):
        builder.resolve_spec("auto")
    assert builder.resolve_spec("local") == "local"  # asked for explicitly
    monkeypatch.setattr(builder, "cuda_available", lambda: False)
    assert builder.resolve_spec("auto") == "local"  # CPU: the local spec is the only one
