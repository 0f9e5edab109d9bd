"""Routing-codec throughput against minimal baselines, with paired ratios.

    megatron-rl bench codecs [--tokens 65536] [--layers 48] [--repeats 5] [--old PATH]

Input: ``[tokens, layers, top-8 of 128 experts]`` int64 routes (the issue's size by default).
Each repeat times, interleaved, every codec's encode/decode and the minimal baselines on the same
input; the table shows M token-layers/s (median) and the paired ratio codec/baseline time
(median [min-max]); ``--old PATH`` also times a saved copy of the previous ``codec.py``.

Baselines (numpy, one thread): encode = range check (min/max) + duplicate check (pairwise
column compares) + cast; packed encode = that + numpy sort + combinatorial rank + bit-pack
(byte-identical to the codec); decode = cast; packed decode = numpy unpack + float-root unrank.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch/numpy start their thread pools

import argparse
import importlib.util
import math
import statistics
import sys
import time

import numpy as np
import torch

from megatron_rl.routing.codec import RoutingBlob, RoutingCodec

torch.set_num_threads(1)


# ------------------------------------------------------------------------- numpy baselines
def base_check_cast(routes: np.ndarray, num_experts: int, dtype) -> np.ndarray:
    if routes.min() < 0 or routes.max() >= num_experts:
        raise ValueError("out of range")
    out = routes.astype(dtype)
    flat = out.reshape(-1, out.shape[-1])
    topk = flat.shape[1]
    repeated = np.zeros(flat.shape[0], dtype=bool)
    for i in range(topk):
        for j in range(i + 1, topk):
            repeated |= flat[:, i] == flat[:, j]
    if repeated.any():
        raise ValueError("duplicate")
    return out


def _binom_table(num_experts: int, topk: int) -> np.ndarray:
    return np.array(
        [[math.comb(n, j) for j in range(topk + 1)] for n in range(num_experts + 1)],
        dtype=np.int64,
    )


def base_pack(routes: np.ndarray, num_experts: int, bits: int) -> np.ndarray:
    topk = routes.shape[-1]
    flat = routes.reshape(-1, topk)
    if flat.min() < 0 or flat.max() >= num_experts:
        raise ValueError("out of range")
    ordered = np.sort(flat.astype(np.uint8), axis=1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        raise ValueError("duplicate")
    table = _binom_table(num_experts, topk)
    ranks = table[ordered[:, 0], 1].copy()
    for j in range(2, topk + 1):
        ranks += table[ordered[:, j - 1], j]
    num_items = ranks.size
    num_bytes = (num_items * bits + 7) // 8
    offset = np.arange(num_items, dtype=np.int64) * bits
    word, shift = offset >> 6, (offset & 63).astype(np.uint64)
    r = ranks.view(np.uint64)
    words = np.zeros(num_bytes // 8 + 2, dtype=np.uint64)
    # words touched by consecutive items are disjoint bit ranges: summing = OR
    _scatter_or(words, word, r << shift)
    spill = shift + np.uint64(bits) > 64
    _scatter_or(words, word[spill] + 1, r[spill] >> (np.uint64(64) - shift[spill]))
    return words.view(np.uint8)[:num_bytes].copy()


def _scatter_or(words: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    # index is non-decreasing: OR runs of equal index with a segmented reduction
    if index.size == 0:
        return
    starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]])
    words[index[starts]] |= np.bitwise_or.reduceat(values, starts)


def base_unpack(data: np.ndarray, num_items: int, num_experts: int, topk: int, bits: int):
    padded = np.zeros((data.size // 8 + 2) * 8, dtype=np.uint8)
    padded[: data.size] = data
    words = padded.view(np.uint64)
    offset = np.arange(num_items, dtype=np.int64) * bits
    word, shift = offset >> 6, (offset & 63).astype(np.uint64)
    high = np.where(shift == 0, np.uint64(0), words[word + 1] << ((np.uint64(64) - shift) & 63))
    ranks = (((words[word] >> shift) | high) & np.uint64((1 << bits) - 1)).astype(np.int64)
    table = _binom_table(num_experts, topk)
    out = np.empty((num_items, topk), dtype=np.int64)
    for j in range(topk, 1, -1):
        column = table[:, j]
        root = math.exp(math.lgamma(j + 1) / j)
        c = (np.power(ranks.astype(np.float64), 1.0 / j) * root + (j - 1) / 2).astype(np.int64)
        np.clip(c, j - 1, num_experts - 1, out=c)
        c -= column[c] > ranks
        c += column[c + 1] <= ranks
        out[:, j - 1] = c
        ranks = ranks - column[c]
    out[:, 0] = ranks
    return out


# ------------------------------------------------------------------------- harness
def load_old(path: str):
    spec = importlib.util.spec_from_file_location("old_routing_codec", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.RoutingCodec


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--old", default=None, help="path to a saved previous codec.py")
    args = parser.parse_args(argv)
    num_e, k = args.experts, args.topk
    num_items = args.tokens * args.layers
    gen = torch.Generator().manual_seed(0)
    # random top-k sets in score order (not ascending), built in chunks to bound memory
    chunks = []
    for start in range(0, num_items, 1 << 18):
        n = min(1 << 18, num_items - start)
        chunks.append(torch.rand(n, num_e, generator=gen).topk(k, dim=-1).indices)
    routes = torch.cat(chunks).reshape(args.tokens, args.layers, k)
    routes_np = routes.numpy()
    old_cls = load_old(args.old) if args.old else None

    cases = {}  # name -> (fn, baseline name)
    baselines = {}
    for name in ("uint8", "int32", "packed"):
        new = RoutingCodec(num_e, k, name)
        blob = new.encode(routes)
        cases[f"{name} encode"] = ("enc", name, new, blob)
        cases[f"{name} decode"] = ("dec", name, new, blob)
    bits = RoutingCodec(num_e, k, "packed").bits
    npdt = {"uint8": np.uint8, "int32": np.int32}
    for name in ("uint8", "int32"):
        baselines[f"{name} encode"] = lambda name=name: base_check_cast(
            routes_np, num_e, npdt[name]
        )
        data = cases[f"{name} decode"][3].data.numpy()
        baselines[f"{name} decode"] = lambda data=data: data.astype(np.int64)
    packed_blob = cases["packed decode"][3]
    baselines["packed encode"] = lambda: base_pack(routes_np, num_e, bits)
    baselines["packed decode"] = lambda: base_unpack(
        packed_blob.data.numpy(), num_items, num_e, k, bits
    )
    # byte-identical / same-sets sanity checks before timing
    assert np.array_equal(baselines["packed encode"](), packed_blob.data.numpy())
    base_sets = baselines["packed decode"]()
    assert np.array_equal(base_sets, np.sort(routes_np.reshape(-1, k), axis=1))

    def run_new(case):
        kind, _, codec, blob = case
        return (lambda: codec.encode(routes)) if kind == "enc" else (lambda: codec.decode(blob))

    def run_old(case):
        kind, name, _, blob = case
        codec = old_cls(num_e, k, name)
        if kind == "enc":
            return lambda: codec.encode(routes)
        return lambda: codec.decode(RoutingBlob(blob.data, name, blob.num_tokens, blob.num_layers))

    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for label, case in cases.items():
            runners = {"new": run_new(case), "base": baselines[label]}
            if old_cls is not None:
                runners["old"] = run_old(case)
            for who, fn in runners.items():
                seconds, _ = timed(fn)
                times.setdefault((label, who), []).append(seconds)

    def rate(label, who):
        return f"{num_items / statistics.median(times[label, who]) / 1e6:.1f}"

    def ratio(label, who):
        r = [a / b for a, b in zip(times[label, who], times[label, "base"], strict=True)]
        return f"{statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"

    print(
        f"{args.tokens} tokens x {args.layers} layers, top-{k} of {num_e}; "
        f"{args.repeats} interleaved repeats, 1 thread; M token-layers/s (median); "
        "ratio = time / baseline time, paired per repeat: median [min-max]"
    )
    header = ["case", "baseline", "new", "new/base"]
    if old_cls is not None:
        header += ["old", "old/base"]
    print(" | ".join(f"{h:>22}" for h in header))
    for label in cases:
        row = [label, rate(label, "base"), rate(label, "new"), ratio(label, "new")]
        if old_cls is not None:
            row += [rate(label, "old"), ratio(label, "old")]
        print(" | ".join(f"{c:>22}" for c in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
