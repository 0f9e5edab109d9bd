"""Benchmark the megatron Qwen3-MoE model on this machine (world size 1).

Measures (1) forward+backward tokens/s of the `tiny` preset, and (2) export throughput (MB/s)
of the streaming HF export (`iter_hf_tensors`) and of writing the HF checkpoint to disk.
Prints a table of what it measured.

    megatron-rl bench model [--preset tiny] [--batch 4] [--seq 128] [--steps 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F

from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
from megatron_rl.backend.optimizer import wrap_for_training
from megatron_rl.model import PRESET_NAMES, build_model, causal_lm_logits, preset_config
from megatron_rl.model.conversion import iter_hf_tensors, save_checkpoint


def bench_train(model, vocab_size: int, batch: int, seq: int, steps: int) -> float:
    """tokens/s of forward + backward (cross-entropy on random tokens), after one warm-up step."""
    tokens_BT = torch.randint(0, vocab_size, (batch, seq + 1))
    elapsed = 0.0
    for step in range(steps + 1):
        model.zero_grad_buffer()
        start = time.perf_counter()
        logits_BTV = causal_lm_logits(model, tokens_BT[:, :-1])
        loss = F.cross_entropy(logits_BTV.reshape(-1, vocab_size), tokens_BT[:, 1:].reshape(-1))
        loss.backward()
        if step:
            elapsed += time.perf_counter() - start
    return batch * seq * steps / elapsed


def bench_export(model, config, folder: str) -> tuple[float, float, float]:
    """(MB exported, MB/s of the streaming iterator, MB/s of writing safetensors)."""
    start = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for _, t in iter_hf_tensors(model, config))
    stream_s = time.perf_counter() - start
    start = time.perf_counter()
    save_checkpoint(model, config, folder, fmt="hf")
    write_s = time.perf_counter() - start
    mb = nbytes / 1e6
    return mb, mb / stream_s, mb / write_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="megatron Qwen3-MoE CPU benchmark")
    parser.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        init_distributed(ParallelConfig(), init_method=f"file://{tmp}/rdzv", device="auto")
        try:
            config = preset_config(args.preset)
            model = wrap_for_training(build_model(config))
            tok_s = bench_train(model, config.vocab_size, args.batch, args.seq, args.steps)
            mb, stream_mb_s, write_mb_s = bench_export(model.module, config, f"{tmp}/hf")
        finally:
            destroy_distributed()
    params = sum(p.numel() for p in model.parameters())
    rows = [
        ("preset", args.preset),
        ("parameters", f"{params / 1e6:.2f} M"),
        ("threads", str(torch.get_num_threads())),
        ("fwd+bwd batch x seq", f"{args.batch} x {args.seq}"),
        ("fwd+bwd tokens/s", f"{tok_s:,.0f}"),
        ("export size", f"{mb:.1f} MB"),
        ("export stream MB/s", f"{stream_mb_s:,.1f}"),
        ("export to safetensors MB/s", f"{write_mb_s:,.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'metric':<{width}}  value")
    print(f"{'-' * width}  {'-' * 12}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
