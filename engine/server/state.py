"""``ServerState``: what the route handlers share (engine, settings, metrics, stored
responses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from baton.engine.entrypoints.serving import ServingEngine
from baton.engine.server.config import ServerConfig
from baton.engine.server.metrics import ServerMetrics
from baton.engine.server.responses_store import ResponseStore


@dataclass(frozen=True)
class ServerState:
    """The objects one server's handlers use; kept on ``app.state.baton``."""

    engine: ServingEngine
    config: ServerConfig
    metrics: ServerMetrics
    responses: ResponseStore = field(default_factory=ResponseStore)


def get_state(request: Request) -> ServerState:
    """The state of the app serving ``request``."""
    return request.app.state.baton
