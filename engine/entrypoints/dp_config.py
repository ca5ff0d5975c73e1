"""``DataParallelConfig``: how many engine replicas to run, where, and how to route to them
(read by ``DataParallelLLM``; light to import, for the CLI)."""

from __future__ import annotations

from dataclasses import dataclass

DATA_PARALLEL_BACKENDS = ("ray",)


@dataclass(frozen=True)
class DataParallelConfig:
    """How to run replicas.

    Attributes:
        size: number of engine replicas (>= 1).
        backend: "ray" (the only one).
        ray_address: an existing cluster ("auto", "host:port" or "ray://host:port"); None
            starts a local one sized to this machine's cores, unless Ray is already started.
        cpus_per_replica: CPUs Ray reserves for each replica and its torch threads; None:
            the cluster's CPUs / size, at least 1 (a local cluster has this machine's cores).
        grammar_affinity: route requests with the same grammar to one replica.
        balance_tokens: how many outstanding tokens the replica holding a grammar may be
            above the least loaded one and still get its requests.
        max_restarts: how often Ray restarts a replica that died (-1: always).

    Raises:
        ValueError: a field out of range, naming it.
    """

    size: int
    backend: str = "ray"
    ray_address: str | None = None
    cpus_per_replica: int | None = None
    grammar_affinity: bool = True
    balance_tokens: int = 4096
    max_restarts: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"data_parallel_size must be an int >= 1, got {self.size!r}")
        if self.backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(
                f"distributed executor backend for data parallelism must be one of "
                f"{DATA_PARALLEL_BACKENDS}, got {self.backend!r}"
            )
        if self.cpus_per_replica is not None and (
            not isinstance(self.cpus_per_replica, int) or self.cpus_per_replica < 1
        ):
            raise ValueError(f"cpus_per_replica must be an int >= 1, got {self.cpus_per_replica!r}")
        if not isinstance(self.balance_tokens, int) or self.balance_tokens < 0:
            raise ValueError(f"balance_tokens must be an int >= 0, got {self.balance_tokens!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < -1:
            raise ValueError(f"max_restarts must be an int >= -1, got {self.max_restarts!r}")
