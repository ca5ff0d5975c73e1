"""Helpers shared by the engine tests: run a set of requests to the end; compare two loads of a
model; run one JSON-schema request on a model and check its object."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.loader import Checkpoint
from baton.engine.models import decoder_layer as decoder_layer_module
from baton.engine.models import llama as llama_module
from baton.engine.models.quant import Int8Weight
from baton.engine.processing.llm_engine import LLMEngine


def run_to_end(
    engine: LLMEngine,
    requests: list[tuple[str, SamplingParams]],
    abort: dict[str, int] | None = None,
) -> dict[str, tuple]:
    """Adds ``requests`` as r0, r1, ... and steps the engine until none is left; aborts
    ``abort[rid]`` once it has shown that many tokens. Returns each request's
    (token ids, finish reason or "abort", text, error)."""
    abort = dict(abort or {})
    for i, (prompt, sp) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, sp)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            if out.finished:
                final[out.request_id] = (c.token_ids, c.finish_reason, c.text, c.error)
            elif out.request_id in abort and len(c.token_ids) >= abort[out.request_id]:
                engine.abort_request(out.request_id)
                final[out.request_id] = (c.token_ids, "abort", c.text, None)
                del abort[out.request_id]
    return final


def spy_int8_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every ``int8_linear`` call the model makes from now on (in this
    process: an in-process executor's model)."""
    rows: list[int] = []
    real = llama_module.int8_linear

    def spy(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None):
        rows.append(x.shape[0])
        return real(x, weight, bias)

    # the layers' projections (decoder_layer) and the LM head (llama)
    for module in (decoder_layer_module, llama_module):
        monkeypatch.setattr(module, "int8_linear", spy)
    return rows


def assert_equal_weights(a: Checkpoint, b: Checkpoint) -> None:
    """The same weight names, each bit for bit."""
    assert set(a.weights) == set(b.weights)
    for key, value in a.weights.items():
        assert torch.equal(value, b.weights[key]), key


def assert_same_checkpoint(a: Checkpoint, b: Checkpoint) -> None:
    """Equal configs (the norm epsilon to float32, as GGUF keeps it) and equal weights."""
    ours, theirs = dataclasses.asdict(a.config), dataclasses.asdict(b.config)
    assert theirs.pop("rms_norm_eps") == pytest.approx(ours.pop("rms_norm_eps"), rel=1e-6)
    assert ours == theirs
    assert_equal_weights(a, b)


def llama_cpp_convert(folder: Path, out: Path) -> Path:
    """``folder`` as GGUF (float32 tensors) by llama.cpp's converter; its output in the failure."""
    from baton.bench.llama_server.llama_cpp_build import convert_hf

    try:
        return convert_hf(folder, out, "f32")
    except subprocess.CalledProcessError as exc:
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{exc.stderr[-3000:]}") from exc


# Runs llama.cpp's converter (argv[1]) once per job of the JSON list in argv[2] ([folder, out]
# pairs) in this one process: torch, transformers and the converter import once, not per model
# (4-5 s of CPU each). Prints a JSON list of each job's error text, null where it converted.
_CONVERT_MANY = """
import contextlib, io, json, runpy, sys, traceback
script, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, script.rsplit("/", 1)[0])
main = runpy.run_path(script)["main"]
errors = []
for folder, out in jobs:
    sys.argv = [script, folder, "--outfile", out, "--outtype", "f32"]
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            main()
        errors.append(None)
    except BaseException:  # SystemExit too: the converter exits 1 on what it refuses
        errors.append(log.getvalue()[-3000:] + traceback.format_exc()[-3000:])
print(json.dumps(errors))
"""


def llama_cpp_convert_many(jobs: dict[str, tuple[Path, Path]]) -> dict[str, str | None]:
    """Each ``name: (folder, out)`` of ``jobs`` written to ``out`` as GGUF (float32 tensors) by
    llama.cpp's converter, all in one subprocess (as ``llama_cpp_convert`` runs it, its
    ``gguf-py`` first on the path). Returns each name's converter output and traceback where it
    failed, None where it converted."""
    from baton.bench.llama_server.llama_cpp_build import converter

    script = converter()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(script.parent / "gguf-py"), *filter(None, [env.get("PYTHONPATH")])]
    )
    pairs = [[str(folder), str(out)] for folder, out in jobs.values()]
    result = subprocess.run(
        # -P: no working directory on the path, where the repository's kernels/ would shadow
        # the kernels package transformers imports (a script's run puts its own folder there).
        [sys.executable, "-P", "-c", _CONVERT_MANY, str(script), json.dumps(pairs)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"the converter's driver failed:\n{result.stderr[-3000:]}"
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    return dict(zip(jobs, errors, strict=True))


def json_object(model: str, prompt: str, schema: dict[str, Any], max_tokens: int) -> Any:
    """One greedy JSON-schema request on ``model`` (float32): it must stop, and its object
    validate against ``schema``; returns the object."""
    llm = LLM(model, dtype="float32", max_model_len=256, max_num_seqs=4)
    try:
        spec = StructuredOutputsParams(json=schema)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=spec)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    finally:
        llm.shutdown()
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", completion
    value = json.loads(completion.text)
    jsonschema.validate(value, schema)
    return value


def prefill_logits(model: Any, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> Any:
    """The logits of every position of ``ids`` prefilled at once into fresh blocks of 4 (from
    block 3 on), under the model's sliding window."""
    from baton.engine.models.attention import AttentionMetadata
    from baton.engine.models.kv_cache import allocate_kv_cache

    n, block = ids.numel(), 4
    kv = allocate_kv_cache(model.config, 32, block, dtype)
    meta = AttentionMetadata.build(
        torch.tensor([n]),
        torch.tensor([n]),
        torch.tensor([list(range(3, 3 + -(-n // block)))]),
        block,
        sliding_window=model.config.sliding_window,
    )
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), kv, meta))


def random_prompt(vocab: int, n: int = 40) -> torch.Tensor:
    """``n`` token ids below ``vocab``, the same every run."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))
