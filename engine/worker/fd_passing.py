"""File descriptors handed from the engine to its model worker over their socket.

The worker is started before the engine has its shared buffers (it imports torch and the
runner meanwhile, while the engine reads the checkpoint), so the buffers' descriptors cannot be
inherited: they follow over the connection as ``SCM_RIGHTS`` ancillary data. The worker gets
its own numbers for them; ``receive_fds`` maps the engine's numbers (which the ``WorkerInit``
message names) to the worker's.

Wire format: one fixed header of ``_SLOTS`` int32 (the engine's descriptor numbers, -1 padded)
sent with the descriptors attached, before any ``Connection`` message.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence
from multiprocessing.connection import Connection

_SLOTS = 8
_HEADER = struct.Struct(f"<{_SLOTS}i")


def send_fds(conn: Connection, fds: Sequence[int]) -> None:
    """Sends ``fds`` (at most 8) to the other end of ``conn``; they stay open here.

    Raises:
        ValueError: more than 8 descriptors. OSError: the socket is closed.
    """
    if len(fds) > _SLOTS:
        raise ValueError(f"at most {_SLOTS} descriptors at once, got {len(fds)}")
    header = _HEADER.pack(*fds, *([-1] * (_SLOTS - len(fds))))
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        socket.send_fds(sock, [header], list(fds))


def receive_fds(conn: Connection) -> dict[int, int] | None:
    """The descriptors ``send_fds`` sent: the sender's number -> this process's. None when the
    connection closed first (the engine gave up before handing them over).

    Raises:
        OSError: a truncated message (descriptors or header lost).
    """
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        data, fds, flags, _ = socket.recv_fds(sock, _HEADER.size, _SLOTS)
        if not data:
            return None
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise OSError("the engine's descriptors arrived truncated")
        while len(data) < _HEADER.size:
            more = sock.recv(_HEADER.size - len(data))
            if not more:
                return None
            data += more
    theirs = [n for n in _HEADER.unpack(data) if n >= 0]
    if len(theirs) != len(fds):
        raise OSError(f"expected {len(theirs)} descriptors from the engine, got {len(fds)}")
    return dict(zip(theirs, fds, strict=True))
