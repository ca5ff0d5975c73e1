"""Helpers of the OpenAI-compatible server's tests (tests/engine/server/test_server*.py): the
model name, key and request bodies they send, a running server's handle, /metrics samples."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai

from baton.engine.entrypoints.async_llm import AsyncLLM

API_KEY = "test-key"
MODEL = "tiny"

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@dataclass(frozen=True)
class Server:
    base: str
    engine: AsyncLLM

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(api_key=api_key, base_url=f"{self.base}/v1", max_retries=0)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (``labels`` as written, e.g. 'status="x"')."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        if sample == key:
            return float(value)
    raise AssertionError(f"no sample {key} in /metrics")


def get_metrics(server: Server) -> str:
    r = httpx.get(f"{server.base}/metrics", timeout=10)
    assert r.status_code == 200
    return r.text
