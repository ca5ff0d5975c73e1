"""Errors that the engine's rooms share with its front ends."""

from __future__ import annotations


class EngineBusyError(RuntimeError):
    """The engine cannot take this request now (its grammar compile queue is full); nothing
    was queued. Retry after ``retry_after_s`` seconds (``LLM.generate`` waits by itself; the
    server answers 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
