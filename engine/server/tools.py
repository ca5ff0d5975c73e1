"""Tool calling in chat completions, on the request side: the request's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` checked into a ``ToolPlan``; the constraint that
forces the calls; and the conversation (tools, earlier calls, tool results) prepared for the
chat template.

The model's tool-call syntax is the server's (``ServerState.tool_call_format``: Hermes',
Llama 3's JSON, Mistral's or Qwen3-Coder's XML; ``baton.grammar.tool_formats``). A chat
template that writes tool calls itself (one in which a format shows,
``detect_tool_call_format``) gets the tools as its ``tools`` variable and the messages as they
are; any other template (the default model's has no tool support) gets the tools as a system
message that shows the syntax, earlier calls written into the assistant turns in it, and tool
results as ``<tool_response>`` blocks in a user turn, so that the prompt and the constraint
speak the same syntax.

``tool_choice``: "none" (no call; the tools are still shown), "auto" (text or calls; with a
response format, calls or an answer in that format), "required" (calls only), a named
function (one call of it), or ``allowed_tools`` (auto or required over a subset).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from baton.engine.server.constraints import Constraint
from baton.engine.server.errors import APIError, bad_request
from baton.engine.server.protocol import ChatCompletionRequest
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.structural_tag import spec_format
from baton.grammar.tool_calls import (
    HERMES,
    FunctionTool,
    ToolCallFormat,
    detect_tool_call_format,
    harmony_call_tag,
    tool_call_tag,
)
from baton.grammar.validation import check_schema_value, validate_spec
from baton.grammar.xgrammar.keywords import xgrammar_unenforced_keywords
from baton.grammar.xgrammar.normal_form import xgrammar_normal_form

Mode = Literal["none", "auto", "required"]


@dataclass(frozen=True)
class ToolPlan:
    """What a request allows in tool calls.

    Attributes:
        definitions: the request's function tools, as sent (shown to the model).
        functions: every function, checked.
        callable: the functions a call may name (all, or the named or allowed ones).
        mode: "none", "auto" or "required".
        parallel: several calls allowed in one answer.
        fmt: the tool-call syntax.
        markers: ``fmt``'s markers that are one token of the model's vocabulary, with their
            ids (``ServerState.tool_markers``); forced calls write them as those tokens.
        control_markers: whether one of them is a control token (its text is left out of
            the detokenised answer unless the request keeps special tokens).
    """

    definitions: tuple[dict[str, Any], ...]
    functions: tuple[FunctionTool, ...]
    callable: tuple[FunctionTool, ...]
    mode: Mode
    parallel: bool
    fmt: ToolCallFormat = HERMES
    markers: tuple[tuple[str, int], ...] = ()
    control_markers: bool = False

    @property
    def harmony(self) -> bool:
        """Whether the calls are gpt-oss's harmony messages (parser "openai")."""
        return self.fmt.name == "openai"

    @property
    def forces_special_tokens(self) -> bool:
        """Whether the constraint may write a control token the answer's text must keep for
        the parser to read (harmony's are read from the token ids instead)."""
        return self.control_markers and not self.harmony and self.mode != "none"


def _function(i: int, tool: Any) -> tuple[dict[str, Any], FunctionTool]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise bad_request(f"{where}: only function tools are supported, got {kind!r}", "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where}.function needs a name", "tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    try:
        check_schema_value(params, what=f"{where}.function.parameters")
    except ValueError as exc:
        raise bad_request(str(exc), "tools") from None
    declared = params.get("type") if isinstance(params, dict) else None
    if params is True or (declared is not None and declared != "object"):
        raise bad_request(
            f"{where}.function.parameters must describe an object (the call's arguments)",
            "tools",
        )
    try:
        function = FunctionTool(fn["name"], params)
    except ValueError as exc:
        raise bad_request(f"{where}.function: {exc}", "tools") from None
    return {"type": "function", "function": fn}, function


def _named(choice: Any, where: str) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where} must name a function: {{'function': {{'name': ...}}}}", where)
    return fn["name"]


def _pick(
    functions: Sequence[FunctionTool], names: Sequence[str], where: str
) -> list[FunctionTool]:
    by_name = {f.name: f for f in functions}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise bad_request(f"{where} names functions not in tools: {', '.join(missing)}", where)
    return [by_name[n] for n in dict.fromkeys(names)]


