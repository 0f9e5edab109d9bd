"""The losses the project ships, with their default aggregation: one list for every test that
runs each of them (the registry must never lose one)."""

DEFAULT_AGG = {
    "grpo": "seq-mean-token-mean",
    "dapo": "token-mean",
    "gspo": "seq-mean-token-mean",
    "gspo_token": "seq-mean-token-mean",
    "vespo": "token-mean",
    "epic": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "cispo": "token-mean",
    "topr": "seq-mean-token-sum",
    "ctpo": "seq-mean-token-mean",
    "ripo": "token-mean",
}
PAPER_LOSSES = tuple(DEFAULT_AGG)
