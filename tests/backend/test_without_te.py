"""megatron-core 0.16.1 without Transformer Engine: the router's TE names exist (as None)."""

import importlib

from megatron_rl.backend.without_te import (
    MOE_UTILS,
    TE_SYMBOLS_OF_MOE_UTILS,
    define_missing_te_symbols,
)


def test_missing_te_names_are_bound_to_none_once(monkeypatch):
    moe_utils = importlib.import_module(MOE_UTILS)
    for name in TE_SYMBOLS_OF_MOE_UTILS:
        monkeypatch.delattr(moe_utils, name, raising=False)
    assert define_missing_te_symbols() == list(TE_SYMBOLS_OF_MOE_UTILS)
    assert all(getattr(moe_utils, name) is None for name in TE_SYMBOLS_OF_MOE_UTILS)
    assert define_missing_te_symbols() == []


def test_a_name_that_exists_is_left_alone(monkeypatch):
    moe_utils = importlib.import_module(MOE_UTILS)
    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel, raising=False)
    define_missing_te_symbols()
    assert moe_utils.te_general_gemm is sentinel
