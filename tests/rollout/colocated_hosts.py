"""``python -m megatron_rl.train`` as if each torchrun rank ran on a node of its own.

Run by torchrun as the script (``torchrun ... tests/rollout/colocated_hosts.py <trainer flags>``):
global rank r takes the loopback address ``127.0.0.(2 + r)`` as its host's only address
(`megatron_rl.rollout.server_hosts.is_this_host`), so a server on ``127.0.0.3`` is "another node"
to rank 0, as a server on node 1 is to rank 0 of a 4-node job. Everything else is the real CLI.
"""

from __future__ import annotations

import os
import sys

from megatron_rl.rollout import server_hosts


def rank_host(rank: int) -> str:
    """The loopback address playing rank ``rank``'s node."""
    return f"127.0.0.{2 + rank}"


def main() -> int:
    mine = rank_host(int(os.environ["RANK"]))
    server_hosts.is_this_host = lambda address: address == mine
    from megatron_rl.train.__main__ import main as train

    return train(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
