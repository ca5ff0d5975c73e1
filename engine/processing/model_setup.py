"""The model side of an engine: the checkpoint (or, for a simulated device, a model shape and
the tokenizer), the KV cache size, and the executor that runs the model."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from baton.engine.config import EngineConfig, num_cpu_cores
from baton.engine.executor.base import Executor
from baton.engine.executor.multiproc import MultiprocExecutor
from baton.engine.executor.sim import SimExecutor, sim_model_config
from baton.engine.executor.sim_runner import (
    CALIBRATION_PATH,
    RunnerModel,
    load_calibration,
)
from baton.engine.executor.sim_traces import TraceBook
from baton.engine.executor.uni import UniExecutor
from baton.engine.executor.worker_process import WorkerProcess
from baton.engine.host_speed import host_speed_seconds
from baton.engine.kv_capacity import StepShape, lone_request_limit
from baton.engine.kv_layout import KVCacheLayout, kv_cache_layout
from baton.engine.loader import Checkpoint, ShardSpec, load_checkpoint, load_tokenizer
from baton.engine.model_parsers import resolve_parsers
from baton.engine.sim_specs import DEFAULT_SHAPE, sim_gpu, sim_shape
from baton.engine.sync_check import SyncChecker
from baton.engine.tokenizer import Tokenizer
from baton.engine.worker.build import RunnerSpec, build_runner
from baton.engine.worker.cpu_threads import ThreadGovernor
from baton.engine.worker.weight_pages import WeightPageMover

logger = logging.getLogger(__name__)

# A simulated device keeps this share of its memory, after the weights, for the KV cache.
_SIM_KV_MEMORY_SHARE = 0.9


@dataclass(frozen=True)
class ModelSetup:
    """What the engine needs to know of its model, and the executor that runs it."""

    path: str
    vocab_size: int
    tokenizer: Tokenizer
    max_model_len: int
    num_kv_blocks: int
    eos_token_ids: tuple[int, ...]
    executor: Executor
    worker_threads: int | None  # torch threads of a model worker process, if there is one
    # SamplingParams fields the model's generation config sets (none on a simulated device).
    sampling_defaults: dict[str, float | int]
    # quantization="gguf": the kernel weights by GGUF type (``Checkpoint.quantized_types``).
    quantized_types: dict[str, int] = field(default_factory=dict)
    # Each KV cache group's attention window (None: full attention; kv_layout.py): one group
    # for a model of one kind, e.g. (None,) or (4096,) (Mistral v0.1); (None, W) where
    # windowed layers and full ones keep blocks of their own (Gemma 2). A windowed group's
    # blocks wholly before its window can go back to the pool.
    kv_group_windows: tuple[int | None, ...] = (None,)
    # ``ModelConfig.architecture`` (None on a simulated device), and the reasoning parser in
    # force: the one named, or gpt-oss's harmony one (``model_parsers.resolve_parsers``).
    architecture: str | None = None
    reasoning_parser: str | None = None


def setup_model(
    config: EngineConfig, checkpoint: Checkpoint | None, checker: SyncChecker
) -> ModelSetup:
    """Loads the model (or, for a "sim:" device, only its tokenizer and traces) and starts
    its executor.

    Raises:
        ModelLoadError: the model or tokenizer cannot be read. ValueError: a bad trace file.
        ExecutorError: the model worker failed to start.
    """
    if sim_gpu(config.device) is not None:
        return _setup_sim(config, checkpoint, checker)
    # The worker process starts now and imports torch and the runner while this process reads
    # the model (1.3-1.9 s of a 1B GGUF server's start, on 2 cores).
    early = WorkerProcess() if config.executor == "mp" else None
    try:
        return _setup_loaded(config, checkpoint, checker, early)
    except BaseException:
        if early is not None:
            early.stop()  # idempotent: the executor may have stopped it already
        raise


def _setup_loaded(
    config: EngineConfig,
    checkpoint: Checkpoint | None,
    checker: SyncChecker,
    early: WorkerProcess | None,
) -> ModelSetup:
    size = config.tensor_parallel_size
    # Under tensor parallelism from a file, each rank's shard is read on its own: the whole
    # model is never in memory (rank 0's shard also gives the config and tokenizer).
    sharded = checkpoint is None and size > 1
    if sharded:
        ckpt = _load_shard(config, 0)
    else:
        # Repacked onto plain pages: the executor moves them onto huge pages in idle time
        # (worker/weight_pages.py says why), so the load does not wait for that.
        ckpt = checkpoint or load_checkpoint(
            config.model,
            dtype=config.dtype,
            keep_quantized=config.quantization == "gguf",
            huge_pages=False,
        )
    c = ckpt.config
    # Before the executor starts: a parser that cannot read the model fails here.
    parsers = resolve_parsers(c.architecture, ckpt.tokenizer, config.reasoning_parser)
    if parsers.reasoning != config.reasoning_parser:
        logger.info(
            "model type %s speaks harmony: reasoning parser %s (none named)",
            c.architecture,
            parsers.reasoning,
        )
    max_model_len = _max_model_len(config, ckpt)
    element = torch.tensor([], dtype=config.dtype).element_size()
    # A block costs one cache tensor pair per slot: every layer, or the layers of one KV cache
    # group where windowed layers and full ones keep blocks of their own (kv_layout.py).
    layout = kv_cache_layout(c.layer_windows())
    per_block = 2 * layout.num_slots * config.block_size * c.num_kv_heads * c.head_dim * element
    num_blocks = config.num_kv_blocks or max(2, config.kv_cache_memory_bytes // per_block)
    max_model_len = _fit_kv_cache(config, max_model_len, num_blocks, layout)
    eos = tuple(sorted(set(c.eos_token_ids) | set(ckpt.tokenizer.eos_token_ids)))
    threads = _worker_threads(config) if config.executor == "mp" else None
    spec = RunnerSpec(
        model_config=c,
        dtype=config.dtype,
        num_kv_blocks=num_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        eos_token_ids=eos,
        tokenizer_vocab_size=ckpt.tokenizer.vocab_size,
        num_threads=threads,
        device=config.device,
        quantization=config.quantization,
        gguf_activations=config.gguf_activations,
        batch_invariant=config.batch_invariant,
        tensor_parallel_size=config.tensor_parallel_size,
        adapt_threads=config.adapt_cpu_threads and config.device == "cpu",
        cuda_graphs=config.device.startswith("cuda") and not config.enforce_eager,
        max_drafts=(
            config.speculative_config.num_speculative_tokens if config.speculative_config else 0
        ),
    )
    executor = _executor(config, spec, ckpt, checker, own_weights=checkpoint is None, early=early)
    return ModelSetup(
        str(ckpt.path),
        c.vocab_size,
        ckpt.tokenizer,
        max_model_len,
        num_blocks,
        eos,
        executor,
        threads,
        dict(ckpt.sampling_defaults),
        ckpt.quantized_types(),
        layout.group_windows,
        c.architecture,
        parsers.reasoning,
    )


def _executor(
    config: EngineConfig,
    spec: RunnerSpec,
    ckpt: Checkpoint,
    checker: SyncChecker,
    *,
    own_weights: bool,
    early: WorkerProcess | None,
) -> Executor:
    """The executor that runs ``spec``'s runner over ``ckpt``'s weights: a worker process per
    rank (``early`` as rank 0's) or this process."""
    if config.executor == "mp":
        rank0 = ckpt.weights
        sharded = own_weights and config.tensor_parallel_size > 1
        weights = (
            (lambda rank: rank0 if rank == 0 else _load_shard(config, rank).weights)
            if sharded
            else ckpt.weights
        )
        return MultiprocExecutor.start(spec, weights, checker, ckpt.quantized, prestarted=early)
    governor = ThreadGovernor() if spec.adapt_threads else None
    runner = build_runner(spec, ckpt.weights, quantized=ckpt.quantized)
    # The runner holds these very tensor objects: moving one re-points it everywhere; its old
    # pages go with their last reference. Only weights this engine loaded itself: a caller's
    # checkpoint may back another engine, whose steps a move must not race.
    owned = ckpt.quantized if own_weights else {}
    mover = WeightPageMover([(q.data, _nothing) for q in owned.values()])
    return UniExecutor(runner, checker, governor, mover)


def _nothing() -> None:
    pass


def _load_shard(config: EngineConfig, rank: int) -> Checkpoint:
    """Tensor-parallel rank ``rank``'s shard of ``config.model``, read from the file alone.

    Raises:
        ModelLoadError: the model cannot be read or cut into ``tensor_parallel_size`` shards.
    """
    return load_checkpoint(
        config.model, dtype=config.dtype, shard=ShardSpec(rank, config.tensor_parallel_size)
    )


def _fit_kv_cache(
    config: EngineConfig, max_model_len: int, num_blocks: int, layout: KVCacheLayout
) -> int:
    """``max_model_len``, lowered (with a warning) to what one request can always hold alone
    in ``num_blocks`` blocks (``kv_capacity.lone_request_limit``): past that a lone request
    would wait for blocks forever. Full-attention groups hold every block of the sequence, a
    windowed one its window and a step's tokens; a model whose every layer is windowed keeps
    any length once its window's blocks fit.

    Raises:
        ValueError: the cache cannot hold even a two-token sequence.
    """
    bs = config.block_size
    fits = lone_request_limit(layout.group_windows, num_blocks, bs, StepShape.of(config))
    if fits is None or fits >= max_model_len:
        return max_model_len
    groups = "" if layout.num_groups == 1 else f" over {layout.num_groups} KV cache groups"
    if fits < 2:
        raise ValueError(
            f"the KV cache's {num_blocks} blocks of {bs} tokens{groups} cannot hold a "
            f"sequence: raise kv_cache_memory_bytes (or num_kv_blocks)"
        )
    logger.warning(
        "max_model_len %d lowered to %d: the KV cache (%d blocks of %d tokens%s) holds no "
        "longer sequence; raise kv_cache_memory_bytes for longer ones",
        max_model_len,
        fits,
        num_blocks,
        bs,
        groups,
    )
    return fits


def _max_model_len(config: EngineConfig, checkpoint: Checkpoint) -> int:
    """The engine's longest sequence: ``config.max_model_len`` (at most the model's
    positions), by default the model's ``max_context``, logged where that is below the
    positions.

    Raises:
        ValueError: ``config.max_model_len`` above ``max_context`` where that is less than the
            positions (LongRoPE's original context): past it baton would not compute what the
            model's reference does.
    """
    model = checkpoint.config
    limit = model.max_context
    if limit < model.max_position_embeddings:
        why = (
            f"the model has LongRoPE scaling beyond its original {limit} positions, whose long "
            "factors baton does not apply yet"
        )
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len}: {why}; up to {limit} tokens it computes "
                f"the same, so max_model_len must be at most {limit}"
            )
        if config.max_model_len is None:
            logger.warning(
                "%s: sequences are limited to %d tokens (of its %d positions), where it "
                "computes the same",
                why,
                limit,
                model.max_position_embeddings,
            )
    return min(config.max_model_len or limit, limit)


