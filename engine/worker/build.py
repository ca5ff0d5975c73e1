"""``RunnerSpec`` and ``build_runner``: a model runner built from a picklable spec and weights,
in whichever process will run it (the engine's, or a worker's)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from baton.engine.kv_layout import kv_cache_layout
from baton.engine.models.causal_lm import causal_lm_class
from baton.engine.models.config import ModelConfig
from baton.engine.models.kv_cache import allocate_kv_cache
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.models.packed import packing_available
from baton.engine.models.parallel import TensorParallel
from baton.engine.worker.cuda_graphs import capture_sizes
from baton.engine.worker.model_runner import ModelRunner
from baton.engine.worker.tp_runner import ParallelModelRunner
from baton.kernels.quant_formats import QuantWeight

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerSpec:
    """Everything needed to build a ``ModelRunner`` except the weights (picklable)."""

    model_config: ModelConfig
    dtype: torch.dtype
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tokenizer_vocab_size: int | None
    num_threads: int | None = None  # torch threads where the runner runs; None: unchanged
    device: str = "cpu"  # where the model, its KV cache and the request rows live
    # Weight quantisation (EngineConfig.quantization): None, "int8" for int8 weight-only
    # linears on every step (CPU), or "gguf" for the GGUF file's quantised linears (CPU; the
    # quantised weights come beside the dense ones, see ``build_runner``).
    quantization: str | None = None
    # quantization="gguf": the numerics of the kernel's activations
    # (EngineConfig.gguf_activations, kernels/quant_linear.py's ACTIVATIONS).
    gguf_activations: str = "float32"
    # Ranks the model is cut over (one worker process each); 1: the whole model in one place.
    tensor_parallel_size: int = 1
    # Drop torch threads while other processes keep the cores busy (CPU; cpu_threads.py).
    adapt_threads: bool = False
    # Capture the decode forward as CUDA graphs at startup (CUDA; worker/cuda_graphs.py).
    cuda_graphs: bool = False
    # A request's tokens the same whatever its batch (EngineConfig.batch_invariant): lone
    # rows padded where a packed GEMM needs it, prefill attended token by token (CPU).
    batch_invariant: bool = True
    # Speculative decoding: draft tokens per request and step at most (the worker process's
    # shared bitmask and token buffers hold 1 + this many rows per request).
    max_drafts: int = 0


def add_cpu_kernels(
    model: LlamaForCausalLM, quantization: str | None, batch_invariant: bool = True
) -> None:
    """What a model gets once its weights are loaded in its final dtype and device: with
    ``quantization="int8"`` every linear as int8 weight-only (``quantize_int8``, for every
    step; dense projection weights released); with "gguf" nothing (the model was built with
    its GGUF-quantised linears, and a linear dequantised at load stays a plain one);
    otherwise, on a CPU, its linears packed for oneDNN where ``packing_available``. Nothing
    else on CUDA. ``batch_invariant`` (``EngineConfig.batch_invariant``): packed lone rows
    padded where needed and prefill attended token by token
    (``LlamaForCausalLM.set_batch_invariant``); False: neither.

    Raises:
        ValueError: an unknown ``quantization``, "int8" for a model the int8 kernel cannot
            run (not on the CPU, or a linear whose in_features is not divisible by 16), "gguf"
            for a model without GGUF-quantised weights or not on the CPU, or a model with them
            and another ``quantization``.
    """
    model.set_batch_invariant(batch_invariant)
    if quantization == "gguf":
        if not model.gguf_quantized:
            raise ValueError(
                "quantization='gguf' needs the checkpoint's quantised weights "
                "(load_checkpoint(..., keep_quantized=True)); the model has none"
            )
        if model.embed_tokens.weight.device.type != "cpu":
            raise ValueError("quantization='gguf' runs on the CPU only")
        return
    if model.gguf_quantized:
        raise ValueError(
            f"the model holds GGUF-quantised weights but quantization is {quantization!r}; "
            "pass quantization='gguf'"
        )
    if quantization == "int8":
        model.quantize_int8()
        return
    if quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}; known: None, 'int8', 'gguf'")
    weight = model.embed_tokens.weight
    if weight.device.type == "cpu" and packing_available(weight.dtype):
        model.pack_weights(batch_invariant)


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Linear and Embedding modules built meanwhile skip their random initialisation (their
    parameters hold whatever memory they got): every parameter is then overwritten by
    ``load_weights``, which names any weight the checkpoint lacks. The initialisation took
    7.9 s of a 16.5 s dense load of the 1B-shape GGUF (AMD EPYC, 2 cores). Not thread-safe:
    the build is the only thing constructing modules in its process."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def build_runner(
    spec: RunnerSpec,
    weights: dict[str, torch.Tensor],
    tp: TensorParallel | None = None,
    quantized: Mapping[str, QuantWeight] | None = None,
) -> ModelRunner:
    """Builds the model from ``weights`` on ``spec.device`` (with int8 weight-only linears
    when ``spec.quantization`` is "int8", else on a CPU its linears packed for oneDNN where
    ``packed.packing_available``: ``add_cpu_kernels``), allocates its KV cache there and
    wraps both in a runner; with ``spec.cuda_graphs`` the runner captures its decode graphs
    before it is returned. With ``tp`` (a joined tensor-parallel group of
    ``spec.tensor_parallel_size`` ranks), ``weights`` are this rank's shard
    (``sharding.shard_weights``) and the runner is a ``ParallelModelRunner``. ``quantized``
    (with ``spec.quantization="gguf"``): the GGUF-quantised linears (``Checkpoint.quantized``),
    which ``weights`` then lacks; the model uses them as they are (no copy).

    Raises:
        ValueError: ``tp`` does not match ``spec.tensor_parallel_size``, a weight is
            missing or misshapen, or the model cannot be quantised as ``spec`` asks.
    """
    if (tp.size if tp is not None else 1) != spec.tensor_parallel_size:
        raise ValueError(
            f"the spec asks for tensor_parallel_size={spec.tensor_parallel_size}, "
            f"but the runner was given {'no group' if tp is None else f'a group of {tp.size}'}"
        )
    with _no_random_init():
        model_class = causal_lm_class(spec.model_config)
        model = model_class(spec.model_config, tp, quantized, spec.gguf_activations).to(
            dtype=spec.dtype
        )
    model.load_weights(weights)
    model.eval()
    device = torch.device(spec.device)
    model.to(device)
    add_cpu_kernels(model, spec.quantization, spec.batch_invariant)
    caches = allocate_kv_cache(
        model.local_config,
        spec.num_kv_blocks,
        spec.block_size,
        spec.dtype,
        device,
        kv_cache_layout(model.local_config.layer_windows()),
    )
    runner_cls = ModelRunner if tp is None else ParallelModelRunner
    # An MoE step reads its experts' token counts on the host (models/moe.py); a sliding
    # window and soft-capped scores are applied by the masked attention path, not the
    # graphs' block-table kernel.
    eager_why = (
        "a mixture-of-experts model"
        if model.config.is_moe
        else "a model with a sliding window"
        if model.config.sliding_window is not None
        else "a model with soft-capped attention scores"
        if model.config.attn_logit_softcapping is not None
        else None
    )
    graphs = spec.cuda_graphs and eager_why is None
    if spec.cuda_graphs and not graphs:
        logger.warning("%s runs its decode steps without CUDA graphs", eager_why)
    runner = runner_cls(
        model,
        caches,
        spec.block_size,
        spec.max_num_seqs,
        spec.max_model_len,
        eos_token_ids=spec.eos_token_ids,
        tokenizer_vocab_size=spec.tokenizer_vocab_size,
        decode_graph_sizes=capture_sizes(spec.max_num_seqs) if graphs else (),
    )
    if graphs:
        runner.capture_cuda_graphs()
    return runner
