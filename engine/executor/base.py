"""The executor interface the engine core talks to, and how it waits for results.

``execute_model`` queues a step's forward, ``sample_tokens`` queues its sampling and returns
an ``AsyncOutput``, and ``AsyncOutput.get_output()`` is the one place where the engine thread
waits for device work. Implementations: ``UniExecutor`` (``uni``: the runner in this process;
synchronous on the CPU, queued on the runner's stream on CUDA) and ``MultiprocExecutor``
(``multiproc``: the runner in a worker process, so a CPU forward overlaps the engine thread).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from baton.engine.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from baton.engine.worker.cpu_threads import ThreadState


class ExecutorError(RuntimeError):
    """The executor cannot run the model any more (e.g. its worker process died)."""


class AsyncOutput(ABC):
    """A step's sampled tokens, possibly not computed yet."""

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Waits for the step's tokens and returns them (the engine's only wait).

        Raises:
            ExecutorError: the executor died before producing the output.
        """


class Executor(ABC):
    """Runs a ``ModelRunner`` for the engine core, step by step, in order."""

    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> None:
        """Queues the forward of one step (its results stay with the runner)."""

    @abstractmethod
    def sample_tokens(self, step_id: int, grammar: GrammarOutput | None) -> AsyncOutput:
        """Queues sampling of the oldest executed step, which must be ``step_id``.

        ``grammar`` may be a view of a reused buffer: the executor copies what
        it needs before returning.
        """

    def bitmask_buffer(self) -> torch.Tensor | None:
        """Where the next ``sample_tokens``'s bitmask should be filled (no copy), if anywhere."""
        return None

    @abstractmethod
    def supports_async_scheduling(self) -> bool:
        """Whether ``execute_model``/``sample_tokens`` return before the work is done."""

    @property
    @abstractmethod
    def device_seconds(self) -> float:
        """Time the device spent on forwards and sampling, for steps already returned."""

    def thread_state(self) -> ThreadState | None:
        """What the CPU thread governor (``worker/cpu_threads.py``) has done where the model
        runs, as of the last returned step; None where there is none."""
        return None

    def failure(self) -> str | None:
        """Why this executor can no longer run steps (e.g. its worker process died), or None
        while it can. Reads only flags, so any thread may call it."""
        return None

    def idle_work(self) -> bool:
        """Runs one short slice of work deferred to idle time, if any (moving GGUF weights onto
        huge pages: ``worker/weight_pages.py``); call only between steps, with none in
        flight. Returns whether any remains. Nothing by default (a worker process does its own
        in its idle time)."""
        return False

    def shutdown(self) -> None:  # noqa: B027 - most executors hold nothing to release
        """Releases the executor's resources; idempotent."""
