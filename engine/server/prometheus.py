"""Prometheus text exposition primitives, written by hand (no client library): label and
value formatting, a family's HELP/TYPE header, and the ``Counter`` and ``Histogram`` the
server's metrics keep. Not thread-safe: their owner locks."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping


def escape_label_value(value: str) -> str:
    """A label value with backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value: integers without a fraction, infinities as +Inf/-Inf."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def format_labels(labels: Mapping[str, str]) -> str:
    """``{k="v",...}`` with the values escaped; empty for no labels."""
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items()) + "}"


def family_header(name: str, kind: str, help_text: str) -> list[str]:
    """The HELP and TYPE lines that open a metric family (once per family)."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class Counter:
    """A monotonically increasing count, optionally split by one label."""

    def __init__(self, name: str, help_text: str, label: str | None = None) -> None:
        self.name, self.help, self.label = name, help_text, label
        self._values: dict[str, float] = {}

    def inc(self, amount: float = 1.0, label_value: str = "") -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (got {amount})")
        self._values[label_value] = self._values.get(label_value, 0.0) + amount

    def value(self, label_value: str = "") -> float:
        return self._values.get(label_value, 0.0)

    def preset(self, label_values: Iterable[str]) -> None:
        """Shows these label values at 0 before they first happen."""
        for v in label_values:
            self._values.setdefault(v, 0.0)

    def render(self, const_labels: Mapping[str, str] | None = None) -> list[str]:
        """The family's lines; ``const_labels`` go on every sample, before the split label."""
        const = dict(const_labels or {})
        lines = family_header(self.name, "counter", self.help)
        if not self._values:
            lines.append(f"{self.name}{format_labels(const)} 0")
        for lv, v in sorted(self._values.items()):
            labels = {**const, self.label: lv} if self.label else const
            lines.append(f"{self.name}{format_labels(labels)} {format_value(v)}")
        return lines


class Histogram:
    """Observations counted into cumulative ``le`` buckets, with their sum and count."""

    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        self.name, self.help = name, help_text
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Counts ``value`` ``times`` times (a request's inter-token gaps at their mean)."""
        self.count += times
        self.sum += value * times
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self._counts[i] += times

    def render(
        self,
        const_labels: Mapping[str, str] | None = None,
        name: str | None = None,
        help_text: str | None = None,
    ) -> list[str]:
        """The family's lines, under ``name`` and ``help_text`` if given (one set of data
        under two names)."""
        name = name or self.name
        const = dict(const_labels or {})
        lines = family_header(name, "histogram", help_text or self.help)
        for upper, n in zip(self.buckets, self._counts, strict=True):
            lines.append(f"{name}_bucket{format_labels({**const, 'le': format_value(upper)})} {n}")
        lines.append(f"{name}_bucket{format_labels({**const, 'le': '+Inf'})} {self.count}")
        lines.append(f"{name}_sum{format_labels(const)} {format_value(self.sum)}")
        lines.append(f"{name}_count{format_labels(const)} {self.count}")
        return lines
