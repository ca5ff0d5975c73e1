"""Traces for the simulated accelerator (``device="sim:<gpu>"``): the real token sequences its
device replays, one per prompt.

- Free traces: greedy outputs of the default model on chat prompts, recorded once per workload
  and cached (recording runs the real model on this CPU).
- JSON traces: valid instances of the shared schemas (maskbench format), serialised compactly
  and tokenised; a (schema, instance) pair is kept only when the engine serves the schema and
  its grammar accepts the instance's tokens and then the end of sequence, each token also
  allowed by the mask row filled before it (xgrammar 0.2.9's masks forbid some tokens its
  matcher accepts, e.g. ``}}`` closing two nested objects in jsone.json: the mask is the
  stricter, and what the device samples from), so the simulator's mask check can only fail
  on a wrong mask, never on a bad trace.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.engine.core.structured_outputs import StructuredOutputManager
from baton.engine.executor.sim_traces import Trace, TraceBook
from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import allocate_bitmask
from baton.grammar.spec import StructuredOutputsParams

CACHE_DIR = Path.home() / ".cache" / "baton" / "sim-traces"
TOPICS = (
    "a lighthouse keeper",
    "a lost robot",
    "the first city on Mars",
    "a jazz trumpeter",
    "a chess tournament",
    "an old bakery",
    "a mountain rescue",
    "a library at night",
)
_COMPILE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class JsonCase:
    """A JSON-schema request with its trace: the schema, and a valid instance's tokens."""

    name: str  # the schema file
    schema: dict[str, Any]
    output: tuple[int, ...]


def chat_prompt(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """``text`` as one user turn under the model's chat template, as token ids."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    return tuple(ids)


def free_prompts(tokenizer: Tokenizer, n: int) -> list[tuple[int, ...]]:
    """``n`` distinct story prompts (the index makes each unique)."""
    return [
        chat_prompt(tokenizer, f"Tell a long story about {TOPICS[i % len(TOPICS)]} (story #{i}).")
        for i in range(n)
    ]


def json_prompt(tokenizer: Tokenizer, name: str, index: int) -> tuple[int, ...]:
    """A distinct prompt for the ``index``-th JSON request (schema file ``name``)."""
    return chat_prompt(tokenizer, f"Return a JSON document for {name} (request #{index}).")


def record_free_traces(
    prompts: Sequence[tuple[int, ...]],
    output_len: int,
    model: str | None = None,
    dtype: str = "bfloat16",
    cache_dir: Path = CACHE_DIR,
) -> list[Trace]:
    """Greedy outputs of ``model`` (default model) for ``prompts``, ``output_len`` tokens each
    (EOS ignored, so every trace has that length). Cached in ``cache_dir`` by workload: a
    second call with the same prompts, length, model and dtype reads the file."""
    key = hashlib.sha256(
        json.dumps([list(map(list, prompts)), output_len, model, dtype]).encode()
    ).hexdigest()[:16]
    path = cache_dir / f"free-{key}.jsonl"
    if path.is_file():
        return TraceBook.load(path).traces()
    from baton.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, async_scheduling=False, max_num_seqs=64)
    try:
        sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        outs = llm.generate([list(p) for p in prompts], sp, use_tqdm=False)
    finally:
        llm.shutdown()
    traces = [Trace(p, tuple(o.outputs[0].token_ids)) for p, o in zip(prompts, outs, strict=True)]
    cache_dir.mkdir(parents=True, exist_ok=True)
    TraceBook(traces).save(path)
    print(f"recorded {len(traces)} free traces in {time.perf_counter() - t0:.0f} s -> {path}")
    return traces


def _instances(data_dir: Path) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """(schema file, schema, valid instance) from the maskbench files, in file order."""
    for path in sorted((data_dir / "schemastore").glob("*.json")):
        doc = json.loads(path.read_text())
        for test in doc["tests"]:
            if test["valid"]:
                yield path.name, doc["schema"], test["data"]


def json_cases(
    tokenizer: Tokenizer,
    data_dir: Path,
    max_schemas: int,
    min_tokens: int,
    max_tokens: int,
) -> list[JsonCase]:
    """Up to ``max_schemas`` (schema, instance) pairs whose compact instance is an object of
    ``min_tokens``..``max_tokens`` tokens, served by the engine (xgrammar or outlines, as
    ``auto`` picks) and accepted by the grammar token by token, then ended by EOS. One
    instance per schema."""
    manager = StructuredOutputManager(
        tokenizer, tokenizer.vocab_size, 1, compile_timeout_s=_COMPILE_TIMEOUT_S
    )
    eos = tokenizer.eos_token_id
    cases: list[JsonCase] = []
    seen: set[str] = set()
    try:
        for name, schema, instance in _instances(data_dir):
            if len(cases) >= max_schemas:
                break
            if name in seen or not isinstance(instance, dict):
                continue
            text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
            tokens = tokenizer.encode(text, add_special_tokens=False)
            if not min_tokens <= len(tokens) <= max_tokens:
                continue
            if _accepted(manager, schema, tokens, eos):
                seen.add(name)
                cases.append(JsonCase(name, schema, tuple(tokens)))
    finally:
        manager.shutdown()
    return cases


def _accepted(
    manager: StructuredOutputManager, schema: dict[str, Any], tokens: list[int], eos: int
) -> bool:
    spec = StructuredOutputsParams(json=schema)
    try:
        manager.validate(spec)
    except ValueError:
        return False
    state = manager.start(spec)
    while (result := manager.poll(state)) is None:
        time.sleep(0.01)
    matcher = state.matcher
    if matcher is None or result.error:
        return False
    row = allocate_bitmask(1, manager.vocab_size)
    for token in [*tokens, eos]:
        matcher.fill_bitmask(row, 0)
        if not (int(row[0, token // 32]) >> (token % 32)) & 1 or not matcher.accept_tokens([token]):
            return False
    return matcher.is_terminated()
