"""``baton serve``: the command that loads a model and runs the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2

from baton.engine.entrypoints.args import add_engine_args, config_from_args
from baton.engine.entrypoints.dp_config import DataParallelConfig
from baton.engine.entrypoints.serving import ServingEngine
from baton.engine.server.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RESPONSES_STORE_SIZE,
    ServerConfig,
)
from baton.grammar.spec import BACKENDS
from baton.grammar.tool_formats import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

API_KEY_ENV = "BATON_API_KEY"
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
        "(/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health, /metrics).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set ${API_KEY_ENV})",
    )
    p.add_argument("--served-model-name", default=None, help="model name clients send")
    add_engine_args(p)
    p.add_argument(
        "--structured-outputs-backend",
        choices=BACKENDS,
        default="auto",
        help="backend of structured requests that name none",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (or the template itself) used instead of the model's",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests send their own chat_template (off: such a request is a 400)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=tuple(TOOL_CALL_PARSERS),
        default=None,
        help="the model's tool-call syntax (vLLM's parser names); default: openai (harmony) "
        "for gpt-oss, else the one the chat template writes, else hermes",
    )
    p.add_argument(
        "--max-reasoning-tokens",
        type=int,
        default=None,
        metavar="N",
        help="with --reasoning-parser: the thinking budget of a structured request that gives "
        "no max_reasoning_tokens (default: unbounded)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted (413 above)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_RESPONSES_STORE_SIZE,
        help="how many /v1/responses answers are kept for previous_response_id "
        "(least recently used evicted first)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long requests in flight may run before they are cancelled "
        f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g}; a second Ctrl-C stops at once)",
    )
    _add_data_parallel_args(p)
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    p.set_defaults(func=run_serve)
    return p


def _add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    """The data-parallel group of ``serve``'s flags."""
    dp = p.add_argument_group("data parallel (engine replicas on Ray)")
    dp.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="serve with N engine replicas, each a Ray actor with its own model (default 1)",
    )
    dp.add_argument(
        "--distributed-executor-backend",
        choices=("ray",),
        default=None,
        help="where replicas run: ray (the default, and the only one, when "
        "--data-parallel-size > 1)",
    )
    dp.add_argument(
        "--ray-address",
        default=None,
        help="an existing Ray cluster ('auto', host:port or ray://host:port); default: start "
        "a local one",
    )
    dp.add_argument(
        "--no-grammar-affinity",
        action="store_true",
        help="route structured requests by load alone instead of to the replica that already "
        "compiled their grammar",
    )


def run_serve(args: argparse.Namespace) -> int:
    """Builds the engine and serves until SIGTERM or SIGINT; returns the exit status.

    On either signal the server stops accepting connections, lets the requests in flight
    finish (at most ``--shutdown-timeout`` seconds, then cancels them), shuts the engine
    down and returns 0. When the server cannot start (e.g. the port is taken) uvicorn exits
    with status 3 (``SystemExit``), after the engine is shut down.

    Raises:
        ValueError: a bad option (before the model is loaded, where possible).
    """
    import uvicorn

    from baton.engine.entrypoints.async_llm import AsyncLLM
    from baton.engine.loader import model_architecture
    from baton.engine.server.app import build_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    shutdown_timeout = getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S)
    if not shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}")
    config = ServerConfig(
        served_model_name=args.served_model_name or default_served_model_name(args.model),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        structured_outputs_backend=args.structured_outputs_backend,
        reasoning_parser=getattr(args, "reasoning_parser", None),
        chat_template=chat_template_text(args.chat_template),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        responses_store_size=getattr(args, "responses_store_size", DEFAULT_RESPONSES_STORE_SIZE),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        max_reasoning_tokens=getattr(args, "max_reasoning_tokens", None),
    )
    # Refused before the model loads: a parser that cannot read it (its architecture is read
    # alone; build_app resolves again with the engine's tokenizer and keeps that result).
    config.resolved(model_architecture(args.model), None)
    engine: ServingEngine
    dp_config = data_parallel_config(args)
    if dp_config is None:
        engine = AsyncLLM(config_from_args(args))
    else:
        from baton.engine.entrypoints.data_parallel import DataParallelLLM

        engine = DataParallelLLM(config_from_args(args), dp_config)
    try:
        if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
            logger.warning("serving on %s without an API key", args.host)
        server = uvicorn.Server(
            uvicorn.Config(
                build_app(engine, config),
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                # Bounded: an open stream must not keep a stop signal from stopping the server.
                timeout_graceful_shutdown=shutdown_timeout,
            )
        )
        with _stop_signals_absorbed():
            server.run()
        if not server.started:
            return 1
        logger.info("server stopped; shutting the engine down")
    finally:
        engine.shutdown()
    return 0


def data_parallel_config(args: argparse.Namespace) -> DataParallelConfig | None:
    """The replicas ``baton serve`` asked for; None for one engine in this process.

    Raises:
        ValueError: a Ray option without ``--data-parallel-size`` > 1, or a bad size.
    """
    size = getattr(args, "data_parallel_size", 1)
    if size == 1:
        for flag, value in (
            ("--distributed-executor-backend", getattr(args, "distributed_executor_backend", None)),
            ("--ray-address", getattr(args, "ray_address", None)),
        ):
            if value is not None:
                raise ValueError(f"{flag} needs --data-parallel-size > 1")
        return None
    return DataParallelConfig(
        size=size,
        backend=args.distributed_executor_backend or "ray",
        ray_address=args.ray_address,
        grammar_affinity=not args.no_grammar_affinity,
    )


@contextlib.contextmanager
def _stop_signals_absorbed() -> Iterator[None]:
    """While serving, SIGINT/SIGTERM are uvicorn's (graceful shutdown). After its shutdown,
    uvicorn raises the signal it caught again, for the handler it replaced: with the default
    ones, SIGTERM would kill the process (status -15, engine never shut down) and SIGINT
    would raise KeyboardInterrupt. These no-op handlers take that second delivery instead."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are the main thread's; uvicorn does not capture them either
        return

    def absorb(signum: int, frame: object) -> None:
        logger.debug("signal %d after shutdown: already stopping", signum)

    previous = {sig: signal.signal(sig, absorb) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def chat_template_text(value: str | None) -> str | None:
    """``--chat-template``'s template: the file's text where ``value`` names a file, else the
    value itself when it reads as a Jinja template.

    Raises:
        ValueError: neither a readable file nor template text.
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it ({exc})") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template {value}: not a valid Jinja template ({exc})") from None
    return text
