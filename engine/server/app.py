"""``build_app``: the FastAPI application of the OpenAI-compatible server.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (and
``GET``/``DELETE /v1/responses/{id}``), ``GET /v1/models``,
``POST /tokenize`` and ``POST /detokenize`` (vLLM's), ``GET /health`` (503 when the engine
cannot serve), ``GET /metrics`` (Prometheus text).
The app does not own the engine: whoever built it shuts it down. Behind a data-parallel
front end, ``/health`` lists every replica (503 only when none can serve) and ``/metrics``
adds per-replica series.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from baton.engine.entrypoints.serving import ServingEngine
from baton.engine.model_parsers import HARMONY_ARCHITECTURE
from baton.engine.server import chat, completions, responses, tokenize
from baton.engine.server.config import ServerConfig
from baton.engine.server.errors import APIError, install_error_handlers
from baton.engine.server.metrics import ServerMetrics
from baton.engine.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from baton.engine.server.responses_store import ResponseStore
from baton.engine.server.state import ServerState, get_state

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_app(engine: ServingEngine, config: ServerConfig) -> FastAPI:
    """An app serving ``engine`` (an ``AsyncLLM`` or a ``DataParallelLLM``) under ``config``
    (API key, body limit, model name), its parsers resolved for the engine's model
    (``ServerConfig.resolved``: gpt-oss gets harmony's where none is named) and logged.

    Raises:
        ValueError: a parser named in ``config`` that cannot read the model.
    """
    architecture = engine.model_architecture()
    # Harmony's tokens are looked up for gpt-oss only (other models' parsers need no tokenizer).
    tokenizer = engine.get_tokenizer() if architecture == HARMONY_ARCHITECTURE else None
    config = config.resolved(architecture, tokenizer)
    logger.info(
        "serving %s (model type %s): reasoning parser %s, tool call parser %s",
        config.served_model_name,
        architecture or "unknown",
        config.reasoning_parser or "none",
        config.tool_call_parser or "the chat template's, else hermes",
    )
    app = FastAPI(title="baton", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(config.served_model_name, engine.max_model_len)
    store = ResponseStore(config.responses_store_size)
    app.state.baton = ServerState(engine, config, metrics, store)
    created = int(time.time())
    install_error_handlers(app, metrics.reject)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(responses.router)
    app.include_router(tokenize.router)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        state = get_state(request)
        card = {
            "id": state.config.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "baton",
            "max_model_len": state.engine.max_model_len,
            # The parsers in force (gpt-oss's harmony ones where none was named); None: none.
            "reasoning_parser": state.config.reasoning_parser,
            "tool_call_parser": state.config.tool_call_parser,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health(request: Request) -> Response:
        engine = get_state(request).engine
        replicas = [
            {"replica": r["replica"], "healthy": bool(r["healthy"]), "restarts": r["restarts"]}
            for r in engine.replica_stats()
        ]
        if not engine.is_healthy():
            error = APIError(503, "the engine is not running")
            if replicas:
                return JSONResponse({**error.body(), "replicas": replicas}, status_code=503)
            return error.response()
        return JSONResponse({"status": "ok", **({"replicas": replicas} if replicas else {})})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        state = get_state(request)
        engine = state.engine
        text = state.metrics.render(engine.stats(), engine.is_healthy(), engine.replica_stats())
        return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)

    # The last added runs first: the key is checked before any body is read.
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.max_body_bytes, on_reject=metrics.reject
    )
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, on_reject=metrics.reject)
    return app
