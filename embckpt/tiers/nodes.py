"""Which node each rank runs on: the hostname, or ``EMBCKPT_NODE`` (tests simulate nodes on one
machine with it), gathered over the process group so that every rank knows every node's ranks.

Files are found by node, never by rank: a relaunch may number a node's ranks differently.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from embckpt.collective import Collective
from embckpt.storage.layout import node_folder

NODE_ENV = "EMBCKPT_NODE"


def node_id() -> str:
    """This process's node: ``EMBCKPT_NODE`` if set, else the hostname.

    Raises:
        ValueError: the id could not name a folder (``storage/layout.py``).
    """
    return node_folder(os.environ.get(NODE_ENV) or socket.gethostname())


@dataclass(frozen=True)
class Nodes:
    """Every rank's node, as this rank sees it after the gather.

    Attributes:
        of_rank: the node of each rank, by rank.
        rank: this rank.
    """

    of_rank: tuple[str, ...]
    rank: int

    @classmethod
    def gather(cls, comm: Collective) -> Nodes:
        """Every rank's :func:`node_id` (collective)."""
        return cls(tuple(comm.all_gather(node_id())), comm.rank)

    @property
    def me(self) -> str:
        return self.of_rank[self.rank]

    @property
    def names(self) -> list[str]:
        """The nodes, sorted: the ring replicas follow."""
        return sorted(set(self.of_rank))

    def ranks(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.of_rank) if n == node]

    def leader(self, node: str) -> int:
        """The rank that speaks for ``node``: its lowest."""
        return min(self.ranks(node))

    def server(self, node: str, asker: int) -> int:
        """The rank of ``node`` that sends files to rank ``asker``: the one at the asker's place
        among its own node's ranks (round ``node``'s), so that each of ``node``'s ranks serves
        its share of a lost node's ranks at once, not the leader all of them in turn. Any rank
        of a node reads the node's folder."""
        ranks = self.ranks(node)
        return ranks[self.ranks(self.of_rank[asker]).index(asker) % len(ranks)]

    @property
    def is_leader(self) -> bool:
        return self.leader(self.me) == self.rank

    def peer(self, node: str) -> str | None:
        """The node that keeps ``node``'s replica: the next one in :attr:`names`, round the
        ring; None with a single node."""
        names = self.names
        if len(names) < 2:
            return None
        return names[(names.index(node) + 1) % len(names)]
