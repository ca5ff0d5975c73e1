"""``baton serve``: the command that loads a model and runs the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from baton.engine.server.config import DEFAULT_MAX_BODY_BYTES, ServerConfig
from baton.grammar.spec import BACKENDS

logger = logging.getLogger(__name__)

API_KEY_ENV = "BATON_API_KEY"


def default_served_model_name(model: str | None) -> str:
    """The model's file or folder name (a GGUF file without its ``.gguf`` suffix)."""
    if model is None:
        from baton.engine.loader import default_model_path

        path = Path(default_model_path())
    else:
        path = Path(model)
    name = path.resolve().name if path.exists() else path.name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") and len(name) > 5 else name


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``serve`` on an argparse sub-parser collection; its handler is ``func``."""
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API "
        "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).",
    )
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set ${API_KEY_ENV})",
    )
    p.add_argument("--served-model-name", default=None, help="model name clients send")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="run each step to completion instead of planning the next one while the model runs",
    )
    p.add_argument(
        "--structured-outputs-backend",
        choices=BACKENDS,
        default="auto",
        help="backend of structured requests that name none",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted (413 above)",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Builds the engine and serves until interrupted; returns the exit status.

    Raises:
        ValueError: a bad option (before the model is loaded, where possible).
    """
    import uvicorn

    from baton.engine.async_llm import AsyncLLM
    from baton.engine.server.app import build_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    config = ServerConfig(
        served_model_name=args.served_model_name or default_served_model_name(args.model),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        structured_outputs_backend=args.structured_outputs_backend,
    )
    engine_args: dict[str, Any] = {}
    if args.max_num_seqs is not None:
        engine_args["max_num_seqs"] = args.max_num_seqs
    if args.max_model_len is not None:
        engine_args["max_model_len"] = args.max_model_len
    if args.no_async_scheduling:
        engine_args["async_scheduling"] = False
    engine = AsyncLLM.from_engine_args(args.model, dtype=args.dtype, **engine_args)
    try:
        if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
            logger.warning("serving on %s without an API key", args.host)
        app = build_app(engine, config)
        # Bounded: an open stream must not keep Ctrl-C from stopping the server.
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
    finally:
        engine.shutdown()
    return 0
