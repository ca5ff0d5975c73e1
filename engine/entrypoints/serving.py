"""What the OpenAI server needs of an engine front end: ``ServingEngine`` (implemented by
``AsyncLLM``, one engine, and ``DataParallelLLM``, replicas on Ray) and the ``OutputStream``
each request gets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from baton.engine.entrypoints.async_llm import Prompt
from baton.engine.outputs import RequestOutput
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import Tokenizer


class OutputStream(Protocol):
    """One request's cumulative outputs; the last has ``finished`` set. ``close()`` aborts
    the request unless it has finished."""

    request_id: str

    @property
    def finished(self) -> bool: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    def close(self) -> None: ...


class ServingEngine(Protocol):
    """An engine the server can serve (see ``AsyncLLM`` for each method's contract)."""

    max_model_len: int

    async def add_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> OutputStream: ...

    async def abort(self, request_id: str) -> None: ...

    def get_tokenizer(self) -> Tokenizer: ...

    def model_architecture(self) -> str | None: ...

    def sampling_defaults(self) -> dict[str, float | int]: ...

    def stats(self) -> dict[str, float | int | str]: ...

    def replica_stats(self) -> list[dict[str, float | int | str]]: ...

    def is_healthy(self) -> bool: ...

    def shutdown(self) -> None: ...
