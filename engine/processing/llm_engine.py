"""``LLMEngine``: builds an engine from a config and runs it: input checks, core steps, outputs.

Why two layers (``LLMEngine`` here, ``EngineCore`` in ``core/``) in one process: the core
sees token ids only (scheduler, executor, grammars over the vocabulary) and holds no text and no
user-facing ids, so it can run wherever the device work is driven from (a data-parallel
replica, or its own process as vLLM's EngineCoreProc) and be tested without a tokenizer.
This layer owns everything textual around it: prompt checks and tokenisation, seeds and
n > 1 fan-out, detokenisation and stop strings, ``RequestOutput``s. It is also where the
pieces are put together (loader, executor, structured-output manager, scheduler, core).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from baton.engine.config import REASONING_PARSERS, EngineConfig
from baton.engine.core.async_scheduler import AsyncScheduler
from baton.engine.core.draft_policy import DraftPolicy
from baton.engine.core.drafter import Drafter
from baton.engine.core.engine_core import EngineCore, InFlight
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request
from baton.engine.core.scheduler import Scheduler
from baton.engine.core.structured_outputs import StructuredOutputManager
from baton.engine.errors import EngineBusyError
from baton.engine.executor.multiproc import MultiprocExecutor
from baton.engine.gc_heap import freeze_startup_heap, release_heap
from baton.engine.loader import Checkpoint
from baton.engine.outputs import RequestOutput
from baton.engine.processing.model_setup import engine_threads, setup_model
from baton.engine.processing.output_processor import OutputProcessor
from baton.engine.sampling_params import SamplingParams
from baton.engine.sync_check import SyncChecker
from baton.engine.tokenizer import Tokenizer
from baton.grammar.compile.service import (
    CompilePoolConfig,
    CompileQueueFull,
    default_compile_workers,
)
from baton.grammar.reasoning import reasoning_token_ids

logger = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15
# Worker processes beyond grammar_compile_workers that slow compiles may hold (each for at most
# the time limit), so that a few slow or hostile specs block no one.
_SLOW_COMPILE_WORKERS = 4


_MIN_FLOAT32 = float(torch.finfo(torch.float32).tiny)


class LLMEngine:
    """A whole engine in one process: tokenizer, core (scheduler + runner), outputs.

    ``add_request`` validates and queues; ``step`` runs one engine step and
    returns the ``RequestOutput`` of every request that progressed.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        self.config = config
        checker = SyncChecker.from_env()
        model = setup_model(config, checkpoint, checker)
        self.vocab_size = model.vocab_size
        self.tokenizer: Tokenizer = model.tokenizer
        self.max_model_len = model.max_model_len
        self.eos_token_ids = model.eos_token_ids
        kv = KVCacheManager(
            model.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            group_windows=model.kv_group_windows,
        )
        self._executor = model.executor
        workers = config.grammar_compile_workers or default_compile_workers()
        spec = config.speculative_config
        self.structured = StructuredOutputManager(
            self.tokenizer,
            model.vocab_size,
            # With drafts, a request's bitmask rows are its last token's and one per draft.
            config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)),
            compile_timeout_s=config.grammar_compile_timeout_s,
            dynamic_compilation=config.grammar_dynamic_compilation,
            fill_threads=engine_threads(config, model.worker_threads),
            compile_pool=CompilePoolConfig(
                workers=workers,
                max_workers=max(
                    workers, config.grammar_compile_max_workers or workers + _SLOW_COMPILE_WORKERS
                ),
                max_queued=config.grammar_compile_queue_size,
            ),
            cache_bytes=config.grammar_cache_bytes,
            reasoning=None
            if model.reasoning_parser is None
            else reasoning_token_ids(self.tokenizer, *_markers(model.reasoning_parser)),
            eos_token_ids=tuple(self.eos_token_ids),
        )
        # The parser in force: config.reasoning_parser, or gpt-oss's harmony one where none
        # was named (model_parsers.resolve_parsers); and the architecture it was chosen for.
        self.reasoning_parser: str | None = model.reasoning_parser
        self.architecture: str | None = model.architecture
        scheduler_cls = AsyncScheduler if config.async_scheduling else Scheduler
        drafter = Drafter(spec, self.tokenizer) if spec is not None else None
        policy = DraftPolicy(spec.num_speculative_tokens) if spec and spec.adaptive else None
        scheduler = scheduler_cls(config, kv, self.max_model_len, self.structured, drafter, policy)
        self.core = EngineCore(
            scheduler,
            model.executor,
            async_scheduling=bool(config.async_scheduling),
            checker=checker,
            fill_thread=config.grammar_fill_thread,
        )
        # The step the core left in flight (async scheduling), handed back on the next step.
        self._in_flight: InFlight | None = None
        self.outputs = OutputProcessor(self.tokenizer)
        self._seeds = random.Random(config.seed)
        self.sampling_defaults: dict[str, float | int] = dict(model.sampling_defaults)
        # quantization="gguf": e.g. "Q4_1=120,Q8_0=1" (kernel weights by GGUF type).
        self._quantized_types = ",".join(f"{k}={v}" for k, v in model.quantized_types.items())
        if self.sampling_defaults:
            logger.info("sampling defaults from the model: %s", self.sampling_defaults)
        logger.info(
            "engine ready: %s on %s in %s%s, %d KV blocks of %d tokens, max_model_len %d, "
            "executor %s%s, async scheduling %s, reasoning parser %s",
            model.path,
            config.device,
            _dtype_name(config.dtype),
            _quantization_note(config, self._quantized_types),
            model.num_kv_blocks,
            config.block_size,
            self.max_model_len,
            config.executor,
            f" x{config.tensor_parallel_size} ranks" if config.tensor_parallel_size > 1 else "",
            "on" if config.async_scheduling else "off",
            self.reasoning_parser or "none",
        )
        freeze_startup_heap()

    def default_sampling_params(self, **fields: object) -> SamplingParams:
        """``SamplingParams`` with the model's sampling defaults (its generation config), then
        ``fields`` on top: a field given here always wins. Raises ``ValueError`` for a bad
        field."""
        return SamplingParams(**{**self.sampling_defaults, **fields})  # type: ignore[arg-type]

    # ----------------------------------------------------------------- input
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        final_only: bool = False,
    ) -> None:
        """Validates and tokenises a prompt, then queues its ``n`` completions. With
        ``final_only`` ``step()`` returns the prompt's output only once it is finished (offline
        generation), which spares building an output, and decoding text, at every step.

        Raises:
            ValueError: empty prompt, text with lone surrogates, a prompt that
                leaves no room for output within max_model_len, token ids outside
                the vocabulary, or a duplicate request id.
            EngineBusyError: its grammar would need a new compile and the compile
                queue is full (``LLM.generate`` waits; the server answers 503).
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_params(params)
        if self.outputs.child_ids(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None:
            self.check_compile_room(params)
        seeds = self._request_seeds(params)
        child_ids = self.outputs.add_request(request_id, text, token_ids, params, final_only)
        for cid, seed in zip(child_ids, seeds, strict=True):
            self.core.add_request(Request.new(cid, token_ids, params, self.eos_token_ids, seed))

    def validate_params(self, params: SamplingParams) -> None:
        """Checks what SamplingParams cannot check alone: the structured-output spec,
        values the sampler's float32 state cannot hold, stop token ids and logit_bias ids in
        the vocabulary.

        Raises:
            ValueError: naming what is wrong.
        """
        if params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(params, name)
            # The sampler keeps these in float32, where they would round to 0: temperature 0
            # there contradicts the request's non-greedy mode, and top_p or
            # repetition_penalty 0 is out of range; either fails the whole step.
            if 0 < value < _MIN_FLOAT32:
                raise ValueError(
                    f"{name} {value!r} is too small: the sampler keeps it in float32, "
                    f"where positive values below {_MIN_FLOAT32:.3g} round to 0"
                )
        if params.max_reasoning_tokens is not None:
            if self.reasoning_parser is None:
                raise ValueError(
                    "max_reasoning_tokens needs a reasoning model: start the engine with "
                    "reasoning_parser (e.g. 'qwen3')"
                )
            if params.structured_outputs is None:
                raise ValueError(
                    "max_reasoning_tokens bounds the thoughts before a structured answer; "
                    "this request has no structured_outputs"
                )
        vocab = self.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be < vocab size {vocab}, got {bad}")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must be < vocab size {vocab}, got {bad}")

    def has_compile_room(self, params: SamplingParams) -> bool:
        """False when a request with ``params`` would queue a new grammar compile and the
        compile queue is full (nothing else is checked, nothing is counted)."""
        spec = params.structured_outputs
        return spec is None or self.structured.has_room(spec)

    def check_compile_room(self, params: SamplingParams) -> None:
        """Raises ``EngineBusyError`` (and counts the refusal) when ``has_compile_room`` is
        False."""
        if params.structured_outputs is None:
            return
        try:
            self.structured.check_room(params.structured_outputs)
        except CompileQueueFull as exc:
            raise EngineBusyError(
                f"the engine is busy: {exc}; retry in {exc.retry_after_s:.0f} s",
                exc.retry_after_s,
            ) from None

    def tokenize_prompt(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids, checked; queues nothing.

        Raises:
            ValueError: empty prompt, text with lone surrogates, token ids outside the
                vocabulary, or a prompt that leaves no room for output within max_model_len.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                # Lone surrogates (JSON allows "\ud800") make the tokenizer raise TypeError.
                raise ValueError(
                    f"prompt must be valid Unicode text: {exc.reason} at position {exc.start}"
                ) from None
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text: str | None = prompt
        else:
            ids = list(prompt)
            text = None
            vocab = self.vocab_size
            bad = [
                t
                for t in ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
            ]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:3]}")
        if not ids:
            raise ValueError("prompt must contain at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                "so it must have at most max_model_len - 1 tokens"
            )
        return text, ids

    def _request_seeds(self, params: SamplingParams) -> list[int]:
        if params.seed is None:
            return [self._seeds.getrandbits(63) for _ in range(params.n)]
        # Completion 0 uses the user's seed as given, so n=1 and n>1 agree on it.
        return [(params.seed + i * _SEED_MIX) % (1 << 63) for i in range(params.n)]

    def abort_request(self, request_id: str) -> None:
        """Aborts all completions of a prompt; frees their KV blocks."""
        self.core.abort_requests(self.outputs.child_ids(request_id))
        self.outputs.remove(request_id)

    # ------------------------------------------------------------------ run
    def has_unfinished_requests(self) -> bool:
        return (
            self.core.has_unfinished_requests()
            or self._in_flight is not None
            or self.outputs.has_unfinished()
        )

    def step(self) -> list[RequestOutput]:
        """One engine step; returns outputs of requests that progressed or finished."""
        core_outputs, self._in_flight = self.core.step(self._in_flight)
        t0 = time.perf_counter()
        results, to_abort = self.outputs.process(core_outputs)
        if to_abort:  # finished by a stop string, or failed in output processing
            self.core.abort_requests(to_abort)
        self.core.stats.add("output", t0, time.perf_counter())
        return results

    def stats(self) -> dict[str, float | int | str]:
        """Engine step statistics since start (see ``EngineStats``), the current load:
        ``num_running``, ``num_waiting``, ``kv_total_blocks``, ``kv_free_blocks``,
        ``kv_usage``; how the model computes: ``dtype`` (e.g. "bfloat16"),
        ``dtype_reason`` (why: "asked for", or what ``dtype="auto"`` saw), and
        ``quantization`` (the weight quantisation in force on every step: "none", "int8"
        or "gguf"), ``reasoning_parser`` (the one in force, gpt-oss's harmony one where
        none was named; "none" without), and with "gguf" ``quantized_weights`` (the kernel
        weights by GGUF type, e.g. "Q4_1=120,Q8_0=1": fused projections and the LM head) and
        ``gguf_activations``
        ("int8" or "float32", ``EngineConfig.gguf_activations``);
        ``cpu_threads``, ``cpu_max_threads``, ``cpu_thread_changes`` and
        ``cpu_others_busy_cores`` where a CPU thread governor runs (``adapt_cpu_threads``);
        ``tensor_parallel_size``, and with it above 1 ``tp_collective_s``: of ``device_s``,
        rank 0's seconds inside collectives (all-reduces, logits gather, token broadcast); and
        the grammar compile service's counters, gauges and compile-time histogram
        (``grammar_*`` keys, see ``CompileService.stats``); with speculative decoding
        ``spec_draft_tokens`` (drafts fed), ``spec_accepted_tokens`` (drafts kept),
        ``spec_acceptance_rate``, ``spec_drafted_steps`` (steps that fed any draft) and
        ``spec_wasted_rows`` (async: rows planned past drafts that were rejected); with the
        adaptive draft policy ``spec_draft_depth`` (the drafts per request its last decision
        chose) and, once fitted, ``spec_step_fixed_ms`` and ``spec_step_row_ms`` (a line
        through the cost of its decode steps without drafts)."""
        sched = self.core.scheduler
        stats: dict[str, float | int | str] = dict(self.core.stats.as_dict())
        stats.update(
            dtype=_dtype_name(self.config.dtype),
            dtype_reason=self.config.dtype_reason,
            quantization=self.config.quantization or "none",
            reasoning_parser=self.reasoning_parser or "none",
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_total_blocks=sched.kv.num_blocks - 1,  # block 0 is reserved
            kv_free_blocks=sched.kv.num_free_blocks,
            kv_usage=sched.kv.usage,
            tensor_parallel_size=self.config.tensor_parallel_size,
        )
        if self._quantized_types:
            stats["quantized_weights"] = self._quantized_types
            stats["gguf_activations"] = self.config.gguf_activations
        threads = self._executor.thread_state()
        if threads is not None:
            stats.update(
                cpu_threads=threads.threads,
                cpu_max_threads=threads.max_threads,
                cpu_thread_changes=threads.changes,
                cpu_others_busy_cores=threads.others_cores,
            )
        if isinstance(self._executor, MultiprocExecutor) and self.config.tensor_parallel_size > 1:
            stats["tp_collective_s"] = self._executor.collective_seconds
        if self.config.speculative_config is not None:
            drafted = sched.num_draft_tokens
            stats.update(
                spec_draft_tokens=drafted,
                spec_accepted_tokens=sched.num_accepted_tokens,
                spec_acceptance_rate=sched.num_accepted_tokens / drafted if drafted else 0.0,
                spec_drafted_steps=sched.num_drafted_steps,
                spec_wasted_rows=sched.num_wasted_rows,
            )
        if sched.draft_policy is not None:
            stats["spec_draft_depth"] = sched.draft_policy.last_depth
            line = sched.draft_policy.cost_line()
            if line is not None:
                stats.update(spec_step_fixed_ms=1e3 * line[0], spec_step_row_ms=1e3 * line[1])
        stats.update(self.structured.service.stats())
        return stats

    def idle_work(self) -> bool:
        """One short slice of work deferred to idle time (moving the GGUF weights onto huge
        pages, ``worker/weight_pages.py``), if any; whether any remains. For a caller with no
        request unfinished (no step in flight)."""
        if self.has_unfinished_requests():
            return False
        return self.core.idle_work()

    def failure(self) -> str | None:
        """Why this engine can no longer run steps (e.g. the model worker died), or None
        while it can. Reads only flags, so any thread may call it."""
        return self.core.failure()

    def shutdown(self) -> None:
        """Stops the model worker (if any) and the grammar compile workers; idempotent."""
        self.core.shutdown()
        self.structured.shutdown()
        release_heap()


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _quantization_note(config: EngineConfig, types: str) -> str:
    """The start-up log's words for the weight quantisation in force."""
    if config.quantization == "int8":
        return " with int8 weight-only linears"
    if config.quantization == "gguf":
        return (
            f" with GGUF-quantised linears ({types}; {config.gguf_activations} activations "
            "for Q4_K/Q6_K)"
        )
    return ""


