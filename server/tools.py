"""Tool calling on chat completions: `tools` and `tool_choice` checked, tools rendered into the
prompt, and the reply's calls parsed into OpenAI's `tool_calls`.

Two tool-call formats, chosen from the model's chat template:
- Hermes style (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), the default. A
  template that does not render `tools` itself (SmolLM2-Instruct's, the default model's, has no
  tool support at all) gets the tools and this format described in its system message.
- Llama 3 (templates that know `<|python_tag|>`): the template renders the tools; a call is a JSON
  object with "name" and "parameters", optionally after `<|python_tag|>`, several joined by ";".

`tool_choice` "required" and a named function are enforced with structured output, as vLLM does:
"required" constrains the reply to a JSON array of {"name", "parameters"} objects over the given
tools, a named function to that function's arguments object. "none" neither renders the tools nor
parses calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxserve.structured.spec import GuidedDecoding
from jaxserve.structured.strict import strict_schema
from server.errors import bad_request
from server.partial_json import complete_string, cut_json_objects, cut_objects

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
PartialCall = tuple[str | None, str]  # (the name once complete, the arguments' text so far)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        call = {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


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
    """How one chat template shows tools to the model and how the model writes its calls:
    "hermes" (`<tool_call>{...}</tool_call>`, also Qwen's), "llama3" (JSON objects, optionally
    after `<|python_tag|>`) or "mistral" (`[TOOL_CALLS]` and a JSON array of calls; the tag is a
    special token, so a reply that starts with `[{` is taken as calls too)."""

    def __init__(self, template: str | None) -> None:
        source = template or ""
        self.kind = "llama3" if PYTHON_TAG in source else "mistral" if MISTRAL_TAG in source else "hermes"
        self.llama3 = self.kind == "llama3"
        self.template_renders_tools = "tools" in source

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

    def call_start(self, text: str) -> int | None:
        """Where the first call starts in a reply's text, if one has."""
        stripped = text.lstrip()
        if self.kind == "llama3":
            return len(text) - len(stripped) if stripped.startswith(("{", PYTHON_TAG)) else None
        if self.kind == "mistral" and stripped.startswith("[{"):
            return len(text) - len(stripped)
        at = text.find(MISTRAL_TAG if self.kind == "mistral" else HERMES_OPEN)
        return None if at < 0 else at

    def holdback(self, text: str) -> int:
        """Characters at the end of `text` that may still become the start of a call."""
        if self.kind == "llama3":
            return len(text) if not text.strip() or PYTHON_TAG.startswith(text.lstrip()) else 0
        if self.kind == "mistral" and text.strip() == "[":
            return len(text)
        marker = MISTRAL_TAG if self.kind == "mistral" else HERMES_OPEN
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                return k
        return 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a reply; a reply whose calls do not parse is all content."""
        start = self.call_start(text)
        if start is None:
            return text, []
        calls = {"llama3": _llama3_calls, "mistral": _mistral_calls, "hermes": _hermes_calls}[self.kind](text[start:])
        if calls is None:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls of `text` (a reply from where its calls start) as far as they are written."""
        if self.kind == "hermes":
            blocks = [b.split(HERMES_CLOSE, 1)[0] for b in text.split(HERMES_OPEN)[1:]]
            objects = [(cut_objects(b, 0) or [{}])[0] for b in blocks]
        elif self.kind == "llama3":
            objects = cut_objects(text.lstrip().removeprefix(PYTHON_TAG), 0, " \t\r\n;")
        else:
            objects = cut_json_objects(text.replace(MISTRAL_TAG, "", 1))
        return [_partial_call(o, "parameters" if self.kind == "llama3" else "arguments") for o in objects]


def _partial_call(item: dict[str, str], arguments_key: str) -> PartialCall:
    name = complete_string(item["name"]) if "name" in item else None
    arguments = item.get(arguments_key, item.get("arguments", item.get("parameters", "")))
    return name, arguments


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


def _hermes_calls(text: str) -> list[ToolCall] | None:
    calls = []
    for block in text.split(HERMES_OPEN)[1:]:
        call = _call(block.split(HERMES_CLOSE, 1)[0], "arguments")
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _mistral_calls(text: str) -> list[ToolCall] | None:
    try:
        value = json.loads(text.strip().removeprefix(MISTRAL_TAG))
    except json.JSONDecodeError:
        return None
    calls = [_call_object(v, "arguments") for v in value] if isinstance(value, list) else [None]
    return None if not calls or None in calls else calls


def _llama3_calls(text: str) -> list[ToolCall] | None:
    text = text.strip().removeprefix(PYTHON_TAG)
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = _call_object(value, "parameters")
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return calls or None


def _call(text: str, arguments_key: str) -> ToolCall | None:
    try:
        return _call_object(json.loads(text), arguments_key)
    except json.JSONDecodeError:
        return None


def _call_object(value: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


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

    def shown(self, text: str) -> int:
        """How much of an unfinished reply may be streamed as content: everything before a call
        (or before what may still become one), less its trailing whitespace (a reply with calls
        drops it); nothing of a forced reply."""
        if self.forced:
            return 0
        start = self.format.call_start(text)
        end = len(text) - self.format.holdback(text) if start is None else start
        return len(text[:end].rstrip())

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls of an unfinished reply as far as they are written (a forced reply is all calls)."""
        if self.choice.mode == "function":
            return [(self.choice.name, text)]
        if self.choice.mode == "required":
            return [_partial_call(item, "parameters") for item in cut_json_objects(text)]
        start = self.format.call_start(text)
        return [] if start is None else self.format.partial_calls(text[start:])
