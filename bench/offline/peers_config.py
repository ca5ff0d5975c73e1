"""What one ``baton bench peers`` run measures (``PeersConfig``), and the dtypes it knows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton.bench.offline.peer_runners import ENGINES
from baton.engine.config import auto_dtype

DTYPES = ("float32", "bfloat16")


def resolve_dtypes(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` with "auto" replaced by what baton's ``dtype="auto"`` picks on this CPU."""
    out = []
    for name in names:
        if name == "auto":
            name = str(auto_dtype("cpu")[0]).removeprefix("torch.")
        if name not in out:
            out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class PeersConfig:
    """What one run measures; raises ``ValueError`` naming a bad field.

    Attributes:
        concurrency: prompts submitted at once, one measured case each.
        max_tokens: most output tokens per request (EOS counts as one).
        dtypes: dtypes of baton and its Python peers (one row each per dtype); the first
            one is the one the goals are judged on.
        engines: keys of ``ENGINES`` to run, in this order on the first repeat.
        repeats: runs of every engine; the order is reversed on every other run and
            figures are medians over the runs.
        model: GGUF file or Hugging Face folder (None: the default model);
            with ``tiny``, only its tokenizer is used.
        tiny: a random-weight 2-layer model over the model's vocabulary (smoke runs).
    """

    concurrency: tuple[int, ...] = (1, 16)
    max_tokens: int = 96
    dtypes: tuple[str, ...] = ("float32",)
    engines: tuple[str, ...] = tuple(ENGINES)
    repeats: int = 1
    model: str | None = None
    tiny: bool = False

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be positive ints, got {list(self.concurrency)}")
        if self.max_tokens < 2:
            raise ValueError(
                f"max_tokens must be >= 2 (TPOT needs two tokens), got {self.max_tokens}"
            )
        if not self.dtypes or any(d not in DTYPES for d in self.dtypes):
            raise ValueError(
                f"dtypes must be a non-empty subset of {list(DTYPES)}, got {list(self.dtypes)}"
            )
        if not self.engines or any(e not in ENGINES for e in self.engines):
            raise ValueError(
                f"engines must be a non-empty subset of {list(ENGINES)}, got {list(self.engines)}"
            )
        for name in ("concurrency", "dtypes", "engines"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name} must not repeat a value, got {list(values)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
