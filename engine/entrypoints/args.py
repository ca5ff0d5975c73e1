"""Engine arguments: the one place where user-facing options (Python keywords or
command-line flags) become a validated ``EngineConfig``.

``LLM``, ``AsyncLLM.from_engine_args``, ``baton generate`` and ``baton serve`` all build
their config here, so a new engine option is added once.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from baton.engine.config import (
    DTYPE_AUTO,
    GGUF_ACTIVATIONS,
    QUANTIZATIONS,
    REASONING_PARSERS,
    EngineConfig,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = (DTYPE_AUTO, *DTYPES)
# ``--quantization`` choices: "none" is the weights as loaded (``quantization=None``).
QUANTIZATION_CHOICES = ("none", *QUANTIZATIONS)
# Engine arguments that were removed, and what to pass instead: refused with that advice
# rather than ignored, so that a user's old setting cannot silently stop applying.
REMOVED_ENGINE_ARGS = {
    "int8_small_batches": (
        "int8 weights are no longer switched on by batch size; pass quantization='int8' for "
        "int8 weight-only linears on every step, or leave quantization unset (None) for the "
        "weights as loaded"
    ),
}


def engine_config(
    model: str | None = None, *, dtype: str | torch.dtype = DTYPE_AUTO, **engine_args: Any
) -> EngineConfig:
    """The ``EngineConfig`` for a model, a dtype (``"auto"``, a name or a torch dtype) and any
    other ``EngineConfig`` fields given as keywords. ``"auto"`` picks bfloat16 where the device
    computes in it natively, float32 elsewhere (``config.auto_dtype``; logged at INFO).

    Raises:
        ValueError: an unknown dtype name, an unknown or removed engine argument (a removed
            one names its replacement, ``REMOVED_ENGINE_ARGS``), or a value ``EngineConfig``
            refuses.
    """
    if isinstance(dtype, str) and dtype != DTYPE_AUTO:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    removed = sorted(set(engine_args) & set(REMOVED_ENGINE_ARGS))
    if removed:
        raise ValueError(
            "; ".join(
                f"engine argument {n!r} was removed: {REMOVED_ENGINE_ARGS[n]}" for n in removed
            )
        )
    fields = {n for n, f in EngineConfig.__dataclass_fields__.items() if f.init}
    unknown = set(engine_args) - fields - {"model", "dtype"}
    if unknown:
        raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
    return EngineConfig(model=model, dtype=dtype, **engine_args)


def add_engine_args(parser: argparse.ArgumentParser, *, max_model_len: int | None = None) -> None:
    """Adds the engine's command-line options to ``parser``; ``config_from_args`` reads them.

    ``max_model_len`` is the default of ``--max-model-len`` (None: the model's own limit).
    """
    _add_model_args(parser, max_model_len)
    _add_grammar_args(parser)
    _add_decoding_args(parser)


def _add_model_args(parser: argparse.ArgumentParser, max_model_len: int | None) -> None:
    """What is loaded, in which dtype, where, and how many sequences and tokens it holds."""
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M)"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=DTYPE_AUTO,
        help="auto (default): bfloat16 where the CPU has AMX or AVX512-BF16 (or on CUDA), "
        "float32 elsewhere; float32 matches transformers",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default="none",
        help="none (default): the weights as loaded, on every step; int8: every linear as "
        "int8 weight-only GEMMs on every step (CPU; faster batch-1 decode, slower large steps); "
        "gguf: a GGUF file's block-quantised linears kept quantised (CPU, one rank)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="most requests running at once"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=max_model_len, help="longest prompt + output"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="cut the model over N worker processes (one shard of every layer each; CPU, gloo)",
    )


def _add_grammar_args(parser: argparse.ArgumentParser) -> None:
    """The grammar compile service's limits."""
    parser.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=None,
        help="seconds of running time one grammar compile may take (default: 10)",
    )
    parser.add_argument(
        "--grammar-compile-workers",
        type=int,
        default=None,
        help="grammar compiles that run at once, each in a worker process (default: 2)",
    )
    parser.add_argument(
        "--grammar-compile-queue-size",
        type=int,
        default=None,
        help="new grammars that may wait for a compile worker; beyond it 503 (default: 64)",
    )
    parser.add_argument(
        "--grammar-cache-mb",
        type=int,
        default=None,
        help="size budget of the compiled-grammar cache in MiB (default: 1024)",
    )


