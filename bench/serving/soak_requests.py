"""The requests of ``baton bench soak``: the planned mix (free text, JSON schema, regex,
choice, invalid constraints, clients that hang up mid-stream), sending one, and judging what
came back against its constraint.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema

VALID_KINDS = ("text", "json", "regex", "choice")
KINDS = (*VALID_KINDS, "invalid", "disconnect")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Disconnecting clients ask for this many times --max-tokens, so that they really hang up
# mid-stream rather than after the end.
DISCONNECT_TOKEN_FACTOR = 8

# Constraints that the server must refuse with a 400 (one per kind of mistake).
INVALID_SPECS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        CHAT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "bad",
                    "schema": {"type": "object", "properties": {"age": {"type": "nonsense"}}},
                },
            }
        },
    ),
    (COMPLETIONS, {"structured_outputs": {"json": {"type": "integer", "minimum": "zero"}}}),
    (COMPLETIONS, {"structured_outputs": {"regex": "([a-z"}}),
    (CHAT, {"structured_outputs": {"choice": []}}),
    (
        CHAT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "object", "required": "name"}},
            }
        },
    ),
)


@dataclass(frozen=True)
class SoakConfig:
    """One soak run.

    Attributes:
        requests: requests to send (the run also stops sending at ``time_limit_s``).
        concurrency: requests in flight at once.
        max_tokens: max_tokens of each valid request.
        time_limit_s: no request is sent after this many seconds of load.
        model: GGUF file or HF folder to serve (None: the default model).
        tiny: serve a tiny random-weight model written to a temporary folder instead.
        invalid_fraction: share of requests with an invalid constraint (400 expected).
        disconnect_fraction: share of streaming requests whose client hangs up mid-stream.
        stream_fraction: share of the valid requests that stream.
        seed: seeds the request mix and each request's sampling.
        request_timeout_s: longest wait for one response.
        startup_timeout_s: longest wait for the server's first healthy /health.
        rss_growth_limit: largest accepted VmRSS growth, first quarter to last quarter.
        check_rss: judge the RSS growth (a very short run has no steady state to judge).
        sample_interval_s: time between two VmRSS samples.
        server_args: extra ``baton serve`` options.

    Raises:
        ValueError: naming the field out of range.
    """

    requests: int = 2000
    concurrency: int = 64
    max_tokens: int = 32
    time_limit_s: float = 900.0
    model: str | None = None
    tiny: bool = False
    invalid_fraction: float = 0.1
    disconnect_fraction: float = 0.1
    stream_fraction: float = 0.5
    seed: int = 0
    request_timeout_s: float = 120.0
    startup_timeout_s: float = 300.0
    rss_growth_limit: float = 0.10
    check_rss: bool = True
    sample_interval_s: float = 0.25
    server_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("requests", "concurrency", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in (
            "time_limit_s",
            "request_timeout_s",
            "startup_timeout_s",
            "rss_growth_limit",
            "sample_interval_s",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        for name in ("invalid_fraction", "disconnect_fraction", "stream_fraction"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {v!r}")
        if self.invalid_fraction + self.disconnect_fraction > 1.0:
            raise ValueError(
                "invalid_fraction + disconnect_fraction must be <= 1, got "
                f"{self.invalid_fraction} + {self.disconnect_fraction}"
            )
        if self.tiny and self.model is not None:
            raise ValueError("give either model or tiny, not both")


# ---------------------------------------------------------------- requests
@dataclass(frozen=True)
class SoakRequest:
    """One planned request: where it goes, its body and what its answer must satisfy.

    ``check`` holds the constraint to verify on a stopped output ("schema", "regex" or
    "choices"); ``disconnect_after`` is the number of SSE events a disconnecting client
    reads before hanging up (0 for the others).
    """

    index: int
    kind: str
    path: str
    body: dict[str, Any]
    check: dict[str, Any]
    disconnect_after: int = 0

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def person_schema(variant: int) -> dict[str, Any]:
    """A small bounded object schema; ``variant`` changes one bound (a different grammar)."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 1 + variant % 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "ok", "color"],
        "additionalProperties": False,
    }


