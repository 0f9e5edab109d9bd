"""Routing-state memory accounting: the EPIC paper's Table 4 and per-rank shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.parallel import ParallelConfig
from megatron_rl.routing import RoutingCodec, local_counts, routing_state_bytes

GIB = 1024**3


@pytest.mark.parametrize(
    ("dtype", "length", "gib"),
    [
        ("uint8", 9000, 1.65),
        ("uint8", 18432, 3.375),
        ("int32", 9000, 6.59),
        ("int32", 18432, 13.50),
    ],
)
def test_reproduces_epic_table_4(dtype, length, gib):
    """512 responses, 48 MoE layers, top-8 of 128 experts (EPIC, Sec. 10.5, Table 4)."""
    codec = RoutingCodec(128, 8, dtype)
    assert routing_state_bytes(codec, 512, length, 48) / GIB == pytest.approx(gib, abs=0.005)
    assert routing_state_bytes(codec, 512, length, 48) == 512 * length * 48 * 8 * (
        1 if dtype == "uint8" else 4
    )


def test_per_rank_share_divides_by_dp_cp_sp_and_pp_but_not_ep():
    codec = RoutingCodec(128, 8, "uint8")
    whole = routing_state_bytes(codec, 64, 1024, 48)
    parallel = ParallelConfig(
        tensor_parallel=2, context_parallel=2, pipeline_parallel=3, expert_parallel=8
    )
    assert parallel.sequence_parallel  # on by default with TP > 1
    assert routing_state_bytes(codec, 64, 1024, 48, parallel, 4) * 4 * 2 * 2 * 3 == whole
    no_sp = ParallelConfig(
        tensor_parallel=2, context_parallel=2, pipeline_parallel=3, sequence_parallel=False
    )
    assert routing_state_bytes(codec, 64, 1024, 48, no_sp, 4) * 4 * 2 * 3 == whole


def test_uneven_splits_count_the_fullest_rank():
    assert local_counts(ParallelConfig(pipeline_parallel=5), 3, 10, 7, 48) == (4 * 7, 10)


def test_invalid_layout_names_the_field():
    with pytest.raises(ValueError, match=r"=0: .*\(ParallelConfig.context_parallel\)"):
        ParallelConfig(context_parallel=0)
    with pytest.raises(ValueError, match="data_parallel must be a positive int"):
        local_counts(ParallelConfig(), 0, 10, 7, 48)


@pytest.mark.slow
def test_routing_memory_tool_prints_table_4_numbers():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "tools/routing_memory.py"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for number in ("1.648", "3.375", "6.592", "13.500"):
        assert number in out
