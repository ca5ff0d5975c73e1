"""engine/worker/messages.py: the engine-worker messages are frozen values that survive the
pickle trip and say what went wrong when a message is not the one expected."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from baton.engine.worker.messages import (
    Execute,
    Failed,
    Ready,
    Rung,
    Sample,
    Shutdown,
    failure_text,
)

MESSAGES = [
    Execute(so=None),  # type: ignore[arg-type]
    Rung(7),
    Sample(3, 1, ("a", "b"), (1, 2)),
    Sample(4, 0),
    Shutdown(),
    Ready(),
    Failed("Traceback ..."),
]


@pytest.mark.parametrize("message", MESSAGES)
def test_messages_survive_pickling_and_are_frozen(message: object) -> None:
    assert pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)) == message
    fields = dataclasses.fields(message)  # type: ignore[arg-type]
    if fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(message, fields[0].name, None)


def test_failure_text_names_what_went_wrong() -> None:
    assert failure_text(Failed("boom")) == "boom"
    text = failure_text(("error", "x"))
    assert text == "unexpected message from the model worker: ('error', 'x')"
    assert len(failure_text(b"y" * 5000)) < 2100
    # The bootstrap's bare reason where it cannot import messages.py: its lines as they are.
    assert failure_text("cannot import the model worker:\nTraceback") == (
        "cannot import the model worker:\nTraceback"
    )