def code_regex(variant: int) -> str:
    """A short anchored pattern; ``variant`` changes its repeat count."""
    return rf"[0-9]{{{1 + variant % 4}}}-[a-z]{{2}}"


def color_choices(variant: int) -> list[str]:
    """A few choices, one of them depending on ``variant``."""
    return ["red", "green", "blue", f"shade{variant}"]


def plan_requests(config: SoakConfig) -> list[SoakRequest]:
    """The whole request mix, shuffled; deterministic for a given config.

    Exactly ``round(requests * fraction)`` invalid and disconnecting requests; the rest split
    evenly over free text, JSON schema, regex and choice.
    """
    rng = random.Random(config.seed)
    n = config.requests
    n_invalid = round(n * config.invalid_fraction)
    n_disconnect = round(n * config.disconnect_fraction)
    rest = n - n_invalid - n_disconnect
    kinds = (
        ["invalid"] * n_invalid
        + ["disconnect"] * n_disconnect
        + [VALID_KINDS[i % len(VALID_KINDS)] for i in range(rest)]
    )
    rng.shuffle(kinds)
    seen: Counter[str] = Counter()
    plan = []
    for i, kind in enumerate(kinds):
        plan.append(_make_request(i, kind, seen[kind], rng, config))
        seen[kind] += 1
    return plan


def _make_request(
    index: int, kind: str, ordinal: int, rng: random.Random, config: SoakConfig
) -> SoakRequest:
    """Request ``index`` of ``kind``, the ``ordinal``-th of its kind."""
    variant = rng.randrange(16)
    chat = rng.random() < 0.5
    path = CHAT if chat else COMPLETIONS
    body: dict[str, Any] = {
        "max_tokens": config.max_tokens,
        "temperature": 1.0,
        "seed": index,
        "stream": rng.random() < config.stream_fraction,
    }
    check: dict[str, Any] = {}
    disconnect_after = 0
    if kind == "json":
        schema = person_schema(variant)
        check = {"schema": schema}
        if chat:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema},
            }
        else:
            body["structured_outputs"] = {"json": schema}
    elif kind == "regex":
        pattern = code_regex(variant)
        check = {"regex": pattern}
        body["structured_outputs"] = {"regex": pattern}
    elif kind == "choice":
        choices = color_choices(variant)
        check = {"choices": choices}
        body["structured_outputs"] = {"choice": choices}
    elif kind == "invalid":
        path, extra = INVALID_SPECS[ordinal % len(INVALID_SPECS)]
        chat = path == CHAT
        body.update(extra)
    elif kind == "disconnect":
        body.update(
            stream=True,
            ignore_eos=True,
            max_tokens=config.max_tokens * DISCONNECT_TOKEN_FACTOR,
        )
        disconnect_after = rng.randint(1, 4)
    elif kind != "text":
        raise ValueError(f"unknown request kind {kind!r}; expected one of {KINDS}")
    if chat:
        body["messages"] = [{"role": "user", "content": f"Request {index}: describe a person."}]
    else:
        body["prompt"] = f"Request {index}: a person is"
    return SoakRequest(index, kind, path, body, check, disconnect_after)


# ----------------------------------------------------------------- outcomes
@dataclass
class Outcome:
    """What one request got. ``ok`` says whether it met its kind's criterion."""

    index: int
    kind: str
    stream: bool
    status: int  # 0: no HTTP answer (transport error or timeout)
    ok: bool
    finish_reason: str | None = None
    checked: bool = False  # a stopped structured output was verified
    problem: str | None = None
    latency_s: float = 0.0


