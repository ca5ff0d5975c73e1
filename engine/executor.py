"""Executors: who runs the model runner, and how the engine waits for its results.

The engine core talks to an ``Executor`` only: ``execute_model`` queues a
step's forward, ``sample_tokens`` queues its sampling and returns an
``AsyncOutput``, and ``AsyncOutput.get_output()`` is the one place where the
engine thread waits for device work. ``UniExecutor`` runs the runner in this
process: synchronously on the CPU, queued on the runner's stream on CUDA (so
it overlaps there); ``MultiprocExecutor`` (mp_executor.py) runs it in a worker
process so that a CPU forward overlaps the engine thread.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from baton.engine.device_buffers import DeviceIO
from baton.engine.model_runner import ForwardOutput, ModelRunner, SampledTokens
from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import LlamaForCausalLM, allocate_kv_cache
from baton.engine.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from baton.engine.sync_check import SyncChecker

# Start and end marks of a piece of device work (see ``DeviceIO.mark``).
_Span = tuple[torch.cuda.Event | float, torch.cuda.Event | float]


class ExecutorError(RuntimeError):
    """The executor cannot run the model any more (e.g. its worker process died)."""


@dataclass(frozen=True)
class RunnerSpec:
    """Everything needed to build a ``ModelRunner`` except the weights (picklable)."""

    model_config: ModelConfig
    dtype: torch.dtype
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tokenizer_vocab_size: int | None
    num_threads: int | None = None  # torch threads where the runner runs; None: unchanged
    device: str = "cpu"  # where the model, its KV cache and the request rows live


def build_runner(spec: RunnerSpec, weights: dict[str, torch.Tensor]) -> ModelRunner:
    """Builds the model from ``weights`` on ``spec.device``, allocates its KV cache there and
    wraps both in a runner."""
    model = LlamaForCausalLM(spec.model_config).to(dtype=spec.dtype)
    model.load_weights(weights)
    model.eval()
    device = torch.device(spec.device)
    model.to(device)
    caches = allocate_kv_cache(
        spec.model_config, spec.num_kv_blocks, spec.block_size, spec.dtype, device
    )
    return ModelRunner(
        model,
        caches,
        spec.block_size,
        spec.max_num_seqs,
        spec.max_model_len,
        eos_token_ids=spec.eos_token_ids,
        tokenizer_vocab_size=spec.tokenizer_vocab_size,
    )


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

    def shutdown(self) -> None:  # noqa: B027 - most executors hold nothing to release
        """Releases the executor's resources; idempotent."""


class UniExecutor(Executor):
    """Runs the runner in this process.

    On the CPU every call completes before returning (the CPU is the device, so its work is
    allowed under ``BATON_SYNC_CHECK``). On CUDA the calls only queue work on the runner's
    stream, so async scheduling overlaps; the runner then runs under the engine's sync-check
    guard, where any host read of a device value is reported. Device time comes from the
    host clock on the CPU and from CUDA events on CUDA, read when an output is collected.
    """

    def __init__(self, runner: ModelRunner, checker: SyncChecker | None = None) -> None:
        self.runner = runner
        self._io: DeviceIO = runner.io
        self._pending: deque[tuple[ForwardOutput, _Span]] = deque()
        self._device_s = 0.0
        self._checker = checker or SyncChecker("off")

    def _device_work(self) -> AbstractContextManager[object]:
        # On the CPU the runner's calls are the device's work, not a wait for it; on CUDA
        # they only queue work, so a host read inside them is a real sync and stays reported.
        return self._checker.allow() if self._io.is_host else contextlib.nullcontext()

    def execute_model(self, so: SchedulerOutput) -> None:
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
