"""``POST /v1/chat/completions``: render the conversation, generate, answer or stream; with
tools, the answer's tool calls are read out of the text (``baton.engine.server.tools``,
``baton.engine.server.tool_output``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from baton.engine.entrypoints.async_llm import EngineDeadError
from baton.engine.outputs import CompletionOutput, RequestOutput
from baton.engine.server.chat_plan import ChatPlan, assistant_reply, plan_chat
from baton.engine.server.errors import APIError, error_body
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
    sse,
    sse_chunker,
    start_requests,
    usage,
)
from baton.engine.server.logprobs import chat_logprobs, prompt_logprobs_json
from baton.engine.server.params import check_model
from baton.engine.server.protocol import ChatCompletionRequest
from baton.engine.server.reasoning import ReasoningDeltas, ReasoningSplitter
from baton.engine.server.state import get_state
from baton.engine.server.tool_output import ToolCallDeltas, finish_reason
from baton.engine.server.tools import ToolPlan, name_the_tool

router = APIRouter()


def _choice_logprobs(c: CompletionOutput, top_n: int, wanted: bool) -> dict[str, Any] | None:
    if not wanted or c.logprobs is None:
        return None
    return {"content": chat_logprobs(c.token_ids, c.logprobs, top_n)}


def _response(
    out: RequestOutput,
    body: ChatCompletionRequest,
    request_id: str,
    created: int,
    model: str,
    plan: ChatPlan,
) -> dict[str, Any]:
    top_n = body.top_logprobs or 0
    choices = []
    splitter = plan.splitter
    thinks = splitter is not None and splitter.thinks_first(out.prompt_token_ids)
    reasoning_tokens = 0
    for c in out.outputs:
        reasoning, message, reason = assistant_reply(c, plan, thinks)
        if splitter is not None:
            reasoning_tokens += splitter.reasoning_tokens(c.token_ids, thinks)
        if reasoning is not None:  # both names: vLLM's and the newer clients'
            message["reasoning_content"] = message["reasoning"] = reasoning
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": _choice_logprobs(c, top_n, body.logprobs),
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
        )
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    counts = usage(len(out.prompt_token_ids), completion_tokens)
    if splitter is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    response = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": counts,
    }
    if out.structured_output_unenforced is not None:  # a lenient schema: what was dropped
        response["structured_outputs_unenforced"] = out.structured_output_unenforced
    if out.prompt_logprobs is not None:  # vLLM's field, beside the choices
        response["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    return response


async def _stream(
    stream: TrackedStream,
    body: ChatCompletionRequest,
    request_id: str,
    created: int,
    model: str,
    tools: ToolPlan | None,
    splitter: ReasoningSplitter | None = None,
) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    thoughts: list[ReasoningDeltas] | None = None

    chunk = sse_chunker(request_id, "chat.completion.chunk", created, model, include_usage)

    yield chunk(
        [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            for i in range(body.n)
        ]
    )
    trackers = [DeltaTracker() for _ in range(body.n)]
    calls = (
        [ToolCallDeltas(tools.fmt, tools.functions) for _ in range(body.n)]
        if tools is not None and tools.mode != "none"
        else None
    )
    last: RequestOutput | None = None
    try:
        async for out in stream:
            last = out
            if splitter is not None and thoughts is None:
                thinks = splitter.thinks_first(out.prompt_token_ids)
                thoughts = [ReasoningDeltas(splitter, thinks) for _ in range(body.n)]
            error = completion_error([out])
            if error is not None:
                yield sse(error_body(error, "server_error"))
                break
            choices = [
                choice
                for c in out.outputs
                if (
                    choice := _choice_delta(
                        c,
                        trackers[c.index],
                        None if thoughts is None else thoughts[c.index],
                        None if calls is None else calls[c.index],
                        body,
                    )
                )
                is not None
            ]
            if choices:
                yield chunk(choices)
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), "server_error"))
    if include_usage and last is not None:
        completion_tokens = sum(len(c.token_ids) for c in last.outputs)
        counts = usage(len(last.prompt_token_ids), completion_tokens)
        if splitter is not None:
            thinks = splitter.thinks_first(last.prompt_token_ids)
            spent = sum(splitter.reasoning_tokens(c.token_ids, thinks) for c in last.outputs)
            counts["completion_tokens_details"] = {"reasoning_tokens": spent}
        yield chunk([], usage=counts)
    yield SSE_DONE


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI's chat completions (see the module docs of ``baton.engine.server``)."""
    state = get_state(request)
    check_model(body.model, state.config)
    plan = plan_chat(state, body)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = body.model or state.config.served_model_name
    param = plan.param
    try:
        streams = await start_requests(state, [plan.prompt], plan.params, request_id, param)
        if body.stream:
            if plan.params.structured_outputs is not None:
                await check_first_output(request, streams, param)
            return SSEResponse(
                _stream(streams[0], body, request_id, created, model, plan.tools, plan.splitter),
                lambda: close_all(streams),
            )
        (out,) = await collect_unary(request, streams, param)
    except ClientDisconnected:
        return Response(status_code=499)
    except APIError as exc:  # a tool's schema the grammar cannot hold: say which tool
        raise name_the_tool(exc, plan.tools) from None
    return JSONResponse(_response(out, body, request_id, created, model, plan))


def _choice_delta(
    c: CompletionOutput,
    tracker: DeltaTracker,
    thoughts: ReasoningDeltas | None,
    calls: ToolCallDeltas | None,
    body: ChatCompletionRequest,
) -> dict[str, Any] | None:
    """One streamed choice's chunk entry for what ``c`` added since the last one (content or
    thoughts, tool-call deltas, logprobs, finish), or None when there is nothing to send."""
    text, ids, entries = tracker.delta(c)
    if not text and not ids and not c.finished:
        return None
    delta: dict[str, Any] = {"content": text} if text else {}
    answer = c.text
    if thoughts is not None:
        delta = thoughts.delta(c.text, c.token_ids)
        answer = thoughts.content
    reason = c.finish_reason
    if calls is not None:
        # Calls are read from the text after the thoughts only, as unstreamed; the thoughts'
        # delta stays beside them.
        delta.pop("content", None)
        delta.update(calls.delta(answer, c.finished))
        reason = finish_reason(reason, calls.has_calls)
        if not delta and not c.finished and not body.logprobs:
            return None
    choice: dict[str, Any] = {"index": c.index, "delta": delta, "finish_reason": reason}
    if body.logprobs:
        choice["logprobs"] = {"content": chat_logprobs(ids, entries, body.top_logprobs or 0)}
    if c.finished:
        choice["stop_reason"] = c.stop_reason
    return choice