def _setup_sim(
    config: EngineConfig, checkpoint: Checkpoint | None, checker: SyncChecker
) -> ModelSetup:
    gpu = sim_gpu(config.device)
    assert gpu is not None
    shape = sim_shape(config.sim_shape or DEFAULT_SHAPE)
    tokenizer = checkpoint.tokenizer if checkpoint is not None else load_tokenizer(config.model)
    model = sim_model_config(shape, tokenizer)
    max_model_len = min(
        config.max_model_len or shape.max_position_embeddings, model.max_position_embeddings
    )
    per_block = config.block_size * shape.kv_bytes_per_token
    free = gpu.memory_bytes * _SIM_KV_MEMORY_SHARE - shape.weight_bytes_per_forward
    num_blocks = config.num_kv_blocks or max(2, int(free // per_block))
    traces = TraceBook.load(config.sim_traces) if config.sim_traces else TraceBook()
    eos = tuple(sorted(set(tokenizer.eos_token_ids)))
    runner = None
    if config.sim_runner != "off":
        path = CALIBRATION_PATH if config.sim_runner == "calibrated" else Path(config.sim_runner)
        try:
            calibration = load_calibration(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"EngineConfig.sim_runner: {path}: {exc}") from None
        host_scale = host_speed_seconds() / calibration.host_speed_s
        runner = RunnerModel(calibration, shape.num_layers, host_scale, config.enforce_eager)
    executor = SimExecutor(
        gpu,
        shape,
        traces,
        eos_token_id=tokenizer.eos_token_id,
        vocab_size=model.vocab_size,
        max_num_seqs=config.max_num_seqs,
        checker=checker,
        runner=runner,
        time_scale=float(config.sim_time_scale),
    )
    source = config.model or "the default model"
    path = f"{shape.name} shape on a simulated {gpu.name}, tokenizer of {source}"
    # The model is a shape (no architecture to recognise): the parser named, if any.
    return ModelSetup(
        path,
        model.vocab_size,
        tokenizer,
        max_model_len,
        num_blocks,
        eos,
        executor,
        None,
        {},
        reasoning_parser=config.reasoning_parser,
    )


def _worker_threads(config: EngineConfig) -> int:
    """Torch threads of each model worker (of each rank under tensor parallelism)."""
    if config.worker_threads is not None:
        return config.worker_threads
    cores = num_cpu_cores()
    # The engine thread needs a core of its own to overlap the worker's forward.
    total = cores - 1 if cores > 2 else cores
    # OMP_NUM_THREADS caps torch's threads in the engine process; the worker, which sets its
    # own count, keeps to it too (two threads on a core another process holds barrier-wait:
    # 2-4x slower steps were measured that way).
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        total = min(total, int(omp) * config.tensor_parallel_size)
    return max(1, total // config.tensor_parallel_size)


def engine_threads(config: EngineConfig, worker_threads: int | None) -> int:
    """Threads the engine process may keep busy: the cores the model worker leaves free
    (at least one). Mask fills that spread over the worker's cores slowed its forward 2x."""
    if worker_threads is None:
        return 2
    return max(1, num_cpu_cores() - worker_threads * config.tensor_parallel_size)
