"""LoRA on megatron's column- and row-parallel linear layers: the output and every gradient equal
the formula ``W x + (alpha / r) B A x`` at world 1, over two tensor-parallel ranks and with
sequence parallelism; the base stays frozen; ``A`` is the same at every layout."""

from __future__ import annotations

import os

import pytest
import torch
from qwen3_moe_testing import spawn_ranks

from megatron_rl.backend import ParallelConfig, init_distributed
from megatron_rl.lora.layers import COLUMN, ROW, LoRALinear, layout_independent_a

SEQ, BATCH, IN, OUT, RANK, ALPHA = 6, 2, 8, 12, 4, 8.0


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(SEQ, BATCH, IN, generator=gen),
        "w_col": torch.randn(OUT, IN, generator=gen) / 3,
        "b_col": torch.randn(OUT, RANK, generator=gen) / 3,
        "w_row": torch.randn(IN, OUT, generator=gen) / 3,
        "b_row": torch.randn(IN, RANK, generator=gen) / 3,
        "g": torch.randn(SEQ, BATCH, IN, generator=gen),
    }


def _reference(data):
    """float64 autograd of ``row(col(x))`` from the formula; the gradients of x, A and B."""
    x = data["x"].double().requires_grad_()
    a_col = layout_independent_a("col", 1, RANK, IN).double().requires_grad_()
    a_row = layout_independent_a("row", 1, RANK, OUT).double().requires_grad_()
    b_col = data["b_col"].double().requires_grad_()
    b_row = data["b_row"].double().requires_grad_()
    scale = ALPHA / RANK
    h = x @ data["w_col"].double().T + scale * (x @ a_col.T) @ b_col.T
    y = h @ data["w_row"].double().T + scale * (h @ a_row.T) @ b_row.T
    (y * data["g"].double()).sum().backward()
    return {
        "y": y.detach(),
        "x": x.grad,
        "a_col": a_col.grad,
        "b_col": b_col.grad,
        "a_row": a_row.grad,
        "b_row": b_row.grad,
    }


def _layers(data, tp: int, rank: int, sequence_parallel: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=IN,
        num_attention_heads=2,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    init = torch.nn.init.zeros_
    col = ColumnParallelLinear(IN, OUT, config=config, init_method=init, bias=False)
    row = RowParallelLinear(
        OUT, IN, config=config, init_method=init, bias=False, input_is_parallel=True,
        skip_bias_add=False,
    )  # fmt: skip
    shard_out, shard_in = OUT // tp, OUT // tp
    with torch.no_grad():
        col.weight.copy_(data["w_col"][rank * shard_out : (rank + 1) * shard_out])
        row.weight.copy_(data["w_row"][:, rank * shard_in : (rank + 1) * shard_in])
    kwargs = dict(rank=RANK, alpha=ALPHA, dropout=0.0, seed=1, sequence_parallel=sequence_parallel)
    col = LoRALinear(col, COLUMN, name="col", **kwargs)
    row = LoRALinear(row, ROW, name="row", **kwargs)
    with torch.no_grad():
        col.lora_B.copy_(data["b_col"][rank * shard_out : (rank + 1) * shard_out])
        row.lora_B.copy_(data["b_row"])
    return col, row


def _step(data, tp: int, rank: int, sequence_parallel: bool) -> dict[str, torch.Tensor]:
    """One forward and backward of ``row(col(x))`` on this rank; its shards of every result."""
    col, row = _layers(data, tp, rank, sequence_parallel)
    x = data["x"]
    chunk = SEQ // tp
    if sequence_parallel:
        x = x[rank * chunk : (rank + 1) * chunk]
    x = x.clone().requires_grad_()
    y, _ = row(col(x)[0])
    g = data["g"][rank * chunk : (rank + 1) * chunk] if sequence_parallel else data["g"]
    (y * g).sum().backward()
    grads = {n: p.grad for n, p in (("a_col", col.lora_A), ("a_row", row.lora_A))}
    grads |= {"b_col": col.lora_B.grad, "b_row": row.lora_B.grad}
    if tp > 1:  # what megatron's finalize_model_grads does for parameters marked so
        for p, name in ((col.lora_A, "a_col"), (row.lora_B, "b_row")):
            if getattr(p, "sequence_parallel", False):
                torch.distributed.all_reduce(grads[name])
    frozen = [p.grad is None and not p.requires_grad for p in (col.base.weight, row.base.weight)]
    return {"y": y.detach(), "x": x.grad, **grads, "frozen": torch.tensor(frozen)}


def test_world_1_equals_the_formula_and_the_base_is_frozen(ws1):
    data = _inputs()
    got, want = _step(data, 1, 0, False), _reference(data)
    assert got.pop("frozen").all()
    for name, value in got.items():
        torch.testing.assert_close(value.double(), want[name], atol=1e-5, rtol=0, msg=name)


def test_b_starts_at_zero_so_the_adapted_layer_starts_as_its_base(ws1):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=IN, num_attention_heads=1, use_cpu_initialization=True
    )
    base = ColumnParallelLinear(
        IN, OUT, config=config, init_method=torch.nn.init.normal_, bias=False
    )
    x = torch.randn(SEQ, BATCH, IN)
    want = base(x)[0]
    layer = LoRALinear(
        base, COLUMN, name="q", rank=RANK, alpha=ALPHA, dropout=0.0, seed=3,
        sequence_parallel=False,
    )  # fmt: skip
    assert torch.equal(layer(x)[0], want)
    assert layer.lora_B.abs().max() == 0 and layer.lora_A.abs().max() > 0
    torch.testing.assert_close(layer.merged_weight(), base.weight.detach())


def _tp2_worker(rank, world_size, init_method, tmp_dir, sequence_parallel) -> None:
    init_distributed(
        ParallelConfig(tensor_parallel=world_size, sequence_parallel=sequence_parallel),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        device="cpu",
    )
    data = torch.load(os.path.join(tmp_dir, "inputs.pt"))
    out = _step(data, world_size, rank, sequence_parallel)
    torch.save(out, os.path.join(tmp_dir, f"r{rank}.pt"))


@pytest.mark.slow  # two spawned ranks each import megatron-core
@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_two_tensor_parallel_ranks_equal_the_formula(tmp_path, ws1, sequence_parallel):
    data = _inputs(seed=1)
    torch.save(data, tmp_path / "inputs.pt")
    spawn_ranks(_tp2_worker, tmp_path, 2, sequence_parallel)
    want = _reference(data)
    got = [torch.load(tmp_path / f"r{rank}.pt") for rank in range(2)]
    assert all(g.pop("frozen").all() for g in got)
    split = {  # how each result is laid out over the two ranks (dim, or None: whole on each)
        "y": 0 if sequence_parallel else None,
        "x": 0 if sequence_parallel else None,
        "a_col": None,
        "b_col": 0,
        "a_row": 1,
        "b_row": None,
    }
    for name, dim in split.items():
        for rank in range(2):
            value = got[rank][name].double()
            if dim is not None:
                value = torch.cat([g[name].double() for g in got], dim=dim)
            torch.testing.assert_close(value, want[name], atol=1e-5, rtol=0, msg=name)
