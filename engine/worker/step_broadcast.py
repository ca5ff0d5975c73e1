"""One message, many readers: the engine writes each step's message once into shared memory,
and every tensor-parallel rank reads it from there.

A ring of ``slots`` fixed-size slots in one shared buffer, each with a header (sequence number,
length), plus one progress word per reader (the last sequence number it has read). The writer
pickles a message once and copies it into the next slot, then rings each reader with a few
bytes on its socket (``messages.Rung(seq)``), which also orders the message among the others on
that socket. A message that does not fit a slot, or whose slot some reader has not read yet,
is not written: the writer says so, and the caller sends it through the sockets instead. So the
writer never waits for a reader.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from baton.engine.worker.shared_memory import SharedBuffer, TensorLayout, pack_layouts

DEFAULT_SLOTS = 8
DEFAULT_SLOT_BYTES = 1 << 20


@dataclass(frozen=True)
class BroadcastLayout:
    """Where the ring lies in its shared buffer (picklable, sent to each reader)."""

    fd: int
    nbytes: int
    headers: TensorLayout  # int64 [slots, 2]: sequence number, length
    progress: TensorLayout  # int64 [readers]: last sequence number read
    payload: TensorLayout  # uint8 [slots, slot_bytes]


class _Ring:
    def __init__(self, buf: SharedBuffer, layout: BroadcastLayout) -> None:
        self._buf = buf
        self.layout = layout
        self.headers = buf.tensor(layout.headers).numpy()
        self.progress = buf.tensor(layout.progress).numpy()
        self.payload = buf.tensor(layout.payload).numpy()
        self.slots, self.slot_bytes = self.payload.shape


class StepBroadcaster(_Ring):
    """The engine's side: ``publish`` writes a message for every reader.

    Raises:
        OSError: the shared memory cannot be had.
    """

    def __init__(
        self, readers: int, slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES
    ) -> None:
        layouts, total = pack_layouts(
            {
                "headers": (torch.int64, (slots, 2)),
                "progress": (torch.int64, (readers,)),
                "payload": (torch.uint8, (slots, slot_bytes)),
            }
        )
        buf = SharedBuffer.create(total, "baton-step-broadcast")
        layout = BroadcastLayout(
            buf.fd, buf.nbytes, layouts["headers"], layouts["progress"], layouts["payload"]
        )
        super().__init__(buf, layout)
        self._next = 1

    def publish(self, message: Any) -> int | None:
        """Writes ``message`` once for all readers and returns its sequence number (what to
        ring each reader with), or None when it was not written (too large, or its slot not yet
        read by everyone): then send it to each reader directly."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        seq = self._next
        if len(data) > self.slot_bytes or int(self.progress.min()) < seq - self.slots:
            return None
        slot = seq % self.slots
        self.payload[slot, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.headers[slot] = (seq, len(data))
        self._next = seq + 1
        return seq

    def close(self) -> None:
        """Closes the descriptor (after the readers have inherited it)."""
        self._buf.close()


class StepReader(_Ring):
    """A rank's side: ``read`` returns the message of a sequence number it was rung with."""

    def __init__(self, layout: BroadcastLayout, reader: int) -> None:
        buf = SharedBuffer(layout.fd, layout.nbytes)
        super().__init__(buf, layout)
        buf.close()  # the mapping stays
        self._reader = reader

    def read(self, seq: int) -> Any:
        """The message published as ``seq``; marks it read by this reader.

        Raises:
            RuntimeError: the slot holds another message (the ring was misused).
        """
        slot = seq % self.slots
        found, length = (int(v) for v in self.headers[slot])
        if found != seq:
            raise RuntimeError(f"step broadcast slot {slot} holds message {found}, not {seq}")
        message = pickle.loads(self.payload[slot, :length].tobytes())
        self.progress[self._reader] = seq
        return message
