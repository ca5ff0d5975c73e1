"""The engines ``baton bench peers`` compares, each behind one small ``Runner`` interface: baton's
offline ``LLM``, transformers with xgrammar's logits processor, Outlines, and llama-cpp-python
(optional), all over the same checkpoint and the same token ids.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from baton.bench.offline.forward import build_transformers
from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.config import num_cpu_cores
from baton.engine.loader import Checkpoint
from baton.engine.tokenizer import Tokenizer

# Prompts and tokens each engine is warmed up with, outside the measurements.
WARMUP_PROMPTS = 2
WARMUP_TOKENS = 8

ENGINES: dict[str, str] = {
    "baton": "baton",
    "transformers": "transformers+xgrammar",
    "outlines": "outlines",
    "llama-cpp": "llama-cpp-python",
}
# llama-cpp-python computes on the GGUF's own quantized weights, whatever --dtypes says.
GGUF_DTYPE = "gguf"


def hf_tokenizer(tokenizer: Tokenizer) -> Any:
    """A transformers fast tokenizer over the same ``tokenizers`` object as baton's (no chat
    template: the peers get the prompts already rendered)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(tokenizer.backend), **tokenizer.special_tokens_map()
    )


@dataclass(frozen=True)
class Workload:
    """The prompts every engine gets: chat text and the same text as token ids."""

    texts: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    warmup_texts: tuple[str, ...]
    warmup_ids: tuple[tuple[int, ...], ...]
    schema: dict[str, Any]
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    @property
    def max_model_len(self) -> int:
        longest = max(len(p) for p in (*self.prompt_ids, *self.warmup_ids))
        return longest + self.max_tokens + 1


def check_same_ids(hf_tok: Any, workload: Workload) -> None:
    """The peers that take text must see the token ids baton gets; raises ``ValueError``
    naming the first prompt that the transformers tokenizer encodes differently."""
    for text, ids in zip(
        (*workload.texts, *workload.warmup_texts),
        (*workload.prompt_ids, *workload.warmup_ids),
        strict=True,
    ):
        if tuple(hf_tok(text)["input_ids"]) != ids:
            raise ValueError(f"transformers' tokenizer encodes prompt {text!r} differently")


def build_hf_model(ckpt: Checkpoint, dtype: str = "float32") -> Any:
    """transformers' Llama over the checkpoint's weights (eval mode), cast to ``dtype`` once
    they are checked. Raises ``ValueError`` when a weight does not land in the model (names or
    shapes differ)."""
    weights = {k: v.float() for k, v in ckpt.weights.items()}
    model = build_transformers(ckpt.config, weights).float()
    state = model.state_dict()
    tied = {"lm_head.weight"} if ckpt.config.tie_word_embeddings else set()
    missing = sorted(set(state) - set(weights) - tied)
    unknown = sorted(set(weights) - set(state))
    if missing or unknown:
        raise ValueError(
            f"checkpoint and transformers' Llama disagree: missing {missing[:3]}, "
            f"unknown {unknown[:3]}"
        )
    if any(not torch.equal(state[k], w) for k, w in weights.items()):
        raise ValueError("transformers' Llama did not take the checkpoint's weights as they are")
    return model.to(getattr(torch, dtype))


@dataclass(frozen=True)
class Completion:
    """One request's output: its text, how many tokens it generated (EOS included) and its
    mean time per output token after the first (None with fewer than two tokens)."""

    text: str
    tokens: int
    tpot_s: float | None


class Runner(Protocol):
    """One engine set up for the workload."""

    label: str

    def run(self, prompts: range) -> list[Completion]:
        """Generates for the workload's prompts ``prompts``, all submitted at once."""
        ...

    def close(self) -> None: ...


class StepRecorder:
    """A transformers streamer that keeps each decoding step's time and tokens (the first
    ``put`` is the prompt). Duck-typed: ``generate`` only calls ``put`` and ``end``."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[list[int]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def sequences_from_steps(
    recorder: StepRecorder, batch: int, eos_token_ids: Sequence[int]
) -> list[tuple[list[int], float | None]]:
    """Each row's generated ids up to its first EOS (included) and its TPOT in seconds, from
    the steps of one batched ``generate``."""
    eos = set(eos_token_ids)
    out = []
    for row in range(batch):
        ids: list[int] = []
        for step in recorder.tokens:
            ids.append(step[row])
            if step[row] in eos:
                break
        n = len(ids)
        tpot = (recorder.times[n - 1] - recorder.times[0]) / (n - 1) if n > 1 else None
        out.append((ids, tpot))
    return out


# ------------------------------------------------------------------ engines
def baton_label(dtype: str) -> str:
    return f"baton {dtype}"


class BatonRunner:
    """baton's offline ``LLM`` over the checkpoint, in ``dtype``."""

    def __init__(self, ckpt: Checkpoint, dtype: str, workload: Workload, max_batch: int) -> None:
        self.workload = workload
        self.llm = LLM.from_checkpoint(
            ckpt,
            dtype=getattr(torch, dtype),
            max_num_seqs=max(max_batch, WARMUP_PROMPTS),
            max_model_len=workload.max_model_len,
            # Like for like: no peer reuses a prefix across requests in this benchmark.
            enable_prefix_caching=False,
        )
        self.label = baton_label(dtype)
        self.params = SamplingParams(
            max_tokens=workload.max_tokens,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(json=workload.schema),
        )
        warm = SamplingParams(
            max_tokens=WARMUP_TOKENS,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(json=workload.schema),
        )
        self.llm.generate([list(p) for p in workload.warmup_ids], warm, use_tqdm=False)

    def run(self, prompts: range) -> list[Completion]:
        ids = [list(self.workload.prompt_ids[i]) for i in prompts]
        outs = self.llm.generate(ids, self.params, use_tqdm=False)
        return [
            Completion(
                o.outputs[0].text, len(o.outputs[0].token_ids), o.metrics.time_per_output_token
            )
            for o in outs
        ]

    def close(self) -> None:
        self.llm.shutdown()


