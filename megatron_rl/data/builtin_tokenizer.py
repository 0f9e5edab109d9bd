"""The built-in task's tokenizer: 16 fixed symbols, no files.

Its ids are fixed (and never change between releases):

    ==  =======  ============================
    id  symbol   role
    ==  =======  ============================
    0   <pad>    pad_token_id
    1   <bos>    first token of every prompt
    2   <eos>    eos_token_id
    3   +        operator
    4   =        end of the question
    5+d d        digit d, d = 0..9 (ids 5..14)
    15  ?        unused filler (never right)
    ==  =======  ============================

``vocab_size`` is 16, divisible by any tensor-parallel size up to 16.
"""

from __future__ import annotations

from megatron_rl.data.symbol_tokenizer import SymbolTokenizer

PAD_ID, BOS_ID, EOS_ID, PLUS_ID, EQUALS_ID, DIGIT0_ID = 0, 1, 2, 3, 4, 5
SYMBOLS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "+", "=", *map(str, range(10)), "?")
"""``SYMBOLS[id]`` is the symbol of token ``id``."""
_SPECIAL_IDS = frozenset({PAD_ID, BOS_ID, EOS_ID})


class BuiltinTokenizer(SymbolTokenizer):
    """The task's whitespace tokenizer over `SYMBOLS` (satisfies the `Tokenizer` protocol).

    ``encode`` splits on whitespace and maps each symbol to its id (ValueError for an unknown
    symbol); ``decode`` joins the symbols of the non-special ids with single spaces and raises
    ValueError for an id outside ``[0, vocab_size)``.
    """

    SYMBOLS = SYMBOLS
    HIDDEN_IDS = _SPECIAL_IDS
    VOCABULARY = "the built-in task's vocabulary"
    eos_token_id: int = EOS_ID
    pad_token_id: int = PAD_ID
    bos_token_id: int = BOS_ID
