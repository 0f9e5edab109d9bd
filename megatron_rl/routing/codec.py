"""Storage codecs for routed-expert indices: one top-k expert set per (token, MoE layer).

``RoutingCodec(num_experts, topk, dtype)`` encodes an integer tensor ``routes_TLK``
``[tokens, moe_layers, topk]`` into a ``RoutingBlob`` and back:

* ``uint8`` / ``int16`` / ``int32``: the indices as they are, in the given width
  (``K * width`` bytes per token-layer); ``auto`` picks the narrowest that holds
  ``num_experts - 1``. A width too narrow for the expert count is a ``ValueError``.
* ``packed``: each top-k *set* as its rank in the combinatorial number system,
  ``rank = sum_j C(c_j, j)`` over the ascending experts ``c_1 < ... < c_K``, bit-packed at
  ``ceil(log2 C(E, K))`` bits: 41 bits (5.125 bytes) per token-layer for 128 experts top-8, against
  8 bytes for uint8 and 32 for int32. Decoding returns the experts in ascending order (the set is
  what routing replay needs; Megatron gathers the gate probabilities at the given indices).

Everything is vectorised torch (CPU or GPU): packing places each rank at its bit offset in a
stream of int64 words (two word writes per set), with no per-bit expansion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32}
CODECS = ("auto", *DTYPES, "packed")


@dataclass(frozen=True, slots=True)
class RoutingBlob:
    """Encoded routes of ``num_tokens`` tokens x ``num_layers`` MoE layers."""

    data: torch.Tensor  # uint8/int16/int32 [T, L, K], or uint8 [bytes] for "packed"
    codec: str  # the resolved codec name ("uint8", "int16", "int32" or "packed")
    num_tokens: int
    num_layers: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _max_value(dtype: torch.dtype) -> int:
    return torch.iinfo(dtype).max


class RoutingCodec:
    """Encode/decode ``[T, L, K]`` expert indices; see the module docstring."""

    def __init__(self, num_experts: int, topk: int, dtype: str = "auto") -> None:
        if not (isinstance(num_experts, int) and num_experts >= 1):
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if not (isinstance(topk, int) and 1 <= topk <= num_experts):
            raise ValueError(f"topk must be an int in [1, num_experts={num_experts}], got {topk!r}")
        if dtype not in CODECS:
            raise ValueError(f"dtype={dtype!r} is unknown; choose one of {CODECS}")
        if dtype == "auto":
            dtype = next(n for n, d in DTYPES.items() if _max_value(d) >= num_experts - 1)
        if dtype in DTYPES and _max_value(DTYPES[dtype]) < num_experts - 1:
            raise ValueError(
                f"dtype={dtype!r} holds expert ids up to {_max_value(DTYPES[dtype])}, but "
                f"num_experts={num_experts} needs {num_experts - 1}; use 'auto' or a wider dtype"
            )
        self.num_experts, self.topk, self.codec = num_experts, topk, dtype
        self.bits = (
            max(1, math.ceil(math.log2(math.comb(num_experts, topk)))) if dtype == "packed" else 0
        )
        if self.bits > 63:
            raise ValueError(
                f"packed ranks of C({num_experts}, {topk}) need {self.bits} bits, more than an "
                "int64 holds; use dtype='auto'"
            )

    def __repr__(self) -> str:
        return (
            f"RoutingCodec(num_experts={self.num_experts}, topk={self.topk}, dtype={self.codec!r})"
        )

    def nbytes(self, num_tokens: int, num_layers: int) -> int:
        """Exact bytes that ``num_tokens x num_layers`` encoded top-k sets occupy."""
        items = num_tokens * num_layers
        if self.codec == "packed":
            return (items * self.bits + 7) // 8
        return items * self.topk * torch.tensor([], dtype=DTYPES[self.codec]).element_size()

    def bytes_per_token_layer(self) -> float:
        return self.bits / 8 if self.codec == "packed" else self.nbytes(1, 1)

    # ---------------------------------------------------------------- encode / decode
    def encode(self, routes_TLK: torch.Tensor) -> RoutingBlob:
        """Validate and encode an integer ``[tokens, moe_layers, topk]`` tensor."""
        self.validate(routes_TLK)
        num_tokens, num_layers, _ = routes_TLK.shape
        if self.codec != "packed":
            data = routes_TLK.to(DTYPES[self.codec]).contiguous()
        else:
            data = self._pack(routes_TLK.reshape(-1, self.topk))
        return RoutingBlob(data, self.codec, num_tokens, num_layers)

    def decode(self, blob: RoutingBlob, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``[tokens, moe_layers, topk]`` expert indices (ascending within a set if packed)."""
        if blob.codec != self.codec:
            raise ValueError(f"blob was encoded with {blob.codec!r}, this codec is {self.codec!r}")
        if blob.nbytes != self.nbytes(blob.num_tokens, blob.num_layers):
            raise ValueError(
                f"blob holds {blob.nbytes} bytes, but {blob.num_tokens} tokens x "
                f"{blob.num_layers} layers need {self.nbytes(blob.num_tokens, blob.num_layers)}"
            )
        if self.codec != "packed":
            return blob.data.to(dtype)
        sets = self._unpack(blob.data, blob.num_tokens * blob.num_layers)
        return sets.reshape(blob.num_tokens, blob.num_layers, self.topk).to(dtype)

    def validate(self, routes_TLK: torch.Tensor) -> None:
        """``ValueError`` naming the first bad position: rank, top-k, range, repeats."""
        if not isinstance(routes_TLK, torch.Tensor) or routes_TLK.is_floating_point():
            raise ValueError("routes must be an integer torch.Tensor [tokens, moe_layers, topk]")
        if routes_TLK.dim() != 3 or routes_TLK.shape[-1] != self.topk:
            raise ValueError(
                f"routes must be [tokens, moe_layers, topk={self.topk}], got shape "
                f"{tuple(routes_TLK.shape)}"
            )
        bad = (routes_TLK < 0) | (routes_TLK >= self.num_experts)
        if bool(bad.any()):
            pos = [int(i) for i in bad.nonzero()[0]]
            value = int(routes_TLK[tuple(pos)])
            raise ValueError(
                f"routes{pos} holds expert {value}, outside [0, num_experts={self.num_experts})"
            )
        if self.topk > 1:
            sorted_TLK = routes_TLK.sort(dim=-1).values
            repeated = (sorted_TLK[..., 1:] == sorted_TLK[..., :-1]).any(dim=-1)
            if bool(repeated.any()):
                pos = [int(i) for i in repeated.nonzero()[0]]
                raise ValueError(
                    f"routes{pos} repeats an expert within its top-{self.topk} set: "
                    f"{routes_TLK[tuple(pos)].tolist()}"
                )

    # ---------------------------------------------------------------- packed internals
    def _binomials(self, device: torch.device) -> torch.Tensor:
        """``[E, K + 1]`` int64 table of ``C(n, j)``."""
        table = [[math.comb(n, j) for j in range(self.topk + 1)] for n in range(self.num_experts)]
        return torch.tensor(table, dtype=torch.int64, device=device)

    def _pack(self, sets_NK: torch.Tensor) -> torch.Tensor:
        binom = self._binomials(sets_NK.device)
        experts = sets_NK.to(torch.int64).sort(dim=-1).values
        slots = torch.arange(1, self.topk + 1, device=experts.device)
        ranks_N = binom[experts, slots].sum(dim=-1)
        num_items = ranks_N.numel()
        num_bytes = (num_items * self.bits + 7) // 8
        # item i occupies bits [i*b, (i+1)*b) of a little-endian stream of int64 words; its low
        # part goes to word w = i*b // 64 at shift s, its high part (if any) to word w + 1.
        # The parts of different items never overlap, so adding them is a bitwise OR.
        offset = torch.arange(num_items, device=ranks_N.device, dtype=torch.int64) * self.bits
        word, shift = offset // 64, offset % 64
        words = torch.zeros(num_bytes // 8 + 2, dtype=torch.int64, device=ranks_N.device)
        words.index_add_(0, word, ranks_N << shift)
        spill = shift + self.bits > 64
        high = ranks_N[spill] >> (64 - shift[spill])
        words.index_add_(0, word[spill] + 1, high)
        return words.view(torch.uint8)[:num_bytes].clone()

    def _unpack(self, data: torch.Tensor, num_items: int) -> torch.Tensor:
        device = data.device
        padded = torch.zeros((data.numel() // 8 + 2) * 8, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        words = padded.view(torch.int64)
        offset = torch.arange(num_items, device=device, dtype=torch.int64) * self.bits
        word, shift = offset // 64, offset % 64
        all_ones = torch.full_like(shift, -1)
        # logical right shift of a signed word: clear the sign-extended top ``shift`` bits
        low_mask = torch.where(shift == 0, all_ones, (1 << (64 - shift).clamp(max=63)) - 1)
        low = (words[word] >> shift) & low_mask
        high = torch.where(shift == 0, 0, words[word + 1] << (64 - shift).clamp(max=63))
        ranks_N = (low | high) & ((1 << self.bits) - 1)
        return self._unrank(ranks_N)

    def _unrank(self, ranks_N: torch.Tensor) -> torch.Tensor:
        binom = self._binomials(ranks_N.device)
        remaining = ranks_N.clone()
        experts = torch.empty(ranks_N.numel(), self.topk, dtype=torch.int64, device=ranks_N.device)
        for j in range(self.topk, 0, -1):
            column = binom[:, j].contiguous()  # non-decreasing in n
            c_j = torch.searchsorted(column, remaining, right=True) - 1
            experts[:, j - 1] = c_j
            remaining = remaining - column[c_j]
        if bool((remaining != 0).any()):
            raise ValueError("packed routing data is corrupt: a rank does not decode to a set")
        return experts
