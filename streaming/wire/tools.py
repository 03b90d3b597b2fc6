"""A request's tools and tool choice, checked, in the form Qwen2.5's chat template takes.

OpenAI's `tools` ([{"type": "function", "function": {"name", "description"?, "parameters"?}}])
and `tool_choice` ("auto", "none", "required", {"type": "function", "function": {"name"}}),
with `parallel_tool_calls`; Anthropic's `tools` ([{"name", "description"?, "input_schema"}]) and
`tool_choice` ({"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}).
Both become one `Tools` value, whose `specs` go to `apply_chat_template(tools=...)` as OpenAI's
function form (what the template prints, one JSON line per tool). A failed check raises
InvalidRequest naming the param in each API's own style (`tools[0].function.name`, `tools.0.name`).

`call_arguments` is the way back: OpenAI's assistant messages carry a call's arguments as a JSON
string, and the template needs the object (it would print a string quoted, escapes and all).

Leaves out: server tools (Anthropic's web search, bash...), OpenAI's custom and allowed_tools
choices, and holding the model to a choice (the parser, toolcalls.py, reads what it wrote).
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from streaming.wire.errors import InvalidRequest

MAX_TOOLS = 128  # per request, as OpenAI allows: each one's schema is prompt text
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a function's name, as both APIs define it


class Tools(NamedTuple):
    specs: list[dict[str, Any]]  # for the chat template; [] for none
    choice: str = "auto"  # "auto" (may call), "none" (must not), "required" (must call one)
    name: str | None = None  # with "required": the one tool to call
    parallel: bool = True  # more than one call in an answer

    @property
    def names(self) -> list[str]:
        return [spec["function"]["name"] for spec in self.specs]


def spec(name: Any, description: Any, parameters: Any, where: str, schema_param: str) -> dict[str, Any]:
    """One tool in the template's form; `where` is the param's prefix ("tools[0].function.")."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequest(f"{where}name must be 1 to 64 letters, digits, _ or -", where + "name")
    function: dict[str, Any] = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise InvalidRequest(f"{where}description must be a string", where + "description")
        function["description"] = description
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise InvalidRequest(f"{where}{schema_param} must be a JSON Schema object", where + schema_param)
        function["parameters"] = parameters
    try:  # the template prints it: it must be JSON, and text a tokenizer takes (no lone surrogates)
        json.dumps(function, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError, RecursionError):
        raise InvalidRequest(f"{where[:-1]} cannot be printed as JSON text", where[:-1]) from None
    return {"type": "function", "function": function}


def tool_list(value: Any, item: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise InvalidRequest(f"tools must be a list of up to {MAX_TOOLS} tools", "tools")
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"{item.format(i)} must be an object", item.format(i))
    return value


def unique(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names = [s["function"]["name"] for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidRequest(f"tool names must be unique: {', '.join(twice)} more than once", "tools")
    return specs


def openai_tools(body: dict[str, Any]) -> Tools:
    """A chat.completions body's tools, tool_choice and parallel_tool_calls."""
    specs = []
    for i, tool in enumerate(tool_list(body.get("tools"), "tools[{}]")):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequest(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', f"tools[{i}]")
        where = f"tools[{i}].function."
        specs.append(
            spec(function.get("name"), function.get("description"), function.get("parameters"), where, "parameters")
        )
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # (null is the default, as OpenAI takes it)
    if not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false", "parallel_tool_calls")
    tools = Tools(unique(specs), parallel=parallel)
    choice = body.get("tool_choice")
    if choice is None:
        return tools._replace(choice="auto" if specs else "none")
    if choice in ("auto", "none"):
        return tools._replace(choice=choice)
    if choice == "required":
        return required(tools, "tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return required(tools, "tool_choice", choice["function"].get("name"), named=True)
    raise InvalidRequest(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def anthropic_tools(body: dict[str, Any]) -> Tools:
    """A messages body's tools and tool_choice."""
    specs = []
    for i, tool in enumerate(tool_list(body.get("tools"), "tools.{}")):
        if tool.get("type") not in (None, "custom"):
            raise InvalidRequest(f"tools.{i}.type: only custom tools are supported", f"tools.{i}.type")
        if not isinstance(tool.get("input_schema"), dict):
            raise InvalidRequest(f"tools.{i}.input_schema: Field required", f"tools.{i}.input_schema")
        specs.append(
            spec(tool.get("name"), tool.get("description"), tool["input_schema"], f"tools.{i}.", "input_schema")
        )
    tools = Tools(unique(specs))
    choice = body.get("tool_choice")
    if choice is None:
        return tools._replace(choice="auto" if specs else "none")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequest('tool_choice.type: must be "auto", "any", "tool" or "none"', "tool_choice.type")
    serial = choice.get("disable_parallel_tool_use", False)
    if not isinstance(serial, bool):
        raise InvalidRequest(
            "tool_choice.disable_parallel_tool_use: must be a boolean", "tool_choice.disable_parallel_tool_use"
        )
    tools = tools._replace(parallel=not serial)
    if kind == "any":
        return required(tools, "tool_choice")
    if kind == "tool":
        return required(tools, "tool_choice.name", choice.get("name"), named=True)
    return tools._replace(choice=kind)


def required(tools: Tools, param: str, name: Any = None, named: bool = False) -> Tools:
    """A choice that requires a call (of the tool `name`, if named): it needs tools, and that one."""
    if not tools.specs:
        raise InvalidRequest("a tool choice that requires a call needs tools", param)
    if named and (not isinstance(name, str) or name not in tools.names):
        raise InvalidRequest(f"the tool choice names no tool of the request: {name!r}", param)
    return tools._replace(choice="required", name=name)


def call_arguments(arguments: Any, param: str) -> dict[str, Any]:
    """An assistant message's call arguments (OpenAI's JSON string, or an object) as the object
    the chat template prints."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            raise InvalidRequest(f"{param} must be a JSON object's text", param) from None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{param} must be a JSON object", param)
    try:  # the template prints it: text a tokenizer takes (no lone surrogates), not too deep
        json.dumps(arguments, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError, RecursionError):
        raise InvalidRequest(f"{param} cannot be printed as JSON text", param) from None
    return arguments


def call_name(name: Any, param: str) -> str:
    """The name of a call in a conversation's history: a tool's name, as both APIs define it."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequest(f"{param} must be 1 to 64 letters, digits, _ or -", param)
    return name
