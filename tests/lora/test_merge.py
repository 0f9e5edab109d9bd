"""``megatron-rl convert hf-to-hf --merge-lora`` against the real ``peft``: the merged checkpoint
equals PEFT's ``merge_and_unload`` of the same adapter on the same base, tensor by tensor, for
attention, dense-MLP, shared- and routed-expert adapters (per expert and shared); bad adapters
are named errors and leave no output folder."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_peft_export import CASES, _adapted, _hf

from megatron_rl.cli.convert import main as convert_main
from megatron_rl.lora.merge import adapter_scale

peft = pytest.importorskip("peft")


@pytest.mark.parametrize(
    "case", ["qwen3-moe-all-linear", "deepseek-v3-all-linear", "deepseek-v3-all-linear-shared"]
)
def test_the_merge_equals_peft_merge_and_unload(ws1, tmp_path, case):
    family, targets, experts = CASES[case]
    hf_config, ids, want, _ = _adapted(tmp_path, family, targets, experts)
    code = convert_main(
        ["hf-to-hf", "--src", str(tmp_path / "base"), "--merge-lora", str(tmp_path / "adapter"),
         "--dst", str(tmp_path / "merged-lora")]
    )  # fmt: skip
    assert code == 0
    peft_model = peft.PeftModel.from_pretrained(
        _hf(hf_config, tmp_path / "base"), tmp_path / "adapter"
    )
    reference = peft_model.merge_and_unload().state_dict()
    merged = _hf(hf_config, tmp_path / "merged-lora")
    got = merged.state_dict()
    assert set(got) == set(reference)
    changed = 0
    base = _hf(hf_config, tmp_path / "base").state_dict()
    for name, tensor in reference.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)
        changed += not torch.equal(tensor, base[name])
    assert changed > 0 and any("experts.gate_up_proj" in n for n in got)
    with torch.no_grad():  # and the megatron policy's logits
        assert (merged(input_ids=ids).logits - want).abs().max() < 1e-5
    assert (tmp_path / "merged-lora" / "config.json").is_file()
    assert not (tmp_path / "merged-lora.tmp").exists()


def test_bad_adapters_are_named_and_write_nothing(ws1, tmp_path):
    _adapted(tmp_path, "qwen3-moe", "attention")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    with pytest.raises(ValueError, match="use_dora"):
        adapter_scale({**config, "use_dora": True})
    assert adapter_scale({**config, "use_rslora": True}) == pytest.approx(8 / 2)
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    for factor in ("lora_A", "lora_B"):  # a pair on a layer the base does not have
        name = key.replace("lora_A", factor)
        tensors[name.replace("q_proj", "nonexistent_proj")] = tensors[name].clone()
    save_file(tensors, tmp_path / "adapter" / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"nonexistent_proj.*the base has no"):
        convert_main(
            ["hf-to-hf", "--src", str(tmp_path / "base"), "--merge-lora",
             str(tmp_path / "adapter"), "--dst", str(tmp_path / "out")]
        )  # fmt: skip
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):  # --merge-lora belongs to hf-to-hf
        convert_main(["hf-to-megatron", "--src", "a", "--dst", "b", "--merge-lora", "c"])
