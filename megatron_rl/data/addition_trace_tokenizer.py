"""The addition-trace task's tokenizer: 16 fixed symbols, no files.

Its ids are fixed (and never change between releases):

    ==  =======  =================================================
    id  symbol   role
    ==  =======  =================================================
    0   <pad>    pad_token_id
    1   <bos>    first token of every prompt
    2   <eos>    eos_token_id, ends every correct response
    3   +        operator (prompt and trace)
    4   =        end of the question; in the trace, before a column's sum and the answer
    5   ;        end of one column of the trace
    6+d d        digit d, d = 0..9 (ids 6..15)
    ==  =======  =================================================

``vocab_size`` is 16, divisible by any tensor-parallel size up to 16; the ``tiny*`` presets size
their vocabulary to it (`megatron_rl.train.task.load_policy_config`).

``decode`` drops ``<pad>`` and ``<eos>`` only: a ``<bos>`` inside a response stays visible as
``<bos>``, so the exact reward (`megatron_rl.rewards.addition_trace_reward`) cannot be fooled by a
stray token the text would otherwise hide.
"""

from __future__ import annotations

from megatron_rl.data.symbol_tokenizer import SymbolTokenizer

PAD_ID, BOS_ID, EOS_ID, PLUS_ID, EQUALS_ID, END_COLUMN_ID, DIGIT0_ID = 0, 1, 2, 3, 4, 5, 6
SYMBOLS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "+", "=", ";", *map(str, range(10)))
"""``SYMBOLS[id]`` is the symbol of token ``id``."""
_HIDDEN_IDS = frozenset({PAD_ID, EOS_ID})


class AdditionTraceTokenizer(SymbolTokenizer):
    """Whitespace tokenizer over `SYMBOLS` (satisfies the `Tokenizer` protocol).

    ``encode`` splits on whitespace and maps each symbol to its id (ValueError for an unknown
    symbol); ``decode`` joins the symbols of every id but ``<pad>`` / ``<eos>`` with single
    spaces and raises ValueError for an id outside ``[0, vocab_size)``. For any text of known
    symbols, ``decode(encode(text)) == " ".join(text.split())`` (``<pad>``/``<eos>`` aside).
    """

    SYMBOLS = SYMBOLS
    HIDDEN_IDS = _HIDDEN_IDS
    VOCABULARY = "the addition-trace vocabulary"
    eos_token_id: int = EOS_ID
    pad_token_id: int = PAD_ID
    bos_token_id: int = BOS_ID
