"""``POST /v1/responses`` (OpenAI's Responses API), ``GET /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` and ``DELETE /v1/responses/{id}``.

A request runs as the chat request it translates to (``responses_input``): the same
template rendering, constraint, tool plan and reasoning split as ``/v1/chat/completions``
(``chat_plan``). Its answer is a response object (``responses_output``) or, streamed, the
Responses events (``responses_stream``). With ``store`` (the default) the response and the
conversation it answered are kept (``ResponseStore``, bounded) for ``GET`` and for a later
request's ``previous_response_id``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from baton.engine.entrypoints.async_llm import EngineDeadError
from baton.engine.outputs import RequestOutput
from baton.engine.server.chat_plan import ChatPlan, plan_chat
from baton.engine.server.errors import APIError, bad_request
from baton.engine.server.fields import check_extra_fields
from baton.engine.server.generation import (
    ClientDisconnected,
    SSEResponse,
    check_first_output,
    close_all,
    collect_unary,
    completion_failure,
    start_requests,
)
from baton.engine.server.params import check_model
from baton.engine.server.protocol import ResponsesRequest
from baton.engine.server.responses_input import chat_request, input_items, renamed, shown
from baton.engine.server.responses_output import (
    ResponseContext,
    json_text,
    new_id,
    output_items,
    response_object,
    response_usage,
)
from baton.engine.server.responses_store import ResponseStore, StoredResponse
from baton.engine.server.responses_stream import ResponseEvents
from baton.engine.server.state import get_state
from baton.engine.server.tools import name_the_tool

router = APIRouter()


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(
        404,
        f"Response with id '{shown(response_id)}' not found: it was never stored (store: false), "
        "was deleted, or was evicted from the server's response store.",
        param=param,
        code="response_not_found",
    )


def _json(data: dict[str, Any]) -> Response:
    return Response(json_text(data), media_type="application/json")


def _stored(store: ResponseStore, response_id: str, param: str | None) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id, param)
    return stored


async def stream_events(
    stream: AsyncIterator[RequestOutput],
    events: ResponseEvents,
    store: ResponseStore | None,
    conversation: Sequence[dict[str, Any]],
) -> AsyncIterator[str]:
    """The events of a streamed response (``stream``: its request's outputs); a failure
    inside the engine ends them with an ``error`` event. The finished response is stored in
    ``store`` (None: not stored) with the ``conversation`` it answered."""
    for event in events.start():
        yield event
    try:
        async for out in stream:
            failure = completion_failure([out])
            if failure is not None:
                message = failure.error or "generation failed"
                yield events.event("error", code="server_error", message=message, param=None)
                return
            for event in events.update(out):
                yield event
            if out.finished:
                for event in events.finish(out):
                    yield event
    except EngineDeadError as exc:
        yield events.event("error", code="server_error", message=str(exc), param=None)
        return
    if store is not None and events.response is not None:
        store.put(StoredResponse(events.response, tuple(conversation)))


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API (see the module docs of ``baton.engine.server.responses``)."""
    state = get_state(request)
    check_model(body.model, state.config)
    check_extra_fields(body)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = _stored(
            state.responses, body.previous_response_id, "previous_response_id"
        ).conversation
    items = input_items(body)
    plan: ChatPlan | None = None
    try:
        plan = plan_chat(state, chat_request(body, history, items))
        model = body.model or state.config.served_model_name
        ctx = ResponseContext(new_id("resp"), int(time.time()), model, body, plan)
        streams = await start_requests(
            state, [plan.prompt], plan.params, ctx.response_id, plan.param
        )
        conversation = [*history, *items]
        store = state.responses if body.store else None
        if body.stream:
            if plan.params.structured_outputs is not None:
                await check_first_output(request, streams, plan.param)
            events = ResponseEvents(ctx)
            return SSEResponse(
                stream_events(streams[0], events, store, conversation), lambda: close_all(streams)
            )
        (out,) = await collect_unary(request, streams, plan.param)
    except APIError as exc:  # a tool's schema the grammar cannot hold: say which tool
        tools = plan.tools if plan is not None else None
        raise renamed(name_the_tool(exc, tools)) from None
    except ClientDisconnected:
        return Response(status_code=499)
    output, status = output_items(out, plan)
    response = response_object(ctx, status, output, response_usage(out, plan))
    if store is not None:
        store.put(StoredResponse(response, tuple(conversation)))
    return _json(response)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    """A stored response, as it was answered; 404 naming the id when it is not stored."""
    return _json(_stored(get_state(request).responses, response_id, None).response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, order: str = "desc") -> Response:
    """The conversation a stored response answered, as items (newest first unless
    ``order=asc``, as OpenAI's); 404 naming the id when it is not stored."""
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be asc or desc, got {order!r}", "order")
    items = list(_stored(get_state(request).responses, response_id, None).input_items)
    if order == "desc":
        items.reverse()
    return _json(
        {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
            "has_more": False,
        }
    )


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    """Forgets a stored response; 404 naming the id when it is not stored."""
    if not get_state(request).responses.delete(response_id):
        raise _not_found(response_id, None)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
