"""``UniExecutor``: the model runner in the engine's own process.

On the CPU every call completes before returning; on CUDA the calls only queue work on the
runner's stream, so async scheduling overlaps without a worker process.
"""

from __future__ import annotations

import contextlib
from collections import deque
from contextlib import AbstractContextManager

import torch

from baton.engine.executor.base import AsyncOutput, Executor, ExecutorError
from baton.engine.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from baton.engine.sync_check import SyncChecker
from baton.engine.worker.cpu_threads import ThreadGovernor, ThreadState
from baton.engine.worker.device_buffers import DeviceIO
from baton.engine.worker.model_runner import ModelRunner
from baton.engine.worker.runner_values import ForwardOutput, SampledTokens
from baton.engine.worker.weight_pages import WeightPageMover

# Start and end marks of a piece of device work (see ``DeviceIO.mark``).
_Span = tuple[torch.cuda.Event | float, torch.cuda.Event | float]


class UniExecutor(Executor):
    """Runs the runner in this process.

    On the CPU every call completes before returning (the CPU is the device, so its work is
    allowed under ``BATON_SYNC_CHECK``). On CUDA the calls only queue work on the runner's
    stream, so async scheduling overlaps; the runner then runs under the engine's sync-check
    guard, where any host read of a device value is reported. Device time comes from the
    host clock on the CPU and from CUDA events on CUDA, read when an output is collected.
    On the CPU a ``governor`` (``worker/cpu_threads.py``; built only for device "cpu") may
    change the torch thread count before each forward. ``mover``'s weights move onto huge
    pages in ``idle_work``.
    """

    def __init__(
        self,
        runner: ModelRunner,
        checker: SyncChecker | None = None,
        governor: ThreadGovernor | None = None,
        mover: WeightPageMover | None = None,
    ) -> None:
        self.runner = runner
        self._governor = governor
        self._mover = mover
        self._io: DeviceIO = runner.io
        self._pending: deque[tuple[ForwardOutput, _Span]] = deque()
        self._device_s = 0.0
        self._checker = checker or SyncChecker("off")

    def _device_work(self) -> AbstractContextManager[object]:
        # On the CPU the runner's calls are the device's work, not a wait for it; on CUDA
        # they only queue work, so a host read inside them is a real sync and stays reported.
        return self._checker.allow() if self._io.is_host else contextlib.nullcontext()

    def idle_work(self) -> bool:
        if self._mover is None or not self._mover.pending:
            return False
        self._mover.move_slice()
        return self._mover.pending > 0

    def execute_model(self, so: SchedulerOutput) -> None:
        if self._governor is not None:
            self._governor.before_step()
        start = self._io.mark()
        with self._device_work():
            fwd = self.runner.execute_model(so)
        self._pending.append((fwd, (start, self._io.mark())))

    def sample_tokens(self, step_id: int, grammar: GrammarOutput | None) -> AsyncOutput:
        fwd, forward_span = self._pending.popleft()
        if fwd.step_id != step_id:
            raise ExecutorError(f"sample_tokens for step {step_id}, but step {fwd.step_id} is next")
        start = self._io.mark()
        with self._device_work():
            sampled = self.runner.sample(fwd, grammar)
        return _UniOutput(self, sampled, (forward_span, (start, self._io.mark())))

    def _collect(self, sampled: SampledTokens, spans: tuple[_Span, ...]) -> ModelRunnerOutput:
        """The one wait: the host copies of a step's results, then its device time."""
        with self._checker.allow():
            output = sampled.to_runner_output()
            self._device_s += sum(self._io.seconds_between(a, b) for a, b in spans)
        return output

    def supports_async_scheduling(self) -> bool:
        # A CPU forward in a thread of this process is starved by the GIL; a CUDA one is
        # only queued here.
        return not self._io.is_host

    @property
    def device_seconds(self) -> float:
        return self._device_s

    def thread_state(self) -> ThreadState | None:
        return self._governor.state() if self._governor is not None else None


class _UniOutput(AsyncOutput):
    """A step sampled by a ``UniExecutor``: its host copies and timing marks, collected once."""

    def __init__(
        self, executor: UniExecutor, sampled: SampledTokens, spans: tuple[_Span, ...]
    ) -> None:
        self._executor, self._sampled, self._spans = executor, sampled, spans
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._collect(self._sampled, self._spans)
        return self._output
