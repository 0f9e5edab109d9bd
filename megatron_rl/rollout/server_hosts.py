"""Which SGLang servers a trainer rank hands tensor handles to, and whether they are on its host.

The ``tensor`` weight-sync transport passes handles, not bytes: shared-memory names on CPU,
CUDA IPC handles on GPU, which only processes on the sender's host (on GPU: the sender's GPU)
can open. Which servers receive a rank's handles (`handle_servers`):

- not colocated: global rank 0 stages every bucket and posts it to every server, so every
  server must be on rank 0's host; the other ranks hand out nothing;
- colocated (``--colocate``, `weight_sync.rank_handles`): server i's TP rank r loads from
  trainer rank ``i * engine_ranks + r`` on its own GPU, so rank g hands its handles to server
  ``g // engine_ranks`` only. Rank 0 still posts every server its entries over HTTP, which
  crosses nodes; the handles inside were made on each server's own node.

So a 4-node colocated job checks on each rank the one server on its own node, never the
other nodes' (`check_same_host`).
"""

from __future__ import annotations

import contextlib
import socket
import urllib.parse
from collections.abc import Sequence


def handle_servers(
    urls: Sequence[str], *, rank: int, engine_ranks: int, colocated: bool
) -> list[str]:
    """The servers of ``urls`` that open handles made by trainer global rank ``rank``.

    Colocated: ``[urls[rank // engine_ranks]]`` (empty when the rank is past the last server;
    `rank_handles.HandleLink` refuses that layout with its own error); else every server on
    rank 0 and none elsewhere.
    """
    if colocated:
        server = rank // engine_ranks
        return [urls[server]] if server < len(urls) else []
    return list(urls) if rank == 0 else []


def is_this_host(address: str) -> bool:
    """Whether ``address`` (an IP address) is this machine's: loopback (``127.0.0.0/8``, ``::1``),
    an address a socket can bind here (any local interface's, whatever the hostname resolves
    to: on stock Debian/DGX-OS ``/etc/hosts`` maps ``gethostname()`` to ``127.0.1.1``, not to the
    interface a cluster's node name resolves to), or one the hostname resolves to."""
    if address.startswith("127.") or address == "::1":
        return True
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.bind((address, 0))  # only a local interface's address can be bound
        return True
    own: set[str] = set()
    with contextlib.suppress(OSError):
        own = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    return address in own


def check_same_host(url: str) -> None:
    """ValueError unless every address ``url``'s host resolves to is this machine's
    (`is_this_host`): a handle made here opens only on this host."""
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as err:
        raise ValueError(f"{url}: cannot resolve {host!r}: {err}") from None
    if not all(is_this_host(a) for a in addresses):
        raise ValueError(
            f"--weight-sync-transport tensor: {url} is not on this host ({socket.gethostname()}); "
            "tensor handles only reach servers on the sender's node and GPUs. Colocated "
            "(--colocate), each trainer rank's server must run on its node (server i on the node "
            "of ranks i * --sglang-engine-ranks ...); otherwise use --weight-sync-transport "
            "distributed"
        )
