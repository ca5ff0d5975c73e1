"""``ReplicaRouter``: which data-parallel replica serves a request, by load and by grammar
affinity.

Load is the replica's outstanding tokens: for every request routed to it and not yet done,
its prompt length plus the tokens it may still generate. A structured request goes to the
replica that served its grammar last (that replica has it compiled and cached), unless that
replica is unhealthy or busy: more than ``balance_tokens`` above the least loaded healthy
replica. Everything else goes to the least loaded healthy replica (ties: the lowest index).
The router only counts; it never calls a replica. Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Grammars remembered for affinity; the oldest is forgotten past this (a replica's own compile
# cache is bounded too, so an old entry would likely miss there anyway).
_AFFINITY_ENTRIES = 4096


@dataclass(frozen=True)
class Route:
    """Where one request goes, and why.

    Attributes:
        replica: the replica's index.
        affinity: "hit" (sent to the replica that holds its grammar), "miss" (a grammar seen
            before, sent elsewhere because that replica was busy or down), "new" (a grammar
            not seen before) or None (no grammar).
    """

    replica: int
    affinity: str | None


class NoReplicaError(RuntimeError):
    """No replica is healthy: nothing can be routed."""


class ReplicaRouter:
    """Routes requests over ``size`` replicas (see the module docs).

    Args:
        size: number of replicas (>= 1).
        balance_tokens: how many outstanding tokens a replica holding a request's grammar
            may be above the least loaded one and still get it (>= 0).
        affinity: False routes by load alone (for measuring what affinity buys).

    Raises:
        ValueError: a bad ``size`` or ``balance_tokens``.
    """

    def __init__(self, size: int, balance_tokens: int = 4096, affinity: bool = True) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"data parallel size must be an int >= 1, got {size!r}")
        if not isinstance(balance_tokens, int) or balance_tokens < 0:
            raise ValueError(f"balance_tokens must be an int >= 0, got {balance_tokens!r}")
        self.size = size
        self.balance_tokens = balance_tokens
        self.affinity = affinity
        self._load = [0] * size
        self._healthy = [True] * size
        self._owner: OrderedDict[object, int] = OrderedDict()
        self.routed = [0] * size
        self.affinity_counts = {"hit": 0, "miss": 0, "new": 0}

    def route(self, grammar_key: object | None, cost: int) -> Route:
        """Picks the replica for a request costing ``cost`` tokens and adds the cost to its
        load (give it back with ``done``).

        Raises:
            NoReplicaError: no replica is healthy.
        """
        healthy = [i for i in range(self.size) if self._healthy[i]]
        if not healthy:
            raise NoReplicaError("no data-parallel replica is healthy")
        least = min(healthy, key=lambda i: (self._load[i], i))
        affinity: str | None = None
        choice = least
        if grammar_key is not None and self.affinity:
            owner = self._owner.get(grammar_key)
            if owner is None:
                affinity = "new"
            elif self._healthy[owner] and (
                self._load[owner] - self._load[least] <= self.balance_tokens
            ):
                affinity, choice = "hit", owner
            else:
                affinity = "miss"
            self._owner[grammar_key] = choice
            self._owner.move_to_end(grammar_key)
            while len(self._owner) > _AFFINITY_ENTRIES:
                self._owner.popitem(last=False)
            self.affinity_counts[affinity] += 1
        self._load[choice] += cost
        self.routed[choice] += 1
        return Route(choice, affinity)

    def done(self, replica: int, cost: int) -> None:
        """Gives back the load of a request that finished, failed or moved."""
        self._load[replica] = max(0, self._load[replica] - cost)

    def set_healthy(self, replica: int, healthy: bool) -> None:
        """Marks a replica up or down; a replica going down forgets its grammars (a restarted
        one starts with an empty cache)."""
        self._healthy[replica] = healthy
        if not healthy:
            for key in [k for k, owner in self._owner.items() if owner == replica]:
                del self._owner[key]

    def healthy(self, replica: int) -> bool:
        """Whether ``replica`` is taking requests."""
        return self._healthy[replica]

    def load(self, replica: int) -> int:
        """Outstanding tokens routed to ``replica``."""
        return self._load[replica]
