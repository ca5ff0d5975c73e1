"""``AsyncLLM``: an asyncio front end over one ``LLMEngine`` driven by a background thread.

The engine is not thread-safe, so it lives on one thread (the *engine thread*) that builds
it, runs its steps and is the only one to call into it. Callers talk to that thread through a
thread-safe command queue (add, abort, shutdown); the thread hands each step's outputs back to
the caller's event loop with ``call_soon_threadsafe``. While no request is unfinished the
thread blocks on the queue: an idle engine costs nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from baton.engine.config import EngineConfig
from baton.engine.entrypoints.args import engine_config
from baton.engine.entrypoints.output_slot import OutputSlot
from baton.engine.errors import EngineBusyError
from baton.engine.loader import Checkpoint
from baton.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from baton.engine.processing.llm_engine import LLMEngine, prompt_from_dict
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Mapping[str, Any]

_JOIN_TIMEOUT_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down or crashed): no request can run any more."""


# ------------------------------------------------------------------ commands
@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    stream: RequestStream
    done: concurrent.futures.Future[None]


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Shutdown:
    pass


_Command = _Add | _Abort | _Shutdown


@dataclass
class _Tracked:
    """What the engine thread keeps per request: where to deliver, and the last output."""

    stream: RequestStream
    prompt: Prompt
    n: int
    last: RequestOutput | None = None


