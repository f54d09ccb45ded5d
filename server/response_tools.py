"""Responses API function tools and `tool_choice` in chat completions' form: Responses' tools are
flat (`{"type": "function", "name": ...}`), chat completions' nest the function
(`{"type": "function", "function": {"name": ...}}`); `server.tools` checks the converted form.
"""

from __future__ import annotations

from typing import Any

from server.errors import bad_request

TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


def function_tools(tools: Any) -> Any:
    """Responses' flat function tools in chat completions' form (`parse_tools` checks the rest)."""
    if not isinstance(tools, list):
        return tools
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: only function tools are supported, not {kind!r}", param="tools")
        _check_tool_keys(tool, i)
        converted.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return converted


def _check_tool_keys(tool: dict[str, Any], i: int) -> None:
    unknown = set(tool) - TOOL_KEYS
    if unknown:
        raise bad_request(f"tools[{i}] has unsupported fields: {sorted(unknown)}", param="tools")


def chat_tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"}:
        return {"type": "function", "function": {"name": value["name"]}}
    if isinstance(value, dict):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', param="tool_choice"
        )
    return value
