"""Token traces the simulated accelerator replays: per prompt, the output tokens it produces.

A trace file holds one JSON object per line, ``{"prompt": [ids], "output": [ids]}``: real
token sequences (greedy outputs recorded from a model, or valid JSON instances tokenised). The
simulated device samples a request's output tokens from the trace of its prompt, then the end
of sequence; a request that goes on past that (it ignores EOS) fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Trace:
    """The output tokens the device produces for one prompt."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]


class TraceBook:
    """Traces by prompt.

    Raises:
        ValueError: two traces for one prompt with different outputs, or a trace with a
            negative or non-integer token.
    """

    def __init__(self, traces: Iterable[Trace] = ()) -> None:
        self._by_prompt: dict[tuple[int, ...], tuple[int, ...]] = {}
        for t in traces:
            for tok in (*t.prompt, *t.output):
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise ValueError(f"trace tokens must be non-negative ints, got {tok!r}")
            known = self._by_prompt.setdefault(t.prompt, t.output)
            if known != t.output:
                raise ValueError(
                    f"two traces for one prompt (first tokens {list(t.prompt[:8])}) differ"
                )

    def __len__(self) -> int:
        return len(self._by_prompt)

    def output_for(self, prompt: Sequence[int]) -> tuple[int, ...] | None:
        """The trace's output for ``prompt``, or None when no trace has this prompt."""
        return self._by_prompt.get(tuple(prompt))

    def traces(self) -> list[Trace]:
        return [Trace(p, o) for p, o in self._by_prompt.items()]

    @classmethod
    def load(cls, path: str | Path) -> TraceBook:
        """Reads a trace file.

        Raises:
            ValueError: naming the file and line of anything that is not a trace.
            OSError: the file cannot be read.
        """
        traces = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    traces.append(Trace(tuple(item["prompt"]), tuple(item["output"])))
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{n}: not a trace ({exc})") from None
        try:
            return cls(traces)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def save(self, path: str | Path) -> None:
        """Writes the traces as a trace file (one JSON object per line)."""
        with open(path, "w", encoding="utf-8") as f:
            for prompt, output in self._by_prompt.items():
                f.write(json.dumps({"prompt": list(prompt), "output": list(output)}) + "\n")
