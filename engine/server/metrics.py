"""Prometheus metrics in the text exposition format, written by hand (no client library).

``ServerMetrics`` keeps the per-request counters and histograms that the handlers update
(on the server's event loop) and renders them together with the engine's gauges from
``AsyncLLM.stats()``, then the same data under vLLM's names (``vllm_metrics``). The text
format's primitives are in ``prometheus``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from baton.engine.outputs import RequestOutput
from baton.engine.server.prometheus import (
    Counter,
    Histogram,
    family_header,
    format_labels,
    format_value,
)
from baton.engine.server.vllm_metrics import VllmMetrics
from baton.grammar.compile.service import COMPILE_SECONDS_BUCKETS

PREFIX = "baton_"
REQUEST_STATUSES = ("finished", "aborted", "error", "rejected")
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


# Engine gauges and counters taken from AsyncLLM.stats(): (stats key, metric, type, help).
_ENGINE_METRICS = (
    ("num_running", "num_requests_running", "gauge", "Requests running in the engine."),
    ("num_waiting", "num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    ("kv_usage", "kv_cache_usage", "gauge", "Fraction of KV cache blocks held by requests."),
    ("kv_free_blocks", "kv_free_blocks", "gauge", "KV cache blocks free to allocate."),
    ("kv_total_blocks", "kv_total_blocks", "gauge", "Usable KV cache blocks."),
    (
        "device_busy_fraction",
        "device_busy_fraction",
        "gauge",
        "Device time over wall time inside engine steps since start.",
    ),
    ("steps", "engine_steps_total", "counter", "Engine steps that ran a batch."),
    (
        "cpu_threads",
        "cpu_threads",
        "gauge",
        "Torch threads the model runs on now (0 where no CPU thread governor runs).",
    ),
    (
        "cpu_thread_changes",
        "cpu_thread_changes_total",
        "counter",
        "Times the thread governor changed the thread count for other processes' load.",
    ),
    (
        "deferred_steps",
        "deferred_steps_total",
        "counter",
        "Steps whose sampling waited for a structured request's token in flight.",
    ),
    (
        "spec_draft_tokens",
        "spec_draft_tokens_total",
        "counter",
        "Speculative draft tokens fed to the model (0 without speculative decoding).",
    ),
    (
        "spec_accepted_tokens",
        "spec_accepted_tokens_total",
        "counter",
        "Speculative draft tokens the model's own choice confirmed.",
    ),
    (
        "spec_drafted_steps",
        "spec_drafted_steps_total",
        "counter",
        "Engine steps that fed at least one draft token.",
    ),
    (
        "spec_wasted_rows",
        "spec_wasted_rows_total",
        "counter",
        "Async scheduling: requests' rows planned past drafts that were then rejected.",
    ),
)

# The grammar compile service's gauges and counters, from the same stats.
_GRAMMAR_METRICS = (
    (
        "grammar_compile_queue_length",
        "grammar_compile_queue_length",
        "gauge",
        "Grammars waiting for a compile worker.",
    ),
    (
        "grammar_compile_queue_limit",
        "grammar_compile_queue_limit",
        "gauge",
        "Grammars that may wait for a compile worker; beyond it requests get 503.",
    ),
    ("grammar_compile_running", "grammar_compiles_running", "gauge", "Grammar compiles running."),
    (
        "grammar_compile_workers",
        "grammar_compile_workers",
        "gauge",
        "Grammar compile worker processes alive.",
    ),
    (
        "grammar_cache_entries",
        "grammar_cache_entries",
        "gauge",
        "Compiled grammars kept in the engine's cache.",
    ),
    (
        "grammar_cache_bytes",
        "grammar_cache_bytes",
        "gauge",
        "Size of the compiled grammars in the cache (bounded by its byte budget).",
    ),
    ("grammar_compiles", "grammar_compiles_total", "counter", "Grammar compiles that succeeded."),
    (
        "grammar_compile_errors",
        "grammar_compile_errors_total",
        "counter",
        "Grammar compiles that failed (the spec cannot be compiled, or it needs too much memory).",
    ),
    (
        "grammar_compile_timeouts",
        "grammar_compile_timeouts_total",
        "counter",
        "Grammar compiles stopped at the time limit.",
    ),
    (
        "grammar_compile_worker_kills",
        "grammar_compile_worker_kills_total",
        "counter",
        "Compile worker processes killed at the time limit (and replaced).",
    ),
    (
        "grammar_compile_worker_deaths",
        "grammar_compile_worker_deaths_total",
        "counter",
        "Compile worker processes that ended while compiling (crash, out of memory).",
    ),
    (
        "grammar_compile_worker_starts",
        "grammar_compile_worker_starts_total",
        "counter",
        "Compile worker processes started.",
    ),
    (
        "grammar_cache_hits",
        "grammar_cache_hits_total",
        "counter",
        "Grammar requests served from the compile cache.",
    ),
    (
        "grammar_compile_joined",
        "grammar_compile_joined_total",
        "counter",
        "Grammar requests served by an identical compile already running.",
    ),
    (
        "grammar_compile_rejected",
        "grammar_compile_rejected_total",
        "counter",
        "Requests refused with 503 because the grammar compile queue was full.",
    ),
)


def _compile_histogram(stats: Mapping[str, float | int]) -> list[str]:
    """The compile-time histogram from the ``grammar_compile_seconds_*`` stats keys."""
    name = f"{PREFIX}grammar_compile_seconds"
    lines = family_header(
        name,
        "histogram",
        "Grammar compile time: its own run in a worker plus its rebuild (cache hits excluded).",
    )
    for bound in COMPILE_SECONDS_BUCKETS:
        n = float(stats.get(f"grammar_compile_seconds_le_{bound:g}", 0))
        lines.append(f'{name}_bucket{{le="{format_value(bound)}"}} {format_value(n)}')
    count = float(stats.get("grammar_compile_seconds_count", 0))
    lines.append(f'{name}_bucket{{le="+Inf"}} {format_value(count)}')
    lines.append(f"{name}_sum {format_value(float(stats.get('grammar_compile_seconds_sum', 0.0)))}")
    lines.append(f"{name}_count {format_value(count)}")
    return lines


class ServerMetrics:
    """Request-level metrics of one server plus the engine's, rendered for ``/metrics``.

    ``observe_request`` is called once per finished, aborted or failed generation;
    ``reject`` once per request refused before it ran. vLLM's names for the same data are
    rendered too (``VllmMetrics``), labelled ``model_name``; ``max_model_len`` bounds their
    token-count buckets.
    """

    def __init__(self, model_name: str = "", max_model_len: int = 2048) -> None:
        self._lock = threading.Lock()
        self.vllm = VllmMetrics(model_name, max_model_len)
        self.requests = Counter(
            f"{PREFIX}requests_total",
            "Requests by outcome (finished, aborted, error, rejected).",
            label="status",
        )
        self.requests.preset(REQUEST_STATUSES)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens_total", "Tokens generated.")
        self.structured_requests = Counter(
            f"{PREFIX}structured_requests_total", "Generations with a structured-output constraint."
        )
        self.lenient_requests = Counter(
            f"{PREFIX}structured_unenforced_requests_total",
            "Lenient structured generations (json_schema.strict false) whose backend left some "
            "keywords unenforced.",
        )
        self.generations = Counter(f"{PREFIX}generations_total", "Generations run (any outcome).")
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.tpot = Histogram(
            f"{PREFIX}time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            _TPOT_BUCKETS,
        )

    def reject(self) -> None:
        """Counts a request refused before it ran (bad input, auth, size, model, busy)."""
        with self._lock:
            self.requests.inc(1, "rejected")

    def observe_request(self, status: str, output: RequestOutput | None, structured: bool) -> None:
        """Counts one generation that ran with its final (or last seen) output."""
        if status not in REQUEST_STATUSES:
            raise ValueError(f"status must be one of {REQUEST_STATUSES}, got {status!r}")
        with self._lock:
            self.requests.inc(1, status)
            self.generations.inc()
            if structured:
                self.structured_requests.inc()
            if output is None:
                self.vllm.observe(status, None)
                return
            if output.structured_output_unenforced is not None:
                self.lenient_requests.inc()
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
            ttft = output.metrics.time_to_first_token
            if ttft is not None:
                self.ttft.observe(ttft)
            tpot = output.metrics.time_per_output_token
            if tpot is not None:
                self.tpot.observe(tpot)
            self.vllm.observe(status, output)

    def render(
        self,
        engine_stats: Mapping[str, float | int | str],
        healthy: bool,
        replicas: Sequence[Mapping[str, float | int | str]] = (),
    ) -> str:
        """The whole exposition text (ends with a newline). ``replicas``: a data-parallel
        front end's per-replica rows (``DataParallelLLM.replica_stats()``), rendered as
        series labelled ``replica``, plus its routing counters from ``engine_stats``."""
        with self._lock:
            lines: list[str] = []
            for metric in (
                self.requests,
                self.generations,
                self.prompt_tokens,
                self.generation_tokens,
                self.structured_requests,
                self.lenient_requests,
            ):
                lines += metric.render()
            name = f"{PREFIX}structured_fraction"
            total = self.generations.value()
            fraction = self.structured_requests.value() / total if total else 0.0
            lines += family_header(name, "gauge", "Fraction of generations that were structured.")
            lines.append(f"{name} {format_value(fraction)}")
            lines += self.ttft.render()
            lines += self.tpot.render()
            vllm_lines = self.vllm.render(
                self.prompt_tokens.value(), self.generation_tokens.value(), engine_stats
            )
        for key, metric, kind, help_text in _ENGINE_METRICS:
            name = PREFIX + metric
            lines += family_header(name, kind, help_text)
            lines.append(f"{name} {format_value(float(engine_stats.get(key, 0)))}")
        for key, metric, kind, help_text in _GRAMMAR_METRICS:
            name = PREFIX + metric
            lines += family_header(name, kind, help_text)
            lines.append(f"{name} {format_value(float(engine_stats.get(key, 0)))}")
        lines += _compile_histogram(engine_stats)
        name = f"{PREFIX}model_compute_info"
        lines += family_header(
            name,
            "gauge",
            "How the model computes: dtype, why (dtype_reason), and the weight quantization "
            "used on every step (none, int8 or gguf); always 1.",
        )
        info = {
            "dtype": str(engine_stats.get("dtype", "unknown")),
            "dtype_reason": str(engine_stats.get("dtype_reason", "")),
            "quantization": str(engine_stats.get("quantization", "none")),
        }
        lines.append(f"{name}{format_labels(info)} 1")
        name = f"{PREFIX}healthy"
        lines += family_header(name, "gauge", "1 while the engine can serve requests.")
        lines.append(f"{name} {1 if healthy else 0}")
        if replicas:
            lines += _replica_lines(engine_stats, replicas)
        lines += vllm_lines
        return "\n".join(lines) + "\n"


# Per-replica series of a data-parallel front end: (row key, metric, type, help).
_REPLICA_METRICS = (
    ("healthy", "replica_healthy", "gauge", "1 while the replica takes requests."),
    ("restarts", "replica_restarts_total", "counter", "Times the replica was restarted."),
    ("routed", "replica_requests_routed_total", "counter", "Requests routed to the replica."),
    ("load_tokens", "replica_load_tokens", "gauge", "Outstanding tokens routed to the replica."),
    ("num_running", "replica_requests_running", "gauge", "Requests running in the replica."),
    ("num_waiting", "replica_requests_waiting", "gauge", "Requests waiting in the replica."),
    ("grammar_compiles", "replica_grammar_compiles_total", "counter", "Grammars compiled."),
    (
        "grammar_cache_entries",
        "replica_grammar_cache_entries",
        "gauge",
        "Compiled grammars in the replica's cache.",
    ),
)


def _replica_lines(
    engine_stats: Mapping[str, float | int | str], replicas: Sequence[Mapping[str, Any]]
) -> list[str]:
    lines: list[str] = []
    for key, metric, kind, help_text in _REPLICA_METRICS:
        name = PREFIX + metric
        lines += family_header(name, kind, help_text)
        for row in replicas:
            label = format_labels({"replica": str(row["replica"])})
            lines.append(f"{name}{label} {format_value(float(row.get(key, 0)))}")
    name = f"{PREFIX}dp_routed_by_affinity_total"
    lines += family_header(
        name,
        "counter",
        "Structured requests by grammar affinity: hit (sent to the replica holding the "
        "grammar), miss (that replica busy or down), new (grammar not seen before).",
    )
    for outcome in ("hit", "miss", "new"):
        value = float(engine_stats.get(f"dp_affinity_{outcome}", 0))
        lines.append(f'{name}{{outcome="{outcome}"}} {format_value(value)}')
    name = f"{PREFIX}dp_retried_requests_total"
    lines += family_header(name, "counter", "Requests sent again after their replica died.")
    lines.append(f"{name} {format_value(float(engine_stats.get('dp_retried_requests', 0)))}")
    return lines