_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_from_dict(prompt: Mapping[str, Any]) -> str | Sequence[int]:
    """The text or token ids of a vLLM-style dict prompt (``TextPrompt``, ``TokensPrompt``):
    the entry points turn dict prompts into what ``tokenize_prompt`` takes with it.

    Raises:
        ValueError: keys other than "prompt" and "prompt_token_ids" (baton takes no
            multi-modal data, embeddings or extra fields, and says so rather than drop them),
            or not exactly one of the two.
    """
    extra = sorted(str(k) for k in prompt if k not in _PROMPT_KEYS)
    if extra:
        raise ValueError(
            f"prompt fields {extra} are not supported: a dict prompt holds 'prompt' (text) "
            "or 'prompt_token_ids'"
        )
    given = [k for k in _PROMPT_KEYS if k in prompt]
    if len(given) != 1:
        raise ValueError("a dict prompt must hold exactly one of 'prompt' and 'prompt_token_ids'")
    value = prompt[given[0]]
    if given[0] == "prompt" and not isinstance(value, str):
        raise ValueError(f"'prompt' must be a string, got {type(value).__name__}")
    if given[0] == "prompt_token_ids" and not isinstance(value, (list, tuple)):
        raise ValueError(f"'prompt_token_ids' must be a list of ints, got {type(value).__name__}")
    return value


def _markers(parser: str) -> tuple[str, str, str]:
    """``reasoning_token_ids``'s texts of ``parser`` (``REASONING_PARSERS``)."""
    markers = REASONING_PARSERS[parser]
    return markers.start, markers.end, markers.forced_prefix
