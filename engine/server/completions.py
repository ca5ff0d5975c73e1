"""``POST /v1/completions``: one or more prompts (text or token ids), answered or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from baton.engine.entrypoints.async_llm import EngineDeadError, Prompt
from baton.engine.outputs import RequestOutput
from baton.engine.server.errors import bad_request, error_body
from baton.engine.server.generation import (
    SSE_DONE,
    ClientDisconnected,
    DeltaTracker,
    SSEResponse,
    TrackedStream,
    check_first_output,
    close_all,
    collect_unary,
    completion_error,
    merge,
    sse,
    sse_chunker,
    start_requests,
    usage,
)
from baton.engine.server.logprobs import completion_logprobs, prompt_logprobs_json
from baton.engine.server.params import check_model, completion_sampling_params
from baton.engine.server.protocol import CompletionRequest
from baton.engine.server.state import ServerState, get_state

router = APIRouter()


def prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """The request's prompts: a string, a list of strings, a list of token ids, or a list of
    token-id lists.

    Raises:
        APIError: 400 for an empty prompt list.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def echo_texts(state: ServerState, body: CompletionRequest, prompts: list[Prompt]) -> list[str]:
    """What ``echo`` puts before each prompt's choices: the prompt string, or its token ids
    decoded (special tokens kept, as ``/detokenize``); empty strings without ``echo``.

    Raises:
        APIError: 400 naming ``prompt`` for a token id outside the vocabulary.
    """
    if not body.echo:
        return [""] * len(prompts)
    tokenizer = state.engine.get_tokenizer()
    try:
        return [
            p if isinstance(p, str) else tokenizer.decode(list(p), skip_special_tokens=False)
            for p in prompts
        ]
    except ValueError as exc:
        raise bad_request(f"prompt: {exc}", "prompt") from exc


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    return usage(
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(len(c.token_ids) for o in outputs for c in o.outputs),
    )


def _echoed_logprobs(
    out: RequestOutput,
    token_ids: list[int],
    entries: list[Any],
    top_n: int,
    decode: Callable[[int], str],
    text_offset: int = 0,
) -> dict[str, Any]:
    """``echo`` with ``logprobs``: the prompt's tokens first (the first with null
    logprobs), then these output tokens (as vLLM)."""
    prompt = out.prompt_logprobs or []
    return completion_logprobs(
        [*out.prompt_token_ids, *token_ids], [*prompt, *entries], top_n, text_offset, decode
    )


def _response(
    outputs: list[RequestOutput],
    body: CompletionRequest,
    request_id: str,
    created: int,
    model: str,
    echo: list[str],
    decode: Callable[[int], str],
) -> dict[str, Any]:
    choices = []
    for p, out in enumerate(outputs):
        for c in out.outputs:
            logprobs = None
            if body.logprobs is not None and c.logprobs is not None:
                if body.echo:
                    logprobs = _echoed_logprobs(out, c.token_ids, c.logprobs, body.logprobs, decode)
                else:
                    logprobs = completion_logprobs(c.token_ids, c.logprobs, body.logprobs)
            choice = {
                "index": p * body.n + c.index,
                "text": echo[p] + c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if out.prompt_logprobs is not None:  # vLLM's field, per choice
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            choices.append(choice)
    response = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(outputs),
    }
    unenforced = {o.structured_output_unenforced for o in outputs} - {None}
    if unenforced:  # a lenient schema: what was dropped
        response["structured_outputs_unenforced"] = "; ".join(sorted(unenforced))
    return response


async def _stream(
    streams: list[TrackedStream],
    body: CompletionRequest,
    request_id: str,
    created: int,
    model: str,
    echo: list[str],
    decode: Callable[[int], str],
) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n = body.n
    trackers = [DeltaTracker() for _ in range(len(streams) * n)]
    # Choices whose first chunk (which carries the echoed prompt) is not sent yet.
    unstarted = set(range(len(streams) * n))

    chunk = sse_chunker(request_id, "text_completion", created, model, include_usage)

    last: dict[int, RequestOutput] = {}
    try:
        async for p, out in merge(streams):
            last[p] = out
            error = completion_error([out])
            if error is not None:
                yield sse(error_body(error, "server_error"))
                break
            choices = []
            for c in out.outputs:
                tracker = trackers[p * n + c.index]
                offset = len(echo[p]) + tracker.text_len  # offsets count the echoed prompt
                text, ids, entries = tracker.delta(c)
                if not text and not ids and not c.finished:
                    continue
                index = p * n + c.index
                first = index in unstarted
                logprobs = None
                if body.logprobs is not None and first and body.echo:
                    logprobs = _echoed_logprobs(out, ids, entries, body.logprobs, decode)
                elif body.logprobs is not None:
                    logprobs = completion_logprobs(ids, entries, body.logprobs, offset)
                if first:
                    unstarted.discard(index)
                    text = echo[p] + text
                choice: dict[str, Any] = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                }
                if c.finished:
                    choice["stop_reason"] = c.stop_reason
                choices.append(choice)
            if choices:
                yield chunk(choices)
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), "server_error"))
    if include_usage and last:
        yield chunk([], usage=_usage(list(last.values())))
    yield SSE_DONE


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's (legacy) text completions."""
    state = get_state(request)
    check_model(body.model, state.config)
    params, constraint = completion_sampling_params(
        body, state.config, defaults=state.engine.sampling_defaults()
    )
    prompts = prompts_of(body.prompt)
    echo = echo_texts(state, body, prompts)
    tokenizer = state.engine.get_tokenizer()

    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = body.model or state.config.served_model_name
    param = constraint.param if constraint is not None else None
    streams = await start_requests(state, prompts, params, request_id, param)
    if body.stream:
        if params.structured_outputs is not None:
            try:
                await check_first_output(request, streams, param)
            except ClientDisconnected:
                return Response(status_code=499)
        return SSEResponse(
            _stream(streams, body, request_id, created, model, echo, decode),
            lambda: close_all(streams),
        )
    try:
        outputs = await collect_unary(request, streams, param)
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(outputs, body, request_id, created, model, echo, decode))
