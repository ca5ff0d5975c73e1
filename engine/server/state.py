"""``ServerState``: what the route handlers share (engine, settings, metrics, stored
responses)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from fastapi import Request

from baton.engine.entrypoints.serving import ServingEngine
from baton.engine.server.config import ServerConfig
from baton.engine.server.metrics import ServerMetrics
from baton.engine.server.responses_store import ResponseStore
from baton.grammar.tool_formats import ToolCallFormat, choose_tool_call_format


@dataclass(frozen=True)
class ServerState:
    """The objects one server's handlers use; kept on ``app.state.baton``."""

    engine: ServingEngine
    config: ServerConfig
    metrics: ServerMetrics
    responses: ResponseStore = field(default_factory=ResponseStore)

    @functools.cached_property
    def tool_call_format(self) -> ToolCallFormat:
        """The syntax the model writes tool calls in: ``config.tool_call_parser``'s, else the
        one the chat template (the server's, else the tokenizer's) writes, else Hermes'
        (``choose_tool_call_format``). Found on first use, then kept."""
        template = self.config.chat_template or self.engine.get_tokenizer().chat_template
        return choose_tool_call_format(self.config.tool_call_parser, template)

    @functools.cached_property
    def tool_markers(self) -> tuple[tuple[tuple[str, int], ...], bool]:
        """The markers of ``tool_call_format`` that are one token of the model's vocabulary,
        with their ids, and whether one of them is a control token (``ToolPlan``)."""
        tokenizer = self.engine.get_tokenizer()
        found = []
        for marker in self.tool_call_format.markers:
            ids = tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) == 1:
                found.append((marker, ids[0]))
        control = any(i in tokenizer.all_special_ids for _, i in found)
        return tuple(found), control


def get_state(request: Request) -> ServerState:
    """The state of the app serving ``request``."""
    return request.app.state.baton
