"""``ResponseStore``: the stored responses of ``/v1/responses`` (``store: true``), so that a
later request can continue one (``previous_response_id``) and ``GET /v1/responses/{id}``
can return it. Bounded: past ``capacity`` the least recently used response is evicted."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: the response object as it was answered.
        input_items: the whole conversation it answered (the previous response's input and
            output items first), as items.
    """

    response: dict[str, Any]
    input_items: tuple[dict[str, Any], ...]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """Its input and output items: what a follow-up request continues."""
        return [*self.input_items, *self.response["output"]]


class ResponseStore:
    """A thread-safe LRU map from response id to ``StoredResponse``.

    Raises:
        ValueError: ``capacity`` is not a positive int.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        """Keeps ``stored`` under its response's id, evicting the least recently used
        response beyond the capacity."""
        with self._lock:
            self._items[stored.response["id"]] = stored
            self._items.move_to_end(stored.response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None if unknown or evicted."""
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        """Forgets a response; whether it was stored."""
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
