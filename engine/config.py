"""Engine configuration, validated once."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

import torch

from baton.engine.sim_specs import DEFAULT_SHAPE, sim_gpu, sim_shape
from baton.engine.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

EXECUTORS = ("uni", "mp", "sim")
SIM_RUNNER_CHOICES = ("calibrated", "off")
# Below this many cores the engine thread competes with the worker's threads:
# measured on 2 cores, async/sync throughput was 0.84-0.99 (default model) and
# 0.58-0.90 (a tiny model), so async scheduling stays off by default there.
MIN_CORES_FOR_OVERLAP = 3


DTYPE_AUTO = "auto"
# Weight quantisations ``EngineConfig.quantization`` takes (None: the weights as loaded).
QUANTIZATIONS = ("int8", "gguf")
# ``EngineConfig.gguf_activations`` values (``kernels/quant_linear.py``'s ACTIVATIONS).
GGUF_ACTIVATIONS = ("int8", "float32")


def auto_dtype(device: str) -> tuple[torch.dtype, str]:
    """The dtype ``dtype="auto"`` picks on ``device``, and why (one sentence for the log).

    bfloat16 where matmuls run natively in it: CUDA devices that support it, CPUs with AMX
    or AVX512-BF16 (measured here, AVX512-BF16 without AMX: the decoder's GEMMs 1.5-2x faster
    than float32 from 8 rows up). float32 elsewhere, where bfloat16 would be emulated.
    """
    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "the CUDA device supports bfloat16"
        return torch.float16, "the CUDA device has no bfloat16; float16 instead"
    if torch.cpu._is_amx_tile_supported():
        return torch.bfloat16, "the CPU has AMX (bfloat16 tile matmuls)"
    if torch.cpu._is_avx512_bf16_supported():
        return torch.bfloat16, "the CPU has AVX512-BF16 (native bfloat16 dot products)"
    return (
        torch.float32,
        "the CPU has neither AMX nor AVX512-BF16, so bfloat16 matmuls would be emulated",
    )


def num_cpu_cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_SPEC_RUNS_WHERE = (
    "speculative decoding runs on one model replica (in the engine's process, in one worker "
    "process or on the simulated device), with either scheduling"
)
# Why structured drafts stay off by default where they can run but were not measured faster
# (``structured_drafts=True`` turns them on there).
_MP_DRAFTS_OFF = (
    "with the model in a worker process (executor='mp', used on CPUs with 3 or more cores) "
    "drafts are not measured faster yet"
)
_CUDA_DRAFTS_OFF = (
    "on CUDA a step with drafts runs eagerly, outside the decode CUDA graphs, and drafts are "
    "not measured on a GPU yet"
)
_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?|sim:[\w.-]+")


def check_device(device: str) -> torch.device:
    """The torch device where the engine's tensors for ``device`` live: "cpu", "cuda", "cuda:N",
    or "sim:<gpu>" (the simulated accelerator, whose host-side tensors are on the CPU).

    Raises:
        ValueError: for any other name, a simulated GPU that is not in ``sim_specs.GPUS``, or a
            CUDA device that this machine does not have (CUDA not available, or N past the
            device count).
    """
    if not isinstance(device, str) or not _DEVICE_RE.fullmatch(device):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'sim:<gpu>', got {device!r}")
    if device == "cpu" or sim_gpu(device) is not None:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r} needs CUDA, which is not available here "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use 'cpu'"
        )
    index = int(device.split(":")[1]) if ":" in device else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {device!r} does not exist: this machine has {count} CUDA devices")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class ReasoningMarkers:
    """The text that opens (``start``) and closes (``end``) a model's thoughts, and what a
    spent reasoning budget writes before ``end`` (``forced_prefix``; see
    ``baton.grammar.reasoning.ReasoningSpec``)."""

    start: str
    end: str
    forced_prefix: str = ""


# Reasoning parsers (vLLM's names) -> the markers of the model's thoughts. gpt-oss (harmony)
# thinks in its analysis channel; its answer is the final channel's message.
REASONING_PARSERS: dict[str, ReasoningMarkers] = {
    "qwen3": ReasoningMarkers("<think>", "</think>"),
    "deepseek_r1": ReasoningMarkers("<think>", "</think>"),
    "openai_gptoss": ReasoningMarkers(
        "<|start|>", "<|channel|>final<|message|>", "<|end|><|start|>assistant"
    ),
}


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance.

    Attributes:
        model: path of a GGUF file or Hugging Face folder; None = default model.
        dtype: weights and activations dtype, or "auto" (the default): bfloat16 where the
            device computes in it natively (CPUs with AMX or AVX512-BF16, CUDA), float32
            elsewhere (see ``auto_dtype``); the choice and its reason are logged at INFO.
            float32 matches transformers to 1e-3 (pin it to compare tokens with
            transformers); bfloat16 runs 1.5-2x faster from 8 rows up on such CPUs, with
            logits about 0.3 away from float32. Resolved to a torch dtype at construction,
            with ``dtype_reason`` saying why.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_model_len: longest sequence (prompt + output); None = the model's context.
        block_size: tokens per KV cache block.
        kv_cache_memory_bytes: memory for the KV cache; sets the number of blocks (and caps
            max_model_len at what one request can hold alone, with a warning).
        num_kv_blocks: explicit number of KV blocks (overrides kv_cache_memory_bytes).
        enable_prefix_caching: reuse cached blocks of identical prefixes.
        seed: base of the seeds drawn for requests that bring none.
        device: where the model runs: "cpu", "cuda", "cuda:N", or "sim:<gpu>" (a simulated
            accelerator: h200, h100, l4; see ``executor/sim.py``). A CUDA device needs the
            in-process executor ("uni"), which overlaps there; a simulated one its own ("sim").
        sim_shape: the model shape a simulated device times (``sim_specs.SHAPES``: smollm2-135m,
            llama-3.1-8b, qwen2.5-7b); None: the default model's, smollm2-135m. Only with a
            "sim:" device; the tokenizer still comes from ``model``.
        sim_traces: the trace file (JSON lines of prompt and output token ids) a simulated
            device replays; None: no traces (every request fails, naming the missing trace).
            With a "sim:" device the KV cache defaults to 90% of the GPU's memory left by the
            weights (``num_kv_blocks`` overrides it).
        sim_runner: what a simulated device charges for the model runner: "calibrated"
            (default: the runner's host time per step, spent on the engine thread as on a GPU,
            and kernel floors, as fitted to the GPU check: ``executor/sim_runner.py``), "off"
            (neither: the device's roofline only), or the path of another calibration file (as
            ``bench/sim/sim_calibration.py`` writes).
        sim_time_scale: a simulated device's times are multiplied by this (> 0; default 1).
            Set to how many times slower this host is than the GPU machine's, a run plays
            that machine in slow motion (``bench/sim/sim_calibration.py`` does).
        grammar_compile_timeout_s: time limit of one grammar compile's own running time
            (its worker process's CPU time: neither its wait in the compile queue nor a
            busy machine counts); past it the worker is killed and the spec fails.
        grammar_compile_workers: grammar compiles that run at once, each in a worker
            process (a compile running longer than 0.1 s stops counting); None: 2, or 1
            on a single core.
        grammar_compile_max_workers: worker processes at most, those slow compiles
            included (each for at most the time limit); None: grammar_compile_workers + 4.
        grammar_compile_queue_size: distinct specs that may wait for a compile worker;
            beyond it ``LLM.generate`` waits and the server answers 503 with Retry-After.
        grammar_cache_bytes: size budget of the engine's cache of compiled grammars (an
            outlines-core index can take tens of MB); least recently used go first.
        grammar_dynamic_compilation: let xgrammar compile JSON schemas lazily
            (much faster compiles, slower first mask fills).
        async_scheduling: plan step N+1 while the device runs step N. None
            turns it on unless an option that cannot overlap is set, or the CPU
            has fewer than 3 cores (then it is off, and the reason is logged at
            INFO); on CUDA it is on. True with an incompatible option raises
            ValueError. Resolved to a bool at construction.
        executor: who runs the model. "mp": a worker process (on CPU the only
            way to overlap, since a forward in a thread is starved by the GIL;
            CPU only); "uni": in this process, synchronously on CPU, queued on a
            stream on CUDA. None picks "uni" on CUDA; on CPU "mp" when async
            scheduling is on, else "uni".
        max_concurrent_batches: steps in flight under async scheduling.
        quantization: weight quantisation the user asks for (vLLM's name); never switched
            by load. None (default): the weights as loaded, on every step. "int8": every
            linear layer and the LM head as int8 weight-only GEMMs (per-output-channel
            scales, quantised from the loaded weights when the model is built; activations
            stay in ``dtype``), on every step whatever its row count, and no dense copy of
            the projections is kept (the embedding stays for lookups). Batch-1 decode is bound
            by reading the weights, which int8 halves against bfloat16; steps of many rows are
            slower than dense bfloat16 (``baton bench linear_kernels``). CPU only; the
            model's linear layers need in_features divisible by 16 (checked when it is
            built). "gguf": a GGUF file's block-quantised linear layers (Q8_0, Q4_0, Q4_1,
            Q4_K, Q6_K; the LM head too) stay in their blocks in memory, repacked at load, and
            every step multiplies them with ``kernels/quant_linear.py`` (activations in
            ``dtype``, or int8 as ``gguf_activations`` says); an embedding of those types stays
            in its blocks too (lookups decode its rows; a tied one's are the LM head's). A
            linear of
            another quantised type is dequantised with a logged warning naming it. CPU only,
            one rank (tensor_parallel_size 1); a model that is not a GGUF file, or has no
            linear of those types, is refused when it is loaded (``ModelLoadError``).
            Reported by ``stats()`` and ``/metrics`` ("none", "int8" or "gguf"; with "gguf"
            ``stats()["quantized_weights"]`` counts the kernel weights by type).
        gguf_activations: with quantization="gguf", how the kernel takes the activations of
            the K-quant weights (Q4_K, Q6_K). "int8" (default): as llama.cpp does, each row of
            x quantised per 256 values to int8 and the dot products summed in integers (at
            batch 1, 2-2.5x faster on those weights; the same rounding of x as llama.cpp's, so
            not gguf's dequantised product to float32 accuracy). "float32": x as given against
            the weights' exact gguf values. Batch-invariant either way (a request's tokens do
            not depend on what else runs); the 32-weight block types always take float32.
        worker_threads: torch threads of the model worker process ("mp"; of each rank's
            under tensor parallelism); None leaves one core to the engine thread when there
            are more than two, and uses every core otherwise (shared out among the ranks),
            at most $OMP_NUM_THREADS per worker when that is set.
        adapt_cpu_threads: on a CPU, run fewer torch threads than that (never more) while
            other processes keep this machine's cores busy, and give them back when the
            cores are free again (``worker/cpu_threads.py``: with one busy process beside
            it, a 2-core machine decoded 3-8x slower on 2 threads than on 1). Changes are
            logged at INFO; ``stats()`` shows ``cpu_threads``. False: the thread count stays
            as set.
        batch_invariant: a request's tokens the same bits whatever else its steps compute
            (the batch, its prompt's chunking, the prefix cache, drafts, the thread count),
            in float32 and bfloat16, on the CPU: a packed GEMM that reduces a lone row in
            another order than a row among others (probed per weight shape at load,
            ``models/row_invariance.py``) gets lone rows padded to two, and prefill is
            attended token by token in the decode kernel's order. False: neither, which is
            faster, if at all, only for long prompts on the CPU (a 1000-token prompt of the
            default model took 4-6% longer token by token in dense bfloat16, measured
            in-process on the AMD EPYC at 5f8d41b; ``bench invariance_cost``'s prefill cell).
            Sliding windows, soft-capped scores and attention sinks take the same kernels.
            Not on CUDA yet (GEMMs and prefill attention chosen per shape by the libraries);
            ``kernels/invariant_matmul.py`` waits for the GPU check to measure it on a GPU.
        tensor_parallel_size: worker processes the model is cut over, one shard of every
            layer each (heads, MLP and vocabulary split; all-reduces through
            ``torch.distributed``, gloo on the CPU). Needs the "mp" executor (None picks it)
            and, so far, device "cpu"; the model's heads, key/value heads and MLP width must
            be divisible by it (checked when the model is loaded).
        speculative_config: speculative decoding (``SpeculativeConfig``, or a dict / JSON text
            of its fields, as vLLM's ``{"method": "ngram", "num_speculative_tokens": 4}``);
            None: as ``structured_drafts`` decides (drafts for structured requests where they
            can run, else off). It runs on one model replica with either scheduling (in this
            process, in the worker process or on the simulated device); with tensor
            parallelism it raises ValueError. Resolved to a ``SpeculativeConfig`` (or None) at
            construction.
        structured_drafts: speculative decoding for structured requests when
            ``speculative_config`` is None: None (default) turns it on ("auto" drafts, the
            grammar's forced tokens then prompt lookup, 3 per step, free text without drafts)
            wherever it can run and was measured faster: where the engine schedules
            synchronously in its own process (on a 2-core CPU by default) and on the simulated
            device (sync or async); it leaves it off elsewhere (logged): in the worker
            process (not measured), and on CUDA with async scheduling, where a step with
            drafts runs outside the CUDA graphs; True asks for it (ValueError where it cannot
            run); False keeps it off. Measured by ``baton bench spec`` (README: faster at
            concurrency 1 and 16 on both JSON workloads, on this CPU and on the simulated
            H200).
        enforce_eager: on CUDA, run every step's forward op by op. False (default, as vLLM's):
            the forward of a pure-decode step (one new token per sequence, up to
            ``worker/cuda_graphs.MAX_CAPTURE_SIZE`` sequences) is captured as CUDA graphs
            when the engine starts, one per batch size up to ``max_num_seqs``, and replayed
            (``worker/cuda_graphs.py``); steps with a prompt chunk or drafts run eagerly. No
            effect on a CPU or a simulated device.
        grammar_fill_thread: with async scheduling, a deferred step's bitmask fill starts as
            soon as the grammars have taken the previous step's tokens, and its native part
            (xgrammar's, llguidance's batched fills) runs on a thread beside the rest of that
            update and the next schedule (``core/fill_thread.py``). True (default); False keeps
            the whole fill on the engine thread after the update (for measurements). Not used
            where drafts are on: drafting reads the grammars while scheduling.
        reasoning_parser: how the model marks its reasoning (vLLM's ``--reasoning-parser``
            names): "qwen3" or "deepseek_r1", both ``<think> ... </think>`` (which must be
            single tokens of the model's vocabulary), or "openai_gptoss" (gpt-oss's harmony:
            the thoughts end with ``<|channel|>final<|message|>``). A structured request's
            grammar then holds from the token after the end of the thoughts, never over them,
            and ``SamplingParams.max_reasoning_tokens`` bounds them. None (default): no
            reasoning, except for gpt-oss (model type ``gpt_oss`` with harmony's tokens), which
            gets "openai_gptoss" as in vLLM; a parser named for gpt-oss must be that one
            (``model_parsers.resolve_parsers``: ValueError when the model is loaded). The
            parser in force is ``stats()["reasoning_parser"]``.
    """

    model: str | None = None
    dtype: torch.dtype | str = DTYPE_AUTO
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "cpu"
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_workers: int | None = None
    grammar_compile_max_workers: int | None = None
    grammar_compile_queue_size: int = 64
    grammar_cache_bytes: int = 1 << 30
    grammar_dynamic_compilation: bool = False
    async_scheduling: bool | None = None
    executor: str | None = None
    max_concurrent_batches: int = 2
    worker_threads: int | None = None
    quantization: str | None = None
    gguf_activations: str = "int8"
    adapt_cpu_threads: bool = True
    batch_invariant: bool = True
    tensor_parallel_size: int = 1
    # Why ``dtype`` is what it is; set at construction.
    dtype_reason: str = field(default="", init=False, compare=False)
    sim_shape: str | None = None
    sim_traces: str | None = None
    sim_runner: str = "calibrated"
    sim_time_scale: float = 1.0
    speculative_config: SpeculativeConfig | None = None
    structured_drafts: bool | None = None
    enforce_eager: bool = False
    grammar_fill_thread: bool = True
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.of(self.speculative_config)
        )
        self._check_sizes()
        self._check_flags()
        simulated = self._check_device()
        self._resolve_dtype()
        self._check_quantization()
        self._check_parallelism()
        self._check_speculative()
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser {self.reasoning_parser!r} is not supported; expected one of "
                f"{', '.join(REASONING_PARSERS)}"
            )
        enabled = self._resolve_async()
        object.__setattr__(self, "async_scheduling", enabled)
        if self.executor is None:
            on_cpu_worker = enabled and self.device == "cpu"
            parallel = self.tensor_parallel_size > 1
            executor = "sim" if simulated else "mp" if on_cpu_worker or parallel else "uni"
            object.__setattr__(self, "executor", executor)
        self._resolve_structured_drafts()

    def _check_sizes(self) -> None:
        """The counts, sizes and time-outs: positive where given."""
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "kv_cache_memory_bytes",
            "max_concurrent_batches",
            "tensor_parallel_size",
            "grammar_compile_queue_size",
            "grammar_cache_bytes",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {v!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 2):
                raise ValueError(f"EngineConfig.{name} must be an int >= 2, got {v!r}")
        if not isinstance(self.grammar_compile_timeout_s, (int, float)) or not (
            self.grammar_compile_timeout_s > 0
        ):
            raise ValueError(
                "EngineConfig.grammar_compile_timeout_s must be > 0, "
                f"got {self.grammar_compile_timeout_s!r}"
            )
        for name in ("grammar_compile_workers", "grammar_compile_max_workers"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"EngineConfig.{name} must be a positive int or None, got {v!r}")
        if (
            self.grammar_compile_workers is not None
            and self.grammar_compile_max_workers is not None
            and self.grammar_compile_max_workers < self.grammar_compile_workers
        ):
            raise ValueError(
                "EngineConfig.grammar_compile_max_workers must be >= grammar_compile_workers, "
                f"got {self.grammar_compile_max_workers} < {self.grammar_compile_workers}"
            )
        if self.worker_threads is not None and (
            not isinstance(self.worker_threads, int)
            or isinstance(self.worker_threads, bool)
            or self.worker_threads < 1
        ):
            raise ValueError(
                f"EngineConfig.worker_threads must be a positive int or None, "
                f"got {self.worker_threads!r}"
            )

    def _check_flags(self) -> None:
        """The boolean switches and the executor's name."""
        for flag in ("adapt_cpu_threads", "enforce_eager", "grammar_fill_thread"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(
                    f"EngineConfig.{flag} must be True or False, got {getattr(self, flag)!r}"
                )
        if self.async_scheduling not in (None, True, False):
            raise ValueError(
                f"EngineConfig.async_scheduling must be None, True or False, "
                f"got {self.async_scheduling!r}"
            )
        if self.executor is not None and self.executor not in EXECUTORS:
            raise ValueError(
                f"EngineConfig.executor must be one of {EXECUTORS} or None, got {self.executor!r}"
            )

    def _check_device(self) -> bool:
        """The device and the simulator's settings; whether the device is simulated."""
        try:
            check_device(self.device)
        except ValueError as exc:
            raise ValueError(f"EngineConfig.device: {exc}") from None
        simulated = self.device.startswith("sim:")
        if simulated:
            try:
                sim_shape(self.sim_shape or DEFAULT_SHAPE)
            except ValueError as exc:
                raise ValueError(f"EngineConfig.sim_shape: {exc}") from None
            if self.executor not in (None, "sim"):
                raise ValueError(
                    f"EngineConfig.executor={self.executor!r} cannot drive the simulated "
                    f"device {self.device!r}; leave it None (or 'sim')"
                )
        elif self.sim_shape is not None or self.sim_traces is not None or self.executor == "sim":
            raise ValueError(
                "EngineConfig.sim_shape, sim_traces and executor='sim' need a simulated device "
                f"(device='sim:<gpu>'), got device {self.device!r}"
            )
        self._check_sim_runner()
        if self.sim_traces is not None and not isinstance(self.sim_traces, str):
            raise ValueError(
                f"EngineConfig.sim_traces must be a path (str), got {self.sim_traces!r}"
            )
        return simulated

    def _check_parallelism(self) -> None:
        """The executor against the device, tensor parallelism and batches in flight."""
        if self.executor == "mp" and self.device != "cpu":
            raise ValueError(
                f"EngineConfig.executor='mp' runs the model in a CPU worker process and cannot "
                f"drive device {self.device!r}; use executor='uni' (or None), which overlaps "
                "on CUDA"
            )
        if self.tensor_parallel_size > 1:
            if self.executor == "uni":
                raise ValueError(
                    f"EngineConfig.tensor_parallel_size={self.tensor_parallel_size} runs one "
                    "worker process per rank and needs executor='mp' (or None), not 'uni'"
                )
            if self.device != "cpu":
                raise ValueError(
                    f"EngineConfig.tensor_parallel_size={self.tensor_parallel_size} runs on the "
                    f"CPU (gloo) so far; device {self.device!r} is not supported with it yet"
                )
        if self.max_concurrent_batches > 2:
            raise ValueError(
                "EngineConfig.max_concurrent_batches must be 1 or 2 "
                f"(one step planned ahead at most), got {self.max_concurrent_batches}"
            )

    def _check_speculative(self) -> None:
        if self.speculative_config is None:
            return
        refused = self._spec_blocker()
        if refused is not None:
            raise ValueError(
                f"EngineConfig.speculative_config is not supported with {refused} yet: "
                f"{_SPEC_RUNS_WHERE}"
            )

    def _spec_blocker(self) -> str | None:
        """What keeps speculative decoding from running with this config, or None."""
        if self.tensor_parallel_size > 1:
            return f"tensor_parallel_size={self.tensor_parallel_size}"
        return None

    def _check_sim_runner(self) -> None:
        runner = self.sim_runner
        if not isinstance(runner, str) or (
            runner not in SIM_RUNNER_CHOICES and not os.path.isfile(runner)
        ):
            raise ValueError(
                f"EngineConfig.sim_runner must be one of {list(SIM_RUNNER_CHOICES)} or the path "
                f"of a calibration file, got {runner!r}"
            )
        scale = self.sim_time_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"EngineConfig.sim_time_scale must be a number > 0, got {scale!r}")
        if not self.device.startswith("sim:") and (self.sim_runner != "calibrated" or scale != 1.0):
            raise ValueError(
                "EngineConfig.sim_runner and sim_time_scale need a simulated device "
                f"(device='sim:<gpu>'), got device {self.device!r}"
            )

    def _resolve_structured_drafts(self) -> None:
        if self.structured_drafts not in (None, True, False):
            raise ValueError(
                "EngineConfig.structured_drafts must be None, True or False, "
                f"got {self.structured_drafts!r}"
            )
        if self.speculative_config is not None or self.structured_drafts is False:
            return
        blocker = self._spec_blocker()
        if blocker is not None:
            if self.structured_drafts:
                raise ValueError(
                    f"EngineConfig.structured_drafts=True is not supported with {blocker} yet: "
                    f"{_SPEC_RUNS_WHERE}"
                )
            logger.info("speculative decoding for structured requests off: %s", blocker)
            return
        if self.structured_drafts is None:
            unmeasured = (
                _MP_DRAFTS_OFF
                if self.executor == "mp"
                else _CUDA_DRAFTS_OFF
                if self.async_scheduling and self.executor != "sim"
                else None
            )
            if unmeasured is not None:
                logger.info("speculative decoding for structured requests off: %s", unmeasured)
                return
        spec = SpeculativeConfig(method="auto", structured_only=True)
        object.__setattr__(self, "speculative_config", spec)
        logger.info(
            "speculative decoding on for structured requests (auto drafts, %d per step; "
            "structured_drafts=False turns it off)",
            spec.num_speculative_tokens,
        )

    def _resolve_dtype(self) -> None:
        if self.dtype == DTYPE_AUTO:
            dtype, why = auto_dtype(self.device)
            reason = f"auto: {why}"
            logger.info("dtype %s (%s)", str(dtype).removeprefix("torch."), reason)
        elif self.dtype in (torch.float32, torch.float16, torch.bfloat16):
            dtype, reason = self.dtype, "asked for"
        else:
            raise ValueError(
                "EngineConfig.dtype must be 'auto', torch.float32, torch.float16 or "
                f"torch.bfloat16, got {self.dtype!r}"
            )
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "dtype_reason", reason)

    def _check_quantization(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                "EngineConfig.quantization must be None (the weights as loaded) or one of "
                f"{list(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(
                f"EngineConfig.quantization={self.quantization!r} needs device='cpu' (its "
                f"kernels are CPU kernels), got {self.device!r}; use quantization=None there"
            )
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(
                f"EngineConfig.gguf_activations must be one of {list(GGUF_ACTIVATIONS)}, got "
                f"{self.gguf_activations!r}"
            )
        if self.quantization == "gguf" and self.tensor_parallel_size != 1:
            raise ValueError(
                "EngineConfig.quantization='gguf' runs on one rank so far; got "
                f"tensor_parallel_size={self.tensor_parallel_size} (use 1, or quantization=None "
                "to cut the dequantised model)"
            )

    def _resolve_async(self) -> bool:
        blocker = None
        cores = num_cpu_cores()
        if self.executor == "uni" and self.device == "cpu":
            blocker = (
                "executor='uni' runs the model in the engine process, where a CPU "
                "forward cannot overlap the scheduler (the GIL starves it); use executor='mp'"
            )
        elif self.max_concurrent_batches < 2:
            blocker = "max_concurrent_batches=1 leaves no room for a step planned ahead"
        few_cores = self.device == "cpu" and cores < MIN_CORES_FOR_OVERLAP
        if blocker is None and few_cores and self.async_scheduling is None and not self.executor:
            # Not incompatible, only slower: asking for it explicitly is allowed.
            blocker = (
                f"only {cores} CPU cores: the model worker needs them all, so overlapping "
                "the engine thread with it costs more than it saves"
            )
        if blocker is None:
            return self.async_scheduling is not False
        if self.async_scheduling:
            raise ValueError(f"async_scheduling=True is incompatible: {blocker}")
        if self.async_scheduling is None:
            logger.info("async scheduling off: %s", blocker)
        return False
