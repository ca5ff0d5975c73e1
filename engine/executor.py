"""Executors: who runs the model runner, and how the engine waits for its results.

The engine core talks to an ``Executor`` only: ``execute_model`` queues a
step's forward, ``sample_tokens`` queues its sampling and returns an
``AsyncOutput``, and ``AsyncOutput.get_output()`` is the one place where the
engine thread waits for device work. ``UniExecutor`` runs the runner in this
process (synchronously on the CPU); ``MultiprocExecutor`` (mp_executor.py)
runs it in a worker process so that a CPU forward overlaps the engine thread.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

import torch

from baton.engine.model_runner import ForwardOutput, ModelRunner
from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import LlamaForCausalLM, allocate_kv_cache
from baton.engine.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from baton.engine.sync_check import SyncChecker


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


def build_runner(spec: RunnerSpec, weights: dict[str, torch.Tensor]) -> ModelRunner:
    """Builds the model from ``weights``, allocates its KV cache and wraps both in a runner."""
    model = LlamaForCausalLM(spec.model_config).to(dtype=spec.dtype)
    model.load_weights(weights)
    model.eval()
    caches = allocate_kv_cache(spec.model_config, spec.num_kv_blocks, spec.block_size, spec.dtype)
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


class CompletedOutput(AsyncOutput):
    """An output that was computed before ``sample_tokens`` returned."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def get_output(self) -> ModelRunnerOutput:
        return self._output


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
    """Runs the runner in this process; on the CPU every call completes before returning."""

    def __init__(self, runner: ModelRunner, checker: SyncChecker | None = None) -> None:
        self.runner = runner
        self._pending: deque[ForwardOutput] = deque()
        self._device_s = 0.0
        self._checker = checker or SyncChecker("off")

    def execute_model(self, so: SchedulerOutput) -> None:
        t0 = time.perf_counter()
        with self._checker.allow():  # the CPU is the device: this is its work, not a wait
            self._pending.append(self.runner.execute_model(so))
        self._device_s += time.perf_counter() - t0

    def sample_tokens(self, step_id: int, grammar: GrammarOutput | None) -> AsyncOutput:
        fwd = self._pending.popleft()
        if fwd.step_id != step_id:
            raise ExecutorError(f"sample_tokens for step {step_id}, but step {fwd.step_id} is next")
        t0 = time.perf_counter()
        with self._checker.allow():
            out = self.runner.sample_tokens(fwd, grammar)
        self._device_s += time.perf_counter() - t0
        return CompletedOutput(out)

    def supports_async_scheduling(self) -> bool:
        # A CPU forward in a thread of this process is starved by the GIL.
        return False

    @property
    def device_seconds(self) -> float:
        return self._device_s
