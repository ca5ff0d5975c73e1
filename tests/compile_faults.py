"""Grammar backends with planted faults, for the fault tests.

Compile workers build backends by import path, so these live in a module of their own
(importable by the workers through the test run's ``sys.path``), and
``use_faulty_backends`` puts them behind an engine in place of the real ones.
"""

from __future__ import annotations

import os
import time

from baton.engine.processing.llm_engine import LLMEngine
from baton.grammar.backend import BackendRecipe
from baton.grammar.compile.service import CompileService
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.xgrammar.backend import XGrammarBackend, XGrammarCompiledGrammar


class PlantedPanic(BaseException):
    """Like pyo3's PanicException: a BaseException, not an Exception."""


class FaultyXGrammarBackend(XGrammarBackend):
    """xgrammar, except for regex specs that start with a marker:

    "sleep": the compile waits (using no CPU) until its worker is killed;
    "panic": the compile raises ``PlantedPanic``;
    "crash": the compile ends its process.
    """

    def compile(self, spec: StructuredOutputsParams) -> XGrammarCompiledGrammar:
        regex = str(spec.regex) if spec.kind == "regex" else ""
        if regex.startswith("sleep"):
            time.sleep(3600)
        if regex.startswith("panic"):
            raise PlantedPanic("planted panic")
        if regex.startswith("crash"):
            os._exit(3)
        return super().compile(spec)


def use_faulty_backends(engine: LLMEngine) -> CompileService:
    """Replaces ``engine``'s compile service by one whose xgrammar is
    ``FaultyXGrammarBackend`` (same limit and pool), its worker template process started
    (seconds on a busy host: no test's timing or step count should include that); returns
    the new service. The caller shuts it down (the engine's shutdown does, too).

    Raises:
        AssertionError: the warm-up compile failed or took over 120 s.
    """
    old = engine.structured.service
    recipes = {
        "xgrammar": BackendRecipe(
            "xgrammar",
            f"{__name__}:FaultyXGrammarBackend",
            worker_options=(("max_threads", 1),),
        ),
        "outlines": BackendRecipe("outlines", "baton.grammar.outlines.backend:OutlinesBackend"),
    }
    service = CompileService(
        recipes, engine.tokenizer, engine.vocab_size, old.timeout_s, pool=old.pool
    )
    old.shutdown()
    engine.structured.service = service
    handle = service.submit(StructuredOutputsParams(regex="faulty-warm-up[0-9]"))
    deadline = time.monotonic() + 120.0
    while (result := handle.result()) is None:
        assert time.monotonic() < deadline, "the compile workers did not start within 120 s"
        time.sleep(0.01)
    assert result.error is None, result.error
    return service
