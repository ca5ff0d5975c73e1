"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes: a prompt (or a conversation,
rendered with the chat template as ``/v1/chat/completions`` renders it) to token ids, and ids
back to text."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from baton.engine.server.chat_plan import check_request_template, render_chat
from baton.engine.server.errors import bad_request
from baton.engine.server.params import check_model
from baton.engine.server.protocol import ChatCompletionRequest, ChatMessage
from baton.engine.server.state import get_state

router = APIRouter()


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize``: ``prompt`` text, or chat ``messages`` (exactly one; with
    ``chat_template``, rendered with that template instead of the server's)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """Body of ``POST /detokenize``: the ids to turn into text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """The prompt's (or the rendered conversation's) token ids, their count and the model's
    ``max_model_len``; with ``return_token_strs`` each id's token string.

    Raises:
        APIError: 400 for neither or both of prompt and messages, or a conversation that
            does not render (``render_chat``); 404 for another model.
    """
    state = get_state(request)
    check_model(body.model, state.config)
    tokenizer = state.engine.get_tokenizer()
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        check_request_template(body.chat_template, state.config)
        chat = ChatCompletionRequest(
            model=body.model,
            messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
            chat_template=body.chat_template,
        )
        ids = render_chat(tokenizer, chat, chat_template=state.config.chat_template)
    else:
        assert body.prompt is not None
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    answer: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": state.engine.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }
    return JSONResponse(answer)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    """The text of ``tokens`` (special tokens included, as vLLM's).

    Raises:
        APIError: 400 for an id outside the vocabulary; 404 for another model.
    """
    state = get_state(request)
    check_model(body.model, state.config)
    tokenizer = state.engine.get_tokenizer()
    vocab = tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(
            f"tokens {bad[:5]} are not ids of the vocabulary (0..{vocab - 1})", "tokens"
        )
    return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})