# ------------------------------------------------------------------- streams
class RequestStream:
    """The outputs of one request, consumed on the event loop that added it.

    Iterating yields cumulative ``RequestOutput``s; the last one has ``finished`` set. When the
    consumer is slower than the engine, intermediate outputs are merged (each output is
    cumulative, so nothing is lost). ``close()`` aborts the request unless it has finished;
    iteration raises ``EngineDeadError`` if the engine stops first.
    """

    def __init__(self, owner: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._owner = owner
        self._slot = OutputSlot(loop)
        self._finished = False
        self._closed = False

    @property
    def finished(self) -> bool:
        """True once the final output has been handed to the consumer."""
        return self._finished

    # Engine-thread side: both are scheduled onto the stream's loop.
    def deliver(self, output: RequestOutput) -> bool:
        """Hands ``output`` to the consumer's loop (from the engine thread); False when that
        loop is closed and nobody is listening."""
        return self._slot.offer(output)

    def deliver_error(self, error: BaseException) -> bool:
        """Ends the stream with ``error`` on the consumer's loop (from the engine thread);
        False when that loop is closed."""
        return self._slot.offer(error)

    # Loop side.
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        try:
            out = await self._slot.take()
        except Exception:  # the engine's error ends the stream; a cancelled wait does not
            self._finished = True
            raise
        if out.finished:
            self._finished = True
        return out

    def close(self) -> None:
        """Aborts the request (freeing its KV blocks) unless it has finished; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._finished:
            self._owner._send_abort(self.request_id)


# -------------------------------------------------------------------- engine
class AsyncLLM:
    """Serves requests from asyncio code with one engine running on a background thread.

    Args:
        config: the engine configuration.
        checkpoint: an already loaded checkpoint (else ``config.model`` is loaded).

    The constructor blocks until the engine is built (model loaded, worker started).

    Raises:
        ModelLoadError, ValueError, ExecutorError: whatever building the engine raised.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        self.config = config
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # Guards _dead together with queueing, so that no command is queued after the engine
        # thread has drained the queue for the last time (it would never be answered).
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._engine: LLMEngine | None = None
        self._snapshot: dict[str, float | int | str] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(
            target=self._run, args=(checkpoint,), name="baton-engine", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self._thread.join()
            raise self._startup_error
        assert self._engine is not None
        self.tokenizer: Tokenizer = self._engine.tokenizer
        self._sampling_defaults = dict(self._engine.sampling_defaults)
        self.max_model_len: int = self._engine.max_model_len
        self._architecture = self._engine.architecture

    @classmethod
    def from_engine_args(
        cls,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        checkpoint: Checkpoint | None = None,
        **engine_args: Any,
    ) -> AsyncLLM:
        """Builds the engine like ``LLM(model, dtype=..., **engine_args)`` does.

        Raises:
            ValueError: an unknown dtype or engine argument.
        """
        return cls(engine_config(model, dtype=dtype, **engine_args), checkpoint)

    # ---------------------------------------------------------------- public
    async def add_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Validates and queues a request; returns its output stream.

        Raises:
            ValueError: bad prompt or parameters (nothing is queued).
            EngineBusyError: the grammar compile queue is full (nothing is queued; retry
                after its ``retry_after_s``).
            EngineDeadError: the engine has stopped.
        """
        if request_id is None:
            request_id = f"async-{next(self._ids)}"
        if isinstance(prompt, Mapping):
            prompt = prompt_from_dict(prompt)
        if self._engine is not None and self._dead is None:
            failure = self._engine.failure()
            if failure is not None:
                # Refused here: the engine thread may be idle and not know yet.
                raise EngineDeadError(f"the model executor failed: {failure}")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(_Add(request_id, prompt, params, stream, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The add may still go through after we stop waiting: abort it behind the add.
            self._send_abort(request_id)
            raise
        return stream

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's cumulative outputs; the last one has ``finished`` set.

        Closing the iterator early or cancelling the task that consumes it aborts the request
        and frees its KV blocks.

        Raises:
            ValueError: bad prompt or parameters (at the first iteration).
            EngineDeadError: the engine stopped before the request finished.
        """
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Aborts a request: its stream ends with a finished output whose unfinished
        completions have ``finish_reason == "abort"``. Unknown ids are ignored."""
        self._send_abort(request_id)

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (safe to use from any thread for encode/decode/templates)."""
        return self.tokenizer

    def model_architecture(self) -> str | None:
        """The model's architecture (``ModelConfig.architecture``, e.g. "llama", "gpt_oss");
        None on a simulated device. Any thread."""
        return self._architecture

    def sampling_defaults(self) -> dict[str, float | int]:
        """The ``SamplingParams`` fields the model ships defaults for (its generation config),
        for front ends to apply to requests that leave them out. A copy; any thread."""
        return dict(self._sampling_defaults)

    def stats(self) -> dict[str, float | int | str]:
        """The engine's state as of its last loop iteration.

        Keys: everything ``LLMEngine.stats()`` returns: step statistics, the load
        (``num_running``, ``num_waiting``, ``kv_*``) and the grammar compile service's
        ``grammar_*`` counters, gauges and compile-time histogram.
        """
        return dict(self._snapshot)

    def replica_stats(self) -> list[dict[str, float | int | str]]:
        """Per-replica rows of a data-parallel front end; one engine has none: empty."""
        return []

    def is_healthy(self) -> bool:
        """True while the engine thread runs and the model (worker) can still run steps."""
        if self._dead is not None or not self._thread.is_alive() or self._engine is None:
            return False
        return self._engine.failure() is None

    def shutdown(self) -> None:
        """Stops the engine thread and the engine; open streams fail with ``EngineDeadError``.

        Blocks until the thread has finished (at most a few seconds); idempotent.
        """
        with self._lock:
            if self._dead is None:
                self._commands.put(_Shutdown())
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(_JOIN_TIMEOUT_S)

    # ------------------------------------------------------------- commands
    def _send(self, command: _Command) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self._dead}")
            self._commands.put(command)

    def _send_abort(self, request_id: str) -> None:
        # Aborting on a stopped engine has nothing left to do.
        with self._lock:
            if self._dead is None:
                self._commands.put(_Abort(request_id))

    # ---------------------------------------------------------- engine thread
    def _run(self, checkpoint: Checkpoint | None) -> None:
        try:
            engine = LLMEngine(self.config, checkpoint)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the constructor
            self._startup_error = exc
            with self._lock:
                self._dead = f"the engine failed to start: {exc}"
            self._ready.set()
            return
        self._engine = engine
        tracked: dict[str, _Tracked] = {}
        self._publish(engine)
        self._ready.set()
        reason = "the engine was shut down"
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                # Deferred work (weights onto huge pages) a slice at a time while idle, a
                # command check between slices: a request waits for one slice at most.
                more = idle and engine.idle_work()
                if self._handle_commands(engine, tracked, block=idle and not more):
                    break
                if engine.has_unfinished_requests():
                    self._dispatch(engine, tracked, engine.step())
                self._publish(engine)
                failure = engine.failure()
                if failure is not None:
                    # The core failed its requests (their outputs went out above) and refuses
                    # new ones: stop here, so that the engine is dead everywhere at once.
                    reason = f"the model executor failed: {failure}"
                    break
        except BaseException as exc:  # noqa: BLE001 - must fail the clients, not hang them
            logger.exception("engine thread failed")
            reason = f"the engine thread failed: {type(exc).__name__}: {exc}"
        finally:
            self._stop(engine, tracked, reason)

    def _handle_commands(
        self, engine: LLMEngine, tracked: dict[str, _Tracked], block: bool
    ) -> bool:
        """Runs every queued command (waiting for one if ``block``); True on shutdown."""
        commands: list[_Command] = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for i, cmd in enumerate(commands):
            if isinstance(cmd, _Shutdown):
                for rest in commands[i + 1 :]:
                    if isinstance(rest, _Add):
                        _fail_add(rest, EngineDeadError("the engine was shut down"))
                return True
            if isinstance(cmd, _Add):
                self._add(engine, tracked, cmd)
            else:
                self._abort(engine, tracked, cmd.request_id)
        return False

    def _add(self, engine: LLMEngine, tracked: dict[str, _Tracked], cmd: _Add) -> None:
        if not cmd.done.set_running_or_notify_cancel():
            return  # the caller stopped waiting; its abort follows in the queue
        if cmd.request_id in tracked:
            cmd.done.set_exception(ValueError(f"request id {cmd.request_id!r} is already in use"))
            return
        try:
            engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except (ValueError, EngineBusyError) as exc:
            cmd.done.set_exception(exc)
            return
        except Exception as exc:  # noqa: BLE001 - e.g. the model worker died: the caller's error
            cmd.done.set_exception(EngineDeadError(f"cannot add the request: {exc}"))
            return
        tracked[cmd.request_id] = _Tracked(cmd.stream, cmd.prompt, cmd.params.n)
        cmd.done.set_result(None)

    def _abort(self, engine: LLMEngine, tracked: dict[str, _Tracked], request_id: str) -> None:
        engine.abort_request(request_id)
        entry = tracked.pop(request_id, None)
        if entry is not None:
            entry.stream.deliver(self._aborted_output(engine, request_id, entry))

    @staticmethod
    def _aborted_output(engine: LLMEngine, request_id: str, entry: _Tracked) -> RequestOutput:
        if entry.last is not None:
            outputs = [
                c if c.finished else dataclasses.replace(c, finish_reason="abort")
                for c in entry.last.outputs
            ]
            return dataclasses.replace(entry.last, outputs=outputs, finished=True)
        prompt = entry.prompt
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = engine.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, list(prompt)
        now = time.monotonic()
        return RequestOutput(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=list(ids),
            outputs=[CompletionOutput(i, "", [], None, None, "abort") for i in range(entry.n)],
            finished=True,
            metrics=RequestMetrics(arrival_time=now, finished_time=now),
        )

    def _dispatch(
        self, engine: LLMEngine, tracked: dict[str, _Tracked], outputs: list[RequestOutput]
    ) -> None:
        for out in outputs:
            entry = tracked.get(out.request_id)
            if entry is None:
                continue
            entry.last = out
            if out.finished:
                del tracked[out.request_id]
            if not entry.stream.deliver(out) and not out.finished:
                engine.abort_request(out.request_id)
                del tracked[out.request_id]

    def _publish(self, engine: LLMEngine) -> None:
        # One reference swap: readers never see a half-written dict.
        self._snapshot = dict(engine.stats())

    def _stop(self, engine: LLMEngine, tracked: dict[str, _Tracked], reason: str) -> None:
        with self._lock:
            self._dead = reason
        error = EngineDeadError(reason)
        while True:  # nothing more can be queued (_dead is set under the lock)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                _fail_add(cmd, EngineDeadError(reason))
        for entry in tracked.values():
            entry.stream.deliver_error(error)
        tracked.clear()
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - shutting down must not raise
            logger.exception("engine shutdown failed")


def _fail_add(cmd: _Add, error: BaseException) -> None:
    """Fails an add that was never run (unless its caller already gave up on it)."""
    if cmd.done.set_running_or_notify_cancel():
        cmd.done.set_exception(error)
