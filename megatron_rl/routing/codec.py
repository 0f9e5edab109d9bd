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

Encoding is vectorised torch (CPU or GPU): packing places each rank at its bit offset in a
stream of int64 words (two word writes per set), with no per-bit expansion. Packed decoding on
CPU runs in numpy over cache-sized chunks (one unaligned 8-byte load per rank, a lookup-table
root guess and one exact correction per expert); other devices use the torch path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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


def _numpy_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """Uninitialised CPU tensor whose memory numpy allocates (None if numpy lacks ``dtype``).

    numpy asks the kernel for transparent huge pages on large buffers and torch's allocator
    does not, so filling a fresh ``[T, L, K]`` int64 output faults far fewer pages this way.
    """
    try:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None
    return torch.from_numpy(np.empty(shape, dtype=np_dtype))


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
        # narrowest dtype holding every expert id: validation/sorting works on it
        self._narrow = next(
            d
            for d in (torch.uint8, torch.int16, torch.int32, torch.int64)
            if _max_value(d) >= num_experts - 1
        )
        self._tables: dict[str, list[torch.Tensor]] = {}
        self._luts: tuple[int, list[tuple[np.ndarray, ...]]] | None = None
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
        narrow, columns = self._check(routes_TLK)
        num_tokens, num_layers, _ = routes_TLK.shape
        if self.codec != "packed":
            dtype = DTYPES[self.codec]
            data = narrow if narrow is not None and narrow.dtype == dtype else routes_TLK
            data = data.to(dtype).contiguous()
        else:
            data = self._pack(columns, num_tokens * num_layers)
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
        shape = (blob.num_tokens, blob.num_layers, self.topk)
        on_cpu = blob.data.device.type == "cpu"
        if self.codec != "packed":
            out = _numpy_empty(shape, dtype) if on_cpu and blob.data.dtype != dtype else None
            return blob.data.to(dtype) if out is None else out.copy_(blob.data)
        num_items = blob.num_tokens * blob.num_layers
        if on_cpu and self.bits <= 57 and self._lookup_tables() is not None:
            out = _numpy_empty((num_items, self.topk), dtype)
            if out is None:
                out = _numpy_empty((num_items, self.topk), torch.int64)
            self._decode_numpy(blob.data.contiguous().numpy(), out.numpy())
            return out.reshape(shape).to(dtype)
        sets = self._unrank(self._unpack(blob.data, num_items))
        return sets.reshape(shape).to(dtype)

    def validate(self, routes_TLK: torch.Tensor) -> None:
        """``ValueError`` naming the first bad position: rank, top-k, range, repeats."""
        self._check(routes_TLK)

    # ---------------------------------------------------------------- validation internals
    def _check(
        self, routes_TLK: torch.Tensor
    ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """Validate; return the routes cast to the narrowest dtype holding ``E - 1`` and their
        ascending columns ``[K] x [T*L]`` in it (both None when empty).

        No full sort: the range check is one min/max pass, the duplicate check runs a fixed
        sorting network over the K columns (``O(K log^2 K)`` elementwise min/max on
        contiguous narrow-dtype columns) and compares neighbours. The network's output is
        exactly what the packed rank needs, so packing sorts once.
        """
        if not isinstance(routes_TLK, torch.Tensor) or routes_TLK.is_floating_point():
            raise ValueError("routes must be an integer torch.Tensor [tokens, moe_layers, topk]")
        if routes_TLK.dim() != 3 or routes_TLK.shape[-1] != self.topk:
            raise ValueError(
                f"routes must be [tokens, moe_layers, topk={self.topk}], got shape "
                f"{tuple(routes_TLK.shape)}"
            )
        if routes_TLK.numel() == 0:
            return None, None
        values = routes_TLK.to(torch.uint8) if routes_TLK.dtype == torch.bool else routes_TLK
        low, high = torch.aminmax(values)
        if int(low) < 0 or int(high) >= self.num_experts:
            self._raise_first_error(routes_TLK)
        narrow = values.to(self._narrow)
        if self.topk == 1:
            return narrow, [narrow.reshape(-1)]
        columns = list(narrow.reshape(-1, self.topk).t().contiguous().unbind(0))
        for i, j in _sorting_network(self.topk):
            columns[i], columns[j] = (
                torch.minimum(columns[i], columns[j]),
                torch.maximum(columns[i], columns[j]),
            )
        repeated = columns[0] == columns[1]
        for k in range(1, self.topk - 1):
            repeated |= columns[k] == columns[k + 1]
        if bool(repeated.any()):
            self._raise_first_error(routes_TLK)
        return narrow, columns

    def _raise_first_error(self, routes_TLK: torch.Tensor) -> None:
        """Slow path (only on bad input): locate and report the first offending position."""
        bad = (routes_TLK < 0) | (routes_TLK >= self.num_experts)
        if bool(bad.any()):
            pos = [int(i) for i in bad.nonzero()[0]]
            value = int(routes_TLK[tuple(pos)])
            raise ValueError(
                f"routes{pos} holds expert {value}, outside [0, num_experts={self.num_experts})"
            )
        sorted_TLK = routes_TLK.sort(dim=-1).values
        repeated = (sorted_TLK[..., 1:] == sorted_TLK[..., :-1]).any(dim=-1)
        pos = [int(i) for i in repeated.nonzero()[0]]
        raise ValueError(
            f"routes{pos} repeats an expert within its top-{self.topk} set: "
            f"{routes_TLK[tuple(pos)].tolist()}"
        )

    # ---------------------------------------------------------------- packed internals
    def _binomials(self, device: torch.device) -> list[torch.Tensor]:
        """``tables[j]`` = int64 ``C(n, j)`` for ``n in [0, E]`` (saturated at int64 max)."""
        key = str(device)
        if key not in self._tables:
            cap = _max_value(torch.int64)
            self._tables[key] = [
                torch.tensor(
                    [min(math.comb(n, j), cap) for n in range(self.num_experts + 1)],
                    dtype=torch.int64,
                    device=device,
                )
                for j in range(self.topk + 1)
            ]
        return self._tables[key]

    def _pack(self, columns: list[torch.Tensor] | None, num_items: int) -> torch.Tensor:
        num_bytes = (num_items * self.bits + 7) // 8
        if columns is None:  # no items
            return torch.zeros(num_bytes, dtype=torch.uint8)
        device = columns[0].device
        tables = self._binomials(device)
        # rank = sum_j C(c_j, j) over the ascending experts c_1 < ... < c_K
        ranks_N = tables[1].index_select(0, columns[0].long())
        for j in range(2, self.topk + 1):
            ranks_N += tables[j].index_select(0, columns[j - 1].long())
        # item i occupies bits [i*b, (i+1)*b) of a little-endian stream of int64 words; its low
        # part goes to word w = i*b // 64 at shift s, its high part (if any) to word w + 1.
        # The parts of different items never overlap, so adding them is a bitwise OR.
        offset = torch.arange(num_items, device=device, dtype=torch.int64) * self.bits
        word, shift = offset >> 6, offset & 63
        words = torch.zeros(num_bytes // 8 + 2, dtype=torch.int64, device=device)
        words.index_add_(0, word, ranks_N << shift)
        spill = (shift + self.bits > 64).nonzero().squeeze(1)
        high = ranks_N[spill] >> (64 - shift[spill])
        words.index_add_(0, word[spill] + 1, high)
        return words.view(torch.uint8)[:num_bytes].clone()

    def _unpack(self, data: torch.Tensor, num_items: int) -> torch.Tensor:
        """torch path: int64 ranks ``[N]`` from the packed bytes (any device, any ``bits``)."""
        device = data.device
        padded = torch.zeros((data.numel() // 8 + 2) * 8, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        words = padded.view(torch.int64)
        offset = torch.arange(num_items, device=device, dtype=torch.int64) * self.bits
        word, shift = offset >> 6, offset & 63
        # ``>>`` is arithmetic: the sign-extended top ``shift`` bits land at or above bit
        # ``64 - shift``; for an item that fits in its word they are above ``bits`` and the mask
        # drops them, for one that spills into the next word they are replaced by its high part.
        mask = (1 << self.bits) - 1
        ranks_N = (words[word] >> shift) & mask
        spill = (shift + self.bits > 64).nonzero().squeeze(1)
        if spill.numel():
            word, shift = word[spill], shift[spill]
            low = (words[word] >> shift) & ((1 << (64 - shift)) - 1)
            ranks_N[spill] = low | ((words[word + 1] << (64 - shift)) & mask)
        return ranks_N

    def _unrank(self, ranks_N: torch.Tensor) -> torch.Tensor:
        """torch path, ranks ``[N]`` -> sets ``[N, K]``; greedy, largest expert first:
        ``c_j = max{n : C(n, j) <= rem}``.

        ``c_j`` starts from the float root ``(j! rem)^(1/j) + (j-1)/2`` (``C(n, j)`` ~
        ``(n - (j-1)/2)^j / j!``), then exact integer steps down/up against the table fix the
        (rare, at most one or two) off-by-one estimates.
        """
        num_items = ranks_N.numel()
        tables = self._binomials(ranks_N.device)
        experts = torch.empty(self.topk, num_items, dtype=torch.int64, device=ranks_N.device)
        if num_items == 0:
            return experts.t()
        if bool((ranks_N >= tables[self.topk][self.num_experts]).any()):
            raise ValueError("packed routing data is corrupt: a rank does not decode to a set")
        remaining = ranks_N
        for j in range(self.topk, 1, -1):
            column = tables[j]
            root = math.exp(math.lgamma(j + 1) / j)
            c_j = remaining.double().pow_(1.0 / j).mul_(root).add_((j - 1) / 2).long()
            c_j.clamp_(j - 1, self.num_experts - 1)
            while True:  # estimate too high: step down
                value = column.index_select(0, c_j)
                over = value > remaining
                if not bool(over.any()):
                    break
                c_j -= over
            while True:  # estimate too low: step up
                under = column.index_select(0, c_j + 1) <= remaining
                if not bool(under.any()):
                    break
                c_j += under
                value = column.index_select(0, c_j)
            experts[j - 1] = c_j
            remaining = remaining - value
        experts[0] = remaining  # C(n, 1) = n
        return experts.t()

    # ---------------------------------------------------------------- packed decode, numpy (CPU)
    _CHUNK = 16384  # items per chunk: a dozen int64 work buffers stay in a 1-2 MiB L2

    def _lookup_tables(self) -> tuple[int, list[tuple[np.ndarray, ...]]] | None:
        """Per ``j = K..2``: ``(guess, C(n, j), C(n + 1, j))`` and the bucket bits ``m``.

        Bucket of ``rem >= 1``: the float64 bits of ``rem`` shifted right by ``52 - m``, i.e.
        exponent and top ``m`` mantissa bits, minus ``(1023 << m) - 1`` (bucket 1 = ``rem == 1``;
        ``rem == 0`` gives a negative index, clipped to 0). ``guess[b] = c_j(lo_b)``, with
        ``c_j(x) = max{n : C(n, j) <= x}`` and ``lo_b`` the smallest integer that rounds into
        ``b``. ``m`` is the least for which every bucket spans at most one step of ``c_j``, so
        ``c_j(rem) = guess + [C(guess + 1, j) <= rem]`` exactly. None when ``m`` would exceed 10.
        """
        if self._luts is None:
            self._luts = (0, [])
            for m in range(1, 11):
                tables = [self._lookup_table(j, m) for j in range(self.topk, 1, -1)]
                if all(t is not None for t in tables):
                    self._luts = (m, tables)
                    break
        return self._luts if self._luts[0] else None

    def _lookup_table(self, j: int, m: int) -> tuple[np.ndarray, ...] | None:
        cap = _max_value(torch.int64)
        binom = np.array(
            [min(math.comb(n, j), cap) for n in range(self.num_experts + 2)], dtype=np.int64
        )
        bucket = np.arange((self.bits + 1) << m, dtype=np.int64) + ((1023 << m) - 1)
        lo = (bucket << (52 - m)).view(np.float64)
        hi = ((bucket + 1) << (52 - m)).view(np.float64)
        lo_int = np.ceil(lo - np.spacing(lo)).astype(np.int64)  # rounding up into the bucket
        hi_int = np.ceil(hi).astype(np.int64) - 1
        c_lo = np.searchsorted(binom, lo_int, side="right") - 1
        c_hi = np.searchsorted(binom, hi_int, side="right") - 1
        if int((c_hi - c_lo).max()) > 1:
            return None
        guess = np.minimum(c_lo, self.num_experts - 1)
        guess[0] = j - 1  # rem == 0
        return guess, binom, binom[1:].copy()

    def _decode_numpy(self, data: np.ndarray, out_NK: np.ndarray) -> None:
        """Packed bytes -> ascending sets in ``out_NK`` ``[N, K]`` (needs ``bits <= 57``).

        Items ``8g + r`` start at bit ``bits * (8g + r)``: byte ``bits * g + (bits * r) // 8``,
        shift ``(bits * r) % 8``; one unaligned little-endian 8-byte load holds the rank as
        ``shift + bits <= 64``. Per chunk of ranks, for ``j = K..2``: ``c_j`` from the lookup
        table, one exact correction, ``rem -= C(c_j, j)``; ``c_1 = rem``.
        """
        num_items, bits, topk = out_NK.shape[0], self.bits, self.topk
        if num_items == 0:
            return
        m, tables = self._lookup_tables()
        groups = (num_items + 7) // 8
        padded = np.zeros(groups * bits + 8, dtype=np.uint8)
        padded[: data.size] = data
        loads = [
            (
                np.ndarray((groups,), np.uint64, padded, offset=bits * r // 8, strides=(bits,)),
                np.uint64(bits * r % 8),
            )
            for r in range(8)
        ]
        chunk = self._CHUNK
        rem = np.empty(chunk, dtype=np.int64)
        rem_g8 = rem.view(np.uint64).reshape(-1, 8)
        as_float, index, c_j, value = (
            np.empty(chunk, dtype=t) for t in (np.float64, *[np.int64] * 3)
        )
        step = np.empty(chunk, dtype=bool)
        mask, offset = np.uint64((1 << bits) - 1), (1023 << m) - 1
        limit = math.comb(self.num_experts, topk)
        for start in range(0, num_items, chunk):
            n = min(chunk, num_items - start)
            g0, g1 = start // 8, (start + n + 7) // 8
            for r, (load, shift) in enumerate(loads):
                np.right_shift(load[g0:g1], shift, out=rem_g8[: g1 - g0, r])
            r_n = rem[:n]
            np.bitwise_and(r_n.view(np.uint64), mask, out=r_n.view(np.uint64))
            if int(r_n.max()) >= limit:
                raise ValueError("packed routing data is corrupt: a rank does not decode to a set")
            f_n, i_n, c_n, v_n, s_n = as_float[:n], index[:n], c_j[:n], value[:n], step[:n]
            out_n = out_NK[start : start + n]
            for j, (guess, binom, binom_next) in zip(range(topk, 1, -1), tables, strict=True):
                np.copyto(f_n, r_n, casting="unsafe")
                np.right_shift(f_n.view(np.int64), 52 - m, out=i_n)
                np.subtract(i_n, offset, out=i_n)
                np.take(guess, i_n, out=c_n, mode="clip")
                np.take(binom_next, c_n, out=v_n, mode="clip")
                np.less_equal(v_n, r_n, out=s_n)  # correction: c_j = guess + 1
                np.add(c_n, s_n, out=c_n)
                np.take(binom, c_n, out=v_n, mode="clip")
                np.subtract(r_n, v_n, out=r_n)
                np.copyto(out_n[:, j - 1], c_n, casting="unsafe")
            np.copyto(out_n[:, 0], r_n, casting="unsafe")


def _sorting_network(n: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort comparators for ``n`` inputs (min to the lower index).

    Built for the next power of two; comparators touching a position ``>= n`` are dropped,
    which is the same as padding with +inf values that never move.
    """
    if n not in _NETWORKS:
        size = 1 << max(0, (n - 1).bit_length())
        pairs = []
        p = 1
        while p < size:
            k = p
            while k >= 1:
                for j in range(k % p, size - k, 2 * k):
                    for i in range(min(k, size - j - k)):
                        if (i + j) // (2 * p) == (i + j + k) // (2 * p) and i + j + k < n:
                            pairs.append((i + j, i + j + k))
                k //= 2
            p *= 2
        _NETWORKS[n] = pairs
    return _NETWORKS[n]


_NETWORKS: dict[int, list[tuple[int, int]]] = {}