def tool_plan(
    body: ChatCompletionRequest,
    fmt: ToolCallFormat = HERMES,
    markers: tuple[tuple[str, int], ...] = (),
    control_markers: bool = False,
) -> ToolPlan | None:
    """The request's tool plan, its calls in the syntax ``fmt`` (``markers``,
    ``control_markers``: as ``ToolPlan``'s); None when it has no tools.

    Raises:
        APIError: 400 naming the field: a tool that is not a function, a bad name or
            parameters schema, duplicate names, a tool_choice without tools, an unknown
            tool_choice, one naming a function not in tools, or harmony calls ("openai"
            parser) on a vocabulary without harmony's marker tokens.
    """
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    pairs = [_function(i, t) for i, t in enumerate(body.tools)]
    functions = [f for _, f in pairs]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request(f"tools have duplicate function names: {names}", "tools")
    parallel = body.parallel_tool_calls is not False
    mode: Mode
    allowed = functions
    if choice is None or choice in ("none", "auto", "required"):
        mode = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        mode, parallel = "required", False
        allowed = _pick(functions, [_named(choice, "tool_choice")], "tool_choice")
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        spec = choice.get("allowed_tools")
        if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required"):
            raise bad_request(
                "tool_choice.allowed_tools needs mode 'auto' or 'required' and tools",
                "tool_choice",
            )
        mode = spec["mode"]
        listed = spec.get("tools")
        if not isinstance(listed, list) or not listed:
            raise bad_request("tool_choice.allowed_tools.tools must list functions", "tool_choice")
        allowed = _pick(
            functions, [_named(t, "tool_choice") for t in listed], "tool_choice.allowed_tools"
        )
    else:
        raise bad_request(
            f"tool_choice {choice!r} is not supported (use none, auto, required, "
            "a named function or allowed_tools)",
            "tool_choice",
        )
    if mode != "none" and fmt.name == "openai" and len(markers) < len(fmt.markers):
        # Harmony's calls are its special tokens: a grammar can only write them by id.
        raise bad_request(
            "tools with --tool-call-parser openai need harmony's markers as tokens of the "
            "model's vocabulary; use tool_choice 'none'",
            "tool_choice",
        )
    return ToolPlan(
        definitions=tuple(d for d, _ in pairs),
        functions=tuple(functions),
        callable=tuple(allowed),
        mode=mode,
        parallel=parallel,
        fmt=fmt,
        markers=markers,
        control_markers=control_markers,
    )


def tool_constraint(
    plan: ToolPlan,
    answer: Constraint | None,
    backend: str,
    max_reasoning_tokens: int | None = None,
) -> Constraint | None:
    """The constraint of a request with tools: ``answer`` (its own constraint, if any) for
    tool_choice "none"; else a structural tag admitting the calls the plan allows (and, with
    "auto", ``answer``'s format as the alternative to calling), compiled by xgrammar with
    ``answer``'s whitespace options. Harmony's calls or final answer come after a free
    analysis message of at most ``max_reasoning_tokens`` (``harmony_call_tag``).

    Raises:
        APIError: 400 when the request asks for another backend than xgrammar or auto (only
            xgrammar reads structural tags; any tool_choice but "none", harmony's included),
            or its constraint cannot be placed in a tag.
    """
    if plan.mode == "none":
        return answer
    base = answer.spec if answer is not None else None
    chosen = base.backend if base is not None else backend
    if chosen not in ("auto", "xgrammar"):  # harmony's auto calls too: never left unchecked
        raise bad_request(
            f"tool calls need the xgrammar backend (the only one that reads structural "
            f"tags), but {chosen!r} was asked for; use the xgrammar or auto backend, or "
            "tool_choice 'none'",
            "tools",
        )
    answer_format = None
    if plan.mode == "auto" and answer is not None:
        try:
            answer_format = spec_format(answer.spec)
        except ValueError as exc:
            raise bad_request(f"{answer.param}: {exc}", answer.param) from None
    tag = plan_tag(plan, plan.callable, answer_format, max_reasoning_tokens)
    options: dict[str, Any] = {"writes_reasoning": plan.harmony}
    if base is not None:
        options |= {
            "whitespace": base.whitespace,
            "max_whitespace_cnt": base.max_whitespace_cnt,
            "disable_additional_properties": base.disable_additional_properties,
            "open_objects": base.open_objects,
        }
    return Constraint(
        "tools", StructuredOutputsParams(structural_tag=tag, backend="xgrammar", **options)
    )


