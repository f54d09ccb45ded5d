"""Tool calling on chat completions: `tools` and `tool_choice` checked, tools rendered into the
prompt, and the reply's calls parsed into OpenAI's `tool_calls`.

The tool-call format is chosen from the model's chat template (`server.tool_formats` parses them):
- Hermes style (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), the default. A
  template that does not render `tools` itself (SmolLM2-Instruct's, the default model's, has no
  tool support at all) gets the tools and this format described in its system message.
- Llama 3 (templates that know `<|python_tag|>`), Mistral (`[TOOL_CALLS]`), Qwen3-Coder's XML
  (templates that write `<parameter=`) and pythonic calls (`[f(a=1)]`, templates that describe
  `[func_name1(...)]`, as Llama 3.2's and 4's pythonic ones do): the template renders the tools.

`tool_choice` "required" and a named function are enforced with structured output, as vLLM does:
"required" constrains the reply to a JSON array of {"name", "parameters"} objects over the given
tools, a named function to that function's arguments object. "none" neither renders the tools nor
parses calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from jaxserve.structured.spec import GuidedDecoding
from jaxserve.structured.strict import strict_schema
from server.errors import bad_request
from server.partial_json import cut_json_objects, cut_objects
from server.tool_formats import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_TAG,
    PYTHON_TAG,
    XML_FUNCTION,
    PartialCall,
    Schemas,
    ToolCall,
    hermes_calls,
    llama3_calls,
    mistral_calls,
    partial_call,
    pythonic_calls,
    pythonic_partial_calls,
    xml_calls,
    xml_partial_calls,
)

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][\w.-]*\s*\(")  # a reply that is a list of calls
PYTHONIC_PREFIX = re.compile(r"\s*(\[\s*([A-Za-z_][\w.-]*\s*)?)?")  # what may still become one
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "function"
    name: str | None = None  # the function, for mode "function"


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`tools` as a list of checked {"type": "function", "function": {...}} objects; 400 naming
    the tool and field otherwise (a parameters schema the grammar library rejects included)."""
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of tools", param="tools")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise bad_request(f'{where} must be an object {{"type": "function", "function": {{...}}}}', param="tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function must be an object", param="tools")
        if set(function) - FUNCTION_FIELDS:
            raise bad_request(
                f"{where}.function has unsupported fields: {sorted(set(function) - FUNCTION_FIELDS)}", param="tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'", param="tools")
        if name in names:
            raise bad_request(f"{where}.function.name {name!r} is given twice", param="tools")
        names.add(name)
        if "description" in function and not isinstance(function["description"], str):
            raise bad_request(f"{where}.function.description must be a string", param="tools")
        if "strict" in function and not isinstance(function["strict"], bool):
            raise bad_request(f"{where}.function.strict must be a boolean", param="tools")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object", param="tools")
        try:
            GuidedDecoding("json", parameters)
        except ValueError as e:
            raise bad_request(f"{where}.function.parameters: {e}", param="tools") from None
        checked.append({"type": "function", "function": {**function, "parameters": parameters}})
    return checked


