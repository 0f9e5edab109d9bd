"""Shared helpers for the model tests: a tiny random HF Qwen3-MoE reference and rank workers.

Workers are top-level functions so the rank processes can unpickle them (`spawn_ranks` forks
them from a pre-imported server: tests/forked_ranks.py); each rank
initialises gloo through a ``file://`` rendezvous inside the test's tmp_path (no port collisions
under pytest-xdist) and always tears its process groups down.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from forked_ranks import start_ranks
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_rl.model import preset_config

SEQ_LEN = 8
BATCH = 2


def tiny_config(**overrides) -> Qwen3MoeConfig:
    config = preset_config("tiny", **overrides)
    config._attn_implementation = "eager"
    return config


def make_hf_checkpoint(folder: str, config: Qwen3MoeConfig, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A random HF model saved with ``save_pretrained`` (per-expert tensor names) in ``folder``."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises the router to zeros; random routing is a real test
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model


def fixed_input_ids(vocab_size: int, seed: int = 1, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """Token ids [BATCH, seq_len]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (BATCH, seq_len), generator=generator)


def hf_reference(model: Qwen3MoeForCausalLM, input_ids_BT: torch.Tensor) -> dict:
    """HF logits [B, T, V] and per MoE layer the top-k experts as a bool map [B*T, E] (B-major)."""
    routes: list[torch.Tensor] = []

    def hook(module, args, output):
        del args
        indices = output[2]
        routing = torch.zeros(indices.shape[0], module.num_experts, dtype=torch.bool)
        routes.append(routing.scatter_(1, indices, True))

    handles = [
        layer.mlp.gate.register_forward_hook(hook)
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        logits = model(input_ids=input_ids_BT).logits
    for handle in handles:
        handle.remove()
    return {"logits": logits, "routes": routes}


def megatron_forward(model, input_ids_BT: torch.Tensor) -> dict:
    """Megatron logits [B, T, V] (gathered), this rank's routing maps [S_local*B, E] (S-major)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl.model import causal_lm_logits

    routes: list[torch.Tensor] = []
    handles = [
        module.register_forward_hook(lambda m, a, out: routes.append(out[1].detach().clone()))
        for module in model.modules()
        if isinstance(module, TopKRouter)
    ]
    with torch.no_grad():
        logits = causal_lm_logits(model, input_ids_BT)
    for handle in handles:
        handle.remove()
    return {"logits": logits, "routes": routes}


def hf_routes_for_rank(hf_routes: list[torch.Tensor], seq_rank: int, seq_size: int) -> list:
    """HF routing [B*T, E] (B-major) -> megatron's [T_local*B, E] (S-major) for one SP chunk."""
    out = []
    for routing in hf_routes:
        routing_BTE = routing.reshape(BATCH, SEQ_LEN, -1)
        chunk = SEQ_LEN // seq_size
        local_TBE = routing_BTE[:, seq_rank * chunk : (seq_rank + 1) * chunk].transpose(0, 1)
        out.append(local_TBE.reshape(-1, routing.shape[-1]))
    return out


def spawn_ranks(worker: Callable, tmp_path, world_size: int, *args) -> None:
    """Run ``worker(rank, world_size, init_method, tmp_dir, *args)`` on ``world_size`` ranks."""
    init_method = f"file://{os.path.join(str(tmp_path), 'rendezvous')}"
    start_ranks(_run_rank, (worker, world_size, init_method, str(tmp_path), args), world_size)


def _run_rank(rank, worker, world_size, init_method, tmp_dir, args) -> None:
    torch.set_num_threads(1)
    from megatron_rl.quiet_imports import defer_megatron_tensorboard, eager_megatron_fusions

    eager_megatron_fusions()  # a spawned rank starts as the CLI does (no-ops once imported)
    defer_megatron_tensorboard()
    from megatron_rl.backend import destroy_distributed

    try:
        worker(rank, world_size, init_method, tmp_dir, *args)
    finally:
        destroy_distributed()


def parity_worker(rank, world_size, init_method, tmp_dir, parallel_kwargs) -> None:
    """One rank of a TP/EP run: load HF shards, compare with the reference, round-trip exports.

    Writes ``result{rank}.pt`` with the max logits diff, routing equality per layer, and whether
    the HF and canonical exports equal the files they came from.
    """
    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.model import build_model
    from megatron_rl.model.conversion import load_checkpoint, save_checkpoint
    from megatron_rl.model.conversion.safetensors_io import CheckpointReader

    parallel = ParallelConfig(**parallel_kwargs)
    init_distributed(
        parallel, rank=rank, world_size=world_size, init_method=init_method, device="cpu"
    )
    reference = torch.load(os.path.join(tmp_dir, "reference.pt"))
    config = tiny_config()
    hf_dir, meg_dir = os.path.join(tmp_dir, "hf"), os.path.join(tmp_dir, "megatron")
    model = build_model(config)
    load_checkpoint(model, hf_dir, config)
    model.eval()
    result = megatron_forward(model, reference["input_ids"])
    sp_size = parallel.tensor_parallel if parallel.sequence_parallel else 1
    sp_rank = rank % sp_size
    expected = hf_routes_for_rank(reference["routes"], sp_rank, sp_size)
    diff = (result["logits"] - reference["logits"]).abs().max().item()
    routes_equal = [torch.equal(g, w) for g, w in zip(result["routes"], expected, strict=True)]

    out_hf = os.path.join(tmp_dir, "export_hf")
    save_checkpoint(model, config, out_hf, fmt="hf")
    exact_hf = _same_tensors(CheckpointReader, hf_dir, out_hf) if rank == 0 else None
    # A canonical (unsharded) Megatron checkpoint written at world size 1 by the parent: the
    # sharded model must hold exactly its shards.
    model2 = build_model(config)
    load_checkpoint(model2, meg_dir, config)
    shards_equal = all(
        torch.equal(a, b)
        for (k, a), (_, b) in zip(
            model.state_dict().items(), model2.state_dict().items(), strict=True
        )
        if torch.is_tensor(a)
    )
    torch.save(
        {
            "diff": diff,
            "routes_equal": routes_equal,
            "exact_hf": exact_hf,
            "shards_equal": shards_equal,
        },
        os.path.join(tmp_dir, f"result{rank}.pt"),
    )


def _same_tensors(reader_cls, folder_a: str, folder_b: str) -> bool:
    with reader_cls(folder_a) as a, reader_cls(folder_b) as b:
        if sorted(a.names()) != sorted(b.names()):
            return False
        return all(torch.equal(a.get(n), b.get(n)) for n in a.names())