def plan_tag(
    plan: ToolPlan,
    functions: Sequence[FunctionTool],
    answer: dict[str, Any] | None = None,
    max_reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """The structural tag of the plan's calls of ``functions`` in its syntax (``answer``:
    auto's alternative format), the markers as their tokens."""
    markers = dict(plan.markers)
    if plan.harmony:
        return harmony_call_tag(
            functions,
            markers,
            mode=plan.mode if plan.mode == "auto" else "required",
            parallel=plan.parallel,
            max_reasoning_tokens=max_reasoning_tokens,
            answer=answer,
        )
    return tool_call_tag(
        functions, plan.mode, parallel=plan.parallel, fmt=plan.fmt, answer=answer, markers=markers
    )


def name_the_tool(error: APIError, plan: ToolPlan | None) -> APIError:
    """``error`` with the function it is about named, when it is the engine's 400 on a tool
    constraint (param "tools") and one function's call alone cannot be built (its schema
    does not compile, or has keywords xgrammar would not enforce); else ``error`` itself.
    Runs only on that error path: the engine checked the whole constraint already."""
    if plan is None or error.status != 400 or error.param != "tools":
        return error
    for i, function in enumerate(plan.functions):
        tag = plan_tag(plan, [function])
        try:
            validate_spec(StructuredOutputsParams(structural_tag=tag, backend="xgrammar"))
            failing = bool(xgrammar_unenforced_keywords(xgrammar_normal_form(function.parameters)))
        except (ValueError, RecursionError):
            failing = True
        if failing:
            message = f"tools[{i}] (function {function.name!r}): {error.message}"
            return APIError(400, message, param="tools", code=error.code)
    return error


# ----------------------------------------------------------------------- the prompt

_TOOLS_PROMPT = """# Tools

You may call one or more functions to answer the user.
The functions are described with JSON schemas within <tools></tools> tags:
<tools>
{tools}
</tools>

{how}"""

# How each format's calls look, for the system message (the template shows no tools).
_HOW_TO_CALL = {
    "hermes": """To call a function, write a JSON object with its name and arguments
within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <arguments-json-object>}
</tool_call>""",
    "llama3_json": """To call a function, write only a JSON object with its name and
parameters: {"name": <function-name>, "parameters": <arguments-json-object>}
(several calls separated by "; ").""",
    "mistral": """To call functions, write [TOOL_CALLS] and then a JSON list of calls:
[TOOL_CALLS][{"name": <function-name>, "arguments": <arguments-json-object>}]""",
    "qwen3_coder": """To call a function, write:
<tool_call>
<function=<function-name>>
<parameter=<parameter-name>>
<value>
</parameter>
</function>
</tool_call>""",
    "openai": """To call a function, write a message to it in the commentary channel:
<|start|>assistant<|channel|>commentary to=functions.<function-name> <|constrain|>json\
<|message|><arguments-json-object><|call|>""",
}


def template_writes_tool_calls(chat_template: str | None) -> bool:
    """Whether the chat template renders tools and calls itself (in a syntax baton knows)."""
    return detect_tool_call_format(chat_template) is not None


def _arguments_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise bad_request(f"{where}.function.arguments must be JSON text", "messages")


def _calls_of(message: dict[str, Any], i: int) -> list[tuple[str, str]]:
    calls = []
    for j, call in enumerate(message.get("tool_calls") or []):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where} needs function.name", "messages")
        calls.append((fn["name"], _arguments_text(fn.get("arguments", "{}"), where)))
    return calls


def prepare_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, chat_template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables for the chat template (see the module docs).

    Raises:
        APIError: 400 for a malformed ``tool_calls`` entry.
    """
    if template_writes_tool_calls(chat_template):
        out = []
        for i, m in enumerate(messages):
            if m.get("tool_calls"):
                calls = []
                for name, args in _calls_of(m, i):
                    try:
                        parsed: Any = json.loads(args)
                    except json.JSONDecodeError:
                        parsed = args
                    calls.append(
                        {"type": "function", "function": {"name": name, "arguments": parsed}}
                    )
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out, ({"tools": list(plan.definitions)} if plan is not None else {})
    fmt = plan.fmt if plan is not None else HERMES
    out = []
    after_tool = False  # consecutive tool results share one user turn
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            written = fmt.render_calls(_calls_of(m, i))
            text = "\n".join(([m["content"]] if m.get("content") else []) + [written])
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            block = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
        after_tool = role == "tool"
    if plan is not None:
        listing = "\n".join(json.dumps(d, ensure_ascii=False) for d in plan.definitions)
        prompt = _TOOLS_PROMPT.format(tools=listing, how=_HOW_TO_CALL[fmt.name])
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content', '')}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}