def verify_output(req: SoakRequest, text: str) -> str | None:
    """Why ``text`` (an output that stopped by itself) breaks ``req``'s constraint, or None."""
    if "schema" in req.check:
        try:
            jsonschema.validate(json.loads(text), req.check["schema"])
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            return f"output is not schema-valid JSON ({type(exc).__name__}): {text[:120]!r}"
    elif "regex" in req.check:
        if re.fullmatch(req.check["regex"], text) is None:
            return f"output {text[:120]!r} does not match {req.check['regex']!r}"
    elif "choices" in req.check and text not in req.check["choices"]:
        return f"output {text[:120]!r} is not one of {req.check['choices']}"
    return None


def _judge(req: SoakRequest, out: Outcome, text: str | None) -> Outcome:
    """Fills ``ok``/``problem`` of a valid request that got a 200."""
    if out.finish_reason not in ("stop", "length"):
        out.problem = f"finish_reason {out.finish_reason!r}"
        return out
    if out.finish_reason == "stop" and req.check and text is not None:
        out.checked = True
        out.problem = verify_output(req, text)
        if out.problem is not None:
            return out
    out.ok = True
    return out


async def send(client: httpx.AsyncClient, req: SoakRequest, timeout_s: float) -> Outcome:
    """Sends one request and judges its answer; never raises for a failed request."""
    t0 = time.perf_counter()
    out = Outcome(req.index, req.kind, req.stream, 0, False)
    try:
        if req.stream:
            await asyncio.wait_for(_send_stream(client, req, out), timeout_s)
        else:
            await asyncio.wait_for(_send_plain(client, req, out), timeout_s)
    except Exception as exc:  # noqa: BLE001 - whatever went wrong is this request's outcome
        out.ok = False
        out.problem = f"{type(exc).__name__}: {exc}"
    out.latency_s = time.perf_counter() - t0
    return out


def _expect_error_status(req: SoakRequest, out: Outcome, body: str) -> None:
    if req.kind == "invalid":
        out.ok = out.status == 400
        if not out.ok:
            out.problem = f"invalid request got HTTP {out.status}, expected 400: {body[:200]}"
    else:
        out.problem = f"HTTP {out.status}: {body[:200]}"


async def _send_plain(client: httpx.AsyncClient, req: SoakRequest, out: Outcome) -> None:
    r = await client.post(req.path, json=req.body)
    out.status = r.status_code
    if r.status_code != 200:
        _expect_error_status(req, out, r.text)
        return
    if req.kind == "invalid":
        out.problem = "invalid request got HTTP 200, expected 400"
        return
    choice = r.json()["choices"][0]
    out.finish_reason = choice.get("finish_reason")
    text = choice["message"]["content"] if req.path == CHAT else choice["text"]
    _judge(req, out, text)


async def _send_stream(client: httpx.AsyncClient, req: SoakRequest, out: Outcome) -> None:
    async with client.stream("POST", req.path, json=req.body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            _expect_error_status(req, out, (await r.aread()).decode(errors="replace"))
            return
        if req.kind == "invalid":
            out.problem = "invalid request got HTTP 200, expected 400"
            return
        parts: list[str] = []
        events = 0
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events += 1
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                out.problem = f"error event: {event['error'].get('message')}"
                return
            for choice in event.get("choices", []):
                if req.path == CHAT:
                    parts.append(choice.get("delta", {}).get("content") or "")
                else:
                    parts.append(choice.get("text") or "")
                if choice.get("finish_reason") is not None:
                    out.finish_reason = choice["finish_reason"]
            if req.disconnect_after and events >= req.disconnect_after:
                # Leaving the block closes the connection mid-stream: that is the test.
                out.ok = True
                return
    if req.kind == "disconnect":
        # It finished before the client could hang up: still a clean answer.
        out.ok = done and out.finish_reason in ("stop", "length")
        if not out.ok:
            out.problem = f"stream ended early (done={done}, finish={out.finish_reason!r})"
        return
    if not done:
        out.problem = "stream ended without [DONE]"
        return
    _judge(req, out, "".join(parts))
