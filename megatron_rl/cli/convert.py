"""Convert a Qwen3-MoE checkpoint between HF safetensors and the megatron_rl Megatron format.

    megatron-rl convert hf-to-megatron --src HF_DIR --dst MEGATRON_DIR
    megatron-rl convert megatron-to-hf --src MEGATRON_DIR --dst HF_DIR
    megatron-rl convert hf-to-hf --src HF_DIR --merge-lora PEFT_ADAPTER_DIR --dst MERGED_DIR

The Megatron format is the unsharded megatron-core state dict in local-spec names with global
expert indices (safetensors + config.json); it loads into the local or the Transformer Engine
spec under any TP/EP layout. The conversion builds the real megatron model (world size 1, CPU
unless CUDA is present), loads the source into it with full validation, and streams it out.
Under torchrun it runs sharded (each rank loads its shard, rank 0 writes).
``python tools/convert_checkpoint.py`` is the same command.

``hf-to-hf --merge-lora`` merges a PEFT LoRA adapter (a LoRA run's ``RUN_DIR/peft_adapter``)
into its base, ``W + (alpha / r) B A`` as PEFT's ``merge_and_unload`` does, tensor by tensor
without building a model (`megatron_rl.lora.merge`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time

from megatron_rl.quiet_imports import quiet_third_party_warnings

DIRECTIONS = {
    "hf-to-megatron": ("hf", "megatron"),
    "megatron-to-hf": ("megatron", "hf"),
    "hf-to-hf": ("hf", "hf"),  # with --merge-lora
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("direction", choices=sorted(DIRECTIONS))
    parser.add_argument("--src", required=True, help="source checkpoint folder (has config.json)")
    parser.add_argument("--dst", required=True, help="destination folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (torchrun)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (torchrun)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-shard-gb", type=float, default=2.0)
    parser.add_argument(
        "--merge-lora",
        metavar="ADAPTER_DIR",
        help="hf-to-hf: merge this PEFT LoRA adapter (adapter_config.json + "
        "adapter_model.safetensors) into --src",
    )
    args = parser.parse_args(argv)
    if (args.direction == "hf-to-hf") != (args.merge_lora is not None):
        parser.error("--merge-lora goes with hf-to-hf, and hf-to-hf needs --merge-lora")
    return args


def convert(args: argparse.Namespace) -> float:
    """Run one conversion; returns the seconds it took."""
    if args.merge_lora is not None:
        from megatron_rl.lora.merge import merge_peft_adapter

        start = time.perf_counter()
        count = merge_peft_adapter(
            args.src, args.merge_lora, args.dst, max_shard_bytes=int(args.max_shard_gb * 1024**3)
        )
        print(f"merged {count} adapted weights")
        return time.perf_counter() - start
    from tqdm import tqdm  # megatron and the model: once a conversion runs (--help answers first)

    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.model import ModelOptions, build_model, load_hf_config
    from megatron_rl.model.conversion import load_checkpoint, save_checkpoint

    src_fmt, dst_fmt = DIRECTIONS[args.direction]
    start = time.perf_counter()
    parallel = ParallelConfig(tensor_parallel=args.tp, expert_parallel=args.ep)
    with tempfile.TemporaryDirectory() as rendezvous:
        init_method = None if args.tp * args.ep > 1 else f"file://{rendezvous}/rdzv"
        init_distributed(parallel, init_method=init_method, device=args.device)
        try:
            hf_config = load_hf_config(args.src)
            model = build_model(hf_config, ModelOptions(dtype=args.dtype))
            load_checkpoint(
                model,
                args.src,
                hf_config,
                fmt=src_fmt,
                progress=lambda it: tqdm(it, desc=f"load {src_fmt}", unit="tensor"),
            )
            save_checkpoint(
                model,
                hf_config,
                args.dst,
                fmt=dst_fmt,
                max_shard_bytes=int(args.max_shard_gb * 1024**3),
                progress=lambda it: tqdm(it, desc=f"write {dst_fmt}", unit="tensor"),
            )
        finally:
            destroy_distributed()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    quiet_third_party_warnings()  # megatron-core's "Apex is not installed" and the like
    seconds = convert(args)
    print(f"{args.direction}: {args.src} -> {args.dst} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