def parse_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> ToolChoice:
    """`tool_choice` (default "auto" with tools, "none" without); 400 when it names no given tool."""
    value = body.get("tool_choice", "auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise bad_request('tool_choice "required" needs tools', param="tool_choice")
        return ToolChoice(value if tools else "none")
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
        return ToolChoice("function", name)
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def forced_constraint(
    tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool, strict: bool = True
) -> GuidedDecoding | None:
    """The structured-output constraint that enforces "required" or a named function. With
    `strict` (the server's default), a function's parameters hold only the properties they list
    unless they allow more (`strict_schema`); a function's own `strict: false` opts out."""
    functions = {t["function"]["name"]: parameters_schema(t["function"], strict) for t in tools}
    if choice.mode == "function":
        return GuidedDecoding("json", functions[choice.name])
    if choice.mode != "required":
        return None
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, parameters in functions.items()
        ]
    }
    return GuidedDecoding(
        "json", {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    )


def parameters_schema(function: dict[str, Any], strict: bool = True) -> Any:
    """A function's parameters as its calls are constrained: strict unless it or the server says not."""
    parameters = function.get("parameters", EMPTY_PARAMETERS)
    return strict_schema(parameters) if function.get("strict", strict) else parameters


class ToolFormat:
    """How one chat template shows tools to the model and how the model writes its calls: "hermes",
    "llama3", "mistral", "qwen3_coder" or "pythonic" (`server.tool_formats`). Mistral's tag is a special token, so
    a reply that starts with `[{` is taken as calls too. `tools` (the request's) type the values of
    Qwen3-Coder's XML parameters."""

    def __init__(self, template: str | None, tools: list[dict[str, Any]] | None = None) -> None:
        source = template or ""
        self.kind = "hermes"
        markers = (
            ("pythonic", "func_name1("),
            ("llama3", PYTHON_TAG),
            ("mistral", MISTRAL_TAG),
            ("qwen3_coder", "<parameter="),
        )
        for kind, marker in markers:
            if marker in source:
                self.kind = kind
                break
        self.template_renders_tools = "tools" in source
        self._schemas: Schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools or []}
        self._markers = {"mistral": (MISTRAL_TAG,), "qwen3_coder": (HERMES_OPEN, XML_FUNCTION)}.get(
            self.kind, (HERMES_OPEN,)
        )

    def prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list | None]:
        """The messages and the `tools` variable to render the chat template with (no tools:
        none are shown, but earlier calls and results in the conversation still are)."""
        if self.template_renders_tools:  # templates read a call's arguments as an object, as in transformers
            return [_with_argument_objects(m) for m in messages], tools or None
        messages = [_hermes_message(m) for m in messages]
        if not tools:
            return messages, None
        description = _hermes_system_text(tools)
        if messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + description}] + messages[1:], None
        return [{"role": "system", "content": description}] + messages, None

    @property
    def markers_anywhere(self) -> tuple[str, ...]:
        """The texts that start a call wherever they come in a reply (Llama 3's and pythonic
        calls start only at its start; so can Mistral's `[{`)."""
        return () if self.kind in ("llama3", "pythonic") else self._markers

    @property
    def call_separator(self) -> str | None:
        """The text that opens each call of a reply, where the calls after it parse alone
        (`partial_calls` of the text from there gives those calls); None for formats whose calls
        only parse from the first one."""
        return {"hermes": HERMES_OPEN, "qwen3_coder": XML_FUNCTION}.get(self.kind)

    def call_start(self, text: str) -> int | None:
        """Where the first call starts in a reply's text, if one has."""
        stripped = text.lstrip()
        if self.kind == "llama3":
            return len(text) - len(stripped) if stripped.startswith(("{", PYTHON_TAG)) else None
        if self.kind == "pythonic":
            return len(text) - len(stripped) if PYTHONIC_START.match(stripped) else None
        if self.kind == "mistral" and stripped.startswith("[{"):
            return len(text) - len(stripped)
        found = [at for at in (text.find(m) for m in self._markers) if at >= 0]
        return min(found) if found else None

    def holdback(self, text: str) -> int:
        """Characters at the end of `text` that may still become the start of a call."""
        if self.kind == "llama3":
            return len(text) if not text.strip() or PYTHON_TAG.startswith(text.lstrip()) else 0
        if self.kind == "pythonic":
            return len(text) if PYTHONIC_PREFIX.fullmatch(text) else 0
        if self.kind == "mistral" and text.strip() == "[":
            return len(text)
        for k in range(min(max(len(m) for m in self._markers) - 1, len(text)), 0, -1):
            if any(text.endswith(m[:k]) for m in self._markers):
                return k
        return 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a reply; a reply whose calls do not parse is all content."""
        start = self.call_start(text)
        if start is None:
            return text, []
        if self.kind == "qwen3_coder":
            calls = xml_calls(text[start:], self._schemas)
        elif self.kind == "pythonic":
            calls = pythonic_calls(text[start:])
        else:
            calls = {"llama3": llama3_calls, "mistral": mistral_calls, "hermes": hermes_calls}[self.kind](text[start:])
        if calls is None:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls of `text` (a reply from where its calls start) as far as they are written."""
        if self.kind == "qwen3_coder":
            return xml_partial_calls(text, self._schemas)
        if self.kind == "pythonic":
            return pythonic_partial_calls(text)
        if self.kind == "hermes":
            blocks = [b.split(HERMES_CLOSE, 1)[0] for b in text.split(HERMES_OPEN)[1:]]
            objects = [(cut_objects(b, 0) or [{}])[0] for b in blocks]
        elif self.kind == "llama3":
            objects = cut_objects(text.lstrip().removeprefix(PYTHON_TAG), 0, " \t\r\n;")
        else:
            objects = cut_json_objects(text.replace(MISTRAL_TAG, "", 1))
        return [partial_call(o, "parameters" if self.kind == "llama3" else "arguments") for o in objects]


