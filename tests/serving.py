"""Serving an ASGI app in the tests: uvicorn on a free loopback port in a thread, and the name the
shared default-model servers are served as."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def serve_in_thread(app: Any, log_level: str = "warning") -> Iterator[str]:
    """Serves the ASGI ``app`` with uvicorn on a free loopback port, in a daemon thread; yields
    its base URL and stops the server on exit. uvicorn is imported here, so that test modules
    that serve nothing do not need it."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


DEFAULT_SERVED_MODEL = "smol"
