"""vLLM's metric names (``vllm:...``) on ``/metrics``, so that dashboards and autoscalers
written for vLLM read baton unchanged.

Every series carries ``model_name`` (the served model name). Values come from the same
bookkeeping as baton's own series: the token counters are ``ServerMetrics``' counters
rendered under vLLM's names, the gauges are the engine's stats, and the histograms are fed
from the same ``RequestMetrics`` in the same call that feeds baton's, once per request,
with vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from baton.engine.outputs import RequestOutput
from baton.engine.server.prometheus import (
    Counter,
    Histogram,
    family_header,
    format_labels,
    format_value,
)

PREFIX = "vllm:"
# vLLM's FinishReason values; shown at 0 before they first happen, as vLLM does.
FINISHED_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


# (engine stats key, vLLM gauge, help): kv_cache_usage_perc's older name is kept as vLLM does.
_GAUGES = (
    ("num_running", "num_requests_running", "Number of requests in model execution batches."),
    ("num_waiting", "num_requests_waiting", "Number of requests waiting to be processed."),
    ("kv_usage", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    (
        "kv_usage",
        "gpu_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage. Older name of vllm:kv_cache_usage_perc.",
    ),
)


class VllmMetrics:
    """The per-request data of vLLM's series that baton's own series do not hold: requests by
    finish reason and vLLM-bucketed histograms. Not thread-safe: ``ServerMetrics`` locks."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.labels = {"model_name": model_name}
        self.success = Counter(
            f"{PREFIX}request_success_total",
            "Count of processed requests by finish reason (one per completion).",
            label="finished_reason",
        )
        self.success.preset(FINISHED_REASONS)
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (each of a request's gaps is counted "
            "at the request's mean gap).",
            INTER_TOKEN_BUCKETS,
        )
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            E2E_BUCKETS,
        )
        token_buckets = buckets_1_2_5(max_model_len)
        self.prompt_len = Histogram(
            f"{PREFIX}request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.generation_len = Histogram(
            f"{PREFIX}request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )

    def observe(self, status: str, output: RequestOutput | None) -> None:
        """Records one generation that ran (``status`` as ``ServerMetrics.observe_request``):
        its completions' finish reasons (``abort`` for one cut off by an abort, ``error`` for
        one the engine failed) and, with an output, its sizes and timings."""
        fallback = "abort" if status == "aborted" else "error"
        if output is None:
            self.success.inc(1, fallback)
            return
        for c in output.outputs:
            self.success.inc(1, c.finish_reason or fallback)
        m = output.metrics
        self.prompt_len.observe(len(output.prompt_token_ids))
        self.generation_len.observe(sum(len(c.token_ids) for c in output.outputs))
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        self.e2e.observe(max(0.0, end - m.arrival_time))
        ttft = m.time_to_first_token
        if ttft is not None:
            self.ttft.observe(ttft)
        tpot = m.time_per_output_token
        if tpot is not None:
            self.inter_token.observe(tpot, times=m.num_generation_tokens - 1)

    def render(
        self,
        prompt_tokens: float,
        generation_tokens: float,
        engine_stats: Mapping[str, float | int | str],
    ) -> list[str]:
        """vLLM's families: ``prompt_tokens`` and ``generation_tokens`` are baton's counters'
        values, the gauges ``engine_stats``' (``AsyncLLM.stats()``)."""
        lines: list[str] = []
        labels = format_labels(self.labels)
        for key, metric, help_text in _GAUGES:
            name = PREFIX + metric
            lines += family_header(name, "gauge", help_text)
            lines.append(f"{name}{labels} {format_value(float(engine_stats.get(key, 0)))}")
        for metric, value, help_text in (
            ("prompt_tokens_total", prompt_tokens, "Number of prefill tokens processed."),
            ("generation_tokens_total", generation_tokens, "Number of generation tokens."),
        ):
            name = PREFIX + metric
            lines += family_header(name, "counter", help_text)
            lines.append(f"{name}{labels} {format_value(value)}")
        lines += self.success.render(self.labels)
        lines += self.ttft.render(self.labels)
        lines += self.inter_token.render(self.labels)
        lines += self.inter_token.render(
            self.labels,
            name=f"{PREFIX}time_per_output_token_seconds",
            help_text="Histogram of time per output token in seconds. Older name of "
            "vllm:inter_token_latency_seconds (the same data).",
        )
        lines += self.e2e.render(self.labels)
        lines += self.prompt_len.render(self.labels)
        lines += self.generation_len.render(self.labels)
        return lines
