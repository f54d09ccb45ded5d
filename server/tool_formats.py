"""The tool-call formats models write, parsed whole and as far as they are written.

- "hermes" (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
- "llama3": JSON objects with "name" and "parameters", optionally after `<|python_tag|>`, joined by ";";
- "mistral": `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}` objects;
- "pythonic" (Llama 3.2's and 4's pythonic templates): a Python list of calls with keyword
  arguments, `[get_weather(city="Paris"), get_time(zone="UTC")]`, the whole reply;
- "qwen3_coder" (Qwen3-Coder's XML): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>`, each value text that the function's parameter schema types (a string
  stays text; numbers, booleans, arrays and objects are read as JSON when they parse).

A call's arguments come out as `json.dumps(..., ensure_ascii=False)` writes them; a partial call
is (its name once complete, the JSON text of its arguments so far) for `server.tool_stream`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
from typing import Any

from server.partial_json import complete_string

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
XML_FUNCTION = "<function="
PartialCall = tuple[str | None, str]  # (the name once complete, the arguments' text so far)
Schemas = dict[str, Any]  # function name -> its parameters schema

_XML_NAME = re.compile(r"<function=([^>\n]+)>")
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


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


def partial_call(item: dict[str, str], arguments_key: str) -> PartialCall:
    """A call object read by `partial_json.cut_objects` (its keys and raw value texts)."""
    name = complete_string(item["name"]) if "name" in item else None
    arguments = item.get(arguments_key, item.get("arguments", item.get("parameters", "")))
    return name, arguments


def hermes_calls(text: str) -> list[ToolCall] | None:
    calls = []
    for block in text.split(HERMES_OPEN)[1:]:
        try:
            call = call_object(json.loads(block.split(HERMES_CLOSE, 1)[0]), "arguments")
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def mistral_calls(text: str) -> list[ToolCall] | None:
    try:
        value = json.loads(text.strip().removeprefix(MISTRAL_TAG))
    except json.JSONDecodeError:
        return None
    calls = [call_object(v, "arguments") for v in value] if isinstance(value, list) else [None]
    return None if not calls or None in calls else calls


def llama3_calls(text: str) -> list[ToolCall] | None:
    text = text.strip().removeprefix(PYTHON_TAG)
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = call_object(value, "parameters")
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return calls or None


def call_object(value: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def xml_calls(text: str, schemas: Schemas) -> list[ToolCall] | None:
    """Qwen3-Coder's calls; None unless every `<function=...>` block is closed."""
    blocks = _xml_blocks(text)
    if not blocks or any("</function>" not in b for b in blocks):
        return None
    calls = []
    for block in blocks:
        name, arguments = _xml_call(block, schemas)
        if name is None:
            return None
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def xml_partial_calls(text: str, schemas: Schemas) -> list[PartialCall]:
    """Qwen3-Coder's calls as far as they go: the arguments of the parameters complete so far
    (a value is typed only once its `</parameter>` is written), closed with the function."""
    out = []
    for block in _xml_blocks(text):
        name, arguments = _xml_call(block, schemas)
        written = json.dumps(arguments, ensure_ascii=False)
        out.append((name, written if "</function>" in block else written[:-1]))
    return out


def _xml_blocks(text: str) -> list[str]:
    return [XML_FUNCTION + b.split("</function>", 1)[0] + ("</function>" if "</function>" in b else "")
            for b in text.split(XML_FUNCTION)[1:]]  # fmt: skip


def _xml_call(block: str, schemas: Schemas) -> tuple[str | None, dict[str, Any]]:
    match = _XML_NAME.match(block)
    if match is None:
        return None, {}
    name = match.group(1).strip()
    properties = (schemas.get(name) or {}).get("properties", {})
    arguments = {
        key.strip(): _xml_value(value, properties.get(key.strip()))
        for key, value in _XML_PARAMETER.findall(block, match.end())
    }
    return name, arguments


def _xml_value(text: str, schema: Any) -> Any:
    """A parameter's value: text for a string (or an unknown parameter), else JSON when it parses."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


_PYTHON_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*\(")


def pythonic_calls(text: str) -> list[ToolCall] | None:
    """Calls written as a Python list of calls with keyword arguments (`[f(a=1), g(b="x")]`, the
    format of Llama 3.2's and Llama 4's pythonic templates); None unless all of it is that."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            return None
        if None in arguments:  # `**kwargs`
            return None
        calls.append(ToolCall(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
    return calls


def pythonic_partial_calls(text: str) -> list[PartialCall]:
    """Pythonic calls as far as they go: a call's name once its `(` is written, then its keyword
    arguments one at a time as each is complete (a value is only known whole)."""
    out: list[PartialCall] = []
    at = text.find("[") + 1
    while at > 0:
        match = _PYTHON_NAME.match(text, at)
        if match is None:
            return out
        end, commas = _call_end(text, match.end())
        if end is None:
            done = text[match.start() : commas[-1]] + ")" if commas else match.group(0) + ")"
            whole = pythonic_calls("[" + done + "]")
            return [*out, (match.group(1), whole[0].arguments[:-1] if whole and commas else "")]
        whole = pythonic_calls("[" + text[match.start() : end] + "]")
        out.append((match.group(1), whole[0].arguments if whole else ""))
        at = end + 1 if end < len(text) and text[end] == "," else 0
    return out


def _call_end(text: str, at: int) -> tuple[int | None, list[int]]:
    """(the index after the `)` that closes a call whose arguments start at `at`, None when cut;
    the indexes of the commas between its arguments)."""
    depth, quote, i, commas = 1, None, at, []
    while i < len(text):
        c = text[i]
        if quote is not None:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1, commas
        elif c == "," and depth == 1:
            commas.append(i)
        i += 1
    return None, commas