def parse_forced(text: str, choice: ToolChoice) -> list[ToolCall]:
    """The calls of a reply constrained by `forced_constraint`, whole or cut short (by max_tokens,
    a stop or an abort): a named function's arguments as far as they go; for "required", each call
    whose name is complete, with the text of its parameters as far as it goes (as OpenAI returns a
    call cut by length)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        if choice.mode == "function":
            return [ToolCall(choice.name, text)]
        calls = []
        for item in cut_json_objects(text):
            try:
                name = json.loads(item.get("name", ""))
            except json.JSONDecodeError:
                continue  # its name was cut
            if isinstance(name, str):
                calls.append(ToolCall(name, item.get("parameters", "")))
        return calls
    if choice.mode == "function":
        return [ToolCall(choice.name, json.dumps(value, ensure_ascii=False))]
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


def _hermes_system_text(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        f"You may call these functions:\n<tools>\n{listed}\n</tools>\nTo call one, reply with\n"
        f'{HERMES_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{HERMES_CLOSE}'
    )


def _hermes_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a template without tool support: calls and results written out as text."""
    calls = message.get("tool_calls")
    if calls:
        bodies = [{"name": c["function"]["name"], "arguments": _arguments(c)} for c in calls]
        written = "\n".join(f"{HERMES_OPEN}\n{json.dumps(b, ensure_ascii=False)}\n{HERMES_CLOSE}" for b in bodies)
        text = (message.get("content") or "") + ("\n" if message.get("content") else "") + written
        return {"role": "assistant", "content": text}
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    return message


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["function"]["arguments"])
    except (json.JSONDecodeError, TypeError):
        return call["function"]["arguments"]


@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """A chat request's tool setup, as the response shapes need it."""

    format: ToolFormat
    choice: ToolChoice

    @property
    def forced(self) -> bool:
        return self.choice.mode in ("required", "function")

    def reply(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a finished reply, as OpenAI reports them: a forced
        reply is all calls (cut ones with what they hold); the finish reason is "length" for a reply
        cut by length, "stop" for a named function's call, "tool_calls" for other calls."""
        if self.forced:
            content, calls = None, parse_forced(text, self.choice)
        else:
            content, calls = self.format.parse(text)
        if calls and finish_reason == "stop":
            finish_reason = "stop" if self.choice.mode == "function" else "tool_calls"
        return content, calls, finish_reason

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls of an unfinished reply as far as they are written (a forced reply is all calls)."""
        if self.choice.mode == "function":
            return [(self.choice.name, text)]
        if self.choice.mode == "required":
            return [partial_call(item, "parameters") for item in cut_json_objects(text)]
        start = self.format.call_start(text)
        return [] if start is None else self.format.partial_calls(text[start:])
