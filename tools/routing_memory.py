"""Routing-replay state size per codec, for the whole batch and per rank.

    python tools/routing_memory.py --responses 512 --length 9000 18432 \
        --moe-layers 48 --topk 8 --experts 128 [--dp 4 --tp 2 --sp --cp 1 --pp 2]

With the defaults (512 responses of 9,000 and 18,432 tokens, Qwen3-30B-A3B: 48 MoE layers, top-8
of 128 experts) the uint8 and int32 rows reproduce Table 4 of the EPIC paper (Sec. 10.5):
1.65 / 3.375 GiB and 6.59 / 13.50 GiB.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from megatron_rl.parallel import ParallelConfig
from megatron_rl.routing import RoutingCodec, routing_state_bytes

GIB = 1024**3


def main() -> None:
    parser = argparse.ArgumentParser(description="Routing-replay state size per codec.")
    parser.add_argument("--responses", type=int, default=512, help="responses in the batch (N)")
    parser.add_argument("--length", type=int, nargs="+", default=[9000, 18432], help="tokens (T)")
    parser.add_argument("--moe-layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()

    parallel = ParallelConfig(
        tensor_parallel=args.tp,
        context_parallel=args.cp,
        pipeline_parallel=args.pp,
        sequence_parallel=args.sp,
    )
    table = Table(
        title=f"routing state: {args.responses} responses, {args.moe_layers} MoE layers, "
        f"top-{args.topk} of {args.experts} experts; per rank: dp={args.dp} tp={args.tp}"
        f"{'+sp' if args.sp else ''} cp={args.cp} pp={args.pp}"
    )
    table.add_column("codec")
    table.add_column("bytes / token-layer", justify="right")
    for length in args.length:
        table.add_column(f"batch GiB, T={length}", justify="right")
        table.add_column(f"per rank GiB, T={length}", justify="right")
    for name in ("uint8", "int16", "int32", "packed"):
        try:
            codec = RoutingCodec(args.experts, args.topk, name)
        except ValueError as err:
            table.add_row(name, f"n/a ({err})")
            continue
        cells = [name, f"{codec.bytes_per_token_layer():g}"]
        for length in args.length:
            whole = routing_state_bytes(codec, args.responses, length, args.moe_layers)
            local = routing_state_bytes(
                codec, args.responses, length, args.moe_layers, parallel, args.dp
            )
            cells += [f"{whole / GIB:.3f}", f"{local / GIB:.3f}"]
        table.add_row(*cells)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
