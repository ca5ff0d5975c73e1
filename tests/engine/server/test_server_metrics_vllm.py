"""vLLM's metric names on ``/metrics`` (checked with a strict text-format parser: families
declared once, labels escaped, histograms cumulative) against baton's own series, and
``echo`` on ``/v1/completions``."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from serving import DEFAULT_SERVED_MODEL as MODEL

from baton.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from baton.engine.server.metrics import ServerMetrics

PROMPT = "The capital of France is"
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"'
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{((?:{_LABEL},?)*)\}})? (\S+)$")
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("",), "gauge": ("",)}


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


@dataclass
class Family:
    kind: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


def parse(text: str) -> dict[str, Family]:
    """Prometheus text format 0.0.4, strictly: HELP and TYPE once per family and before its
    samples, a family's samples together, valid names, escaped label values, float values."""
    assert text.endswith("\n")
    families: dict[str, Family] = {}
    helped: set[str] = set()
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert re.fullmatch(_NAME, name) and name not in helped, line
            helped.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in _SUFFIXES and name not in families, line
            assert name in helped, f"TYPE before HELP: {line}"
            families[name] = Family(kind)
            current = name
            continue
        match = _SAMPLE.match(line)
        assert match is not None, f"not a sample line: {line!r}"
        sample, labels_text, value = match.group(1), match.group(2) or "", match.group(5)
        assert current is not None
        assert any(sample == current + s for s in _SUFFIXES[families[current].kind]), line
        labels = {k: _unescape(v) for k, v in re.findall(_LABEL, labels_text)}
        families[current].samples.append((sample, labels, float(value)))
    for name, fam in families.items():
        if fam.kind == "histogram":
            check_histogram(name, fam)
    return families


def check_histogram(name: str, fam: Family) -> None:
    """Buckets ascending in ``le`` ending at +Inf, counts monotone, +Inf = _count, a _sum."""
    buckets = [(float(lb["le"]), v) for s, lb, v in fam.samples if s == f"{name}_bucket"]
    bounds = [b for b, _ in buckets]
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds) and bounds[-1] == math.inf
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), (name, counts)
    (count,) = [v for s, _, v in fam.samples if s == f"{name}_count"]
    (_sum,) = [v for s, _, v in fam.samples if s == f"{name}_sum"]
    assert counts[-1] == count


def value(fams: dict[str, Family], sample: str, **labels: str) -> float:
    """The one sample named ``sample`` whose labels include ``labels``."""
    found = [
        v
        for family in fams.values()
        for s, lb, v in family.samples
        if s == sample and labels.items() <= lb.items()
    ]
    assert len(found) == 1, (sample, labels, found)
    return found[0]


def scrape(base: str) -> dict[str, Family]:
    r = httpx.get(f"{base}/metrics", timeout=30)
    assert r.status_code == 200
    return parse(r.text)


