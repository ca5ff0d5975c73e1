"""``ServerState``: what the route handlers share (engine, settings, metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from baton.engine.entrypoints.serving import ServingEngine
from baton.engine.server.config import ServerConfig
from baton.engine.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerState:
    """The objects one server's handlers use; kept on ``app.state.baton``."""

    engine: ServingEngine
    config: ServerConfig
    metrics: ServerMetrics


def get_state(request: Request) -> ServerState:
    """The state of the app serving ``request``."""
    return request.app.state.baton