def _add_decoding_args(parser: argparse.ArgumentParser) -> None:
    """Drafts, reasoning, CPU threads, batch invariance, CUDA graphs and scheduling."""
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "auto", "num_speculative_tokens": '
        "4}' (method: grammar, ngram or auto); implies synchronous scheduling",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="the model thinks in <think> ... </think> (vLLM's parser names): structured "
        "output holds after the thoughts, and the server returns them as reasoning_content; "
        "default: openai_gptoss (harmony) for gpt-oss, else none",
    )
    parser.add_argument(
        "--no-structured-drafts",
        action="store_true",
        help="serve structured requests without speculative decoding where the engine would "
        "use it by default (synchronous scheduling in its own process)",
    )
    parser.add_argument(
        "--gguf-activations",
        choices=GGUF_ACTIVATIONS,
        default=None,
        help="with --quantization gguf: int8 rows of x for the Q4_K/Q6_K weights as llama.cpp "
        "does (default, faster) or float32 (the weights' exact gguf values)",
    )
    parser.add_argument(
        "--no-adapt-cpu-threads",
        action="store_true",
        help="keep torch's thread count fixed on a CPU instead of dropping threads while "
        "other processes keep the cores busy",
    )
    parser.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="on a CPU, let a request's tokens depend on its batch for faster long prompts "
        "(padded attention for prefill; lone rows not padded); see EngineConfig.batch_invariant",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step op by op instead of replaying the decode CUDA graphs "
        "captured at startup",
    )
    scheduling = parser.add_mutually_exclusive_group()
    scheduling.add_argument(
        "--async-scheduling",
        action="store_true",
        help="plan the next step while the model runs even where the engine would not by "
        "default (a CPU with fewer than 3 cores); an option it cannot run with is an error",
    )
    scheduling.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="run each step to completion instead of planning the next one while the model runs",
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of options added by ``add_engine_args``; unset options keep
    the engine's defaults (async scheduling: decided by the engine unless turned on or off).

    Raises:
        ValueError: a value ``EngineConfig`` refuses.
    """
    engine_args: dict[str, Any] = {"device": args.device}
    quantization = getattr(args, "quantization", "none")
    if quantization != "none":
        engine_args["quantization"] = quantization
    if args.max_num_seqs is not None:
        engine_args["max_num_seqs"] = args.max_num_seqs
    if args.max_model_len is not None:
        engine_args["max_model_len"] = args.max_model_len
    if args.tensor_parallel_size is not None:
        engine_args["tensor_parallel_size"] = args.tensor_parallel_size
    if getattr(args, "gguf_activations", None) is not None:
        engine_args["gguf_activations"] = args.gguf_activations
    if getattr(args, "no_adapt_cpu_threads", False):
        engine_args["adapt_cpu_threads"] = False
    if getattr(args, "no_batch_invariant", False):
        engine_args["batch_invariant"] = False
    if getattr(args, "enforce_eager", False):
        engine_args["enforce_eager"] = True
    if args.no_async_scheduling:
        engine_args["async_scheduling"] = False
    if getattr(args, "async_scheduling", False):
        engine_args["async_scheduling"] = True
    if getattr(args, "no_structured_drafts", False):
        engine_args["structured_drafts"] = False
    if getattr(args, "speculative_config", None) is not None:
        engine_args["speculative_config"] = args.speculative_config
    if getattr(args, "reasoning_parser", None) is not None:
        engine_args["reasoning_parser"] = args.reasoning_parser
    for flag, field in (
        ("grammar_compile_timeout", "grammar_compile_timeout_s"),
        ("grammar_compile_workers", "grammar_compile_workers"),
        ("grammar_compile_queue_size", "grammar_compile_queue_size"),
    ):
        if getattr(args, flag) is not None:
            engine_args[field] = getattr(args, flag)
    if args.grammar_cache_mb is not None:
        engine_args["grammar_cache_bytes"] = args.grammar_cache_mb * (1 << 20)
    return engine_config(args.model, dtype=args.dtype, **engine_args)