def complete(base: str, **body: Any) -> dict[str, Any]:
    payload = {"model": MODEL, "prompt": PROMPT, "temperature": 0, **body}
    r = httpx.post(f"{base}/v1/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}


def test_vllm_series_match_baton_series(default_model_server: str) -> None:
    base = default_model_server
    before = scrape(base)
    by_length = complete(base, max_tokens=3, ignore_eos=True)
    by_stop = complete(base, max_tokens=8, guided_choice=["Paris", "Lyon"])
    assert by_length["choices"][0]["finish_reason"] == "length"
    assert by_stop["choices"][0]["finish_reason"] == "stop"
    assert by_stop["choices"][0]["text"] in ("Paris", "Lyon")
    after = scrape(base)

    for name, kind in VLLM_FAMILIES.items():
        assert after[name].kind == kind, name
        for _, labels, _ in after[name].samples:
            assert labels.get("model_name") == MODEL, (name, labels)

    def delta(sample: str, **labels: str) -> float:
        return value(after, sample, **labels) - value(before, sample, **labels)

    usages = [r["usage"] for r in (by_length, by_stop)]
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    # The same bookkeeping as baton's series: equal totals, not just equal increments.
    for vllm_name, baton_name in (
        ("vllm:prompt_tokens_total", "baton_prompt_tokens_total"),
        ("vllm:generation_tokens_total", "baton_generation_tokens_total"),
        ("vllm:num_requests_running", "baton_num_requests_running"),
        ("vllm:num_requests_waiting", "baton_num_requests_waiting"),
        ("vllm:kv_cache_usage_perc", "baton_kv_cache_usage"),
        ("vllm:gpu_cache_usage_perc", "baton_kv_cache_usage"),
        ("vllm:time_to_first_token_seconds_count", "baton_time_to_first_token_seconds_count"),
        ("vllm:time_to_first_token_seconds_sum", "baton_time_to_first_token_seconds_sum"),
    ):
        assert value(after, vllm_name) == value(after, baton_name), vllm_name
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == completion_tokens
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert value(after, "vllm:request_success_total", finished_reason="abort") >= 0
    successes = sum(v for _, _, v in after["vllm:request_success_total"].samples)
    assert successes == value(after, "baton_generations_total")  # n = 1 everywhere here

    # One observation per request; token histograms sum the usage.
    for hist in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert delta(f"{hist}_count") == 2, hist
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == completion_tokens
    assert delta("vllm:e2e_request_latency_seconds_sum") >= delta(
        "vllm:time_to_first_token_seconds_sum"
    )
    # Inter-token latency counts each request's gaps between tokens.
    gaps = sum(max(0, u["completion_tokens"] - 1) for u in usages)
    assert delta("vllm:inter_token_latency_seconds_count") == gaps
    itl = after["vllm:inter_token_latency_seconds"].samples
    tpot = after["vllm:time_per_output_token_seconds"].samples
    assert [(s.replace("inter_token_latency", "x"), lb, v) for s, lb, v in itl] == [
        (s.replace("time_per_output_token", "x"), lb, v) for s, lb, v in tpot
    ]


def test_model_name_label_is_escaped() -> None:
    name = 'a "quoted"\\model\nname'
    m = ServerMetrics(name, max_model_len=100)
    out = RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        outputs=[CompletionOutput(0, "ab", [5, 6, 7], None, None, "length")],
        finished=True,
        metrics=RequestMetrics(
            arrival_time=0.0,
            first_token_time=0.04,
            last_token_time=0.08,
            finished_time=0.5,
            num_generation_tokens=3,
        ),
    )
    m.observe_request("finished", out, structured=False)
    m.observe_request("aborted", None, structured=False)
    fams = parse(m.render({"kv_usage": 0.25}, healthy=True))
    assert {lb["model_name"] for _, lb, _ in fams["vllm:request_success_total"].samples} == {name}
    assert value(fams, "vllm:request_success_total", finished_reason="length") == 1
    assert value(fams, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(fams, "vllm:gpu_cache_usage_perc") == 0.25
    # vLLM's 1-2-5 token buckets up to max_model_len; its e2e buckets.
    bounds = [lb["le"] for s, lb, _ in fams["vllm:request_prompt_tokens"].samples if "le" in lb]
    assert bounds == ["1", "2", "5", "10", "20", "50", "100", "+Inf"]
    assert value(fams, "vllm:request_prompt_tokens_bucket", le="2") == 0
    assert value(fams, "vllm:request_prompt_tokens_bucket", le="5") == 1
    assert value(fams, "vllm:e2e_request_latency_seconds_bucket", le="0.3") == 0
    assert value(fams, "vllm:e2e_request_latency_seconds_bucket", le="0.5") == 1
    assert value(fams, "vllm:inter_token_latency_seconds_count") == 2
    assert value(fams, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.04)


def test_echo_prepends_the_prompt(default_model_server: str, default_model_engine: Any) -> None:
    base = default_model_server
    plain = complete(base, max_tokens=4)["choices"][0]["text"]
    echoed = complete(base, max_tokens=4, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT + plain
    assert echoed["usage"]["completion_tokens"] == 4
    ids = default_model_engine.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    by_ids = complete(base, max_tokens=4, echo=True, prompt=[ids, ids])
    assert [c["text"] for c in by_ids["choices"]] == [PROMPT + plain] * 2

    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 4, "echo": True}
    with httpx.stream(
        "POST", f"{base}/v1/completions", json=body | {"stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert texts[0].startswith(PROMPT)
    assert "".join(texts) == PROMPT + plain
