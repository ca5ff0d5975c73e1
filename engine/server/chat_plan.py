"""What ``/v1/chat/completions`` and ``/v1/responses`` share: a conversation rendered with the
chat template, the request planned into prompt, sampling parameters, constraint, tool plan
and reasoning splitter, and one finished completion read back into thoughts, text and tool
calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2

from baton.engine.outputs import CompletionOutput
from baton.engine.sampling_params import SamplingParams
from baton.engine.server.config import ServerConfig
from baton.engine.server.constraints import Constraint
from baton.engine.server.errors import bad_request
from baton.engine.server.params import chat_sampling_params
from baton.engine.server.protocol import REASONING_EFFORTS, ChatCompletionRequest
from baton.engine.server.reasoning import ReasoningSplitter, reasoning_splitter
from baton.engine.server.state import ServerState
from baton.engine.server.tool_output import tool_message
from baton.engine.server.tools import ToolPlan, prepare_messages, tool_plan
from baton.engine.tokenizer import Tokenizer, chat_template_variables


def render_chat(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    tools: ToolPlan | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """The prompt token ids of the conversation, rendered with the request's own
    ``chat_template``, else ``chat_template`` where given (the server's ``--chat-template``),
    else the model's, with the tools, earlier calls and tool results as ``prepare_messages``
    lays them out, and the request's ``reasoning_effort`` (see ``template_variables``).

    Raises:
        APIError: 400 for non-text content parts, malformed tool calls, a conversation the
            template rejects, a request template that does not parse or fails to render
            (naming ``chat_template``), a ``reasoning_effort`` the template cannot take, or
            ``continue_final_message`` with ``add_generation_prompt``.
    """
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request(
            "continue_final_message needs add_generation_prompt set to false",
            "continue_final_message",
        )
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                        f"messages[{i}].content",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        message = m.model_dump(exclude_none=True)
        message["content"] = content or ""
        messages.append(message)
    own = body.chat_template is not None
    template = (
        body.chat_template
        if own
        else chat_template
        if chat_template is not None
        else tokenizer.chat_template
    )
    messages, variables = prepare_messages(messages, tools, template)
    variables.update(template_variables(template, body))
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            tokenize=True,
            continue_final_message=body.continue_final_message,
            chat_template=template,
            **variables,
        )
    except jinja2.TemplateSyntaxError as exc:
        if own:
            raise bad_request(f"chat_template does not parse: {exc}", "chat_template") from None
        raise bad_request(f"messages: the chat template failed: {exc}", "messages") from None
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        if own:
            raise bad_request(f"chat_template failed to render: {exc}", "chat_template") from None
        raise bad_request(f"messages: the chat template failed: {exc}", "messages") from None
    except Exception as exc:  # a request's own template may fail any way; never a 500
        if not own:
            raise
        raise bad_request(
            f"chat_template failed to render: {type(exc).__name__}: {exc}", "chat_template"
        ) from None
    return list(ids)


def template_variables(template: str | None, body: ChatCompletionRequest) -> dict[str, Any]:
    """The variables the request passes to ``template``: its ``chat_template_kwargs`` and its
    ``reasoning_effort``, which only a template that reads ``reasoning_effort`` can take
    (effort "none", asking for nothing, is accepted by any template).

    Raises:
        APIError: 400 naming ``chat_template`` for a request template that does not parse,
            or ``reasoning_effort`` for a value that is not an effort, one the template does
            not read, or one that ``chat_template_kwargs`` contradicts.
    """
    variables = dict(body.chat_template_kwargs or {})
    effort = body.reasoning_effort
    if effort is None:
        return variables
    if effort not in REASONING_EFFORTS:
        raise bad_request(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
            "reasoning_effort",
        )
    try:
        reads = template is not None and "reasoning_effort" in chat_template_variables(template)
    except jinja2.TemplateSyntaxError as exc:
        raise bad_request(f"chat_template does not parse: {exc}", "chat_template") from None
    if not reads:
        if effort == "none":
            return variables
        raise bad_request(
            f"reasoning_effort {effort!r} is not supported: the chat template in use does not "
            "read reasoning_effort (send null or 'none', or a template that reads it)",
            "reasoning_effort",
        )
    if variables.get("reasoning_effort", effort) != effort:
        raise bad_request(
            "reasoning_effort and chat_template_kwargs.reasoning_effort differ",
            "reasoning_effort",
        )
    variables["reasoning_effort"] = effort
    return variables


@dataclass(frozen=True)
class ChatPlan:
    """A chat request made ready to run.

    Attributes:
        prompt: the rendered conversation's token ids.
        params: its sampling parameters (the constraint in them).
        constraint: the constraint and the body field that carried it, if any.
        tools: the tool plan; None without tools.
        splitter: cuts answers into thoughts and the rest (the server's reasoning parser).
    """

    prompt: list[int]
    params: SamplingParams
    constraint: Constraint | None
    tools: ToolPlan | None
    splitter: ReasoningSplitter | None

    @property
    def param(self) -> str | None:
        """The body field that carried the constraint (named in a 400)."""
        return self.constraint.param if self.constraint is not None else None


def plan_chat(state: ServerState, body: ChatCompletionRequest) -> ChatPlan:
    """The tool plan (calls in the server's syntax, ``ServerState.tool_call_format``),
    sampling parameters (with the server's default thinking budget), constraint and prompt of
    ``body`` under the server's settings.

    Raises:
        APIError: 400 naming the bad field (see ``tool_plan``, ``chat_sampling_params`` and
            ``render_chat``).
    """
    check_request_template(body.chat_template, state.config)
    tools = tool_plan(body, state.tool_call_format, *state.tool_markers)
    params, constraint = chat_sampling_params(
        body, state.config, tools, defaults=state.engine.sampling_defaults()
    )
    tokenizer = state.engine.get_tokenizer()
    prompt = render_chat(tokenizer, body, tools, state.config.chat_template)
    parser = state.config.reasoning_parser
    splitter = None if parser is None else reasoning_splitter(tokenizer, parser)
    return ChatPlan(prompt, params, constraint, tools, splitter)


def assistant_reply(
    c: CompletionOutput, plan: ChatPlan, thinks: bool
) -> tuple[str | None, dict[str, Any], str | None]:
    """``(reasoning, message, finish_reason)`` of a finished completion: its thoughts (None
    without a reasoning parser or when it did not think), the assistant message (content,
    and ``tool_calls`` read out of the text when the plan allows calls) and OpenAI's finish
    reason (``thinks``: the completion began with thoughts, ``ReasoningSplitter.thinks_first``).
    """
    reasoning, text = None, c.text
    if plan.splitter is not None:
        reasoning, text = plan.splitter.split(c.text, c.token_ids, thinks)
    tools = plan.tools
    if tools is not None and tools.mode != "none":
        message, reason = tool_message(text or "", c.finish_reason, tools.fmt, tools.functions)
    else:
        message, reason = {"role": "assistant", "content": text}, c.finish_reason
    return reasoning, message, reason


def check_request_template(template: str | None, config: ServerConfig) -> None:
    """Refuses a request's own chat template unless the server trusts them.

    Raises:
        APIError: 400 naming ``chat_template`` when ``template`` is given and the server was
            not started with ``--trust-request-chat-template``.
    """
    if template is not None and not config.trust_request_chat_template:
        raise bad_request(
            "this server does not accept a request's own chat_template (start it with "
            "--trust-request-chat-template to allow it)",
            "chat_template",
        )
