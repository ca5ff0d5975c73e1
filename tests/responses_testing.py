"""Helpers of the Responses API's tests (tests/engine/server/test_server_responses*.py): the
weather schema, its text format and tool, the question asked, the logprobs ``include``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Weather(BaseModel):
    """The weather to look up."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


SCHEMA = Weather.model_json_schema()
FORMAT = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {**SCHEMA, "additionalProperties": False},
    "strict": True,
}
ASK = "What is the weather in Paris, in celsius?"

LOGPROBS = "message.output_text.logprobs"
