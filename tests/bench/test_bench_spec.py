"""``baton bench spec``'s runs on the simulated device: traces from outputs, and every mode
replaying them (drafts verified against the traces, outputs checked against them)."""

from __future__ import annotations

import json

import pytest

from baton.bench.offline.spec import _params
from baton.bench.sim.spec_sim import ASYNC, SimRun, measure_sim, trace_of

pytestmark = pytest.mark.slow

INSTANCES = [
    {
        "name": f"Person {i}",
        "age": 20 + i,
        "email": f"p{i}@example.com",
        "city": "Lisbon",
        "employer": "Acme Robotics",
        "skills": ["Python", "SQL"][: 1 + i % 2],
    }
    for i in range(4)
]


def test_a_trace_drops_only_a_closing_eos():
    assert trace_of([5, 6, 2], "stop", {2}) == (5, 6)
    assert trace_of([5, 6, 2], "length", {2}) == (5, 6, 2)
    assert trace_of([5, 6], "stop", {2}) == (5, 6)  # ended by its grammar: no EOS


def test_every_mode_replays_the_traces_on_the_simulator(tiny_model_dir, tokenizer):
    prompts = tuple(tuple(tokenizer.encode(f"Extract person {i}:")) for i in range(4))
    outputs = tuple(
        tuple(tokenizer.encode(json.dumps(x, separators=(",", ":")), add_special_tokens=False))
        for x in INSTANCES
    )
    params = _params("extraction", 96)
    runs = [
        SimRun("extraction", 1, prompts[:2], outputs[:2], params),
        SimRun("extraction", 4, prompts, outputs, params),
    ]
    result = measure_sim(
        str(tiny_model_dir), "sim:h200", "llama-3.1-8b", runs, ("off", "grammar"), 3, 256
    )
    rows = {(r["mode"], r["concurrency"]): r for r in result["rows"]}
    modes = ("off", "grammar")
    assert set(rows) == {(m + a, c) for m in modes for a in ("", ASYNC) for c in (1, 4)}
    for r in rows.values():  # each trace and the EOS its end is
        assert r["output_tokens"] == sum(len(o) + 1 for o in outputs[: r["prompts"]])
    assert rows[("off", 4)]["tokens_per_step"] <= 4.0
    # The keys and punctuation the schema forces are drafted and kept.
    for c in (1, 4):
        for a in ("", ASYNC):
            assert rows[("grammar" + a, c)]["steps"] < rows[("off" + a, c)]["steps"]
            assert rows[("grammar" + a, c)]["acceptance_rate"] > 0.5


def test_a_row_is_the_median_of_its_runs():
    from baton.bench.offline.spec import _median_row

    runs = [
        {"tok_per_s": v, "steps": 10, "load_avg_1m": [0.1 * i, 0.1 * i + 0.05], "tokens": [[1]]}
        for i, v in enumerate((30.0, 10.0, 20.0))
    ]
    row = _median_row("auto", runs)
    assert row["mode"] == "auto" and row["tok_per_s"] == 20.0 and row["steps"] == 10
    assert row["tok_per_s_runs"] == [30.0, 10.0, 20.0]
    assert row["load_avg_1m"] == [0.0, 0.25]
    assert _median_row("off", runs[:2])["tok_per_s"] == 20.0


def test_modes_name_the_engine_config_they_run():
    from baton.bench.offline.spec import MODES, SpecBenchConfig
    from baton.bench.sim.spec_sim import spec_config

    assert spec_config("off", 5) is None
    assert spec_config("auto", 5) == {
        "method": "auto",
        "num_speculative_tokens": 5,
        "adaptive": True,
    }
    assert spec_config("ngram-fixed", 3) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "adaptive": False,
    }
    assert {"auto-fixed", "grammar-fixed", "ngram-fixed"} <= set(MODES)
    cfg = SpecBenchConfig(modes=("off", "auto-fixed", "auto"), quantization="gguf")
    assert cfg.quantization == "gguf"
    with pytest.raises(ValueError, match="modes"):
        SpecBenchConfig(modes=("off", "auto-adaptive"))
