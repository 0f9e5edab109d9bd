"""The built-in task: stable ids, records, config validation, and learnability from reward alone."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.data import (
    BuiltinTaskConfig,
    Tokenizer,
    builtin_task,
    uniform_policy_accuracy,
)
from megatron_rl.data.builtin_task import HELDOUT_FORMS, builtin_heldout
from megatron_rl.data.builtin_tokenizer import BOS_ID, EOS_ID, PAD_ID, SYMBOLS
from megatron_rl.model import preset_config
from megatron_rl.rewards import compute_rewards, get_reward_fn, score_builtin_response


def test_token_ids_are_stable_and_fit_the_tiny_preset():
    tokenizer, _ = builtin_task(BuiltinTaskConfig())
    assert isinstance(tokenizer, Tokenizer)
    assert ("<pad>", "<bos>", "<eos>", "+", "=", *"0123456789", "?") == SYMBOLS
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 2)
    assert tokenizer.encode("3 + 9 =") == [8, 3, 14, 4]
    assert tokenizer.vocab_size == 16 <= preset_config("tiny").vocab_size


def test_default_task_is_digit_successor():
    config = BuiltinTaskConfig()
    tokenizer, records = builtin_task(config)
    assert len(records) == config.num_prompts == 10
    assert [r.index for r in records] == list(range(10))
    assert records[3].prompt_ids == (BOS_ID, 8, 4) and records[3].answer == "4"
    assert records[9].answer == "0"
    assert records[3].prompt_text == "<bos> 3 ="
    assert config.chance_accuracy == pytest.approx(0.1)
    assert uniform_policy_accuracy(tokenizer.vocab_size) == pytest.approx(1 / 16)


def test_modular_addition_answers_and_seeded_subset():
    config = BuiltinTaskConfig(num_prompts=20, modulus=7, num_operands=2, offset=0, seed=5)
    tokenizer, records = builtin_task(config)
    for record in records:
        a, b = (int(s) for s in tokenizer.decode(record.prompt_ids).strip(" =").split(" + "))
        assert record.answer == str((a + b) % 7)
    assert len({r.prompt_ids for r in records}) == 20
    assert records == builtin_task(config)[1]
    assert records != builtin_task(BuiltinTaskConfig(**{**_fields(config), "seed": 6}))[1]


def _fields(config: BuiltinTaskConfig) -> dict:
    return {name: getattr(config, name) for name in config.__slots__}


def test_decode_drops_special_tokens_and_verifier_reads_first_symbol():
    tokenizer, _ = builtin_task(BuiltinTaskConfig())
    assert tokenizer.decode([9, EOS_ID, PAD_ID]) == "4"
    assert score_builtin_response(tokenizer.decode([9, EOS_ID]), "4") == 1.0
    assert score_builtin_response(tokenizer.decode([9, 10, 3]), "4") == 1.0
    assert score_builtin_response(tokenizer.decode([10, 9]), "4") == 0.0
    assert score_builtin_response(tokenizer.decode([EOS_ID]), "4") == 0.0
    assert score_builtin_response(tokenizer.decode([15, 9]), "4") == 0.0
    with pytest.raises(ValueError, match="outside"):
        tokenizer.decode([16])
    with pytest.raises(ValueError, match="not in the built-in"):
        tokenizer.encode("12")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"modulus": 11}, "modulus"),
        ({"num_operands": 5}, "num_operands"),
        ({"num_prompts": 11}, "num_prompts"),
        ({"num_prompts": 0}, "num_prompts"),
        ({"offset": 10}, "offset"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_config_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        BuiltinTaskConfig(**kwargs)


def test_softmax_bandit_learns_task_from_reward_alone():
    """REINFORCE with a group-mean baseline on a [prompts, vocab] logit table, starting uniform
    (chance 1/16), scored through get_reward_fn("builtin"): accuracy >= 0.9 in < 300 updates."""
    tokenizer, records = builtin_task(BuiltinTaskConfig())
    reward_fn = get_reward_fn("builtin")
    generator = torch.Generator().manual_seed(0)
    logits_PV = torch.zeros(len(records), tokenizer.vocab_size, requires_grad=True)
    optimizer = torch.optim.Adam([logits_PV], lr=0.1)
    answer_ids = torch.tensor([tokenizer.encode(r.answer)[0] for r in records])
    group_size, accuracy, steps = 8, 0.0, 0
    while accuracy < 0.9 and steps < 300:
        probs_PV = torch.softmax(logits_PV, dim=-1)
        samples_PG = torch.multinomial(probs_PV.detach(), group_size, True, generator=generator)
        responses = [tokenizer.decode([t, tokenizer.eos_token_id]) for t in samples_PG.flatten()]
        answers = [r.answer for r in records for _ in range(group_size)]
        batch = compute_rewards(reward_fn, responses, answers)
        rewards_PG = torch.tensor(batch.rewards).view(len(records), group_size)
        advantages_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
        logprobs_PG = torch.log(probs_PV).gather(1, samples_PG)
        loss = -(advantages_PG * logprobs_PG).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
        with torch.no_grad():
            accuracy = torch.softmax(logits_PV, -1).gather(1, answer_ids[:, None]).mean().item()
    assert accuracy >= 0.9, f"accuracy {accuracy:.3f} after {steps} updates"


@pytest.mark.parametrize("form", HELDOUT_FORMS)
def test_held_out_prompts_are_new_questions_with_the_training_answers(form):
    config = BuiltinTaskConfig()
    _, train = builtin_task(config)
    held = builtin_heldout(config, form)
    assert not {r.prompt_ids for r in train} & {r.prompt_ids for r in held}
    assert [r.answer for r in held] == [r.answer for r in train]
    assert [r.index for r in held] == list(range(10))
    expected = "<bos> 0 + 3 =" if form == "zero-first" else "<bos> 3 + 0 ="
    assert held[3].prompt_text == expected and held[3].answer == "4"
    assert builtin_task(config)[1] == train  # the training set is untouched


def test_held_out_prompts_follow_a_sampled_task_and_refuse_a_fifth_operand():
    config = BuiltinTaskConfig(num_prompts=7, num_operands=2, modulus=5, offset=0, seed=3)
    _, train = builtin_task(config)
    held = builtin_heldout(config)
    assert [r.prompt_text for r in held] == [
        "<bos> 0 + " + r.prompt_text.removeprefix("<bos> ") for r in train
    ]
    assert [r.answer for r in held] == [r.answer for r in train]
    default = BuiltinTaskConfig()
    assert builtin_heldout(default) == builtin_heldout(default, "zero-first")  # the chosen form
    with pytest.raises(ValueError, match="at most 3"):
        builtin_heldout(BuiltinTaskConfig(num_operands=4, num_prompts=10))
    with pytest.raises(ValueError, match="form='middle'"):
        builtin_heldout(config, "middle")
