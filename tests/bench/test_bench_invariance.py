"""The same-answer probe's bookkeeping: matching token lists and reading engine variants."""

from __future__ import annotations

from baton.bench.offline import invariance


def test_compare_counts_identical_requests_and_finds_the_first_difference():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8], [9]]
    other = [[1, 2, 3], [4, 0, 6], [7, 8, 9], [9]]
    got = invariance.compare(ref, other)
    assert got == {"identical": 2, "of": 4, "first_diff": [None, 1, 2, None]}


def test_variants_parse_json_values_and_keep_text():
    assert invariance._variant("quantization=int8,worker_threads=1,flag=true") == {
        "quantization": "int8",
        "worker_threads": 1,
        "flag": True,
    }
    assert invariance._variant("") == {}


def test_strangers_sit_between_the_probe_prompts_and_differ_in_length():
    assert len(invariance.STRANGERS) == len(invariance.TOPICS)
    assert len({len(s) for s in invariance.STRANGERS}) > 1
    sps = invariance.params(8, sampled=True)
    assert len({sp.seed for sp in sps}) == len(sps) and all(sp.temperature > 0 for sp in sps)
