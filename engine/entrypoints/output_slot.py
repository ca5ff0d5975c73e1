"""``OutputSlot``: where a producer thread leaves one request's outputs for the consumer on its
event loop (``AsyncLLM``'s engine thread, ``DataParallelLLM``'s pump threads)."""

from __future__ import annotations

import asyncio

from baton.engine.outputs import RequestOutput


class OutputSlot:
    """The newest output of one request, or the error that ended it, waiting for its consumer.

    Outputs are cumulative, so only the newest waits: a slower consumer merges the ones it
    missed and loses nothing; a finished output is never replaced. An error waits beside the
    output and is raised once no output is left to take.

    Args:
        loop: the consumer's event loop (``offer`` schedules onto it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None

    def offer(self, item: RequestOutput | BaseException) -> bool:
        """Hands an output or an error to the consumer's loop, from any thread; False when
        that loop is closed and nobody is listening."""
        try:
            self._loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:
            return False
        return True

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        elif self._latest is None or not self._latest.finished:
            self._latest = item
        self._event.set()

    async def take(self) -> RequestOutput:
        """The newest output not taken yet, waiting for one; raises the waiting error when
        no output is left."""
        while self._latest is None and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._latest is not None:
            out, self._latest = self._latest, None
            return out
        error, self._error = self._error, None
        assert error is not None
        raise error