class TransformersXgrammarRunner:
    """transformers batched ``generate`` (left padding, greedy) with xgrammar's logits
    processor, the grammar compiled once the way xgrammar's docs show it."""

    def __init__(self, model: Any, hf_tok: Any, workload: Workload, dtype: str) -> None:
        import xgrammar as xgr

        self.label = f"transformers+xgrammar {dtype}"
        self.model, self.hf_tok, self.workload = model, hf_tok, workload
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tok,
            vocab_size=model.config.vocab_size,
            stop_token_ids=list(workload.eos_token_ids),
        )
        # Compact JSON, as baton's default (no free whitespace between tokens).
        self.grammar = xgr.GrammarCompiler(info).compile_json_schema(
            json.dumps(workload.schema),
            strict_mode=True,
            any_whitespace=False,
            separators=(",", ":"),
        )
        self._generate([list(p) for p in workload.warmup_ids], WARMUP_TOKENS)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
        from xgrammar.contrib.hf import LogitsProcessor

        pad = self.workload.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        recorder = StepRecorder()
        self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=list(self.workload.eos_token_ids),
            # One processor per call: it keeps grammar state across the steps of one call.
            logits_processor=[LogitsProcessor(self.grammar)],
            streamer=recorder,
        )
        return [
            Completion(self.hf_tok.decode(seq, skip_special_tokens=True), len(seq), tpot)
            for seq, tpot in sequences_from_steps(
                recorder, len(prompts), self.workload.eos_token_ids
            )
        ]

    def run(self, prompts: range) -> list[Completion]:
        return self._generate(
            [list(self.workload.prompt_ids[i]) for i in prompts], self.workload.max_tokens
        )

    def close(self) -> None:
        pass


class OutlinesRunner:
    """Outlines' ``Generator`` over the transformers model with a JSON-schema output type
    (its default backend, outlines-core), batched with ``Generator.batch``."""

    def __init__(self, model: Any, hf_tok: Any, workload: Workload, dtype: str) -> None:
        import outlines
        from outlines.types import JsonSchema

        self.label = f"outlines {dtype}"
        self.workload = workload
        self.model = outlines.from_transformers(model, hf_tok)
        # Compact JSON, as baton's default: no whitespace between JSON tokens.
        output_type = JsonSchema(json.dumps(workload.schema), whitespace_pattern="")
        self.generator = outlines.Generator(self.model, output_type)
        self._generate(list(workload.warmup_texts), WARMUP_TOKENS)

    def _generate(self, texts: list[str], max_tokens: int) -> list[Completion]:
        recorder = StepRecorder()
        outs = self.generator.batch(
            texts,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=self.workload.pad_token_id,
            eos_token_id=list(self.workload.eos_token_ids),
            streamer=recorder,
        )
        steps = sequences_from_steps(recorder, len(texts), self.workload.eos_token_ids)
        return [
            Completion(text, len(seq), tpot) for text, (seq, tpot) in zip(outs, steps, strict=True)
        ]

    def run(self, prompts: range) -> list[Completion]:
        with torch.inference_mode():
            return self._generate(
                [self.workload.texts[i] for i in prompts], self.workload.max_tokens
            )

    def close(self) -> None:
        pass


class LlamaCppRunner:
    """llama-cpp-python on the GGUF file with a grammar from the JSON schema; greedy
    (``temp=0``), prompts decoded one after another (no batched API), state reset before each
    prompt so no prefix is reused."""

    label = "llama-cpp-python"

    def __init__(self, gguf_path: Path, workload: Workload) -> None:
        from llama_cpp import Llama, LlamaGrammar

        self.workload = workload
        threads = num_cpu_cores()
        self.llm = Llama(
            model_path=str(gguf_path),
            n_ctx=workload.max_model_len,
            n_threads=threads,
            n_threads_batch=threads,
            seed=0,
            verbose=False,
        )
        self.grammar = LlamaGrammar.from_json_schema(json.dumps(workload.schema), verbose=False)
        self.eos = set(workload.eos_token_ids) | {self.llm.token_eos()}
        for p in workload.warmup_ids:
            self._one(p, WARMUP_TOKENS)

    def _one(self, prompt: Sequence[int], max_tokens: int) -> Completion:
        self.llm.reset()
        ids: list[int] = []
        times: list[float] = []
        for token in self.llm.generate(list(prompt), temp=0.0, grammar=self.grammar):
            times.append(time.perf_counter())
            ids.append(token)
            if token in self.eos or len(ids) >= max_tokens:
                break
        body = [t for t in ids if t not in self.eos]
        text = self.llm.detokenize(body).decode("utf-8", errors="replace")
        tpot = (times[-1] - times[0]) / (len(ids) - 1) if len(ids) > 1 else None
        return Completion(text, len(ids), tpot)

    def run(self, prompts: range) -> list[Completion]:
        return [self._one(self.workload.prompt_ids[i], self.workload.max_tokens) for i in prompts]

    def close(self) -> None:
        self.llm.close()


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def unavailable(module: str) -> str | None:
    """Why ``module`` cannot be used here, or None when it imports."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"`import {module}` failed ({exc}); install it to include this peer"
    return None
