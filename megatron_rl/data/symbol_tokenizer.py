"""A whitespace tokenizer over a fixed tuple of symbols: the built-in tasks' tokenizers.

A subclass names its ``SYMBOLS`` (``SYMBOLS[id]`` is the symbol of id), the ids ``decode``
leaves out (``HIDDEN_IDS``), its special ids and the vocabulary's name for error messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar


class SymbolTokenizer:
    """``encode`` splits on whitespace and maps each symbol to its id (ValueError for an unknown
    symbol); ``decode`` joins the symbols of every id outside ``HIDDEN_IDS`` with single spaces
    and raises ValueError for an id outside ``[0, vocab_size)`` (the `Tokenizer` protocol)."""

    SYMBOLS: ClassVar[tuple[str, ...]] = ()
    HIDDEN_IDS: ClassVar[frozenset[int]] = frozenset()
    VOCABULARY: ClassVar[str] = ""  # e.g. "the built-in task's vocabulary"
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int
    has_chat_template: bool = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.vocab_size = len(cls.SYMBOLS)
        cls._ids = {symbol: index for index, symbol in enumerate(cls.SYMBOLS)}

    def encode(self, text: str) -> list[int]:
        ids = []
        for symbol in text.split():
            if symbol not in self._ids:
                raise ValueError(f"symbol {symbol!r} is not in {self.VOCABULARY} {self.SYMBOLS}")
            ids.append(self._ids[symbol])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        symbols = []
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside [0, {self.vocab_size})")
            if token not in self.HIDDEN_IDS:
                symbols.append(self.SYMBOLS[token])
        return " ".join(symbols)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"
