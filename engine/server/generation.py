"""Running generations for HTTP requests: start (400 on bad input), merge several prompts'
streams, count outcomes in the metrics, stop on client disconnect, and SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from baton.engine.entrypoints.async_llm import EngineDeadError, Prompt
from baton.engine.entrypoints.serving import OutputStream
from baton.engine.outputs import CompletionOutput, RequestOutput
from baton.engine.sampling_params import SamplingParams
from baton.engine.server.errors import APIError, bad_request
from baton.engine.server.metrics import ServerMetrics
from baton.engine.server.state import ServerState

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


class TrackedStream:
    """An ``OutputStream`` whose outcome (finished, aborted, error) is counted exactly once
    in the server metrics, when it ends or is closed."""

    def __init__(self, stream: OutputStream, metrics: ServerMetrics, structured: bool) -> None:
        self.stream = stream
        self.metrics = metrics
        self.structured = structured
        self.last: RequestOutput | None = None
        self._peeked: RequestOutput | None = None
        self._failed = False
        self._recorded = False

    def __aiter__(self) -> TrackedStream:
        return self

    async def peek(self) -> RequestOutput:
        """The next output, kept for the next ``__anext__`` to return again.

        Raises:
            StopAsyncIteration: the stream has ended.
            EngineDeadError: the engine has stopped.
        """
        if self._peeked is None:
            self._peeked = await self.__anext__()
        return self._peeked

    async def __anext__(self) -> RequestOutput:
        if self._peeked is not None:
            out, self._peeked = self._peeked, None
            return out
        try:
            out = await self.stream.__anext__()
        except EngineDeadError:
            self._failed = True
            self._record()
            raise
        self.last = out
        if out.finished:
            self._record()
        return out

    def close(self) -> None:
        """Aborts the request unless it finished; records the outcome."""
        self.stream.close()
        self._record()

    def _record(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        last = self.last
        if self._failed:
            status = "error"
        elif last is not None and last.finished:
            failure = completion_failure([last])
            if failure is not None and failure.error_kind == INVALID_SPEC:
                return  # answered with a 400, which the error handler counts as rejected
            errored = failure is not None
            aborted = any(c.finish_reason == "abort" for c in last.outputs)
            status = "error" if errored else "aborted" if aborted else "finished"
        else:
            status = "aborted"
        self.metrics.observe_request(status, last, self.structured)


async def start_requests(
    state: ServerState,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    request_id: str,
    structured_param: str | None = None,
) -> list[TrackedStream]:
    """Adds one request per prompt (ids ``{request_id}-{i}``); all or none.

    Raises:
        APIError: 400 with the engine's message when a prompt or the parameters are invalid
            (requests already added are aborted); its ``param`` is "prompt" for a prompt
            error, "stop_token_ids" or "logit_bias" for an id outside the vocabulary, else
            ``structured_param`` (the body field that carried the constraint) for a
            structured request.
        EngineDeadError: the engine has stopped.
    """
    streams: list[TrackedStream] = []
    structured = params.structured_outputs is not None
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            stream = await state.engine.add_request(prompt, params, rid)
            streams.append(TrackedStream(stream, state.metrics, structured))
    except ValueError as exc:
        close_all(streams)
        message = str(exc)
        if message.startswith("prompt"):
            param: str | None = "prompt"
        elif message.startswith(("stop_token_ids", "logit_bias")):
            param = message.split(" ", 1)[0]
        else:
            param = structured_param
        raise bad_request(message, param) from None
    except BaseException:
        close_all(streams)
        raise
    return streams


def close_all(streams: Sequence[TrackedStream]) -> None:
    """Closes (aborting the unfinished) every stream."""
    for s in streams:
        s.close()


async def merge(streams: Sequence[TrackedStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields ``(stream index, output)`` as any stream produces, until all have finished."""
    pending: dict[asyncio.Future[RequestOutput], int] = {
        asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()


async def collect(streams: Sequence[TrackedStream]) -> list[RequestOutput]:
    """The final output of every stream, in order."""
    final: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge(streams):
        final[i] = out
    assert all(o is not None for o in final)
    return final  # type: ignore[return-value]


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work`` while watching the connection.

    Raises:
        ClientDisconnected: the client disconnected first (``work`` is cancelled).
    """
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected


async def collect_unary(
    request: Request, streams: Sequence[TrackedStream], param: str | None = None
) -> list[RequestOutput]:
    """The final outputs of a non-streamed response; closes (aborts) every stream either way.

    Raises:
        ClientDisconnected: the client went away first.
        APIError: 400 naming ``param`` (the field that carried the constraint) when the
            structured-output spec could not be compiled because of the spec itself; 500 when
            a request failed inside the engine.
    """
    try:
        outputs = await until_disconnect(request, collect(streams))
    finally:
        close_all(streams)
    failure = completion_failure(outputs)
    if failure is not None:
        raise failure_error(failure, param)
    return outputs


async def check_first_output(
    request: Request, streams: Sequence[TrackedStream], param: str | None
) -> None:
    """Before a structured stream answers 200: waits for the first stream's first output (its
    grammar compiled, its first token sampled, or its failure) so that a spec the backends
    refuse is answered with a 400 like a non-streamed request's. Every prompt of a request
    shares the spec, so the first stream speaks for all; the output stays in the stream.

    Raises:
        ClientDisconnected: the client went away first (the streams are closed).
        APIError: 400 as ``collect_unary``'s (the streams are closed).
    """
    try:
        first = await until_disconnect(request, streams[0].peek())
    except StopAsyncIteration:
        return
    except BaseException:
        close_all(streams)
        raise
    failure = completion_failure([first])
    if failure is not None and failure.error_kind == INVALID_SPEC:
        close_all(streams)
        raise failure_error(failure, param)


def sse_chunker(
    request_id: str, obj: str, created: int, model: str, include_usage: bool
) -> Callable[..., str]:
    """``chunk(choices, **extra)``: one streamed chunk as an event, in OpenAI's envelope
    (``usage`` null on every chunk when the client asked for a final usage chunk; ``extra``
    overrides, e.g. that final ``usage``)."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        data: dict[str, Any] = {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            data["usage"] = None
        data.update(extra)
        return sse(data)

    return chunk


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs ``on_close`` however it ends (done, client
    disconnect, error), so an unfinished request is always aborted."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class DeltaTracker:
    """Turns one completion's cumulative outputs into deltas (new text, new tokens and their
    logprobs) for streaming."""

    def __init__(self) -> None:
        self.text_len = 0
        self.num_tokens = 0

    def delta(self, completion: CompletionOutput) -> tuple[str, list[int], list[Any]]:
        """What ``completion`` has beyond the previous call's; advances the tracker."""
        text = completion.text[self.text_len :]
        ids = completion.token_ids[self.num_tokens :]
        entries = list(completion.logprobs[self.num_tokens :]) if completion.logprobs else []
        self.text_len = max(self.text_len, len(completion.text))
        self.num_tokens = max(self.num_tokens, len(completion.token_ids))
        return text, list(ids), entries


INVALID_SPEC = "invalid_spec"
"""``CompletionOutput.error_kind`` of a request whose spec cannot be compiled (a 400)."""


def completion_failure(outputs: Sequence[RequestOutput]) -> CompletionOutput | None:
    """The first failed completion, if any failed."""
    for out in outputs:
        for c in out.outputs:
            if c.finish_reason == "error":
                return c
    return None


def completion_error(outputs: Sequence[RequestOutput]) -> str | None:
    """The error message of the first failed completion, if any failed."""
    failure = completion_failure(outputs)
    return None if failure is None else failure.error or "generation failed"


def failure_error(failure: CompletionOutput, param: str | None) -> APIError:
    """The HTTP error for a failed completion: 400 naming ``param`` for a spec that cannot
    be compiled, else 500."""
    message = failure.error or "generation failed"
    if failure.error_kind == INVALID_SPEC:
        return bad_request(message, param)
    return APIError(500, message)
