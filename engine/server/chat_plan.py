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
from baton.engine.server.constraints import Constraint
from baton.engine.server.errors import bad_request
from baton.engine.server.params import chat_sampling_params
from baton.engine.server.protocol import ChatCompletionRequest
from baton.engine.server.reasoning import ReasoningSplitter
from baton.engine.server.state import ServerState
from baton.engine.server.tool_output import tool_message
from baton.engine.server.tools import ToolPlan, prepare_messages, tool_plan
from baton.engine.tokenizer import Tokenizer


def render_chat(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    tools: ToolPlan | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """The prompt token ids of the conversation, rendered with the model's chat template, or
    ``chat_template`` where given (the server's ``--chat-template``), with the tools, earlier
    calls and tool results as ``prepare_messages`` lays them out.

    Raises:
        APIError: 400 for non-text content parts, malformed tool calls, a conversation the
            template rejects, or ``continue_final_message`` with ``add_generation_prompt``.
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
    template = chat_template if chat_template is not None else tokenizer.chat_template
    messages, variables = prepare_messages(messages, tools, template)
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            tokenize=True,
            continue_final_message=body.continue_final_message,
            chat_template=template,
            **{**variables, **(body.chat_template_kwargs or {})},
        )
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise bad_request(f"messages: the chat template failed: {exc}", "messages") from None
    return list(ids)


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
    tools = tool_plan(body, state.tool_call_format)
    params, constraint = chat_sampling_params(
        body, state.config, tools, defaults=state.engine.sampling_defaults()
    )
    tokenizer = state.engine.get_tokenizer()
    prompt = render_chat(tokenizer, body, tools, state.config.chat_template)
    parser = state.config.reasoning_parser
    splitter = None if parser is None else ReasoningSplitter(tokenizer, parser)
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
