"""What the engine and a model worker process send each other over the worker's connection
(pickled): one frozen type per kind, dispatched by type on each side.

Engine to worker: ``Execute`` (a step's forward), ``Rung`` (the same, written once into the
shared ring for every tensor-parallel rank: ``step_broadcast.py``), ``Sample`` (sample that
step; its bitmask, if any, lies in the slot's shared buffer) and ``Shutdown``. Worker to
engine: ``Ready`` once, or ``Failed`` (why it cannot start, or why a tensor-parallel step
failed), then one ``worker_main.Reply`` per ``Sample``, in order.

This module imports nothing heavy: a worker that fails to import its model code can still
say why with ``Failed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.engine.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class Execute:
    """Run the forward of step ``so`` (its sample follows as ``Sample``)."""

    so: SchedulerOutput


@dataclass(frozen=True)
class Rung:
    """The ``Execute`` at sequence number ``seq`` of the shared step ring."""

    seq: int


@dataclass(frozen=True)
class Sample:
    """Sample step ``step_id``; the grammar rows of ``grammar_ids`` (``row_counts`` rows
    each) are in bitmask slot ``slot``, and the tokens go to that slot's sampled buffer."""

    step_id: int
    slot: int
    grammar_ids: tuple[str, ...] = ()
    row_counts: tuple[int, ...] = ()


@dataclass(frozen=True)
class Shutdown:
    """Stop serving and exit."""


@dataclass(frozen=True)
class Ready:
    """The worker built its model and serves steps from now on."""


@dataclass(frozen=True)
class Failed:
    """The worker cannot go on; ``detail`` says why (a traceback)."""

    detail: str


WorkerCommand = Execute | Rung | Sample | Shutdown


def failure_text(message: object) -> str:
    """What a worker's message that is not the one expected says: a ``Failed``'s detail, a
    bare ``str`` as is (the bootstrap's reason when it cannot import this module), or the
    message itself."""
    if isinstance(message, Failed):
        return message.detail
    if isinstance(message, str):
        return message
    return f"unexpected message from the model worker: {message!r:.2000}"
