"""get_reward_fn / compute_rewards: names, user functions, and per-sample failure isolation."""

from __future__ import annotations

import logging
import math
import textwrap

import numpy as np
import pytest

from megatron_rl.rewards import available_rewards, compute_rewards, get_reward_fn


def test_available_rewards_lists_builtins():
    assert available_rewards() == ("addition-trace", "builtin", "math")


def test_builtin_reward_checks_first_symbol():
    reward_fn = get_reward_fn("builtin")
    out = compute_rewards(reward_fn, ["4", "4 2", "5", ""], ["4"] * 4)
    assert out.rewards == [1.0, 1.0, 0.0, 0.0]
    assert out.failed == [False] * 4 and out.errors == [None] * 4


def test_unknown_name_lists_available_and_module_syntax():
    with pytest.raises(
        ValueError, match=r"unknown reward 'mth'; available: addition-trace, builtin, math, or "
    ):
        get_reward_fn("mth")


def test_user_function_is_imported_from_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            def exact(response, answer):
                return float(response.strip() == answer)

            NOT_CALLABLE = 3
            """
        ),
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reward_fn = get_reward_fn("my_rewards_mod:exact")
    assert compute_rewards(reward_fn, [" a ", "b"], ["a", "a"]).rewards == [1.0, 0.0]
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        get_reward_fn("my_rewards_mod:missing")
    with pytest.raises(ValueError, match="not a function"):
        get_reward_fn("my_rewards_mod:NOT_CALLABLE")


def test_unimportable_module_raises_naming_it():
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg_xyz\.mod'"):
        get_reward_fn("no_such_pkg_xyz.mod:fn")


def _flaky(response: str, answer: str):
    values = {
        "ok": 1.0,
        "int": 1,
        "bool": True,
        "np": np.float32(0.5),
        "npbool": np.bool_(True),
        "nan": math.nan,
        "inf": -math.inf,
        "none": None,
        "str": "1.0",
    }
    if response == "raise":
        raise RuntimeError("verifier crashed")
    return values[response]


def test_bad_samples_fail_alone_with_zero_reward_and_a_message(caplog):
    responses = ["ok", "int", "bool", "np", "npbool", "nan", "inf", "none", "str", "raise"]
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rewards.batch"):
        out = compute_rewards(_flaky, responses, ["x"] * len(responses))
    assert out.rewards == [1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert out.failed == [False] * 5 + [True] * 5
    assert out.num_failed == 5
    assert all(isinstance(r, float) for r in out.rewards)
    assert out.errors[:5] == [None] * 5
    assert out.errors[5].startswith("sample 5: reward function _flaky returned the non-finite")
    assert "sample 7" in out.errors[7] and "NoneType" in out.errors[7]
    assert "sample 8" in out.errors[8] and "not a number" in out.errors[8]
    assert out.errors[9] == "sample 9: reward function _flaky raised RuntimeError: verifier crashed"
    assert "5 of 10 samples failed" in caplog.text


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        compute_rewards(get_reward_fn("builtin"), ["1", "2"], ["1"])
